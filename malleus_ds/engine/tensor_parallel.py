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
so gradient sync and migration address slices by global layer index and :data:`SHARD_DIM`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.llama import TP_PLAN

#: Block parameter (name inside a block) -> dimension it is split along under TP (absent: replicated).
#: The model's own TP plan; the slice map reads the same through ``param_table``.
SHARD_DIM: dict[str, int] = TP_PLAN


class TPError(ValueError):
    """A TP group size the model cannot be split by."""


def check_tp_size(cfg, tp_size: int, where: str = "") -> None:
    """Raise ``TPError`` unless ``tp_size`` divides the heads and the FFN width of ``cfg``."""
    pre = f"{where}: " if where else ""
    if tp_size < 1:
        raise TPError(f"{pre}TP size {tp_size} must be >= 1")
    if cfg.num_heads % tp_size:
        raise TPError(f"{pre}TP group size {tp_size} does not divide the model's num_heads="
                      f"{cfg.num_heads}; use TP groups whose size divides {cfg.num_heads}")
    if cfg.ffn % tp_size:
        raise TPError(f"{pre}TP group size {tp_size} does not divide the model's FFN width "
                      f"{cfg.ffn}; use TP groups whose size divides {cfg.ffn}")


_COMM_CONTEXT = None


def set_comm_context(factory) -> None:
    """Run every TP all-reduce inside ``factory()`` (e.g. ``ComputeClock.excluded``), or plainly
    when None. Process-wide: one engine per process."""
    global _COMM_CONTEXT
    _COMM_CONTEXT = factory


def _all_reduce(t: torch.Tensor, group) -> None:
    if _COMM_CONTEXT is None:
        dist.all_reduce(t, group=group)
    else:
        with _COMM_CONTEXT():
            dist.all_reduce(t, group=group)


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
def _shard_linear(lin: nn.Linear, dim: int, tp_rank: int, tp_size: int) -> None:
    lin.weight = nn.Parameter(shard(lin.weight.data, dim, tp_rank, tp_size))
    lin.out_features, lin.in_features = lin.weight.shape


def apply_tp(stage: nn.Module, group, tp_rank: int, tp_size: int) -> nn.Module:
    """Shard every block of ``stage`` (a ``StageModule``) for TP rank ``tp_rank`` of ``tp_size``.

    ``group`` is the TP process group (unused when ``tp_size == 1``). Returns ``stage``.
    """
    if tp_size == 1:
        return stage
    check_tp_size(stage.cfg, tp_size)
    for blk in stage.blocks.values():
        for name, sub in blk.named_modules():
            d = SHARD_DIM.get(f"{name}.weight")
            if d is not None:
                _shard_linear(sub, d, tp_rank, tp_size)
        for mod in (blk.attn, blk.mlp):
            # f before the column-parallel pair, g after the row-parallel projection
            mod.register_forward_pre_hook(lambda m, args, g=group: (copy_to_tp(args[0], g),) + args[1:])
            mod.register_forward_hook(lambda m, args, out, g=group: reduce_from_tp(out, g))
    return stage
