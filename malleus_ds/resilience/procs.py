"""Process-tree helpers (Linux ``/proc``): the launcher wrapper signals torchrun's workers,
which run in sessions of their own, directly."""
from __future__ import annotations

import os
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """One object per process, made by ``make`` on first use (again if ``usable`` says the last
    one is spent) and closed by :meth:`release`: the CPU quota (``cpu_quota.py``) and the CPU
    competitors (``cpu_compete.py``) of a straggler emulation each keep one."""

    def __init__(self, make: Callable[[], T], usable: Callable[[T], bool] = lambda obj: True):
        self._make, self._usable, self._obj = make, usable, None

    def get(self) -> T:
        if self._obj is None or not self._usable(self._obj):
            self._obj = self._make()
        return self._obj

    def release(self) -> None:
        """Close this process's object, if any (end of a run)."""
        obj, self._obj = self._obj, None
        if obj is not None:
            obj.close()


def children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, for every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: parse after the last ')'
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs)."""
    kids, out, todo = children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (field 3 onwards), or None if ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: parse after the last ')'
    return stat[stat.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22), or None if
    there is no such process. (pid, start time) names a process even after its pid is reused."""
    f = _stat_fields(pid)
    return None if f is None else int(f[19])


def parent_of(pid: int) -> int | None:
    f = _stat_fields(pid)
    return None if f is None else int(f[1])


def cmdline(pid: int) -> list[str]:
    """The process's argv ([] if it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def is_alive(pid: int, started: int | None) -> bool:
    """``pid`` still names the process that started at ``started`` and has not exited (a zombie,
    state Z, counts as exited)."""
    f = _stat_fields(pid)
    return f is not None and f[0] != "Z" and (started is None or int(f[19]) == started)


def is_stopped(pid: int, started: int | None) -> bool:
    """``pid`` still names the process that started at ``started`` and is stopped (SIGSTOP, a
    debugger: state T or t): it runs no thread, so nothing it hosts (a store) answers."""
    f = _stat_fields(pid)
    return f is not None and f[0] in ("T", "t") and (started is None or int(f[19]) == started)


def is_running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    f = _stat_fields(pid)
    return f is not None and f[0] != "Z"


def rank_pid(root: int, rank: int) -> int | None:
    """The process below ``root`` (a launcher) that runs training rank ``rank``: the one whose
    environment has ``RANK=<rank>`` and a ``LOCAL_RANK`` (as torchrun and the deepspeed
    launcher set them); None if there is none (yet)."""
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return pid
    return None
