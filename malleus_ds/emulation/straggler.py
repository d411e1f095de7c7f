"""Straggler emulation (DESIGN.md §6): make chosen ranks look like slow GPUs.

A schedule is a list of ``{rank, rate, start_step, end_step}`` entries. While step ``k`` is in
``[start_step, end_step)`` (``end_step=None``: until the end), rank ``rank`` runs at ``rate``: after
each of its micro-batch computes it sleeps ``(rate - 1) ×`` the compute time it just measured, so
its compute looks ``rate`` times slower to everything else (peers, timers, the rate estimator).
Entries that overlap on one rank combine by ``max``. Off by default (empty schedule).

``method`` says how the slowdown is made (``straggler.method``):

* ``sleep`` (default): the emulation above; ``emulated_s`` holds the sleeps.
* ``quota``: a real slowdown from the OS. At the start of each step (:meth:`Straggler.at_step`,
  called by ``ComputeClock.start_step``) the rank's CPU is capped to ``1/rate`` of one core by a
  cgroup quota (``malleus_ds/emulation/cpu_quota.py``) whenever its rate changes; nothing sleeps and
  ``emulated_s`` stays 0; ``emulated_rates`` in metrics.jsonl still records the schedule's rates,
  which are then the *target* slowdown. :func:`check_method` refuses ``quota`` where the machine
  cannot apply it, naming the reason.
* ``compete``: a real slowdown without cgroups (``malleus_ds/emulation/cpu_compete.py``): the rank is
  pinned to one core and competing busy processes beside it take ``1 - 1/rate`` of that core;
  as with ``quota`` nothing sleeps. Needs only CPU affinity (Linux).

Pure Python (no torch): the schedule is validated before any process group exists.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

_KEYS = ("rank", "rate", "start_step", "end_step")
METHODS = ("sleep", "quota", "compete")
#: the methods the OS applies (nothing sleeps; ``emulated_s`` stays 0)
REAL = ("quota", "compete")


class StragglerError(ValueError):
    """A malformed straggler schedule. The message names the entry, the field and the value."""


@dataclass(frozen=True)
class StragglerEntry:
    """Rank ``rank`` runs ``rate``× slower during steps ``[start_step, end_step)``."""

    rank: int
    rate: float                     # ≥ 1.0; 4.0 = four times slower
    start_step: int = 0             # first slowed step (0-based)
    end_step: int | None = None     # first step no longer slowed; None = until the end

    def active(self, step: int) -> bool:
        return self.start_step <= step and (self.end_step is None or step < self.end_step)


class RawSchedule(tuple):
    """A schedule's entries as given (plain dicts) plus the ``method`` that applies them: what
    ``ds_config.malleus.straggler`` parses to (``engine/settings.py``). A tuple, so it compares
    equal to the plain entries; :meth:`StragglerSchedule.parse` reads its ``method``."""

    method: str = "sleep"

    def __new__(cls, entries=(), method: str = "sleep") -> "RawSchedule":
        self = super().__new__(cls, entries)
        self.method = method
        return self


def parse_method(v: Any, where: str = "straggler.method") -> str:
    """``sleep`` | ``quota`` | ``compete`` (``None``: sleep); anything else is a StragglerError
    naming it."""
    m = "sleep" if v is None else v
    if m not in METHODS:
        raise StragglerError(f"{where}={v!r} is not known; choose one of {list(METHODS)} "
                             f"(sleep: emulated by sleeping; quota: a real CPU cap by cgroup; "
                             f"compete: real, busy processes pinned beside the rank)")
    return m


@dataclass(frozen=True)
class StragglerSchedule:
    entries: tuple[StragglerEntry, ...] = ()
    method: str = "sleep"               # sleep | quota (module doc)

    @staticmethod
    def parse(raw: Iterable[Mapping[str, Any]] | None, world_size: int | None = None,
              method: str | None = None) -> "StragglerSchedule":
        """Build from plain dicts (e.g. ``[{rank: 1, rate: 4.0, start_step: 5, end_step: 100}]``).
        ``method``: how to slow (default: ``raw.method`` of a :class:`RawSchedule`, else sleep).

        Raises ``StragglerError`` naming ``straggler.schedule[i].field`` and the bad value.
        """
        method = parse_method(method if method is not None else getattr(raw, "method", None))
        if raw is None:
            return StragglerSchedule(method=method)
        if not isinstance(raw, (list, tuple)):   # a number, a string, a single mapping, ...
            raise StragglerError(f"straggler.schedule must be a list of "
                                 f"{{rank, rate, start_step, end_step}} entries (or empty / "
                                 f"null for none), got {raw!r} ({type(raw).__name__})")
        out = []
        for i, e in enumerate(raw):
            where = f"straggler.schedule[{i}]"
            check_keys(e, where, _KEYS)
            for k in ("rank", "rate"):
                if k not in e or e[k] is None:
                    raise StragglerError(f"{where}.{k} is required")
            rank = _int(e["rank"], f"{where}.rank")
            if rank < 0:
                raise StragglerError(f"{where}.rank={rank} must be >= 0")
            if world_size is not None and rank >= world_size:
                raise StragglerError(f"{where}.rank={rank} does not exist: the job has "
                                     f"world_size={world_size} ranks (0..{world_size - 1})")
            rate, start, end = rate_window(e, where, "rank")
            out.append(StragglerEntry(rank, rate, start, end))
        return StragglerSchedule(tuple(out), method)

    def rate(self, rank: int, step: int) -> float:
        """Emulated rate of ``rank`` at ``step`` (1.0 when no entry is active)."""
        r = 1.0
        for e in self.entries:
            if e.rank == rank and e.active(step):
                r = max(r, e.rate)
        return r

    def rates(self, step: int, world_size: int) -> dict[int, float]:
        """Active rates at ``step``: {rank: rate} for slowed ranks only."""
        return {d: x for d in range(world_size) if (x := self.rate(d, step)) > 1.0}

    def to_json(self) -> list[dict]:
        return [{"rank": e.rank, "rate": e.rate, "start_step": e.start_step,
                 "end_step": e.end_step} for e in self.entries]

    def __bool__(self) -> bool:
        return bool(self.entries)


def check_method(schedule: StragglerSchedule, reason=None, where: str = "straggler") -> None:
    """Refuse ``method=quota`` or ``compete`` (with a schedule) on a machine that cannot apply
    it, naming why. ``reason``: ``cpu_quota.unavailable_reason`` /
    ``cpu_compete.unavailable_reason`` (a parameter for tests); ``where``: the config section,
    for the message."""
    if schedule.method not in REAL or not schedule:
        return
    if reason is None:
        if schedule.method == "quota":
            from .cpu_quota import unavailable_reason as reason
        else:
            from .cpu_compete import unavailable_reason as reason
    why = reason()
    if why:
        alt = f"{where}.method=compete or " if schedule.method == "quota" else ""
        raise StragglerError(f"{where}.method={schedule.method}: {why}; use "
                             f"{alt}{where}.method=sleep")


class Straggler:
    """Per-rank straggler. Call :meth:`at_step` when a step starts and :meth:`after_compute`
    right after each timed micro-batch compute (``malleus_ds/engine/clock.py`` does both).

    ``quota``: a callable returning this process's slowdown control, an object with
    ``set_rate`` (default ``cpu_quota.process_quota`` for ``method=quota``,
    ``cpu_compete.process_competitor`` for ``compete``), called on the first rate change only,
    so a rank the schedule never slows never touches a cgroup or its affinity. Building a
    Straggler runs :func:`check_method` (on every rank alike: the same error everywhere, no
    hang)."""

    def __init__(self, schedule: StragglerSchedule, rank: int, sleep=time.sleep,
                 quota=None, reason=None) -> None:
        self.schedule = schedule
        self.rank = rank
        self._sleep = sleep
        self._quota_factory = quota
        self._quota = None
        self.applied_rate = 1.0         # quota / compete: the rate the OS now enforces
        check_method(schedule, reason)

    def at_step(self, step: int) -> None:
        """Start of ``step``. sleep: nothing. quota / compete: set this rank's CPU cap (its
        competitors) to the step's rate when it differs from the one applied."""
        if self.schedule.method not in REAL:
            return
        rate = self.schedule.rate(self.rank, step)
        if rate == self.applied_rate:
            return
        if self._quota is None:
            if self._quota_factory is not None:
                factory = self._quota_factory
            elif self.schedule.method == "quota":
                from .cpu_quota import process_quota as factory
            else:
                from .cpu_compete import process_competitor as factory
            self._quota = factory()
        self._quota.set_rate(rate)
        self.applied_rate = rate

    def after_compute(self, step: int, compute_seconds: float) -> float:
        """sleep: sleep ``(rate - 1) × compute_seconds`` if this rank is slowed at ``step``.
        quota / compete: nothing (the OS already slowed the compute).

        Returns the seconds slept (0.0 when healthy or with a real method)."""
        if self.schedule.method in REAL:
            return 0.0
        rate = self.schedule.rate(self.rank, step)
        if rate <= 1.0 or compute_seconds <= 0:
            return 0.0
        delay = (rate - 1.0) * compute_seconds
        t0 = time.perf_counter()
        self._sleep(delay)
        return time.perf_counter() - t0 if self._sleep is time.sleep else delay

    def close(self) -> None:
        """quota / compete: lift the cap (back to rate 1.0); the cgroup itself goes at
        ``cpu_quota.release`` (end of a run) or at exit, the competitors at rate 1.0."""
        if self._quota is not None and self.applied_rate != 1.0:
            self._quota.set_rate(1.0)
        self.applied_rate = 1.0


