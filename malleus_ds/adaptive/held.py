"""Held ranks and the rank that calibrates probes (DESIGN.md §6, "Probes measure the device").

A held rank works under a plan made for it as slow (:func:`held_ranks`, planned at least
:data:`HOLD`): it sustains a probe like a rank without work, so a light load that runs inside a
throughput cap does not read as a recovery. :func:`probe_reference`: the least-loaded working
rank that is not held times the same probe at the same moment, to calibrate theirs.

numpy only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


#: a working rank planned at least this slow is held (:func:`held_ranks`): its share is light
#: enough (2/3 of a full one or less) for a cap to hide in it. Below, its training reads it:
#: a rank planned just over healthy is often a noisy reading, and probing it costs steps on a
#: shared CPU for a share that is nearly full anyway
HOLD = 1.5


def held_ranks(units: Sequence[float], rates: Sequence[float] | None,
               healthy: float = HOLD) -> np.ndarray:
    """Ranks with work under a plan made for them as slow (planned rate >= ``healthy``,
    :data:`HOLD` by default): each sustains a probe like a suspended rank (DESIGN.md §6,
    "Probes measure the device"), so a light load that runs inside a throughput cap (a CPU
    quota, a power cap) does not read as a recovery that full work would undo."""
    u = np.asarray(units, dtype=float)
    if rates is None:
        return np.zeros(u.size, dtype=bool)
    r = np.array([np.nan if x is None else x for x in rates], dtype=float)
    if r.size != u.size:
        raise ValueError(f"held_ranks: {r.size} rates for {u.size} ranks")
    with np.errstate(invalid="ignore"):
        return (u > 0) & (r >= healthy)


def probe_reference(units: Sequence[float], held: Sequence[bool] | None = None) -> int | None:
    """The rank that times a probe alongside the ranks without work and the held ones, to
    calibrate theirs: the least-loaded rank with work that is not held (lowest index on ties);
    None when no rank needs calibrating (every rank works, none held) or none can."""
    u = np.asarray(units, dtype=float)
    h = np.zeros(u.size, dtype=bool) if held is None else np.asarray(held, dtype=bool)
    ok = (u > 0) & ~h
    if not ((u <= 0).any() or h.any()) or not ok.any():
        return None
    return int(np.flatnonzero(ok & (u == u[ok].min()))[0])
