"""``data=tokens``: a local memory-mapped file of token ids (.bin / .npy), its sample order, the
start-up checks (every one a ConfigError from build_run_config naming the field and the numbers),
the default ``data=bytes`` unchanged, and the data recorded in checkpoints."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from malleus_ds.app.config import ConfigError, build_run_config
from malleus_ds.data import CORPUS_PATH, ByteCorpus, DataConfig, build_dataset, make_dataset
from malleus_ds.samples import global_batch_ids
from malleus_ds.data.tokens import (DataError, TokenDataset, check_token_file, num_windows,
                                    tokens_needed)
from malleus_ds.models import model_config
from malleus_ds.app.reference import reference_run
from malleus_ds.app.runners.base import DistEnv
from malleus_ds.app.runners.checkpoint import RUN_FILE, Checkpointer
from malleus_ds.app.runners.resume import resume_point, run_record
from tests.configs import cfg

CONF = Path(__file__).resolve().parents[3] / "conf"


def _bin(path: Path, ids, dtype=np.uint16) -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def _npy(path: Path, ids, dtype=np.uint16) -> Path:
    np.save(path, np.asarray(ids, dtype=dtype))
    return path


def _ids(n: int, vocab: int = 256, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


def _tok(path, **kw) -> dict:
    return {"kind": "tokens", "path": str(path), **kw}


# --- the dataset ----------------------------------------------------------------------------


def test_windows_and_a_fixed_seeded_order(tmp_path):
    ids = _ids(1000)
    f = _bin(tmp_path / "t.bin", ids)
    a, b = TokenDataset(f, 32, seed=3), TokenDataset(f, 32, seed=3)
    n = (1000 - 33) // 16 + 1                            # windows of 33 tokens, one every 16
    assert len(a) == n == num_windows(1000, 32)
    assert sorted(a.order.tolist()) == list(range(n))    # a permutation of the window starts
    assert np.array_equal(a.order, np.random.default_rng(3).permutation(n))
    assert not np.array_equal(a.order, TokenDataset(f, 32, seed=4).order)
    assert isinstance(a.tokens, np.memmap)               # memory-mapped, not read
    for i in (0, 7, n - 1):
        x, y = a.sample(i)
        start = int(a.order[i]) * 16
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (32,)
        assert x.tolist() == ids[start:start + 32].tolist()
        assert y.tolist() == ids[start + 1:start + 33].tolist()   # next-token targets
        assert torch.equal(x, b.sample(i)[0]) and torch.equal(y, b.sample(i)[1])
    assert torch.equal(a.sample(n + 5)[0], a.sample(5)[0])        # later epochs: same order


def test_batches_do_not_depend_on_the_order_of_calls(tmp_path):
    f = _bin(tmp_path / "t.bin", _ids(3000, seed=1))
    a, b = TokenDataset(f, 16, seed=0), TokenDataset(f, 16, seed=0)
    ids = list(global_batch_ids(3, 8))
    xa, ya = a.batch(ids)
    for i in reversed(range(40)):                                 # other calls first on b
        b.sample(i)
    b.batch(list(global_batch_ids(9, 8)))
    xb, yb = b.batch(ids)
    assert xa.shape == (8, 16) and xa.dtype == torch.int64
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.batch(ids[::-1])[0], xa.flip(0))         # per-sample, not per-call
    assert torch.equal(torch.stack([a.sample(i)[0] for i in ids]), xa)


def test_npy_files_uint32_and_the_same_samples_as_bin(tmp_path):
    ids = _ids(700, vocab=70000, seed=2)
    a = TokenDataset(_npy(tmp_path / "t.npy", ids, np.uint32), 24, seed=1)
    b = TokenDataset(_bin(tmp_path / "t.bin", ids, np.uint32), 24, seed=1, dtype="uint32")
    assert a.file.dtype == np.uint32 and a.file.num_tokens == 700 and a.file.npy
    assert isinstance(a.tokens, np.memmap)
    assert torch.equal(a.batch(range(10))[0], b.batch(range(10))[0])
    assert int(a.batch(range(len(a)))[0].max()) >= 65536         # uint32 ids survive
    big = TokenDataset(_npy(tmp_path / "be.npy", ids, ">u4"), 24, seed=1)  # big-endian header
    assert torch.equal(big.batch(range(10))[0], a.batch(range(10))[0])


def test_the_byte_corpus_as_uint16_tokens_is_the_byte_corpus(tmp_path):
    """Same window scheme and seed: a byte file written as token ids gives identical samples
    and identical training (reference_run, the math every engine is checked against)."""
    f = _bin(tmp_path / "corpus.bin", np.frombuffer(CORPUS_PATH.read_bytes(), np.uint8))
    tok, byt = TokenDataset(f, 64, seed=5), ByteCorpus(64, seed=5)
    assert len(tok) == len(byt) and np.array_equal(tok.order, byt.order)
    for step in (0, 3, 250):
        ids = list(global_batch_ids(step, 8))
        assert all(torch.equal(p, q) for p, q in zip(tok.batch(ids), byt.batch(ids)))
    m = model_config("tiny", max_seq_len=16)
    kw = dict(seed=0, steps=2, global_batch_size=4, micro_batch_size=2)
    ref, _ = reference_run(m, **kw)
    got, _ = reference_run(m, **kw, data=DataConfig(kind="tokens", path=str(f)))
    assert got == ref
    short, _ = reference_run(m, **kw, data=DataConfig(kind="tokens", path=str(f), seq_len=8))
    assert short != ref                                           # data.seq_len is honoured


# --- config: the default is unchanged, data=tokens parses ----------------------------------


def test_default_is_the_byte_corpus_as_before():
    c = cfg()
    assert c.data == DataConfig() == DataConfig("bytes", None, None, None)
    for data_seed in (None, 5):
        c = cfg(train={"data_seed": data_seed})
        d, old = build_dataset(c), ByteCorpus(c.model.max_seq_len, seed=c.train.corpus_seed)
        assert type(d) is ByteCorpus and d.seq_len == 64
        assert np.array_equal(d.order, old.order) and torch.equal(d.tokens, old.tokens)
        assert torch.equal(d.batch(range(8))[0], old.batch(range(8))[0])
    assert build_dataset(cfg(data={"seq_len": 32})).seq_len == 32


def _compose(overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config", overrides=overrides),
                                      resolve=True)


def test_hydra_group_data(tmp_path, monkeypatch):
    d = _compose([])
    assert d["data"] == {"kind": "bytes", "path": None, "dtype": None, "seq_len": None}
    assert build_run_config(d, world_size=1, ds_search_dirs=(CONF / "deepspeed",)).data \
        == DataConfig()
    _bin(tmp_path / "train.bin", _ids(2000))
    monkeypatch.chdir(tmp_path)                                   # a relative path: the CWD's
    d = _compose(["data=tokens", "data.path=train.bin", "data.seq_len=32"])
    assert d["data"] == {"kind": "tokens", "path": "train.bin", "dtype": None, "seq_len": 32}
    rc = build_run_config(d, world_size=2, ds_search_dirs=(CONF / "deepspeed",))
    assert rc.data == DataConfig("tokens", str(tmp_path / "train.bin"), None, 32)
    ds = build_dataset(rc)
    assert isinstance(ds, TokenDataset) and ds.seq_len == 32 and ds.file.dtype == np.uint16
    with pytest.raises(ConfigError, match=r"data=tokens needs data.path=FILE"):
        build_run_config(_compose(["data=tokens"]), world_size=1,
                         ds_search_dirs=(CONF / "deepspeed",))


def test_tokens_config_resolves_path_dtype_and_seq_len(tmp_path, monkeypatch):
    _npy(tmp_path / "t.npy", _ids(3000), np.uint32)
    monkeypatch.chdir(tmp_path)
    c = cfg(data=_tok("t.npy"))
    assert c.data == DataConfig("tokens", str(tmp_path / "t.npy"), None, None)
    ds = build_dataset(c)
    assert ds.seq_len == c.model.max_seq_len == 64 and ds.file.dtype == np.uint32
    assert cfg(data=_tok("t.npy", dtype="uint32")).data.dtype == "uint32"
    _bin(tmp_path / "t32.bin", _ids(3000), np.uint32)
    ds = build_dataset(cfg(data=_tok("t32.bin", dtype="uint32", seq_len=16)))
    assert ds.seq_len == 16 and ds.file.num_tokens == 3000
    ds = make_dataset(DataConfig("tokens", str(tmp_path / "t.npy"), seq_len=8),
                      model_config("tiny"), seed=1)
    assert ds.batch([0, 1])[0].shape == (2, 8)


# --- every start-up error, with its message -------------------------------------------------


def _err(tmp_path, data, pattern, **sections):
    with pytest.raises(ConfigError, match=pattern) as e:
        cfg(data=data, **sections)
    return str(e.value)


def test_missing_file_and_suffix(tmp_path):
    p = tmp_path / "nope.bin"
    _err(tmp_path, _tok(p), re.escape(f"data.path='{p}': file not found"))
    _bin(tmp_path / "t.txt", _ids(2000))
    _err(tmp_path, _tok(tmp_path / "t.txt"), r"reads a \.bin file .* or a \.npy file .*got "
                                             r"suffix '\.txt'")


def test_wrong_dtypes(tmp_path):
    f = _bin(tmp_path / "t.bin", _ids(2000))
    _err(tmp_path, _tok(f, dtype="int32"),
         re.escape("data.dtype='int32' must be one of ['uint16', 'uint32']"))
    _err(tmp_path, _tok(f, dtype="uint8"), r"data.dtype='uint8' must be one of")
    fl = _npy(tmp_path / "f.npy", _ids(2000), np.float32)
    _err(tmp_path, _tok(fl), re.escape(f"data.path='{fl}' holds dtype <f4 (float32); "
                                       f"data=tokens needs uint16 or uint32 token ids"))
    i64 = _npy(tmp_path / "i.npy", _ids(2000), np.int64)
    _err(tmp_path, _tok(i64), r"holds dtype <i8 \(int64\)")
    u16 = _npy(tmp_path / "u.npy", _ids(2000), np.uint16)
    _err(tmp_path, _tok(u16, dtype="uint32"),
         re.escape(f"data.dtype=uint32 but data.path='{u16}' holds uint16"))
    two = tmp_path / "two.npy"
    np.save(two, _ids(2000).astype(np.uint16).reshape(40, 50))
    _err(tmp_path, _tok(two), re.escape(f"data.path='{two}' holds an array of shape (40, 50); "
                                        f"data=tokens needs a 1-D array"))
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not numpy at all" * 10)
    _err(tmp_path, _tok(junk), r"is not a readable \.npy file")


def test_size_not_a_multiple_of_the_dtype(tmp_path):
    f = tmp_path / "odd.bin"
    f.write_bytes(np.asarray(_ids(1000), np.uint16).tobytes() + b"\x01")
    _err(tmp_path, _tok(f), re.escape(f"data.path='{f}' has 2001 bytes, not a multiple of 2 "
                                      f"(data.dtype=uint16)"))
    g = _bin(tmp_path / "six.bin", _ids(1001))                    # 2002 bytes: not uint32
    _err(tmp_path, _tok(g, dtype="uint32"), r"has 2002 bytes, not a multiple of 4 "
                                            r"\(data.dtype=uint32\)")
    cut = _npy(tmp_path / "cut.npy", _ids(2000))
    cut.write_bytes(cut.read_bytes()[:-10])
    _err(tmp_path, _tok(cut), r"the header promises 2000 tokens of uint16 \(4000 bytes\) but "
                              r"3990 bytes follow it")


def test_ids_outside_the_vocabulary(tmp_path):
    ids = _ids(2000)
    ids[17], ids[1500], ids[1900] = 300, 999, 999
    f = _bin(tmp_path / "t.bin", ids)
    msg = _err(tmp_path, _tok(f), re.escape(
        f"data.path='{f}': token id 999 (at token index 1500) is >= model.vocab_size=256; "
        f"3 of 2000 tokens are out of range, the first at index 17; set model.vocab_size >= 1000"))
    assert "re-tokenize" in msg
    assert cfg(data=_tok(f), model={"vocab_size": 1000}).model.vocab_size == 1000
    # the scan works chunk by chunk: the same answer whatever the chunk size
    for chunk in (1, 7, 1499, 1500, 1501, 10**6):
        with pytest.raises(DataError, match=r"token id 999 \(at token index 1500\).* 3 of 2000 "
                                            r"tokens .* the first at index 17;"):
            check_token_file(f, None, seq_len=64, vocab_size=256, global_batch_size=8,
                             chunk=chunk)
    tf = check_token_file(f, None, seq_len=64, vocab_size=1000, global_batch_size=8, chunk=7)
    assert tf.num_tokens == 2000


def test_a_file_shorter_than_one_global_batch(tmp_path):
    # seq_len 64: windows of 65 tokens every 32; 8 windows need 7 * 32 + 65 = 289 tokens
    assert tokens_needed(8, 64) == 289 and num_windows(289, 64) == 8 == num_windows(320, 64)
    assert num_windows(288, 64) == 7
    ok = _bin(tmp_path / "ok.bin", _ids(289))
    assert len(build_dataset(cfg(data=_tok(ok)))) == 8
    f = _bin(tmp_path / "t.bin", _ids(288))
    _err(tmp_path, _tok(f), re.escape(
        f"data.path='{f}' holds 288 tokens: 7 windows of seq_len+1=65 tokens (one every 32 "
        f"tokens), fewer than one global batch (train.global_batch_size=8); it needs >= 289 "
        f"tokens"))
    tiny = _bin(tmp_path / "tiny.bin", _ids(40))                  # < seq_len + 1 tokens
    _err(tmp_path, _tok(tiny), r"holds 40 tokens: 0 windows of seq_len\+1=65 tokens .* it needs "
                               r">= 289 tokens")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    _err(tmp_path, _tok(empty), r"holds 0 tokens: 0 windows")
    # a shorter data.seq_len or a smaller global batch fits the same file
    assert build_dataset(cfg(data=_tok(tiny, seq_len=8), train={"global_batch_size": 2}))
    _err(tmp_path, _tok(f), r"train.global_batch_size=16\); it needs >= 545 tokens",
         train={"global_batch_size": 16})
    with pytest.raises(DataError, match=r"holds 40 tokens, fewer than one window of "
                                        r"seq_len\+1=65"):
        TokenDataset(tiny, 64)


def test_seq_len_kind_and_unknown_fields(tmp_path):
    f = _bin(tmp_path / "t.bin", _ids(3000))
    _err(tmp_path, _tok(f, seq_len=65), re.escape(
        "data.seq_len=65 > model.max_seq_len=64: samples cannot be longer than the model's "
        "context"))
    _err(tmp_path, {"seq_len": 65}, r"data.seq_len=65 > model.max_seq_len=64")   # bytes too
    _err(tmp_path, _tok(f, seq_len=0), r"data.seq_len=0 must be >= 1")
    _err(tmp_path, _tok(f, seq_len=2.5), r"data.seq_len=2.5 must be an integer")
    assert cfg(data=_tok(f, seq_len=65), model={"max_seq_len": 128}).data.seq_len == 65
    _err(tmp_path, {"kind": "tokens", "paht": str(f)}, re.escape(
        "data has unknown fields ['paht']; allowed: ['kind', 'path', 'dtype', 'seq_len']"))
    _err(tmp_path, {"kind": "csv"}, r"data.kind='csv' is not known; choose one of "
                                    r"\['bytes', 'tokens', 'text'\]")
    _err(tmp_path, {"kind": "tokens"}, r"data=tokens needs data.path=FILE: a .bin or .npy file "
                                       r"of token ids \(got data.path=None\)")
    _err(tmp_path, {"kind": "bytes", "path": str(f)},
         re.escape(f"data.path='{f}' is set but data=bytes trains on the shipped byte corpus "
                   f"and reads no file; use data=tokens data.path=FILE"))
    _err(tmp_path, {"dtype": "uint16"}, r"data.dtype='uint16' is set but data=bytes")
    _err(tmp_path, [1, 2], r"data must be a mapping")
    with pytest.raises(ConfigError, match=r"unknown top-level fields \['dataset'\] \(did you "
                                          r"mean 'dataset' -> 'data'\?\)"):
        build_run_config({"dataset": {}}, world_size=1)


# --- checkpoints record the data ------------------------------------------------------------


def _save(tmp_path, step=3, **kw):
    c = cfg(checkpoint={"dir": str(tmp_path / "ck")}, **kw)
    Checkpointer(c, DistEnv()).save(step, lambda root, tag, done: None)
    return c


def _resume(tmp_path, **kw):
    return cfg(checkpoint={"dir": str(tmp_path / "ck"), "resume": True},
               train={"steps": 6}, **kw)


def test_checkpoints_record_the_data_and_resume_checks_it(tmp_path):
    f = _bin(tmp_path / "a.bin", _ids(3000))
    g = _bin(tmp_path / "b.bin", _ids(3000, seed=9))
    c = _save(tmp_path, data=_tok(f, seq_len=32))
    rec = json.loads((tmp_path / "ck" / "global_step3" / RUN_FILE).read_text())
    assert rec == run_record(c, 3)
    assert rec["data"] == {"kind": "tokens", "path": str(f), "dtype": "uint16", "tokens": 3000,
                           "seq_len": 32}
    assert resume_point(_resume(tmp_path, data=_tok(f, seq_len=32))).step == 3
    bad = [({"data": {"seq_len": 32}},
            r"was trained on other data \(kind=tokens path=.*a.bin dtype=uint16 tokens=3000 "
            r"seq_len=32\), this run has kind=bytes seq_len=32: kind='tokens' there, 'bytes' "
            r"here; path=.* there, None here"),
           ({"data": _tok(g, seq_len=32)}, r"path='.*a.bin' there, '.*b.bin' here; the data "
                                           r"position of step 3 belongs to the saved data"),
           ({"data": _tok(f)}, r"seq_len=32 there, 64 here")]
    for kw, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            resume_point(_resume(tmp_path, **kw))
    _bin(f, _ids(3100))                                           # the file changed
    with pytest.raises(ConfigError, match=r"tokens=3000 there, 3100 here.*data.path \(the file "
                                          r"unchanged\)"):
        resume_point(_resume(tmp_path, data=_tok(f, seq_len=32)))


def test_byte_checkpoints_and_records_from_before_data(tmp_path):
    c = _save(tmp_path)
    assert run_record(c, 3)["data"] == {"kind": "bytes", "path": None, "dtype": None,
                                        "tokens": None, "seq_len": 64}
    assert resume_point(_resume(tmp_path)).step == 3
    with pytest.raises(ConfigError, match=r"seq_len=64 there, 32 here"):
        resume_point(_resume(tmp_path, data={"seq_len": 32}))
    rf = tmp_path / "ck" / "global_step3" / RUN_FILE
    old = json.loads(rf.read_text())
    del old["data"]                                               # saved before data.* existed
    rf.write_text(json.dumps(old))
    assert resume_point(_resume(tmp_path)).step == 3              # = the byte corpus
    f = _bin(tmp_path / "a.bin", _ids(3000))
    with pytest.raises(ConfigError, match=r"other data \(kind=bytes seq_len=64\), this run has "
                                          r"kind=tokens"):
        resume_point(_resume(tmp_path, data=_tok(f)))
