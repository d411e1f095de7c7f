"""Shared plans and helpers for the MalleusEngine tests: the tiny model, plan JSON builders,
the single-process reference and its check, random valid plans (no test functions here)."""
from __future__ import annotations

import random

import numpy as np

from malleus_ds.models.llama import model_config

CFG = model_config("tiny", max_seq_len=16)      # 4 layers, H=64, 4 heads, FFN 176
STEPS = 10
# Adam's eps: with the usual 1e-8, an element whose summed gradient is ~1e-8 (cancellation
# across micro-batches) gets an update that amplifies fp32 re-ordering noise by lr/eps = 1e5,
# so one element in ~1e5 differs by ~1e-4 although losses agree to 1e-7. 1e-5 keeps the check
# about the engine's math, not about that conditioning (test_default_eps_losses covers 1e-8).
EPS = 1e-5


def plan_json(pipes, G=8, mbs=1, L=4, suspended=()):
    return {"version": 1, "num_layers": L, "global_batch_size": G, "micro_batch_size": mbs,
            "pipelines": [{"micro_batches": m, "stages": [{"ranks": list(r), "layers": list(l)}
                                                          for r, l in st]} for m, st in pipes],
            "suspended": list(suspended)}


def ds_config(zero: int, eps: float = EPS, clip: float = 0.0) -> dict:
    return {"zero_optimization": {"stage": zero}, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": eps}}}


def train_cases(rank, world, cases):
    """Worker: for each (plan_json, zero, steps, eps[, clip]) build an engine, train, return
    (losses, {name: (array, dim, tp_rank, tp_size)})."""
    import malleus_ds
    from malleus_ds.plan import Plan

    out = []
    for pj, zero, steps, eps, *clip in cases:
        eng, *_ = malleus_ds.initialize(model=CFG, config=ds_config(zero, eps, *clip),
                                        plan=Plan.from_json(pj))
        losses = [eng.train_batch() for _ in range(steps)]
        shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
        out.append((losses, shards))
    return out


def tp_slice(full: np.ndarray, dim: int | None, tp_rank: int, tp_size: int) -> np.ndarray:
    """Slice ``tp_rank`` of ``tp_size`` of a full reference tensor along ``dim`` (None: whole),
    i.e. what a rank holding that TP shard must equal."""
    if dim is None:
        return full
    w = full.shape[dim] // tp_size
    return np.take(full, range(tp_rank * w, (tp_rank + 1) * w), axis=dim)


_REF: dict = {}


def reference(G, mbs, steps, eps, clip=0.0):
    from malleus_ds.app.reference import OptimConfig, reference_run

    key = (G, mbs, steps, eps, clip)
    if key not in _REF:
        _REF[key] = reference_run(CFG, seed=0, steps=steps, global_batch_size=G,
                                  micro_batch_size=mbs, optim=OptimConfig(lr=1e-3, eps=eps),
                                  grad_clip=clip)
    return _REF[key]


def check(pj, results, steps=STEPS, eps=EPS, loss_rtol=1e-5, param_rtol=1e-5, clip=0.0):
    """Every rank's losses equal the reference; every held shard equals the reference slice."""
    ref_losses, ref_sd = reference(pj["global_batch_size"], pj["micro_batch_size"], steps, eps,
                                   clip)
    seen = set()
    for rank, (losses, shards) in enumerate(results):
        np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol, err_msg=f"rank {rank} losses")
        for n, (arr, dim, tr, ts) in shards.items():
            full = tp_slice(ref_sd[n].numpy(), dim, tr, ts)
            err = np.abs(arr - full).max() / np.abs(full).max()
            assert err <= param_rtol, f"rank {rank} {n}: max rel err {err:.2e} > {param_rtol}"
            seen.add(n)
    assert seen == set(ref_sd), f"parameters held by no rank: {sorted(set(ref_sd) - seen)}"


def random_plan(rng: random.Random, world: int, L: int = 4, G: int = 12, mbs: int = 1) -> dict:
    """A random valid plan on ``world`` ranks: 0-1 suspended, 1-3 pipelines, 1-L stages each,
    TP sizes from {1, 2, 4}, random layer cuts and micro-batch split."""
    ranks = list(range(world))
    rng.shuffle(ranks)
    suspended = [ranks.pop()] if rng.random() < 0.4 else []
    npipes = rng.randint(1, min(3, len(ranks)))
    sizes = [1] * npipes
    for _ in range(len(ranks) - npipes):
        sizes[rng.randrange(npipes)] += 1
    M = G // mbs
    cuts = sorted(rng.sample(range(1, M), npipes - 1))
    mbs_per = [b - a for a, b in zip([0] + cuts, cuts + [M])]
    pipes = []
    for n, m in zip(sizes, mbs_per):
        while True:                                  # TP groups of 1/2/4 ranks, at most L stages
            groups, left = [], n
            while left:
                g = rng.choice([s for s in (1, 2, 4) if s <= left])
                groups.append(g)
                left -= g
            if len(groups) <= L:
                break
        S = len(groups)
        lc = sorted(rng.sample(range(1, L), S - 1)) if S > 1 else []
        bounds = [0] + lc + [L]
        stages, it = [], iter(ranks[:n])
        ranks = ranks[n:]
        for j, g in enumerate(groups):
            stages.append(([next(it) for _ in range(g)], (bounds[j], bounds[j + 1])))
        pipes.append((m, stages))
    return plan_json(pipes, G=G, mbs=mbs, L=L, suspended=suspended)


# p0: 2 stages (TP1 then TP2), 5 micro-batches; p1: 1 stage TP1, 3 micro-batches.
# Layers 1-3 are held by a TP=2 group in p0 and a TP=1 rank in p1 (finest-shard sync).
HETERO = plan_json([(5, [([0], (0, 1)), ([1, 2], (1, 4))]),
                    (3, [([3], (0, 4))])])
# a suspended rank (2) next to a 2-stage and a 1-stage pipeline, uneven layers
SUSPENDED = plan_json([(6, [([0], (0, 3)), ([1], (3, 4))]),
                       (2, [([3], (0, 4))])], suspended=[2])
