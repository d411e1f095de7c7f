"""The planner's search settings: one frozen dataclass that the entry point (``search.plan``)
and the genetic search (``genetic.py``) both read, so neither imports the other for it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerConfig:
    """Search settings (all optional)."""

    seed: int = 0                       # seeds pymoo's random generator
    time_limit: float | None = None     # seconds for the whole call; None = auto (see below)
    pop_size: int = 32                  # GA population
    max_generations: int = 60           # GA generations at most
    patience: int = 12                  # stop after this many generations without improvement
    multi_objective: bool = False       # NSGA-II on (step time, state moved) -> Pareto set
    polish_evals: int = 3000            # coordinate-descent evaluations after the GA (0 = off)
    num_pipelines: int | None = None    # fix the number of pipelines (Malleus: dp); None = search
    min_improvement: float = 0.0        # keep current_plan unless the best plan is this much
                                        #   faster (relative, e.g. 0.05 = 5%): migration costs
