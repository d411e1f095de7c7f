"""Malleus layout planner (DESIGN.md §4): pure Python + numpy + pymoo.

Entry point: :func:`plan` (``plan(problem, seed=0, time_limit=None) -> PlanResult``).
Levels: :mod:`.grouping` (per-node TP groups), :mod:`.templates` (layout space / genome),
:mod:`.partition` (exact layers per stage), :mod:`.batch` (exact micro-batches per pipeline),
:mod:`.placement` (concrete ranks, min migration), :mod:`.search` (pymoo GA), :mod:`.baselines`.
"""
from .baselines import all_baselines, data_only, drop, static
from .placement import moved_units
from .search import ParetoPoint, PlannerConfig, PlanResult, plan

__all__ = ["plan", "PlanResult", "PlannerConfig", "ParetoPoint", "all_baselines", "static",
           "data_only", "drop", "moved_units"]
