"""The adaptive loop's decisions without processes (control.py, planner/worker.py): settings, the
planning problem of a running job, the cost rule, the planner worker, and the controller driven
by synthetic timings through detection → background re-plan → decision."""
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from malleus_ds.job_layout import JobLayout
from malleus_ds.adaptive.control import Controller
from malleus_ds.adaptive.job import JobSpec
from malleus_ds.adaptive.settings import AdaptiveSettings
from malleus_ds.adaptive.session import Switched
from malleus_ds.steploop import StepSums
from malleus_ds.engine.probe_block import ProbeBlock
from malleus_ds.adaptive.replan import decide, job_problem, memory_model, nominal_shape
from malleus_ds.cost import step_time
from malleus_ds.models.llama import PRESETS, param_table
from malleus_ds.plan import Plan, PlanError, static_plan, validate_plan
from malleus_ds.planner.worker import alternative_plan, answer
from malleus_ds.adaptive.detect import DetectConfig
from malleus_ds.adaptive.work import cost_units


@pytest.mark.parametrize("sec, match", [
    ({"adaptive": "yes"}, r"malleus.adaptive='yes' must be true or false"),
    ({"detect": {"every": 0}}, r"malleus.detect.every=0"),
    ({"detect": {"healthy": 0.9}}, r"malleus.detect.healthy=0.9"),
    ({"detect": {"change": -0.1}}, r"malleus.detect.change=-0.1"),
    ({"detect": {"window": 2.5}}, r"malleus.detect.window=2.5 must be an integer"),
    ({"detect": {"evry": 2}}, r"unknown keys \['evry'\]"),
    ({"horizon_steps": 0}, r"horizon_steps=0 must be an integer >= 1"),
    ({"replan_at": [5, 5]}, r"replan_at\[1\]=5 is not after replan_at\[0\]=5"),
    ({"replan_at": [0]}, r"replan_at\[0\]=0 must be an integer >= 1"),
    ({"replan_at": "5"}, r"replan_at must be a list"),
    ({"planner_time_limit_s": 0}, r"planner_time_limit_s=0"),
    ({"min_improvement": 1.5}, r"min_improvement=1.5"),
])
def test_settings_errors_name_the_field(sec, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveSettings.from_config(sec)


def test_settings_defaults_and_values():
    s = AdaptiveSettings.from_config({})
    assert s.enabled and s.detect == DetectConfig() and s.horizon_steps == 100
    s = AdaptiveSettings.from_config({"adaptive": False, "detect": {"every": 1, "healthy": 1.5},
                                      "replan_at": [3, 9], "tp_slowdown": {"1": 1, "2": 1.9}})
    assert not s.enabled and s.detect.every == 1 and s.detect.healthy == 1.5
    assert s.replan_at == (3, 9) and s.tp_slowdown == {1: 1.0, 2: 1.9}


def test_job_problem_is_a_valid_problem_for_the_running_plan():
    from malleus_ds.cost import validate_for_problem

    for plan, tp in [(static_plan(4, 8, 1, 1, 1, 4), 1), (static_plan(8, 16, 2, 2, 2, 2), 2)]:
        world = sum(len(s.ranks) for p in plan.pipelines for s in p.stages)
        pr = job_problem(plan, JobLayout(world, world, tp), {k: float(k) for k in (1, 2) if tp % k == 0},
                         None)
        assert (pr.tp, pr.pp * pr.dp * pr.tp) == (tp, world)
        validate_for_problem(pr, plan)
    # a non-uniform starting plan: the fewest stages that tile the world
    odd = Plan.from_json({"version": 1, "num_layers": 4, "global_batch_size": 8,
                          "micro_batch_size": 1, "pipelines": [
                              {"micro_batches": 5, "stages": [{"ranks": [0], "layers": [0, 4]}]},
                              {"micro_batches": 3, "stages": [{"ranks": [1], "layers": [0, 1]},
                                                              {"ranks": [2], "layers": [1, 4]}]}],
                          "suspended": [3]})
    assert nominal_shape(odd, 4, 1) == (1, 4)


def test_memory_model_from_real_sizes():
    cfg = PRESETS["70b"]
    m = memory_model(param_table(cfg), cfg, 1, 4096, True, 81920.0)
    # our 70B layer (no GQA): 4h² + 3·h·ffn = 0.97e9 params x 20 bytes (bf16 param, its bf16
    # gradient of one micro-batch, the fp32 gradient buckets, fp32 master, two Adam moments)
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    n = 4 * h * h + 3 * h * f + 2 * h
    assert m.layer_static_mb == pytest.approx(n * 20 / 2**20)
    assert m.layer_grad_mb == pytest.approx(n * 6 / 2**20)       # freed before a switch
    # Megatron's s·b·h·(34 + 5·a·s/h) bytes at 16 bits
    assert m.layer_activation_mb == pytest.approx(4096 * h * (34 + 5 * 64 * 4096 / h) / 2**20)
    assert m.embedding_mb == pytest.approx((cfg.vocab_size + 1) * h * 20 / 2**20)   # + norm
    assert m.budget_mb == pytest.approx(0.9 * 81920)
    fp32 = memory_model(param_table(cfg), cfg, 1, 4096, False, 1.0)   # 4+4+4+4+8, grads 8
    assert fp32.layer_static_mb == pytest.approx(m.layer_static_mb * 24 / 20)
    assert fp32.layer_grad_mb == pytest.approx(n * 8 / 2**20)
    assert memory_model(param_table(cfg), cfg, 1, 4096, True, 1.0,
                        switch_buffer_mb=512).switch_buffer_mb == 512


def _problem(rates=None, cur=None):
    plan = static_plan(4, 8, 1, 1, 1, 4)
    pr = job_problem(plan, JobLayout(4, 4, 1), {1: 1.0}, None)
    return pr.with_rates(rates or {}, current_plan=cur or plan), plan


def test_cost_rule():
    pr, cur = _problem({3: 5.0})
    new = Plan.from_json(answer({"problem": pr.to_json()})["plan"])
    assert new.id != cur.id and step_time(pr, new) < step_time(pr, cur) / 2
    s = 10                                        # horizon_steps
    d = decide(pr, cur, new, "onset", [1, 1, 1, 5], 9, 0.4, 1.0, 10**6, 0.5, s)
    ev = d.line()
    assert d.plan == new.to_json() and ev["adopted"] and ev["to"] == new.id
    assert ev["predicted_step_s"][0] == 1.0          # calibrated on the measured step time
    assert ev["predicted_step_s"][1] == pytest.approx(step_time(pr, new) / step_time(pr, cur),
                                                      abs=1e-3)
    assert set(ev) >= {"event", "step", "trigger", "measured_rates", "from", "to", "planning_s",
                       "predicted_step_s"}
    # the same gain does not repay a migration longer than it
    gain = (1.0 - ev["predicted_step_s"][1]) * 10
    d = decide(pr, cur, new, "onset", [1, 1, 1, 5], 9, 0.4, 1.0, 10**9, gain + 0.1, s)
    assert d.plan is None and not d.adopted and d.to_plan == cur.id
    assert "migration" in d.reason
    # forced always moves; the same plan never does; no step time yet: stay
    assert decide(pr, cur, new, "forced", [1] * 4, 5, 0.1, 1.0, 1, 1e9, s).plan is not None
    assert decide(pr, cur, cur, "change", [1] * 4, 5, 0.1, 1.0, 0, 0.0, s).plan is None
    assert decide(pr, cur, new, "onset", [1] * 4, 5, 0.1, None, 1, 0.0, s).plan is None
    # rates a checkpoint carried: adopted before any step is timed (the planner only answers
    # with a plan min_improvement better), and never the running plan again
    carried = decide(pr, cur, new, "carried", [1, 1, 1, 5], 6, 0.1, None, 1, 0.0, s)
    assert carried.plan is not None and "carried" in carried.reason
    assert decide(pr, cur, cur, "carried", [1, 1, 1, 5], 6, 0.1, None, 1, 0.0, s).plan is None


def test_the_migration_prediction_fits_a_fixed_part_and_a_bandwidth():
    """Switches of 0 B in 11 s and 1 TB in 31 s: 11 s fixed + 1 TB per 20 s, so 2 TB predicts
    51 s (folding the fixed part into the bandwidth predicted 62 s). Before two sizes are
    measured: the fixed part of a switch that moved nothing, the bandwidth of those that moved
    bytes, else ``migrate_gbps``."""
    from types import SimpleNamespace as NS

    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = Controller(JobSpec.of_model(PRESETS["tiny"], plan), AdaptiveSettings(
        enabled=False, migrate_gbps=2.0), plan)
    assert ctl.session.migrate_s_for(4 * 10**9) == pytest.approx(0.05 + 2.0)
    ctl.migrations.append(Switched(0, 11.0))
    assert ctl.session.migrate_s_for(4 * 10**9) == pytest.approx(11.0 + 2.0)
    ctl.migrations.append(Switched(10**12, 31.0))
    assert ctl.session.migrate_s_for(2 * 10**12) == pytest.approx(51.0)
    assert ctl.session.migrate_s_for(0) == pytest.approx(11.0)


def test_worker_forced_gives_another_valid_plan_and_errors_are_answers():
    from malleus_ds.cost import validate_for_problem

    pr, cur = _problem()                          # healthy: the planner keeps the static plan
    a = answer({"problem": pr.to_json(), "forced": True})
    alt = Plan.from_json(a["plan"])
    assert alt.id != cur.id and a["method"] == "forced-alternative"
    validate_for_problem(pr, alt)
    assert alternative_plan(pr, alt).id != alt.id
    assert "error" in answer({"problem": {"version": 1}})
    one = static_plan(1, 1, 1, 1, 1, 1)
    pr1 = job_problem(one, JobLayout(1, 1, 1), {1: 1.0}, None).with_rates({}, current_plan=one)
    with pytest.raises(PlanError, match="no valid plan other than the running one"):
        alternative_plan(pr1, one)


class _FakeEngine(SimpleNamespace):
    """What the app reads off a MalleusEngine to attach the loop (app/loop.py), and what the
    probe block times."""


def _loop(e, settings):
    """The loop for fake engine ``e``, built as the app builds it (app/loop.py; no TP timing)."""
    from malleus_ds.app.loop import job_spec

    return Controller(job_spec(e), settings, e.plan, ProbeBlock(e))


def _engine(plan, rank=0, world=4):
    from malleus_ds.engine.precision import Precision

    cfg = PRESETS["tiny"]
    return _FakeEngine(global_rank=rank, world_size=world, plan=plan, located=plan.locate(rank),
                       settings=SimpleNamespace(migrate_bucket_mb=64.0, recompute=False),
                       job=JobLayout.one_node(world),
                       param_table=param_table(cfg), model_cfg=cfg, seq_len=cfg.max_seq_len,
                       precision=Precision(), zero_stage=1, device="cpu", migrations=[])


def _drive(ctl, plan, rates, steps, rng, base=0.01):
    """Feed ``steps`` steps of synthetic timings (± 10% noise) through slots/observe."""
    from malleus_ds.adaptive.work import cost_units

    units = cost_units(plan, 4, 1, {1: 1.0})
    for k in range(steps):
        comp = units * base * np.asarray(rates) * rng.uniform(0.9, 1.1, 4)
        ready, _ = ctl.contribute(comp[0], 0.0)    # rank 0's flag, as the all-reduce would sum
        ctl.observe(k, StepSums(loss=0.0, overflow=False, ready=ready, compute_s=comp,
                                probe_s=np.full(4, np.nan)))
        ctl.step_done(float(comp.max()) * 1.2)
        yield k


def test_controller_detects_plans_in_the_background_and_decides():
    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = _loop(_engine(plan), AdaptiveSettings(detect=DetectConfig(every=1)))
    rng = np.random.default_rng(0)
    try:
        for _ in _drive(ctl, plan, [1, 1, 1, 1], 30, rng):
            assert ctl.session.pending is None and ctl.session.result is None      # healthy: nothing
        requested = None
        for k in _drive(ctl, plan, [1, 1, 1, 5], 200, rng):
            if ctl.session.pending is not None and requested is None:
                requested = k
                assert ctl.session.pending["trigger"] == "onset"
            if ctl.ready:
                break
            time.sleep(0.02)                   # training goes on while the worker plans
        assert requested is not None and requested <= 5, "detected within the first window"
        ev = ctl.session.result.line()
        assert ev["trigger"] == "onset" and ev["adopted"], ev
        assert ev["measured_rates"][3] == pytest.approx(5.0, rel=0.15)
        new = Plan.from_json(ctl.session.result.plan)
        assert new.locate(3) is None or new.pipelines[new.locate(3)[0]].micro_batches < 2
    finally:
        ctl.close()


def test_running_plan_always_fits_the_memory_model():
    from malleus_ds.adaptive.replan import fit_running_plan
    from malleus_ds.cost import validate_for_problem

    cfg = PRESETS["70b"]
    plan = static_plan(80, 8, 1, 1, 4, 1)
    tight = memory_model(param_table(cfg), cfg, 1, 4096, True, 1000.0)   # "1 GB devices"
    pr = job_problem(plan, JobLayout(4, 4, 1), {1: 1.0}, tight)
    with pytest.raises(PlanError, match="needs .* MB > budget 900 MB"):
        validate_for_problem(pr, plan)
    fitted = fit_running_plan(pr, plan)
    validate_for_problem(fitted, plan)
    assert fit_running_plan(fitted, plan) is fitted


class _WallClock:
    """The engine's clock as the probe reads it: ``compute_s`` grows by the wall time of each
    ``_timed`` call."""

    def __init__(self):
        self.compute_s = 0.0


class _VirtualTime:
    """A clock that moves only when a probe run says so: the probe's readings are exactly the
    run times the test sets, however loaded the machine is (sleeps overshoot there)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.now += s


def _probing_engine(plan, rank, block_s, _time=None):
    """A fake engine whose probe block takes ``block_s`` seconds per run (a sleep inside
    ``run_block``; a callable: of the run's number, from 1) and counts its runs. ``_time``: a
    :class:`_VirtualTime` instead of the wall clock (patch ``probe_block.time`` with it too)."""
    if _time is None:
        import time as _time

    import torch

    e = _engine(plan, rank=rank)
    e.clock, e.act_dtype, e.runs = _WallClock(), torch.float32, [0]
    cfg = e.model_cfg

    class Cfg(SimpleNamespace):
        def run_block(self, blk, x, ctx):
            e.runs[0] += 1
            _time.sleep(block_s(e.runs[0]) if callable(block_s) else block_s)
            return cfg.run_block(blk, x, ctx)

    e.model_cfg = Cfg(build_layer=cfg.build_layer, block_context=cfg.block_context,
                      hidden_size=cfg.hidden_size)

    def timed(fn):
        t0 = _time.perf_counter()
        fn()
        e.clock.compute_s += _time.perf_counter() - t0

    e._timed = timed
    return e


def _virtual(monkeypatch) -> _VirtualTime:
    """A virtual clock for the probe block (sleeps overshoot on a loaded machine)."""
    from malleus_ds.engine import probe_block

    clock = _VirtualTime()
    monkeypatch.setattr(probe_block, "time", clock)
    return clock


def test_a_rank_without_work_sustains_its_probe_and_reports_one_run(monkeypatch):
    """Rank 3 (no work) keeps the device busy for ProbeBlock.SUSTAIN_S, then times repeats over
    ProbeBlock.TIMED_S (engine/probe_block.py), and reports seconds per run; the calibrating rank (working) times
    ProbeBlock.REF_RUNS runs, with a warm-up only the first time. The budget (half a step) bounds a probe on short steps."""
    plan = static_plan(4, 8, 1, 1, 1, 3)          # 3 pipelines on ranks 0-2; rank 3 is spare
    clock = _virtual(monkeypatch)
    idle = _loop(_probing_engine(plan, 3, 0.01, _time=clock), AdaptiveSettings())
    try:
        assert not idle.working
        per_run = idle.probing.measure(2)
        runs = idle.probing.block.engine.runs[0]
        # warm-up + sustain (60 ms) + timed repeats (100 ms at the last run's pace)
        assert runs == 1 + 2 + 6 + 10 and clock.now == pytest.approx(0.01 * runs), runs
        assert per_run == pytest.approx(0.01)
    finally:
        idle.close()
    ref = _loop(_probing_engine(plan, 0, 0.01, _time=clock), AdaptiveSettings())
    try:
        assert ref.working
        per_run = ref.probing.measure(2)    # first probe: a warm-up, then REF_RUNS timed
        assert ref.probing.block.engine.runs[0] == 1 + ProbeBlock.REF_RUNS
        assert per_run == pytest.approx(0.01)
        ref.probing.measure(4)                # later ones: warm already (it works every step)
        assert ref.probing.block.engine.runs[0] == 1 + 2 * ProbeBlock.REF_RUNS
    finally:
        ref.close()
    short = _loop(_probing_engine(plan, 3, 0.01, _time=clock), AdaptiveSettings())
    try:
        short.step_times.extend([0.04] * 5)        # 40 ms steps: a probe gets at most 20 ms
        short.probing.measure(2)
        assert short.probing.block.engine.runs[0] <= 1 + 2 + 2, short.probing.block.engine.runs[0]
    finally:
        short.close()


def test_a_held_rank_with_slack_sustains_its_probe_within_its_slack(monkeypatch):
    """Rank 3 works under a plan made for it at rate 3.5 (held): with slack it sustains its probe
    like a suspended rank (a light load inside a CPU quota reads healthy; the sustained probe
    reads the cap), within half its slack; busy, it does not probe (its training is measured
    under load); rank 0 calibrates; a plan made for it as healthy ends the hold."""
    plan = static_plan(4, 8, 1, 1, 1, 4)          # 4 pipelines, every rank works
    clock = _virtual(monkeypatch)
    c = _loop(_probing_engine(plan, 3, 0.01, _time=clock), AdaptiveSettings())
    try:
        assert c.probe_ref is None and not c.probe_due(2)
        c.considered([1.0, 1.0, 1.0, 3.5])        # same on every rank: from the broadcast event
        assert c.held.tolist() == [False, False, False, True] and c.probe_ref == 0
        c.step_times.extend([1.0] * 5)
        c.compute_times.extend([0.2] * 5)         # slack 0.8 s: room for the whole probe
        assert c.probe_due(2) and not c.probe_due(3)
        per_run = c.probing.measure(2)
        runs = c.probing.block.engine.runs[0]
        assert runs == 1 + 2 + 6 + 10 and clock.now == pytest.approx(0.01 * runs), runs
        assert per_run == pytest.approx(0.01)
        c.compute_times.extend([0.9] * 5)         # busy: its training reads it under load
        assert not c.probe_due(2)
        c.step_times.extend([0.3] * 5)
        c.compute_times.extend([0.1] * 5)         # slack 0.2 s: the probe gets at most 0.1 s
        c.probing.block.engine.runs[0] = 0
        assert c.probe_due(2)
        c.probing.measure(2)
        # a 0.1 s budget: warm-up + 2 early runs (30 ms), then a sustain of half what is left
        # (35 ms: 4 runs of 10 ms) and timed repeats over one quota period (50 ms)
        assert c.probing.block.engine.runs[0] == 1 + 2 + 4 + 5, c.probing.block.engine.runs[0]
        c.switched(plan, [1.0, 1.0, 1.0, 1.0])
        assert not c.held.any() and c.probe_ref is None and not c.probe_due(2)
    finally:
        c.close()


def test_whether_a_rank_times_after_the_all_reduce_is_known_alike_on_every_rank():
    """``timed_after_reduce`` (the step's clock numbers in its sums are then ``late``): read
    from the plan every rank shares, the same on every rank whatever each one's own timings;
    true on every step after which some rank probes, false on every step of a healthy plan."""
    plan = static_plan(4, 8, 1, 1, 1, 4)          # 4 pipelines, every rank works
    loops = [_loop(_engine(plan, rank=r), AdaptiveSettings()) for r in range(4)]
    try:
        every = loops[0].s.detect.probe_every
        steps = range(3 * every)
        assert not any(c.timed_after_reduce(s) or c.probe_due(s) for c in loops for s in steps)
        for r, c in enumerate(loops):
            c.considered([1.0, 1.0, 1.0, 3.5])    # rank 3 held, rank 0 calibrates
            c.step_times.extend([1.0] * 5)
            c.compute_times.extend([0.2 if r == 3 else 0.9] * 5)
        for s in steps:
            said = {c.timed_after_reduce(s) for c in loops}
            assert said == {s % every == 0}, (s, said)
            assert any(c.probe_due(s) for c in loops) == (s % every == 0)
        loops[3].compute_times.extend([0.9] * 5)  # busy: rank 3 no longer probes; rank 0 does
        assert {c.timed_after_reduce(0) for c in loops} == {True} and loops[0].probe_due(0)
    finally:
        for c in loops:
            c.close()


def test_carried_rates_schedule_a_replan_before_the_first_resumed_step():
    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = _loop(_engine(plan), AdaptiveSettings(replan_at=(9,)))
    try:
        assert ctl.carry([1.0, 4.2, None, 1.05], 6)
        assert ctl.forced == [6, 9] and ctl.session.carried_at == 6
        assert ctl.measured[1] == 4.2 and np.isnan(ctl.measured[2])
        healthy = _loop(_engine(plan), AdaptiveSettings())
        assert not healthy.carry([1.0, 1.1, 1.0, None], 6) and healthy.forced == []
        assert healthy.measured[1] == 1.1                  # still the measurement to start from
        assert not healthy.carry([4.0, 1.0], 6)            # another world: not these ranks
        off = _loop(_engine(plan), AdaptiveSettings(enabled=False))
        assert not off.carry([1.0, 4.0, 1.0, 1.0], 6) and off.forced == []
    finally:
        ctl.close()


def test_carried_rates_follow_the_device_and_fall_back_to_ranks():
    from malleus_ds.app.runners.resume import carried_rates

    meta = {"rates": [1.0, 4.0, None, 1.0], "devices": ["a/0", "a/1", "b/0", "b/1"]}
    # a restart renumbered the ranks: the slow device keeps its rate
    assert carried_rates(meta, ["b/0", "b/1", "a/0", "a/1"]) == [None, 1.0, 1.0, 4.0]
    assert carried_rates(meta, ["a/0", "a/1"]) == [1.0, 4.0]           # node b left
    # two emulated nodes on one host: names repeat, so only the same world maps (by rank)
    same = dict(meta, devices=["h/0", "h/1", "h/0", "h/1"])
    assert carried_rates(same, ["h/0", "h/1", "h/0", "h/1"]) == [1.0, 4.0, None, 1.0]
    assert carried_rates(same, ["h/0", "h/1"]) is None
    assert carried_rates({"step": 3}, ["a/0"]) is None                # saved before rates existed


# -- the loop checks its own predictions (issue 31) ------------------------------------------


def _light_plan(slow: int) -> Plan:
    """Four one-stage pipelines; rank ``slow`` runs 1 of the 8 micro-batches (a plan for it at
    about rate 2-3)."""
    from malleus_ds.plan import Pipeline, Stage

    mbs = [2] * 4
    mbs[slow], mbs[(slow + 1) % 4] = 1, 3
    return Plan(num_layers=4, global_batch_size=8, micro_batch_size=1,
                pipelines=tuple(Pipeline(m, (Stage((r,), (0, 4)),)) for r, m in enumerate(mbs)))


def test_a_readmitted_rank_still_slow_breaks_the_promise_and_the_loop_replans_at_once():
    """Issue 31, failure 1: rank 3, still 10x slow, was let back into a plan made for it at rate
    3. Its steps run far slower than that plan promised: the check misses within ``patience``
    judged steps, the loop re-measures (the steps since the switch: rank 3 reads ~10) and
    re-plans at once, past the detector's cooldown, and the new plan gives rank 3 less work."""
    plan = static_plan(4, 8, 1, 1, 1, 4)
    eng = _engine(plan)
    ctl = _loop(eng, AdaptiveSettings())
    rng = np.random.default_rng(1)
    try:
        for _ in _drive(ctl, plan, [1, 1, 1, 1], 12, rng):
            pass
        assert ctl.promise.pace.seconds is not None                  # the healthy pace is known
        light = _light_plan(3)
        eng.plan = light
        ctl.switched(light, [1.0, 1.0, 1.0, 3.0])
        assert ctl.check.expected_s is not None and ctl.check.plan_id == light.id
        missed_at = decided = None
        for k in _drive(ctl, light, [1, 1, 1, 10], 3000, rng):    # until decided (~60 s max)
            evs = ctl.take_events()
            if any(e["outcome"] == "missed" for e in evs) and missed_at is None:
                missed_at = k
            if ctl.ready:
                decided = k
                break
            time.sleep(0.02)
        assert missed_at is not None and missed_at <= 1 + ctl.s.check.patience + 1, missed_at
        ev = ctl.session.result.line()
        assert ev["trigger"] == "missed" and ev["adopted"], ev
        assert ev["measured_rates"][3] > 5.0, ev            # re-measured since the switch
        new = Plan.from_json(ctl.session.result.plan)
        work = lambda p: cost_units(p, 4, 1, {1: 1.0})[3]    # noqa: E731
        assert work(new) < work(light), (new, light)
    finally:
        ctl.close()


def test_a_missed_promise_with_nothing_better_goes_back_to_the_faster_previous_plan():
    from malleus_ds.steploop import ReplanDecision

    plan = static_plan(4, 8, 1, 1, 1, 4)
    light = _light_plan(1)
    validate_plan(light, JobLayout.one_node(4))
    ctl = _loop(_engine(light), AdaptiveSettings())
    try:
        kept = ReplanDecision(step=0, trigger="missed", adopted=False, from_plan=light.id,
                              to_plan=light.id, reason="the running plan is still the best",
                              trigger_rates=(1.0, 1.8, 1.0, 1.0))
        ctl.promise.previous = (plan, 0.35, [1.0, 10.0, 1.0, 1.0])
        back = ctl.promise.back_out(kept, light, 0.57)          # the previous plan ran faster
        assert back.plan is not None and Plan.from_json(back.plan).id == plan.id
        assert back.adopted and back.to_plan == plan.id
        assert back.line()["rates_for"] == [1.0, 10.0, 1.0, 1.0]
        assert "back to" in back.reason and "0.350" in back.reason
        assert ctl.promise.back_out(kept, light, 0.30) is kept   # it ran slower: stay
        ctl.promise.previous = None
        assert ctl.promise.back_out(kept, light, 0.57) is kept   # nothing to go back to
        # the host got slower for everyone on the healthy layout: the plan that suspended a
        # straggler (gone now) ran faster back then, but the model says it is worse today
        nominal, suspended = static_plan(4, 8, 1, 1, 1, 4), static_plan(4, 8, 1, 1, 1, 3)
        ctl.close()
        ctl = _loop(_engine(nominal), AdaptiveSettings())
        ctl.promise.previous = (suspended, 0.35, [1.0, 1.0, 1.0, 10.0])
        healthy = replace(kept, trigger_rates=(1.0,) * 4)
        assert ctl.promise.back_out(healthy, nominal, 0.47) is healthy
    finally:
        ctl.close()


def test_a_probe_reads_its_faster_reading_unless_its_sustained_runs_show_a_cap():
    """Two readings, each with the device's slowdown and a bias of its own on a shared host:
    the early one (the reference's shape and moment; cold after idling) and the sustained one
    (busy next to processes that wake from waits). The faster is read, whichever it is; a
    sustained reading 5x the early one (a quota: full speed for the first milliseconds only)
    is a cap and is read."""
    from malleus_ds.engine import probe_block

    plan = static_plan(4, 8, 1, 1, 1, 3)
    for late, expect in ((1.5, "early"), (0.6, "sustained"), (5.0, "sustained")):
        # warm-up and the two early runs at 20 ms, every later run `late` x that
        block = lambda n, late=late: 0.02 if n <= 3 else 0.02 * late  # noqa: E731
        clock = _VirtualTime()
        idle = _loop(_probing_engine(plan, 3, block, _time=clock), AdaptiveSettings())
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(probe_block, "time", clock)
                got = idle.probing.measure(2)
            early, sustained = idle.probing.block.last
            last = idle.probing.block.last
            assert early == pytest.approx(0.02) and sustained == pytest.approx(0.02 * late), last
            assert got == (early if expect == "early" else sustained), (late, last)
        finally:
            idle.close()


def test_a_sudden_straggler_on_the_first_plan_is_planned_for_within_two_steps():
    """The first plan is held to the job's healthy pace by the severe rule: two steps ~10x that
    pace, and the loop re-plans (trigger onset) from those two steps' rates, before the
    detector's window would confirm it."""
    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = _loop(_engine(plan), AdaptiveSettings())
    rng = np.random.default_rng(2)
    try:
        for _ in _drive(ctl, plan, [1, 1, 1, 1], 12, rng):
            pass
        assert ctl.check.expected_s == pytest.approx(ctl.promise.pace.seconds) and ctl.check.severe_only
        for k in _drive(ctl, plan, [1, 1, 1, 10], 2, rng):
            pass
        assert ctl.session.pending is not None and ctl.session.pending["trigger"] == "onset", ctl.session.pending
        assert ctl.session.pending["rates"][3] > 5.0
        assert ctl.det.streak == 0          # the detector had not confirmed anything yet
    finally:
        ctl.close()


def test_a_host_slow_for_everyone_is_no_reason_to_plan():
    """Every rank 2.5x slower for 6 steps (a busy host), then noise: the first plan misses its
    pace, but no rank's rate moved, so nothing is planned (a healthy run never re-plans)."""
    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = _loop(_engine(plan), AdaptiveSettings())
    rng = np.random.default_rng(4)
    try:
        for _ in _drive(ctl, plan, [1, 1, 1, 1], 12, rng):
            pass
        missed = []
        for rates in ([2.5] * 4,) * 6 + ([1, 1, 1, 1],) * 30:
            for _ in _drive(ctl, plan, rates, 1, rng):
                missed += [e for e in ctl.take_events() if e["outcome"] == "missed"]
                assert ctl.session.pending is None and ctl.session.result is None
        assert missed, "the slow host was seen"
    finally:
        ctl.close()


def test_a_rank_slowed_by_sleeping_has_no_cap_to_sustain_for():
    """Under ``straggler.method=sleep`` every run is slowed alike: no sustained window (it only
    added noise: a rate-10 rank read 52 as a 'cap'); under ``quota`` it stays."""
    from malleus_ds.emulation.straggler import StragglerSchedule

    plan = static_plan(4, 8, 1, 1, 1, 3)
    for method, sustains in (("sleep", False), ("quota", True)):
        idle = _loop(_probing_engine(plan, 3, 0.01), AdaptiveSettings())
        try:
            sched = StragglerSchedule.parse([{"rank": 3, "rate": 2.0}], method=method)
            idle.probing.block.engine.clock.straggler = SimpleNamespace(schedule=sched)
            idle.probing.measure(2)
            assert (idle.probing.block.last[1] is not None) == sustains, (method, idle.probing.block.last)
        finally:
            idle.close()


class _HeldAnswers:
    """A planner client that records requests and answers only when the test says."""

    def __init__(self):
        self.asked = []

    def request(self, msg):
        self.asked.append(msg)

    def poll(self):
        return None

    def close(self):
        pass


def _healthy_steps(ctl, plan, rates, first, n, rng):
    units = cost_units(plan, 4, 1, {1: 1.0})
    for k in range(first, first + n):
        comp = units * 0.01 * np.asarray(rates) * rng.uniform(0.95, 1.05, 4)
        ctl.contribute(comp[0], 0.0)
        ctl.observe(k, StepSums(loss=0.0, overflow=False, ready=False, compute_s=comp,
                                probe_s=np.full(4, np.nan)))


def test_a_decision_overtaken_by_the_rates_is_asked_again_for_todays():
    """Issue 31: a re-plan for a straggler that left while the planner worked is not adopted;
    the loop asks again at once for the rates of the steps since it asked (a recovery), and
    takes that answer as it comes. Rates that held stay decided as planned."""
    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = _loop(_engine(plan), AdaptiveSettings(detect=DetectConfig(every=1)))
    ctl.close()
    ctl.session.client = fake = _HeldAnswers()
    rng = np.random.default_rng(3)
    light = _light_plan(3)
    try:
        _healthy_steps(ctl, plan, [1, 1, 1, 5], 0, 6, rng)
        ctl.session.request("onset", [1.0, 1.0, 1.0, 5.0], 6)
        _healthy_steps(ctl, plan, [1, 1, 1, 5], 6, 1, rng)
        ctl.session.collect({"plan": light.to_json()})             # one step since: too few to say
        assert ctl.session.result is not None and ctl.session.result.trigger == "onset"
        ctl.session.result = None
        ctl.session.request("onset", [1.0, 1.0, 1.0, 5.0], 7)
        _healthy_steps(ctl, plan, [1, 1, 1, 1], 7, 3, rng)  # rank 3 healthy again meanwhile
        ctl.session.collect({"plan": light.to_json()})
        assert ctl.session.result is None and len(fake.asked) == 3
        p = ctl.session.pending
        assert p["trigger"] == "onset"                     # nothing was planned for rank 3 yet
        assert p["rates"] == [1.0, 1.0, 1.0, 1.0] and p["step"] == 10
        _healthy_steps(ctl, plan, [1, 1, 1, 6], 10, 3, rng)  # moved again: taken as it comes
        ctl.session.collect({"plan": plan.to_json()})
        ev = ctl.session.result.line()
        assert "rates moved from [1.0, 1.0, 1.0, 5.0] to [1.0, 1.0, 1.0, 1.0]" in ev["reason"]
        assert ev["measured_rates"] == [1.0, 1.0, 1.0, 1.0]
    finally:
        ctl.session.client = None
