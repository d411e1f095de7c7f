"""The trace of ``--from-run`` (``from_run.py``): the slowdown each rank of a recorded run really
ran at, on the step clock (its bounds are step indices from the run's first step,
``replay/loop.py``).

The run's emulated schedule says which rank was slowed when and by how much; what it ran at
differs. An emulated CPU straggler runs slower than scheduled (its compute, between its sleeps,
finds its caches cold, and more so on a light share). The loop decides on those readings, and the replay is asked to predict the run the loop
really ran, so its trace carries them:

* the schedule is cut into :class:`Piece` s, a phase of the schedule on one plan of the run;
* a first pass gives each slowed rank of a piece the loop's own measured rate there
  (:func:`realized`);
* on the plans the replay also runs (known by id after a first replay), the median over the
  piece's steps of the rate the rank ran at, from the run's own ``compute_s`` per cost unit over
  its healthy peers' (:func:`refine`), leaving out steps that held a probe or followed a switch;
* on those plans and steps, every working rank's rate step by step: its ``compute_s`` per cost
  unit over the healthy steps' (``Replay.scale``). A rank the schedule leaves alone runs slow
  too at times (whatever shares its core), and the loop reads the straggler's rate against it,
  low while that lasts, so its re-plans come when the rates it read say; the replay's loop
  reads the same;
* where the run's step lines carry its probes' readings (``probe_rates``, idle and held ranks),
  what each probe read, by the step it was timed after (:func:`probed`), for the replay's loop
  to read there (:class:`RunRecord`): a held rank whose probe reads just above the healthy
  threshold stays held, where a replay reading exactly 1.0 would let it back. A probe's reading
  is not its rank's compute rate (a probe is short, and a throttled rank's can land in the
  fast part of its quota period), so it stays out of the trace;
* :func:`trace_of` writes the pieces as a :class:`~malleus_ds.replay.trace.Trace`, one event per
  rank while its rate stays.

What the run's own loop read, step by step (:class:`RunRecord`), is what the replay's loop reads
where it runs the run's plan (``run_malleus(record=)``):

* the ranks' ``compute_s``. The trace's rates are the run's slowdowns against its healthy
  step, at least 1, so a rank that computed faster than that (later in a run) reads 1, and the
  straggler's rate against it comes out low; near a tie between two plans that is enough for
  the replay to pick the other plan;
* each step's seconds, which its pace check judged, and when each re-plan's answer was taken
  (``answers``: the step after which it asked, and the step before which it took the answer);
* which held ranks probed, and what their probes read. A held rank probes while its own
  compute leaves it slack (``probe.light``), a judgement on each rank's own timings that the
  replay's can only approach, so the run's record says when each one probed (a held rank
  that probes a step earlier comes back a step earlier).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .trace import Event, Trace, make_trace


@dataclass
class Piece:
    """A phase of the schedule on one plan of the run: its step lines, their indices from the
    run's first step (``start`` up to ``end``, not included), and each slowed rank's rate
    there (the schedule's, refined from the run)."""

    phase: int
    plan: str | None
    steps: tuple
    start: int
    end: int
    rates: dict
    each: dict = field(default_factory=dict)    # step index -> {rank: its rate}, where read
    probes: dict = field(default_factory=dict)  # step index -> {rank: what its probe read}


@dataclass
class RunRecord:
    """What a recorded run's loop read at each step index (from the run's first step, warm-up
    included: the loop read those too), for the replay's loop to read where it runs the run's
    plan (``run_malleus(record=)``): each step's plan, ``compute_s`` and seconds, when each
    re-plan was answered, and the probes of idle and held ranks (:func:`probed`; ``probing``:
    the run's step lines carry them, ``probe_rates``, and then a step without any is one in
    which no idle or held rank probed)."""

    plans: tuple
    compute: tuple
    probe_reads: dict
    probing: bool
    answers: dict = field(default_factory=dict)  # request step -> the step it was answered at
    seconds: tuple = ()                         # each step's seconds, as the run's loop read them

    @classmethod
    def of(cls, steps, reads: dict | None = None, answers: dict | None = None) -> "RunRecord":
        """From the run's step lines (``reads``: their :func:`probed`, if read
        already; ``answers``: as the field)."""
        reads = probed(steps) if reads is None else reads
        return cls(tuple(s.get("plan") for s in steps),
                   tuple(tuple(s["compute_s"]) if s.get("compute_s") else None for s in steps),
                   reads, bool(reads), dict(answers or {}),
                   tuple(float(s["step_time_s"]) for s in steps))

    def _ran(self, step: int, plan: str) -> bool:
        return 0 <= step < len(self.plans) and self.plans[step] == plan

    def compute_s(self, step: int, plan: str):
        """The ranks' ``compute_s`` the run's loop read at ``step`` if it ran ``plan`` then,
        else None."""
        return self.compute[step] if self._ran(step, plan) else None

    def step_s(self, step: int, plan: str) -> float | None:
        """The seconds of ``step`` the run's loop read, if it ran ``plan`` then, else None."""
        return self.seconds[step] if self._ran(step, plan) and step < len(self.seconds) else None

    def answered(self, step: int, plan: str) -> int | None:
        """The step before which the run's loop took the answer to a re-plan it asked after
        ``step``, if it ran ``plan`` then and asked then, else None."""
        return self.answers.get(step) if self._ran(step, plan) else None

    def probes(self, step: int, plan: str) -> dict | None:
        """{rank: what its probe read} for the idle and held ranks that probed after ``step``
        in the run, if it ran ``plan`` then and recorded its probes (an empty dict: none
        probed), else None (the replay's loop decides who probes)."""
        if not (self.probing and self._ran(step, plan)):
            return None
        return dict(self.probe_reads.get(step, {}))


def trace_of(pieces, num_gpus: int, where: str = "") -> Trace:
    """The trace of the pieces' rates on the step clock (one event per rank while its rate
    stays; its "seconds" are step indices)."""
    rows: list[Event] = []
    last: dict[int, int] = {}

    def add(a, b, g, r):
        i = last.get(g)
        if i is not None and (rows[i].rate, rows[i].end_s) == (r, a):
            rows[i] = Event(rows[i].start_s, b, g, r)
        else:
            last[g] = len(rows)
            rows.append(Event(a, b, g, r))
    for pc in pieces:
        for k in range(pc.start, pc.end):
            for g, r in sorted({**pc.rates, **pc.each.get(k, {})}.items()):
                if r > 1.0:
                    add(float(k), float(k + 1), g, r)
    end = max((pc.end for pc in pieces), default=0)
    return make_trace(rows, num_gpus, hours=end / 3600.0 + 1e-9, where=where)


def refine(pieces, units: dict, unit_s: float, probe_every: int, switch_steps=(),
           refs: dict | None = None) -> bool:
    """Each piece whose plan the replay ran (``units``: that plan's cost units per rank, by
    plan id) gets each slowed rank's rate from the run's own compute: per step, its
    ``compute_s`` per unit over that of the step's healthy working ranks (else ``unit_s``, the
    healthy steps' per-unit seconds, ``Replay.scale``), the median over the piece's steps that
    did not follow a switch, leaving out a rank's steps that held its probe (a probe's seconds
    ride in its step's ``compute_s``: where the run recorded its probes, ``Piece.probes``, the
    ranks that probed, and on a probe step the rank that calibrates them under the plan,
    ``refs``: by plan id, as the replay's loop chose it; else every rank on a probe step); and
    on each such step, every working rank's rate at that step (``Piece.each``): its
    ``compute_s`` per unit over ``unit_s``, at least 1. In place; True if a rate changed."""
    import numpy as np

    every = probe_every
    switched = {int(e) for e in switch_steps}
    recorded = any(pc.probes for pc in pieces)
    changed = False
    for pc in pieces:
        u = units.get(pc.plan)
        if u is None:
            continue
        u = np.asarray(u, dtype=np.float64)
        calib = (refs or {}).get(pc.plan)       # the rank that calibrates the probes
        slow = np.zeros(u.size, dtype=bool)
        slow[list(pc.rates)] = True
        reads: dict[int, list[float]] = {g: [] for g in pc.rates}
        each: dict[int, dict[int, float]] = {}
        for i, s in enumerate(pc.steps):
            k = int(s["step"])
            if k in switched or (k % every == 0 and not recorded):
                continue
            c = np.array(s.get("compute_s") or (), dtype=np.float64)
            if c.shape != u.shape:
                continue
            c[list(pc.probes.get(pc.start + i, {}))] = np.nan    # their probe's seconds in it
            if recorded and k % every == 0 and calib is not None:
                c[calib] = np.nan            # ...and the calibrating rank's, on a probe step
            ok = (u > 0) & ~slow & (c > 0)
            ref = float(np.median(c[ok] / u[ok])) if ok.any() else unit_s
            for g in pc.rates:
                if u[g] > 0 and c[g] > 0 and ref > 0:
                    reads[g].append(c[g] / u[g] / ref)
            each[pc.start + i] = {int(g): round(max(1.0, c[g] / u[g] / unit_s), 3)
                                  for g in np.flatnonzero((u > 0) & (c > 0))}
        if each != pc.each:
            pc.each, changed = each, True
        for g, xs in reads.items():
            if xs:
                r = round(max(1.0, statistics.median(xs)), 3)
                changed |= r != pc.rates[g]
                pc.rates[g] = r
    return changed


def probed(steps) -> dict[int, dict[int, float]]:
    """Per step index: the rate each rank's probe read after that step, from the next step
    line's ``probe_rates`` (a probe is timed after a step's all-reduce and read in the next
    step's); empty for runs that did not write them."""
    out: dict[int, dict[int, float]] = {}
    for i in range(len(steps) - 1):
        pr = steps[i + 1].get("probe_rates") or ()
        got = {g: float(r) for g, r in enumerate(pr) if r is not None}
        if got:
            out[i] = got
    return out


def realized(steps, window: int) -> dict[int, float]:
    """Per rank, the slowdown it really ran at over ``steps`` (a phase of the schedule on one
    plan): the median of the loop's measured rates once its window holds only these steps (in
    fewer steps than the window: the last one's). On CPU an emulated straggler runs slower than
    its schedule says (its compute, between its sleeps, finds its caches cold, more so on a
    light share), and the trace is what the job ran through. Ranks never read: absent (their scheduled rate holds)."""
    out: dict[int, float] = {}
    rows = [s.get("measured_rates") for s in steps[min(window, len(steps) - 1):]]
    for g in range(max((len(r) for r in rows if r), default=0)):
        xs = [float(r[g]) for r in rows if r and g < len(r) and r[g] is not None]
        if xs:
            out[g] = max(1.0, statistics.median(xs))
    return out
