"""Live plan switches keep the math (DESIGN.md §6): one engine object trains on plan A, switches
in place (``engine.switch_plan``) through TP sizes, stage counts, layer ranges, micro-batches and
a suspended rank, and its per-step losses, final parameters and Adam states equal one
single-process run. Each switch is also checked to move state exactly: the whole model's
parameters (fp32 masters) and Adam moments, gathered just before and just after, are identical.

Every 4-rank case here (the switch sequence under ZeRO 1, 0 and 2, identical and micro-batch-only
switches, a bucket that splits and merges, bf16, the first random sequence, a failed transfer)
runs in one ``run_distributed`` call (:func:`_results`: the ranks are built once); the tests
compare its results. That 50 live switches grow neither groups nor memory is checked in
test_group_lifetime.py, whose 4 ranks make 50 switches already."""
import functools
import random

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.cases import (CFG, EPS, check, ds_config, plan_json, random_plan,
                                           tp_slice)
from tests.cases import HETERO
from tests.integration.test_malleus_replan import gather_full_state

#: the shared run (nine switch cases on 4 ranks) takes 20 s or more on 2 cores
pytestmark = pytest.mark.slow

B = plan_json([(3, [([2, 0], (0, 3)), ([1], (3, 4))]), (5, [([3], (0, 4))])])
C = plan_json([(8, [([0, 1, 2, 3], (0, 4))])])                       # one TP4 stage
D = plan_json([(4, [([0], (0, 2)), ([1], (2, 4))]), (4, [([2], (0, 1)), ([3], (1, 4))])])
E = plan_json([(5, [([0, 1], (0, 4))]), (3, [([3], (0, 4))])], suspended=[2])
SEQ = [(2, B), (4, C), (6, E), (8, D)]
STEPS = 10


def _full_equal(a: dict, b: dict) -> float:
    """Max abs difference between two gathered full states (same keys required)."""
    worst = 0.0
    for k in ("params", "exp_avg", "exp_avg_sq"):
        assert set(a[k]) == set(b[k]), k
        for n in a[k]:
            worst = max(worst, float((a[k][n] - b[k][n]).abs().max()))
    return worst


def _switching(rank, world, start, seq, cfg, steps, exact):
    import malleus_ds
    from malleus_ds.plan import Plan

    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(start))
    losses, reports, diffs = [], [], []
    for step in range(steps):
        for k, pj in seq:
            if k == step:
                before = gather_full_state(eng, world)[0] if exact else None
                reports.append(eng.switch_plan(Plan.from_json(pj)))
                if exact:
                    diffs.append(_full_equal(before, gather_full_state(eng, world)[0]))
        losses.append(eng.train_batch())
    st = eng.local_state()
    shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
    adam = {n: (st["exp_avg"][n].numpy(), st["exp_avg_sq"][n].numpy()) for n in st["exp_avg"]}
    return (losses, shards), reports, diffs, adam


@functools.lru_cache(maxsize=None)
def _adam_reference(steps):
    """The single-process reference's Adam moments after ``steps`` steps, by name."""
    from malleus_ds.app.reference import OptimConfig, reference_run

    ref = {}
    reference_run(CFG, seed=0, steps=steps, global_batch_size=8, micro_batch_size=1,
                  optim=OptimConfig(lr=1e-3, eps=EPS), adam_out=ref)
    return ref


def _check_adam(results, steps, rtol=1e-4):
    ref = _adam_reference(steps)
    for rank, (_lt, _rep, _d, adam) in enumerate(results):
        shards = _lt[1]
        for n, (m, v) in adam.items():
            _arr, dim, tr, ts = shards[n]
            for got, key in ((m, "exp_avg"), (v, "exp_avg_sq")):
                full = tp_slice(ref[n][key].numpy(), dim, tr, ts)
                err = np.abs(got - full).max() / max(np.abs(full).max(), 1e-30)
                assert err <= rtol, f"rank {rank} {key} {n}: rel err {err:.1e}"


def _seq_config(zero):
    cfg = ds_config(zero)
    if zero == 2:     # tiny migration buckets: many messages and rounds per switch
        cfg["malleus"] = {"migrate_bucket_mb": 0.05}
    return cfg


@pytest.mark.parametrize("zero", [1, 0, 2])
def test_switch_sequence_equals_reference(zero):
    res = [r["seq"][zero] for r in _results()]
    check(D, [r[0] for r in res], steps=STEPS, eps=EPS)
    _check_adam(res, STEPS)
    reports = res[0][1]
    assert [r.step for r in reports] == [k for k, _ in SEQ]
    for r in res:     # every rank reports the same (reduced) numbers
        assert [x.event() for x in r[1]] == [x.event() for x in reports]
    assert all(x.bytes == x.lower_bound > 0 for x in reports)
    assert all(d == 0.0 for r in res for d in r[2]), [r[2] for r in res]
    # some messages travel from / into their place (no staging), and the state is still exact
    assert sum(x.direct_ends for x in reports) > 0, reports
    if zero == 2:
        assert min(x.rounds for x in reports) > 1 and max(x.peak_extra_bytes for x in reports)


