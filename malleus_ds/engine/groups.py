"""Process groups from a plan: pure rank arithmetic first, ``new_group`` calls in one place.

Plans are not grids (DeepSpeed's ``ProcessTopology`` cannot describe them), so the plan carries
explicit rank lists. :func:`layer_holders` / :func:`sync_rank_sets` compute, with no processes,
every rank set the engine will talk over; :class:`GroupCache` turns rank sets into process groups
and destroys the ones no plan uses any more.

Creation. ``torch.distributed.new_group`` is collective over the whole world and must be called
in the same order on every rank, so ``GroupCache.ensure`` creates the *sorted* list of missing
sets, and every rank (suspended ones too) calls it with the same plan. It is called only at
engine start-up (``MalleusEngine.build_groups``) and at a switch boundary (``switch.py``), never
during a step: nothing else in malleus_ds creates a group, and DeepSpeed's base engine, given
``mpu.PlanMPU``, takes its data-parallel group from it instead of creating one
(tests/integration/test_group_lifetime.py checks torch's own group counter across build, steps and
switches).

Lifetime rule (a group is destroyed at a switch boundary unless one of these uses it; the rule
itself, its reason and its memory-for-time trade are in ``group_sets.py``, pure rank-set
arithmetic that the replay applies too):

* the running plan of every live engine: each engine *holds* its plan's sets (``hold`` at build,
  ``release_unused(..., owner=engine)`` at each switch replaces the holding);
* the sets of the last ``group_sets.RECENT_PLANS`` distinct layouts held (``hold`` records
  each), so that a switch back to a recent layout creates no group;
* an engine dropped on some rank but not yet on all (garbage collection runs at different times
  on different ranks): its holding stays until ``release_unused`` agrees, with one small
  all-reduce over the registered engines, that every rank dropped it. The cache must stay the
  same on every rank, or the next ``ensure`` would call ``new_group`` on some ranks only;
* every 1-rank set, for the life of the process: the base engine's data-parallel group. The
  base engine keeps it (``engine.mpu``, ``data_parallel_group``, ``seq_data_parallel_group``),
  and so does DeepSpeed's module-level ``deepspeed.utils.groups.mpu``, which outlives the engine
  that set it; every engine of the process shares the same one. Each rank needs only its own,
  but there is no cheaper safe way to make it: ``new_group(..., use_local_synchronization=True)``
  lets non-members skip the call, and on NCCL with ``device_id`` bound at init (what
  ``app/runners/base.py`` does) members then wait in ``ncclCommSplit`` for the non-members' no-color
  split, which never comes; ``split_group`` needs a bound accelerator device and refuses gloo.
  So every rank calls ``new_group`` for all ``world_size`` singletons, once per process: a rank
  is a member of one of them, the others are ``NON_GROUP_MEMBER`` placeholders that hold nothing.

Destruction: ``torch.distributed.destroy_process_group(group)`` for each unused set, in the same
sorted order on every rank (it is not collective in torch, but NCCL's communicator teardown can
be, so the order is fixed anyway). A destroyed set that a later plan needs is simply created
again by the next ``ensure`` (torch names it afresh). So the live count is bounded by the sets
of the running plans and of the recent layouts plus ``world_size``, however many switches a run
makes.
"""
from __future__ import annotations

import weakref
from typing import Iterable

from ..layout import RankSet, owner_holders, sync_rank_sets  # noqa: F401 - re-exported
from ..plan import Plan
from ..migrate.group_sets import RecentSets, doomed, missing, norm, order
from ..migrate.group_sets import plan_rank_sets, tp_rank_sets  # noqa: F401 - re-exported

#: The stage holding ``layer`` in each pipeline (EMBED: first stages, HEAD: last stages).
layer_holders = owner_holders


def check_world(plan: Plan, world: int) -> None:
    """A plan may leave ranks out (they idle, like suspended ones) but not name missing ones."""
    from ..plan import PlanError

    named = plan.all_ranks
    if named and max(named) >= world:
        raise PlanError(f"plan names rank {max(named)}, outside the world of {world} ranks that "
                        f"were launched (0..{world - 1}); launch {max(named) + 1} ranks or use a "
                        f"plan made for {world}")


