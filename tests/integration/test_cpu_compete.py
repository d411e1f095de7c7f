"""Competitor processes (straggler.method=compete) of a killed rank exit by themselves."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from malleus_ds.emulation import cpu_compete as cc


def test_competitors_of_a_killed_rank_exit_by_themselves(tmp_path):
    reason = cc.unavailable_reason()
    if reason:
        pytest.skip(f"no CPU affinity here: {reason}")
    code = ("import sys, time; from malleus_ds.emulation.cpu_compete import CpuCompetitor as C; "
            "c = C(); c.set_rate(2.0); print(c.procs[0].pid, flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    pid = int(p.stdout.readline())
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        # a zombie of ours? (the competitor's parent was the killed process, so init reaps it)
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("a competitor outlived its rank by 20 s")
