"""The rank sets a plan talks over, and how long their process groups live: pure rank-set
arithmetic, no torch, no processes, beside the transfer plan (a switch's other pure half), so
the replay charges a switch's communicators without importing the engine.

The engine's :class:`~malleus_ds.engine.groups.GroupCache` turns these sets into process groups
and applies the lifetime rule below with ``new_group`` / ``destroy_process_group``; the
cluster-scale replay (``replay/costs.py``, ``replay/loop.py``) applies the same rule to the
same sets with :class:`GroupMirror`, to charge a switch's communicators only where the engine
creates some.

**Lifetime rule** (what a switch boundary keeps; everything else of two or more ranks is
destroyed):

* the sets every live engine holds (its running plan's, :func:`plan_rank_sets`);
* the sets of the :data:`RECENT_PLANS` most recently held distinct *layouts* (families of rank
  sets: two plans that differ only in micro-batch counts have the same family and count once),
  the running one included (:class:`RecentSets`), so a switch back to a layout the job ran a
  switch or two ago creates no group;
* every 1-rank set, for the life of the process (why: ``engine/groups.py``).

**The trade.** A group that outlives its plan costs memory on every GPU in it: one NCCL
communicator (its transport buffers, ``NCCL_BUFFSIZE``, 4 MiB by default, for each channel and
peer it connects to, and a watchdog thread) until it is destroyed. A rank belongs to few groups
of a layout (its TP group and the replica sets of the layers it holds), so keeping three
layouts' costs it at most three times the communicators of one. A switch that finds its groups
cached does not pay their creation: ``communicators_s`` in ``replay/costs.py``, 5 s at 2,048
GPUs (MegaScale), against the pause of a switch that moves nothing, a few tens of milliseconds
on 4 CPU ranks (bench/RESULTS.md, session 33). A straggler's arrival and its recovery are two
switches whose second goes back to the first's layout, and a flapping GPU makes the same pair
again and again, so the previous layouts are the ones worth keeping; three of them (the running
one and two before it) cover a straggler and its recovery, and a second straggler arriving
before the first recovered, while bounding the groups alive at once to those of three layouts
plus the singletons (plus any other live engine's), however many switches a run makes.
"""
from __future__ import annotations

from typing import Iterable

from ..layout import RankSet, sync_rank_sets
from ..plan import Plan

#: how many distinct layouts' groups a switch keeps, the running one included (module doc)
RECENT_PLANS = 3


def tp_rank_sets(plan: Plan) -> set[RankSet]:
    return {tuple(sorted(s.ranks)) for p in plan.pipelines for s in p.stages if s.tp > 1}


def order(rs: RankSet) -> tuple:
    """The one global order groups are created and destroyed in: by size, then by ranks."""
    return (len(rs), rs)


def norm(rank_sets: Iterable[Iterable[int]]) -> set[RankSet]:
    return {tuple(sorted(s)) for s in rank_sets}


def plan_rank_sets(plan: Plan, world_size: int) -> list[RankSet]:
    """All sets ``MalleusEngine`` needs for ``plan``, in creation order: TP groups, sync groups
    and one singleton per rank (the 1-rank "data parallel group" handed to the DeepSpeed base
    engine; why every rank makes all of them: ``engine/groups.py``)."""
    sets = sync_rank_sets(plan) | tp_rank_sets(plan) | {(r,) for r in range(world_size)}
    return sorted(sets, key=order)


def missing(live: Iterable[RankSet], wanted: Iterable[Iterable[int]]) -> list[RankSet]:
    """The sets of ``wanted`` not in ``live``, in creation order."""
    return sorted(norm(wanted) - set(live), key=order)


def doomed(live: Iterable[RankSet], used: Iterable[RankSet]) -> list[RankSet]:
    """The sets of ``live`` the lifetime rule destroys when ``used`` is what it keeps (singletons
    are never destroyed), in destruction order."""
    keep = set(used)
    return sorted((rs for rs in live if rs not in keep and len(rs) > 1), key=order)


class RecentSets:
    """The rank-set families of the last ``k`` distinct layouts held, least recent first.
    Every rank must make the same :meth:`held` calls (they decide what is destroyed)."""

    def __init__(self, k: int = RECENT_PLANS) -> None:
        if k < 1:
            raise ValueError(f"RecentSets: k={k} must be >= 1 (the running layout)")
        self.k = k
        self._families: list[frozenset[RankSet]] = []

    def held(self, rank_sets: Iterable[Iterable[int]]) -> None:
        """A layout held now (built, or switched to): it becomes the most recent."""
        fam = frozenset(norm(rank_sets))
        if fam in self._families:
            self._families.remove(fam)
        self._families.append(fam)
        del self._families[:-self.k]

    def sets(self) -> set[RankSet]:
        return set().union(*self._families)

    def __len__(self) -> int:
        return len(self._families)

    def clear(self) -> None:
        self._families.clear()


class GroupMirror:
    """The groups a one-engine job of ``world`` ranks holds, as :class:`GroupCache` keeps them
    for the same switches (same sets, same rule), with no processes: what a replayed switch
    creates (``replay/costs.py``)."""

    def __init__(self, plan: Plan, world: int, k: int = RECENT_PLANS) -> None:
        self.world = world
        self.live: set[RankSet] = set()
        self.recent = RecentSets(k)
        self.created = self.destroyed = 0
        self._sets: dict[Plan, list[RankSet]] = {}
        self.switch(plan)

    def sets_of(self, plan: Plan) -> list[RankSet]:
        if plan not in self._sets:
            self._sets[plan] = plan_rank_sets(plan, self.world)
        return self._sets[plan]

    def would_create(self, plan: Plan) -> list[RankSet]:
        """The sets a switch to ``plan`` would create now."""
        return missing(self.live, self.sets_of(plan))

    def switch(self, plan: Plan) -> list[RankSet]:
        """Switch to ``plan`` (``ensure``, then ``release_unused``); the sets it created."""
        sets = self.sets_of(plan)
        made = missing(self.live, sets)
        self.live.update(made)
        self.recent.held(sets)
        gone = doomed(self.live, self.recent.sets())
        self.live.difference_update(gone)
        self.created += len(made)
        self.destroyed += len(gone)
        return made
