"""app/runners/guard.py: a rank notices when its launcher dies without signalling it (a reused pid,
the stop messages; with real launcher processes: tests/integration/test_launcher_watch.py)."""
import os
import signal

from malleus_ds.app.runners.guard import LAUNCHER_GONE, StopSignals, Stopped
from malleus_ds.resilience import procs


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
