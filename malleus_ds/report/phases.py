"""Straggler phases of a run from its per-step rates, read the way the adaptive loop reads them.

The one rule every report uses where it splits a run by *measured* rates (``whatif.py``, and so
``launch/summarize.py``, the compare report's what-if lines and ``malleus-plot``'s what-if marks;
DESIGN.md §6, "What-if account"). A single step's reading is noise on a shared host (a healthy
rank now and then reads well above 1.0 for one step); the loop (``adaptive/rates.py``,
``detect.py``) never acts on one, and neither does a report:

1. **Smoothed.** Each rank's rate at a step is the median of its readings over
   :data:`WINDOW` (= ``DetectConfig.window``, 5) steps centred on the step (missing readings
   skipped; near the ends of the run the window shrinks on both sides alike). The loop takes
   the same median over the last :data:`WINDOW` steps; a report sees the steps after each step
   too, so it centres the window and its phases do not lag the onset by ``WINDOW // 2`` steps
   as the loop's reading does. A step change of the rate keeps its exact step; a spike of up
   to ``WINDOW // 2`` steps disappears (at the run's ends, rule 3 drops it).
2. **Threshold.** A smoothed rate below :data:`HEALTHY` (``adaptive.detect.HEALTHY``, 1.2) counts as
   1.0. A step's *condition* is the set of ranks at or above it.
3. **Minimum duration.** A change of condition counts only when the new condition lasts at
   least :data:`MIN_STEPS` (= ``WINDOW + DetectConfig.confirm`` = 7) consecutive steps, the
   readings the loop takes before it can act on a shift (a full window, then ``confirm``
   detections). A shorter stretch keeps the condition before it (the run starts healthy, as
   the loop does): a short straggler inside a healthy run is healthy, a short dip inside a
   straggler phase does not split it. So a run shorter than :data:`MIN_STEPS` steps has no
   straggler phase, whatever it measured.

A straggler phase's rate per slowed rank is the median of that rank's (unsmoothed) readings over
the phase. Pure: numpy only, no torch.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..adaptive.detect import HEALTHY, DetectConfig
from .run_model import stretches

#: steps in the median that smooths a rank's readings (the adaptive loop's window)
WINDOW = DetectConfig().window
#: steps a new condition must last to count as a phase: the loop's window plus its confirmations
MIN_STEPS = WINDOW + DetectConfig().confirm

__all__ = ["HEALTHY", "WINDOW", "MIN_STEPS", "RatePhase", "centred_median", "smoothed",
           "rate_phases"]


@dataclass(frozen=True)
class RatePhase:
    """Rows ``lo <= i < hi`` of the input (steps ``first..last``, inclusive) in one condition."""

    lo: int
    hi: int
    first: int
    last: int
    rates: tuple[tuple[int, float], ...]   # ((rank, rate), ...) of slowed ranks; () = healthy

    @property
    def steps(self) -> int:
        return self.hi - self.lo


def centred_median(y: Sequence[float], window: int = WINDOW) -> np.ndarray:
    """Each value's median over the ``window`` values centred on it (NaN skipped; all-NaN: NaN).
    Near the ends the window shrinks on both sides alike (3 values one step in, the value
    itself at the end), so it stays centred: a step change keeps its exact step."""
    y = np.asarray(y, dtype=float)
    h = max(0, (int(window) - 1) // 2)
    n = y.size
    out = np.empty(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # an all-NaN window -> NaN
        for i in range(n):
            k = min(h, i, n - 1 - i)
            out[i] = np.nanmedian(y[i - k:i + k + 1])
    return out


def _matrix(rates: Sequence[Sequence[float | None] | None], world: int | None) -> np.ndarray:
    """Rows of per-rank readings (None, a short row or a missing row: NaN) as (steps, world)."""
    width = world if world is not None else max((len(r) for r in rates if r), default=0)
    m = np.full((len(rates), width), np.nan)
    for i, row in enumerate(rates):
        for d, x in enumerate(list(row or ())[:width]):
            if x is not None:
                m[i, d] = float(x)
    return m


def smoothed(rates: Sequence[Sequence[float | None] | None], window: int = WINDOW,
             world: int | None = None) -> np.ndarray:
    """Each rank's readings (rows: steps; None: not measured) smoothed by :func:`centred_median`
    over ``window`` steps: a (steps, ranks) array, NaN where a window holds no reading."""
    m = _matrix(rates, world)
    return np.stack([centred_median(m[:, d], window) for d in range(m.shape[1])], axis=1) \
        if m.shape[1] else m


def rate_phases(steps: Sequence[int], rates: Sequence[Sequence[float | None] | None],
                window: int = WINDOW, healthy: float = HEALTHY, min_steps: int = MIN_STEPS,
                world: int | None = None) -> list[RatePhase]:
    """The run's phases (module docstring): ``steps[i]`` is row ``i``'s step number and
    ``rates[i]`` its per-rank readings (None or a missing rank: not measured). Consecutive,
    covering every row, alternate conditions; ``[]`` for no rows."""
    if len(steps) != len(rates):
        raise ValueError(f"rate_phases: {len(steps)} steps but {len(rates)} rows of rates")
    if not len(steps):
        return []
    raw = _matrix(rates, world)
    sm = smoothed(rates, window, raw.shape[1])
    with np.errstate(invalid="ignore"):
        hot = sm >= healthy                      # NaN (no reading) is healthy
    keys = [tuple(int(d) for d in np.flatnonzero(row)) for row in hot]
    cur: tuple = ()                              # the loop starts healthy
    for st in stretches(keys):                   # (run_model.stretches) a stretch too short to
        if st.hi - st.lo >= min_steps:           # confirm keeps the condition before it
            cur = st.key
        keys[st.lo:st.hi] = [cur] * (st.hi - st.lo)
    out: list[RatePhase] = []
    for st in stretches(keys):
        key, lo, hi = st.key, st.lo, st.hi
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # a rank never measured -> NaN
            med = [float(np.nanmedian(raw[lo:hi, d])) for d in key]
        x = tuple((d, round(m, 4)) for d, m in zip(key, med) if m >= healthy)
        if out and out[-1].rates == x:           # a rank whose readings over the phase stay
            p = out.pop()                        # below the threshold is dropped: join again
            lo = p.lo
        out.append(RatePhase(lo, hi, int(steps[lo]), int(steps[hi - 1]), x))
    return out
