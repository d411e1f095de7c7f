"""The planner's entry point: heuristic seeds + a pymoo genetic search over the discrete layout
space (``genetic.py``), exact inner solvers in the evaluation, and the baselines as a floor;
this file picks the answer among them.

    from malleus_ds.planner import plan
    res = plan(problem, seed=0, time_limit=2.0)   # -> PlanResult
    res.plan, res.step_time, res.efficiency, res.method, res.baselines

The search is reproducible from ``seed`` as long as the time limit does not cut it short
(generations and stall patience bound it otherwise). Whatever happens, the returned plan is
valid (checked with :func:`malleus_ds.cost.validate_for_problem`) and no slower than the best
baseline (static, data-only, drop) and than ``problem.current_plan``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Mapping

from ..cost import (capacity_fraction, check_memory, check_switch_memory, comm_spec,
                    healthy_step_time, step_time, validate_for_problem)
from ..cost import eta as cost_eta
from ..plan import Plan, PlanError
from ..problem import Problem, fmt_mb
from .baselines import all_baselines, resplit
from .gpu_links import gpu_links_note, regroup_off_slow_gpu_links
from .links import across_slow_links, links_note
from .config import PlannerConfig
from .genetic import REL_TIE, ParetoPoint, genetic_search
from .placement import moved_units, units_to_mb
from .templates import SearchSpace



@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    step_time: float
    efficiency: float
    method: str                          # search | static | links | data-only | drop | current
    baselines: Mapping[str, float | None]        # η of each baseline (None: not applicable)
    baseline_plans: Mapping[str, Plan | None]
    seconds: float
    moved_units: float                           # vs problem.current_plan (0 without one)
    moved_mb: float | None
    evaluations: int = 0
    generations: int = 0
    search_step_time: float | None = None        # best layout found by the search itself
    pareto: tuple[ParetoPoint, ...] = field(default=())
    notes: tuple[str, ...] = ()                  # what the plan leaves as it is, and why

    def summary(self) -> str:
        bl = " ".join(f"{k}={'n/a' if v is None else f'{v:.3f}'}" for k, v in self.baselines.items())
        mv = f" moved={self.moved_units:.1f} layer-units" if self.moved_units else ""
        if self.moved_mb:
            mv += f" ({self.moved_mb:.0f} MB)"
        return (f"method={self.method} step_time={self.step_time:.2f} eta={self.efficiency:.3f} "
                f"pipelines={len(self.plan.pipelines)} "
                f"stages={[len(p.stages) for p in self.plan.pipelines]} "
                f"suspended={len(self.plan.suspended)}{mv} | baselines eta: {bl} | "
                f"{self.seconds:.2f}s, {self.evaluations} evals, {self.generations} gens"
                + "".join(f"\n  note: {n}" for n in self.notes))


def auto_time_limit(problem: Problem) -> float:
    """Default planning budget: 1.8 s up to 64 GPUs, growing linearly to 50 s at 1024 GPUs.
    (Pass ``time_limit=math.inf`` for none; the search usually stops earlier on its own.)"""
    n = problem.num_gpus
    return 1.8 + max(0, min(n, 1024) - 64) / (1024 - 64) * 48.2 + max(0, n - 1024) * 0.05


def _is_healthy(problem: Problem) -> bool:
    return (all(problem.rate(r) == 1.0 for r in problem.rates)
            and all(v == 1.0 for v in problem.link_rates.values())
            and all(v == 1.0 for v in problem.gpu_link_rates.values()))


#: which of equally fast, equally cheap candidates wins (lower first)
_PRIORITY = {"current": 0, "static": 1, "search": 2, "links": 2, "regroup": 2, "rebalance": 2,
             "data-only": 3, "drop": 4}


class _Candidates:
    """The valid candidates as (step time, state moved, priority, method, plan); a plan that
    fails the problem's checks, or that the job could not migrate to, is left out."""

    def __init__(self, problem: Problem) -> None:
        self.problem, self.old = problem, problem.current_plan
        self.items: list[tuple[float, float, int, str, Plan]] = []

    def add(self, method: str, p: Plan | None) -> None:
        if p is None:
            return
        try:
            validate_for_problem(self.problem, p)
            if self.old is not None and method != "current":
                check_switch_memory(self.problem, self.old, p)    # the job must also migrate to it
        except PlanError:
            return
        self.items.append((step_time(self.problem, p), moved_units(self.old, p),
                           _PRIORITY[method], method, p))