class GroupCache:
    """Process groups keyed by sorted rank tuple, created and destroyed in one global order."""

    def __init__(self) -> None:
        self._groups: dict[RankSet, object] = {}
        self._owners: list[tuple[weakref.ref, frozenset[RankSet]]] = []   # registration order
        self._recent = RecentSets()         # the last layouts held (group_sets.py)
        self._world = None          # the default group the cached groups belong to
        self.created = 0            # new_group calls made by this cache
        self.destroyed = 0          # destroy_process_group calls made by this cache

    def _same_world(self, dist) -> None:
        """Groups die with the world: after ``destroy_process_group()`` and a new
        ``init_process_group`` in the same process, start empty."""
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is not self._world:
            self._groups.clear()
            self._owners.clear()
            self._recent.clear()
            self._world = world

    def ensure(self, rank_sets: Iterable[Iterable[int]]) -> None:
        """Create the missing groups. Collective: call on every rank with the same sets."""
        import torch.distributed as dist

        self._same_world(dist)
        for rs in missing(self._groups, rank_sets):
            self._groups[rs] = dist.new_group(list(rs))
            self.created += 1

    def get(self, ranks: Iterable[int]):
        rs = tuple(sorted(ranks))
        if rs not in self._groups:
            raise KeyError(f"no process group for ranks {list(rs)}; GroupCache.ensure must "
                           f"create it on every rank first")
        return self._groups[rs]

    def __contains__(self, ranks) -> bool:
        return tuple(sorted(ranks)) in self._groups

    def count(self) -> int:
        """Groups cached now (this rank's placeholders for groups it is not in included)."""
        return len(self._groups)

    def sets(self) -> list[RankSet]:
        """The cached rank sets, in creation order."""
        return sorted(self._groups, key=order)

    def hold(self, owner, rank_sets: Iterable[Iterable[int]]) -> None:
        """``owner`` (an engine; kept by weak reference) uses exactly ``rank_sets`` from now on,
        replacing what it held; its layout becomes the most recent one. Not collective, but
        every rank must make the same calls."""
        sets = frozenset(norm(rank_sets))
        absent = missing(self._groups, sets)
        if absent:
            raise KeyError(f"GroupCache.hold: no process group for ranks {list(absent[0])} "
                           f"({len(absent)} sets missing); GroupCache.ensure must create them "
                           f"on every rank first")
        self._recent.held(sets)
        for i, (ref, _) in enumerate(self._owners):
            if ref() is owner:
                self._owners[i] = (ref, sets)
                return
        self._owners.append((weakref.ref(owner), sets))

    def owners(self) -> int:
        """Engines registered (live, or dropped on some rank and not yet agreed)."""
        return len(self._owners)

    def release_unused(self, keep_sets: Iterable[Iterable[int]] = (), *, owner=None,
                       device=None) -> list[RankSet]:
        """Destroy every cached group the lifetime rule (module docstring) does not keep, in
        sorted order; returns their rank sets. ``keep_sets``: kept as well; with ``owner``, they
        become its holding (a switch: the new plan's sets). Call at a switch boundary on every
        rank with the same arguments: one all-reduce (on ``device``) when engines other than
        ``owner`` are registered, none otherwise."""
        import torch.distributed as dist

        keep = norm(keep_sets)
        if owner is not None:
            self.hold(owner, keep)          # raises, on every rank, before any collective
        self._forget_dropped(owner, device, dist)
        used = keep.union(self._recent.sets(), *(sets for _, sets in self._owners))
        gone = doomed(self._groups, used)
        for rs in gone:
            dist.destroy_process_group(self._groups.pop(rs))
            self.destroyed += 1
        return gone

    def _forget_dropped(self, owner, device, dist) -> None:
        """Unregister the engines (other than ``owner``) that every rank has dropped."""
        others = [i for i, (ref, _) in enumerate(self._owners)
                  if owner is None or ref() is not owner]
        if not others:
            return
        import torch

        flags = torch.tensor([int(self._owners[i][0]() is None) for i in others],
                             dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        gone = {i for i, f in zip(others, flags.tolist()) if f}
        self._owners = [o for i, o in enumerate(self._owners) if i not in gone]


#: One cache per process: engines built one after another (tests, re-plans) share groups.
GROUPS = GroupCache()
