"""malleus_ds/report/compare.py: one straggler schedule under several engines, side by side (pure)."""
import pytest

from malleus_ds.report.compare import (
    CompareError,
    compare,
    closing_line,
    format_comparison,
    no_straggler_note,
    segments)
from malleus_ds.emulation.straggler import StragglerSchedule


def _records(times, rates_of, samples=16, world=2):
    return [{"step": s, "loss": 1.0, "samples": samples, "step_time_s": t,
             "compute_s": [0.1] * world, "emulated_rates": rates_of(s)}
            for s, t in enumerate(times)]


def _rates(s):   # rank 1: rate 2 in steps 4-7, rate 4 in 8-11, healthy again from 12
    return {"1": 2.0} if 4 <= s < 8 else {"1": 4.0} if 8 <= s < 12 else {}


def test_segments_cut_the_schedule_where_the_rates_change():
    segs = segments(_records([1.0] * 14, _rates) + [{"event": "migrate", "step": 5}])
    assert [(g.first, g.last, g.label) for g in segs] == [
        (0, 3, "healthy"), (4, 7, "rank 1 at rate 2"), (8, 11, "rank 1 at rate 4"),
        (12, 13, "healthy")]


def test_numbers_bound_and_closing_line():
    # baseline: the straggler sets the pace (2x, then 4x the healthy 1 s); contender: 1.2 s and
    # 1.5 s per step plus a 0.5 s migration before step 5
    ds = _records([1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 1, 1], _rates)
    ma = _records([1, 1, 1, 1, 2, 1.2, 1.2, 1.2, 1.5, 1.5, 1.5, 1.5, 1, 1], _rates)
    ev = [{"event": "replan", "step": 5, "adopted": True},
          {"event": "replan", "step": 9, "adopted": False},
          {"event": "migrate", "step": 5, "seconds": 0.5}]
    c = compare([("deepspeed", ds, []), ("malleus", ma, ev)], warmup=1)
    assert [(g.first, g.last) for g in c.segments] == [(1, 3), (4, 7), (8, 11), (12, 13)]
    assert c.bound == pytest.approx((1.0, 0.75, 0.625, 1.0))
    st = c.stats[1][1]
    assert (st.steps, st.seconds, st.switches, st.migrate_s) == (4, pytest.approx(6.1), 1, 0.5)
    assert c.stats[0][2].samples_per_s == pytest.approx(4.0)     # 16 samples / 4 s
    line = closing_line(c)
    # baseline: 8 + 16 = 24 s for 8 steps that take 8 s at its healthy pace -> 16 s lost;
    # contender: 6.1 + 6 = 12.1 s -> won back 11.9 s (74%); bound: 4/0.75 + 4/0.625 = 11.73 s
    assert "steps 4-11" in line and "cost deepspeed 16.0 s (24.0 s instead of 8.0 s" in line
    assert "malleus won back 11.9 s of it (74%)" in line
    assert "would win back 12.3 s (77%)" in line
    text = format_comparison(c)
    assert "rank 1 at rate 4" in text and "0.62x" in text and "0.25x" in text


def test_no_straggler_is_said_not_hidden():
    flat = _records([1.0] * 6, lambda s: {})
    c = compare([("deepspeed", flat, []), ("malleus", flat, [])], warmup=1)
    assert "nothing to win back" in closing_line(c)
    sched = StragglerSchedule.parse([{"rank": 1, "rate": 3.0, "start_step": 20}], 2)
    note = no_straggler_note(sched.rates, 2, 10, 2)
    assert note and "no straggler in steps 2-9" in note
    assert no_straggler_note(sched.rates, 2, 30, 2) is None
    assert no_straggler_note(StragglerSchedule.parse([], 2).rates, 0, 5, 2)


def test_runs_of_different_schedules_are_refused():
    a = _records([1.0] * 10, _rates)
    b = _records([1.0] * 10, lambda s: {"1": 2.0} if s >= 3 else {})
    with pytest.raises(CompareError, match="another straggler schedule"):
        compare([("deepspeed", a, []), ("malleus", b, [])], warmup=0)
    with pytest.raises(CompareError, match="no step lines"):
        compare([("deepspeed", a, []), ("malleus", [], [])], warmup=0)


def test_compare_field_is_checked():
    from malleus_ds.app.config import ConfigError, compare_engines

    assert compare_engines([]) == () and compare_engines(None) == ()
    assert compare_engines(["deepspeed", "malleus"]) == ("deepspeed", "malleus")
    for bad, msg in [("malleus", "must be a list"), (["deepspeed", "megatron"], "megatron"),
                     (["malleus", "malleus"], "twice")]:
        with pytest.raises(ConfigError, match=msg):
            compare_engines(bad)
