"""Malleus layout planner (DESIGN.md §4): pure Python + numpy + scipy + pymoo.

Entry point::

    from malleus_ds.planner import plan, PlannerConfig
    res = plan(problem, seed=0, time_limit=None)        # -> PlanResult
    res.plan            # the best valid Plan (validated with cost.validate_for_problem)
    res.step_time, res.efficiency, res.method           # method: search|static|data-only|drop|current
    res.baselines       # η of static / data-only / drop;  res.baseline_plans: their plans
    res.moved_units, res.moved_mb                       # state to move vs problem.current_plan
    res.pareto          # with multi_objective=True and a current_plan: (plan, step_time, moved)

Re-planning during training: ``plan(problem.with_rates(rates, current_plan=cur),
config=PlannerConfig(min_improvement=0.05))`` keeps ``cur`` unless a plan is 5% faster.
``time_limit=None`` means an automatic budget (1.8 s up to 64 GPUs, up to 50 s at 1024).

Levels: :mod:`.grouping` (per-node TP groups, suspension), :mod:`.templates` (layout space and
genome), :mod:`.partition` (exact layers per stage, memory-aware), :mod:`.batch` (exact
micro-batches per pipeline), :mod:`.placement` (concrete ranks, least migration),
:mod:`.search` (the entry point: seeds, polish), :mod:`.genetic` (the pymoo GA),
:mod:`.config` (``PlannerConfig``), :mod:`.baselines` (static, data-only, drop).
"""
from .baselines import all_baselines, data_only, drop, static
from .placement import moved_units
from .config import PlannerConfig
from .search import ParetoPoint, PlanResult, auto_time_limit, plan

__all__ = ["plan", "PlanResult", "PlannerConfig", "ParetoPoint", "auto_time_limit",
           "all_baselines", "static", "data_only", "drop", "moved_units"]