def _with_overrides(config: PlannerConfig | None, seed: int | None, time_limit: float | None,
                    multi_objective: bool | None) -> PlannerConfig:
    """``config`` (default: PlannerConfig()) with the keyword arguments that are given."""
    cfg = config or PlannerConfig()
    if seed is not None or time_limit is not None or multi_objective is not None:
        from dataclasses import replace
        cfg = replace(cfg, **{k: v for k, v in (("seed", seed), ("time_limit", time_limit),
                                                 ("multi_objective", multi_objective))
                              if v is not None})
    return cfg


def _add_fixed(cands: _Candidates, problem: Problem, bplans: Mapping[str, Plan | None],
               healthy: bool) -> None:
    """The candidates that need no search: the running plan; healthy, the static plan; else
    every baseline, the cut at the slow links, TP groups off slow GPU links, and the running
    layout re-split for the rates and the links its pipelines cross."""
    old = problem.current_plan
    if old is not None:
        cands.add("current", old)
    if healthy:
        cands.add("static", bplans["static"])
        return
    for k, p in bplans.items():
        cands.add(k, p)
    cands.add("links", across_slow_links(problem))     # stage boundaries on the slow links
    for p in (old, bplans["static"]):                   # TP groups off the slow GPU links
        cands.add("regroup", regroup_off_slow_gpu_links(problem, p))
    if old is not None:
        # the running layout, its micro-batches re-split for the new rates (and the links its
        # pipelines cross: fewer for a pipeline whose boundary crosses a slow link): no state
        # moves, so the loop adopts it at once (adaptive/session.py)
        cands.add("rebalance", resplit(problem, old))


def _add_searched(cands: _Candidates, problem: Problem, cfg: PlannerConfig,
                  deadline: float | None) -> tuple[int, int, float | None,
                                                   tuple[ParetoPoint, ...]]:
    """The genetic search's plans as candidates (re-split for communication where the problem
    has links); (evaluations, generations, its best step time, its Pareto front)."""
    space = SearchSpace(problem, cfg.num_pipelines)
    found, gens, pareto = genetic_search(space, cfg, deadline, problem.current_plan)
    evals = space.evaluations
    if comm_spec(problem) is not None:   # the search costs compute only: re-split data
        found = found + [q for q in (resplit(problem, p) for p in found) if q]
    search_T = None
    for p in found:
        cands.add("search", p)
        search_T = min(search_T or math.inf, step_time(problem, p))
    return evals, gens, search_T, pareto


def _pick(items: list[tuple[float, float, int, str, Plan]], min_improvement: float
          ) -> tuple[float, float, int, str, Plan]:
    """The fastest candidate (ties: least state moved, then priority); the running plan unless
    the best is more than ``min_improvement`` faster."""
    best_T = min(c[0] for c in items)
    cur = [c for c in items if c[3] == "current"]
    if cur and min_improvement > 0 and best_T > cur[0][0] * (1 - min_improvement):
        best_T = cur[0][0]          # not worth a migration: the current plan is within the margin
    tied = [c for c in items if c[0] <= best_T * (1 + REL_TIE)]
    return min(tied, key=lambda c: (c[1], c[2], c[0]))


def plan(problem: Problem, *, seed: int | None = None, time_limit: float | None = None,
         config: PlannerConfig | None = None, multi_objective: bool | None = None) -> PlanResult:
    """Best valid plan for ``problem`` (see module docstring). Keyword args override ``config``."""
    cfg = _with_overrides(config, seed, time_limit, multi_objective)
    t0 = time.perf_counter()
    limit = auto_time_limit(problem) if cfg.time_limit is None else cfg.time_limit
    deadline = None if math.isinf(limit) else t0 + max(0.0, limit) * 0.85
    T_h = healthy_step_time(problem)
    f = capacity_fraction(problem)
    old = problem.current_plan

    def eta(T: float) -> float:
        return cost_eta(T_h, T, f)

    cands = _Candidates(problem)
    bplans = all_baselines(problem)
    healthy = _is_healthy(problem)
    _add_fixed(cands, problem, bplans, healthy)
    evals = gens = 0
    search_T = None
    pareto: tuple[ParetoPoint, ...] = ()
    # healthy: the static plan (the user's layout) unless it does not fit in memory
    if not healthy or bplans["static"] is None:
        evals, gens, search_T, pareto = _add_searched(cands, problem, cfg, deadline)
    if not cands.items:
        why = _memory_why(problem)
        raise PlanError(f"problem '{problem.name}': no valid plan found (the static plan does not "
                        f"fit in memory and the search found nothing that does){why}; check the "
                        f"memory section or give more GPUs")
    T, mv, _, method, best = _pick(cands.items, cfg.min_improvement)
    note = "; ".join(n for n in (links_note(problem, method, T),
                                  gpu_links_note(problem, best)) if n) or None
    return PlanResult(
        notes=(note,) if note else (),
        plan=best, step_time=T, efficiency=eta(T), method=method,
        baselines={k: (eta(step_time(problem, p)) if p is not None else None) for k, p in bplans.items()},
        baseline_plans=bplans, seconds=time.perf_counter() - t0, moved_units=mv,
        moved_mb=units_to_mb(problem, mv) if old is not None else None,
        evaluations=evals, generations=gens, search_step_time=search_T, pareto=pareto)


