"""The ``data.*`` section of a run (conf/data/): plain values in, a checked
:class:`~malleus_ds.data.DataConfig` out.

``config.build_run_config`` calls :func:`parse_data` on every rank before any process group
exists; every refusal is a :class:`~malleus_ds.data.tokens.DataError` naming the field and the
numbers, which the app passes on unchanged.
"""
from __future__ import annotations

import os
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Mapping

from . import DATA_KINDS, DataConfig
from .tokens import DTYPES, SUFFIXES, DataError, check_token_file

if TYPE_CHECKING:
    from ..models import ModelConfig


def parse_data(c: Mapping[str, Any], model: "ModelConfig", global_batch_size: int) -> DataConfig:
    """``data.*`` (conf/data/). ``data=tokens``: the file is checked here in full (exists,
    dtype, size, every id < model.vocab_size, long enough for one global batch), so every rank
    fails at start-up with the same message instead of mid-run."""
    allowed = [f.name for f in fields(DataConfig)]
    if not isinstance(c, Mapping):
        raise DataError(f"data must be a mapping with keys {allowed}, got {c!r}")
    unknown = sorted(str(k) for k in set(c) - set(allowed))
    if unknown:
        raise DataError(f"data has unknown fields {unknown}; allowed: {allowed}")
    kind = "bytes" if c.get("kind") is None else str(c["kind"])
    if kind not in DATA_KINDS:
        raise DataError(f"data.kind={kind!r} is not known; choose one of {list(DATA_KINDS)} "
                        f"(data=bytes: the shipped byte corpus; data=tokens data.path=FILE)")
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


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise DataError(f"{where}={v!r} must be an integer")
    return int(v)
