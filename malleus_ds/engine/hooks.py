"""The step hooks: where a loop attached to the engine sees each step (issue 32).

MalleusEngine calls these at fixed points of ``train_batch`` and ``apply_scheduled_switch``;
the engine imports no loop. The app attaches one (``app/loop.py`` attaches the adaptive loop,
``malleus_ds/adaptive/control.py``); without one the engine runs :class:`NoLoop`: nothing
measured, nothing decided. A hook object has these methods:

* ``contribute(compute_s) -> (ready, probe_per_unit)``: this rank's values for the step's one
  all-reduce (``step_reduce.py``): rank 0's "a decision is ready" flag and a probe reading;
* ``observe(step, sums)``: after that all-reduce, every rank's numbers (``StepSums``);
* ``after_reduce(step)``: right after it, when every rank leaves it at once (probes run here);
* ``step_done(seconds)``: the step's wall time;
* ``before_step(step) -> [(event, plan JSON or None), ...]``: collective, at the boundary
  before ``step``: plans to switch to, the same on every rank;
* ``switched(plan, rates, job, migration)`` / ``considered(rates)``: a switch happened (made
  for ``rates``) / a decision kept the running plan;
* ``take_events() -> [dict]``: events for metrics.jsonl; ``measured_rates() -> [float|None]``;
  ``close()``.
"""
from __future__ import annotations


class NoLoop:
    """The hooks of an engine with no loop attached: nothing measured, nothing decided."""

    def __init__(self, world: int) -> None:
        self.world = world

    def contribute(self, compute_s: float, probe_s: float | None = None) -> tuple[bool, float]:
        return False, 0.0

    def observe(self, step: int, sums) -> None:
        pass

    def after_reduce(self, step: int) -> None:
        pass

    def step_done(self, seconds: float) -> None:
        pass

    def before_step(self, step: int) -> list:
        return []

    def switched(self, plan, rates, job=None, migration=None) -> None:
        pass

    def considered(self, rates) -> None:
        pass

    def take_events(self) -> list[dict]:
        return []

    def measured_rates(self) -> list[float | None]:
        return [None] * self.world

    def close(self) -> None:
        pass
