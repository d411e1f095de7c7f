"""Megatron-style tensor parallelism applied to an already-built stage (torchtitan's ``apply_tp``).

The model code knows nothing about TP. ``apply_tp`` slices the full, deterministically
initialised weights of every block in place and wraps attention and MLP with the two Megatron
conjugate ops:

* ``f`` = :func:`copy_to_tp`: identity forward, all-reduce of the gradient backward (input of a
  column-parallel pair: ``wq/wk/wv`` and ``w_gate/w_up``);
* ``g`` = :func:`reduce_from_tp`: all-reduce forward, identity backward (output of the
  row-parallel ``wo`` / ``w_down``).

Column-parallel weights (out, in) are split along dim 0 (attention by whole heads), row-parallel
weights along dim 1. Norms, embedding and head stay replicated inside the TP group (every TP rank
computes the same values and gradients). Parameter names do not change (``blocks.5.attn.wq.weight``),
so gradient sync and migration address slices by global layer index and the model's ``tp_plan``
(read through ``param_table``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.base import TPError


def check_tp_size(cfg, tp_size: int, where: str = "") -> None:
    """Raise ``TPError`` unless the model ``cfg`` can be split ``tp_size`` ways (its own rule:
    heads and FFN width; for grouped-query attention also the KV heads)."""
    cfg.check_tp(tp_size, where)


_COMM_CONTEXT = None


def set_comm_context(factory) -> None:
    """Run every TP all-reduce's wait inside ``factory(tensor, group)`` (the engine's: the
    clock leaves it out of compute and times it, ``ComputeClock.collective``), or plainly when
    None. Process-wide: one engine per process."""
    global _COMM_CONTEXT
    _COMM_CONTEXT = factory


def _all_reduce(t: torch.Tensor, group) -> None:
    """Issue the TP all-reduce asynchronously, then wait for it inside the comm context: the
    wait is where a slow TP peer costs time (on NCCL the call returns at once and the stream
    waits; the clock's events around the wait time it), so it is left out of this rank's
    compute and only the slow member of a TP group reads slow."""
    work = dist.all_reduce(t, group=group, async_op=True)
    if _COMM_CONTEXT is None:
        work.wait()
    else:
        with _COMM_CONTEXT(t, group):
            work.wait()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        _all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        _all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def shard(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Slice ``tp_rank`` of ``tp_size`` equal slices of ``full`` along ``dim`` (a copy)."""
    n = full.shape[dim]
    if n % tp_size:
        raise TPError(f"dimension {dim} of size {n} is not divisible by TP size {tp_size}")
    w = n // tp_size
    return full.narrow(dim, tp_rank * w, w).clone()


@torch.no_grad()
def _shard_linear(lin: nn.Linear, plan, name: str, tp_rank: int, tp_size: int) -> None:
    d = plan.get(f"{name}.weight")
    if d is None:
        return
    lin.weight = nn.Parameter(shard(lin.weight.data, d, tp_rank, tp_size))
    lin.out_features, lin.in_features = lin.weight.shape
    if lin.bias is not None:
        bd = plan.get(f"{name}.bias")
        if bd is not None:      # a column-parallel bias splits with its output features
            lin.bias = nn.Parameter(shard(lin.bias.data, bd, tp_rank, tp_size))


def _f_hook(group):
    """Forward pre-hook: ``f`` on the region's input, positional or ``hidden_states=``."""
    def hook(mod, args, kwargs):
        if args:
            return (copy_to_tp(args[0], group),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = copy_to_tp(kwargs["hidden_states"], group)
        return args, kwargs
    return hook


def _g_hook(group):
    """Forward hook: ``g`` on the region's output (its first element when a tuple, as HF
    attention returns ``(output, weights)``)."""
    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (reduce_from_tp(out[0], group),) + tuple(out[1:])
        return reduce_from_tp(out, group)
    return hook


def apply_tp(stage: nn.Module, group, tp_rank: int, tp_size: int) -> nn.Module:
    """Shard every decoder layer of ``stage`` (a ``StageModule``) for TP rank ``tp_rank`` of
    ``tp_size`` by the model's ``tp_plan``, and put ``f`` / ``g`` around its ``tp_regions``.

    ``group`` is the TP process group (unused when ``tp_size == 1``). Returns ``stage``.
    """
    if tp_size == 1:
        return stage
    cfg = stage.cfg
    check_tp_size(cfg, tp_size)
    plan = cfg.tp_plan
    for blk in stage.blocks.values():
        for name, sub in blk.named_modules():
            if isinstance(sub, nn.Linear):
                _shard_linear(sub, plan, name, tp_rank, tp_size)
        for mod in cfg.tp_regions(blk):
            # f before the column-parallel pair, g after the row-parallel projection
            mod.register_forward_pre_hook(_f_hook(group), with_kwargs=True)
            mod.register_forward_hook(_g_hook(group))
    return stage
