"""Rates and slow links of a run's step lines, per step and per phase, as the what-if account
reads them (definitions: ``whatif.py``'s module docstring; pure: records in, numbers out).

A run's rates come from one source (:func:`rate_source`): the loop's ``measured_rates``, else
the emulated schedule, else each rank's ``compute_s`` over the fastest rank's. A rate below
:data:`HEALTHY` counts as 1.0. A step's slow links (:func:`link_state`) are the measured ones
read as the adaptive loop reads them, else "emulated" where the slow-link emulation waited.
"""
from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from .run_model import emulated_rates
from ..adaptive.detect import HEALTHY  # a rate below this counts as healthy (DESIGN.md §6)
from ..adaptive.detect import DetectConfig

#: a measured link rate below this counts as healthy (``detect.link_healthy``'s default)
LINK_HEALTHY = DetectConfig().link_healthy


def _compute_rates(r: Mapping) -> list[float] | None:
    c = r.get("compute_s")
    if not isinstance(c, list) or len(c) < 2 or any(x is None for x in c):
        return None
    lo = min(float(x) for x in c)
    return [float(x) / lo for x in c] if lo > 0 else None


def rate_source(records: Sequence[Mapping]) -> str:
    """Where this run's rates come from (see the module docstring)."""
    if any(any(x is not None for x in r.get("measured_rates") or ()) for r in records
           if isinstance(r.get("measured_rates"), list)):
        return "measured"
    if any(emulated_rates(r) for r in records):
        return "emulated"
    if any(_compute_rates(r) for r in records):
        return "compute_s"
    return "none"


def readings(r: Mapping, source: str, world: int) -> list[float | None]:
    """Per rank this step's reading as recorded, not yet thresholded (None: not known)."""
    if source == "measured":
        m = r.get("measured_rates")
        v = list(m) if isinstance(m, list) else []
    elif source == "emulated":
        e = emulated_rates(r)
        v = [float(e.get(str(d), e.get(d, 1.0))) for d in range(world)]
    elif source == "compute_s":
        v = _compute_rates(r) or []
    else:
        v = []
    return [None if x is None else float(x) for x in (v + [None] * world)[:world]]


def _rate_vector(r: Mapping, source: str, world: int) -> list[float | None]:
    """Per rank this step's rate, a rate below HEALTHY read as 1.0 (None: not known)."""
    return [None if x is None else (1.0 if x < HEALTHY else x)
            for x in readings(r, source, world)]


def phase_rates(rs: Sequence[Mapping], source: str, world: int
                ) -> tuple[tuple[int, float], ...]:
    """A phase's slowed ranks: each rank's median rate over ``rs``, for those at or above
    :data:`HEALTHY` (``((rank, rate), ...)``; ``()``: healthy)."""
    out = []
    vecs = [_rate_vector(r, source, world) for r in rs]
    for d in range(world):
        xs = [v[d] for v in vecs if v[d] is not None]
        x = statistics.median(xs) if xs else 1.0
        if x >= HEALTHY:
            out.append((d, round(x, 4)))
    return tuple(out)


#: a GPU link's name in a phase's links (its key in ``gpu_link_rates`` after it)
GPU_LINK = "GPUs "


def link_state(r: Mapping) -> tuple[str, ...]:
    """A step line's slow links: the measured ones (``link_rates``, node pairs ``"a-b"``, and
    ``gpu_link_rates``, pairs of a node's GPUs ``"GPUs r-s"``; read as the adaptive loop reads
    them: slow from ``detect.link_healthy``), else ``("emulated",)`` where the slow-link
    emulation waited on some rank (``link_emulated_s``), else ``()``."""
    slow: list[str] = []
    for field, prefix in (("link_rates", ""), ("gpu_link_rates", GPU_LINK)):
        lr = r.get(field)
        if isinstance(lr, Mapping):
            slow += sorted(prefix + k for k, v in lr.items()
                           if isinstance(v, (int, float)) and v >= LINK_HEALTHY)
    if slow:
        return tuple(slow)
    le = r.get("link_emulated_s")
    if isinstance(le, list) and any(isinstance(x, (int, float)) and x > 0 for x in le):
        return ("emulated",)
    return ()


def phase_links(rs: Sequence[Mapping], key: tuple[str, ...]
                ) -> tuple[tuple[str, float | None], ...]:
    """A phase's slow links with their median measured rate (None: emulated, not measured)."""
    out = []
    for name in key:
        field, k = (("gpu_link_rates", name[len(GPU_LINK):]) if name.startswith(GPU_LINK)
                    else ("link_rates", name))
        xs = [float(r[field][k]) for r in rs if isinstance(r.get(field), Mapping) and k in r[field]]
        out.append((name, round(statistics.median(xs), 4) if xs else None))
    return tuple(out)