def check_keys(e: Any, where: str, keys: tuple[str, ...]) -> None:
    """A schedule entry is a mapping of ``keys`` only (a StragglerError names ``where``)."""
    if not isinstance(e, Mapping):
        raise StragglerError(f"{where} must be a mapping with keys {list(keys)}, got {e!r}")
    unknown = sorted(set(e) - set(keys))
    if unknown:
        raise StragglerError(f"{where} has unknown keys {unknown}; allowed: {list(keys)}")


def rate_window(e: Mapping[str, Any], where: str, what: str) -> tuple[float, int, int | None]:
    """An entry's ``rate`` (a finite number >= 1.0) and steps ``[start_step, end_step)``, each
    checked with a StragglerError naming ``where`` and the field; ``what`` is slowed ("rank",
    "link")."""
    try:
        rate = float(e.get("rate"))
    except (TypeError, ValueError):
        raise StragglerError(f"{where}.rate={e.get('rate')!r} is not a number") from None
    if not rate >= 1.0 or rate == float("inf"):
        raise StragglerError(f"{where}.rate={rate} must be a finite number >= 1.0 "
                             f"(1.0 = healthy; emulation can only slow a {what} down)")
    start = _int(e.get("start_step", 0) or 0, f"{where}.start_step")
    if start < 0:
        raise StragglerError(f"{where}.start_step={start} must be >= 0")
    end = e.get("end_step")
    if end is not None:
        end = _int(end, f"{where}.end_step")
        if end <= start:
            raise StragglerError(f"{where}: end_step={end} must be > start_step={start}")
    return rate, start, end


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise StragglerError(f"{where}={v!r} must be an integer")
    return int(v)
