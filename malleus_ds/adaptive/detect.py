"""When a measured rate shift triggers a re-plan: Malleus's rule (DESIGN.md §2, §6).

A rate below ``healthy`` counts as 1.0; a re-plan needs some rate to differ from the one the
current plan was made for by ``change`` (relative), in ``confirm`` consecutive detections, and
none is raised during a ``cooldown`` after planning (:class:`Detector`, :class:`DetectConfig`).

numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .work import per_rank


#: a smoothed measured rate below this counts as healthy (1.0): DESIGN.md §6; the default of
#: :attr:`DetectConfig.healthy`, and the threshold ``whatif.py`` and ``malleus-plot`` use
HEALTHY = 1.2


@dataclass(frozen=True)
class DetectConfig:
    """When a measured rate shift triggers re-planning (Malleus's defaults)."""

    every: int = 1          # run detection every N steps (cheap: numpy on rank 0)
    window: int = 5         # median over the last N per-step rates (smoothing)
    healthy: float = HEALTHY  # a smoothed rate below this counts as healthy (1.0)
    change: float = 0.3     # re-plan when |r - p| >= change * p for some rank (relative)...
    confirm: int = 2        # ...in this many consecutive detections (hysteresis)
    cooldown: int = 2       # detections skipped after a planning attempt
    probe_every: int = 2    # a rank without work times its probe every N steps
    #: a link's smoothed rate below this counts as healthy (``link_watch.py``): the waits on a
    #: collective scatter far more from step to step than compute (a small all-reduce on a
    #: loaded host reads well over twice its median now and then on a healthy link)
    link_healthy: float = 2.0
    #: MB a link held slow is probed with (a round trip every ``probe_every`` steps, one held
    #: link at a time: ``engine/link_probe.py``); 0: not probed
    link_probe_mb: float = 0.1
    #: also read the links between the GPUs of a node (TP collectives, reductions inside a
    #: node: ``link_watch.py``): true, false, or None (the default): where the job's nominal
    #: TP degree is above 1, whose collectives cross those links on every layer
    gpu_links: bool | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming ``malleus.detect.<field>=<value>`` for a bad field."""
        rules = (("every", self.every >= 1, ">= 1"), ("window", self.window >= 1, ">= 1"),
                 ("healthy", self.healthy >= 1.0, ">= 1.0 (1.0 = healthy)"),
                 ("change", self.change > 0, "> 0 (relative, e.g. 0.3 = 30%)"),
                 ("confirm", self.confirm >= 1, ">= 1"), ("cooldown", self.cooldown >= 0, ">= 0"),
                 ("probe_every", self.probe_every >= 1, ">= 1"),
                 ("link_healthy", self.link_healthy >= 1.0, ">= 1.0 (1.0 = healthy)"),
                 ("link_probe_mb", self.link_probe_mb >= 0, ">= 0 (0: links are not probed)"),
                 ("gpu_links", self.gpu_links in (None, True, False),
                  "true, false or null (null: where the job's TP degree is above 1)"))
        for name, ok, need in rules:
            if not ok:  # NaN fails every comparison, so it is rejected too
                raise ValueError(f"detect.{name}={getattr(self, name)!r} must be {need}")


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

    def normalise(self, rates: Sequence[float]) -> np.ndarray:
        """A rate below ``healthy`` -> 1.0; NaN (no data) -> the planned value for that rank."""
        r = per_rank(rates, self.world, "rates").copy()
        nan = np.isnan(r)
        r[nan] = self.planned[nan]
        r[r < self.cfg.healthy] = 1.0
        return r

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
