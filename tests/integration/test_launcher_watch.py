"""Under the deepspeed launcher both the launcher and the runner are watched
(app/runners/guard.py), with real processes."""
import os
import signal
import subprocess
import sys
import threading
import time

from malleus_ds.app.runners.guard import LAUNCHER_GONE, Launcher, LauncherWatch, StopSignals, launchers_above
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


def test_under_the_deepspeed_launcher_both_launch_and_the_runner_are_watched():
    top = subprocess.Popen([sys.executable, "-c", TREE, "deepspeed"], stdout=subprocess.PIPE,
                           text=True)
    try:
        leaf = int(top.stdout.readline())
        mid = procs.parent_of(leaf)
        found = launchers_above(leaf, environ={})
        assert [x.pid for x in found] == [mid, top.pid], found
        assert found[0].name == "deepspeed.launcher.launch"
        # torchrun's agent is recognised by its environment; a bare process watches nothing
        assert [x.pid for x in launchers_above(mid, environ={"TORCHELASTIC_RUN_ID": "x"})] == \
            [top.pid]
        assert launchers_above(mid, environ={}) == []
        w = launchers_above(mid, environ={"MALLEUS_DS_WRAPPER_PID": str(os.getpid())})
        assert [x.pid for x in w] == [os.getpid()]
    finally:
        for pid in procs.descendants(top.pid) + [top.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        top.wait()


def test_a_dead_launcher_raises_the_stop_flag_then_the_deadline_exits():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    flag, exited = StopSignals(), threading.Event()
    codes = []
    watch = LauncherWatch([Launcher(sleeper.pid, procs.start_time(sleeper.pid), "fake")], rank=0,
                          interval_s=0.05, grace_s=0.5, stop=flag,
                          exit=lambda c: (codes.append(c), exited.set()))
    watch.start()
    try:
        time.sleep(0.3)
        assert flag.signum == 0 and watch.gone is None       # alive: nothing happens
        sleeper.kill()
        sleeper.wait()
        assert exited.wait(10), "the watch never gave up on a stop that did not come"
        assert flag.signum == LAUNCHER_GONE and watch.gone.pid == sleeper.pid
        assert codes == [128 + LAUNCHER_GONE]
    finally:
        watch.stop()
        if sleeper.poll() is None:
            sleeper.kill()
