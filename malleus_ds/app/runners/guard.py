"""A run's guards: the hung-rank watchdog (``malleus_ds/resilience/watchdog.py``) and clean stops on
SIGTERM / SIGINT.

Signals: the first SIGTERM or SIGINT a rank receives only raises a flag (:data:`STOP`). The flag
rides in the per-step collective every runner already does (engine=malleus: the step's
all-reduce, ``MalleusEngine.set_stop_source``; the others: ``StepReporter.step_done``'s
all-gather), where every rank reads the largest, so all ranks agree on the same step boundary
(a flag raised after that collective shows in the next step's); there, with ``checkpoint.dir``
set, they save a checkpoint (what SLURM and Kubernetes expect after SIGTERM), metrics.jsonl is
flushed and closed, and :class:`Stopped` unwinds the run: the app prints one line and exits
with 128 + the signal number. A second signal acts at once (SIGINT: KeyboardInterrupt; SIGTERM: exit).

A launcher that dies without signalling its ranks (the ``deepspeed`` runner does not pass
SIGTERM on to ``deepspeed.launcher.launch``; any launcher can be killed with -9) must not leave
them training as orphans: :class:`LauncherWatch` watches the launcher processes above this rank
and, when one is gone, raises the same flag with :data:`LAUNCHER_GONE`, so every rank stops after
the same step, checkpoints and closes metrics.jsonl, as for SIGTERM.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...report.metrics import METRICS_FILE
from ...resilience.watchdog import Watchdog, watchdog_store


#: the stop code a rank raises when its launcher is gone (SIGHUP: "the controlling side hung
#: up"); a real SIGTERM/SIGINT on any rank outranks it in the step's collective (max)
LAUNCHER_GONE = int(signal.SIGHUP)


class Stopped(Exception):
    """Every rank stopped at the same step boundary after a signal (or its launcher's death)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None = None,
                 unsaved: str | None = None) -> None:
        """``unsaved``: why the stop's own checkpoint could not be written (the error, which
        names the latest checkpoint on disk); the stop happens all the same."""
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint {checkpoint}" if checkpoint else ""
        if unsaved:
            where = f"; its checkpoint could not be written, so the next run continues from " \
                    f"the latest one and does the steps since again: {unsaved}"
        why = (f"stopped after step {step}: the launcher exited without stopping the ranks"
               if signum == LAUNCHER_GONE else
               f"stopped by {signal.Signals(signum).name} after step {step}")
        super().__init__(f"{why}{where}; metrics.jsonl is complete up to there")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGTERM / SIGINT -> a flag read at step boundaries (main thread only). ``on_first``:
    callables run with the signal number when the first signal arrives (a peer-loss watch)."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, object] = {}
        self.on_first: list = []

    def install(self) -> None:
        import threading

        self.signum = 0
        if threading.current_thread() is not threading.main_thread():
            return              # signal handlers live in the main thread (tests call from others)
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum and self.signum != LAUNCHER_GONE:    # the second signal: stop now
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + signum)
        first = not self.signum
        self.signum = signum
        if first:
            for fn in list(self.on_first):
                fn(signum)


STOP = StopSignals()


@dataclass(frozen=True)
class Launcher:
    """A process above this rank whose death must stop it: (pid, start time) and a name."""

    pid: int
    started: int | None
    name: str


def launchers_above(pid: int | None = None, environ=None) -> list[Launcher]:
    """The launcher processes whose death should stop the rank ``pid`` (default: this process):

    * under ``deepspeed.launcher.launch`` (the ``deepspeed`` command's per-node child): that
      process and its parent (the ``deepspeed`` runner locally, pdsh's remote shell on a cluster):
      the runner dies of SIGTERM without passing it on;
    * under torchrun's agent (``TORCHELASTIC_RUN_ID`` set): the agent;
    * under ``python launch/train.py nproc_per_node=N`` (``MALLEUS_DS_WRAPPER_PID``): the wrapper.

    A bare process (no launcher) watches nothing: its parent is a shell, and a run under
    ``nohup`` must outlive the terminal."""
    from ...resilience import procs

    env = os.environ if environ is None else environ
    me = os.getpid() if pid is None else pid
    parent = procs.parent_of(me)
    out: list[Launcher] = []
    if parent and parent > 1:
        argv = procs.cmdline(parent)
        if "deepspeed.launcher.launch" in argv:        # python -u -m deepspeed.launcher.launch
            out.append(Launcher(parent, procs.start_time(parent), "deepspeed.launcher.launch"))
            gp = procs.parent_of(parent)
            if gp and gp > 1:
                gargv = procs.cmdline(gp)
                name = "deepspeed" if any(a.endswith("deepspeed") or "deepspeed.launcher.runner"
                                          in a for a in gargv[:3]) else " ".join(gargv[:2])
                out.append(Launcher(gp, procs.start_time(gp), name or f"pid {gp}"))
        elif env.get("TORCHELASTIC_RUN_ID"):
            out.append(Launcher(parent, procs.start_time(parent), "torchrun"))
    wrapper = env.get("MALLEUS_DS_WRAPPER_PID")
    if wrapper and wrapper.isdigit() and int(wrapper) not in (me, *(x.pid for x in out)):
        w = int(wrapper)
        out.append(Launcher(w, procs.start_time(w), "launch/train.py nproc_per_node=N"))
    return [x for x in out if x.started is not None]     # already gone: nothing to watch