def _identity(rank, world, pj):
    import malleus_ds
    from malleus_ds.plan import Plan

    cfg = dict(ds_config(1), scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}})
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(pj))
    eng.train_batch()
    eng.train_batch()
    before = (eng.lr_scheduler.state_dict(), eng.optimizer.param_groups[0]["lr"])
    rep = eng.switch_plan(Plan.from_json(B))            # LR schedule carries over
    after = (eng.lr_scheduler.state_dict(), eng.optimizer.param_groups[0]["lr"])
    assert rep.bytes > 0 and before == after, (before, after)
    eng.train_batch()
    assert eng.optimizer.param_groups[0]["lr"] > before[1]      # still warming up
    eng.switch_plan(Plan.from_json(pj))
    same = eng.switch_plan(Plan.from_json(pj))
    other_mb = dict(pj, pipelines=[dict(p) for p in pj["pipelines"]])
    other_mb["pipelines"][0]["micro_batches"] += 1
    other_mb["pipelines"][1]["micro_batches"] -= 1
    mb = eng.switch_plan(Plan.from_json(other_mb))
    return same.bytes, mb.bytes, eng.train_batch()


def test_identical_and_micro_batch_only_switches_move_nothing():
    res = [r["identity"] for r in _results()]
    assert all(r[:2] == (0, 0) for r in res), res


# ---------------------------------------------------------------------- kept in place

# rank 1's bucket (embedding, layers 0-4, head; holders {1, 3}) splits into {1, 2} for the
# embedding and layers 0-2 and {1, 3} for layers 2-4 and the head, then merges back
SPLIT_A = plan_json([(4, [([1], (0, 4))]), (4, [([3], (0, 4))])], suspended=[0, 2])
SPLIT_B = plan_json([(4, [([1], (0, 4))]), (4, [([2], (0, 2)), ([3], (2, 4))])], suspended=[0])


def _split(rank, world, cfg):
    import malleus_ds
    from malleus_ds.plan import Plan

    def storages(eng):
        opt = eng.runtime.optimizer
        return {t.untyped_storage().data_ptr() for m in opt.masters if m is not None
                for t in (m, opt.optimizer.state[m]["exp_avg"], opt.optimizer.state[m]["exp_avg_sq"])}

    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(SPLIT_A))
    losses, kept, diffs = [], [], []
    for step in range(6):
        if step in (2, 4):
            before, full = storages(eng), gather_full_state(eng, world)[0]
            eng.switch_plan(Plan.from_json(SPLIT_B if step == 2 else SPLIT_A))
            diffs.append(_full_equal(full, gather_full_state(eng, world)[0]))
            kept.append(storages(eng) <= before)
        losses.append(eng.train_batch())
    return losses, kept, diffs


@pytest.mark.parametrize("zero", [1, 2])
def test_a_bucket_that_splits_and_merges_keeps_its_memory(zero):
    """Rank 1 holds the same optimizer elements under both plans, only regrouped: its masters
    and moments stay in the memory they were in (views), nothing is copied, the math holds."""
    from malleus_ds.app.reference import OptimConfig, reference_run

    res = [r["split"][zero] for r in _results()]
    ref = reference_run(CFG, seed=0, steps=6, global_batch_size=8, micro_batch_size=1,
                        optim=OptimConfig(lr=1e-3, eps=EPS))[0]
    for losses, kept, diffs in res:
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        assert diffs == [0.0, 0.0], diffs
    assert res[1][1] == [True, True], res[1][1]
    assert not res[2][1][0] and not res[3][1][0]    # they do take new memory (and copy)


# ---------------------------------------------------------------------- bf16


def _bf16(rank, world):
    import torch

    import malleus_ds
    from malleus_ds.plan import Plan
    from tests.integration.test_malleus_precision import mp_config

    eng, *_ = malleus_ds.initialize(model=CFG, config=mp_config(1, bf16={"enabled": True}),
                                    plan=Plan.from_json(HETERO))
    losses, diffs, casts = [], [], []
    for step in range(6):
        if step in (2, 4):
            before = gather_full_state(eng, world)[0]
            eng.switch_plan(Plan.from_json(B if step == 2 else C))
            diffs.append(_full_equal(before, gather_full_state(eng, world)[0]))
            st = eng.local_state()            # fp32 masters: the live bf16 params are their casts
            lp = eng.local_params()           # the same masters, without the moments
            assert all(torch.equal(lp[n], st["params"][n]) for n in st["params"]) and lp.keys() \
                == st["params"].keys()
            casts.append(max((float((p.detach().float() - st["params"][n].to(torch.bfloat16)
                                     .float()).abs().max()) for n, p in eng.named.items()),
                             default=0.0))
            assert all(p.dtype == torch.bfloat16 for p in eng.named.values())
        losses.append(eng.train_batch())
    return losses, diffs, casts


