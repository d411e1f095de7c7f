"""``data=text``: raw text (.jsonl, .txt, .parquet, a datasets folder) tokenized with a local
tokenizer into a cached token file.

The tokenizers are trained here (``tokenizers``: a word-level one, whose ids a test can compute
by hand) and saved as folders ``AutoTokenizer`` loads; nothing is downloaded. Checked: how
documents are packed (tokenizer(doc) + EOS, concatenated, then the windows of data=tokens), the
cache (reused, rebuilt for changed text or tokenizer, built once by concurrent processes) and
every start-up error, each naming the file and the numbers."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from malleus_ds.app.config import ConfigError
from malleus_ds.data import CORPUS_PATH, DataConfig, build_dataset, make_dataset
from malleus_ds.data import text as text_mod
from malleus_ds.data.text import prepare_text
from malleus_ds.data.tokens import DataError, TokenDataset
from malleus_ds.app.reference import reference_run
from tests.configs import cfg

CONF = Path(__file__).resolve().parents[3] / "conf"
SPECIALS = ["<unk>", "<eos>", "<bos>"]
UNK, EOS, BOS = 0, 1, 2
#: some prose to train tokenizers on and to write documents from
LINES = [ln for ln in CORPUS_PATH.read_text().splitlines() if ln.strip()][:400]


def make_tokenizer(d: Path, texts=LINES, *, kind: str = "word", template: str | None = None,
                   vocab_size: int | None = None) -> Path:
    """Train a tokenizer on ``texts`` and save it as a folder ``AutoTokenizer`` loads
    (tokenizer.json + tokenizer_config.json). ``kind``: "word" (WordLevel on whitespace and
    punctuation: ids computable by hand) or "bpe" (byte-level BPE). ``template``: a post-processor
    (e.g. "<bos> $A": the tokenizer's own call puts BOS first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        kw = {} if vocab_size is None else {"vocab_size": vocab_size}
        trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, **kw)
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size or 300, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<bos>", BOS), ("<eos>", EOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(str(d))
    return d


def word_ids(tok_dir: Path, text: str) -> list[int]:
    """What the word-level tokenizer gives ``text``, computed from its vocabulary by hand."""
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return [vocab.get(w, UNK) for w in re.findall(r"\w+|[^\w\s]+", text)]


def write_jsonl(path: Path, docs, field: str = "text") -> Path:
    with open(path, "w") as f:
        for d in docs:
            f.write((json.dumps({field: d, "meta": 1}) if d is not None else "") + "\n")
    return path


def docs(n: int, per: int = 3, start: int = 0) -> list[str]:
    return ["\n".join(LINES[i:i + per]) for i in range(start, start + n * per, per)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "word")


def text_cfg(path, tokenizer=None, model=None, **data):
    """A run config with data=text (model=tiny with a vocabulary the tokenizers fit in)."""
    d = {"kind": "text", "path": None if path is None else str(path), "seq_len": 16, **data}
    if tokenizer is not None:
        d["tokenizer"] = str(tokenizer)
    return cfg(world=1, data=d, model=model or {"name": "tiny", "vocab_size": 4096})


def _err(pattern, *a, **kw) -> str:
    with pytest.raises(ConfigError, match=pattern) as e:
        text_cfg(*a, **kw)
    return str(e.value)


# --- packing ----------------------------------------------------------------------------------


def test_documents_joined_by_eos_as_computed_by_hand(tmp_path, tok):
    texts = docs(40)
    src = write_jsonl(tmp_path / "c.jsonl", texts[:20] + [None, ""] + texts[20:])  # blank, empty
    c = text_cfg(src, tok)
    want = [i for t in texts for i in word_ids(tok, t) + [EOS]]
    ds = build_dataset(c)
    assert isinstance(ds, TokenDataset) and ds.tokens.dtype == np.uint16
    assert ds.tokens.tolist() == want
    assert c.data.token_file == str(ds.path) and ds.path.suffix == ".npy"
    assert ds.path.parent == tmp_path / "c.jsonl.malleus-tokens" == Path(c.data.cache_dir)
    assert c.data.tokenizer == str(tok) and c.data.text_field == "text"
    # the windows and the order are data=tokens' on the same ids
    np.save(tmp_path / "want.npy", np.asarray(want, np.uint16))
    ref = TokenDataset(tmp_path / "want.npy", 16, seed=c.train.corpus_seed)
    assert np.array_equal(ds.order, ref.order)
    assert all(torch.equal(a, b) for a, b in zip(ds.batch(range(8)), ref.batch(range(8))))
    meta = json.loads(ds.path.with_suffix(".json").read_text())
    assert (meta["documents"], meta["tokens"], meta["prefix"], meta["suffix"]) \
        == (40, len(want), [], [EOS])


