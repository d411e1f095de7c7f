"""Replay a training job under a straggler trace, policy by policy (``malleus-sim replay``).

The job is a planning problem (its nominal layout; its own ``rates`` are ignored) and the
seconds of one healthy step of its static plan (``step_s``): the cost model's step time of a
plan under a rate vector, times ``step_s`` over the model's healthy step time of the static
plan, is that plan's step in seconds under those rates. The trace is cut into segments of
constant rates (``trace.py``); each policy steps through them:

* ``static``: the nominal plan throughout, as DeepSpeed and Megatron run;
* ``oracle``: at each change of the true rates, at once and for free, the plan the planner
  finds for them (a ceiling on what any re-planning reaches; plans are cached by rate
  vector, and the planner's wall time is reported per event, not charged);
* ``rebalance-data``: the static layout with only its micro-batches per pipeline re-split for
  the true rates, at once and for free (the planner's ``data-only`` baseline): the best live
  policy of Greyhound (ATC'25), which moves no state.

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
from .trace import Segment, Trace

#: the policies this replay has; the issue's others (``malleus``: the real adaptive loop,
#: ``restart``) are refused by name until they are built
POLICIES = ("static", "rebalance-data", "oracle")


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
    static: Plan = field(init=False)
    scale: float = field(init=False)
    _plans: dict = field(default_factory=dict, init=False, repr=False)
    plan_seconds: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ReplayError(f"--step-s={self.step_s:g} must be > 0 (seconds of one healthy "
                              f"step of the static plan)")
        healthy = self.problem.with_rates({})
        self.static = healthy.static_plan()
        self.scale = self.step_s / step_time(healthy, self.static)

    @property
    def samples_per_step(self) -> int:
        return self.static.global_batch_size

    @property
    def healthy_samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    def step_seconds(self, plan: Plan, rates: dict[int, float]) -> float:
        """Seconds of one step of ``plan`` under ``rates``."""
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


def check_policies(names: Sequence[str]) -> list[str]:
    """The policies asked for, checked (``--policies``)."""
    out = []
    for n in names:
        n = n.strip()
        if n in ("malleus", "restart"):
            raise ReplayError(f"--policies: {n!r} is not built yet (issue 33); this replay has "
                              f"{', '.join(POLICIES)}")
        if n not in POLICIES:
            raise ReplayError(f"--policies: unknown policy {n!r}; one of {', '.join(POLICIES)}")
        if n not in out:
            out.append(n)
    if not out:
        raise ReplayError("--policies: name at least one policy")
    return out


def replay(problem: Problem, trace: Trace, step_s: float, policies: Sequence[str] = POLICIES,
           planner_time_limit_s: float | None = None, seed: int = 0,
           progress: bool = False) -> dict:
    """Replay every policy over ``trace``; the result as the JSON ``--json`` writes."""
    if trace.num_gpus != problem.num_gpus:
        raise ReplayError(f"the trace is for {trace.num_gpus} GPUs, the problem has "
                          f"{problem.num_gpus}")
    names = check_policies(policies)
    rp = Replay(problem, step_s, planner_time_limit_s, seed)
    segs = trace.segments()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(segs) * len(names), desc="replay", unit="segment", leave=False)
    try:
        results = {n: RUNNERS[n](rp, segs, bar.update if bar else None) for n in names}
    finally:
        if bar is not None:
            bar.close()
    healthy = rp.healthy_samples_per_s
    base = results.get("static") or run_static(rp, segs)
    hours = trace.horizon_s / 3600.0
    pol = {}
    for n, r in results.items():
        pol[n] = {"samples_per_s": round(r.samples_per_s, 6),
                  "vs_static": round(r.samples_per_s / base.samples_per_s, 6),
                  "vs_healthy": round(r.samples_per_s / healthy, 6),
                  "switches": r.switches, "migration_s": round(r.migration_s, 3),
                  "gpu_hours_lost": round(trace.num_gpus * hours
                                          * (1.0 - r.samples_per_s / healthy), 3)}
    spp = rp.samples_per_step
    events = []
    for k, s in enumerate(segs):        # each policy's step there, from its own timeline
        rates = s.rate_map()
        ev = {"start_s": s.start_s, "end_s": s.end_s, "slow_gpus": len(rates),
              "worst_rate": max(rates.values(), default=1.0),
              "static_step_s": round(spp / base.timeline[k][2], 6)}
        if "rebalance-data" in results:
            ev["rebalance_step_s"] = round(spp / results["rebalance-data"].timeline[k][2], 6)
        if "oracle" in results:
            ev["oracle_step_s"] = round(spp / results["oracle"].timeline[k][2], 6)
            ev["planning_s"] = round(rp.plan_seconds.get(tuple(sorted(rates.items())), 0.0), 3)
        events.append(ev)
    bound = capacity_bound(segs, trace.num_gpus)
    return {"problem": problem.name, "num_gpus": trace.num_gpus, "hours": round(hours, 6),
            "step_s": step_s, "samples_per_step": spp,
            "healthy_samples_per_s": round(healthy, 6),
            "capacity_bound": round(bound, 6),
            "capacity_samples_per_s": round(healthy * bound, 6),
            "rows": len(trace.events), "segments": len(segs),
            "policies": pol, "events": events,
            "timelines": {n: r.timeline for n, r in results.items()}}
