"""A whole replay (``malleus-sim replay``): every policy over one trace, and the result as the
JSON ``--json`` writes and the table and plot read (``output.py``).

Beyond samples/s per policy, it accounts for what the re-planning policies did:

* **events**: each decision of ``malleus`` (adopted or not) and each restart of ``restart``: the
  trace change it answered (the last change of the true rates before the loop asked; its
  detection seconds are from that change to the request, its detection steps the loop's steps
  that ended in between), the planner's seconds, the seconds
  the job stood still (migration or restart), and what the switch won or lost: the samples
  its new plan made until the next switch, against the samples the old plan would have made
  in the same time under the same true rates, less those the pause cost
  (:func:`switch_gain`);
* **break-even**: per straggler of the trace (the rows that start and end together at one
  rate: a node, or one GPU), the shortest duration for which switching to the planner's plan
  pays: below it, detection, planning and both switches (in, and back out at recovery) cost
  more samples than the faster plan wins (:func:`break_even_s`);
* **detection**: the loop's detection delay in steps over its events, against the detector's
  own latency (:func:`detection_summary`): per-step timings are exact in a replay, as on GPUs,
  so at any scale a change should be answered within that many steps.
"""
from __future__ import annotations

import bisect
from typing import Sequence

from ..adaptive.settings import AdaptiveSettings
from ..migrate.group_sets import GroupMirror
from .costs import MigrationCost, RestartCost
from .run import RUNNERS, PolicyResult, Replay, ReplayError, capacity_bound, run_static
from .trace import Segment, Trace

POLICIES = ("static", "rebalance-data", "oracle", "malleus", "restart")
#: the triggers of the loop's detector (``adaptive/detect.trigger_kind``)
DETECTED = ("onset", "change", "recovery")


def check_policies(names: Sequence[str]) -> list[str]:
    """The policies asked for, checked (``--policies``)."""
    out = []
    for n in names:
        n = n.strip()
        if n not in POLICIES:
            raise ReplayError(f"--policies: unknown policy {n!r}; one of {', '.join(POLICIES)}")
        if n not in out:
            out.append(n)
    if not out:
        raise ReplayError("--policies: name at least one policy")
    return out


def _rates_at(segs: Sequence[Segment], starts: list[float], t: float) -> int:
    return max(0, bisect.bisect_right(starts, t) - 1)


def switch_gain(rp: Replay, segs: Sequence[Segment], old, new, t0: float, pause_s: float,
                t1: float) -> float:
    """Samples a switch from ``old`` to ``new`` at ``t0`` won by ``t1`` (the next switch or the
    end): ``new``'s samples from ``t0 + pause_s`` to ``t1`` less ``old``'s from ``t0`` to ``t1``,
    each under the true rates of every segment in between."""
    won = 0.0
    spp = rp.samples_per_step
    for s in segs:
        if s.end_s <= t0 or s.start_s >= t1:
            continue
        rates = s.rate_map()
        a, b = max(s.start_s, t0), min(s.end_s, t1)
        won -= (b - a) * spp / rp.step_seconds(old, rates)
        a = max(a, t0 + pause_s)
        if b > a:
            won += (b - a) * spp / rp.step_seconds(new, rates)
    return won


def break_even_s(rp: Replay, rates: dict[int, float], costs: MigrationCost, detect_s: float
                 ) -> tuple[float, dict]:
    """The shortest straggler duration ``D`` (seconds) at ``rates`` for which a switch to the
    planner's plan pays, with its terms. In: detection ``d``, planning ``p``, migration ``m1``
    (the job stands still) and then the plan's gain ``s1 - s0`` samples/s over static; out, at
    recovery: detection ``d`` again on the new plan (healthy, ``h1 <= h``) and migration ``m2``
    back (to a layout whose groups the job still holds: ``migrate/group_sets.py``).
    ``net(D) = (D - d - p - m1)(s1 - s0) - m1 s0 - d (h - h1) - m2 h``, zero at ``D``. ``inf``
    where the plan is no faster than static."""
    from .job import problem_job

    spp = rp.samples_per_step
    new = rp.best_plan(rates)
    p = rp.plan_seconds.get(tuple(sorted(rates.items())), 0.0)
    s0 = spp / rp.step_seconds(rp.static, rates)
    s1 = spp / rp.step_seconds(new, rates)
    h = spp / rp.step_seconds(rp.static, {})
    h1 = spp / rp.step_seconds(new, {})
    spec = problem_job(rp.problem, rp.static)
    groups = GroupMirror(rp.static, spec.world)     # back out: static's groups are still held
    m1 = costs.of_switch(spec, rp.static, new, rp.step_seconds(new, rates),
                         held=groups.live).seconds
    groups.switch(new)
    m2 = costs.of_switch(spec, new, rp.static, rp.step_seconds(rp.static, {}),
                         held=groups.live).seconds
    terms = {"detect_s": round(detect_s, 3), "planning_s": round(p, 3),
             "migration_in_s": round(m1, 3), "migration_out_s": round(m2, 3),
             "gain_samples_per_s": round(s1 - s0, 6)}
    if new.id == rp.static.id or not s1 > s0:
        return float("inf"), terms
    cost = m1 * s0 + detect_s * (h - h1) + m2 * h
    return detect_s + p + m1 + cost / (s1 - s0), terms


