from __future__ import annotations

import pytest

from malleus_ds.emulation.straggler import Straggler, StragglerError, StragglerSchedule
from malleus_ds.report.metrics import (
    MetricsWriter,
    StepRecord,
    format_phases,
    phases,
    read_metrics)


def test_schedule_windows_and_overlap():
    s = StragglerSchedule.parse([{"rank": 1, "rate": 2.0, "start_step": 2, "end_step": 4},
                                 {"rank": 1, "rate": 3.0, "start_step": 3},
                                 {"rank": 0, "rate": 1.5}])
    assert [s.rate(1, k) for k in range(6)] == [1.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert s.rate(0, 0) == 1.5 and s.rate(2, 3) == 1.0
    assert s.rates(3, 3) == {0: 1.5, 1: 3.0}
    assert not StragglerSchedule.parse([]) and not StragglerSchedule.parse(None)
    assert StragglerSchedule.parse(s.to_json()) == s


def test_off_by_default_and_world_check():
    with pytest.raises(StragglerError, match=r"rank=4 does not exist"):
        StragglerSchedule.parse([{"rank": 4, "rate": 2}], world_size=4)


def test_straggler_sleeps_rate_minus_one_times_compute():
    slept = []
    s = Straggler(StragglerSchedule.parse([{"rank": 1, "rate": 4.0, "start_step": 1}]), rank=1,
                  sleep=slept.append)
    assert s.after_compute(0, 0.5) == 0.0                    # before start_step
    assert s.after_compute(1, 0.5) == pytest.approx(1.5)     # (4 - 1) * 0.5
    assert slept == [pytest.approx(1.5)]
    healthy = Straggler(s.schedule, rank=0, sleep=slept.append)
    assert healthy.after_compute(1, 0.5) == 0.0 and len(slept) == 1


def test_real_sleep_is_measured():
    s = Straggler(StragglerSchedule.parse([{"rank": 0, "rate": 3.0}]), rank=0)
    assert 0.019 <= s.after_compute(0, 0.01) < 2.0


def test_metrics_writer_and_phases(tmp_path):
    w = MetricsWriter(tmp_path)
    for k in range(8):
        rates = {"1": 4.0} if k >= 4 else {}
        w.write(StepRecord(k, 5.0 - k * 0.1, 8, 1.0 if k < 4 else 4.0, (0.5, 2.0), (0.0, 1.5),
                           rates))
    w.close()
    recs = read_metrics(tmp_path)
    assert len(recs) == 8 and set(recs[0]) >= {"step", "loss", "samples", "step_time_s",
                                                 "compute_s"}
    assert recs[5]["compute_s"] == [0.5, 2.0] and recs[5]["emulated_rates"] == {"1": 4.0}
    ph = phases(recs, warmup_steps=1)
    assert [p.label for p in ph] == ["healthy", "rank 1 at rate 4"]
    assert [p.steps for p in ph] == [3, 3]                   # warm-up + transition left out
    assert ph[0].samples_per_s == pytest.approx(8.0) and ph[1].samples_per_s == pytest.approx(2.0)
    assert "0.25x" in format_phases(ph)
    assert MetricsWriter(None).path is None


def test_compute_clock_leaves_out_communication_and_emulates():
    import time

    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.runners import DistEnv
    from malleus_ds.app.runners.common import ComputeClock, exclude_calls

    cfg = build_run_config({"straggler": {"schedule": [{"rank": 0, "rate": 2.0, "start_step": 1}]}},
                           world_size=1)
    clock = ComputeClock(cfg, DistEnv())

    class Engine:  # stands in for DeepSpeed: backward calls a reduction internally
        def reduce(self):
            time.sleep(0.2)

        def backward(self):
            time.sleep(0.05)
            self.reduce()

    eng = Engine()
    exclude_calls(eng, ["reduce"], clock)
    clock.start_step(0)
    with clock.compute():
        eng.backward()
    assert 0.04 <= clock.compute_s < 0.15 and clock.emulated_s == 0.0   # the 0.2 s left out
    clock.start_step(1)                                                 # now rate 2
    with clock.compute():
        time.sleep(0.05)
    assert clock.emulated_s >= 0.045 and clock.compute_s >= 0.095


class FakeQuota:
    def __init__(self):
        self.rates = []

    def set_rate(self, r):
        self.rates.append(r)


def test_quota_method_caps_the_cpu_at_rate_changes_and_never_sleeps():
    sched = StragglerSchedule.parse([{"rank": 1, "rate": 3.0, "start_step": 2, "end_step": 4},
                                     {"rank": 1, "rate": 2.0, "start_step": 4, "end_step": 5}],
                                    method="quota")
    made, slept = [], []

    def factory():
        made.append(FakeQuota())
        return made[-1]

    s = Straggler(sched, rank=1, sleep=slept.append, quota=factory, reason=lambda: None)
    for k in range(6):
        s.at_step(k)
        assert s.after_compute(k, 0.5) == 0.0
    assert len(made) == 1 and made[0].rates == [3.0, 2.0, 1.0] and slept == []
    s.at_step(3)
    s.close()
    assert made[0].rates[-2:] == [3.0, 1.0] and s.applied_rate == 1.0
    healthy = Straggler(sched, rank=0, quota=factory, reason=lambda: None)
    for k in range(6):
        healthy.at_step(k)
    assert len(made) == 1                       # a rank never slowed never touches a cgroup
    sleeper = Straggler(StragglerSchedule.parse(sched.to_json()), rank=1, quota=factory)
    sleeper.at_step(2)                          # sleep: at_step does nothing
    assert len(made) == 1


def test_quota_method_errors_name_the_reason():
    from malleus_ds.emulation.straggler import RawSchedule, check_method

    sched = StragglerSchedule.parse([{"rank": 1, "rate": 3.0}], method="quota")
    msg = (r"^straggler.method=quota: /sys/fs/cgroup/cpu is read-only; "
           r"use straggler.method=compete or straggler.method=sleep$")
    with pytest.raises(StragglerError, match=msg):
        Straggler(sched, rank=0, reason=lambda: "/sys/fs/cgroup/cpu is read-only")
    with pytest.raises(StragglerError, match=r"ds_config.malleus.straggler.method=quota: x; use "
                                             r"ds_config.malleus.straggler.method=compete or "
                                             r"ds_config.malleus.straggler.method=sleep$"):
        check_method(sched, lambda: "x", "ds_config.malleus.straggler")
    compete = StragglerSchedule.parse([{"rank": 1, "rate": 3.0}], method="compete")
    with pytest.raises(StragglerError, match=r"^straggler.method=compete: no affinity; use "
                                             r"straggler.method=sleep$"):
        check_method(compete, lambda: "no affinity")
    asked = []
    check_method(StragglerSchedule.parse(sched.to_json()), lambda: asked.append(1) or "x")
    check_method(StragglerSchedule.parse([], method="quota"), lambda: asked.append(1) or "x")
    assert asked == []                          # sleep, or no straggler: nothing to check
    with pytest.raises(StragglerError, match=r"straggler.method='cgroup' is not known; choose "
                                             r"one of \['sleep', 'quota', 'compete'\]"):
        StragglerSchedule.parse([], method="cgroup")
    raw = RawSchedule(({"rank": 1, "rate": 2},), "quota")
    assert raw == ({"rank": 1, "rate": 2},) and StragglerSchedule.parse(raw).method == "quota"
    assert StragglerSchedule.parse(raw, method="sleep").method == "sleep"


def test_compute_clock_applies_the_quota_at_step_start_and_emulates_nothing():
    from malleus_ds.engine.clock import ComputeClock

    q = FakeQuota()
    sched = StragglerSchedule.parse([{"rank": 0, "rate": 4.0, "start_step": 1}], method="quota")
    clock = ComputeClock(Straggler(sched, 0, quota=lambda: q, reason=lambda: None))
    for k in range(3):
        clock.start_step(k)
        clock.add(0.25)
        assert clock.emulated_s == 0.0 and clock.compute_s == 0.25
    assert q.rates == [4.0]
