"""Real slowdowns from the OS: cap this process's CPU with a cgroup (``straggler.method=quota``).

Contract:

* :class:`CpuQuota` puts this process (every thread: it writes ``cgroup.procs``) into a cgroup of
  its own, ``malleus-<pid>``, and :meth:`CpuQuota.set_rate` caps it: rate ``1.0`` = no limit
  (v1 ``cpu.cfs_quota_us = -1``, v2 ``cpu.max = "max PERIOD"``), rate ``r > 1`` = a quota of
  ``period / r`` per period. **The rate is relative to one full core**: a rank runs one compute
  thread (``OMP_NUM_THREADS=1``), so alone on a free core it runs ``r`` times slower. On a shared,
  oversubscribed machine its peers get less than a core each, so its slowdown relative to them
  is smaller (docs/DESIGN.md, real slowdowns; ``--calibrate`` measures it).
* Where: cgroup v1 -> ``<root>/cpu/malleus-<pid>`` (the cpu controller's mount); cgroup v2 ->
  a child of this process's current cgroup when delegation lets us enable ``cpu`` there, else a
  child of the root. Creating one removes stale ``malleus-<pid>`` folders whose process is dead
  (a crashed process leaves an empty one behind).
* :meth:`CpuQuota.close` (also run at exit) moves the process back to its original cgroup and
  removes the folder. Idempotent.
* :func:`unavailable_reason` says precisely why this cannot work here (not Linux, no cpu
  controller, not writable, ...), or ``None``.
* The period is ours (default 50 ms, not the kernel's 100 ms): the throttle pause is up to
  ``period - quota``, so a shorter period spreads the slowdown more evenly over a step of tens
  of milliseconds; but the kernel hands runtime out in slices of
  ``/proc/sys/kernel/sched_cfs_bandwidth_slice_us`` (5 ms), so a quota below that overshoots
  (the process runs slower than its rate). 50 ms keeps the quota >= 5 ms up to rate 10.
  The kernel's smallest quota is 1 ms: the largest rate is ``period_us / 1000`` (50).

``python -m malleus_ds.emulation.cpu_quota --calibrate [--rates 2,3,6] [--busy N]`` times a fixed
single-threaded torch matmul loop alone and under each rate's quota and prints the measured
slowdown ("the true slowdown is the same work timed alone under the same quota").

Stdlib only (the calibration workload imports torch lazily).
"""
from __future__ import annotations

import atexit
import errno
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..resilience.procs import PerProcess

SYS_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
DEFAULT_PERIOD_US = 50_000
MIN_QUOTA_US = 1_000            # the kernel refuses a smaller cfs quota
_NAME = re.compile(r"^malleus-(\d+)$")


class CpuQuotaError(RuntimeError):
    """The cgroup could not be set up or changed; the message names the file and the errno."""


def quota_us(rate: float, period_us: int) -> int | None:
    """The quota for ``rate`` (``None`` = no limit). ``rate`` is relative to one full core."""
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate >= 1.0 \
            or rate == float("inf"):
        raise ValueError(f"rate={rate!r} must be a finite number >= 1.0 (1.0 = no limit)")
    if rate == 1.0:
        return None
    q = int(round(period_us / rate))
    if q < MIN_QUOTA_US:
        raise ValueError(f"rate={rate} needs a quota of {period_us / rate:.0f} us per "
                         f"{period_us} us period, below the kernel's minimum of {MIN_QUOTA_US} "
                         f"us; the largest rate is {period_us / MIN_QUOTA_US:g}")
    return q


@dataclass(frozen=True)
class Layout:
    """Where this process's cpu cgroup lives. ``parents``: folders to try for ``malleus-<pid>``,
    best first; ``original``: the cgroup folder the process is in now."""

    version: int                    # 1 or 2
    root: Path                      # the cpu controller's mount (v1) or the unified root (v2)
    original: Path
    parents: tuple[Path, ...]


