"""``straggler.method=compete`` slows a workload for real: two busy processes pinned beside this
one on its core (``malleus_ds/emulation/cpu_compete.py``), and nothing left once closed. It
reads wall timings, so it runs with the cores to itself (``alone``: its file is not in
tests/conftest.py's SHARE_CORES): another process on the core would dilute the slowdown."""
from __future__ import annotations

import os
import time

import pytest

from malleus_ds.emulation import cpu_compete as cc


def _work(n: int = 200_000) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t0


def test_a_competitor_really_slows_this_process_and_leaves_no_trace():
    reason = cc.unavailable_reason()
    if reason:
        pytest.skip(f"no CPU affinity here: {reason}")
    before = os.sched_getaffinity(0)
    c = cc.CpuCompetitor()
    try:
        os.sched_setaffinity(0, {c.core})
        alone = min(_work() for _ in range(5))
        c.set_rate(3.0)
        assert len(c.procs) == 2 and os.sched_getaffinity(0) == {c.core}
        _work()                                          # they start meanwhile
        slowed = sorted(_work() for _ in range(5))[2]
        # 3x nominally; loose: the machine's other core may take a competitor now and then
        assert slowed / alone >= 1.6, (alone, slowed)
        c.set_rate(2.5)                                  # nice changes: restarted at nice 1
        assert len(c.procs) == 2 and c.nice == 1
        procs = list(c.procs)
    finally:
        c.close()
    assert os.sched_getaffinity(0) == before and c.procs == []
    assert all(p.poll() is not None for p in procs)
