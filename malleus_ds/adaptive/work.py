"""The work a rank does under a plan, in the units its rate is measured in (DESIGN.md §6).

* :func:`cost_units`: layers held × micro-batches of its pipeline × the TP-size slowdown of its
  group (0 for a rank without work), the head counted on a pipeline's last stage;
* :func:`cost_shape`: the per-micro-batch features whose weights the rate estimator fits;
* :func:`per_rank`: one value per rank, checked;
* :class:`RunningWork`: the running plan's work, its held ranks and its calibrating rank.

numpy only: no torch, no torch.distributed, no deepspeed, no omegaconf.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..plan import Plan, charged_layers
from .held import HOLD, held_ranks, probe_reference


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


class RunningWork:
    """The running plan's work per rank, as the loop reads rates against it: cost units and
    their per-micro-batch shape (:func:`cost_units`, :func:`cost_shape`) under the TP slowdown
    table of the job's TP degree; the ranks held (working under a plan made for them as slow,
    ``held.held_ranks``) with the rates it was made for (``floor``); and the rank that
    calibrates their probes (``held.probe_reference``). The same on every rank."""

    def __init__(self, plan: Plan, world: int, tp: int, tp_slowdown: Any,
                 tp_measured: Mapping[int, float] | None, head: float, recompute: bool) -> None:
        """``tp_slowdown``: the user's ``tp_slowdown`` setting; ``tp_measured``: the table
        measured at start-up (``engine/tp_cost.py``), if any; ``head``: the last stage's output
        head in layers; ``recompute``: activation checkpointing (a recomputed layer does
        ``cost.RECOMPUTE_FACTOR`` of a plain one's work, the head does not grow)."""
        from ..cost import RECOMPUTE_FACTOR

        self.world, self.given, self.tp_measured = world, tp_slowdown, tp_measured
        self.head = head
        self.recompute = bool(recompute)
        self.layer_cost = RECOMPUTE_FACTOR if self.recompute else 1.0
        self.tp = tp                      # the TP degree self.slowdown is keyed by
        self.slowdown = self._slowdown(tp)
        self.units = self.shape = None
        self.for_plan(plan, tp)
        self.held = held_ranks(self.units, None)
        self.floor = np.zeros(world)     # the held ranks' planned rates (the estimate's floor)
        self.probe_ref = probe_reference(self.units, self.held)

    def _slowdown(self, tp: int) -> dict[int, float]:
        """tp/g -> slowdown: the user's ``tp_slowdown`` map where given, else the table measured
        at start-up for this ``tp``, else ideal (tp/g)."""
        from ..problem import given_slowdown, ideal_slowdown

        given = given_slowdown(self.given, tp)
        if given is not None:
            return given
        ideal = ideal_slowdown(tp)
        if self.tp_measured is not None and set(self.tp_measured) == set(ideal) and tp == self.tp:
            return dict(self.tp_measured)
        return ideal

    def for_plan(self, plan: Plan, tp: int) -> bool:
        """The work of ``plan`` on a job of TP degree ``tp``; returns whether ``tp`` changed
        (a switch that brought new TP sizes)."""
        changed = tp != self.tp
        if changed:
            self.tp = tp
            self.slowdown = self._slowdown(tp)
        self.units = cost_units(plan, self.world, self.tp, self.slowdown, self.head,
                                self.layer_cost)
        self.shape = tuple(cost_shape(plan, self.world).T)     # per-micro-batch terms, fitted
        return changed

    def hold(self, rates: Sequence[float | None], healthy: float) -> None:
        """The ranks the running plan treats as slow (from the rates it was made for: the
        broadcast decision's, or the shared measurement) and the rank that calibrates their
        probes."""
        self.held = held_ranks(self.units, rates, max(HOLD, healthy))
        self.floor = np.where(self.held, [0.0 if r is None else r for r in rates], 0.0)
        self.probe_ref = probe_reference(self.units, self.held)
