"""Straggler traces drawn from published statistics (``malleus-sim trace``; docs/TRACES.md
holds each number and its source).

Regimes:

* ``persistent``: a few faulty GPUs, about 3x slow, for hours (ByteDance, OSDI'25: faulty
  workers cause 1.7% of straggling jobs, which then run about 3x slow; a job's slowdown is
  steady from step to step);
* ``transient``: many short compute stragglers, 1.2-2x, minutes long, node-wide (Alibaba,
  Greyhound, ATC'25: about 1.5% of nodes per 80 minutes, about 10 minutes on average);
* ``mixed``: both at once;
* ``flapping``: a few GPUs that alternate between slow and healthy every few minutes for the
  whole trace (a stress case with no published rate: a loop that follows every flip thrashes).

A seed makes a trace reproducible (numpy's PCG64). Stdlib + numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..job_layout import JobLayout
from .trace import Event

REGIMES = ("persistent", "transient", "mixed", "flapping")


@dataclass(frozen=True)
class Persistent:
    """Faulty GPUs: one per ``gpus_per_fault`` GPUs (at least one), each starting at a uniform
    time, lasting ``min_hours`` plus an exponential time (mean ``mean_hours`` in all; cut at
    the horizon), at a rate uniform in ``rate``. "For hours": a fault lasts at least
    ``min_hours`` (a plain exponential of mean 3 h drew 3- and 13-minute faults, which are the
    transient regime's business)."""

    gpus_per_fault: int = 256
    mean_hours: float = 3.0
    min_hours: float = 1.0
    rate: tuple[float, float] = (2.5, 3.5)


@dataclass(frozen=True)
class Transient:
    """Node-wide compute stragglers: Poisson arrivals, ``per_node_per_80min`` per node every 80
    minutes; each lasts an exponential time of mean ``mean_minutes`` and slows every GPU of
    its node by one rate uniform in ``rate``."""

    per_node_per_80min: float = 0.015
    mean_minutes: float = 10.0
    rate: tuple[float, float] = (1.2, 2.0)


@dataclass(frozen=True)
class Flapping:
    """GPUs that flap: one per ``gpus_per_flapper`` GPUs (at least one), each from a uniform
    time in its first healthy phase to the horizon alternating a slow phase (minutes uniform in
    ``slow_minutes``) and a healthy one (minutes uniform in ``healthy_minutes``); each GPU is
    slow at one rate, uniform in ``rate``, every time."""

    gpus_per_flapper: int = 170
    slow_minutes: tuple[float, float] = (2.0, 4.0)
    healthy_minutes: tuple[float, float] = (2.0, 4.0)
    rate: tuple[float, float] = (1.6, 1.9)


def _flapping(f: Flapping, num_gpus: int, horizon: float, rng) -> list[Event]:
    """The slow phases of ``f``'s flapping GPUs over ``horizon`` seconds."""
    out: list[Event] = []
    n = max(1, round(num_gpus / f.gpus_per_flapper))
    for g in rng.choice(num_gpus, size=min(n, num_gpus), replace=False):
        rate = round(float(rng.uniform(*f.rate)), 3)
        now = float(rng.uniform(0.0, 60.0 * f.healthy_minutes[1]))
        while now < horizon:
            end = min(horizon, now + 60.0 * float(rng.uniform(*f.slow_minutes)))
            out.append(Event(round(now, 3), round(end, 3), int(g), rate))
            now = end + 60.0 * float(rng.uniform(*f.healthy_minutes))
    return [e for e in out if e.end_s > e.start_s]


def generate(regime: str, num_gpus: int, hours: float, seed: int = 0,
             gpus_per_node: int = 8, persistent: Persistent = Persistent(),
             transient: Transient = Transient(),
             flapping: Flapping = Flapping()) -> list[Event]:
    """The events of one trace, sorted by start."""
    if regime not in REGIMES:
        raise ValueError(f"regime={regime!r}: one of {', '.join(REGIMES)}")
    if num_gpus < 1 or not hours > 0 or gpus_per_node < 1:
        raise ValueError(f"need gpus >= 1, hours > 0, gpus_per_node >= 1; got {num_gpus}, "
                         f"{hours}, {gpus_per_node}")
    rng = np.random.default_rng(seed)
    horizon = hours * 3600.0
    out: list[Event] = []
    if regime in ("persistent", "mixed"):
        p = persistent
        n = max(1, round(num_gpus / p.gpus_per_fault))
        gpus = rng.choice(num_gpus, size=min(n, num_gpus), replace=False)
        for g in gpus:
            start = float(rng.uniform(0.0, horizon * 0.9))
            dur = 3600.0 * (p.min_hours + float(rng.exponential(p.mean_hours - p.min_hours)))
            out.append(Event(round(start, 3), round(min(horizon, start + dur), 3),
                             int(g), round(float(rng.uniform(*p.rate)), 3)))
    if regime in ("transient", "mixed"):
        t = transient
        layout = JobLayout(num_gpus, gpus_per_node)     # says so when nodes do not tile the job
        nodes = layout.nodes
        per_s = nodes * t.per_node_per_80min / (80 * 60.0)       # arrivals per second, job-wide
        now = float(rng.exponential(1.0 / per_s))
        while now < horizon:
            node = int(rng.integers(nodes))
            dur = max(30.0, float(rng.exponential(t.mean_minutes * 60.0)))
            rate = round(float(rng.uniform(*t.rate)), 3)
            start, end = round(now, 3), round(min(horizon, now + dur), 3)
            if end > start:
                for g in layout.node_ranks(node):
                    out.append(Event(start, end, g, rate))
            now += float(rng.exponential(1.0 / per_s))
    if regime == "flapping":
        out += _flapping(flapping, num_gpus, horizon, rng)
    return sorted(out, key=lambda e: (e.start_s, e.gpu))
