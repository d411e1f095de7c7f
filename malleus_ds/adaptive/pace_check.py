"""The loop checks its own predictions (DESIGN.md §6, "The loop checks its own predictions").

Rates are measured, and measurements mislead: a probe that ran in a lucky moment, a light share
that reads slow. Whatever the cause, it shows in one number the loop can always trust: the step
time. The running plan was chosen because the cost model promised a step time for it under the
rates it was planned for; :class:`PaceCheck` holds the loop to that promise.

* **The expectation** of the running plan: the cost model's step time for it under the rates it
  was planned for, in seconds by one scale (:class:`HealthyPace`: seconds per model unit, from
  the job's own healthy steps on its first plan, else from the last re-plan's calibration).
* **The check**: every step after a switch (the first left out), the measured step time
  against the expectation. Worse by more than ``margin`` (relative) in ``patience`` steps in a
  row, or ``severe`` times the promise in ``severe_patience`` steps in a row, is a ``missed``
  verdict; ``kept_after`` judged steps without one is ``kept``. Each is a ``check`` event in
  metrics.jsonl. The user's first plan promised the job's healthy pace once that is measured,
  and is held to the severe rule only: a rate-10 straggler shows in two steps, well before the
  detector's smoothed window confirms it, while a healthy run's noise never reaches it.
* **What a miss does** (``control.py``): re-measure (rates from the steps since the switch
  only), re-plan at once without waiting for the detector's hysteresis, and if the planner finds
  nothing better, go back to the previous plan when that one was measured faster. A miss that
  changed nothing doubles the steps before the check may miss again (``backoff``), so a cost
  model that is merely off on this machine costs a planning round now and then, not a thrash.

The same check catches a healthy rank kept on a light share: its plan promised the pace of a
job with a straggler, the job runs slower than that with no straggler to explain it, and going
back to the previous plan gives the rank full work, where its training timings read the truth.

Its settings, :class:`CheckConfig` (``malleus.check.*``), live with the rest of the ``malleus``
section in ``interop/malleus_section.py``; this module re-exports the name.

Pure Python + numpy: no torch, no process groups.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..interop.malleus_section import CheckConfig


class HealthyPace:
    """Seconds per cost-model unit of this job, from its healthy steps: the median of the last
    ``keep`` step times measured on the job's first plan while every rank read healthy, divided
    by the model's step time of that plan with every rate 1.0. None until ``need`` such steps."""

    def __init__(self, keep: int = 10, need: int = 3) -> None:
        self.keep, self.need = keep, need
        self._steps: deque[float] = deque(maxlen=keep)
        self.model_s: float | None = None       # the model's healthy step time of the first plan

    def add(self, step_s: float, model_s: float) -> None:
        if step_s > 0 and model_s > 0:
            self._steps.append(step_s)
            self.model_s = model_s

    @property
    def seconds(self) -> float | None:
        """The measured healthy step time (s), or None."""
        return float(np.median(self._steps)) if len(self._steps) >= self.need else None

    @property
    def scale(self) -> float | None:
        s = self.seconds
        return s / self.model_s if s is not None and self.model_s else None


class PaceCheck:
    """The running plan's promise against its measured step times (module doc)."""

    def __init__(self, cfg: CheckConfig = CheckConfig()) -> None:
        cfg.check()
        self.cfg = cfg
        self.plan_id: str | None = None
        self.expected_s: float | None = None
        self.why = ""
        self.severe_only = False
        self._reset()
        self._quiet = 0                 # judged steps still to wait after a miss
        self._backoff = cfg.backoff

    def _reset(self) -> None:
        self._judged = 0
        self._streak: list[float] = []
        self._severe: list[float] = []
        self._kept = False

    def expect(self, plan_id: str, expected_s: float | None, why: str = "",
               severe_only: bool = False) -> None:
        """The running plan and its promised step seconds (None: nothing to check). A new plan
        restarts the check; a new expectation for the same plan (re-planned, kept, a healthy
        pace measured further) keeps its count of judged steps and its streaks.
        ``severe_only``: only the severe rule counts, and nothing is ever ``kept`` (the user's
        first plan against the job's healthy pace: a sudden straggler is seen within
        ``severe_patience`` steps, the noise of a healthy run never is)."""
        if plan_id != self.plan_id:
            self._reset()
            self._quiet = 0              # a new plan is judged from its first step
        self.plan_id, self.expected_s, self.why = plan_id, expected_s, why
        self.severe_only = severe_only

    def observe(self, step: int, step_s: float, first: bool = False) -> dict | None:
        """One step. ``first``: the first after a switch (allocation, first touch: up to
        ~1.5x slower), which counts for the severe rule only. Returns a ``check`` event when
        the check decides (``kept`` once per plan, ``missed`` at each miss)."""
        exp = self.expected_s
        if not self.cfg.enabled or exp is None or not exp > 0 or not step_s > 0:
            return None
        if not first:
            self._judged += 1
        if self._quiet > 0:
            self._quiet -= 1
            return None
        slow = step_s > exp * (1 + self.cfg.margin) and not (self.severe_only or first)
        self._streak = self._streak + [step_s] if slow else []
        severe = step_s > exp * self.cfg.severe
        self._severe = self._severe + [step_s] if severe else []
        if (len(self._streak) >= self.cfg.patience
                or len(self._severe) >= self.cfg.severe_patience):
            slow = self._streak if len(self._streak) >= self.cfg.patience else self._severe
            self._streak, self._severe = [], []
            self._quiet = self._backoff
            return self._event(step, "missed", float(np.median(slow)), len(slow))
        if (not self._kept and not self.severe_only and self._judged >= self.cfg.kept_after
                and not self._streak):
            self._kept = True
            return self._event(step, "kept", step_s)
        return None

    def settled(self) -> bool:
        """Would more steps at this pace change nothing? (No streak, no backoff running, and
        the promise judged kept, or one never judged kept.)"""
        return (not self._streak and not self._severe and self._quiet == 0
                and (self._kept or self.severe_only or self.expected_s is None
                     or not self.cfg.enabled))

    def state(self) -> tuple:
        """What further steps could change, for a simulator's fast-forward (control.py)."""
        return (self.plan_id, self.expected_s, self._kept, self._backoff, self.severe_only)

    def skip(self, steps: int) -> None:
        """``steps`` judged steps at a settled pace that a simulator did not run."""
        if self.cfg.enabled and self.expected_s:
            self._judged += steps

    def acted(self, changed: bool) -> None:
        """What the loop did about the last miss: ``changed`` (a new plan or the previous one)
        resets the backoff; nothing changed doubles it."""
        self._backoff = self.cfg.backoff if changed else max(1, 2 * self._backoff)
        self._quiet = 0 if changed else self._backoff
        self._streak, self._severe = [], []

    def _event(self, step: int, outcome: str, measured: float, steps: int = 1) -> dict:
        return {"event": "check", "step": step, "plan": self.plan_id, "outcome": outcome,
                "steps": steps,
                "expected_s": round(self.expected_s, 4), "measured_s": round(measured, 4),
                "ratio": round(measured / self.expected_s, 3), "margin": self.cfg.margin,
                "expected_from": self.why}
