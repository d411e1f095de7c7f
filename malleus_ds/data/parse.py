"""The ``data.*`` section of a run (conf/data/): plain values in, a checked
:class:`~malleus_ds.data.DataConfig` out.

``config.build_run_config`` calls :func:`parse_data` on every rank before any process group
exists; every refusal is a :class:`~malleus_ds.data.tokens.DataError` naming the field and the
numbers, which the app passes on unchanged.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from . import DATA_KINDS, DataConfig
from .tokens import (DTYPES, SUFFIXES, DataError, check_token_file, num_windows, stride_of,
                     tokens_needed)

if TYPE_CHECKING:
    from ..models import ModelConfig

#: ``data.*`` keys every kind has (conf/data/*.yaml)
KEYS = ("kind", "path", "dtype", "seq_len")
#: ``data=text`` only (conf/data/text.yaml)
TEXT_KEYS = ("text_field", "tokenizer", "cache_dir")


def parse_data(c: Mapping[str, Any], model: "ModelConfig", global_batch_size: int) -> DataConfig:
    """``data.*`` (conf/data/). ``data=tokens``: the file is checked here in full (exists,
    dtype, size, every id < model.vocab_size, long enough for one global batch), so every rank
    fails at start-up with the same message instead of mid-run. ``data=text``: the text is
    tokenized here (once, cached; :func:`_text`) and checked the same way."""
    if not isinstance(c, Mapping):
        raise DataError(f"data must be a mapping with keys {list(KEYS)}, got {c!r}")
    kind = "bytes" if c.get("kind") is None else str(c["kind"])
    if kind not in DATA_KINDS:
        raise DataError(f"data.kind={kind!r} is not known; choose one of {list(DATA_KINDS)} "
                        f"(data=bytes: the shipped byte corpus; data=tokens data.path=FILE; "
                        f"data=text data.path=FILE|DIR)")
    allowed = list(KEYS + TEXT_KEYS) if kind == "text" else list(KEYS)
    unknown = sorted(str(k) for k in set(c) - set(allowed))
    if unknown:
        only = [k for k in unknown if k in TEXT_KEYS]
        raise DataError(f"data has unknown fields {unknown}; allowed: {allowed}"
                        + (f" ({', '.join('data.' + k for k in only)}: data=text only)"
                           if only else ""))
    seq_len = c.get("seq_len")
    if seq_len is not None:
        seq_len = _int(seq_len, "data.seq_len")
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be >= 1 (tokens per sample; null = "
                            f"model.max_seq_len={model.max_seq_len})")
        if seq_len > model.max_seq_len:
            raise DataError(f"data.seq_len={seq_len} > model.max_seq_len={model.max_seq_len}: "
                            f"samples cannot be longer than the model's context; lower "
                            f"data.seq_len or raise model.max_seq_len")
    path, dtype = c.get("path"), c.get("dtype")
    if kind == "bytes":
        for k, v in (("path", path), ("dtype", dtype)):
            if v is not None:
                raise DataError(f"data.{k}={v!r} is set but data=bytes trains on the shipped "
                                f"byte corpus and reads no file; use data=tokens data.path=FILE "
                                f"(a .bin/.npy of token ids; bytes of a text file: "
                                f"np.fromfile(txt, np.uint8).astype(np.uint16).tofile(bin)) "
                                f"or drop data.{k}")
        if model.vocab_size < 256:
            raise DataError(f"data=bytes feeds byte ids 0..255 but model.vocab_size="
                            f"{model.vocab_size} < 256; use a model whose vocabulary covers "
                            f"bytes, or data=tokens data.path=FILE with ids < "
                            f"{model.vocab_size}")
        return DataConfig(kind="bytes", seq_len=seq_len)
    if isinstance(path, int) and not isinstance(path, bool):
        path = str(path)
    if kind == "text":
        return _text(c, model, global_batch_size, seq_len)
    if path is None or not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise DataError(f"data=tokens needs data.path=FILE: a {' or '.join(SUFFIXES)} file of "
                        f"token ids (got data.path={path!r})")
    if dtype is not None and str(dtype) not in DTYPES:
        raise DataError(f"data.dtype={dtype!r} must be one of {list(DTYPES)} (or null: uint16 "
                        f"for .bin, the header's dtype for .npy)")
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    check_token_file(path, None if dtype is None else str(dtype),
                     seq_len=model.max_seq_len if seq_len is None else seq_len,
                     vocab_size=model.vocab_size, global_batch_size=global_batch_size)
    return DataConfig(kind="tokens", path=path, dtype=None if dtype is None else str(dtype),
                      seq_len=seq_len)


def _text(c: Mapping[str, Any], model: "ModelConfig", global_batch_size: int,
          seq_len: int | None) -> DataConfig:
    """``data=text``: resolve the paths (against the CWD) and the tokenizer (``data.tokenizer``
    or the model's folder), tokenize or find the cached tokens, and check that they fill one
    global batch. Runs on every rank; only the first to take the cache's lock tokenizes."""
    from . import text_tokens

    path = c.get("path")
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise DataError(f"data=text needs data.path=FILE|DIR: a .jsonl, .txt or .parquet file, "
                        f"a datasets save_to_disk folder or a folder of such files (got "
                        f"data.path={path!r})")
    if c.get("dtype") is not None:
        raise DataError(f"data.dtype={c['dtype']!r} is set but data=text picks the dtype of its "
                        f"token cache itself (uint16, or uint32 for a vocabulary over 65536); "
                        f"drop data.dtype")
    field = "text" if c.get("text_field") is None else c["text_field"]
    if not isinstance(field, str) or not field:
        raise DataError(f"data.text_field={field!r} must be a non-empty string (the .jsonl "
                        f"field or table column that holds the text)")
    paths = {}
    for k in ("tokenizer", "cache_dir"):
        v = c.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (str, os.PathLike))
                              or not str(v).strip()):
            raise DataError(f"data.{k}={v!r} must be a folder path (or null)")
        paths[k] = None if v is None else _abs(v)
    data = DataConfig(kind="text", path=_abs(path), seq_len=seq_len, text_field=field,
                      tokenizer=paths["tokenizer"], cache_dir=paths["cache_dir"])
    tt = text_tokens(data, model)
    s = model.max_seq_len if seq_len is None else seq_len
    windows = num_windows(tt.num_tokens, s)
    if windows < global_batch_size:
        raise DataError(f"data.path={data.path!r}: {tt.documents} document(s) in {tt.files} "
                        f"file(s) give {tt.num_tokens} tokens: {windows} windows of seq_len+1="
                        f"{s + 1} tokens (one every {stride_of(s)} tokens), fewer than one global "
                        f"batch (train.global_batch_size={global_batch_size}); it needs >= "
                        f"{tokens_needed(global_batch_size, s)} tokens (more text, or a smaller "
                        f"data.seq_len / train.global_batch_size)")
    return replace(data, tokenizer=str(tt.tokenizer), cache_dir=str(tt.path.parent),
                   token_file=str(tt.path))


def _abs(p) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(p)))


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise DataError(f"{where}={v!r} must be an integer")
    return int(v)
