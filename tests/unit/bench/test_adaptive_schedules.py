"""The criteria of ``bench_adaptive.py --repeat`` (``bench/adaptive_schedules.py``) on synthetic
metrics rows: no processes. A good run passes every criterion; a late re-plan, a slow run after
recovery and a healthy run with a re-plan each fail the right one (and only it)."""
import importlib.util
import sys
from pathlib import Path

import pytest

_P = Path(__file__).resolve().parents[3] / "bench" / "adaptive_schedules.py"
_spec = importlib.util.spec_from_file_location("adaptive_schedules", _P)
sch = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("adaptive_schedules", sch)     # dataclasses look their module up
_spec.loader.exec_module(sch)

# the criteria on a fixed schedule (the bench's own may move): rank 1 at rate 10 in [4, 26)
S = sch.Schedule("recover", 56, (sch.Entry(1, 10.0, 4, 26),))


def rows(sched, step_s, steps=None):
    """One row per step; ``step_s(k, rates)`` -> the step's seconds (16 samples a step)."""
    return [{"step": k, "samples": 16, "step_time_s": step_s(k, sched.rates(k))}
            for k in range(sched.steps if steps is None else steps)]


def deepspeed(k, rates):
    return 0.5 * max(rates.values(), default=1.0)


def adaptive_rows(sched, replan_at=(), slow_after=False):
    """Healthy 0.5 s; slow (as DeepSpeed) until the first re-plan after an onset, then 0.6 s;
    ``slow_after``: 0.7 s from the recovery on (0.71 of healthy)."""
    fixed = set()
    for o in sch.onsets(sched):
        nxt = min([r for r in replan_at if r > o.step], default=sched.steps)
        fixed |= set(range(nxt, sched.steps))

    def f(k, rates):
        if rates:
            return 0.6 if k in fixed else deepspeed(k, rates)
        if slow_after and k >= sch.recoveries(sched)[0]:
            return 0.7
        return 0.5
    return rows(sched, f)


def events(replan_at, adopted=True):
    ev = []
    for s in replan_at:
        ev.append({"event": "replan", "step": s, "trigger": "onset", "adopted": adopted})
        if adopted:
            ev.append({"event": "migrate", "step": s, "seconds": 0.1})
    return ev


def judge(sched, replan_at, **kw):
    return sch.judge_adaptive(adaptive_rows(sched, replan_at, **kw), events(replan_at), sched,
                              rows(sched, deepspeed), [])


def test_schedules_are_well_formed():
    for s in sch.SCHEDULES.values():
        assert sch.onsets(s) and sch.recoveries(s), s.name
        assert sch.after_windows(s), f"{s.name}: no after-recovery window to judge"
        assert sch.healthy_window(s)[1] - sch.healthy_window(s)[0] >= 2, s.name
        assert all(e.end <= s.steps for e in s.entries)
        assert s.hydra().startswith("[{rank:")
    assert [o.step for o in sch.onsets(S)] == [4] and sch.recoveries(S) == [26]
    assert sch.after_windows(S) == [(41, 56)]
    assert [o.step for o in sch.onsets(sch.SCHEDULES["returns"])] == [6, 46]
    assert [o.step for o in sch.onsets(sch.SCHEDULES["two"])] == [6, 16]
    # a worsening rate is an onset each time it rises; the recovery of one of two is not
    assert [o.step for o in sch.onsets(sch.SCHEDULES["worsens"])] == [6, 14, 22]
    assert sch.recoveries(sch.SCHEDULES["two"]) == [34]
    assert S.hydra() == "[{rank:1,rate:10.0,start_step:4,end_step:26}]"


def test_a_good_run_passes_every_criterion():
    r = judge(S, [9, 28])                         # 5 steps after onset; back after recovery
    assert r["pass"] == {"onset": True, "vs_deepspeed": True, "after": True}
    assert r["onset"] == 5
    assert r["vs_deepspeed"] >= 2.5
    assert r["after"] == pytest.approx(1.0)
    assert r["replans"] == 2 and r["adopted"] == 2


def test_a_late_replan_fails_onset_only():
    r = judge(S, [13, 28])                        # 9 steps after onset
    assert r["onset"] == 9
    assert r["pass"]["onset"] is False
    assert r["pass"]["after"] is True


def test_no_adopted_replan_fails_onset():
    ev = events([9], adopted=False)
    r = sch.judge_adaptive(adaptive_rows(S, []), ev, S, rows(S, deepspeed), [])
    assert r["onset"] is None and r["pass"]["onset"] is False
    assert r["pass"]["vs_deepspeed"] is False     # it never left DeepSpeed's speed
    assert r["adopted"] == 0 and r["replans"] == 1


def test_slow_after_recovery_fails_after_only():
    r = judge(S, [9, 28], slow_after=True)
    assert r["after"] == pytest.approx(0.5 / 0.7)
    assert r["pass"] == {"onset": True, "vs_deepspeed": True, "after": False}


def test_slow_while_straggling_fails_vs_deepspeed():
    slow = rows(S, lambda k, rates: 2.5 if rates else 0.5)   # 2x deepspeed only
    r = sch.judge_adaptive(slow, events([9]), S, rows(S, deepspeed), [])
    assert r["vs_deepspeed"] == pytest.approx(5.0 * 22 / (2.5 * 22 + 0.1))
    assert r["pass"] == {"onset": True, "vs_deepspeed": False, "after": True}


def test_migrations_count_in_the_straggling_steps():
    ev = events([9]) + [{"event": "migrate", "step": 10, "seconds": 30.0}]
    r = sch.judge_adaptive(adaptive_rows(S, [9]), ev, S, rows(S, deepspeed), [])
    assert r["pass"]["vs_deepspeed"] is False


