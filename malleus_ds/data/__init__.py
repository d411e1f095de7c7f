"""Deterministic byte-level language-modelling data.

Sample ``i`` is the same tensor on every rank and every engine, so any rank can fetch any global
sample id. The global batch of step ``k`` is the fixed list of ids ``[k*G, (k+1)*G)``.
The shipped corpus (``corpus.txt``) is English technical prose: docstrings of the Python
standard library (PSF licence), extracted once and committed; nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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


def global_batch_ids(step: int, global_batch_size: int) -> range:
    """The sample ids of step ``step`` (0-based): the same list whatever the engine or layout."""
    return range(step * global_batch_size, (step + 1) * global_batch_size)