def _own_path(proc_cgroup: str, version: int) -> str:
    """This process's cgroup path (relative to the mount) from ``/proc/self/cgroup``."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return "/"
    for ln in lines:
        parts = ln.split(":", 2)
        if len(parts) != 3:
            continue
        if version == 2 and parts[0] == "0" and parts[1] == "":
            return parts[2] or "/"
        if version == 1 and "cpu" in parts[1].split(","):
            return parts[2] or "/"
    return "/"


def _under(root: Path, rel: str) -> Path:
    return root.joinpath(*[p for p in rel.split("/") if p])


def detect(sys_root: str = SYS_ROOT, proc_cgroup: str = PROC_CGROUP) -> Layout | None:
    """The cpu controller's layout here (v1 first: a hybrid host mounts v2 without ``cpu``), or
    ``None`` when no cpu controller is mounted."""
    base = Path(sys_root)
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        root = base / name
        if (root / "cpu.cfs_quota_us").exists():
            return Layout(1, root, _under(root, _own_path(proc_cgroup, 1)), (root,))
    ctrl = base / "cgroup.controllers"
    if ctrl.exists() and "cpu" in _read(ctrl).split():
        own = _under(base, _own_path(proc_cgroup, 2))
        parents = (own, base) if own != base else (base,)
        return Layout(2, base, own, parents)
    return None


def own_cap(sys_root: str = SYS_ROOT, proc_cgroup: str = PROC_CGROUP) -> float:
    """How many times slower than one full core this process's own cpu cgroup lets it run
    (``period / quota``; 1.0 without a quota, or where no cpu controller is readable). Read, not
    assumed: a quota set by anyone (this module, a job scheduler) counts; a parent's does not."""
    lay = detect(sys_root, proc_cgroup)
    if lay is None:
        return 1.0
    try:
        if lay.version == 1:
            q = int(_read(lay.original / "cpu.cfs_quota_us") or -1)
            per = int(_read(lay.original / "cpu.cfs_period_us") or 0)
        else:
            q_s, _, per_s = (_read(lay.original / "cpu.max") or "max").partition(" ")
            q, per = (-1 if q_s == "max" else int(q_s)), int(per_s or 0)
    except ValueError:
        return 1.0
    return per / q if q > 0 and per > 0 and per > q else 1.0


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(parent: Path, alive=_alive) -> list[Path]:
    """Remove ``malleus-<pid>`` folders under ``parent`` whose process is dead; returns them.
    A folder still holding processes (the kernel refuses to remove it) is left alone."""
    out = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return out
    for d in entries:
        m = _NAME.match(d.name)
        if m and d.is_dir() and not alive(int(m.group(1))):
            try:
                d.rmdir()
                out.append(d)
            except OSError:
                pass
    return out


def _v2_cpu_enabled(parent: Path) -> bool:
    """``cpu`` is (or can be made) enabled for the children of ``parent`` (v2 delegation)."""
    sub = parent / "cgroup.subtree_control"
    if "cpu" in _read(sub).split():
        return True
    try:
        sub.write_text("+cpu")
    except OSError:
        return False
    return "cpu" in _read(sub).split()


def unavailable_reason(sys_root: str = SYS_ROOT, proc_cgroup: str = PROC_CGROUP) -> str | None:
    """Why a :class:`CpuQuota` cannot work here, or ``None``. Creates and removes a probe
    folder (the only sure test of write access)."""
    if not sys.platform.startswith("linux"):
        return f"CPU quotas need Linux cgroups; this is {sys.platform}"
    lay = detect(sys_root, proc_cgroup)
    if lay is None:
        return (f"no cgroup cpu controller is mounted (looked for {sys_root}/cpu/cpu.cfs_quota_us "
                f"(cgroup v1) and 'cpu' in {sys_root}/cgroup.controllers (cgroup v2))")
    why = []
    for parent in lay.parents:
        if lay.version == 2 and not _v2_cpu_enabled(parent):
            why.append(f"{parent}/cgroup.subtree_control does not enable 'cpu' and cannot be "
                       f"written")
            continue
        probe = parent / f"malleus-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return None
        except OSError as e:
            why.append(f"cannot create a cgroup under {parent} (cgroup v{lay.version}): "
                       f"{errno.errorcode.get(e.errno, e.errno)} {e.strerror} (uid {os.getuid()})")
    return "; ".join(why)


