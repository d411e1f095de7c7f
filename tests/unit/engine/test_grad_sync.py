"""The buckets are the fp32 gradient accumulators (engine/grad_sync.py), without processes.

For random plans (pipelines of different depths, TP 1/2/4 side by side) and every rank: adding
each micro-batch's gradients straight into the buckets gives, bit for bit, the buffers the old
two-copy path built (sum per parameter, then ``flatten(mask=True)``); ``read``/``write`` round
trip a parameter's windows; a non-contributing piece stays zero; and nothing but the buckets
holds fp32 gradient memory.
"""
from __future__ import annotations

import random

import pytest
import torch

from malleus_ds.engine.grad_sync import GradSync
from malleus_ds.views import flatten
from malleus_ds.layout import build_buckets, local_shards
from malleus_ds.models.llama import model_config, param_table
from malleus_ds.plan import Plan
from tests.cases import random_plan


class _NoGroups:
    def get(self, ranks):
        return None




def _table():
    cfg = model_config("tiny")
    return cfg, param_table(cfg)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulating_into_buckets_equals_sum_then_flatten(seed, dtype):
    rng = random.Random(seed)
    cfg, table = _table()
    world = rng.choice([4, 6, 8])
    plan = Plan.from_json(random_plan(rng, world, L=cfg.num_layers))
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for rank in range(world):
        shards = local_shards(plan, table, rank)
        if not shards:
            continue
        buckets = build_buckets(plan, table, rank)
        gs = GradSync(buckets, _NoGroups(), rank=rank,
                      shapes={n: torch.Size(sh.shape) for n, sh in shards.items()})
        gs.zero_()
        summed = {n: torch.zeros(sh.shape) for n, sh in shards.items()}
        for _ in range(3):                                   # three micro-batches
            grads = {n: torch.randn(sh.shape, generator=gen).to(dtype)
                     for n, sh in shards.items() if rng.random() < 0.9}
            for n, g in grads.items():
                summed[n] += g.float()
            gs.accumulate(grads)
        for b, flat in zip(buckets, gs.flats):
            want = flatten(b, summed, mask=True)
            assert torch.equal(flat, want), (rank, b.ranks)
        for n in shards:                                     # read/write round trip
            t = gs.read(n)
            contributing = [e for b in buckets for e in b.entries()
                            if e[0].name == n and e[0].contribute]
            if not contributing:
                assert not t.any()                           # a non-zero TP rank's copy
                continue
            before = [f.clone() for f in gs.flats]
            gs.write(n, t * 2)
            gs.write(n, t)
            assert all(torch.equal(x, y) for x, y in zip(before, gs.flats))
        checked += 1
    assert checked


def test_the_buckets_are_the_only_fp32_gradient_memory():
    cfg, table = _table()
    plan = Plan.from_json(random_plan(random.Random(3), 4, L=cfg.num_layers))
    rank = plan.all_ranks[0]
    shards = local_shards(plan, table, rank)
    buckets = build_buckets(plan, table, rank)
    gs = GradSync(buckets, _NoGroups(), rank=rank,
                  shapes={n: torch.Size(sh.shape) for n, sh in shards.items()})
    elements = sum(b.flat_size for b in buckets)
    assert gs.nbytes == 0               # nothing before the first step (a switch builds it)
    gs.zero_()
    assert gs.nbytes == 4 * elements
    assert elements < 1.3 * sum(torch.Size(sh.shape).numel() for sh in shards.values())
    gs.free()
    assert gs.nbytes == 0 and gs.flats == []
