"""The re-split decision for the data-parallel engine (every rank makes the same one), from the
adaptive loop's own pieces, and attaching it (``dp/`` and ``adaptive/`` import nothing from each
other; the app joins them, as ``app/loop.py`` does for MalleusEngine).

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

import numpy as np


class SpeedSplit:
    """The split decision (module doc) under ``detect`` (``DetectConfig``); deterministic, so
    every rank's copy decides the same. ``state_dict`` / ``load_state_dict``: a checkpoint's."""

    def __init__(self, detect, min_share: int = 1):
        from collections import deque

        detect.check()
        self.detect, self.min_share = detect, min_share
        self.est = self.det = None          # built for the world of the first step
        self._skip = 1                      # readings still to leave out (the first step's)
        self._last = None                   # the split of the last call
        #: the readings the estimator keeps (its window), for a checkpoint
        self._kept = deque(maxlen=detect.window)

    def decide(self, step: int, seconds_per_sample: Sequence[float], split):
        """``dp.loop.SplitPolicy.decide``: the next split and its rates, or None."""
        from ..dp.split import split_for

        w = split.world
        if self.est is None:
            self._build(w)
        skip, self._skip = self._skip, 0
        if self._last is not None and split != self._last:
            self._skip = 1                  # the next step is the new split's first
        self._last = split
        if skip:
            return None
        if np.isfinite(self.est.add(list(seconds_per_sample), [1.0] * w)).any():
            self._kept.append([float(x) for x in seconds_per_sample])     # the estimator kept it
        if (step + 1) % self.detect.every:
            return None
        trig = self.det.check(self.est.rates())
        if trig is None:
            return None
        self.det.planned_for(trig.rates)
        new = split_for(trig.rates, split.global_batch, split.micro_batches,
                        min_share=self.min_share)
        return None if new == split else (new, trig.rates)

    def _build(self, world: int) -> None:
        from ..adaptive.detect import Detector
        from ..adaptive.rates import RateEstimator

        self.est = RateEstimator(world, window=self.detect.window, healthy=self.detect.healthy)
        self.det = Detector(world, self.detect)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (plain values): the estimator's window of readings (it keeps
        nothing else of them), the detector's planned rates, streak and cooldown, the readings
        still to skip and the last split seen."""
        last = self._last
        return {"readings": [list(x) for x in self._kept], "skip": self._skip,
                "last": None if last is None else {"shares": list(last.shares),
                                                   "micro_batches": last.micro_batches},
                "planned": None if self.det is None else [float(x) for x in self.det.planned],
                "streak": 0 if self.det is None else self.det.streak,
                "cooldown": 0 if self.det is None else self.det.cooldown}

    def load_state_dict(self, state: dict) -> None:
        """The state :meth:`state_dict` gave (the same world): the estimator rebuilt from the
        readings it kept, so the next decisions are the uninterrupted run's. ValueError naming
        the field for a state of another world."""
        from ..dp.split import Split

        planned, last = state.get("planned"), state.get("last")
        shares = None if last is None else last["shares"]
        world = len(planned) if planned is not None else len(shares) if shares is not None \
            else None
        bad = [f"{k}={v!r}" for k, v in (("planned", planned), ("last.shares", shares))
               if v is not None and len(v) != world]
        bad += [f"readings[{i}]={r!r}" for i, r in enumerate(state.get("readings", []))
                if len(r) != world]
        if bad:
            raise ValueError(f"the re-split policy's checkpoint state is for {world} ranks; "
                             f"{', '.join(bad)}")
        self.est = self.det = None
        self._kept.clear()
        self._skip = int(state.get("skip", 1))
        self._last = None if last is None else Split(tuple(shares), last["micro_batches"])
        if world is None:
            return
        self._build(world)
        for r in state.get("readings", []):
            self.est.add(list(r), [1.0] * world)
            self._kept.append([float(x) for x in r])
        self.det.planned = np.asarray(planned, dtype=np.float64) if planned is not None \
            else self.det.planned
        self.det.streak, self.det.cooldown = int(state["streak"]), int(state["cooldown"])


class KeepSplit:
    """A policy that never re-splits: the loop runs for its facts only (``malleus.adaptive``
    false with ``malleus.metrics_dir`` set)."""

    def decide(self, step, seconds_per_sample, split):
        return None


def attach_dp_loop(engine, settings):
    """Attach :class:`SpeedSplit` under ``settings`` (``dp.settings.DPSettings``) to
    ``engine`` (a ``MalleusDPEngine``), or :class:`KeepSplit` when ``settings.adaptive`` is
    false but ``settings.metrics_dir`` asks for metrics; and the metrics writer
    (:func:`write_metrics`). Returns the loop (None: none)."""
    if settings.adaptive:
        loop = engine.attach_loop(SpeedSplit(settings.detect))
    elif settings.metrics_dir:
        loop = engine.attach_loop(KeepSplit())
    else:
        return None
    if loop is not None and settings.metrics_dir:
        write_metrics(engine, loop, settings)
    return loop


def write_metrics(engine, loop, settings) -> None:
    """Rank 0 writes ``settings.metrics_dir/metrics.jsonl`` (``report/metrics.py``'s
    ``StepRecord`` lines, and each re-split as an event line after the step before its first),
    from every step's :class:`~malleus_ds.dp.loop.StepFacts` (told one step late: an event is
    held until its step's predecessor is written)."""
    from ..emulation.straggler import StragglerSchedule
    from ..report.metrics import MetricsWriter, StepRecord

    writer = MetricsWriter(settings.metrics_dir if loop.rank == 0 else None)
    schedule = StragglerSchedule.parse(settings.straggler, loop.world) \
        if settings.straggler else None
    written = [0]                           # events of loop.events already written

    def on_step(f) -> None:
        rates = ({str(r): x for r, x in schedule.rates(f.step, loop.world).items()}
                 if schedule is not None else {})
        writer.write(StepRecord(f.step, f.loss, f.samples, f.step_time_s, f.compute_s,
                                f.emulated_s, rates, plan="split-" + "-".join(
                                    str(x) for x in f.shares)))
        for ev in loop.events[written[0]:]:
            if ev["step"] > f.step + 1:
                break
            writer.write_event(ev)
            written[0] += 1

    loop.observers.append(on_step)
