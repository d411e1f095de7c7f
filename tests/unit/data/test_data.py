from __future__ import annotations

import torch

from malleus_ds.app.config import build_run_config
from malleus_ds.data import CORPUS_PATH, ByteCorpus
from malleus_ds.samples import global_batch_ids
from malleus_ds.app.runners.common import replica_micro_batches


def test_samples_are_deterministic_and_shifted():
    a, b = ByteCorpus(32, seed=0), ByteCorpus(32, seed=0)
    x, y = a.sample(5)
    assert torch.equal(x, b.sample(5)[0]) and x.shape == (32,)
    assert torch.equal(x[1:], y[:-1])                     # next-byte targets
    assert CORPUS_PATH.stat().st_size > 100_000           # shipped, not downloaded
    xb, yb = a.batch([1, 2, 3])
    assert xb.shape == (3, 32) and xb.dtype == torch.int64


def test_replicas_cover_the_global_batch_once_in_order():
    cfg = build_run_config({"train": {"global_batch_size": 12, "micro_batch_size": 2}},
                           world_size=3)
    for step in (0, 4):
        got = [i for r in range(3) for mb in replica_micro_batches(cfg, step, r, 3) for i in mb]
        assert got == list(global_batch_ids(step, 12))
        assert [len(replica_micro_batches(cfg, step, r, 3)) for r in range(3)] == [2, 2, 2]
