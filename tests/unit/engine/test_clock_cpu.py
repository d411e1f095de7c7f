"""The compute clock on CPU: a rank's device is the core it gets (issue 31).

Ranks that share cores count their peers' compute as their own when timed by the wall: a
healthy rank on a light share read 1.5-2x. The clock leaves out the time the thread waited,
runnable, for a core held by another process (``/proc/thread-self/schedstat``), keeps a CPU
quota's throttling (its CPU seconds times the cgroup's cap), keeps the whole wait under
``straggler.method=compete`` (that wait *is* its slowdown), and leaves a sleep's wake-up wait
out of the emulation. Scripted time sources (one real competitor on the same core:
tests/integration/test_clock_cpu.py).
"""
from __future__ import annotations

import time

import pytest

from malleus_ds.engine import clock as clock_mod
from malleus_ds.engine.clock import ComputeClock, thread_times
from malleus_ds.emulation.straggler import Straggler, StragglerSchedule


class Host:
    """Wall, CPU and run-queue wait seconds the test advances by hand."""

    def __init__(self, monkeypatch, cap=1.0):
        self.wall = self.cpu = self.wait = 0.0
        monkeypatch.setattr(clock_mod.time, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(clock_mod, "thread_times", lambda path=None: (self.cpu, self.wait))
        monkeypatch.setattr(clock_mod, "own_cap", lambda: cap)

    def run(self, cpu=0.0, wait=0.0, blocked=0.0):
        self.cpu += cpu
        self.wait += wait
        self.wall += cpu + wait + blocked


def _clock(method="sleep", rate=None, sleep=None):
    entries = [] if rate is None else [{"rank": 0, "rate": rate, "start_step": 0}]
    sched = StragglerSchedule.parse(entries, 1, method=method)
    return ComputeClock(Straggler(sched, 0, sleep=sleep or (lambda s: None)))


def test_a_wait_for_a_core_is_not_compute(monkeypatch):
    h = Host(monkeypatch)
    c = _clock()
    assert c.waits
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.18, wait=0.12, blocked=0.01)     # a page-in or a lock: still compute
    assert c.compute_s == pytest.approx(0.19)
    assert c.wait_s == pytest.approx(0.12)           # the host's contention, kept apart
    c.start_step(1)
    assert c.wait_s == 0.0


def test_a_quota_keeps_its_throttling(monkeypatch):
    """A quota's throttled time is a run-queue wait too: the CPU seconds times the cap stand."""
    h = Host(monkeypatch, cap=3.0)
    c = _clock()
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.2, wait=0.4)
    assert c.compute_s == pytest.approx(0.6)
    c.start_step(1)
    with c.compute():                  # capped AND sharing a core: the cap is the floor
        h.run(cpu=0.2, wait=0.55)
    assert c.compute_s == pytest.approx(0.6)


def test_device_time_never_exceeds_the_wall(monkeypatch):
    """A span shorter than the quota's period runs in one burst (its CPU seconds times the cap
    overshoot), and a CPU clock read late adds to the span: neither may read above the wall, or
    the emulation accounts more slowdown than it slept."""
    h = Host(monkeypatch, cap=3.0)
    c = _clock()
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.004)                              # one unthrottled burst: wall 4 ms
    assert c.compute_s == pytest.approx(0.004)
    h = Host(monkeypatch)
    c = _clock()
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.003)
        h.cpu += 0.001                                # the CPU clock read 1 ms late
    assert c.compute_s == pytest.approx(0.003)


@pytest.mark.skipif(thread_times() is None, reason="no /proc/thread-self/schedstat here")
def test_this_threads_cpu_seconds_are_current():
    """schedstat's run time of a running thread lags by up to a tick; ``thread_times`` reads
    this thread's own from ``time.thread_time``, so a span never reads more CPU than wall."""
    worst = 0.0
    for _ in range(300):
        t0, (c0, _w) = time.perf_counter(), thread_times()
        sum(range(2000))
        c1, t1 = thread_times()[0], time.perf_counter()
        worst = max(worst, (c1 - c0) - (t1 - t0))
    assert worst <= 1e-4


def test_compete_keeps_the_whole_wait(monkeypatch):
    h = Host(monkeypatch)
    c = _clock(method="compete")
    assert not c.waits
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.1, wait=0.2)
    assert c.compute_s == pytest.approx(0.3)


def test_communication_inside_a_span_is_left_out_with_its_own_waits(monkeypatch):
    h = Host(monkeypatch)
    c = _clock()
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.1, wait=0.05)
        with c.excluded():
            h.run(cpu=0.02, wait=0.1, blocked=0.08)
        h.run(cpu=0.15)
    assert c.compute_s == pytest.approx(0.25)


def test_the_emulation_sleeps_by_the_wall_and_is_accounted_in_device_time(monkeypatch):
    """On shared cores a rank at rate 4 must take 4x as long as its peers by the wall (they wait
    for cores too), so it sleeps 3x its wall time; its compute reads 4x its device time, and
    its own wait for a core after the sleep is left out."""
    h = Host(monkeypatch)
    asked = []

    def fake(s):
        asked.append(s)
        h.run(wait=0.03, blocked=s)                       # woke up, then waited 30 ms for a core
    monkeypatch.setattr(time, "sleep", fake)              # measured by the wall, as time.sleep is
    c = _clock(rate=4.0, sleep=fake)
    c.start_step(0)
    with c.compute():
        h.run(cpu=0.01, wait=0.01)                        # device 0.01 s, wall 0.02 s
    assert asked == [pytest.approx(0.06)]                 # (4 - 1) x the wall
    assert c.emulated_s == pytest.approx(0.03)            # (4 - 1) x the device time
    assert c.compute_s == pytest.approx(0.04)             # 4 x the device time
    assert c.wait_s == pytest.approx(0.01 + 0.03)         # in the span, and after waking


def test_thread_times_reads_schedstat_or_says_none(tmp_path):
    f = tmp_path / "schedstat"
    f.write_text("230891278 157450235 84\n")
    assert thread_times(str(f)) == pytest.approx((0.230891278, 0.157450235))
    assert thread_times(str(tmp_path / "missing")) is None
    f.write_text("garbage\n")
    assert thread_times(str(f)) is None




@pytest.mark.skipif(thread_times() is None, reason="no /proc/thread-self/schedstat here")
def test_each_thread_and_a_forked_child_read_their_own_schedstat():
    """The schedstat file stays open per thread: another thread, and a child forked after this
    thread opened it, each read the file of their own thread."""
    import os
    import threading

    def own() -> str:           # the task whose schedstat this thread's open file reads
        thread_times()
        return os.readlink(f"/proc/self/fd/{clock_mod._OWN.fd}")

    assert own() == f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"
    got = {}
    t = threading.Thread(target=lambda: got.update(path=own(), tid=threading.get_native_id()))
    t.start()
    t.join()
    assert got["path"] == f"/proc/{os.getpid()}/task/{got['tid']}/schedstat"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, own().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 200).decode() == f"/proc/{pid}/task/{pid}/schedstat"
