"""The planner in a process of its own: the adaptive loop's background re-planning (control.py).

A process, not a thread: the planner is Python-heavy (pymoo, the layout search), and in a thread
it would hold rank 0's GIL while that rank trains, stalling every rank that waits for it. Rank 0
starts one worker per run (``python -m malleus_ds.planner.worker``, no torch imported) and talks
to it in JSON lines:

    request  {"problem": <problem JSON, with rates and current_plan>, "seed": 0,
              "time_limit": null, "min_improvement": 0.05, "forced": false}
    answer   {"plan": <plan JSON>, "step_time": 12.0, "method": "search", "planning_s": 0.41}
             or {"error": "PlanError: ..."}

``forced``: the answer is a valid plan *other* than ``current_plan`` (:func:`alternative_plan`),
for ``malleus.replan_at``. The same request (seed aside) is answered again from
:class:`AnswerCache` at once, with ``"cached": true``.
"""
from __future__ import annotations

import json
import sys
import time

from ..plan import Plan, PlanError, static_plan
from ..problem import Problem


def alternative_plan(problem: Problem, current: Plan, preferred: Plan | None = None) -> Plan:
    """A valid plan other than ``current``: ``preferred`` if it differs, else the first valid of
    the baselines and the uniform layouts of every (tp, pp) shape, in a fixed order."""
    from ..cost import validate_for_problem
    from . import all_baselines

    cands = [preferred] + list(all_baselines(problem).values())
    L, G, B, W = (problem.num_layers, problem.global_batch_size, problem.micro_batch_size,
                  problem.num_gpus)
    for t in [d for d in range(1, problem.tp + 1) if problem.tp % d == 0]:
        for pp in range(1, L + 1):
            if W % (t * pp) == 0 and G // B >= W // (t * pp):
                cands.append(static_plan(L, G, B, t, pp, W // (t * pp)))
    for c in cands:
        if c is None or c.id == current.id:
            continue
        try:
            validate_for_problem(problem, c)
        except PlanError:
            continue
        return c
    raise PlanError(f"forced re-plan: no valid plan other than the running one ({current.id}) "
                    f"for {W} ranks and {L} layers")


def answer(req: dict) -> dict:
    """One request -> one answer (see the module docstring); errors become ``{"error": ...}``."""
    from ..cost import step_time
    from . import PlannerConfig, plan

    t0 = time.perf_counter()
    try:
        pr = Problem.from_json(req["problem"])
        forced = bool(req.get("forced"))
        res = plan(pr, config=PlannerConfig(
            seed=int(req.get("seed", 0)), time_limit=req.get("time_limit"),
            min_improvement=0.0 if forced else float(req.get("min_improvement", 0.0))))
        new, method = res.plan, res.method
        if forced and pr.current_plan is not None and new.id == pr.current_plan.id:
            new, method = alternative_plan(pr, pr.current_plan), "forced-alternative"
        return {"plan": new.to_json(), "step_time": step_time(pr, new), "method": method,
                "planning_s": round(time.perf_counter() - t0, 4)}
    except Exception as e:      # noqa: BLE001 - the answer carries it to rank 0
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


class AnswerCache:
    """Answers by request, so a rate vector planned for once is answered again at once (a
    straggler that comes and goes, a GPU that flaps between two rates). The key is the request
    without its ``seed`` (the loop seeds each request by its step); errors are not kept. At
    most ``size`` answers, the least recently used dropped first."""

    def __init__(self, size: int = 64) -> None:
        from collections import OrderedDict

        self.size = size
        self._d: "OrderedDict[str, dict]" = OrderedDict()
        self.hits = 0

    def answer(self, req: dict) -> dict:
        key = json.dumps({k: v for k, v in req.items() if k != "seed"}, sort_keys=True)
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
            self.hits += 1
            return dict(hit, planning_s=0.0, cached=True)
        out = answer(req)
        if "error" not in out:
            self._d[key] = out
            if len(self._d) > self.size:
                self._d.popitem(last=False)
        return out


def main() -> int:
    cache = AnswerCache()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            out = {"error": f"bad request: {e}"}
        else:
            out = cache.answer(req)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
