"""The planner's genetic search (pymoo) over the discrete layout space, and a deterministic
coordinate-descent polish of its best points. ``search.plan`` seeds it, adds the baselines and
the running plan as candidates and picks the answer; this file only searches.

The genome (``templates.SearchSpace``): number of pipelines, fill policy, one grouping option
per special node, a pipeline slot per group; each genome is evaluated with the exact inner
solvers (layer split, micro-batch split). Single-objective GA on step time, or NSGA-II on
(step time, state moved from ``current_plan``) with ``PlannerConfig.multi_objective``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..plan import Plan
from .placement import build_plan, moved_units
from .templates import INFEASIBLE, SearchSpace

if TYPE_CHECKING:
    from .config import PlannerConfig

#: relative tolerance under which two step times count as equal (ties go to less state moved)
REL_TIE = 1e-9


@dataclass(frozen=True)
class ParetoPoint:
    plan: Plan
    step_time: float
    moved_units: float


class _PlanCache:
    """Genome -> (its plan or None when infeasible, state moved from the running plan), each
    genome built once."""

    def __init__(self, space: SearchSpace, old: Plan | None) -> None:
        self.space, self.old = space, old
        self.built: dict[tuple, tuple[Plan | None, float]] = {}

    def __call__(self, x) -> tuple[Plan | None, float]:
        space = self.space
        k = tuple(np.clip(np.asarray(x, dtype=np.int64), space.xl, space.xu).tolist())
        if k not in self.built:
            T, lay, ev = space.evaluate(k)
            if ev is None:
                self.built[k] = (None, INFEASIBLE)
            else:
                p = build_plan(space, lay, ev, self.old)
                self.built[k] = (p, moved_units(self.old, p))
        return self.built[k]


def _scored_seeds(space: SearchSpace, old: Plan | None, deadline: float | None
                  ) -> list[tuple[float, tuple]]:
    """The heuristic seeds by step time, the running plan among them (warm start: a re-plan
    after a small change usually lies next to it); past the deadline, those scored so far."""
    seeds = (space.from_plan(old) if old is not None else []) + space.seeds()
    scored = []
    for x in seeds:
        if deadline is not None and time.perf_counter() > deadline and scored:
            break
        scored.append((space.evaluate(x)[0], tuple(x.tolist())))
    scored.sort()
    return scored


def _initial_population(space: SearchSpace, scored: list[tuple[float, tuple]], pop_size: int,
                        seed: int) -> np.ndarray:
    """The best distinct seeds, then mutants of them, ``pop_size`` genomes in all."""
    rng = np.random.default_rng(seed)
    init: list[tuple] = []
    for _, k in scored:
        if k not in init:
            init.append(k)
    init = init[:pop_size]
    base = [np.array(k) for k in init] or [np.array(space.xl)]
    while len(init) < pop_size:
        x = base[len(init) % len(base)].copy()
        n_mut = 1 + int(rng.integers(0, 3))
        for i in rng.integers(0, space.n_var, size=n_mut):
            x[i] = rng.integers(space.xl[i], space.xu[i] + 1)
        k = tuple(x.tolist())
        if k not in init:
            init.append(k)
        elif len(init) >= 1 and rng.random() < 0.1:   # tiny spaces: allow duplicates to finish
            init.append(k)
    return np.array(init, dtype=np.int64)


def _evolve(space: SearchSpace, cfg: "PlannerConfig", deadline: float | None, mo: bool,
            X0: np.ndarray, plan_of: _PlanCache) -> tuple[list[tuple], int]:
    """Run the GA (NSGA-II when ``mo``) from ``X0`` until ``max_generations``, ``patience``
    generations without a better step time, or the deadline; (its best genomes, generations)."""
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.algorithms.soo.nonconvex.ga import GA
    from pymoo.core.problem import Problem as PymooProblem
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair

    def objectives(x) -> list[float]:
        T = space.evaluate(x)[0]
        if not mo:
            return [T]
        p, mv = plan_of(x)
        return [T, mv if p is not None else INFEASIBLE]

    class _P(PymooProblem):
        def __init__(self) -> None:
            super().__init__(n_var=space.n_var, n_obj=2 if mo else 1, xl=space.xl, xu=space.xu,
                             vtype=int)

        def _evaluate(self, X, out, *args, **kwargs):
            out["F"] = np.array([objectives(x) for x in X], dtype=float)

    kw = dict(pop_size=cfg.pop_size, sampling=X0,
              crossover=SBX(prob=0.9, eta=15, vtype=float, repair=RoundingRepair()),
              mutation=PM(eta=5, vtype=float, repair=RoundingRepair()),
              eliminate_duplicates=True)
    algo = NSGA2(**kw) if mo else GA(**kw)
    if not (space.n_var > 0 and (deadline is None or time.perf_counter() < deadline)):
        return [], 0
    algo.setup(_P(), termination=("n_gen", cfg.max_generations + 1), seed=cfg.seed,
               verbose=False)
    gens, best, stall = 0, math.inf, 0
    while gens < cfg.max_generations and stall < cfg.patience and algo.has_next():
        if deadline is not None and time.perf_counter() > deadline:
            break
        algo.next()
        gens += 1
        F = algo.opt.get("F")
        cur = float(F[:, 0].min()) if F is not None and len(F) else math.inf
        if cur < best * (1 - 1e-12):
            best, stall = cur, 0
        else:
            stall += 1
    pop = algo.opt if algo.opt is not None else algo.pop
    return ([tuple(x.tolist()) for x in pop.get("X").astype(np.int64)] if pop is not None
            else []), gens


def _pareto_front(ranked: list[tuple[tuple, float]], plan_of: _PlanCache
                  ) -> tuple[ParetoPoint, ...]:
    """The feasible plans on the front of (step time, state moved); among equal step times (up
    to rounding) the one that moves less."""
    pts = []
    for k, T in ranked:
        if T >= INFEASIBLE:
            continue
        p, mv = plan_of(k)
        if p is not None:
            pts.append(ParetoPoint(p, T, mv))
    front, best_mv = [], math.inf
    for pt in sorted(pts, key=lambda q: (q.step_time, q.moved_units)):
        if pt.moved_units < best_mv - 1e-9:
            if front and pt.step_time <= front[-1].step_time * (1 + REL_TIE):
                front[-1] = pt          # same step time up to rounding: keep the cheaper
            else:
                front.append(pt)
            best_mv = pt.moved_units
    return tuple(front)


def genetic_search(space: SearchSpace, cfg: "PlannerConfig", deadline: float | None, old: Plan | None
            ) -> tuple[list[Plan], int, tuple[ParetoPoint, ...]]:
    """The best plans the search finds (ties on step time: up to 8 when there is a running
    plan, resolved later by state moved), the generations run, and the Pareto front of (step
    time, state moved) when multi-objective."""
    mo = cfg.multi_objective and old is not None
    plan_of = _PlanCache(space, old)
    scored = _scored_seeds(space, old, deadline)
    X0 = _initial_population(space, scored, cfg.pop_size, cfg.seed)
    Xs, gens = _evolve(space, cfg, deadline, mo, X0, plan_of)
    # candidates: the GA's best plus the best seeds; ties on step time resolved by migration
    Xs = Xs + [k for _, k in scored[:4]]
    if Xs and cfg.polish_evals > 0:
        start = min(Xs, key=lambda k: space.evaluate(k)[0])
        Xs.append(polish(space, start, deadline, cfg.polish_evals))
    ranked = sorted({k: space.evaluate(k)[0] for k in Xs}.items(), key=lambda kv: kv[1])
    if not ranked or ranked[0][1] >= INFEASIBLE:
        return [], gens, ()
    bestT = ranked[0][1]
    top = [k for k, T in ranked if T <= bestT * (1 + REL_TIE)][:8 if old is not None else 1]
    plans = [p for p in (plan_of(k)[0] for k in top) if p is not None]
    pareto: tuple[ParetoPoint, ...] = ()
    if mo:
        pareto = _pareto_front(ranked, plan_of)
        plans += [pt.plan for pt in pareto[:1]]
    return plans, gens, pareto


def polish(space: SearchSpace, x: tuple, deadline: float | None, max_evals: int) -> tuple:
    """First-improvement coordinate descent from ``x``: number of pipelines, fill policy,
    each node's grouping option, and each group's pipeline. Deterministic."""
    best = list(x)
    bestT = space.evaluate(best)[0]
    used = 0

    def out_of_budget() -> bool:
        return used >= max_evals or (deadline is not None and time.perf_counter() > deadline)

    def try_(cand: list[int]) -> bool:
        nonlocal best, bestT, used
        cand = np.clip(np.asarray(cand, dtype=np.int64), space.xl, space.xu).tolist()
        if cand == best:
            return False
        used += 1
        T = space.evaluate(cand)[0]
        if T < bestT * (1 - 1e-12):
            best, bestT = cand, T
            return True
        return False

    improved = True
    while improved and not out_of_budget():
        improved = False
        P = best[0]
        for dP in (-1, 1, -2, 2, -4, 4):
            c = list(best)
            c[0] = P + dP
            improved |= try_(c)
        c = list(best)
        c[1] = 1 - c[1]
        improved |= try_(c)
        for i in range(len(space.special_nodes)):
            for o in range(int(space.xu[2 + i]) + 1):
                if out_of_budget():
                    return tuple(best)
                c = list(best)
                c[2 + i] = o
                improved |= try_(c)
        P = best[0]
        slots = [space.slot_offset[i] + k
                 for i in range(len(space.special_nodes))
                 for k in range(len(space.options[i][best[2 + i]].groups))]
        for g in slots:
            cur = best[g] * P // space.P_max
            for p in range(P):
                if p == cur:
                    continue
                if out_of_budget():
                    return tuple(best)
                c = list(best)
                c[g] = -(-p * space.P_max // P)
                improved |= try_(c)
    return tuple(best)
