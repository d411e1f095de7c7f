"""When a measured rate shift triggers a re-plan: Malleus's rule (DESIGN.md §2, §6).

A rate below ``healthy`` counts as 1.0; a re-plan needs some rate to differ from the one the
current plan was made for by ``change`` (relative), in ``confirm`` consecutive detections, and
none is raised during a ``cooldown`` after planning (:class:`Detector`; its settings,
:class:`DetectConfig` and :data:`HEALTHY`, live with the ``malleus`` section's in
``interop/malleus_section.py`` and are re-exported here).

numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..interop.malleus_section import HEALTHY, DetectConfig  # noqa: F401  (the loop's names)
from .work import per_rank


@dataclass(frozen=True)
class Trigger:
    """A confirmed rate shift: plan for ``rates``."""

    kind: str                   # "onset" | "change" | "recovery"
    rates: tuple[float, ...]    # normalised smoothed rates (healthy ones = 1.0), per rank


def trigger_kind(rates: np.ndarray, planned: np.ndarray) -> str:
    """What a shift from the ``planned`` rates to ``rates`` (both normalised) is: "recovery"
    (every rank healthy again), "onset" (from an all-healthy plan) or "change"."""
    if np.all(rates == 1.0) and np.any(planned > 1.0):
        return "recovery"
    return "onset" if np.all(planned == 1.0) else "change"


class Detector:
    """Decides, from smoothed rates, when to re-plan (see :class:`DetectConfig`).

    ``planned`` holds the normalised rates the current plan was made for (all 1.0 at start).
    """

    def __init__(self, world: int, cfg: DetectConfig = DetectConfig()):
        cfg.check()
        self.world, self.cfg = world, cfg
        self.planned = np.ones(world, dtype=np.float64)
        self.streak = 0       # consecutive detections with a shift
        self.cooldown = 0     # detections still to skip
        #: per rank, a rate it is planned at however healthy it reads (a flapping rank,
        #: ``stragglers.StragglerWatch.holds``; 1.0: none)
        self.hold = np.ones(world, dtype=np.float64)

    def normalise(self, rates: Sequence[float], held: bool = True) -> np.ndarray:
        """A rate below ``healthy`` -> 1.0; NaN (no data) -> the planned value for that rank;
        ``held``: a held rank at least at its :attr:`hold`."""
        r = per_rank(rates, self.world, "rates").copy()
        nan = np.isnan(r)
        r[nan] = self.planned[nan]
        r[r < self.cfg.healthy] = 1.0
        return np.maximum(r, self.hold) if held else r

    def check(self, rates: Sequence[float], idle: Sequence[bool] | None = None
              ) -> Trigger | None:
        """One detection (every ``cfg.every`` steps) on :meth:`RateEstimator.rates`.

        ``idle[d]``: rank d has no work under the running plan (suspended). For such a rank only
        a *decrease* counts: it may be fit to come back, while a rise changes nothing (it is
        out already) and its probe readings are the noisiest."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return None
        r, p = self.normalise(rates), self.planned
        # a move by `change` (relative), or a rank planned as slow that now reads healthy: a
        # plan made for a rate under 1 / (1 - change) could otherwise never see its rank
        # recover (1.0 is the floor, and 1.0 is not `change` below it), so one spurious
        # reading just over `healthy` would keep a healthy rank out for good)
        moved = (np.abs(r - p) >= self.cfg.change * p) | ((p > 1.0) & (r == 1.0))
        if idle is not None:
            moved &= ~np.asarray(idle, dtype=bool) | (r < p)
        shifted = bool(np.any(moved))
        self.streak = self.streak + 1 if shifted else 0
        if self.streak < self.cfg.confirm:
            return None
        return Trigger(trigger_kind(r, p), tuple(round(float(x), 3) for x in r))

    def planned_for(self, rates: Sequence[float]) -> None:
        """After a planning attempt (adopted or not): remember ``rates``, restart hysteresis and
        the cooldown."""
        self.planned = self.normalise(rates)
        self.streak = 0
        self.cooldown = self.cfg.cooldown
