"""app/runners/guard.py: a rank notices when its launcher dies without signalling it (pure-ish: real
processes, no process groups)."""
import os
import signal

from malleus_ds.app.runners.guard import LAUNCHER_GONE, StopSignals, Stopped
from malleus_ds.resilience import procs

# a process tree shaped like `deepspeed` -> `python -m deepspeed.launcher.launch` -> rank: the
# middle process's argv names deepspeed.launcher.launch; the leaf prints its pid and sleeps
TREE = r"""
import subprocess, sys, time
leaf = "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)"
mid = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', %r]); p.wait()" % leaf)
p = subprocess.Popen([sys.executable, "-c", mid, "deepspeed." + "launcher.launch"])
p.wait()
"""


def test_a_reused_pid_is_not_mistaken_for_the_launcher():
    me = os.getpid()
    assert procs.is_alive(me, procs.start_time(me))
    assert not procs.is_alive(me, procs.start_time(me) + 1)      # another process's start time


def test_stop_messages():
    assert "stopped by SIGTERM after step 7" in str(Stopped(int(signal.SIGTERM), 7))
    msg = str(Stopped(LAUNCHER_GONE, 7, "ck/global_step7"))
    assert "after step 7: the launcher exited without stopping the ranks" in msg
    assert "checkpoint ck/global_step7" in msg
    # a real signal after the launcher's loss is a first signal, not the second
    s = StopSignals()
    s.signum = LAUNCHER_GONE
    s._handle(int(signal.SIGTERM), None)
    assert s.signum == signal.SIGTERM
