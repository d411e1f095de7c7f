"""Straggler emulation from the ds_config's ``malleus.straggler`` (the engine's own timer, used
when no runner clock is attached): only the scheduled rank sleeps, (rate - 1) x its measured
compute, and only inside the scheduled steps. Sleeps are recorded, not timed. On CPU a sleep is
(rate - 1) x the compute's wall time (so the rank takes rate x as long as its peers on shared
cores too) and is accounted as (rate - 1) x its device time (the wall less waits for a core)."""
from tests.integration.harness import run_distributed
from tests.cases import CFG, ds_config, plan_json

TWO_PIPES = plan_json([(4, [([0], (0, 4))]), (4, [([1], (0, 4))])], G=8)


def _train(rank, world):
    import malleus_ds
    from malleus_ds.plan import Plan

    cfg = ds_config(1)
    cfg["malleus"] = {"straggler": [{"rank": 1, "rate": 3.0, "start_step": 1, "end_step": 2}]}
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(TWO_PIPES))
    slept: list[float] = []
    eng.straggler._sleep = slept.append
    per_step = []
    for _ in range(3):
        n = len(slept)
        eng.train_batch()
        per_step.append((eng.compute_seconds, slept[n:], eng.clock.emulated_s))
    return per_step


def test_only_the_scheduled_rank_sleeps_in_its_steps():
    r0, r1 = run_distributed(_train, 2)
    assert all(s == [] and e == 0 for _, s, e in r0)
    assert r1[0][1] == [] and r1[2][1] == []                 # outside [start_step, end_step)
    compute, sleeps, emulated = r1[1]
    assert len(sleeps) == 8                                  # 4 forwards + 4 backwards
    # compute_seconds includes the emulated part, as a slow GPU would show it: 3x measured, less
    # any wait for a core around each (here instant) sleep, which is left out (exact with
    # scripted time: tests/unit/engine/test_clock_cpu.py)
    assert 0.5 * 2.0 / 3.0 * compute < emulated <= 2.0 / 3.0 * compute * (1 + 1e-6)
    assert sum(sleeps) >= emulated * (1 - 1e-6)              # the wall is at least the device
