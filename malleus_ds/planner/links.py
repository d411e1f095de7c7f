"""A layout for slow links: pipelines whose stage boundaries cross them.

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

from ..capacity import segments
from ..plan import Pipeline, Plan, PlanError, Stage, even_split
from ..problem import Problem

__all__ = ["segments", "cut_at_slow_links", "across_slow_links", "links_note"]


def across_slow_links(problem: Problem) -> Plan | None:
    """The layout the module doc describes, or None where it does not apply
    (:func:`cut_at_slow_links` says why)."""
    return cut_at_slow_links(problem)[0]


def cut_at_slow_links(problem: Problem) -> tuple[Plan | None, str | None]:
    """(the layout the module doc describes, None) or (None, why it does not apply: no slow
    link, segments holding unequal numbers of TP groups, more segments than layers or
    pipelines than micro-batches, or the layout does not fit in memory)."""
    if not any(v > 1.0 for v in problem.link_rates.values()):
        return None, None
    segs = segments(problem)
    if len(segs) < 2:
        return None, None
    if len(segs) > problem.num_layers:
        return None, (f"the slow links cut the cluster into {len(segs)} segments, more than the "
                      f"model's {problem.num_layers} layers: no pipeline can take a stage in each")
    job, tp = problem.job, problem.tp
    groups = [[tuple(job.node_ranks(n)[i:i + tp]) for n in seg
               for i in range(0, problem.gpus_per_node, tp)] for seg in segs]
    if len({len(g) for g in groups}) != 1:
        sizes = ", ".join(f"nodes {seg}: {len(g)}" for seg, g in zip(segs, groups))
        return None, (f"the segments the slow links cut hold unequal numbers of TP groups "
                      f"({sizes}): no layout of whole pipelines takes one stage in each")
    bounds = even_split(problem.num_layers, len(segs))
    total = problem.global_batch_size // problem.micro_batch_size
    pipes_n = len(groups[0])
    if total < pipes_n:
        return None, (f"{pipes_n} pipelines across the slow links need as many micro-batches; "
                      f"the global batch has {total}")
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
        out = _valid(problem, plan)
    except PlanError:
        out = None
    return out, (None if out is not None else
                 "the layout cut at the slow links does not fit in memory")


def links_note(problem: Problem, method: str, step_time: float) -> str | None:
    """What the plan does about slow links, where it does nothing (where nothing can help, the
    plan says so): why no layout cut at them applies, or what it would cost against the plan
    chosen. None without a slow link, or when the cut was chosen."""
    if method == "links" or not any(v > 1.0 for v in problem.link_rates.values()):
        return None
    cut, why = cut_at_slow_links(problem)
    slow = ", ".join(f"{a}-{b} x{v:g}" for (a, b), v in sorted(problem.link_rates.items())
                     if v > 1.0)
    if cut is None:
        return f"slow links {slow}: kept the layout: {why}"
    from ..cost import step_time as cost_step_time

    return (f"slow links {slow}: kept the layout: the one cut at them takes "
            f"{cost_step_time(problem, cut):.2f} against {step_time:.2f} (its boundaries and "
            f"bubbles cost more than the reductions it keeps off them)")
