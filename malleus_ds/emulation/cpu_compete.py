"""A real slowdown without cgroups: busy processes pinned to this process's core.

``straggler.method=compete`` (``straggler.py``) slows a rank the way a noisy neighbour does: the
rank is pinned to one core and ``n`` spinning processes are pinned beside it. The kernel's fair
scheduler then gives the rank ``w0 / (w0 + n·w)`` of that core, where ``w0`` = 1024 is the
weight of nice 0 and ``w`` the weight of the competitors' nice value (:data:`NICE_WEIGHTS`,
the kernel's ``sched_prio_to_weight``): :func:`competitors` picks ``n = ceil(rate - 1)`` and the
nice value whose weight makes that share closest to ``1/rate``. It needs only
``os.sched_setaffinity`` (Linux) and no privileges (raising one's own nice value is always
allowed); where a cgroup CPU quota is possible (``cpu_quota.py``, ``method=quota``) that is the
tighter cap. Unlike a quota, competitors also take the core's caches and memory bandwidth, and
the share holds only while the rank is runnable: a rank that waits on a collective gives its
time to them.

The competitors are child processes started with ``python -c`` (no fork of a process that has
torch threads); each checks every few milliseconds that its parent is alive and exits when it is
not, so a killed rank never leaves them spinning. :meth:`CpuCompetitor.close` (also at exit)
stops them and restores the rank's CPU affinity.
"""
from __future__ import annotations

import atexit
import math
import os
import subprocess
import sys

from ..resilience.procs import PerProcess

#: CFS weight per nice value 0..19 (kernel/sched/core.c, ``sched_prio_to_weight``)
NICE_WEIGHTS = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
                110, 87, 70, 56, 45, 36, 29, 23, 18, 15)
#: the most competitors per rank (rate 17): more only adds start-up time and noise
MAX_COMPETITORS = 16

_SPIN = """
import os, sys
core, parent, nice = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {core})
os.nice(nice)
while os.getppid() == parent:
    for _ in range(20000):
        pass
"""


class CpuCompeteError(RuntimeError):
    """Competing processes cannot be set up here; the message says why."""


def unavailable_reason() -> str | None:
    """Why ``method=compete`` cannot run here, or None."""
    if not hasattr(os, "sched_setaffinity"):
        return f"os.sched_setaffinity is not available on {sys.platform} (Linux only)"
    try:
        os.sched_getaffinity(0)
    except OSError as e:
        return f"cannot read this process's CPU affinity: {e.strerror or e}"
    return None


def competitors(rate: float) -> tuple[int, int]:
    """(how many spinning processes, their nice value) so that a rank pinned to their core gets
    the share of it closest to ``1/rate``; (0, 0) for ``rate <= 1``."""
    if not math.isfinite(rate):
        raise ValueError(f"rate={rate} must be finite")
    if rate <= 1.0:
        return 0, 0
    n = min(MAX_COMPETITORS, math.ceil(rate - 1.0 - 1e-9))
    per = NICE_WEIGHTS[0] * (rate - 1.0) / n          # the weight each competitor should have
    nice = min(range(len(NICE_WEIGHTS)), key=lambda k: abs(NICE_WEIGHTS[k] - per))
    return n, nice


def share(n: int, nice: int) -> float:
    """The core share a runnable nice-0 rank gets beside ``n`` competitors of ``nice``."""
    return NICE_WEIGHTS[0] / (NICE_WEIGHTS[0] + n * NICE_WEIGHTS[nice])


def pick_core(cores: set[int] | frozenset[int], local_rank: int) -> int:
    """The core a rank is pinned to: the ``local_rank``-th of the cores it may use (wrapping)."""
    if not cores:
        raise CpuCompeteError("this process may run on no core")
    ordered = sorted(cores)
    return ordered[local_rank % len(ordered)]


class CpuCompetitor:
    """This process pinned to one core, with competing processes beside it (module doc)."""

    def __init__(self, core: int | None = None) -> None:
        why = unavailable_reason()
        if why:
            raise CpuCompeteError(why)
        self.original = frozenset(os.sched_getaffinity(0))
        self.core = core if core is not None else \
            pick_core(self.original, int(os.environ.get("LOCAL_RANK", "0")))
        self.procs: list[subprocess.Popen] = []
        self.nice = 0
        self.rate = 1.0
        atexit.register(self.close)

    def set_rate(self, rate: float) -> None:
        """Run about ``rate`` times slower than alone on a core (1.0: no competitors, the
        original affinity back)."""
        n, nice = competitors(rate)
        if nice != self.nice:
            self._stop(0)
            self.nice = nice
        self._stop(n)
        if n:
            os.sched_setaffinity(0, {self.core})
        else:
            os.sched_setaffinity(0, self.original)
        while len(self.procs) < n:
            try:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(self.core), str(os.getpid()), str(nice)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL))
            except OSError as e:
                self.close()
                raise CpuCompeteError(f"cannot start a competing process: {e}") from None
        self.rate = float(rate)

    def _stop(self, keep: int) -> None:
        while len(self.procs) > keep:
            p = self.procs.pop()
            p.kill()
            p.wait()

    def close(self) -> None:
        """Stop the competitors, restore the affinity. Idempotent (also run at exit)."""
        self._stop(0)
        self.nice, self.rate = 0, 1.0
        try:
            os.sched_setaffinity(0, self.original)
        except OSError:
            pass
        atexit.unregister(self.close)


_PROCESS: PerProcess[CpuCompetitor] = PerProcess(lambda: CpuCompetitor())


def process_competitor() -> CpuCompetitor:
    """This process's one :class:`CpuCompetitor`, created on first use."""
    return _PROCESS.get()


def release() -> None:
    """Stop this process's competitors (end of a run). No-op if none."""
    _PROCESS.release()


def calibrate(rates=(2.0, 3.0, 6.0), repeats: int = 3, workload=None, out=print
              ) -> dict[float, float]:
    """Measured slowdown per rate: a fixed workload's median time beside the rate's competitors
    over its median time alone on the same core."""
    import statistics

    from .cpu_quota import _matmul_workload

    work = workload or _matmul_workload
    c = CpuCompetitor()
    try:
        c.set_rate(1.0)
        os.sched_setaffinity(0, {c.core})
        work()
        alone = statistics.median(work() for _ in range(repeats))
        out(f"alone on core {c.core}: {alone:.3f} s")
        res = {}
        for r in rates:
            c.set_rate(r)
            work()                                # the competitors start up meanwhile
            t = statistics.median(work() for _ in range(repeats))
            c.set_rate(1.0)
            os.sched_setaffinity(0, {c.core})
            res[float(r)] = t / alone
            n, nice = competitors(r)
            out(f"rate {r:g}: {n} competitor(s) at nice {nice} -> {t:.3f} s, measured "
                f"slowdown {t / alone:.2f}x")
        return res
    finally:
        c.close()
