"""The three simple baselines the planner must never lose to.

- **static**: the uniform Megatron/DeepSpeed layout, untouched.
- **data-only**: the static layout, micro-batches re-split across pipelines (exactly).
- **drop**: static pipelines holding a straggler are removed (their ranks suspended), their
  micro-batches given to the rest (exactly). Not applicable when every pipeline holds one.

Each returns ``None`` when it does not apply or its plan breaks the memory budget.
"""
from __future__ import annotations

from dataclasses import replace

from ..cost import pipeline_stage_times, validate_for_problem
from ..plan import Pipeline, Plan, PlanError
from ..problem import Problem
from .batch import FixedPipeline, split_batches


def _valid(problem: Problem, plan: Plan) -> Plan | None:
    try:
        validate_for_problem(problem, plan)
    except PlanError:
        return None
    return plan


def static(problem: Problem) -> Plan | None:
    try:
        return _valid(problem, problem.static_plan())
    except PlanError:
        return None


def _resplit(problem: Problem, pipes: list[Pipeline]) -> list[Pipeline] | None:
    M = problem.global_batch_size // problem.micro_batch_size
    models = [FixedPipeline(pipeline_stage_times(problem, p.stages)) for p in pipes]
    res = split_batches(models, [1] * len(models), M)
    if res is None:
        return None
    _, ms = res
    return [replace(p, micro_batches=m[0]) for p, m in zip(pipes, ms)]


def resplit(problem: Problem, plan: Plan) -> Plan | None:
    """``plan``'s layout with its micro-batches re-split exactly for ``problem``'s rates (and
    links: the stage times include communication); no rank changes what it holds, so a switch
    to it moves no state. None when no split exists."""
    pipes = _resplit(problem, list(plan.pipelines))
    return None if pipes is None else replace(plan, pipelines=tuple(pipes))


def data_only(problem: Problem) -> Plan | None:
    base = static(problem)
    if base is None:
        return None
    pipes = _resplit(problem, list(base.pipelines))
    if pipes is None:
        return None
    return _valid(problem, replace(base, pipelines=tuple(pipes)))


def drop(problem: Problem) -> Plan | None:
    base = static(problem)
    if base is None:
        return None
    keep = [p for p in base.pipelines if all(problem.rate(r) == 1.0 for r in p.ranks)]
    if not keep or len(keep) == len(base.pipelines):
        return None if not keep else data_only(problem)
    pipes = _resplit(problem, keep)
    if pipes is None:
        return None
    susp = tuple(sorted(r for p in base.pipelines if p not in keep for r in p.ranks))
    return _valid(problem, replace(base, pipelines=tuple(pipes), suspended=susp))


def all_baselines(problem: Problem) -> dict[str, Plan | None]:
    return {"static": static(problem), "data-only": data_only(problem), "drop": drop(problem)}