def test_bf16_switches_move_masters_exactly():
    from tests.integration.test_malleus_precision import LOSS_RTOL_BF16, reference

    res = [r["bf16"] for r in _results()]
    ref_losses = reference("bf16", 6)[0]
    for losses, diffs, casts in res:
        assert diffs == [0.0, 0.0] and casts == [0.0, 0.0], (diffs, casts)
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL_BF16)


# ---------------------------------------------------------------------- random sequences


def _random_case(seed: int, world: int):
    rng = random.Random(seed)
    plans = [random_plan(rng, world, G=8) for _ in range(4)]
    steps = sorted(rng.sample(range(1, 6), 3))
    return plans[0], list(zip(steps, plans[1:])), rng.randint(0, 2)


@pytest.mark.parametrize("world,seed", [(4, 1), (5, 2), (6, 3)])
def test_random_plan_sequences(world, seed):
    start, seq, zero = _random_case(seed, world)
    if world == 4:    # in the shared 4-rank run
        res = [r["random"] for r in _results()]
    else:
        res = run_distributed(_switching, world, start, seq, ds_config(zero), 6, False,
                              timeout=300)
    check(seq[-1][1], [r[0] for r in res], steps=6, eps=EPS)
    _check_adam(res, 6)


# ---------------------------------------------------------------------- faults


def _fault(rank, world, bad):
    import malleus_ds
    import malleus_ds.migrate.transport as transport
    from malleus_ds.plan import Plan

    cfg = dict(ds_config(1), malleus={"migrate_timeout_s": 3})
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(HETERO))
    eng.train_batch()
    before = {n: p.detach().clone() for n, p in eng.named.items()}
    saved = transport.before_round
    if rank == bad:
        def boom(r, t):
            raise OSError("injected: NIC went away")
        transport.before_round = boom
    try:
        return failed_switch(eng, Plan.from_json(C), before)
    finally:
        transport.before_round = saved


def failed_switch(eng, plan, before) -> tuple[str, float, bool, bool]:
    """Switch ``eng`` to ``plan`` expecting a MigrationError: (its message, seconds until it,
    whether the engine then refuses to train, whether the parameters still equal ``before``);
    ("no error", 0.0, False, False) if the switch succeeded."""
    import time

    from malleus_ds.migrate.transport import MigrationError

    t0 = time.perf_counter()
    try:
        eng.switch_plan(plan)
        return "no error", 0.0, False, False
    except MigrationError as e:
        msg = str(e)
    took = time.perf_counter() - t0
    try:
        eng.train_batch()
        refused = False
    except MigrationError:
        refused = True
    kept = all((p.detach() == before[n]).all() for n, p in eng.named.items())
    return msg, took, refused, kept


def test_a_failed_transfer_stops_every_rank_with_a_message():
    res = [r["fault"] for r in _results()]
    for rank, (msg, took, refused, kept) in enumerate(res):
        assert "before step 1" in msg, (rank, msg)
        assert ("injected" in msg) if rank == 1 else ("rank 1" in msg), (rank, msg)
        assert took < 20, took
        assert refused, f"rank {rank} trained after a failed switch"
        assert kept, f"rank {rank}: the old plan's parameters were modified"


# ---------------------------------------------------------------------- the shared run


def _all(rank, world):
    """Every 4-rank case of this file, one after the other in the same ranks (the failed
    transfer last: it leaves its engine refusing to train)."""
    start, seq, zero = _random_case(1, world)
    return {
        "seq": {z: _switching(rank, world, HETERO, SEQ, _seq_config(z), STEPS, z != 0)
                for z in (1, 0, 2)},
        "identity": _identity(rank, world, HETERO),
        "split": {z: _split(rank, world, ds_config(z)) for z in (1, 2)},
        "bf16": _bf16(rank, world),
        "random": _switching(rank, world, start, seq, ds_config(zero), 6, False),
        "fault": _fault(rank, world, 1),
    }


@functools.lru_cache(maxsize=None)
def _results():
    """The shared 4-rank run (paid by the first test that reads it)."""
    return run_distributed(_all, 4, timeout=600)
