"""Rank 0's re-split decision for the data-parallel engine, from the adaptive loop's own pieces,
and attaching it (``dp/`` and ``adaptive/`` import nothing from each other; the app joins them,
as ``app/loop.py`` does for MalleusEngine).

:class:`SpeedSplit` is the ``dp.loop.SplitPolicy`` that ``malleus_ds.initialize`` attaches:

1. each step, every rank's compute seconds per sample go into ``adaptive.rates.RateEstimator``
   as that rank's compute seconds over one unit of work (a sample: the units are the same for
   every rank, so the estimator's per-unit times are the seconds per sample): per-step times
   relative to the step's median, median-smoothed over ``detect.window`` steps, divided by a
   healthy reference, so ``1.0`` is healthy and ``3.0`` three times slower per sample. The
   run's first step and the first step under each new split are left out (allocations, first
   touches, ZeRO-3 recording its fetch order), as the pipeline loop leaves out a plan's first;
2. every ``detect.every`` steps, ``adaptive.detect.Detector`` checks those rates against the
   ones the current split was made for (a rate below ``detect.healthy`` counts as 1.0; a move
   of ``detect.change`` relative, in ``detect.confirm`` detections in a row, then
   ``detect.cooldown`` detections skipped): hysteresis, so noise never re-splits;
3. on a trigger, the next split is ``dp.split.split_for(rates, global_batch, micro_batches,
   min_share=1)``: shares in proportion to speed, a rank too slow for one sample per
   micro-batch kept at one (it still runs every micro-batch and joins every collective). A split
   equal to the current one is no decision.

The estimator's work-shape terms (a first stage's extra work, a per-micro-batch fixed cost) are
not used: every rank runs the same micro-batches, and seconds per sample assume a rank's compute
grows with its samples. A fixed cost per micro-batch (a small model, a short micro-batch) makes
a rank with a small share read slower per sample than it is, which keeps a slowed rank's share
small after it recovers until its share's cost per sample reads healthy.
"""
from __future__ import annotations

from typing import Sequence


class SpeedSplit:
    """Rank 0's split decision (module doc) under ``detect`` (``DetectConfig``)."""

    def __init__(self, detect, min_share: int = 1):
        detect.check()
        self.detect, self.min_share = detect, min_share
        self.est = self.det = None          # built for the world of the first step
        self._skip = 1                      # readings still to leave out (the first step's)
        self._last = None                   # the split of the last call

    def decide(self, step: int, seconds_per_sample: Sequence[float], split):
        """``dp.loop.SplitPolicy.decide``: the next split and its rates, or None."""
        from ..adaptive.detect import Detector
        from ..adaptive.rates import RateEstimator
        from ..dp.split import split_for

        w = split.world
        if self.est is None:
            self.est = RateEstimator(w, window=self.detect.window, healthy=self.detect.healthy)
            self.det = Detector(w, self.detect)
        skip, self._skip = self._skip, 0
        if self._last is not None and split != self._last:
            self._skip = 1                  # the next step is the new split's first
        self._last = split
        if skip:
            return None
        self.est.add(list(seconds_per_sample), [1.0] * w)
        if (step + 1) % self.detect.every:
            return None
        trig = self.det.check(self.est.rates())
        if trig is None:
            return None
        self.det.planned_for(trig.rates)
        new = split_for(trig.rates, split.global_batch, split.micro_batches,
                        min_share=self.min_share)
        return None if new == split else (new, trig.rates)


def attach_dp_loop(engine, settings):
    """Attach :class:`SpeedSplit` under ``settings`` (``dp.settings.DPSettings``) to
    ``engine`` (a ``MalleusDPEngine``) unless ``settings.adaptive`` is false; returns the loop
    (None: none)."""
    if not settings.adaptive:
        return None
    return engine.attach_loop(SpeedSplit(settings.detect))
