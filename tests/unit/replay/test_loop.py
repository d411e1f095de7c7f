"""The replay's ``malleus`` policy (the real adaptive loop on a simulated clock, ``replay/loop.py``)
and ``restart`` policy, their cost terms and the break-even duration, on hand-sized cases."""
from __future__ import annotations

import pytest

from malleus_ds.replay.costs import MigrationCost, RestartCost
from malleus_ds.replay.job import BYTES_PER_PARAM, problem_job, problem_params
from malleus_ds.replay.loop import SimClock, SimPlanner, run_malleus
from malleus_ds.replay.restart import run_restart
from malleus_ds.replay.run import Replay
from malleus_ds.replay.summary import break_even_s, replay
from malleus_ds.replay.trace import Event, make_trace
from malleus_ds.planner.worker import AnswerCache

from .test_run import dp_problem

FIXED = 0.25         # planner seconds charged per request: runs compare exactly


def _charge(wall: float, req: dict) -> float:
    return FIXED


def test_one_gpu_at_rate_2_the_loop_switches_in_and_back_out_between_static_and_oracle():
    """Pure DP, 4 GPUs, GPU 3 at rate 2 from 600 s to 3000 s of an hour, 1 s steps. The loop
    sees it within a few steps, re-splits the micro-batches at once, without waiting for the
    planner (no state moves in pure DP, no group is created and every buffer is kept: the switch
    costs nothing, as on the engine); the planner's answer, which comes after, finds nothing
    better; the same again when it ends, back to the user's layout."""
    tr = make_trace([Event(600.0, 3000.0, 3, 2.0)], 4, hours=1.0)
    res = replay(dp_problem(), tr, step_s=1.0, planner_time_limit_s=2.0, charge=_charge)
    pol = res["policies"]
    m, st, orc = pol["malleus"], pol["static"], pol["oracle"]
    assert st["vs_healthy"] < m["vs_healthy"] < orc["vs_healthy"]
    assert m["switches"] == 2 and m["of_oracle_gain"] > 0.95
    onset, kept, back, kept2 = [e for e in res["events"] if e["policy"] == "malleus"]
    assert onset["trigger"] == "onset" and onset["adopted"] and onset["change_s"] == 600.0
    assert 0 < onset["detection_s"] <= 5 * 2.0 and onset["planning_s"] == 0.0   # 5 slow steps
    assert kept["trigger"] == "onset" and not kept["adopted"] and kept["planning_s"] == FIXED
    assert kept2["trigger"] == "recovery" and not kept2["adopted"]
    assert onset["bytes"] == 0 and onset["transfer_s"] == 0.0
    assert onset["migration_s"] == 0.0 and back["migration_s"] == 0.0
    assert onset["new_groups"] == 0 and onset["buffers_kept"] and onset["communicators_s"] == 0
    assert onset["won_s"] > 0 and back["trigger"] == "recovery" and back["adopted"]
    assert m["planning_s"] == pytest.approx(2 * FIXED)
    # every policy below the bound; restart pays its documented seconds twice
    for p in pol.values():
        assert p["vs_healthy"] <= res["capacity_bound"] + 1e-9
    assert pol["restart"]["switches"] == 2
    assert pol["restart"]["migration_s"] == pytest.approx(2 * RestartCost().seconds)