def stragglers(trace: Trace) -> list[tuple[float, dict[int, float], int]]:
    """The trace's stragglers: rows that start and end together at one rate, grouped (a node
    or a GPU), as (rate, {gpu: rate}, how many such) per distinct group of GPUs and rate."""
    groups: dict[tuple[float, float, float], list[int]] = {}
    for e in trace.events:
        groups.setdefault((e.start_s, e.end_s, e.rate), []).append(e.gpu)
    out: dict[tuple, list] = {}
    for (a, b, r), gpus in groups.items():
        key = (tuple(sorted(gpus)), r)
        if key in out:
            out[key][2] += 1
        else:
            out[key] = [r, {g: r for g in sorted(gpus)}, 1]
    return [tuple(v) for v in out.values()]


def _run_policies(rp: Replay, segs: Sequence[Segment], names: Sequence[str], runners: dict,
                  progress: bool) -> dict[str, PolicyResult]:
    """Each policy's result over ``segs``, in order, with a progress bar when asked."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(segs) * len(names), desc="replay", unit="segment", leave=False)
    tick = bar.update if bar else None
    try:
        results: dict[str, PolicyResult] = {}
        for n in names:
            if bar is not None:
                bar.set_description(f"replay: {n}")
            results[n] = runners[n](rp, segs, tick)
    finally:
        if bar is not None:
            bar.close()
    return results


def _policy_rows(results: dict[str, PolicyResult], base: PolicyResult, healthy: float,
                 trace: Trace) -> dict[str, dict]:
    """Per policy: samples/s against static and healthy, switches, migration seconds, GPU hours
    lost, its share of the oracle's gain; the malleus loop's planning seconds and steps."""
    hours = trace.horizon_s / 3600.0
    pol = {}
    for n, r in results.items():
        pol[n] = {"samples_per_s": round(r.samples_per_s, 6),
                  "vs_static": round(r.samples_per_s / base.samples_per_s, 6),
                  "vs_healthy": round(r.samples_per_s / healthy, 6),
                  "switches": r.switches, "migration_s": round(r.migration_s, 3),
                  "gpu_hours_lost": round(trace.num_gpus * hours
                                          * (1.0 - r.samples_per_s / healthy), 3)}
    if "oracle" in pol:
        gain = pol["oracle"]["vs_static"] - 1.0
        for n, p in pol.items():
            p["of_oracle_gain"] = round((p["vs_static"] - 1.0) / gain, 4) if gain > 1e-9 \
                else None
    if "malleus" in results:
        m = results["malleus"]
        pol["malleus"].update({"planning_s": round(m.planning_s, 3), "steps": m.steps,
                               "stepped_steps": m.stepped})
    return pol


def _segment_rows(rp: Replay, segs: Sequence[Segment], results: dict[str, PolicyResult],
                  base: PolicyResult) -> list[dict]:
    """Per segment: its slow GPUs and each fixed policy's step there, from its timeline."""
    spp = rp.samples_per_step
    seg_rows = []
    for k, s in enumerate(segs):
        rates = s.rate_map()
        ev = {"start_s": s.start_s, "end_s": s.end_s, "slow_gpus": len(rates),
              "worst_rate": max(rates.values(), default=1.0),
              "static_step_s": round(spp / base.timeline[k][2], 6)}
        if "rebalance-data" in results:
            ev["rebalance_step_s"] = round(spp / results["rebalance-data"].timeline[k][2], 6)
        if "oracle" in results:
            ev["oracle_step_s"] = round(spp / results["oracle"].timeline[k][2], 6)
            ev["planning_s"] = round(rp.plan_seconds.get(tuple(sorted(rates.items())), 0.0), 3)
        seg_rows.append(ev)
    return seg_rows


