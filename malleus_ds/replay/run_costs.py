"""The step, switch and planning terms of ``--from-run`` (``from_run.py``), fitted to a recorded
run's ``migrate`` and ``replan`` events and its step lines: its steady healthy steps
(:func:`steady`), the migration's fixed part and
bandwidth and the first step's warm-up (:func:`switch_costs`), the seconds charged per planner
request (:func:`charge`), and, for runs without ``wait_s``, how much longer steps ran while the
planner searched (:func:`planner_stall`)."""
from __future__ import annotations

import statistics

from .costs import MigrationCost


#: a job's first healthy steps run slow while it starts (the planner's worker importing, first
#: touch of memory), well past the noise of the steps after them.
#: The healthy steps before the first within this factor of their median are left out
START_BAND = 1.1


def steady(steps, conds, switched=()) -> list[dict]:
    """The healthy steps of the job's first plan, anywhere in the run (``conds``: each step's
    straggler condition, empty when healthy), less the first after a switch (``switched``:
    their step numbers) and the start-up: the leading steps slower than :data:`START_BAND`
    times their median (at least two are kept). The healthy step is their median: a run's pace
    drifts (the steps after a recovery can run faster than the ones before the straggler), and
    a median over both ends is the least moved by either."""
    plan0 = steps[0].get("plan") if steps else None
    sw = {int(k) for k in switched}
    ok = [s for s, c in zip(steps, conds)
          if not c and s.get("plan") == plan0 and int(s["step"]) not in sw]
    if len(ok) < 3:
        return ok
    med = statistics.median(float(s["step_time_s"]) for s in ok)
    k = 0
    while k < len(ok) - 2 and float(ok[k]["step_time_s"]) > START_BAND * med:
        k += 1
    return ok[k:]


def healthy_replan(replan: dict) -> bool:
    """Was this re-plan asked with every rank healthy (the planner answers without a search)?"""
    return all(r is not None and r <= 1.0 for r in replan.get("measured_rates") or [None])


def planner_stall(steps, events) -> float:
    """How much longer a step ran while the planner searched on the ranks' host (a CPU run:
    the search takes a core): the median, over the steps from each searching re-plan's
    detection to its answer, of the step time over the median of the steps of the same plan
    and straggler condition that ran with no search in flight (nor first after a switch),
    less one; 0 when no such pair exists."""
    from ..report.run_model import emulated_condition

    busy: set[int] = set()
    for e in events:
        if e.get("event") == "replan" and e.get("detected") is not None and not healthy_replan(e):
            busy.update(range(int(e["detected"]), int(e["step"])))
    first = {int(e["step"]) for e in events if e.get("event") == "migrate"}

    def key(s):
        return s.get("plan"), emulated_condition(s)

    calm: dict = {}
    for s in steps:
        k = int(s["step"])
        if k not in busy and k not in first:
            calm.setdefault(key(s), []).append(float(s["step_time_s"]))
    ratios = [float(s["step_time_s"]) / statistics.median(calm[key(s)]) for s in steps
              if int(s["step"]) in busy and int(s["step"]) not in first
              and len(calm.get(key(s), ())) >= 2]
    return max(0.0, statistics.median(ratios) - 1.0) if ratios else 0.0


def switch_costs(steps, events) -> MigrationCost:
    """A fixed part and a bandwidth fitted to the run's ``migrate`` events (least squares over
    their sizes; a single size: its seconds as the fixed part), and the warm-up: the first step
    after a switch over the median of the next five, less one (median over switches). The
    fixed part is every switch's (``fixed_s``: the run's switches paid it whatever groups they
    found cached), and the warm-up every switch's too (the fit does not tell re-splits apart)."""
    from ..adaptive.replan import fit_switch_seconds

    ms = [(float(e.get("bytes", 0)), float(e.get("seconds", 0.0))) for e in events
          if e.get("event") == "migrate"]
    fixed, gbps = 0.0, 1e3
    fit = fit_switch_seconds(ms)
    if fit is not None:
        fixed, gbps = fit[0], 1.0 / fit[1] / 1e9
    elif ms:
        fixed = statistics.median(t for _, t in ms)
    by_step = {int(s["step"]): float(s["step_time_s"]) for s in steps}
    warm = []
    for e in events:
        if e.get("event") == "migrate":
            k = int(e["step"])
            nxt = [by_step[i] for i in range(k + 1, k + 6) if i in by_step]
            if k in by_step and len(nxt) >= 3:
                warm.append(max(0.0, by_step[k] / statistics.median(nxt) - 1.0))
    w = statistics.median(warm) if warm else 0.0
    return MigrationCost(network_gbps=gbps, nvlink_gbps=gbps, communicators_s=0.0, fixed_s=fixed,
                         warmup_steps=w, warmup_kept_steps=w)


def charge(planning: dict, seq: dict | None = None):
    """Seconds charged per request, by its kind (every rank healthy: the planner answers without
    a search): the seconds of the run's own request of that kind in the same turn (``seq``: the
    seconds of each, in order; a search's seconds vary with what shares the host, so the
    run's own seconds for that turn are the best guess), past them the run's median for the kind (``planning``), else the planner's wall
    time here."""
    from .sim_planner import is_search

    turn = {"search": 0, "healthy": 0}

    def charged(wall: float, req: dict) -> float:
        kind = "search" if is_search(req) else "healthy"
        k, turn[kind] = turn[kind], turn[kind] + 1
        done = (seq or {}).get(kind) or ()
        return done[k] if k < len(done) else planning.get(kind, wall)
    return charged
