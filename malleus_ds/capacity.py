"""The capacity bound with slow links (DESIGN.md §3, "The capacity bound").

Without slow links the bound is ``f = sum_d (1/x_d) / N`` (``cost.capacity_fraction``): no
layout computes the step faster than spreading its compute over what is left of the GPUs. A
slow link takes more: work done on both of its sides must cross it. :func:`link_capacity` is
the share of the healthy step's compute throughput that no layout can beat, under the cost
model's terms and with every message overlapped with compute (a bound, not a plan):

* the nodes split into *sides* at the slow links (:func:`segments`: nodes joined by healthy
  links). With one slow cut (two sides ``A`` and ``B``, GPU capacities
  ``c_A = sum_{d in A} 1/x_d`` and ``c_B``), a layout either
  - works on one side only: ``T >= W / c_A`` (or ``W / c_B``), ``W = N T_c`` the step's work
    in GPU x model units (``T_c``: the static plan's healthy step, communication left out);
  - gives some layer to one side only and another to the other side only: every micro-batch
    then crosses, ``T >= max(W / (c_A + c_B), M a / bw)`` (``M`` micro-batches of ``a`` MB of
    activations, each direction of a full-duplex link);
  - or holds ``k`` layers on both sides and gives the helping side nothing else: their
    gradients cross (``k g / bw``, ``g`` one layer's gradient MB) and the helping side does at
    most ``k / L`` of the work: ``T >= min_k max((1 - φ_k) W / c_A, φ_k W / c_B, k g / bw)``,
    ``φ_k = min(k / L, c_B / (c_A + c_B))``, either side helping;

  ``bw`` is the cut's bandwidth: the smaller side's node count x ``comm.inter_node_gbps`` over
  the least rate of the links across the cut, in model units per MB (``comm.layer_ms``);
* with three sides or more, every split of the sides into two unions ``A | B`` is such a cut
  (the links across are all slow: healthy links join the nodes of a side), and the argument
  above holds for each, reading the links inside a union as healthy and the cut's bandwidth as
  its fastest links' (both only loosen it): each split bounds the step, and the bound is the
  largest of their least ``T`` (:data:`MAX_SPLIT_SIDES`: above it, each side against the rest);
* the bound is ``T_c / T_min``. It is at most ``f``; with no slow link or no ``comm`` section
  it is ``f``.

Pure Python.
"""
from __future__ import annotations

from dataclasses import replace

from .cost import capacity_fraction, comm_spec, step_time
from .problem import Problem


def segments(problem: Problem) -> list[list[int]]:
    """The nodes joined by healthy links (rate 1.0), each a sorted list, in node order: the
    sides a slow link cuts the cluster into (the planner's cut at slow links uses them too)."""
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


def compute_step(problem: Problem) -> float:
    """``T_c``: the static plan's healthy step time with communication left out (model units)."""
    extra = {k: v for k, v in (problem.extra or {}).items() if k != "comm"}
    pr = replace(problem.with_rates({}).with_link_rates({}, {}), extra=extra)
    return step_time(pr, pr.static_plan())


#: up to this many sides every split of them in two is tried; above, each side against the
#: rest (fewer bounds: looser, still a bound)
MAX_SPLIT_SIDES = 12


def _splits(sides: list[list[int]]):
    """Two-way splits of ``sides`` into unions ``(A, B)`` of whole sides (module doc)."""
    k = len(sides)
    if k > MAX_SPLIT_SIDES:
        for i in range(k):
            yield sides[i], [n for j, s in enumerate(sides) if j != i for n in s]
        return
    for mask in range(1, 1 << (k - 1)):        # side k-1 always in B: each split once
        a = [n for j, s in enumerate(sides) if mask >> j & 1 for n in s]
        b = [n for j, s in enumerate(sides) if not mask >> j & 1 for n in s]
        yield a, b


def _cut_step(problem: Problem, cs, a_nodes: list[int], b_nodes: list[int], t_c: float
              ) -> float:
    """The least step time any layout reaches across the cut between ``a_nodes`` and
    ``b_nodes`` (module doc), in model units."""
    job = problem.job
    cap = [sum(1.0 / problem.rate(d) for n in side for d in job.node_ranks(n))
           for side in (a_nodes, b_nodes)]
    rate = min(problem.link_rate(x, y) for x in a_nodes for y in b_nodes)
    bw = min(len(a_nodes), len(b_nodes)) * cs.inter_node_gbps / rate     # GB/s = MB/ms
    per_mb = 1.0 / bw / cs.layer_ms                                       # model units per MB
    work = problem.num_gpus * t_c
    m = problem.global_batch_size // problem.micro_batch_size
    best = min(work / cap[0], work / cap[1],
               max(work / (cap[0] + cap[1]), m * cs.activation_mb * per_mb))
    L = problem.num_layers
    for main, helper in ((0, 1), (1, 0)):
        ca, cb = cap[main], cap[helper]
        for k in range(1, L + 1):
            phi = min(k / L, cb / (ca + cb))
            best = min(best, max((1.0 - phi) * work / ca, phi * work / cb,
                                 k * cs.grad_mb * per_mb))
    return best


def link_capacity(problem: Problem) -> float:
    """The capacity bound with slow links (module doc), a share of the healthy throughput."""
    f = capacity_fraction(problem)
    cs = comm_spec(problem)
    sides = segments(problem)
    if cs is None or len(sides) < 2:
        return f
    t_c = compute_step(problem)
    # every split is a cut whose links are all slow (healthy links join a side's nodes): each
    # gives a bound, and the least of them holds
    best = max(_cut_step(problem, cs, a, b, t_c) for a, b in _splits(sides))
    return min(f, t_c / best)