def test_each_onset_is_checked():
    two = sch.SCHEDULES["two"]                    # onsets 6 and 16
    good = judge(two, [10, 20])
    assert [o["latency"] for o in good["onsets"]] == [4, 4] and good["pass"]["onset"]
    # the second straggler never re-planned for: the first re-plan does not cover it
    late = judge(two, [10])
    assert [o["latency"] for o in late["onsets"]] == [4, None]
    assert late["onset"] is None and late["pass"]["onset"] is False
    # a re-plan decided before the second onset's step counts for the first onset, not both
    ret = sch.SCHEDULES["returns"]                # onsets 6 and 46
    r = judge(ret, [10, 28, 51])
    assert [o["latency"] for o in r["onsets"]] == [4, 5] and r["pass"]["onset"]
    assert [o["latency"] for o in judge(ret, [10, 28, 58])["onsets"]] == [4, 12]


def test_real_onsets_below_a_straggler_are_not_judged():
    w = sch.SCHEDULES["worsens"]                  # rank 2: 4 -> 8 -> 16 at 6, 14, 22
    true = {4.0: 1.05, 8.0: 2.0, 16.0: 4.0}       # quota targets on 2 shared cores (made up)
    os_ = sch.onsets(w, true)
    assert [o.judged for o in os_] == [False, True, True]
    r = sch.judge_adaptive(adaptive_rows(w, [17, 25]), events([17, 25]), w,
                           rows(w, deepspeed), [], true)
    assert [o["latency"] for o in r["onsets"]] == [None, 3, 3]
    assert r["pass"]["onset"] is True and r["onset"] == 3


def test_healthy_run():
    h = [{"step": k, "samples": 16, "step_time_s": 0.5} for k in range(50)]
    ok = sch.judge_healthy(h, [])
    assert ok["pass"] == {"healthy": True} and ok["replans"] == 0
    assert ok["tput"] == pytest.approx(32.0)
    bad = sch.judge_healthy(h, [{"event": "replan", "step": 30, "trigger": "drift",
                                 "adopted": False}])
    assert bad["pass"] == {"healthy": False} and bad["replans"] == 1


def test_spread_and_verdict():
    assert sch.spread([5, 3, 9, 4], higher_better=False) == (9, 5, 3)
    assert sch.spread([None, 3, 4], higher_better=False) == (None, 4, 3)
    assert sch.spread([2.6, 2.4, 3.0], higher_better=True) == (2.4, 2.6, 3.0)
    assert sch.spread([], True) == (None, None, None)
    runs = [{"pass": {"onset": True}}, {"pass": {"onset": False}}]
    assert sch.verdict(runs, "onset") is False
    assert sch.verdict(runs[:1], "onset") is True
    assert sch.verdict([], "onset") is False


def test_an_onset_of_a_rank_already_left_out_needs_no_replan():
    w = sch.Schedule("w", 40, (sch.Entry(2, 4.0, 6, 14), sch.Entry(2, 16.0, 14, 22)))
    ev = [{"event": "replan", "step": 9, "trigger": "onset", "adopted": True},
          {"event": "migrate", "step": 9, "seconds": 0.1, "idle": [2]}]
    lat = sch.onset_latencies(ev, w)
    assert [o["latency"] for o in lat] == [3, 0]                 # out since step 9
    ev[1]["idle"] = []                                           # still working: no re-plan
    assert [o["latency"] for o in sch.onset_latencies(ev, w)] == [3, None]


def test_the_healthy_reference_is_robust_to_one_odd_step():
    """The two-straggler run 9 of 2026-12-05: its 4-step healthy window held one lucky step."""
    steps = [0.363, 0.346, 0.375, 0.266]
    rows_ = [{"step": 2 + k, "samples": 16, "step_time_s": t} for k, t in enumerate(steps)]
    summed = sch.tput(rows_, [], range(2, 6))
    robust = sch.healthy_tput(rows_, range(2, 6))
    assert summed == pytest.approx(64 / sum(steps))
    assert robust == pytest.approx((16 / 0.363 + 16 / 0.346) / 2)   # the median of 4
    assert 42.2 / summed < 0.9 <= 42.2 / robust       # the same after pace: a miss, then not
    assert sch.healthy_tput(rows_, range(10, 12)) is None


def test_scaled_schedule_and_the_slowdown_deepspeed_measured():
    """``--real`` on shared cores: the quota is the rate times the cores' sharing, and what a
    rate really cost is read from the DeepSpeed run, which runs at its slowest rank's pace."""
    two = sch.SCHEDULES["two"]                    # rank 1 at 6 in [6, 26), rank 3 at 10 in [16, 34)
    q = two.scaled(2.0)
    assert q.hydra().startswith("[{rank:1,rate:12.0,start_step:6,end_step:26}")
    assert [o.step for o in sch.onsets(q)] == [o.step for o in sch.onsets(two)]
    assert sch.straggling_steps(q) == sch.straggling_steps(two)
    with pytest.raises(ValueError, match="k=0.5"):
        two.scaled(0.5)
    # a job slowed 5.5x by the rate-6 rank alone, 9x once rank 3 is at 10 (max rate holds)
    ds = rows(two, lambda k, r: 0.4 * {6.0: 5.5, 10.0: 9.0}.get(max(r.values(), default=1), 1.0))
    ds[20]["step_time_s"] = 100.0                 # one odd step moves no median
    got = sch.measured_slowdown(ds, two)
    assert got == pytest.approx({6.0: 5.5, 10.0: 9.0})
    assert sch.measured_slowdown([], two) == {}