class LauncherWatch:
    """A daemon thread that checks the launchers above this rank every ``interval_s``. When one
    is gone it raises :data:`STOP` with :data:`LAUNCHER_GONE` (every rank then stops after the
    same step, as after SIGTERM) and, should this process still run ``grace_s`` later (stuck
    before a step boundary), exits it with status 128 + SIGHUP."""

    def __init__(self, launchers: list[Launcher], rank: int, interval_s: float = 0.5,
                 grace_s: float = 120.0, stop: StopSignals | None = None,
                 exit=os._exit) -> None:
        self.launchers, self.rank = launchers, rank
        self.interval_s, self.grace_s = interval_s, grace_s
        self.stop_flag = stop or STOP
        self._exit = exit
        self.gone: Launcher | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="malleus-launcher-watch",
                                        daemon=True)

    def start(self) -> "LauncherWatch":
        if self.launchers:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        from ...resilience import procs

        while not self._done.wait(self.interval_s):
            gone = next((x for x in self.launchers if not procs.is_alive(x.pid, x.started)), None)
            if gone is None:
                continue
            self.gone = gone
            if not self.stop_flag.signum:
                self.stop_flag.signum = LAUNCHER_GONE
            print(f"[malleus_ds] rank {self.rank}: the launcher {gone.name} (pid {gone.pid}) "
                  f"exited without stopping this rank: stopping after the current step",
                  file=sys.stderr, flush=True)
            if self._done.wait(self.grace_s):
                return
            print(f"[malleus_ds] rank {self.rank}: still running {self.grace_s:.0f} s after its "
                  f"launcher exited: exiting now", file=sys.stderr, flush=True)
            sys.stderr.flush()
            self._exit(128 + LAUNCHER_GONE)
            return


def leave_when_a_peer_is_gone(dog: Watchdog, rank: int, signum: int, grace_s: float = 30.0,
                              every_s: float = 0.2, exit=os._exit) -> threading.Thread:
    """After a stop signal, watch for a peer process that is gone (``Watchdog.gone_peers``);
    if one is, exit at once with ``128 + signum``. torchrun signals every worker when one of
    them dies (killed, OOM, a segfault): the survivors are then blocked in a collective or an
    agreement with the dead rank, a stop at a step boundary can never be agreed, and the agent
    would wait ``grace_s`` (its 30 s) before its SIGKILL, which delays the restart. A stop
    whose ranks are all alive is left to finish (it checkpoints)."""
    def run() -> None:
        seen: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                gone = dog.gone_peers(seen)
            except Exception:  # noqa: BLE001 - store gone: the agent is ending the job
                gone = []
            if gone:
                print(f"[malleus_ds] rank {rank}: {signal.Signals(signum).name} and rank(s) "
                      f"{gone} gone: no step boundary can be agreed without them; exiting now",
                      file=sys.stderr, flush=True)
                exit(128 + signum)
                return
            time.sleep(every_s)

    t = threading.Thread(target=run, name="malleus-peer-loss", daemon=True)
    t.start()
    return t


def start_watchdog(cfg, env) -> Watchdog | None:
    """The hung-rank watchdog of this rank (multi-rank runs with ``hang_timeout_s`` > 0)."""
    if env.world_size < 2 or not cfg.hang_timeout_s:
        return None
    store = watchdog_store(timeout_s=min(30.0, max(5.0, cfg.hang_timeout_s / 2)))
    if store is None:
        return None
    metrics = Path(cfg.run_dir) / METRICS_FILE if (env.is_rank0 and cfg.run_dir) else None

    def log(report: dict) -> None:
        if metrics is not None:     # the main thread is blocked: nothing else writes now
            with open(metrics, "a") as f:
                f.write(json.dumps(report) + "\n")

    prefix = f"malleus_wd/{os.environ.get('MALLEUS_DS_ATTEMPT', '0')}"    # base.attempt_store
    return Watchdog(store, env.rank, env.world_size, cfg.hang_timeout_s, on_hang=log,
                    prefix=prefix).start()