def test_an_event_shorter_than_detection_gives_no_switch():
    """GPU 1 at rate 3 for 1.5 steps: gone before the loop can confirm it; the loop runs the
    static plan throughout, the same samples as static, and plans nothing."""
    tr = make_trace([Event(100.0, 101.5, 1, 3.0)], 4, hours=0.25)
    rp = Replay(dp_problem(), 1.0)
    m = run_malleus(rp, tr.segments(), charge=_charge)
    assert m.switches == 0 and not [d for d in m.decisions if d.adopted]
    res = replay(dp_problem(), tr, 1.0, ["static", "malleus"], charge=_charge)
    assert res["policies"]["malleus"]["vs_static"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
def test_fast_forward_gives_the_same_result_as_stepping():
    """Three stragglers, one overlapping another; with a fixed planner charge the loop run step
    by step and the loop fast-forwarded through steady stretches agree on every decision, its
    moment, and the samples."""
    ev = [Event(300.0, 1500.0, 2, 3.0), Event(900.0, 1200.0, 0, 1.5),
          Event(2400.0, 2600.0, 1, 2.5)]
    tr = make_trace(ev, 4, hours=1.0)
    rp = Replay(dp_problem(), 1.0)
    a = run_malleus(rp, tr.segments(), charge=_charge, fast_forward=False)
    b = run_malleus(rp, tr.segments(), charge=_charge, fast_forward=True)
    assert b.stepped < a.stepped / 3 and a.steps == b.steps
    assert [(d.step, d.trigger, d.adopted, d.to_plan) for d in a.decisions] == \
        [(d.step, d.trigger, d.adopted, d.to_plan) for d in b.decisions]
    assert [d.t for d in a.decisions] == pytest.approx([d.t for d in b.decisions], rel=1e-9)
    assert b.samples == pytest.approx(a.samples, rel=1e-9)
    assert a.switches >= 4


def test_on_the_step_clock_the_rates_change_at_the_named_steps():
    """A trace whose bounds are step indices (a recorded run's schedule, ``from_run.py``):
    GPU 3 at rate 2 for steps 10-29 of 60. Steps 0-9 take 1 s, step 10 is the first at 2 s
    whatever the clock says, the replay runs exactly 60 steps, and each step's end is kept."""
    tr = make_trace([Event(10, 30, 3, 2.0)], 4, hours=60 / 3600)
    rp = Replay(dp_problem(), 1.0)
    m = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True)
    assert m.steps == len(m.step_ends) == 60
    assert m.step_ends[:12] == pytest.approx([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14])
    assert m.samples == 60 * rp.samples_per_step and m.seconds == pytest.approx(m.step_ends[-1])
    onset, kept, back, kept2 = m.decisions      # each re-split at once, then the planner's
    assert [(d.trigger, d.adopted, d.first) for d in m.decisions] == [
        ("onset", True, True), ("onset", False, False), ("recovery", True, True),
        ("recovery", False, False)] and m.switches == 2
    # the switches' pauses lie between steps: the timeline ends with the last step
    assert m.timeline[-1][1] == pytest.approx(m.step_ends[-1])
    assert sum(b - a for a, b, _ in m.timeline) == pytest.approx(m.seconds)


class _Record:
    """What a recorded run's loop read (``run_trace.RunRecord``'s questions), by hand."""

    def __init__(self, probes=None, compute=None, seconds=None, answered=None):
        self._probes, self._compute = probes, compute
        self._seconds, self._answered = seconds, answered

    def probes(self, step, plan):
        return self._probes(step, plan) if self._probes else None

    def compute_s(self, step, plan):
        return self._compute(step, plan) if self._compute else None

    def step_s(self, step, plan):
        return self._seconds(step, plan) if self._seconds else None

    def answered(self, step, plan):
        return self._answered(step, plan) if self._answered else None


def test_a_recorded_runs_probe_readings_are_what_the_loop_reads():
    """On the step clock, GPU 3 at rate 4 for steps 10-39 of 90. The loop takes its work away
    and probes it; after step 40 the trace says it is healthy. Replayed as is, the loop lets
    it back soon after; given a run's probes that read 1.5 until step 60 (``record``), it
    keeps it out until the probes after then read healthy."""
    tr = make_trace([Event(10, 40, 3, 4.0)], 4, hours=90 / 3600)
    rp = Replay(dp_problem(), 1.0)
    free = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True)
    slow = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                       record=_Record(lambda k, plan: {3: 1.5} if 40 <= k < 60 else None))
    back = [d.step for d in free.decisions if d.trigger == "recovery" and d.adopted]
    late = [d.step for d in slow.decisions if d.trigger == "recovery" and d.adopted]
    assert back and late and back[0] < 50 and late[0] > 60, (back, late)


def test_a_held_rank_probes_where_the_runs_did():
    """GPU 3 at rate 6 for steps 10-39 of 120: the loop gives it a light share (4 of 40 units),
    a held rank, which probes while its compute leaves it slack and comes back once two probes
    read healthy. A run whose step lines show that no held rank probed (an empty record at
    every step) kept it held: its training reads cannot bring it back (a light load inside a
    throughput cap reads healthy), so the replay keeps it held too."""
    tr = make_trace([Event(10, 40, 3, 6.0)], 4, hours=120 / 3600)
    rp = Replay(dp_problem(), 1.0)
    own = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True)
    held = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                       record=_Record(lambda k, plan: {}))
    light = [u for u in own.units.values() if 0 < u[3] < min(u[:3])]
    assert light, own.units
    assert [d.trigger for d in own.decisions if d.adopted] == ["onset", "recovery"]
    assert [d.trigger for d in held.decisions if d.adopted] == ["onset"]


