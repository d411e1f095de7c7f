"""The compute clock on CPU with a real competitor: a busy neighbour on the same core does not slow
the clock (engine/clock.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from malleus_ds.engine.clock import ComputeClock, thread_times


_SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


@pytest.mark.skipif(thread_times() is None or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux schedstat and CPU affinity")
def test_a_busy_neighbour_on_the_same_core_does_not_slow_the_clock():
    """Real: this thread and a spinning process pinned to one core share it; the wall time of
    a fixed CPU loop roughly doubles, the clock's reading stays near its CPU seconds."""
    core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    spin = subprocess.Popen([sys.executable, "-c", _SPIN, str(core)])
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)                                  # the spinner is on its core
        c = ComputeClock(None)
        c.start_step(0)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        with c.compute():
            x = 0
            while time.thread_time() - cpu0 < 0.3:
                x += 1
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    finally:
        spin.kill()
        spin.wait()
        os.sched_setaffinity(0, before)
    assert wall > 1.4 * cpu, (wall, cpu)                 # the neighbour did take the core
    assert c.compute_s < 1.15 * cpu and c.compute_s > 0.9 * cpu, (c.compute_s, wall, cpu)
