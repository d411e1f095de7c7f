"""A layout for slow GPU links: TP groups re-formed so no group holds both ends of one.

A TP group all-reduces every layer's activations twice forward and twice backward, over the
links between its GPUs, all inside one node. Where the link between two GPUs of a node is slow
(``Problem.gpu_link_rates``: a degraded NVLink or PCIe path), the group holding both pays it on
every layer, while a reduction or a pipeline message between them happens once a step. The
remedy keeps the layout and trades ranks between the node's TP groups: the same group sizes and
stages, with each group formed so that the slow pairs fall between groups, and where it can,
not between the ranks at the same place of two groups either (data-parallel peers reduce over
that link once a step).

:func:`regroup_off_slow_gpu_links` builds it from a plan (the running one, the static one); the
planner (``search.py``) weighs it against the other candidates with the exact cost
(``cost.tp_times``), so it is chosen only where it wins: a rank slow in compute moves with its
new group, which the cost sees too.
"""
from __future__ import annotations

from itertools import combinations, permutations, product

from ..plan import Pipeline, Plan, Stage
from ..problem import Problem

#: nodes with more multi-GPU TP ranks than this keep their groups (the search is exhaustive:
#: 8 ranks in pairs have 105 partitions x 8 orders, in fours 35 x 24)
MAX_RANKS = 8


def _slow(problem: Problem) -> dict[tuple[int, int], float]:
    """The problem's slow GPU links (pair -> rate above 1)."""
    return {k: v for k, v in problem.gpu_link_rates.items() if v > 1.0}


def _badness(groups, slow: dict) -> tuple:
    """How badly ``groups`` (ordered rank tuples of one node) sit on the slow links: first the
    links held inside a group (its TP ring crosses them on every layer: the slowest, then how
    many), then those between ranks at the same place in two groups (the data-parallel peers of
    stages that hold the same layers reduce over them once a step)."""
    inside = [slow[p] for g in groups for p in combinations(sorted(g), 2) if p in slow]
    across = [slow[p] for i, g in enumerate(groups) for h in groups[i + 1:]
              for p in ((min(x, y), max(x, y)) for x, y in zip(g, h)) if p in slow]
    return (max(inside, default=1.0), len(inside), max(across, default=1.0), len(across))


def _partitions(ranks: list[int], sizes: list[int]):
    """Every split of ``ranks`` into groups of ``sizes`` (in order), each group in every order
    but the first (whose order fixes the others' places)."""
    def splits(ranks, sizes):
        if not sizes:
            yield []
            return
        first, rest = ranks[0], ranks[1:]
        for others in combinations(rest, sizes[0] - 1):
            group = (first, *others)
            left = [r for r in rest if r not in others]
            for tail in splits(left, sizes[1:]):
                yield [group, *tail]
    for part in splits(ranks, sizes):
        for orders in product(*(permutations(g) for g in part[1:])):
            yield [part[0], *orders]


def regroup_off_slow_gpu_links(problem: Problem, plan: Plan | None) -> Plan | None:
    """``plan`` with each node's multi-GPU TP groups re-formed from the same ranks (the same
    sizes, stages and micro-batches) so they hold as few slow GPU links as can be, slowest
    first, and then put as few between data-parallel peers (:func:`_badness`); None without a
    plan, a slow GPU link, or a better grouping."""
    if plan is None:
        return None
    slow = _slow(problem)
    if not slow:
        return None
    job = problem.job
    by_node: dict[int, list[tuple[int, ...]]] = {}
    for p in plan.pipelines:
        for st in p.stages:
            if len(st.ranks) > 1:
                by_node.setdefault(job.node_of(st.ranks[0]), []).append(tuple(st.ranks))
    new: dict[tuple[int, ...], tuple[int, ...]] = {}
    for node, groups in by_node.items():
        now = _badness(groups, slow)
        ranks = sorted(r for g in groups for r in g)
        if now == (1.0, 0, 1.0, 0) or len(ranks) > MAX_RANKS:
            continue
        # largest groups first, so the first rank of each split takes the largest size
        order = sorted(groups, key=len, reverse=True)
        best = min(_partitions(ranks, [len(g) for g in order]),
                   key=lambda part: _badness(part, slow))
        if _badness(best, slow) < now:
            new.update(zip(order, best))
    if not new:
        return None
    pipes = tuple(Pipeline(p.micro_batches, tuple(
        Stage(new.get(tuple(st.ranks), tuple(st.ranks)), st.layers) for st in p.stages))
        for p in plan.pipelines)
    return Plan(plan.num_layers, plan.global_batch_size, plan.micro_batch_size, pipes,
                plan.suspended)


def gpu_links_note(problem: Problem, plan: Plan) -> str | None:
    """What the chosen ``plan`` does about slow GPU links where some TP group of it still
    holds one (where nothing can help, the plan says so): why no grouping avoids it. None
    without a slow GPU link or when no group holds one."""
    slow = _slow(problem)
    held = sorted({p for st in (s for q in plan.pipelines for s in q.stages)
                   for p in combinations(sorted(st.ranks), 2) if p in slow})
    if not held:
        return None
    names = ", ".join(f"GPUs {a}-{b} x{slow[(a, b)]:g}" for a, b in held)
    job = problem.job
    groups = [st.ranks for q in plan.pipelines for st in q.stages if len(st.ranks) > 1]
    node = job.node_of(held[0][0])
    mine = [g for g in groups if job.node_of(g[0]) == node]
    if len(mine) == 1:
        why = (f"node {node}'s only TP group holds them: a group of {len(mine[0])} ranks has "
               f"no other ranks of its node to trade with")
    else:
        why = ("every grouping of the node's TP ranks holds one, or the groups that avoid "
               "them cost more (a slow GPU moves with its group)")
    return f"slow GPU links {names}: kept inside a TP group: {why}"