def test_the_loop_reads_the_runs_own_compute_where_it_ran_the_runs_plan():
    """The trace holds GPU 3 at rate 4 for steps 10-39, but the run's loop read every rank at
    the healthy pace on the static plan (its ``compute_s``): the replay's loop reads that, and
    keeps the static plan, whose steps take what the trace's rates give. On any other plan
    the record has nothing, and the trace is what the loop reads."""
    tr = make_trace([Event(10, 40, 3, 4.0)], 4, hours=60 / 3600)
    rp = Replay(dp_problem(), 1.0)
    calm = [28 * rp.scale] * 4
    read = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                       record=_Record(compute=lambda k, plan: calm
                                      if plan == rp.static.id else None))
    assert read.switches == 0 and not read.decisions
    assert read.samples / read.seconds < 0.5 * 28        # 30 of 60 steps at a quarter pace
    other = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                        record=_Record(compute=lambda k, plan: calm if plan == "x" else None))
    assert other.switches == 2


def test_a_probes_seconds_in_the_runs_compute_are_not_read(monkeypatch):
    """A probe timed after a step rides in its rank's ``compute_s`` of that step (the step line
    is written after it), but the run's loop read the compute before it. GPU 3 at rate 6 from
    step 10 gets a light share (held), and another rank calibrates its probes
    (``probe_ref``); the run's step lines, on that plan, say every rank computed 1.0 s, and
    that GPU 3 probed after each probe step (even), reading 6. The loop reads the calibrating
    rank at 1.0 s less ``REF_RUNS`` runs of the block (a cost unit each) on those steps, GPU 3
    at 1.0 s less one or two runs of 6 units (``_less_probes``), 1.0 s on the other steps and
    for every other rank. Where the run did not record its probes, it reads 1.0 s."""
    from malleus_ds.replay import loop as loop_mod

    seen = []

    class Recording(loop_mod.Controller):
        def observe(self, step, sums):
            seen.append((step, self.probe_ref, sums.compute_s.copy()))
            return super().observe(step, sums)

    monkeypatch.setattr(loop_mod, "Controller", Recording)
    tr = make_trace([Event(10, 60, 3, 6.0)], 4, hours=60 / 3600)
    rp = Replay(dp_problem(), 1.0)

    def compute(k, plan):
        return None if plan == rp.static.id else [1.0] * 4
    run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                record=_Record(lambda k, plan: {3: 6.0}, compute))
    held = [(k, ref, c) for k, ref, c in seen if ref is not None]
    assert held and {k % 2 for k, _, _ in held} == {0, 1}
    block = 6 * rp.scale
    for k, ref, c in held:
        want = [1.0] * 4
        if k % 2 == 0:
            want[ref] = 1.0 - loop_mod.REF_RUNS * rp.scale
            assert 1.0 - 2 * block - 1e-9 <= c[3] <= 1.0 - block + 1e-9
            want[3] = c[3]
        assert list(c) == pytest.approx(want), k
    seen.clear()
    run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                record=_Record(compute=compute))
    assert all(list(c) == [1.0] * 4 for _, ref, c in seen if ref is not None)


def test_a_held_ranks_probe_is_not_read_either_as_often_as_its_budget_ran_it():
    """``_less_probes`` by hand: the calibrating rank 0 timed the block twice (0.01 s each);
    held rank 3's probe read 4.0, 0.04 s a run, as many runs (1-2) as half its budget holds:
    steps of 1.0 s, its own compute 0.5 s: budget min(0.5, 0.5 x 0.5) = 0.25 s, two runs;
    compute 0.95 s: 0.025 s, one. A run that did not record its probes: nothing known."""
    import numpy as np

    from malleus_ds.replay.loop import _less_probes

    def cut(own3):
        own = [np.array([1.0, 1.0, 1.0, own3])] * 3
        return _less_probes(np.array([1.0, 1.0, 1.0, 0.5]), {3: 4.0}, 0, np.full(4, 0.01),
                            [1.0] * 3, own)
    assert cut(0.5) == pytest.approx([0.98, 1.0, 1.0, 0.5 - 2 * 0.04])
    assert cut(0.95) == pytest.approx([0.98, 1.0, 1.0, 0.5 - 0.04])
    assert list(_less_probes(np.ones(4), None, 0, np.full(4, 0.01), [1.0], [])) == [1.0] * 4


