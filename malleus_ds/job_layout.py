"""The job's shape: how many ranks, how they sit in nodes, and the nominal TP degree; and the
answers derived from them that every layer asks (torchtitan's ``ParallelDims`` plays this part).

* ``node_of(rank)``, ``same_node(a, b)``, ``node_ranks(node)``: a TP group never crosses a node,
  a pipeline boundary inside one node is cheaper than one across nodes, and a migration reads
  from a holder on the receiver's node when there is one.
* ``tp``: the nominal TP degree. Every stage's TP size divides it; cost units and the TP slowdown
  table are keyed by ``tp // group size`` (``adaptive/work.py``). :func:`nominal_tp` decides it.
* :func:`finest_tp`: the TP degree of a layer's finest shards, the lcm of its holders' TP sizes
  (gradient-sync chunks, ``layout.py``).

Which micro-batches and samples each pipeline runs, and the loss share each micro-batch carries,
are decided in ``samples.py`` (they depend on the plan, not on the job's shape).

Pure and at the bottom: it imports nothing from the package. ``plan.validate_plan``, the cost
model, the planner's grouping, the migrator, the engine (``MalleusEngine.job``) and the runners
(``app/runners/job.py``) ask it; none works these answers out again (tests/unit/test_job_layout.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


class JobLayoutError(ValueError):
    """A job shape that cannot exist. ``detail`` names the field and the numbers, so a caller
    can put its own section in front (``cluster.`` + detail, ``ds_config.malleus.`` + detail)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"job layout: {detail}")
        self.detail = detail


def nominal_tp(*plans, at_least: int = 1) -> int:
    """The job's nominal TP degree: the least common multiple of ``at_least`` and every stage's
    TP size in ``plans``, so every TP group divides it. The one place this is decided."""
    return math.lcm(at_least, *(st.tp for p in plans for q in p.pipelines for st in q.stages))


def finest_tp(holders: Iterable) -> int:
    """The TP degree of the finest shards of a layer held by the stages ``holders``: the lcm of
    their TP sizes, so every holder's shard is a whole number of finest chunks."""
    return math.lcm(*(s.tp for s in holders))


@dataclass(frozen=True)
class JobLayout:
    """``world`` ranks in nodes of ``gpus_per_node``, nominal TP degree ``tp``."""

    world: int
    gpus_per_node: int
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "gpus_per_node", "tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise JobLayoutError(f"{name}={v!r} must be an integer >= 1")
        if self.world % self.gpus_per_node:
            raise JobLayoutError(f"gpus_per_node={self.gpus_per_node} does not divide the world "
                                 f"size {self.world}")

    @classmethod
    def one_node(cls, world: int, tp: int = 1) -> "JobLayout":
        """Every rank on one node (the engine API without ``malleus.gpus_per_node``)."""
        return cls(world, world, tp)

    @classmethod
    def for_plans(cls, world: int, *plans, gpus_per_node: int | None = None,
                  tp: int | None = None) -> "JobLayout":
        """The layout of a job running ``plans``: one node unless ``gpus_per_node`` says
        otherwise; the nominal TP degree is ``tp`` if given (every plan must divide it, which
        ``plan.validate_plan`` checks), else the lcm of the plans' TP sizes."""
        return cls(world, gpus_per_node or world, tp or nominal_tp(*plans))

    def with_plans(self, *plans) -> "JobLayout":
        """This layout with ``tp`` raised so every TP size of ``plans`` divides it (a plan the
        engine switches to may hold TP sizes the first did not)."""
        tp = nominal_tp(*plans, at_least=self.tp)
        return self if tp == self.tp else JobLayout(self.world, self.gpus_per_node, tp)

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def node_ranks(self, node: int) -> range:
        """The ranks of ``node``, in order."""
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def nodes_of(self, ranks: Sequence[int]) -> list[int]:
        """The sorted distinct nodes ``ranks`` sit on."""
        return sorted({self.node_of(r) for r in ranks})
