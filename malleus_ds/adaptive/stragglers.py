"""Each straggler's onset and end, as the loop reads them, and what that says of the one now
(pure; issue 52, item 2).

Rank 0 keeps one :class:`StragglerWatch`, with the loop's clock (:attr:`StragglerWatch.now_s`:
the seconds of the steps so far, which the loop adds). At each detection it is given the ranks
that read slow (the detector's normalised rates above 1.0); a rank that turns slow
starts a straggler, one that reads healthy again ends it, each once the detector's ``confirm``
readings in a row agree (dated from the first). Ranks that turn slow at the same
detection and recover at the same detection are one straggler (a node-wide slowdown is one
event, not eight), and each ended straggler's duration goes to the job's
:class:`~malleus_ds.adaptive.duration.DurationModel`. :meth:`StragglerWatch.remaining` is the
model's expected remaining duration of the youngest slowdown among some ranks: a layout made
for the rates of now pays only until that one ends (the loop re-plans then).

**A rank that flaps** (:data:`FLAP_ENDS` slowdowns ended within :data:`FLAP_S`) is held at its
last slow rate (:meth:`StragglerWatch.holds`) until it has stayed healthy for :data:`FLAP_S`:
the loop plans for it as slow meanwhile, instead of following every flip a detection late (a
plan for a rank that has just recovered, or the healthy plan for one slow again). Its ends are
still observed: the model learns how short its slowdowns are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .duration import DurationModel, _minutes

#: a rank whose slowdowns ended this many times within :data:`FLAP_S` seconds flaps (two
#: could be two stragglers, or one whose reading dipped for a moment: three is a pattern)
FLAP_ENDS = 3
#: ...and is held slow until it has stayed healthy this long
FLAP_S = 1800.0


@dataclass(frozen=True)
class Remaining:
    """The expected remaining seconds of a slowdown, and the words a decision's reason gives it
    (e.g. ``expected 8.3 min left (transient 0.93)``)."""

    seconds: float
    age_s: float
    text: str


class StragglerWatch:
    """Per rank, the clock when its current slowdown began (NaN: healthy); the job's
    :class:`DurationModel`, fed each ended straggler (module doc)."""

    def __init__(self, world: int, model: DurationModel | None = None, confirm: int = 1) -> None:
        if confirm < 1:
            raise ValueError(f"confirm={confirm!r}: readings in a row to turn a rank, >= 1")
        self.confirm = confirm
        self._count = np.zeros(world, dtype=np.int64)   # readings in a row against the state
        self._since = np.full(world, np.nan)            # ... since this clock
        self.now_s = 0.0                  # the loop's clock: seconds of its steps so far
        self.onset = np.full(world, np.nan)
        self.model = model if model is not None else DurationModel()
        self.ended: list[tuple[tuple[int, ...], float, float]] = []   # (ranks, start, end)
        self.slow_rate = np.ones(world)     # each rank's last rate read while slow (confirmed)
        self.ends: dict[int, list[float]] = {}   # each rank's recent ends (within FLAP_S)

    def update(self, rates: Sequence[float]) -> list[float]:
        """One detection's reading at :attr:`now_s`: each rank's normalised rate (above 1.0:
        slow). A rank turns slow, or healthy again, once :attr:`confirm` readings in a row say
        so, dated from the first of them (one noisy reading is no onset and no end). Returns
        the durations of the stragglers that ended now (each observed by the model)."""
        r = np.asarray(rates, dtype=np.float64)
        now_s, s = self.now_s, r > 1.0
        if s.shape != self.onset.shape:
            raise ValueError(f"slow: {s.shape[0] if s.ndim else 0} ranks, the watch has "
                             f"{self.onset.shape[0]}")
        was = ~np.isnan(self.onset)
        flip = s != was
        self._count[~flip] = 0
        self._since[flip & (self._count == 0)] = now_s
        self._count[flip] += 1
        go = flip & (self._count >= self.confirm)
        # a slow reading of a rank slow by the watch's own count: a one-reading blip of a
        # healthy rank sets no rate a flapper could later be held at
        held = s & (was | go)
        self.slow_rate[held] = r[held]
        self._count[go] = 0
        self.onset[go & s] = self._since[go & s]
        gone = go & ~s
        out = []
        for start, end in sorted({(float(a), float(b)) for a, b in
                                  zip(self.onset[gone], self._since[gone])}):
            ranks = tuple(int(d) for d in np.flatnonzero(gone & (self.onset == start)
                                                         & (self._since == end)))
            dur = max(0.0, end - start)
            self.model.observe(dur)
            self.ended.append((ranks, start, end))
            out.append(dur)
        for g in np.flatnonzero(gone):
            self.ends.setdefault(int(g), []).append(float(self._since[g]))
        self.onset[gone] = np.nan
        return out

    def holds(self) -> np.ndarray:
        """Per rank, the rate to plan it at however healthy it reads (1.0: none): a flapping
        rank's last slow rate, until :data:`FLAP_S` after its last end (module doc)."""
        out = np.ones(self.onset.shape[0])
        for g, ends in list(self.ends.items()):
            ends[:] = [t for t in ends if self.now_s - t <= FLAP_S]
            if not ends:
                del self.ends[g]
            elif len(ends) >= FLAP_ENDS:
                out[g] = self.slow_rate[g]
        return out

    def steady_s(self) -> float | None:
        """Seconds until :meth:`holds` changes with no new reading (a hold's release, a
        recent end leaving the window); None: never."""
        t = [max(0.0, ends[0] + FLAP_S - self.now_s) for ends in self.ends.values() if ends]
        return min(t) if t else None

    def age_s(self, ranks: Iterable[int] | None = None) -> float | None:
        """Seconds the youngest current slowdown among ``ranks`` (None: all) has lasted; None
        when none of them is slow."""
        on = self.onset if ranks is None else self.onset[list(ranks)]
        on = on[~np.isnan(on)]
        return None if not on.size else max(0.0, self.now_s - float(on.max()))

    def remaining(self, ranks: Iterable[int] | None = None) -> Remaining | None:
        """The expected remaining duration of the youngest slowdown among ``ranks`` (None: no
        such rank is slow)."""
        age = self.age_s(ranks)
        if age is None:
            return None
        m = self.model
        return Remaining(m.remaining_s(age), age,
                         f"{m.brief(age)}; lasted {_minutes(age)}, {len(m.seen)} ended seen")