def test_a_probe_that_does_not_sustain_costs_a_few_runs_of_the_block():
    """``PROBE_RUNS``: the probe block's untimed run and its timed ones (``ProbeBlock``)."""
    from malleus_ds.engine.probe_block import ProbeBlock
    from malleus_ds.replay.loop import PROBE_RUNS, REF_RUNS

    assert PROBE_RUNS == 1 + ProbeBlock.REF_RUNS
    assert REF_RUNS == ProbeBlock.REF_RUNS


def test_a_slow_planner_answers_late_on_the_simulated_clock():
    """The planner's seconds are charged to the clock: at 40 s per plan its answer comes at
    least 40 s after the loop asked. The re-split it would find was adopted at once, before
    the answer (the first response waits for no planner), so the slow planner costs the job
    nothing here."""
    tr = make_trace([Event(300.0, 3000.0, 3, 2.0)], 4, hours=1.0)
    rp = Replay(dp_problem(), 1.0)
    fast = run_malleus(rp, tr.segments(), charge=lambda w, r: 0.0)
    slow = run_malleus(rp, tr.segments(), charge=lambda w, r: 40.0)
    f, s = [[d for d in r.decisions if not d.first][0] for r in (fast, slow)]
    assert s.requested_t == pytest.approx(f.requested_t)
    assert s.t - s.requested_t >= 40.0 > f.t - f.requested_t
    a, b = fast.decisions[0], slow.decisions[0]
    assert a.first and b.first and a.adopted and b.t == a.t < s.t
    assert slow.samples == pytest.approx(fast.samples, rel=1e-9)


def test_sim_planner_and_the_answer_cache():
    clock = SimClock()
    calls = []
    pl = SimPlanner(clock, charge=lambda w, r: 5.0, cache=_Counting(calls))
    pl.request({"problem": {"x": 1}, "seed": 3})
    assert pl.poll() is None
    clock.now = 4.9
    assert pl.poll() is None
    clock.now = 5.0
    assert pl.poll() == {"plan": 1}
    assert pl.charged == [5.0] and pl.requested == [0.0]
    cache = AnswerCache(size=2)
    req = {"problem": dp_problem().with_rates({3: 2.0}).to_json(), "seed": 1,
           "time_limit": 1.0, "min_improvement": 0.0}
    first = cache.answer(req)
    again = cache.answer(dict(req, seed=9))          # the seed is not part of the key
    assert again["cached"] and again["plan"] == first["plan"] and again["planning_s"] == 0.0
    assert "error" in cache.answer({"problem": {}, "seed": 0}) and cache.hits == 1
    assert len(cache._d) == 1                          # errors are not kept


class _Counting:
    def __init__(self, calls):
        self.calls = calls

    def answer(self, req):
        self.calls.append(req)
        return {"plan": len(self.calls)}


def test_the_problem_stands_for_its_state_and_a_switch_moves_it_over_the_links():
    """The table holds ``layer_static_mb`` per layer per GPU at 20 B a parameter; a switch
    that moves a whole stage's state between nodes takes the transfer plan's bytes over the
    network at the given bandwidth, plus the fixed terms."""
    import json
    from pathlib import Path

    from malleus_ds.problem import Problem

    pr = Problem.from_json(json.loads(
        (Path(__file__).resolve().parents[3] / "examples/problem_64gpu_one_slow.json").read_text()))
    table = problem_params(pr)
    layer = sum(s.numel for s in table if s.owner == 0)
    assert layer * BYTES_PER_PARAM / pr.tp / 2 ** 20 == pytest.approx(1200, rel=1e-6)
    spec = problem_job(pr, pr.static_plan())
    st = pr.static_plan()
    from malleus_ds.planner import plan as run_planner

    new = run_planner(pr, seed=0, time_limit=2.0).plan      # rank 9 at rate 4
    c = MigrationCost(network_gbps=10.0, nvlink_gbps=100.0, communicators_s=1.0,
                      warmup_steps=0.5)
    mig = c.of_switch(spec, st, new, new_step_s=8.0)
    assert mig.bytes > 0
    assert mig.seconds == pytest.approx(mig.terms["transfer_s"] + 1.0 + 4.0, abs=1e-3)
    faster = MigrationCost(network_gbps=20.0, nvlink_gbps=200.0, communicators_s=1.0,
                           warmup_steps=0.5).of_switch(spec, st, new, 8.0)
    assert faster.terms["transfer_s"] == pytest.approx(mig.terms["transfer_s"] / 2, rel=1e-3)
    assert mig.terms["new_groups"] > 0 and not mig.terms["buffers_kept"]
    same = c.of_switch(spec, st, st, 8.0)
    assert same.bytes == 0 and same.seconds == 0.0


