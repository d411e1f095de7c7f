"""The trace of ``--from-run`` (``from_run.py``): the slowdown each rank of a recorded run really
ran at, on the step clock (its bounds are step indices after warm-up, ``replay/loop.py``).

The run's emulated schedule says which rank was slowed when and by how much; what it ran at
differs. An emulated CPU straggler runs slower than scheduled (its compute, between its sleeps,
finds its caches cold: rank 1 scheduled at 3 measured 3.2-3.7 in the demo, more on a light
share). The loop decides on those readings, and the replay is asked to predict the run the loop
really ran, so its trace carries them:

* the schedule is cut into :class:`Piece` s, a phase of the schedule on one plan of the run;
* a first pass gives each slowed rank of a piece the loop's own measured rate there
  (:func:`realized`);
* on the plans the replay also runs (known by id after a first replay), the median over the
  piece's steps of the rate the rank ran at, from the run's own ``compute_s`` per cost unit over
  its healthy peers' (:func:`refine`), leaving out steps that held a probe or followed a switch;
* :func:`trace_of` writes the pieces as a :class:`~malleus_ds.replay.trace.Trace`, one event per
  rank while its rate stays.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .trace import Event, Trace, make_trace


@dataclass
class Piece:
    """A phase of the schedule on one plan of the run: its step lines, their indices after
    warm-up (``start`` up to ``end``, not included), and each slowed rank's rate there (the
    schedule's, refined from the run)."""

    phase: int
    plan: str | None
    steps: tuple
    start: int
    end: int
    rates: dict


def trace_of(pieces, num_gpus: int, where: str = "") -> Trace:
    """The trace of the pieces' rates on the step clock (one event per rank while its rate
    stays; its "seconds" are step indices)."""
    rows: list[Event] = []
    for pc in pieces:
        a, b = float(pc.start), float(pc.end)
        for g, r in pc.rates.items():
            if rows and (rows[-1].gpu, rows[-1].rate, rows[-1].end_s) == (g, r, a):
                rows[-1] = Event(rows[-1].start_s, b, g, r)
            else:
                rows.append(Event(a, b, g, r))
    end = max((pc.end for pc in pieces), default=0)
    return make_trace(rows, num_gpus, hours=end / 3600.0 + 1e-9, where=where)


def refine(pieces, units: dict, unit_s: float, probe_every: int, switch_steps=()) -> bool:
    """Each piece whose plan the replay ran (``units``: that plan's cost units per rank, by
    plan id) gets each slowed rank's rate from the run's own compute: per step, its
    ``compute_s`` per unit over that of the step's healthy working ranks (else ``unit_s``, the
    healthy steps' per-unit seconds, ``Replay.scale``), the median over the piece's steps that
    held no probe (a probe's seconds ride in its step's ``compute_s``) and did not follow a
    switch. In place; True if a rate changed."""
    import numpy as np

    every = probe_every
    switched = {int(e) for e in switch_steps}
    changed = False
    for pc in pieces:
        u = units.get(pc.plan)
        if u is None:
            continue
        u = np.asarray(u, dtype=np.float64)
        slow = np.zeros(u.size, dtype=bool)
        slow[list(pc.rates)] = True
        reads: dict[int, list[float]] = {g: [] for g in pc.rates}
        for s in pc.steps:
            k = int(s["step"])
            if k % every == 0 or k in switched:
                continue
            c = np.asarray(s.get("compute_s") or (), dtype=np.float64)
            if c.shape != u.shape:
                continue
            ok = (u > 0) & ~slow & (c > 0)
            ref = float(np.median(c[ok] / u[ok])) if ok.any() else unit_s
            for g in pc.rates:
                if u[g] > 0 and c[g] > 0 and ref > 0:
                    reads[g].append(c[g] / u[g] / ref)
        for g, xs in reads.items():
            if xs:
                r = round(max(1.0, statistics.median(xs)), 3)
                changed |= r != pc.rates[g]
                pc.rates[g] = r
    return changed


def realized(steps, window: int) -> dict[int, float]:
    """Per rank, the slowdown it really ran at over ``steps`` (a phase of the schedule on one
    plan): the median of the loop's measured rates once its window holds only these steps (in
    fewer steps than the window: the last one's). On CPU an emulated straggler runs slower than
    its schedule says (its compute, between its sleeps, finds its caches cold: rank 1 scheduled
    at 3 measured 3.2-3.7 in the demo, more on a light share), and the trace is what the job ran
    through. Ranks never read: absent (their scheduled rate holds)."""
    out: dict[int, float] = {}
    rows = [s.get("measured_rates") for s in steps[min(window, len(steps) - 1):]]
    for g in range(max((len(r) for r in rows if r), default=0)):
        xs = [float(r[g]) for r in rows if r and g < len(r) and r[g] is not None]
        if xs:
            out[g] = max(1.0, statistics.median(xs))
    return out
