"""Everything one rank holds for one plan, in one object, so a plan switch is "build the next
runtime, move state into it, drop the old one" (DESIGN.md §6-7).

A :class:`PlanRuntime` owns the stage module (TP-sharded, in the training dtype), the pipeline
peers and 1F1B schedule, the gradient buckets (which are also the fp32 gradient accumulators) and
their sync, and the ZeRO-sharded optimizer with its fp32 masters. What outlives a plan (the
step counters, the loss scaler, the LR schedule, the data) stays on the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..layout import Bucket, ParamTable, build_buckets
from ..models.base import on_meta
from ..plan import Plan
from .grad_sync import GradSync
from .groups import GROUPS
from .optimizer import ShardedOptimizer
from .precision import Precision
from ..schedule import one_f_one_b
from .tensor_parallel import apply_tp
from .tied import TiedSync
from .wire import pipeline_peers


@dataclass(frozen=True)
class StageSpec:
    """Where ``rank`` sits in a plan: (pipeline, stage) or None, and its TP group."""

    located: tuple[int, int] | None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None


def locate(plan: Plan, rank: int) -> StageSpec:
    loc = plan.locate(rank)
    if loc is None:
        return StageSpec(None)
    st = plan.pipelines[loc[0]].stages[loc[1]]
    return StageSpec(loc, st.ranks.index(rank), st.tp, GROUPS.get(st.ranks) if st.tp > 1 else None)


def build_stage(plan: Plan, spec: StageSpec, make_stage: Callable[..., nn.Module],
                precision: Precision, *, reuse: Mapping[str, nn.Parameter] | None = None,
                device=None) -> nn.Module:
    """This rank's stage module for ``plan``: built, TP-sharded, cast to the training dtype.
    Process groups must exist (``GROUPS.ensure``).

    ``reuse`` (a plan switch): the module is built on the meta device (no init, no memory), then
    every parameter takes the given tensor object (one the previous plan held with exactly this
    shard: nothing moves, nothing is copied) or fresh uninitialised memory on ``device`` that the
    migration fills."""
    if spec.located is None:
        return nn.Module()
    st = plan.pipelines[spec.located[0]].stages[spec.located[1]]
    if reuse is None:
        module = make_stage(st.start, st.end, True)
    else:
        with on_meta():
            module = make_stage(st.start, st.end, False)
    apply_tp(module, spec.tp_group, spec.tp_rank, spec.tp_size)
    if precision.mixed:
        # what DeepSpeedEngine._cast_module_mixed_precision does (parameters only; the model
        # has no buffers); fp32 masters are then made from these casts, as DeepSpeed's
        # BF16_Optimizer / FP16_Optimizer make theirs
        with torch.no_grad():
            for p in module.parameters():
                p.data = p.data.to(precision.dtype)
    if reuse is not None:
        for name, p in list(module.named_parameters()):
            old = reuse.get(name)
            if old is None or old.shape != p.shape or old.dtype != p.dtype:
                old = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, old)
    return module


@dataclass(eq=False)
class PlanRuntime:
    plan: Plan
    spec: StageSpec
    module: nn.Module
    named: dict[str, nn.Parameter]
    zero_stage: int
    buckets: list[Bucket]
    grad_sync: GradSync
    optimizer: ShardedOptimizer
    pipeline_id: int | None = None
    stage_id: int | None = None
    num_stages: int = 0
    micro_batches: int = 0
    schedule: list = field(default_factory=list)
    act_src: int | None = None
    act_dsts: list[int] = field(default_factory=list)
    grad_src: int | None = None
    grad_dsts: list[int] = field(default_factory=list)
    hooks: list = field(default_factory=list)        # immediate accumulation into the buckets
    tied: TiedSync | None = None                       # tied embedding/head gradient sum
    #: the host memory this rank's checkpoint is copied into, laid out for the runs of its
    #: holdings it writes (``engine/checkpoint_save.SaveBuffer``; a pure function of the plan,
    #: so made at its first save and reused by every other)
    save_buffer: object | None = None

    @property
    def located(self):
        return self.spec.located

    def close(self) -> None:
        """Drop hooks and references so the old plan's tensors can be freed."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.named.clear()
        self.grad_sync.free()

    def accumulate(self) -> None:
        """After a micro-batch's backward: every parameter's gradient into the fp32 buckets (one
        ``_foreach_add_``), then dropped (``GradSync.accumulate``)."""
        grads = {n: p.grad for n, p in self.named.items() if p.grad is not None}
        self.grad_sync.accumulate(grads)
        for n in grads:
            self.named[n].grad = None


