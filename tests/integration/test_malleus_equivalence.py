"""MalleusEngine == single-process reference (DESIGN.md §5), on 2-6 CPU gloo ranks.

Per-step losses (rtol 1e-5, 10 steps; 5 for the random plans, whose point is their layouts) and
every rank's final parameter shards (max rel err <= 1e-5 against the matching slice of the
reference) for non-uniform plans. Several plans share one process launch to keep the suite
fast: every 4-rank case (HETERO under ZeRO 0/1/2, the suspended rank, default eps, the 4-rank
random plans, activation checkpointing across a switch) runs in one ``run_distributed`` call
(:func:`_four`), whose results the tests compare.
"""
import functools
import random

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.cases import EPS, HETERO, STEPS, SUSPENDED, check, plan_json, random_plan, train_cases

#: the shared 4-rank run takes 20 s or more on 2 cores
pytestmark = pytest.mark.slow

RANDOM_STEPS = 5          # random plans: what they vary is the layout, not the step count

# 6 ranks: 3-stage TP1 pipeline next to a 2-stage pipeline with a TP2 first stage; mbs=2
SIX = plan_json([(1, [([0], (0, 1)), ([1], (1, 3)), ([2], (3, 4))]),
                 (3, [([3, 4], (0, 2)), ([5], (2, 4))])], G=8, mbs=2)


FOUR = [(HETERO, 0, STEPS, EPS), (HETERO, 1, STEPS, EPS), (HETERO, 2, STEPS, EPS),
        (SUSPENDED, 1, STEPS, EPS), (SUSPENDED, 2, 5, EPS, 0.05), (HETERO, 1, STEPS, 1e-8)]


def test_four_ranks_hetero_zero012_suspended_clipping_default_eps():
    res = [r["cases"] for r in _four()]
    for k, (pj, _zero, steps, eps, *clip) in enumerate(FOUR):
        # Adam's usual eps=1e-8: losses still agree to 1e-5, params to 1e-3 (see EPS)
        check(pj, [r[k] for r in res], steps=steps, eps=eps, clip=(clip or [0.0])[0],
              param_rtol=1e-5 if eps == EPS else 1e-3)


def test_six_ranks_three_vs_two_stages_tp2_and_random_plans():
    rng = random.Random(3)
    cases = [(SIX, 1, STEPS, EPS)] + [(random_plan(rng, 6, G=rng.choice([8, 12])),
                                       rng.choice([0, 1, 2]), RANDOM_STEPS, EPS)
                                      for _ in range(2)]
    res = run_distributed(train_cases, 6, cases, timeout=300)
    for k, (pj, _z, steps, eps) in enumerate(cases):
        # parameters to 2e-5 of the tensor's largest: the reduction order of 6 ranks through
        # Adam's steps measured 1.08e-5 on one of our machines' CPUs (1e-5 on another); a wrong
        # slice or a missed gradient is off by orders of magnitude more
        check(pj, [r[k] for r in res], steps=steps, eps=eps, param_rtol=2e-5)


def _random_cases(world, seed):
    rng = random.Random(seed)
    cases = []
    for _ in range(2):
        pj = random_plan(rng, world, G=rng.choice([8, 12]), mbs=1)
        cases.append((pj, rng.choice([0, 1, 2]), RANDOM_STEPS, EPS))
    return cases


@pytest.mark.parametrize("world,seed", [(4, 1), (5, 2)])
def test_random_valid_plans(world, seed):
    """Property: random valid plans (suspended ranks, 1-3 pipelines, TP 1/2/4, random cuts and
    micro-batch splits), ZeRO 0, 1 or 2, all equal the reference."""
    cases = _random_cases(world, seed)
    if world == 4:    # in the shared 4-rank run
        res = [r["random"] for r in _four()]
    else:
        res = run_distributed(train_cases, world, cases, timeout=300)
    for k, (pj, _z, steps, eps) in enumerate(cases):
        check(pj, [r[k] for r in res], steps=steps, eps=eps)


SWITCH_AT = 5


