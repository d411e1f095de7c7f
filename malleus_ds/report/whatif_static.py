"""The static plan a static job runs, and what it keeps of healthy throughput under rates and
slow links, for the what-if account (definitions: ``whatif.py``'s module docstring).

:func:`static_model` simulates the static plan's 1F1B step healthy and under the rates;
:func:`static_keep` turns that into the share of healthy throughput kept, slowing only the
compute when the run recorded it; :func:`link_bound` is how much further than the compute bound
slow links bring a perfect layout down (``capacity.py``). :func:`layout_from_config` reads the
layout from a run's Hydra config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .whatif_rates import GPU_LINK


@dataclass(frozen=True)
class Layout:
    """The static plan a static job runs: ``plan.static_plan`` of these numbers."""

    tp: int
    pp: int
    dp: int
    num_layers: int
    global_batch_size: int
    micro_batch_size: int

    def describe(self) -> str:
        m = self.global_batch_size // self.micro_batch_size
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}, {self.num_layers} layers, "
                f"{m} micro-batches")


def layout_from_config(conf: Mapping, world: int) -> Layout | None:
    """The static layout of a Hydra ``config.yaml`` (``parallel``, ``model``, ``train``; dp null
    = world / (tp pp)); None when a needed number is missing (num_layers only matters for
    pp > 1)."""
    try:
        par, tr = conf.get("parallel") or {}, conf.get("train") or {}
        tp, pp = int(par.get("tp") or 1), int(par.get("pp") or 1)
        dp = int(par.get("dp") or world // (tp * pp))
        layers = (conf.get("model") or {}).get("num_layers")
        layers = int(layers) if layers else (pp if pp == 1 else None)
        if layers is None:
            return None
        return Layout(tp, pp, dp, layers, int(tr.get("global_batch_size", 8)),
                      int(tr.get("micro_batch_size", 1)))
    except (TypeError, ValueError, AttributeError, ZeroDivisionError):
        return None


def link_bound(layout: Layout | None, cluster: tuple[int, int] | None, comm: Mapping | None,
               rates: Mapping[int, float], links: Sequence[tuple[str, float | None]]
               ) -> float | None:
    """``link_capacity / f`` (``malleus_ds/capacity.py``) for a phase with slow links: how
    much further than the compute bound the links bring a perfect layout down; None when it
    cannot be told (no layout, node shape, measured ``comm`` section or link rate). Slow GPU
    links are left out (the bound only loosens: ``capacity.py``): with those alone, 1.0."""
    if layout is None or cluster is None or not comm or not links:
        return None
    if any(x is None or "-" not in n for n, x in links):
        return None
    links = [(n, x) for n, x in links if not n.startswith(GPU_LINK)]
    if not links:
        return 1.0
    from ..capacity import link_capacity
    from ..cost import capacity_fraction
    from ..plan import PlanError
    from ..problem import Problem

    nodes, gpn = cluster
    try:
        pr = Problem(name="whatif", nodes=nodes, gpus_per_node=gpn,
                     num_layers=layout.num_layers, global_batch_size=layout.global_batch_size,
                     micro_batch_size=layout.micro_batch_size, tp=layout.tp, pp=layout.pp,
                     dp=layout.dp, tp_slowdown={1: 1.0}, memory=None, rates=dict(rates),
                     extra={"comm": dict(comm)}).with_link_rates(
                         {n: max(1.0, float(x)) for n, x in links})
        return link_capacity(pr) / capacity_fraction(pr)
    except (PlanError, ValueError, KeyError):
        return None



@dataclass(frozen=True)
class StaticModel:
    """The static plan's step in model units: healthy, under the rates, and the compute one
    rank does per healthy step (the busiest rank's)."""

    healthy: float
    slowed: float
    busy: float
    how: str


def static_model(layout: Layout | None, rates: Mapping[int, float], world: int) -> StaticModel:
    """The static plan's simulated 1F1B step time (``simulate.build_timeline``) healthy and under
    ``rates``; without a usable layout, the slowest rank's pace (1 unit of compute per step,
    ``max rate`` units under ``rates``)."""
    x = max(rates.values(), default=1.0)
    if layout is None:
        return StaticModel(1.0, x, 1.0, "slowest rank's pace (layout not recorded: exact for "
                                        "pp=1)")
    from ..plan import PlanError
    from ..problem import Problem
    from ..simulate import build_timeline

    n = layout.tp * layout.pp * layout.dp
    if n != world:
        return StaticModel(1.0, x, 1.0, f"slowest rank's pace (the layout {layout.describe()} "
                                        f"has {n} ranks, the run {world})")
    try:
        prob = Problem(name="static", nodes=1, gpus_per_node=world, num_layers=layout.num_layers,
                       global_batch_size=layout.global_batch_size,
                       micro_batch_size=layout.micro_batch_size, tp=layout.tp, pp=layout.pp,
                       dp=layout.dp, tp_slowdown={1: 1.0}, memory=None, rates={})
        plan = prob.static_plan()
        h = build_timeline(prob, plan)
        r = build_timeline(prob.with_rates(dict(rates)), plan) if rates else h
    except (PlanError, ValueError) as e:
        return StaticModel(1.0, x, 1.0, f"slowest rank's pace ({e})")
    return StaticModel(h.step_time, r.step_time, max(b for bs in h.busy for b in bs),
                       f"simulated 1F1B step of the static plan ({layout.describe()})")


def static_keep(model: StaticModel, step_s: float, compute_s: float | None) -> float:
    """``k``: the share of healthy throughput the static plan keeps. With the healthy step's
    busiest-rank compute seconds ``compute_s``, only compute slows: the extra model units cost
    ``compute_s / busy`` seconds each on top of the healthy ``step_s``; without it the whole
    step scales with the model."""
    if compute_s and compute_s > 0 and step_s > 0:
        return step_s / (step_s + compute_s / model.busy * (model.slowed - model.healthy))
    return model.healthy / model.slowed