def build_runtime(plan: Plan, rank: int, spec: StageSpec, module: nn.Module, table: ParamTable,
                  zero_stage: int, make_optimizer, precision: Precision, device,
                  prev: "PlanRuntime | None" = None,
                  tied: tuple[tuple[str, str], ...] = ()) -> PlanRuntime:
    """Peers, schedule, buckets, gradient sync, sharded optimizer and accumulators for ``module``
    (already on ``device``) under ``plan``. ``prev`` (a plan switch): optimizer ranges that
    hold the same elements in memory the previous plan has keep it (the same tensors, or views
    where a bucket split or merged), other masters start empty (migrated in)."""
    named = dict(module.named_parameters())
    buckets = build_buckets(plan, table, rank)
    rt = PlanRuntime(
        plan=plan, spec=spec, module=module, named=named, zero_stage=zero_stage, buckets=buckets,
        grad_sync=GradSync(buckets, GROUPS, device=device, zero_stage=zero_stage, rank=rank,
                           shapes={n: p.shape for n, p in named.items()}),
        optimizer=ShardedOptimizer(buckets, GROUPS, named, rank, zero_stage, make_optimizer,
                                   device=device,
                                   prev=prev.optimizer if prev is not None else None,
                                   from_params=prev is None),
        tied=TiedSync(plan, rank, tied))
    if spec.located is not None:
        i, j = spec.located
        pipe = plan.pipelines[i]
        rt.pipeline_id, rt.stage_id, rt.num_stages = i, j, len(pipe.stages)
        rt.micro_batches = pipe.micro_batches
        rt.schedule = one_f_one_b(j, rt.num_stages, pipe.micro_batches)
        peers = pipeline_peers(plan, rank)     # wire.py: k-th receiver <- sender k % g
        rt.act_src, rt.act_dsts = peers.act_src, list(peers.act_dsts)
        rt.grad_src, rt.grad_dsts = peers.grad_src, list(peers.grad_dsts)
    if precision.immediate_grad_update:
        # per parameter as soon as autograd has its gradient (``bf16.immediate_grad_update``):
        # at most one parameter's low-precision gradient alive at a time
        for n, p in named.items():
            rt.hooks.append(p.register_post_accumulate_grad_hook(
                lambda q, n=n, gs=rt.grad_sync: _add_one(gs, n, q)))
    return rt


@torch.no_grad()
def _add_one(gs: GradSync, name: str, p: torch.Tensor) -> None:
    gs.accumulate({name: p.grad})
    p.grad = None


class _FromRuntime:
    """A MalleusEngine attribute that reads the running plan's :class:`PlanRuntime` (``path``:
    dotted, default the attribute's own name). Before the first plan is adopted it does not
    exist (AttributeError, so ``getattr(engine, name, default)`` works)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        self.parts = (self.path or name).split(".")

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        v = obj.__dict__.get("runtime")
        if v is None:
            raise AttributeError(f"{self.name}: no plan adopted yet")
        for part in self.parts:
            v = getattr(v, part)
        return v


class RunningPlan:
    """The running plan's facts as attributes of the engine, each read from its
    :class:`PlanRuntime` (``self.runtime``): nothing is copied at a switch, so nothing can go
    stale (``MalleusEngine.adopt`` only sets ``runtime`` and DeepSpeed's own fields)."""

    plan = _FromRuntime()
    located = _FromRuntime()
    named = _FromRuntime()
    pipeline_id = _FromRuntime()
    stage_id = _FromRuntime()
    num_stages = _FromRuntime()
    micro_batches = _FromRuntime()
    schedule = _FromRuntime()
    act_src = _FromRuntime()
    act_dsts = _FromRuntime()
    grad_src = _FromRuntime()
    grad_dsts = _FromRuntime()
    buckets = _FromRuntime()
    grad_sync = _FromRuntime()
    zero_stage = _FromRuntime()
    tp_rank = _FromRuntime("spec.tp_rank")
    tp_size = _FromRuntime("spec.tp_size")
    tp_group = _FromRuntime("spec.tp_group")