def test_cost_flags_are_checked_by_name():
    assert MigrationCost.parse("network_gbps=25,warmup_steps=1").network_gbps == 25.0
    assert RestartCost.parse("init_s=10").seconds == 29 + 100 + 10 + 41
    with pytest.raises(ValueError, match=r"--switch-costs: network_gbps=0.0 must be > 0"):
        MigrationCost.parse("network_gbps=0")
    with pytest.raises(ValueError, match=r"--switch-costs: 'speed=3' is not key=value with a key"):
        MigrationCost.parse("speed=3")
    with pytest.raises(ValueError, match=r"--restart-costs: load_s='x' is not a number"):
        RestartCost.parse("load_s=x")
    with pytest.raises(ValueError, match=r"--restart-costs: save_s=-1.0 must be >= 0"):
        RestartCost.parse("save_s=-1")


def test_restart_pays_its_seconds_at_each_detected_change():
    tr = make_trace([Event(600.0, 3000.0, 3, 2.0)], 4, hours=1.0)
    rp = Replay(dp_problem(), 1.0)
    cost = RestartCost(save_s=10, transform_s=0, init_s=20, load_s=10)
    r = run_restart(rp, tr.segments(), cost=cost)
    assert r.switches == 2 and r.migration_s == 80.0
    first, back = r.restarts
    # the detector's window median and confirmation on the static plan's 2 s steps, then 1 s
    assert 600 < first["t"] <= 600 + 6 * 2 and 3000 < back["t"] <= 3000 + 6 * 8 / 7
    # by hand: 600 s healthy; detection at static's 1/2; 40 s stopped; 7/8 until 3000;
    # detection of the recovery at 7/8; 40 s stopped; healthy to the end
    d1 = first["t"] - 600
    d2 = back["t"] - 3000
    hand = (600 + d1 * 0.5 + (3000 - first["t"] - 40) * 7 / 8 + d2 * 7 / 8
            + (3600 - back["t"] - 40)) / 3600
    assert r.samples_per_s / rp.healthy_samples_per_s == pytest.approx(hand, abs=2e-3)


