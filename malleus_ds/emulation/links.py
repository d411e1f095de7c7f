"""Slow-link emulation: make chosen links look slow.

``straggler.link_schedule`` is a list of entries, each naming one link and when it is slow::

    [{nodes: [0, 1], rate: 4.0, start_step: 10, end_step: 40},   # between nodes 0 and 1
     {ranks: [2, 3], rate: 2.0}]                                 # between two ranks of a node

``nodes`` are the job layout's node indices (``JobLayout.node_of``: ``cluster.gpus_per_node``
ranks each); ``ranks`` name a pair of ranks (inside a node, where the link between two GPUs
matters). While step ``k`` is in ``[start_step, end_step)`` (``end_step`` null: until the end),
a message or collective crossing the link waits ``(rate - 1) ×`` its wire's time: the fastest
seconds per MB this rank has seen of it, times its MB (``ComputeClock.comm``; the whole wait
would hold a late peer's own emulated wait, and a pipeline across the link fed it back), as
the compute emulation sleeps ``(rate - 1) ×`` a rank's measured compute. A pipeline message
between ranks ``a`` and ``b`` crosses the link between their nodes (or the pair itself); a
collective over a group crosses a node link when the group has ranks on both nodes, a rank-pair
link when it holds both ranks. Overlapping entries combine by ``max``.

Bad entries are refused by name before any process group: an unknown node or rank, a link from a
node (or rank) to itself, a rate below 1. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..job_layout import JobLayout, JobLayoutError
from .straggler import StragglerError, _int, check_keys, rate_window

_KEYS = ("nodes", "ranks", "rate", "start_step", "end_step")


@dataclass(frozen=True)
class LinkEntry:
    """The link between ``ends`` (two nodes, or two ranks when ``by_rank``) is ``rate``× slow
    during steps ``[start_step, end_step)``."""

    ends: tuple[int, int]
    by_rank: bool
    rate: float
    start_step: int = 0
    end_step: int | None = None

    def active(self, step: int) -> bool:
        return self.start_step <= step and (self.end_step is None or step < self.end_step)

    def crossed_by(self, ranks: Sequence[int], job: JobLayout) -> bool:
        """Does a message between ``ranks`` (two: a point-to-point; more: a group) cross it?"""
        a, b = self.ends
        if self.by_rank:
            return a in ranks and b in ranks
        nodes = job.nodes_of(ranks)
        return a in nodes and b in nodes


@dataclass(frozen=True)
class LinkSchedule:
    entries: tuple[LinkEntry, ...] = ()
    job: JobLayout | None = None        # where the ranks sit (None: an empty schedule)

    @staticmethod
    def parse(raw: Iterable[Mapping[str, Any]] | None, world_size: int,
              gpus_per_node: int) -> "LinkSchedule":
        """From plain dicts (module doc); a StragglerError names
        ``straggler.link_schedule[i].field`` and the value."""
        if raw is None or (isinstance(raw, (list, tuple)) and not raw):
            return LinkSchedule()
        if not isinstance(raw, (list, tuple)):
            raise StragglerError(f"straggler.link_schedule must be a list of {{nodes or ranks, "
                                 f"rate, start_step, end_step}} entries (or empty for none), "
                                 f"got {raw!r}")
        try:
            job = JobLayout(world_size, gpus_per_node)
        except JobLayoutError as e:
            raise StragglerError(f"straggler.link_schedule: the job's layout: {e}") from None
        nodes = job.nodes
        out = []
        for i, e in enumerate(raw):
            where = f"straggler.link_schedule[{i}]"
            check_keys(e, where, _KEYS)
            given = [k for k in ("nodes", "ranks") if e.get(k) is not None]
            if len(given) != 1:
                raise StragglerError(f"{where} names its link by exactly one of 'nodes' (two "
                                     f"node indices) or 'ranks' (two ranks), got {given or 'none'}")
            key = given[0]
            pair = e[key]
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise StragglerError(f"{where}.{key}={pair!r} must be a list of two")
            a, b = (_int(x, f"{where}.{key}") for x in pair)
            limit, what = (nodes, "node") if key == "nodes" else (world_size, "rank")
            for x in (a, b):
                if not 0 <= x < limit:
                    raise StragglerError(f"{where}.{key}: {what} {x} does not exist: the job has "
                                         f"{limit} {what}s (0..{limit - 1})"
                                         + (f", {gpus_per_node} ranks per node"
                                            if key == "nodes" else ""))
            if a == b:
                raise StragglerError(f"{where}.{key}=[{a}, {b}]: a link joins two {what}s; a "
                                     f"{what} to itself is not one")
            if key == "ranks" and not job.same_node(a, b):
                raise StragglerError(f"{where}.ranks=[{a}, {b}] are on nodes "
                                     f"{job.node_of(a)} and {job.node_of(b)}: name a "
                                     f"link between nodes by 'nodes'")
            rate, start, end = rate_window(e, where, "link")
            out.append(LinkEntry((min(a, b), max(a, b)), key == "ranks", rate, start, end))
        return LinkSchedule(tuple(out), job)

    def rate(self, ranks: Sequence[int], step: int) -> float:
        """How much slower a message between ``ranks`` runs at ``step`` (1.0: no slow link)."""
        r = 1.0
        for e in self.entries:
            if e.active(step) and e.crossed_by(ranks, self.job):
                r = max(r, e.rate)
        return r

    def __bool__(self) -> bool:
        return bool(self.entries)
