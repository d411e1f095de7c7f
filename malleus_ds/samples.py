"""Which sample ids a training step uses: one rule for every engine, layout and dataset.

The global batch of step ``k`` (0-based) is the fixed list of ids ``[k*G, (k+1)*G)``, cut into
micro-batches of ``micro_batch_size`` in order; a pipeline of a plan takes a contiguous run of
them. Any rank can therefore fetch any sample by id, and a layout change never changes the
data a step trains on. Pure Python: the engine, the reference loop and the datasets import it.
"""
from __future__ import annotations


def global_batch_ids(step: int, global_batch_size: int) -> range:
    """The sample ids of step ``step`` (0-based): the same list whatever the engine or layout."""
    return range(step * global_batch_size, (step + 1) * global_batch_size)


def loss_share(micro_batch_size: int, global_batch_size: int) -> float:
    """What each micro-batch's mean loss is scaled by before backward: summed over every
    micro-batch of every pipeline, the gradients are those of the global-batch mean, whatever
    the layout (one process, DeepSpeed or any plan). The one place this is decided."""
    return micro_batch_size / global_batch_size


def micro_batches(step: int, global_batch_size: int, micro_batch_size: int) -> list[list[int]]:
    """Sample-id lists of the micro-batches of ``step``, in global order."""
    ids = list(global_batch_ids(step, global_batch_size))
    return [ids[i:i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]


def pipeline_micro_batches(step: int, plan, pipeline: int) -> list[list[int]]:
    """Sample-id lists of the micro-batches pipeline ``pipeline`` of ``plan`` runs at ``step``:
    the next ``micro_batches`` of the step's micro-batches after those of the pipelines before
    it, in plan order. The one place this is decided (DESIGN.md §5)."""
    first = sum(p.micro_batches for p in plan.pipelines[:pipeline])
    every = micro_batches(step, plan.global_batch_size, plan.micro_batch_size)
    return every[first:first + plan.pipelines[pipeline].micro_batches]
