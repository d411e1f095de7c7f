"""The work a rank does under a plan, in the units its rate is measured in (DESIGN.md §6).

* :func:`cost_units`: layers held × micro-batches of its pipeline × the TP-size slowdown of its
  group (0 for a rank without work), the head counted on a pipeline's last stage;
* :func:`cost_shape`: the per-micro-batch features whose weights the rate estimator fits;
* :func:`per_rank`: one value per rank, checked.

numpy only: no torch, no torch.distributed, no deepspeed, no omegaconf.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..plan import Plan, charged_layers


def per_rank(x: Sequence[float], world: int, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if a.shape != (world,):
        raise ValueError(f"{what}: expected {world} values (one per rank), got {a.size}")
    return a


def cost_units(plan: Plan, world: int, tp: int, tp_slowdown: Mapping[int, float],
               head: float = 0.0, layer_cost: float = 1.0) -> np.ndarray:
    """Per-rank work under ``plan`` (length ``world``, float64), in "one layer × one micro-batch
    on a healthy full TP group": ``layers held × micro-batches × tp_slowdown[tp // g]``; a
    pipeline's last stage holds ``head`` more layers' worth (the output head, ``cost.head_layers``).
    ``layer_cost``: a layer's work in those units (``cost.RECOMPUTE_FACTOR`` when activation
    checkpointing recomputes layers but not the head).

    0.0 for a rank the plan does not use (suspended or absent). Raises ``ValueError`` for a rank
    outside the world, a group size that does not divide ``tp``, or a missing slowdown key.
    """
    out = np.zeros(world, dtype=np.float64)
    for i, pipe in enumerate(plan.pipelines):
        for j, stage in enumerate(pipe.stages):
            where = f"pipelines[{i}].stages[{j}]"
            if tp % stage.tp:
                raise ValueError(f"{where}: TP group size {stage.tp} does not divide tp={tp}")
            key = tp // stage.tp
            if key not in tp_slowdown:
                raise ValueError(f"{where}: tp_slowdown has no entry for key {key} (= tp {tp} / "
                                 f"group size {stage.tp}); keys: {sorted(tp_slowdown)}")
            layers = charged_layers(stage, j == len(pipe.stages) - 1, head, layer_cost)
            u = layers * pipe.micro_batches * float(tp_slowdown[key])
            for r in stage.ranks:
                if not 0 <= r < world:
                    raise ValueError(f"{where}: rank {r} is outside 0..{world - 1}")
                out[r] = u
    return out


def cost_shape(plan: Plan, world: int) -> np.ndarray:
    """Per rank ``(B, C)`` (shape ``(world, 2)``): the micro-batches it runs as a first stage
    (the embedding's per-micro-batch cost) and the micro-batches it runs at all (the fixed cost
    every micro-batch pays: launches, the activation hand-off, Python); zeros for a rank without
    work. With :func:`cost_units` these are the features whose weights ``RateEstimator`` fits
    (the work model beyond ``layers x micro-batches``)."""
    out = np.zeros((world, 2), dtype=np.float64)
    for pipe in plan.pipelines:
        for j, stage in enumerate(pipe.stages):
            for r in stage.ranks:
                if 0 <= r < world:
                    out[r] = (pipe.micro_batches if j == 0 else 0.0, pipe.micro_batches)
    return out
