"""Deterministic byte-level language-modelling data.

Sample ``i`` is the same tensor on every rank and every engine, so any rank can fetch any global
sample id. The global batch of step ``k`` is the fixed list of ids ``[k*G, (k+1)*G)``.
The shipped corpus (``corpus.txt``) is English technical prose: docstrings of the Python
standard library (PSF licence), extracted once and committed; nothing is downloaded.

``data=tokens`` trains on a local file of token ids instead (:mod:`malleus_ds.data.tokens`),
``data=text`` on raw text tokenized by the model's own tokenizer into a cached token file
(:mod:`malleus_ds.data.text`), read the same way.
:func:`build_dataset` is the one factory every runner and the reference use.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .tokens import DataError, TokenDataset

if TYPE_CHECKING:
    from ..models import ModelConfig

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


class ByteCorpus:
    """Windows of ``seq_len + 1`` bytes; sample ``i`` -> (input (T,), target (T,)) int64."""

    def __init__(self, seq_len: int, seed: int = 0, path: str | Path | None = None) -> None:
        p = Path(path) if path else CORPUS_PATH
        if not p.is_file():
            raise FileNotFoundError(f"data: corpus file not found: {p}")
        raw = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        if raw.size < 2 * (seq_len + 1):
            raise ValueError(f"data: corpus {p} has {raw.size} bytes, too small for "
                             f"seq_len={seq_len}")
        self.tokens = torch.from_numpy(raw.astype(np.int64))
        self.seq_len = seq_len
        # windows start every seq_len/2 bytes; their order is a fixed seeded permutation
        self.stride = max(1, seq_len // 2)
        n = (raw.size - seq_len - 1) // self.stride + 1
        self.order = np.random.default_rng(seed).permutation(n)

    def __len__(self) -> int:
        return len(self.order)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.order[i % len(self.order)]) * self.stride
        w = self.tokens[start:start + self.seq_len + 1]
        return w[:-1], w[1:]

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack samples ``ids`` -> inputs (B, T), targets (B, T)."""
        xs, ys = zip(*(self.sample(int(i)) for i in ids))
        return torch.stack(xs), torch.stack(ys)


#: ``data.kind`` values (the ``conf/data/`` options)
DATA_KINDS = ("bytes", "tokens", "text")


@dataclass(frozen=True)
class DataConfig:
    """``data.*``: what the run trains on (parsed and checked by ``data.parse.parse_data``).

    ``kind="bytes"``: the shipped byte corpus (:class:`ByteCorpus`). ``kind="tokens"``: the
    token-id file ``path`` (absolute; ``.bin`` of ``dtype`` ids or ``.npy``), see
    :class:`~malleus_ds.data.tokens.TokenDataset`. ``seq_len``: tokens per sample; None =
    ``model.max_seq_len``. ``dtype``: None = uint16 for ``.bin``, the header's for ``.npy``.

    ``kind="text"`` (:mod:`malleus_ds.data.text`): ``path`` is a ``.jsonl``/``.txt``/``.parquet``
    file, a ``datasets`` save_to_disk folder or a folder of such files, ``text_field`` the field
    or column with the text, ``tokenizer`` the
    tokenizer folder (parsed: the model's own folder when not set), ``cache_dir`` where the
    token file is cached (parsed: ``<path>.malleus-tokens``). ``token_file`` is set by the
    parser (the cached ``.npy`` it found or built), never by a user."""

    kind: str = "bytes"
    path: str | None = None
    dtype: str | None = None
    seq_len: int | None = None
    text_field: str | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None
    token_file: str | None = None

    def resolved_seq_len(self, model: "ModelConfig") -> int:
        return model.max_seq_len if self.seq_len is None else self.seq_len


def make_dataset(data: DataConfig, model: "ModelConfig", seed: int):
    """The dataset of ``data`` for ``model``, its sample order seeded by ``seed``."""
    seq_len = data.resolved_seq_len(model)
    if data.kind == "bytes":
        return ByteCorpus(seq_len, seed=seed)
    if data.kind == "tokens":
        if not data.path:
            raise DataError("data=tokens needs data.path=FILE (.bin or .npy of token ids)")
        return TokenDataset(data.path, seq_len, seed=seed, dtype=data.dtype)
    if data.kind == "text":
        return TokenDataset(data.token_file or text_tokens(data, model).path, seq_len, seed=seed)
    raise DataError(f"data.kind={data.kind!r} is not known; choose one of {list(DATA_KINDS)}")


def text_tokens(data: DataConfig, model: "ModelConfig"):
    """``data=text``: the corpus' cached token file (found, or tokenized now) for ``model``
    (:class:`~malleus_ds.data.text.TextTokens`)."""
    from .text import default_cache_dir, prepare_text, tokenizer_dir

    if not data.path:
        raise DataError("data=text needs data.path=FILE|DIR (.jsonl, .txt, .parquet or a folder)")
    tok, src = tokenizer_dir(data.tokenizer, model)
    return prepare_text(data.path, text_field=data.text_field or "text", tokenizer=tok,
                        tokenizer_src=src, cache_dir=data.cache_dir or default_cache_dir(data.path),
                        vocab_size=model.vocab_size)


def build_dataset(cfg):
    """The run's dataset: ``cfg`` is the app's ``RunConfig`` (read for ``cfg.data``,
    ``cfg.model`` and ``train.corpus_seed``, the sample order's seed; not imported here: the
    config imports this package). The same samples on every rank, engine and layout."""
    return make_dataset(cfg.data, cfg.model, cfg.train.corpus_seed)