def _recompute(rank, world):
    """HETERO with activation checkpointing (the ds_config's section, as the app passes it),
    switched live to SUSPENDED at step 5: (losses, shards, decoder layer calls on this rank)."""
    import malleus_ds
    from malleus_ds.plan import Plan
    from tests.cases import CFG, ds_config

    calls = [0]

    def count(eng):             # every stage the engine builds, the switch's too
        for blk in getattr(eng.module, "blocks", {}).values():
            blk.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    cfg = dict(ds_config(1), activation_checkpointing={})
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(HETERO))
    assert eng.settings.recompute
    count(eng)
    losses = []
    for step in range(STEPS):
        if step == SWITCH_AT:
            eng.switch_plan(Plan.from_json(SUSPENDED))
            count(eng)
        losses.append(eng.train_batch())
    shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
    return (losses, shards), calls[0]


def _layer_calls(pj, rank, steps):
    """Decoder layer forwards rank ``rank`` runs under plan ``pj`` in ``steps`` steps."""
    for pipe in pj["pipelines"]:
        for st in pipe["stages"]:
            if rank in st["ranks"]:
                a, b = st["layers"]
                return (b - a) * pipe["micro_batches"] * steps
    return 0


def test_activation_checkpointing_keeps_the_math_across_tp2_and_a_switch():
    """MalleusEngine with recompute (a TP=2 stage, whose recompute repeats its all-reduces in
    the same order on both ranks; a live switch that builds new stages) gives the losses and
    parameters of the plain single-process reference, and every layer runs twice."""
    res = [r["recompute"] for r in _four()]
    check(HETERO, [r[0] for r in res])
    for rank, (_, calls) in enumerate(res):
        plain = _layer_calls(HETERO, rank, SWITCH_AT) + \
            _layer_calls(SUSPENDED, rank, STEPS - SWITCH_AT)
        assert calls == 2 * plain, (rank, calls, plain)


# fp32 ZeRO-0 with clipping that bites: a two-stage pipeline, and two one-stage replicas
PP2 = plan_json([(8, [([0], (0, 2)), ([1], (2, 4))])])
DP2 = plan_json([(4, [([0], (0, 4))]), (4, [([1], (0, 4))])])
CLIP = 0.05


def _first_stage_clipping(rank, world):
    """Losses of three engines: PP2 throughout, PP2 switched to DP2 at ``SWITCH_AT``, DP2."""
    import malleus_ds
    from malleus_ds.plan import Plan
    from tests.cases import CFG, ds_config

    out = []
    for start, after in ((PP2, None), (PP2, DP2), (DP2, None)):
        eng, *_ = malleus_ds.initialize(model=CFG, config=ds_config(0, clip=CLIP),
                                        plan=Plan.from_json(start))
        losses = []
        for step in range(STEPS):
            if after is not None and step == SWITCH_AT:
                eng.switch_plan(Plan.from_json(after))
            losses.append(eng.train_batch())
        out.append(losses)
    return out


def test_fp32_zero0_pipeline_clips_by_the_first_stage_across_a_switch():
    """Stock DeepSpeed's fp32 ZeRO-0 PipelineEngine clips by its first stage's gradient norm
    (``engine/clip_norm.py``; against stock itself: test_third_party_ds_configs.py). The set the
    starting plan gives is kept by a switch to a layout without a pipeline, so re-planning does
    not change the math; an engine that starts without a pipeline clips by the whole norm, the
    one-process reference."""
    from tests.cases import reference

    (kept, switched, dp), _ = run_distributed(_first_stage_clipping, 2, timeout=300)
    ref_losses, _ = reference(8, 1, STEPS, EPS, CLIP)
    np.testing.assert_allclose(switched, kept, rtol=1e-5)
    np.testing.assert_allclose(dp, ref_losses, rtol=1e-5)
    assert np.max(np.abs(np.subtract(kept, ref_losses)) / np.abs(ref_losses)) > 1e-4


def _four_ranks(rank, world, random_cases):
    return {"cases": train_cases(rank, world, FOUR),
            "random": train_cases(rank, world, random_cases),
            "recompute": _recompute(rank, world)}


@functools.lru_cache(maxsize=None)
def _four():
    """The shared 4-rank run (paid by the first test that reads it)."""
    return run_distributed(_four_ranks, 4, _random_cases(4, 1), timeout=600)
