"""Placement (DESIGN.md §4e): turn an evaluated layout into a concrete :class:`Plan`.

Healthy full groups are interchangeable for step time, so we choose which concrete group
fills each healthy stage. Without a ``current_plan`` we follow the static layout's order (a
layout shaped like the static one comes out *as* the static plan). With one, we solve an
assignment problem (Hungarian, exact) that keeps as much state in place as possible.

State moved is counted in *layer-units*: one unit = the full parameter + optimizer state of one
layer. A rank of a group of ``g`` needs ``layers / g`` units; it keeps ``overlap * min(1/g_new,
1/g_old)`` of what it held before (shards of power-of-two groups nest). When the problem has a
memory section, units convert to MB as ``units * layer_static_mb * tp``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..plan import Pipeline, Plan, Stage
from ..problem import Problem
from .grouping import Group, static_position
from .templates import Evaluation, Layout, SearchSpace


def _old_holdings(old: Plan | None) -> dict[int, tuple[int, int, int]]:
    """rank -> (start, end, group size) in ``old``."""
    out: dict[int, tuple[int, int, int]] = {}
    if old is None:
        return out
    for p in old.pipelines:
        for s in p.stages:
            for r in s.ranks:
                out[r] = (s.start, s.end, len(s.ranks))
    return out


def moved_units(old: Plan | None, new: Plan) -> float:
    """Layer-units of state that ranks of ``new`` must receive (0 if ``old`` is None)."""
    if old is None:
        return 0.0
    held = _old_holdings(old)
    total = 0.0
    for p in new.pipelines:
        for s in p.stages:
            g = len(s.ranks)
            for r in s.ranks:
                need = s.num_layers / g
                h = held.get(r)
                if h is not None:
                    ov = max(0, min(s.end, h[1]) - max(s.start, h[0]))
                    need -= ov * min(1.0 / g, 1.0 / h[2])
                total += need
    return total


def units_to_mb(problem: Problem, units: float) -> float | None:
    if problem.memory is None:
        return None
    return units * problem.memory.layer_static_mb * problem.tp


def build_plan(space: SearchSpace, lay: Layout, ev: Evaluation, old: Plan | None = None) -> Plan:
    """Concrete plan for an evaluated layout; healthy stages filled by :func:`_place`."""
    pr = space.problem
    # Per pipeline: stage list of (Group or None for healthy) and layer ranges.
    skel: list[list[tuple[Group | None, int, int]]] = []
    for ps, key, m in zip(lay.pipes, ev.keys, ev.ms):
        md = space.model(key)
        order, layers = md.layout(m)
        # concrete entries in the same sorted order as the key
        specials = sorted(ps.specials, key=lambda gr: (gr.y, gr.g, gr.ranks))
        entries: list[Group | None] = list(specials) + [None] * ps.n_healthy
        stages, start = [], 0
        for idx, l in zip(order, layers):
            stages.append((entries[idx], start, start + l))
            start += l
        skel.append(stages)
    slots = [(i, j, a, b) for i, st in enumerate(skel) for j, (gr, a, b) in enumerate(st) if gr is None]
    fill = _place(pr, slots, lay.healthy_pool, old)
    used = set()
    pipes = []
    for i, (st, m) in enumerate(zip(skel, ev.ms)):
        stages = []
        for j, (gr, a, b) in enumerate(st):
            if gr is None:
                gr = fill[(i, j)]
            used.update(gr.ranks)
            stages.append(Stage(tuple(gr.ranks), (a, b)))
        pipes.append(Pipeline(int(m), tuple(stages)))
    susp = set(lay.suspended)
    for gr in lay.healthy_pool:      # healthy groups left over (none normally) are suspended
        if not used.intersection(gr.ranks):
            susp.update(gr.ranks)
    return Plan(pr.num_layers, pr.global_batch_size, pr.micro_batch_size, tuple(pipes),
                tuple(sorted(susp)))


def _place(pr: Problem, slots: Sequence[tuple[int, int, int, int]], pool: Sequence[Group],
           old: Plan | None) -> dict[tuple[int, int], Group]:
    if not slots:
        return {}
    if old is None:
        ordered = sorted(pool, key=lambda gr: static_position(gr.ranks[0], pr.tp, pr.dp)
                         + (gr.ranks[0],))
        return {(i, j): ordered[k] for k, (i, j, _, _) in enumerate(sorted(slots))}
    held = _old_holdings(old)
    tp = pr.tp
    # (pool, tp) arrays of old holdings per rank
    A = np.zeros((len(pool), tp))
    B = np.zeros((len(pool), tp))
    W = np.zeros((len(pool), tp))
    for q, gr in enumerate(pool):
        for t, r in enumerate(gr.ranks):
            h = held.get(r)
            if h is not None:
                A[q, t], B[q, t], W[q, t] = h[0], h[1], min(1.0 / len(gr.ranks), 1.0 / h[2])
    sa = np.array([a for (_, _, a, _) in slots], dtype=float)
    sb = np.array([b for (_, _, _, b) in slots], dtype=float)
    ov = np.clip(np.minimum(sb[:, None, None], B[None]) - np.maximum(sa[:, None, None], A[None]), 0, None)
    kept = (ov * W[None]).sum(axis=2)                     # (slots, pool)
    rows, cols = linear_sum_assignment(-kept)
    return {(slots[r][0], slots[r][1]): pool[c] for r, c in zip(rows, cols)}