def _memory_why(problem: Problem) -> str:
    """The numbers behind "no valid plan": the static plan's fullest stage (as ``check_memory``
    words it) and the memory floor every layout must meet, with the term that breaks it."""
    m = problem.memory
    if m is None:
        return ""
    out = ""
    try:
        check_memory(problem, problem.static_plan())
    except PlanError as e:
        out += f": the static plan's {e}"
    budget = m.budget_mb
    need, what = _memory_floor(problem, budget)
    if need > budget + 1e-9:
        out += (f"; no layout can fit: {what} = {fmt_mb(need)} MB per GPU > budget {fmt_mb(budget)} MB "
                f"(device_mb {fmt_mb(m.device_mb)} - reserved_mb {fmt_mb(m.reserved_mb)}), "
                f"{fmt_mb(need - budget)} MB short")
    else:
        out += (f"; every layout needs >= {fmt_mb(need)} MB per GPU ({what}), within the budget "
                f"{fmt_mb(budget)} MB, so layer split and activations in flight rule them out")
    return out


def _memory_floor(problem: Problem, budget: float) -> tuple[float, str]:
    """A lower bound on the fullest GPU's memory under any layout, and how it is made up. Three
    bounds, simplest first: ``extra_mb`` alone; the first stage (embedding + one layer with one
    micro-batch in flight, full TP group); the whole model spread evenly over every GPU of the
    cluster as one pipeline (each pipeline holds every layer and both embeddings). Returns the
    first one over ``budget`` (the root cause), else the largest. With activation checkpointing
    a layer keeps ``layer_input_mb`` per micro-batch instead of ``layer_activation_mb``, which
    each GPU holds once for the layer it recomputes (``cost.stage_memory_terms``)."""
    m, tp, L, n = problem.memory, problem.tp, problem.num_layers, problem.num_gpus
    static = f"layer_static_mb {fmt_mb(m.layer_static_mb)}"
    act = f"layer_activation_mb {fmt_mb(m.layer_activation_mb)}"
    extra = f"extra_mb {fmt_mb(m.extra_mb)}"
    emb = f"embedding_mb {fmt_mb(m.embedding_mb)}"
    if problem.activation_checkpointing:
        inp = f"layer_input_mb {fmt_mb(m.layer_input_mb)}"
        one = m.layer_static_mb + m.layer_input_mb + m.layer_activation_mb
        spread = ((L * m.layer_static_mb + 2 * m.embedding_mb) * tp + L * m.layer_input_mb) / n \
            + m.layer_activation_mb + m.extra_mb
        spread_what = (f"({L} layers x {static} + 2 x {emb}) x tp {tp} / {n} GPUs + {L} x "
                       f"{inp} / {n} GPUs + one recomputed layer's {act} + {extra}")
        one_what = f"{static} + {inp} + its recomputed {act}"
    else:
        one = m.layer_static_mb + m.layer_activation_mb
        spread = (L * one + 2 * m.embedding_mb) * tp / n + m.extra_mb
        spread_what = (f"{L} layers x ({static} + {act}) + 2 x {emb}, x tp {tp} / {n} GPUs, "
                       f"+ {extra}")
        one_what = f"{static} + {act}"
    terms = [
        (m.extra_mb, f"{extra} alone"),
        (m.embedding_mb + one + m.extra_mb,
         f"the first stage: {emb} + one layer ({one_what}) + {extra}"),
        (spread, spread_what),
    ]
    over = [t for t in terms if t[0] > budget + 1e-9]
    return over[0] if over else max(terms, key=lambda t: t[0])