def _break_even_rows(rp: Replay, trace: Trace, events: list[dict], settings: AdaptiveSettings,
                     switch_costs: MigrationCost, step_s: float, how_many: int) -> list[dict]:
    """The break-even of the trace's ``how_many`` most frequent stragglers, with the malleus
    loop's median detection seconds (without a detection: the detector's own latency)."""
    detect = sorted(e["detection_s"] for e in events
                    if e["policy"] == "malleus" and e["detection_s"] is not None)
    detect_s = detect[len(detect) // 2] if detect else \
        (settings.detect.window // 2 + settings.detect.confirm) * settings.detect.every * step_s
    be = []
    for rate, rates, count in sorted(stragglers(trace), key=lambda x: (-x[2], -x[0]))[:how_many]:
        d, terms = break_even_s(rp, rates, switch_costs, detect_s)
        be.append({"gpus": len(rates), "rate": rate, "count": count,
                   "break_even_s": None if d == float("inf") else round(d, 1), **terms})
    return be


def replay(problem, trace: Trace, step_s: float, policies: Sequence[str] = POLICIES,
           planner_time_limit_s: float | None = None, seed: int = 0,
           settings: AdaptiveSettings | None = None, switch_costs: MigrationCost | None = None,
           restart_costs: RestartCost | None = None, zero_stage: int = 1,
           break_even_max: int = 12, progress: bool = False, charge=None) -> dict:
    """Replay every policy over ``trace``; the result as the JSON ``--json`` writes.
    ``break_even_max``: stragglers (by how often the trace has them) whose break-even is
    computed (none for a problem without a memory section: a switch's bytes are unknown);
    ``charge``: (the planner's wall seconds, the request) -> seconds on the malleus loop's clock
    (None: as measured)."""
    from .loop import run_malleus
    from .restart import run_restart

    if trace.num_gpus != problem.num_gpus:
        raise ReplayError(f"the trace is for {trace.num_gpus} GPUs, the problem has "
                          f"{problem.num_gpus}")
    names = check_policies(policies)
    settings = settings or AdaptiveSettings()
    switch_costs = switch_costs or MigrationCost()
    restart_costs = restart_costs or RestartCost()
    if "malleus" in names and problem.memory is None:
        raise ReplayError(f"problem '{problem.name}' has no memory section: the malleus policy "
                          f"sizes each switch's migration from memory.layer_static_mb and "
                          f"memory.embedding_mb; add them, or leave malleus out of --policies")
    rp = Replay(problem, step_s, planner_time_limit_s, seed)
    segs = trace.segments()
    runners = dict(RUNNERS)
    runners["malleus"] = lambda rp_, segs_, prog: run_malleus(
        rp_, segs_, settings, switch_costs, zero_stage, charge=charge, progress=prog)
    runners["restart"] = lambda rp_, segs_, prog: run_restart(
        rp_, segs_, settings, restart_costs, prog)
    results = _run_policies(rp, segs, names, runners, progress)
    healthy = rp.healthy_samples_per_s
    base = results.get("static") or run_static(rp, segs)
    pol = _policy_rows(results, base, healthy, trace)
    seg_rows = _segment_rows(rp, segs, results, base)
    events = _events(rp, segs, results)
    be = _break_even_rows(rp, trace, events, settings, switch_costs, step_s,
                          break_even_max if problem.memory is not None else 0)
    bound = capacity_bound(segs, trace.num_gpus)
    detection = detection_summary(events, settings or AdaptiveSettings())
    return {"problem": problem.name, "num_gpus": trace.num_gpus,
            "hours": round(trace.horizon_s / 3600.0, 6),
            "step_s": step_s, "samples_per_step": rp.samples_per_step,
            "healthy_samples_per_s": round(healthy, 6),
            "capacity_bound": round(bound, 6),
            "capacity_samples_per_s": round(healthy * bound, 6),
            "rows": len(trace.events), "segments": len(segs),
            "switch_costs": vars(switch_costs), "restart_costs": restart_costs.terms(),
            "policies": pol, "events": events, "segment_steps": seg_rows,
            "break_even": be, "detection": detection,
            "timelines": {n: r.timeline for n, r in results.items()}}


def detector_latency_steps(settings: AdaptiveSettings) -> int:
    """The steps the loop's detector needs to answer a change in exact timings: the change
    must hold the median of its ``window`` (half of it), then ``confirm`` checks in a row, one
    every ``every`` steps, plus the check cadence the change may fall between."""
    d = settings.detect
    return (d.window // 2 + d.confirm) * d.every + d.every


def detection_summary(events: list[dict], settings: AdaptiveSettings) -> dict | None:
    """The malleus loop's detection delay in steps over the changes its detector answered
    (:data:`DETECTED`; not its forced, carried or missed-promise re-plans): median, largest,
    the detector's latency and how many events took longer. None without such an event. A
    request answered first by a re-split at once counts once (by the planner's decision)."""
    steps = sorted(e["detection_steps"] for e in events
                   if e["policy"] == "malleus" and e.get("detection_steps") is not None
                   and e["trigger"] in DETECTED and not e.get("first"))
    if not steps:
        return None
    bound = detector_latency_steps(settings)
    return {"events": len(steps), "median_steps": steps[len(steps) // 2],
            "max_steps": steps[-1], "latency_steps": bound,
            "over": sum(s > bound for s in steps)}


def _events(rp: Replay, segs: Sequence[Segment], results: dict) -> list[dict]:
    """The per-event table (module doc) of the malleus and restart policies."""
    starts = [s.start_s for s in segs]
    out = []

    def change_before(t: float) -> tuple[float, Segment]:
        s = segs[_rates_at(segs, starts, t)]
        return s.start_s, s

    if "malleus" in results:
        m = results["malleus"]
        adopted = [d for d in m.decisions if d.adopted]
        ends = {id(d): (adopted[i + 1].t if i + 1 < len(adopted) else m.seconds)
                for i, d in enumerate(adopted)}
        plans = m.plans
        for d in m.decisions:
            at, seg = change_before(d.requested_t if d.requested_t is not None else d.t)
            row = {"policy": "malleus", "t_s": round(d.t, 3), "trigger": d.trigger,
                   "adopted": d.adopted, "slow_gpus": len(seg.rates),
                   "worst_rate": max(dict(seg.rates).values(), default=1.0),
                   "change_s": at,
                   "detection_s": None if d.requested_t is None else round(d.requested_t - at, 3),
                   "detection_steps": None if d.requested_t is None else
                   bisect.bisect_right(m.step_ends, d.requested_t)
                   - bisect.bisect_right(m.step_ends, at),
                   "planning_s": round(d.planning_s, 3), "migration_s": round(d.migration_s, 3),
                   "bytes": d.bytes, "first": d.first, **d.terms}
            if d.adopted:
                won = switch_gain(rp, segs, plans[d.from_plan], plans[d.to_plan], d.t,
                                  d.migration_s, ends[id(d)])
                row["won_samples"] = round(won, 1)
                row["won_s"] = round(won / rp.healthy_samples_per_s, 2)
            out.append(row)
    if "restart" in results:
        r = results["restart"]
        for i, x in enumerate(r.restarts):
            at, seg = change_before(x["t"])
            t1 = r.restarts[i + 1]["t"] if i + 1 < len(r.restarts) else r.seconds
            won = switch_gain(rp, segs, r.plans[x["from"]], r.plans[x["to"]], x["t"],
                              x["seconds"], t1)
            out.append({"policy": "restart", "t_s": x["t"], "trigger": "restart",
                        "adopted": True, "slow_gpus": len(seg.rates),
                        "worst_rate": max(dict(seg.rates).values(), default=1.0),
                        "change_s": at, "detection_s": x["detection_s"],
                        "planning_s": x["planning_s"], "migration_s": x["seconds"],
                        "bytes": None, "won_samples": round(won, 1),
                        "won_s": round(won / rp.healthy_samples_per_s, 2)})
    return out