def test_break_even_by_hand():
    """Pure DP, GPU 3 at rate 2: static 14 units a step (2 samples/s of 28 per 1 s healthy step
    scaled: 28/2 = 14), the plan 8 units (24.5). A re-split: no state moves, no group is made,
    every buffer is kept, so only the fixed part and the kept-buffers warm-up are paid:
    m1 = fixed + warmup_kept x 8/7 s, m2 = fixed + warmup_kept x 1 s. The duration where the
    net is 0."""
    rp = Replay(dp_problem(), 1.0)
    c = MigrationCost(communicators_s=2.0, warmup_steps=0.5, warmup_kept_steps=0.25, fixed_s=0.1)
    d, terms = break_even_s(rp, {3: 2.0}, c, detect_s=3.0)
    s0, s1, h, h1 = 14.0, 24.5, 28.0, 24.5
    m1, m2 = 0.1 + 0.25 * 8 / 7, 0.1 + 0.25
    p = rp.plan_seconds[((3, 2.0),)]
    want = 3.0 + p + m1 + (m1 * s0 + 3.0 * (h - h1) + m2 * h) / (s1 - s0)
    assert d == pytest.approx(want, rel=1e-6)
    assert terms["migration_in_s"] == pytest.approx(m1, abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("regime,hours", [("persistent", 24.0), ("transient", 6.0)])
def test_at_256_gpus_the_loop_meets_the_issues_targets(regime, hours):
    """A 100B-class job on 256 GPUs (tp 8, pp 8, dp 4) under a drawn trace, the loop with its
    default settings (bench/bench_replay.py runs the full set at 256 and 1,024 GPUs): under a
    persistent fault it keeps at least 0.85 of the oracle's gain; under transient stragglers it
    is never more than 2% below static; no policy above the capacity bound."""
    import json
    from pathlib import Path

    from malleus_ds.problem import Problem
    from malleus_ds.replay.regimes import generate

    root = Path(__file__).resolve().parents[3]
    pr = Problem.from_json(json.loads((root / "examples/problem_256gpu_gpt100b.json").read_text()))
    tr = make_trace(generate(regime, 256, hours, seed=3), 256, hours)
    res = replay(pr, tr, 12.0, ["static", "oracle", "malleus"], charge=lambda w, r: 1.0)
    m = res["policies"]["malleus"]
    assert m["vs_static"] >= 0.98
    if regime == "persistent":
        assert m["of_oracle_gain"] >= 0.85
    for p in res["policies"].values():
        assert p["vs_healthy"] <= res["capacity_bound"] + 1e-9


def test_a_step_across_a_change_counts_its_work_on_each_side_of_it():
    """GPU 3 at rate 4 from 100.5 s, mid-step: the healthy stretch ends at 100.5 s at the
    healthy pace (the step's first half), and the step's remaining work counts after it."""
    tr = make_trace([Event(100.5, 3000.0, 3, 4.0)], 4, hours=1.0)
    rp = Replay(dp_problem(), 1.0)
    m = run_malleus(rp, tr.segments(), charge=_charge)
    first = m.timeline[0]
    assert first[0] == 0.0 and first[1] == pytest.approx(100.5)
    assert first[2] == pytest.approx(28.0)            # 28 samples per 1 s healthy step
    assert m.timeline[1][0] == pytest.approx(100.5)


def test_a_search_on_the_ranks_host_slows_the_steps_it_overlaps():
    """``planner_stall`` (a CPU run whose planner shares the ranks' cores, ``from_run.py``):
    while a search is in flight the steps take that much longer; a request with every rank
    healthy is answered without a search and stalls nothing."""
    clock = SimClock()
    pl = SimPlanner(clock, charge=lambda w, r: 5.0, cache=_Counting([]))
    pl.request({"problem": {"rates": {"3": 2.0}}})
    pl.request({"problem": {"rates": {}}})
    assert pl.searching()
    clock.now = 5.0
    assert not pl.searching()                 # the search's answer is in; the healthy one
    tr = make_trace([Event(300.0, 3000.0, 3, 2.0)], 4, hours=1.0)
    rp = Replay(dp_problem(), 1.0)
    calm = run_malleus(rp, tr.segments(), charge=lambda w, r: 40.0)
    slow = run_malleus(rp, tr.segments(), charge=lambda w, r: 40.0, planner_stall=0.5)
    onset = calm.decisions[0]
    assert onset.trigger == "onset" and slow.decisions[0].trigger == "onset" and onset.first
    # the re-split at once, 2 s after the request (one 2 s step at rate 2); the rest of the 40 s
    # search under it (28 samples a step of st s): 1.5 st steps, 38 / (1.5 st) steps instead
    # of 38 / st; a stalled step that starts inside the search runs whole, and the answer is
    # taken at the next step boundary (up to 2 more steps at the old pace)
    st = rp.step_seconds(calm.plans[onset.to_plan], {3: 2.0})
    assert onset.t - onset.requested_t == pytest.approx(2.0) and st < 2.0
    lost = calm.samples - slow.samples
    assert (38 / st - 38 / (1.5 * st)) * 28 <= lost <= (38 / st - 38 / (1.5 * st) + 2) * 28
    with pytest.raises(ValueError, match="planner_stall=-1 must be >= 0"):
        run_malleus(rp, tr.segments(), planner_stall=-1)


def test_probes_are_timed_after_a_step_and_read_in_the_next(monkeypatch):
    """As the engine does (``Controller.after_reduce``): a probe is timed right after an even
    step's all-reduce, at the rate of that moment, and read in the next step's reduce; a held
    rank probes only while its own compute leaves it slack (``probe.light``): GPU 3, held on
    a share that fills its steps at rate 3, does not probe until it recovers."""
    from malleus_ds.replay import loop as loop_mod

    seen = []

    class Recording(loop_mod.Controller):
        def observe(self, step, sums):
            seen.append((step, sums.probe_s.copy(), self.held.copy()))
            return super().observe(step, sums)

    monkeypatch.setattr(loop_mod, "Controller", Recording)
    tr = make_trace([Event(300.0, 1200.0, 3, 3.0)], 4, hours=0.5)
    res = run_malleus(Replay(dp_problem(), 1.0), tr.segments(), charge=_charge,
                      fast_forward=False)
    assert [d.trigger for d in res.decisions if d.adopted] == ["onset", "recovery"]
    probed = [(k, p) for k, p, _ in seen if (p == p).any()]
    assert probed and all(k % 2 == 1 for k, _ in probed)       # timed after an even step
    readings = [p[3] / loop_mod.PROBE_S for _, p, h in seen if h[3] and p[3] == p[3]]
    # busy while held at rate 3 (9 units of a 9-unit step): no probe; light once it
    # recovered: it probes, healthy at once
    assert readings and all(r == pytest.approx(1.0) for r in readings)


def test_a_recorded_runs_answer_is_taken_at_the_runs_step():
    """GPU 3 at rate 4 from step 10 of 60 on the step clock. Where the run asked at the same
    step on the same plan, its answer is taken before the step the run took it at (the
    ``replan`` event's ``step``), however long the replay's steps took: a planner's seconds
    that end just inside the run's step and just past the replay's moved a switch by a step
    (``two``: 2.85 s against a 2.93 s step, 2.68 s replayed). Elsewhere the clock decides."""
    tr = make_trace([Event(10, 60, 3, 4.0)], 4, hours=60 / 3600)
    rp = Replay(dp_problem(), 1.0)
    own = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True)
    asked: list[int] = []

    def answered(k, plan):
        asked.append(k)
        return k + 7 if plan == rp.static.id else None
    late = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                       record=_Record(answered=answered))
    # the planner's answers (the re-split decided at once, before them, waits for none)
    first = [d.step for d in own.decisions if not d.first]
    anchored = [d.step for d in late.decisions if not d.first]
    assert asked and anchored[0] == asked[0] + 7 != first[0], (asked, first, anchored)
    assert [d.step for d in late.decisions if d.first] == [d.step for d in own.decisions
                                                            if d.first]
    other = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                        record=_Record(answered=lambda k, plan: k + 7 if plan == "x" else None))
    assert [d.step for d in other.decisions if not d.first] == first