def test_a_folder_txt_files_and_the_tokenizers_own_special_tokens(tmp_path, tok):
    """A folder: .jsonl and .txt files, recursive, sorted by relative path, hidden ones skipped;
    a .txt file is one document. A tokenizer that puts BOS first keeps it per document; one that
    ends with EOS itself gets no second EOS."""
    d = tmp_path / "texts"
    (d / "b").mkdir(parents=True)
    (d / ".hidden").mkdir()
    write_jsonl(d / "b" / "2.jsonl", docs(3, start=30))
    (d / "a.txt").write_text("\n".join(LINES[:30]) + "\n\n")
    (d / "c.txt").write_text("")                                   # empty: skipped
    write_jsonl(d / ".hidden" / "x.jsonl", ["never read"])
    write_jsonl(d / ".skip.jsonl", ["never read"])
    (d / "notes.md").write_text("not text data")                   # other suffixes: ignored
    order = [" ".join(LINES[:30])] + docs(3, start=30)
    for template, frame in ((None, ([], [EOS])), ("<bos> $A", ([BOS], [EOS])),
                            ("$A <eos>", ([], [EOS]))):
        t = make_tokenizer(tmp_path / f"tok{len(frame[0])}{template is None}", template=template)
        ds = build_dataset(text_cfg(d, t))
        want = [i for x in order for i in frame[0] + word_ids(t, x) + frame[1]]
        assert ds.tokens.tolist() == want, template
    assert ds.path.parent == tmp_path / "texts.malleus-tokens"


