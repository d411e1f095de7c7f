"""Per-node TP grouping (DESIGN.md §4a).

A node's GPUs are split into TP groups whose sizes divide ``tp`` (a group of ``g`` runs at
``y = slowdown[tp/g] * max x``), and slow GPUs may be suspended. We enumerate every split of
the node's GPUs, sorted slowest first, into consecutive runs of allowed sizes, for every number
of suspended stragglers, and keep, for each number of groups, the split with the highest
throughput ``sum 1/y`` (fewer groups = fewer stages = less bubble; more throughput = faster).
Suspending GPUs is allowed for healthy ones too (e.g. keep a healthy half-node group and park
the rest), since one extra stage can cost more bubble than a small group adds throughput.
The nominal split (``gpus_per_node / tp`` full groups, nobody suspended) is always option 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

_MAX_COMPOSITIONS = 4000


@dataclass(frozen=True)
class Group:
    """A concrete TP group: its ranks (one node) and its rate ``y``."""

    ranks: tuple[int, ...]
    y: float

    @property
    def g(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class NodeOption:
    groups: tuple[Group, ...]
    suspended: tuple[int, ...]

    @property
    def throughput(self) -> float:
        return sum(1.0 / gr.y for gr in self.groups)


def nominal_groups(node_ranks: Sequence[int], tp: int, rates: Mapping[int, float],
                   slowdown: Mapping[int, float]) -> tuple[Group, ...]:
    """The static layout's groups of a node (its ranks in order, ``JobLayout.node_ranks``):
    consecutive blocks of ``tp`` ranks."""
    out = []
    for k in range(len(node_ranks) // tp):
        ranks = tuple(node_ranks[k * tp:(k + 1) * tp])
        out.append(Group(ranks, float(slowdown[1]) * max(rates.get(r, 1.0) for r in ranks)))
    return tuple(out)


@lru_cache(maxsize=64)
def _compositions(n: int, parts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Ordered compositions of ``n`` into ``parts`` (capped: ascending-sorted ones if huge)."""
    out: list[tuple[int, ...]] = []

    def rec(rem: int, acc: tuple[int, ...]) -> None:
        if len(out) > _MAX_COMPOSITIONS:
            return
        if rem == 0:
            out.append(acc)
            return
        for p in parts:
            if p <= rem:
                rec(rem - p, acc + (p,))

    rec(n, ())
    if len(out) > _MAX_COMPOSITIONS:  # fall back to partitions, smallest groups for the slowest
        out = []

        def rec2(rem: int, acc: tuple[int, ...], lo: int) -> None:
            if rem == 0:
                out.append(acc)
                return
            for p in parts:
                if lo <= p <= rem:
                    rec2(rem - p, acc + (p,), p)

        rec2(n, (), 0)
    return tuple(out)


def node_options(node_ranks: Sequence[int], tp: int, rates: Mapping[int, float],
                 slowdown: Mapping[int, float], max_suspend: int | None = None) -> list[NodeOption]:
    """Grouping options for a node, given its ranks in order (option 0 = nominal), pruned as
    described above.

    ``slowdown`` is keyed by ``tp/g``.
    """
    ranks = list(node_ranks)
    gpus_per_node = len(ranks)
    nominal = NodeOption(nominal_groups(ranks, tp, rates, slowdown), ())
    xs = {r: float(rates.get(r, 1.0)) for r in ranks}
    order = sorted(ranks, key=lambda r: (-xs[r], r))       # slowest first
    n_slow = sum(1 for r in ranks if xs[r] > 1.0)
    if n_slow == 0:
        return [nominal]
    if max_suspend is None:
        max_suspend = gpus_per_node       # healthy GPUs too, even the whole node
    parts = tuple(sorted(g for g in range(1, tp + 1) if tp % g == 0))
    best: dict[int, NodeOption] = {}
    for k in range(0, min(max_suspend, gpus_per_node) + 1):
        rest = order[k:]
        for comp in _compositions(len(rest), parts):
            groups, i = [], 0
            for size in comp:
                members = tuple(sorted(rest[i:i + size]))
                i += size
                y = float(slowdown[tp // size]) * max(xs[r] for r in members)
                groups.append(Group(members, y))
            opt = NodeOption(tuple(groups), tuple(sorted(order[:k])))
            cur = best.get(len(groups))
            if cur is None or opt.throughput > cur.throughput + 1e-12:
                best[len(groups)] = opt
    # keep only options not dominated in (fewer groups, more throughput)
    out = [nominal]
    top = -1.0
    for ng in sorted(best):
        o = best[ng]
        if o.throughput > top + 1e-12:
            top = o.throughput
            if _key(o) != _key(nominal):
                out.append(o)
    return out


def _key(o: NodeOption) -> tuple:
    return (tuple(sorted(gr.ranks for gr in o.groups)), o.suspended)


def static_position(rank: int, tp: int, dp: int) -> tuple[int, int]:
    """(dp_rank, pp_rank) of ``rank`` in the static layout."""
    q = rank // tp
    return q % dp, q // dp


def is_healthy_full(group: Group, tp: int) -> bool:
    return group.g == tp and group.y == 1.0