class CpuQuota:
    """This process in a cgroup of its own, its CPU capped by :meth:`set_rate` (module doc)."""

    def __init__(self, sys_root: str = SYS_ROOT, proc_cgroup: str = PROC_CGROUP,
                 period_us: int = DEFAULT_PERIOD_US, pid: int | None = None) -> None:
        if not MIN_QUOTA_US <= period_us <= 1_000_000:
            raise ValueError(f"period_us={period_us} must be in [{MIN_QUOTA_US}, 1000000]")
        lay = detect(sys_root, proc_cgroup)
        if lay is None:
            raise CpuQuotaError(unavailable_reason(sys_root, proc_cgroup) or "no cpu controller")
        self.layout, self.period_us = lay, period_us
        self.pid = os.getpid() if pid is None else pid
        self.rate = 1.0
        self.path: Path | None = None
        errors = []
        for parent in lay.parents:
            if lay.version == 2 and not _v2_cpu_enabled(parent):
                errors.append(f"{parent}: 'cpu' not enabled in cgroup.subtree_control")
                continue
            clean_stale(parent)
            d = parent / f"malleus-{self.pid}"
            try:
                d.mkdir(exist_ok=True)
                self.path = d
                self._write_limit(None)
                self._move(d)
                break
            except OSError as e:
                errors.append(f"{d}: {e.strerror or e}")
                self._remove(d)
                self.path = None
        if self.path is None:
            raise CpuQuotaError("cannot put this process in a cgroup of its own: "
                                + "; ".join(errors))
        atexit.register(self.close)

    # -- the limit ---------------------------------------------------------------------------

    def limit_files(self, quota: int | None) -> dict[str, str]:
        """What to write for ``quota`` (``None`` = no limit), per file, in order."""
        if self.layout.version == 1:
            return {"cpu.cfs_period_us": str(self.period_us),
                    "cpu.cfs_quota_us": "-1" if quota is None else str(quota)}
        return {"cpu.max": f"{'max' if quota is None else quota} {self.period_us}"}

    def _write_limit(self, quota: int | None) -> None:
        assert self.path is not None
        if self.layout.version == 1 and quota is None:
            (self.path / "cpu.cfs_quota_us").write_text("-1")   # the period may then change
        for name, value in self.limit_files(quota).items():
            (self.path / name).write_text(value)

    def set_rate(self, rate: float) -> None:
        """Run ``rate`` times slower than on one full core (1.0: no limit)."""
        q = quota_us(rate, self.period_us)
        if self.path is None:
            raise CpuQuotaError("set_rate after close()")
        try:
            self._write_limit(q)
        except OSError as e:
            raise CpuQuotaError(f"cannot set rate {rate} (quota {q} us per {self.period_us} us) "
                                f"in {self.path}: {e.strerror or e}") from None
        self.rate = float(rate)

    # -- membership --------------------------------------------------------------------------

    def _move(self, d: Path) -> None:
        (d / "cgroup.procs").write_text(str(self.pid))

    @staticmethod
    def _remove(d: Path) -> None:
        try:
            d.rmdir()
        except OSError:
            pass

    def close(self) -> None:
        """Back to the original cgroup; the folder removed. Idempotent (also run at exit)."""
        d, self.path = self.path, None
        if d is None:
            return
        atexit.unregister(self.close)
        try:
            self._move(self.layout.original)
        except OSError:
            pass            # the folder stays; the next CpuQuota cleans it once we are gone
        self._remove(d)
        self.rate = 1.0


_PROCESS: PerProcess[CpuQuota] = PerProcess(lambda: CpuQuota(), usable=lambda q: q.path is not None)


def process_quota() -> CpuQuota:
    """This process's one :class:`CpuQuota`, created on first use."""
    return _PROCESS.get()


def release() -> None:
    """Lift this process's quota and leave its cgroup (end of a run). No-op if none."""
    _PROCESS.release()


# -- calibration --------------------------------------------------------------------------------


def _matmul_workload(n: int = 256, iters: int = 150) -> float:
    """Seconds for a fixed single-threaded torch matmul loop (under a second on one free core)."""
    import time

    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    t0 = time.perf_counter()
    for _ in range(iters):
        a = torch.tanh(a @ b)
    return time.perf_counter() - t0


def _spin() -> None:
    """A pure busy loop (no lock polled: it never sleeps); the caller terminates it."""
    while True:
        pass


def calibrate(rates=(2.0, 3.0, 6.0), repeats: int = 3, busy: int = 0, workload=_matmul_workload,
              out=print) -> dict[float, float]:
    """Measured slowdown per rate: the workload's median time under ``period/rate`` over its
    median time alone (``busy`` extra spinning processes share the machine meanwhile)."""
    import multiprocessing as mp
    import statistics

    reason = unavailable_reason()
    if reason:
        raise CpuQuotaError(f"cannot calibrate: {reason}")
    ctx = mp.get_context("fork")
    spinners = [ctx.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    q = CpuQuota()
    try:
        workload()                                  # warm-up (allocator, first-call costs)
        alone = statistics.median(workload() for _ in range(repeats))
        out(f"alone: {alone:.3f} s ({busy} busy process(es), {os.cpu_count()} cores, "
            f"period {q.period_us} us, cgroup v{q.layout.version} {q.path})")
        res = {}
        for r in rates:
            q.set_rate(r)
            t = statistics.median(workload() for _ in range(repeats))
            q.set_rate(1.0)
            res[float(r)] = t / alone
            out(f"rate {r:g}: quota {quota_us(r, q.period_us)} us -> {t:.3f} s, measured "
                f"slowdown {t / alone:.2f}x")
        return res
    finally:
        q.close()
        for p in spinners:
            p.terminate()
            p.join(5)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m malleus_ds.emulation.cpu_quota",
                                 description="CPU quotas for real straggler slowdowns.")
    ap.add_argument("--calibrate", action="store_true",
                    help="time a fixed workload alone and under each rate's quota")
    ap.add_argument("--rates", default="2,3,6", help="comma-separated rates (default 2,3,6)")
    ap.add_argument("--busy", type=int, default=0, help="extra spinning processes meanwhile")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    reason = unavailable_reason()
    if not a.calibrate:
        print("available" if reason is None else f"unavailable: {reason}")
        return 0 if reason is None else 1
    if reason:
        print(f"cannot calibrate: {reason}", file=sys.stderr)
        return 1
    calibrate(tuple(float(x) for x in a.rates.split(",")), a.repeats, a.busy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