def test_the_text_field_and_a_cache_dir(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", docs(30), field="content")
    c = text_cfg(src, tok, text_field="content", cache_dir=str(tmp_path / "cache"))
    assert Path(c.data.token_file).parent == tmp_path / "cache"
    assert not (tmp_path / "c.jsonl.malleus-tokens").exists()
    assert build_dataset(c).tokens.tolist() == [i for t in docs(30)
                                                for i in word_ids(tok, t) + [EOS]]


def test_the_model_folders_own_tokenizer_and_the_reference(tmp_path):
    """model=hf_local: the tokenizer is the model folder's; make_dataset without the parsed
    token file finds the same cache, so the single-process reference trains on the same data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = tmp_path / "my-llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=32)
                     ).save_pretrained(str(m))
    make_tokenizer(m, kind="bpe", vocab_size=300)
    src = write_jsonl(tmp_path / "c.jsonl", docs(30))
    c = text_cfg(src, model={"name": "hf", "hf_path": str(m)})
    assert c.data.tokenizer == str(m)
    ds = build_dataset(c)
    assert ds.tokens.dtype == np.uint16 and int(ds.tokens.max()) < 300
    plain = DataConfig("text", str(src), seq_len=16)               # tokenizer from the model
    kw = dict(seed=0, steps=2, global_batch_size=8, micro_batch_size=4)
    assert reference_run(c.model, **kw, data=plain)[0] == reference_run(c.model, **kw,
                                                                         data=c.data)[0]
    assert make_dataset(plain, c.model, seed=c.train.corpus_seed).path == ds.path


# --- the cache --------------------------------------------------------------------------------


def test_the_cache_is_reused_and_rebuilt_for_changed_text_or_tokenizer(tmp_path, monkeypatch):
    t = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "c.jsonl", docs(30))
    first = Path(text_cfg(src, t).data.token_file)
    stamp = first.stat().st_mtime_ns
    built = []
    real = text_mod.tokenize
    monkeypatch.setattr(text_mod, "tokenize", lambda *a, **k: built.append(1) or real(*a, **k))
    loads = []
    real_load = text_mod.load_tokenizer
    monkeypatch.setattr(text_mod, "load_tokenizer",
                        lambda *a: loads.append(1) or real_load(*a))
    again = text_cfg(src, t)
    assert Path(again.data.token_file) == first and first.stat().st_mtime_ns == stamp
    assert built == [] and loads == []             # found by its key: no tokenizer even loaded
    write_jsonl(src, docs(31))                     # changed text: another key, a new build
    changed = Path(text_cfg(src, t).data.token_file)
    assert changed != first and built == [1] and first.is_file()
    assert len(np.load(changed)) > len(np.load(first))
    make_tokenizer(t, template="<bos> $A")         # changed tokenizer (same folder, same text)
    retok = Path(text_cfg(src, t).data.token_file)
    assert retok not in (first, changed) and built == [1, 1]
    assert np.load(retok)[0] == BOS
    assert text_cfg(src, t).data.token_file == str(retok) and built == [1, 1]
    names = sorted(p.name for p in first.parent.iterdir())
    assert [n for n in names if n.endswith(".npy")] == sorted(
        p.name for p in (first, changed, retok))
    assert not [n for n in names if ".tmp" in n]


def _race(src, tok_dir, cache, start, out):
    """One of two processes building the same cache at once (slowed, so they overlap)."""
    real = text_mod.tokenize

    def slow(*a, **k):
        time.sleep(0.5)
        return real(*a, **k)

    text_mod.tokenize = slow
    start.wait()
    tt = prepare_text(src, text_field="text", tokenizer=tok_dir, tokenizer_src="t",
                      cache_dir=cache, vocab_size=4096, progress=False)
    out.put((os.getpid(), tt.built, str(tt.path), np.load(tt.path).tolist()))


def test_concurrent_builders_make_one_cache(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", docs(60))
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(src, tok, tmp_path / "cache", start, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(b for _, b, _, _ in got) == [False, True]       # one built, one waited
    assert got[0][2] == got[1][2] and got[0][3] == got[1][3]
    assert got[0][3] == [i for t in docs(60) for i in word_ids(tok, t) + [EOS]]
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    key = Path(got[0][2]).stem
    assert files == [f"{key}.json", f"{key}.lock", f"{key}.npy"]


def test_a_failed_or_killed_build_leaves_nothing_a_reader_would_use(tmp_path):
    """The cache alone (token_cache.py): a build that dies leaves no entry, only its lock; a
    dead builder's temporary files go when the next build starts; a DataError is recorded."""
    from malleus_ds.data import token_cache as tc

    folder, dt = tmp_path / "cache", np.dtype(np.uint16)

    def crash(f):
        f.write(np.arange(10, dtype=dt).tobytes())
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        tc.get_or_build(folder, "k1", dt, crash, what="w")
    assert sorted(p.name for p in folder.iterdir()) == ["k1.lock"]
    assert tc.lookup(folder, "k1") is None
    (folder / ".k1.raw.tmp99999").write_bytes(b"half")             # a killed builder's files
    (folder / ".k1.npy.tmp99999").write_bytes(b"half")

    def ok(f):
        f.write(np.arange(10, dtype=dt).tobytes())
        return {"tokens": 10}

    e = tc.get_or_build(folder, "k1", dt, ok, what="w")
    assert e.built and np.load(e.path).tolist() == list(range(10)) and e.meta["dtype"] == "uint16"
    assert sorted(p.name for p in folder.iterdir()) == ["k1.json", "k1.lock", "k1.npy"]
    assert not tc.get_or_build(folder, "k1", dt, crash, what="w").built    # found, not rebuilt

    def bad(f):
        raise DataError("data.path='x': line 2 is bad")

    for _ in range(2):                                             # recorded: same message
        with pytest.raises(DataError, match="line 2 is bad"):
            tc.get_or_build(folder, "k2", dt, bad if _ == 0 else crash, what="w")
    blocked = tmp_path / "file"
    blocked.write_text("")                                         # a folder that cannot be made
    with pytest.raises(DataError, match=re.escape(
            f"w: cannot write the token cache in {blocked / 'c'} (")) as ei:
        tc.get_or_build(blocked / "c", "k3", dt, ok, what="w")
    assert "set data.cache_dir=DIR to a writable folder" in str(ei.value)


# --- bad input: a start-up error naming the file and the numbers -----------------------------


def test_a_missing_text_field_names_the_file_and_line(tmp_path, tok, monkeypatch):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps({"body": "x", "id": 3}) + "\n")
    msg = _err(re.escape(f"data.path='{src}': line 3 has no field 'text' (its fields: "
                         f"['body', 'id']); set data.text_field=NAME"), src, tok)
    # recorded: the next process fails with the same message without reading the text again
    monkeypatch.setattr(text_mod, "tokenize", lambda *a, **k: pytest.fail("re-read"))
    assert _err("line 3 has no field 'text'", src, tok) == msg
    assert [p.suffix for p in (tmp_path / "c.jsonl.malleus-tokens").glob("*.error")] == [".error"]
    monkeypatch.undo()
    d = tmp_path / "folder"
    d.mkdir()
    write_jsonl(d / "a.jsonl", docs(30))
    (d / "b.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + "{not json\n")
    _err(re.escape(f"data.path='{d}': b.jsonl line 2 is not valid JSON"), d, tok)
    (d / "b.jsonl").write_text(json.dumps(["text"]) + "\n")
    _err(r"b.jsonl line 1 is a JSON list, not an object with a 'text' field", d, tok)
    (d / "b.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    _err(r"b.jsonl line 1: field 'text' holds a int, not a string", d, tok)
    (d / "b.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    _err(r"b.jsonl line 1 is not UTF-8 text", d, tok)


def test_an_empty_corpus(tmp_path, tok):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    _err(re.escape(f"data.path='{empty}': no text to train on: 1 file(s), all empty"), empty, tok)
    blank = write_jsonl(tmp_path / "b.jsonl", ["", None, ""])
    _err(re.escape(f"data.path='{blank}': no text to train on: 1 file(s), "
                   f"{blank.stat().st_size} bytes, 0 non-empty documents"), blank, tok)
    d = tmp_path / "d"
    d.mkdir()
    (d / "x.md").write_text("hello")
    _err(re.escape(f"data.path='{d}' is a folder without .jsonl, .txt, .parquet files"), d, tok)
    _err(re.escape(f"data.path='{tmp_path / 'nope.jsonl'}': no such file or folder"),
         tmp_path / "nope.jsonl", tok)


def test_a_tokenizer_larger_than_the_model_vocabulary(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", docs(30))
    n = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    msg = _err(re.escape(f"data.tokenizer={tok}: the tokenizer has {n} tokens (len(tokenizer), "
                         f"added tokens included) but model.vocab_size=256"), src, tok,
               model={"name": "tiny"})
    assert f"vocab_size >= {n}" in msg
    text_cfg(src, tok, model={"name": "tiny", "vocab_size": n})    # fits exactly: fine
    # a cached build is checked too (its record keeps the vocabulary)
    _err(rf"the tokenizer has {n} tokens", src, tok, model={"name": "tiny", "vocab_size": n - 1})


def test_no_tokenizer(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", docs(30))
    _err(re.escape("data=text needs a tokenizer: model=tiny brings none (only model=hf_local "
                   "model.hf_path=DIR uses its folder's tokenizer); set data.tokenizer=DIR"), src)
    _err(r"model=tiny-qwen2 brings none", src, model={"name": "hf", "hf_config": "tiny-qwen2"})
    _err(re.escape(f"data.tokenizer={tmp_path / 'none'}: no such folder"), src, tmp_path / "none")
    (tmp_path / "empty").mkdir()
    _err(re.escape(f"data.tokenizer={tmp_path / 'empty'}: no tokenizer files there"), src,
         tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")
    _err(re.escape(f"data.tokenizer={broken}: cannot load the tokenizer"), src, broken)
    no_eos = make_tokenizer(tmp_path / "no-eos")
    conf = json.loads((no_eos / "tokenizer_config.json").read_text())
    conf.pop("eos_token")
    (no_eos / "tokenizer_config.json").write_text(json.dumps(conf))
    _err(r"the tokenizer has no eos_token, and data=text joins documents with it", src, no_eos)


def test_a_corpus_shorter_than_one_global_batch(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", ["one two three four five"] * 4)   # 4 x 6 tokens
    # 24 tokens, seq_len 16: windows of 17 every 8 -> 1 window; 8 need 7 * 8 + 17 = 73 tokens
    _err(re.escape(f"data.path='{src}': 4 document(s) in 1 file(s) give 24 tokens: 1 windows of "
                   f"seq_len+1=17 tokens (one every 8 tokens), fewer than one global batch "
                   f"(train.global_batch_size=8); it needs >= 73 tokens"), src, tok)
    assert len(build_dataset(text_cfg(src, tok, seq_len=2))) >= 8


def test_other_settings_and_formats(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", docs(30))
    _err(r"data.dtype='uint16' is set but data=text picks the dtype", src, tok, dtype="uint16")
    _err(r"data.text_field='' must be a non-empty string", src, tok, text_field="")
    _err(r"data=text needs data.path=FILE\|DIR", None, tok)
    csv = tmp_path / "t.csv"
    csv.write_text("text\nhello\n")
    msg = _err(r"data=text reads \.jsonl, \.txt, \.parquet files or a folder of them .* got "
               r"suffix '\.csv'; convert", csv, tok)
    assert "to_json('train.jsonl')" in msg
    d = tmp_path / "folder"
    (d / "saved").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", docs(30))
    (d / "saved" / "data-00000-of-00001.arrow").write_bytes(b"")
    _err(r"holds 1 file\(s\) data=text does not read \(saved/data-00000-of-00001.arrow\); .* a "
         r"datasets folder is read when data.path points at it", d, tok)
    _err(r"an \.arrow file is read as a shard of a datasets folder",
         d / "saved" / "data-00000-of-00001.arrow", tok)
    with pytest.raises(ConfigError, match=re.escape(
            "data has unknown fields ['tokenizer']; allowed: ['kind', 'path', 'dtype', "
            "'seq_len'] (data.tokenizer: data=text only)")):
        cfg(data={"kind": "tokens", "path": "x.bin", "tokenizer": str(tok)})


# --- tables: parquet files and datasets folders (pyarrow) ------------------------------------


def _tokens(path, tok_dir, tmp_path, field="text") -> list[int]:
    tt = prepare_text(path, text_field=field, tokenizer=tok_dir, tokenizer_src="t",
                      cache_dir=tmp_path / "cache", vocab_size=4096, progress=False)
    return np.load(tt.path).tolist()


def test_parquet_files_one_document_per_row(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = docs(40)
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.table({"id": list(range(25)), "body": texts[:24] + [""]}), d / "a.parquet",
                   row_group_size=7)                                  # several row groups
    write_jsonl(d / "b.jsonl", texts[24:], field="body")
    c = text_cfg(d, tok, text_field="body")
    assert build_dataset(c).tokens.tolist() == [i for t in texts for i in word_ids(tok, t) + [EOS]]
    f = d / "a.parquet"
    _err(re.escape(f"data.path='{f}': has no column 'text' (its columns: ['id', 'body']); set "
                   f"data.text_field=NAME"), f, tok)
    _err(re.escape(f"data.path='{f}': column 'id' holds int64, not strings"), f, tok,
         text_field="id")
    pq.write_table(pa.table({"text": ["fine", None]}), f)
    _err(re.escape(f"data.path='{f}': row 2: column 'text' is null"), f, tok)
    f.write_bytes(b"PAR1 not really")
    _err(re.escape(f"data.path='{f}': is not a readable parquet file"), f, tok)


#: ``datasets.Dataset.from_dict({"text": [...4 rows, one empty], "id": [...]})
#: .save_to_disk(DIR, num_shards=2)``, written by datasets 5.2.0 (not needed at run time)
SAVED = Path(__file__).resolve().parents[2] / "fixtures" / "hf_saved"


def test_a_datasets_save_to_disk_folder(tmp_path, tok, monkeypatch):
    rows = ["The first document.", "A second one, with more words!", "the fourth and last"]
    assert _tokens(SAVED, tok, tmp_path) == [i for t in rows for i in word_ids(tok, t) + [EOS]]
    assert not SAVED.with_name("hf_saved.malleus-tokens").exists()
    with pytest.raises(DataError, match=r"data-00000-of-00002.arrow has no column 'body' \(its "
                                        r"columns: \['text', 'id'\]\)"):
        _tokens(SAVED, tok, tmp_path, field="body")
    dd = tmp_path / "dict"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=re.escape(
            f"data.path='{dd}' is a datasets DatasetDict (splits ['train', 'test']); point "
            f"data.path at one split's folder, e.g. {dd / 'train'}")):
        _tokens(dd, tok, tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)      # pyarrow not installed
    with pytest.raises(DataError, match=r"reading \.parquet files and datasets folders needs "
                                        r"pyarrow, which is not installed: pip install pyarrow"):
        _tokens(SAVED, tok, tmp_path)


def test_hydra_group_and_the_checkpoint_record(tmp_path, tok, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.runners.resume import data_record

    write_jsonl(tmp_path / "c.jsonl", docs(30))
    monkeypatch.chdir(tmp_path)                                    # relative paths: the CWD's
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        d = OmegaConf.to_container(compose(config_name="config", overrides=[
            "data=text", "data.path=c.jsonl", f"data.tokenizer={tok}", "data.seq_len=16",
            "model.vocab_size=4096"]), resolve=True)
    assert d["data"] == {"kind": "text", "path": "c.jsonl", "dtype": None, "seq_len": 16,
                         "text_field": "text", "tokenizer": str(tok), "cache_dir": None}
    rc = build_run_config(d, world_size=2, ds_search_dirs=(CONF / "deepspeed",))
    assert rc.data.path == str(tmp_path / "c.jsonl")
    rec = data_record(rc)
    assert rec == {"kind": "text", "path": str(tmp_path / "c.jsonl"), "dtype": "uint16",
                   "tokens": len(np.load(rc.data.token_file)), "seq_len": 16,
                   "tokenizer": str(tok), "text_key": Path(rc.data.token_file).stem}
    write_jsonl(tmp_path / "c.jsonl", docs(30, start=1))           # same name, other text
    again = build_run_config(d, world_size=2, ds_search_dirs=(CONF / "deepspeed",))
    assert data_record(again)["text_key"] != rec["text_key"]
