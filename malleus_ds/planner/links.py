"""A layout for slow links (issue: slow links): pipelines whose stage boundaries cross them.

A pipeline boundary carries one activation per micro-batch; a data-parallel reduction carries
the whole model's gradients every step. Where a link between nodes is slow
(``Problem.link_rates``), the layout that keeps gradient traffic off it cuts the cluster at the
slow links: the nodes joined by healthy links form a *segment*, each pipeline takes one stage in
every segment (one TP group of one of its nodes), and each stage's data-parallel peers are the
other pipelines' stages in the same segment, so every reduction stays on healthy links. Layers
are split evenly over the segments and micro-batches re-split by the pipelines' costs.

:func:`across_slow_links` builds it; the planner (``search.py``) weighs it against the other
candidates with the exact cost (``cost.py``: boundaries and the reduction by the links they
cross), so it is chosen only where it wins.
"""
from __future__ import annotations

from ..plan import Pipeline, Plan, PlanError, Stage, even_split
from ..problem import Problem


def segments(problem: Problem) -> list[list[int]]:
    """The nodes joined by healthy links (rate 1.0), each a sorted list, in node order."""
    parent = list(range(problem.nodes))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a in range(problem.nodes):
        for b in range(a + 1, problem.nodes):
            if problem.link_rate(a, b) == 1.0:
                parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for n in range(problem.nodes):
        groups.setdefault(root(n), []).append(n)
    return sorted(groups.values())


def across_slow_links(problem: Problem) -> Plan | None:
    """The layout the module doc describes, or None where it does not apply: no slow link, the
    segments hold unequal numbers of TP groups, or more segments than layers."""
    if not any(v > 1.0 for v in problem.link_rates.values()):
        return None
    segs = segments(problem)
    if len(segs) < 2 or len(segs) > problem.num_layers:
        return None
    job, tp = problem.job, problem.tp
    groups = [[tuple(job.node_ranks(n)[i:i + tp]) for n in seg
               for i in range(0, problem.gpus_per_node, tp)] for seg in segs]
    if len({len(g) for g in groups}) != 1:
        return None
    bounds = even_split(problem.num_layers, len(segs))
    total = problem.global_batch_size // problem.micro_batch_size
    pipes_n = len(groups[0])
    if total < pipes_n:
        return None
    mbs = even_split(total, pipes_n)
    pipes = []
    for i in range(pipes_n):
        stages = tuple(Stage(ranks=groups[s][i], layers=(bounds[s], bounds[s + 1]))
                       for s in range(len(segs)))
        pipes.append(Pipeline(micro_batches=mbs[i + 1] - mbs[i], stages=stages))
    plan = Plan(problem.num_layers, problem.global_batch_size, problem.micro_batch_size,
                tuple(pipes), ())
    from .baselines import _resplit, _valid

    resplit = _resplit(problem, list(plan.pipelines))
    if resplit is not None:
        plan = Plan(plan.num_layers, plan.global_batch_size, plan.micro_batch_size,
                    tuple(resplit), ())
    try:
        return _valid(problem, plan)
    except PlanError:
        return None
