"""The compute clock's CUDA-event path, on CPU: fake events stamped by a fake device clock.

On a GPU the clock records a pair of events per span and reads them ONCE per step; an excluded
span (a TP all-reduce waiting for a slow peer) inside a compute span is subtracted by its own
events; a step in which the straggler emulation slows this rank falls back to synchronised
timing (the emulation sleeps on the host in proportion to what it just measured).
"""
from __future__ import annotations

import pytest

from malleus_ds.engine import clock as clock_mod
from malleus_ds.engine.clock import ComputeClock
from malleus_ds.engine.comm_log import BUCKET, PROBE, TP, CommLog, bucket_key, tensor_mb
from malleus_ds.emulation.straggler import Straggler, StragglerSchedule


class FakeGPU:
    """A device clock the test advances by hand; events read it when recorded."""

    def __init__(self):
        self.now = 0.0
        self.syncs = 0

    def event(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = gpu.now

            def synchronize(self):
                gpu.syncs += 1

            def elapsed_time(self, other):            # milliseconds, as torch.cuda.Event
                return (other.t - self.t) * 1e3
        return Event


@pytest.fixture
def gpu(monkeypatch):
    g = FakeGPU()
    import torch
    monkeypatch.setattr(torch.cuda, "Event", g.event())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronised"))
    return g


def test_events_one_read_per_step_and_excluded_spans_subtracted(gpu):
    c = ComputeClock(None, cuda=True)
    c.start_step(0)
    assert c.events
    with c.compute():                  # forward: 2 s of compute with a 5 s TP wait inside
        gpu.now += 1.0
        with c.excluded():
            gpu.now += 5.0
        gpu.now += 1.0
    gpu.now += 100.0                   # pipeline bubble / p2p between spans: not compute
    with c.compute():
        gpu.now += 3.0
    assert gpu.syncs == 0              # nothing waited for while the step ran
    assert c.compute_s == pytest.approx(5.0)
    assert c.compute_s == pytest.approx(5.0) and gpu.syncs == 1    # read once
    c.start_step(1)
    with c.compute():
        gpu.now += 2.0
    assert c.compute_s == pytest.approx(2.0) and gpu.syncs == 2


def test_excluded_outside_compute_is_not_timed_by_events(gpu):
    c = ComputeClock(None, cuda=True)
    c.start_step(0)
    with c.excluded():                 # e.g. DeepSpeed's gradient all-reduce after backward
        gpu.now += 9.0
    with c.compute():
        gpu.now += 1.0
    assert c.compute_s == pytest.approx(1.0)


def test_an_emulated_step_synchronises_and_sleeps(monkeypatch):
    import torch
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    slept = []
    sched = StragglerSchedule.parse([{"rank": 0, "rate": 3.0, "start_step": 1}], 1)
    c = ComputeClock(Straggler(sched, 0, sleep=slept.append), cuda=True)
    c.start_step(0)
    assert c.events                     # healthy step: events
    c.start_step(1)
    assert not c.events                 # slowed step: synchronised spans
    t = iter([10.0, 10.5])
    monkeypatch.setattr(clock_mod.time, "perf_counter", lambda: next(t, 10.5))
    with c.compute():
        pass
    assert len(syncs) == 2 and slept == [pytest.approx(1.0)]
    assert c.compute_s == pytest.approx(1.5) and c.emulated_s == pytest.approx(1.0)


def test_cpu_uses_perf_counter(monkeypatch):
    # the span's time waiting for a core is the kernel's (schedstat), real even when the wall
    # clock is faked here: on a loaded machine it would be taken off the fake 1.5 s
    monkeypatch.setattr(clock_mod, "thread_times", lambda *a: None)
    c = ComputeClock(None, cuda=False)
    c.start_step(0)
    assert not c.events
    t = iter([1.0, 1.25, 2.0, 2.5])
    monkeypatch.setattr(clock_mod.time, "perf_counter", lambda: next(t))
    with c.compute():
        with c.excluded():
            pass
    # compute 1.0 -> 2.5 with 1.25 -> 2.0 excluded
    assert c.compute_s == pytest.approx(0.75)


class _AsyncWork:
    """NCCL's behaviour on the host: ``all_reduce`` returns at once, the wait is where the
    slow peer's time goes (on a GPU: the stream waits; here the fake device clock advances)."""

    def __init__(self, advance):
        self.advance = advance

    def wait(self):
        self.advance()
        return True


@pytest.mark.parametrize("gpu_events", [True, False])
def test_a_slow_tp_peer_is_not_counted_as_my_compute(gpu_events, monkeypatch, request):
    """A TP rank's forward with two all-reduces (attention, MLP) whose peer is 5 s late each:
    only its own 2 s of compute count, on the GPU path (events) and on the CPU path."""
    import torch
    import torch.distributed as dist

    from malleus_ds.engine import tensor_parallel as tpm

    if gpu_events:
        gpu = request.getfixturevalue("gpu")
        advance = lambda s: setattr(gpu, "now", gpu.now + s)          # noqa: E731
        c = ComputeClock(None, cuda=True)
    else:
        now = [0.0]
        monkeypatch.setattr(clock_mod.time, "perf_counter", lambda: now[0])
        # the kernel's run-queue wait is real even when the wall clock is faked: on a loaded
        # machine it would be taken off the fake 2 s (CI read 1.998)
        monkeypatch.setattr(clock_mod, "thread_times", lambda *a: None)
        advance = lambda s: now.__setitem__(0, now[0] + s)            # noqa: E731
        c = ComputeClock(None, cuda=False)
    calls = []

    def fake_all_reduce(t, group=None, async_op=False):
        calls.append(async_op)
        assert async_op, "TP all-reduces are issued asynchronously"
        return _AsyncWork(lambda: advance(5.0))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    # as the engine's context: left out of compute and timed over the group (ranks 0 and 1)
    c.comm_log = CommLog(lambda r: 0)
    tpm.set_comm_context(lambda t, group: c.collective((0, 1), tensor_mb(t)))
    try:
        c.start_step(0)
        x = torch.ones(4, requires_grad=True)
        with c.compute():
            advance(1.0)                                  # attention
            y = tpm.reduce_from_tp(x * 2, group=object())
            advance(1.0)                                  # MLP
            tpm.reduce_from_tp(y * 3, group=object())
        assert calls == [True, True]
        assert c.compute_s == pytest.approx(2.0)
        if gpu_events:      # read from the events at the next step's start, nothing waited
            assert c.comm_log.values()[TP:PROBE] == [0.0] * 4
            c.start_step(1)
        # the quicker per MB of the two (16 bytes each, 5 s each)
        assert c.comm_log.values()[TP:PROBE] == pytest.approx(
            [bucket_key((0, 1)), 2.0, 16e-6, 5.0])
    finally:
        tpm.set_comm_context(None)


def test_a_quota_step_keeps_cuda_events(monkeypatch):
    """method=quota slows the process itself (no sleep): nothing to synchronise for."""
    import torch
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronised"))
    from malleus_ds.emulation.straggler import RawSchedule

    sched = StragglerSchedule.parse(RawSchedule([{"rank": 0, "rate": 3.0}], method="quota"), 1)
    st = Straggler.__new__(Straggler)
    st.schedule, st.rank = sched, 0
    c = ComputeClock(st, cuda=True)
    monkeypatch.setattr(c.straggler, "at_step", lambda step: None, raising=False)
    c.start_step(0)
    assert c.events


def test_cuda_communication_is_timed_by_events_and_read_at_the_next_step(gpu):
    """On a GPU a receive or a reduction is a pair of events around the wait on its handle,
    read when the next step starts (after the last step's all-reduce was read on the host):
    the step itself never waits for the GPU on their account."""
    c = ComputeClock(None, cuda=True)
    c.comm_log = CommLog(lambda r: r // 2)
    c.start_step(0)
    with c.comm((0, 2), 1.0, "p2p"):
        gpu.now += 0.5
    with c.comm((0, 1, 2, 3), 2.0, "dp"):
        gpu.now += 1.0
    assert gpu.syncs == 0 and c.comm_log.values() == [0.0] * len(c.comm_log.values())
    c.start_step(1)
    v = c.comm_log.values()
    assert v[:3] == pytest.approx([3.0, 1.0, 0.5])
    assert v[BUCKET:TP] == pytest.approx([bucket_key((0, 1, 2, 3)), 4.0, 2.0, 1.0])
    assert gpu.syncs == 1
    c.start_step(2)              # read once
    assert c.comm_log.values() == [0.0] * len(v)


def test_cuda_slow_link_emulation_and_probes_wait_for_their_end_event(gpu):
    """Where the emulation slows the link a message crosses, the host waits for the message
    and sleeps (rate - 1) x its time; a probe (an exchange apart from the step) is read at
    once. A message on a healthy link stays on the events."""
    from malleus_ds.emulation.links import LinkSchedule

    slept = []
    links = LinkSchedule.parse([{"nodes": [0, 1], "rate": 3.0}], 4, 2)
    c = ComputeClock(None, cuda=True, links=links, sleep=slept.append)
    c.comm_log = CommLog(lambda r: r // 2)
    c.start_step(0)
    with c.comm((0, 1), 1.0, "p2p"):            # inside node 0: not slowed
        gpu.now += 0.1
    assert gpu.syncs == 0 and slept == []
    with c.comm((0, 2), 1.0, "p2p"):            # across the slow link
        gpu.now += 0.5
    assert gpu.syncs == 1 and slept == pytest.approx([1.0])
    with c.comm((0, 2), 0.2, "probe"):
        gpu.now += 0.1
    assert gpu.syncs == 2 and slept == pytest.approx([1.0, 0.2])
    v = c.comm_log.values()
    assert v[:3] == pytest.approx([3.0, 1.0, 1.5])          # the emulated wait included
    assert v[PROBE:] == pytest.approx([3.0, 0.2, 0.3])
    c.start_step(1)
    assert c.comm_log.values()[:6] == pytest.approx([2.0, 1.0, 0.1, 0.0, 0.0, 0.0])
