"""The optimizer every engine builds: torch AdamW (or Adam with L2, ``decoupled=False``) with one
set of settings.

``OptimConfig`` is what the app's ``train.*`` and a ds_config's ``optimizer`` section both come
down to; ``make_optimizer`` is the one constructor (the single-process reference, the torch
runner and MalleusEngine's ZeRO shards all call it, so their numbers agree).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimConfig:
    """AdamW settings shared by every engine (torch.optim.AdamW semantics)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: AdamW's decoupled weight decay (True), or Adam with an L2 term in the gradient (False:
    #: DeepSpeed's ``adam_w_mode=false``, torch.optim.Adam)
    decoupled: bool = True


#: device types with a fused AdamW kernel in torch
FUSED_DEVICES = ("cuda", "cpu", "xpu", "mps")


def make_optimizer(params, oc: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """torch AdamW, multi-tensor (``foreach``) by default: one kernel per operation over all of
    the parameters instead of one per parameter, with per-element math identical to the
    single-tensor loop (checked bit for bit in tests/unit/test_optim.py), so any subset
    of the parameters a rank holds gets the same numbers as one process. ``fused``: torch's fused
    kernel (the ds_config's ``optimizer.params.fused``), where torch has one for the parameters'
    device (CUDA, CPU); its rounding differs from the loop by about one ulp per step."""
    params = list(params)
    kw = dict(lr=oc.lr, betas=oc.betas, eps=oc.eps, weight_decay=oc.weight_decay)
    cls = torch.optim.AdamW if oc.decoupled else torch.optim.Adam
    if fused and params and params[0].device.type in FUSED_DEVICES:
        return cls(params, fused=True, **kw)
    return cls(params, foreach=True, **kw)
