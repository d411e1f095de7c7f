"""Doing a fault to a running job: find the process, signal it, cap it, fill its disk.

Each live fault of a :class:`~malleus_ds.chaos.schedule.Schedule` becomes an :class:`Injection`
when the job reaches its step; the ones that last (a quota, a full disk, a freeze) are undone
by :meth:`Injection.end` at their end step, or when the run is over. A fault that cannot be done
on this machine (no cgroup CPU controller, no tmpfs) is reported as not done, never faked.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..resilience.procs import cmdline, descendants, parent_of
from .schedule import Fault

PLANNER = "malleus_ds.planner.worker"


def _below(launchers: Sequence[int]) -> list[int]:
    """Every process under any of ``launchers``."""
    return [d for launcher in launchers for d in descendants(launcher)]


def rank_process(launchers: Sequence[int], rank: int) -> int | None:
    """The training process of ``rank`` under ``launchers`` (one per node): ``RANK=<rank>`` in
    its environment and not the child of another such process (rank 0's planner inherits its
    environment)."""
    found = []
    for pid in _below(launchers):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            found.append(pid)
    top = [p for p in found if parent_of(p) not in found]
    return top[0] if top else None


def planner_process(launchers: Sequence[int]) -> int | None:
    for pid in _below(launchers):
        if any(PLANNER in a for a in cmdline(pid)):
            return pid
    return None


def fill(disk: Path, name: str = "chaos-filler") -> Path:
    """Write zeros into ``disk`` until no byte is left; returns the filler file (OSError: the
    disk takes no file at all, e.g. read-only)."""
    f = disk / name
    with open(f, "wb") as out:
        block = b"\0" * (1 << 16)
        try:
            while True:
                out.write(block)
                out.flush()
        except OSError:
            pass
    return f


@dataclass
class Injection:
    """One fault being done (or that could not be): ``done`` says which, ``note`` why not."""

    fault: Fault
    done: bool = False
    note: str = ""
    _undo: list = field(default_factory=list)

    def end(self) -> bool:
        """Undo what lasts; what cannot be undone now (a file on a disk another fault made
        read-only) is kept for the next call. True when nothing is left."""
        left = []
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except ProcessLookupError:
                pass                    # the process is gone: nothing to undo
            except OSError:
                left.append(fn)
        self._undo = left[::-1]
        return not left


def _remount(disk: Path, mode: str) -> bool:
    import subprocess

    return subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)],
                          capture_output=True).returncode == 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def inject(f: Fault, launchers: Sequence[int], disk: Path | None) -> Injection:
    """Do ``f`` to the job under ``launchers`` now (the first: the one a SIGTERM goes to;
    ``disk``: its checkpoint tmpfs, or None). A lost node is the job's to do
    (``run.TwoNodes.lose_node``)."""
    inj = Injection(f)
    if f.kind in ("quota", "freeze", "hang", "kill"):
        pid = rank_process(launchers, f.rank)
        if pid is None:
            inj.note = f"rank {f.rank} has no process now (restarting?)"
            return inj
        if f.kind == "kill":
            _signal(pid, signal.SIGKILL)
        elif f.kind == "hang":
            _signal(pid, signal.SIGSTOP)
            inj._undo.append(lambda: _signal(pid, signal.SIGKILL))   # at the end, if it lingers
        elif f.kind == "freeze":
            _signal(pid, signal.SIGSTOP)
            t = threading.Timer(f.seconds, _signal, (pid, signal.SIGCONT))
            t.start()
            inj._undo.append(lambda: (t.cancel(), _signal(pid, signal.SIGCONT)))
        else:
            from ..emulation.cpu_quota import CpuQuota, CpuQuotaError
            try:
                q = CpuQuota(pid=pid)
                q.set_rate(f.rate)
            except (CpuQuotaError, OSError) as e:
                inj.note = f"no CPU quota here: {e}"
                return inj
            inj._undo.append(q.close)
    elif f.kind == "planner_kill":
        pid = planner_process(launchers)
        if pid is None:
            inj.note = "no planner process now"
            return inj
        _signal(pid, signal.SIGKILL)
    elif f.kind == "disk_full":
        if disk is None:
            inj.note = "no checkpoint tmpfs to fill (mount failed)"
            return inj
        try:
            filler = fill(disk, f"chaos-filler-{f.step}")
        except OSError as e:
            inj.note = f"cannot fill {disk}: {e.strerror or e}"
            return inj
        inj._undo.append(lambda: filler.unlink(missing_ok=True))
    elif f.kind == "disk_ro":
        if disk is None:
            inj.note = "no checkpoint tmpfs to make read-only (mount failed)"
            return inj
        if not _remount(disk, "ro"):
            inj.note = f"cannot remount {disk} read-only"
            return inj
        def writable() -> None:
            if not _remount(disk, "rw"):
                raise OSError(f"cannot remount {disk} read-write")
        inj._undo.append(writable)
    elif f.kind == "sigterm":
        _signal(launchers[0], signal.SIGTERM)
    else:
        inj.note = f"{f.kind} is set at launch, not injected"
        return inj
    inj.done = True
    return inj
