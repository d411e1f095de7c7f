"""Process groups from a plan: pure rank arithmetic first, ``new_group`` calls in one place.

Plans are not grids (DeepSpeed's ``ProcessTopology`` cannot describe them), so the plan carries
explicit rank lists. :func:`layer_holders` / :func:`sync_rank_sets` compute, with no processes,
every rank set the engine will talk over; :class:`GroupCache` turns rank sets into process groups.

``torch.distributed.new_group`` is collective over the whole world and must be called in the same
order on every rank, so ``GroupCache.ensure`` creates the *sorted* list of missing sets, and every
rank (suspended ones too) calls it with the same plan. Groups are cached by sorted rank tuple for
the life of the process, so a re-plan only creates the sets it has not seen before.
"""
from __future__ import annotations

from math import lcm
from typing import Iterable

from ..layout import RankSet, owner_holders, sync_rank_sets
from ..plan import Plan, Stage

#: The stage holding ``layer`` in each pipeline (EMBED: first stages, HEAD: last stages).
layer_holders = owner_holders


def finest_degree(holders: Iterable[Stage]) -> int:
    """The TP degree of the finest shards of a layer: lcm of its holders' TP sizes."""
    return lcm(*(s.tp for s in holders))


def check_world(plan: Plan, world: int) -> None:
    """A plan may leave ranks out (they idle, like suspended ones) but not name missing ones."""
    from ..plan import PlanError

    named = plan.all_ranks
    if named and max(named) >= world:
        raise PlanError(f"plan names rank {max(named)}, outside the world of {world} ranks that "
                        f"were launched (0..{world - 1}); launch {max(named) + 1} ranks or use a "
                        f"plan made for {world}")


def tp_rank_sets(plan: Plan) -> set[RankSet]:
    return {tuple(sorted(s.ranks)) for p in plan.pipelines for s in p.stages if s.tp > 1}


def plan_rank_sets(plan: Plan, world_size: int) -> list[RankSet]:
    """All sets ``MalleusEngine`` needs for ``plan``: TP groups, sync groups and one singleton
    per rank (the 1-rank "data parallel group" handed to the DeepSpeed base engine).

    Scaling note: that is ``world_size`` extra ``new_group`` calls once per process (cached
    across re-plans); cheap on 8-64 ranks, worth replacing by a split-based creation at 1000+."""
    sets = sync_rank_sets(plan) | tp_rank_sets(plan) | {(r,) for r in range(world_size)}
    return sorted(sets, key=lambda s: (len(s), s))


class GroupCache:
    """Process groups keyed by sorted rank tuple, created in one global order."""

    def __init__(self) -> None:
        self._groups: dict[RankSet, object] = {}

    def ensure(self, rank_sets: Iterable[Iterable[int]]) -> None:
        """Create the missing groups. Collective: call on every rank with the same sets."""
        import torch.distributed as dist

        todo = sorted({tuple(sorted(s)) for s in rank_sets} - set(self._groups),
                      key=lambda s: (len(s), s))
        for rs in todo:
            self._groups[rs] = dist.new_group(list(rs))

    def get(self, ranks: Iterable[int]):
        rs = tuple(sorted(ranks))
        if rs not in self._groups:
            raise KeyError(f"no process group for ranks {list(rs)}; GroupCache.ensure must "
                           f"create it on every rank first")
        return self._groups[rs]

    def __contains__(self, ranks) -> bool:
        return tuple(sorted(ranks)) in self._groups


#: One cache per process: engines built one after another (tests, re-plans) share groups.
GROUPS = GroupCache()
