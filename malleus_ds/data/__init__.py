"""Deterministic byte-level language-modelling data.

Sample ``i`` is the same tensor on every rank and every engine, so any rank can fetch any global
sample id. The global batch of step ``k`` is the fixed list of ids ``[k*G, (k+1)*G)``.
The shipped corpus (``corpus.txt``) is English technical prose: docstrings of the Python
standard library (PSF licence), extracted once and committed; nothing is downloaded.

``data=tokens`` trains on a local file of token ids instead (:mod:`malleus_ds.data.tokens`).
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
DATA_KINDS = ("bytes", "tokens")


@dataclass(frozen=True)
class DataConfig:
    """``data.*``: what the run trains on (parsed and checked by ``data.parse.parse_data``).

    ``kind="bytes"``: the shipped byte corpus (:class:`ByteCorpus`). ``kind="tokens"``: the
    token-id file ``path`` (absolute; ``.bin`` of ``dtype`` ids or ``.npy``), see
    :class:`~malleus_ds.data.tokens.TokenDataset`. ``seq_len``: tokens per sample; None =
    ``model.max_seq_len``. ``dtype``: None = uint16 for ``.bin``, the header's for ``.npy``."""

    kind: str = "bytes"
    path: str | None = None
    dtype: str | None = None
    seq_len: int | None = None

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
    raise DataError(f"data.kind={data.kind!r} is not known; choose one of {list(DATA_KINDS)}")


def build_dataset(cfg):
    """The run's dataset: ``cfg`` is the app's ``RunConfig`` (read for ``cfg.data``,
    ``cfg.model`` and ``train.corpus_seed``, the sample order's seed; not imported here: the
    config imports this package). The same samples on every rank, engine and layout."""
    return make_dataset(cfg.data, cfg.model, cfg.train.corpus_seed)