def test_the_loop_reads_the_runs_own_step_seconds_where_it_ran_the_runs_plan(monkeypatch):
    """GPU 3 at rate 4 from step 10 of 60: the loop re-plans, and its new plan promises a step.
    The run's steps 30-34 on that plan took 5 s (its step lines). The loop's pace check reads
    what the run's read (``Controller.step_done``), and judges the promise missed; its clock
    stays the replay's own. On another plan the record has nothing."""
    from malleus_ds.adaptive import control

    read: list[float] = []
    missed: list[dict] = []
    orig = control.Controller.step_done

    def spy(self, seconds):
        read.append(seconds)
        orig(self, seconds)
        missed.extend(e for e in self.promise.events if e.get("outcome") == "missed"
                      and e not in missed)
    monkeypatch.setattr(control.Controller, "step_done", spy)
    tr = make_trace([Event(10, 60, 3, 4.0)], 4, hours=60 / 3600)
    rp = Replay(dp_problem(), 1.0)
    own = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True)
    moved = own.decisions[0].to_plan
    assert max(read) < 5.0 and not [e for e in missed if e["plan"] == moved]

    def slow(plan):
        return lambda k, p: 5.0 if p == plan and 30 <= k < 35 else None
    read.clear()
    missed.clear()
    run = run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                      record=_Record(seconds=slow(moved)))
    assert read[30:35] == [5.0] * 5 and read[35] < 5.0
    assert [e["step"] for e in missed if e["plan"] == moved] == [31]   # two past twice it
    assert run.step_ends == own.step_ends               # its clock stays the replay's own
    read.clear()
    run_malleus(rp, tr.segments(), charge=_charge, on_steps=True,
                record=_Record(seconds=slow("x")))
    assert max(read) < 5.0
