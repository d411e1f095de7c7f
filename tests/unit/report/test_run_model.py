"""malleus_ds/report/run_model.py: the one model of a run the reports share (issue 32): the split
into stretches of equal condition, the throughput with migrations, the rank count; and that
compare, the run summary's phases, the what-if account and the plot's data read it alike."""
from __future__ import annotations

import json

import pytest

from malleus_ds.report import compare, metrics, plot_data, whatif
from malleus_ds.report.run_model import (
    Stretch,
    emulated_condition,
    events_in,
    step_lines,
    stretches,
    throughput,
    world_of)


def _step(s, t=1.0, rates=None, **kw):
    return {"step": s, "samples": 8, "step_time_s": t, "emulated_rates": rates or {}, **kw}


def test_stretches_are_maximal_runs_of_equal_keys():
    assert stretches("aabbba") == [Stretch("a", 0, 2), Stretch("b", 2, 5), Stretch("a", 5, 6)]
    assert stretches([]) == [] and stretches(iter([1])) == [Stretch(1, 0, 1)]


def test_emulated_condition():
    rec = {"emulated_rates": {"3": 1.1, "1": 4}}
    assert emulated_condition(rec) == ((1, 4.0), (3, 1.1))          # sorted by rank, floats
    assert emulated_condition(rec, healthy=1.2) == ((1, 4.0),)      # the what-if's reading
    assert emulated_condition({"rates": {"2": 2.0}}) == ((2, 2.0),)  # before the rename
    assert emulated_condition({}) == () == emulated_condition({"emulated_rates": None})


def test_segments_phases_and_regions_are_the_same_stretches():
    """healthy 0-3, rank 1 at 2 in 4-7, healthy 8-9: compare's segments, the summary's phases
    (the first step after each change left out, both healthy stretches one phase) and the
    plot's region all cut at steps 4 and 8."""
    recs = [_step(s, 2.0 if 4 <= s < 8 else 1.0, {"1": 2.0} if 4 <= s < 8 else None,
                  compute_s=[0.5, 0.5]) for s in range(10)]
    recs.insert(5, {"event": "migrate", "step": 5, "seconds": 0.5})
    assert [(g.first, g.last, g.rates) for g in compare.segments(recs)] == [
        (0, 3, ()), (4, 7, ((1, 2.0),)), (8, 9, ())]
    ph = metrics.phases(recs, warmup_steps=1)
    assert [(p.rates, p.steps, p.first_step) for p in ph] == [((), 4, 1), (((1, 2.0),), 3, 5)]
    assert ph[1].samples_per_s == pytest.approx(4.0)                # step time only
    # the plan is part of the summary's key: a switch at step 6 starts a new phase
    planned = [dict(r, plan="a" if r["step"] < 6 else "b") for r in step_lines(recs)]
    assert [(p.plan, p.steps) for p in metrics.phases(planned)] == [
        ("a", 4), ("a", 1), ("b", 1), ("b", 1)]


def test_region_is_the_active_stretch(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    recs = [_step(s, rates={"1": 2.0} if 4 <= s < 8 else None) for s in (0, 1, 4, 5, 7, 9)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    # recorded steps only: the region ends at the first recorded step after it
    assert plot_data.straggler_regions([plot_data.load_run_data(d)]) == [
        plot_data.Region(4, 9, "rank 1 at rate 2")]


def test_throughput_counts_the_migrations_before_its_steps():
    steps = [_step(s, t) for s, t in [(4, 1.0), (5, 2.0), (6, 2.0)]]
    events = [{"event": "migrate", "step": 5, "seconds": 0.5},
              {"event": "migrate", "step": 6},                       # no seconds: 0
              {"event": "migrate", "step": 7, "seconds": 9.0},       # after the last step
              {"event": "replan", "step": 5, "seconds": 9.0},        # not a migration
              {"event": "hang", "seconds": 9.0}]                     # no step
    tp = throughput(steps, events)
    assert (tp.steps, tp.samples, tp.step_s, tp.migrate_s) == (3, 24.0, 5.0, 0.5)
    assert tp.seconds == 5.5 and tp.samples_per_s == pytest.approx(24 / 5.5)
    assert throughput(steps).samples_per_s == pytest.approx(24 / 5)      # no events
    assert throughput(steps, events, 4, 7).migrate_s == 9.5              # explicit bounds
    assert throughput([], events) == throughput([])
    assert throughput([]).samples_per_s == 0.0
    assert [e["step"] for e in events_in(events, 5, 7, "migrate")] == [5, 6, 7]
    # compare's segment and the what-if phase: the same numbers
    st = compare.segment_stats(steps, events, 4, 6)
    assert (st.steps, st.samples, st.seconds, st.migrate_s) == (3, 24.0, 5.5, 0.5)


def test_world_of_one_rule():
    assert world_of([_step(0, compute_s=[0.1] * 2, measured_rates=[1.0] * 3)]) == 3
    assert world_of([_step(0, rates={"4": 2.0}, compute_s=[0.1] * 2)]) == 5   # rank 4 + 1
    assert world_of([_step(0), {"event": "replan", "measured_rates": [1.0] * 8}]) == 1
    assert world_of([]) == 1 and world_of([_step(0)], least=0) == 0


def test_every_report_counts_the_same_ranks(tmp_path):
    """compare, the what-if account and the plot's data: one count. Lines without compute_s
    (a straggler on rank 1, named by the schedule only) count 2 ranks everywhere; compare once
    counted compute_s alone and divided by zero on them."""
    recs = [_step(s, 2.0 if s >= 3 else 1.0, {"1": 2.0} if s >= 3 else None) for s in range(8)]
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = compare.compare([("x", recs, [])], warmup=1)
    assert c.world == 2 and c.bound == pytest.approx((1.0, 0.75))
    assert whatif.account(recs, [], None, warmup=1).world == 2
    assert plot_data.load_run_data(d).world_size == 2
