"""A replay's setting (:class:`Replay`) and its policies that only pick a plan per segment.

The job is a planning problem (its nominal layout; its own ``rates`` are ignored) and the
seconds of one healthy step of its static plan (``step_s``): the cost model's step time of a
plan under a rate vector, times ``step_s`` over the model's healthy step time of the static
plan, is that plan's step in seconds under those rates. With ``compute_share`` f < 1 (a run
whose steps are partly communication, ``from_run.py``) only ``f x step_s`` scales so, and
``(1 - f) x step_s`` stays. The trace is cut into segments of
constant rates (``trace.py``); each policy steps through them:

* ``static``: the nominal plan throughout, as DeepSpeed and Megatron run;
* ``oracle``: at each change of the true rates, at once and for free, the plan the planner
  finds for them (a ceiling on what any re-planning reaches; plans are cached by rate
  vector, and the planner's wall time is reported per event, not charged);
* ``rebalance-data``: the static layout with only its micro-batches per pipeline re-split for
  the true rates, at once and for free (the planner's ``data-only`` baseline): the best live
  policy of Greyhound (ATC'25), which moves no state.

The policies that step (``malleus``: the real adaptive loop, ``loop.py``; ``restart``,
``restart.py``) and the whole replay's result (``summary.py``) build on this.

Within a segment a plan runs ``seconds / step`` steps (fractional: the segment's share of
samples). Every policy is judged against the same clock: samples over the trace's seconds.

``capacity_bound``: the time-weighted mean over the trace of the mean over GPUs of
``1 / rate``, the fraction of healthy throughput that the cluster's compute could give if work
moved freely and for free. No policy exceeds it where the nominal layout is the best healthy
one (a layout the planner finds faster even when healthy, e.g. with a smaller pipeline bubble,
can).

numpy only (the planner and the cost model are ours).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..cost import step_time
from ..plan import Plan, PlanError
from ..problem import Problem
from .trace import Segment

class ReplayError(ValueError):
    """A replay that cannot run (a policy unknown, a problem the planner cannot plan)."""


@dataclass
class PolicyResult:
    """What one policy did over the trace."""

    name: str
    samples: float = 0.0
    seconds: float = 0.0
    switches: int = 0
    migration_s: float = 0.0
    #: (start_s, end_s, samples per second) per segment, for the plot
    timeline: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Replay:
    """A replay's setting and the memo of plans and step times its policies share."""

    problem: Problem
    step_s: float
    planner_time_limit_s: float | None = None
    seed: int = 0
    #: the share of a healthy step that is compute (slows with the rates); the rest
    #: (communication, the optimizer, overheads) stays. 1.0: all of it
    compute_share: float = 1.0
    static: Plan = field(init=False)
    scale: float = field(init=False)
    _plans: dict = field(default_factory=dict, init=False, repr=False)
    plan_seconds: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ReplayError(f"--step-s={self.step_s:g} must be > 0 (seconds of one healthy "
                              f"step of the static plan)")
        if not 0.0 < self.compute_share <= 1.0:
            raise ReplayError(f"compute share {self.compute_share:g} must be in (0, 1]")
        healthy = self.problem.with_rates({})
        self.static = healthy.static_plan()
        # seconds per model unit of compute
        self.scale = self.compute_share * self.step_s / step_time(healthy, self.static)

    @property
    def samples_per_step(self) -> int:
        return self.static.global_batch_size

    @property
    def healthy_samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    def step_seconds(self, plan: Plan, rates: dict[int, float]) -> float:
        """Seconds of one step of ``plan`` under ``rates``: the part that is not compute, and
        the cost model's step time in seconds."""
        return (1.0 - self.compute_share) * self.step_s + self.compute_seconds(plan, rates)

    def compute_seconds(self, plan: Plan, rates: dict[int, float]) -> float:
        """The compute part of :meth:`step_seconds` alone (the cost model's step in seconds)."""
        return step_time(self.problem.with_rates(rates), plan) * self.scale

    def best_plan(self, rates: dict[int, float]) -> Plan:
        """The planner's plan for ``rates`` (cached by rate vector; the static plan when every
        GPU is healthy). Its wall seconds are kept in :attr:`plan_seconds`."""
        key = tuple(sorted(rates.items()))
        if key not in self._plans:
            if not key:
                self._plans[key] = self.static
                self.plan_seconds[key] = 0.0
            else:
                from ..planner import plan as run_planner

                t0 = time.perf_counter()
                try:
                    res = run_planner(self.problem.with_rates(rates), seed=self.seed,
                                      time_limit=self.planner_time_limit_s)
                except (PlanError, ValueError) as e:
                    raise ReplayError(f"the planner cannot plan for rates {dict(key)}: {e}") \
                        from None
                self._plans[key] = res.plan
                self.plan_seconds[key] = time.perf_counter() - t0
        return self._plans[key]

    def rebalanced(self, rates: dict[int, float]) -> Plan:
        """The static layout with its micro-batches re-split for ``rates`` (the static plan
        where no re-split is valid or better)."""
        key = ("data", tuple(sorted(rates.items())))
        if key not in self._plans:
            from ..planner.baselines import data_only

            p = data_only(self.problem.with_rates(rates)) if rates else None
            if p is not None and self.step_seconds(p, rates) >= self.step_seconds(
                    self.static, rates):
                p = None
            self._plans[key] = p or self.static
        return self._plans[key]


def rate_vector(seg: Segment, n: int):
    """``seg``'s rates as one array over its ``n`` GPUs (1.0 where healthy)."""
    import numpy as np

    v = np.ones(n)
    for g, r in seg.rates:
        v[g] = r
    return v


def capacity_bound(trace_segments: Sequence[Segment], num_gpus: int) -> float:
    """Time-weighted mean over the segments of the mean over GPUs of ``1 / rate``."""
    total = sum(s.seconds for s in trace_segments)
    if total <= 0:
        return 1.0
    acc = 0.0
    for s in trace_segments:
        slow = sum(1.0 / r for _, r in s.rates)
        frac = (num_gpus - len(s.rates) + slow) / num_gpus
        acc += frac * s.seconds
    return acc / total


def _fixed(rp: Replay, segs: Sequence[Segment], name: str,
           choose: Callable[[dict[int, float]], Plan], progress=None) -> PolicyResult:
    out = PolicyResult(name)
    prev = None
    for s in segs:
        rates = s.rate_map()
        plan = choose(rates)
        if prev is not None and plan.id != prev.id:
            out.switches += 1
        prev = plan
        step = rp.step_seconds(plan, rates)
        sps = rp.samples_per_step / step
        out.samples += sps * s.seconds
        out.seconds += s.seconds
        out.timeline.append((s.start_s, s.end_s, sps))
        if progress is not None:
            progress(1)
    return out


def run_static(rp: Replay, segs: Sequence[Segment], progress=None) -> PolicyResult:
    return _fixed(rp, segs, "static", lambda rates: rp.static, progress)


def run_oracle(rp: Replay, segs: Sequence[Segment], progress=None) -> PolicyResult:
    return _fixed(rp, segs, "oracle", rp.best_plan, progress)


def run_rebalance(rp: Replay, segs: Sequence[Segment], progress=None) -> PolicyResult:
    return _fixed(rp, segs, "rebalance-data", rp.rebalanced, progress)


RUNNERS = {"static": run_static, "rebalance-data": run_rebalance, "oracle": run_oracle}
