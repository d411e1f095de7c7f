"""The single-process reference: plain PyTorch AdamW on the whole model (DESIGN.md §5).

Every distributed engine is checked against :func:`reference_run` on the same data: the global
batch of step ``k`` is ``global_batch_ids(k, G)`` (``samples.py``); each micro-batch's mean loss
is scaled by ``micro_batch_size / global_batch_size`` and gradients are summed, so the step
minimises the global-batch mean. The logged loss is that global-batch mean.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterable

import torch

from ..data import DataConfig, make_dataset
from ..models import ModelConfig, build_model, lm_loss
from ..models.base import (
    enable_activation_checkpointing,
    global_named_parameters,
    global_state_dict,
    tied_params)
from ..optim import OptimConfig, make_optimizer
from ..samples import loss_share, micro_batches


def reference_run(cfg: ModelConfig, *, seed: int, steps: int, global_batch_size: int,
                  micro_batch_size: int, optim: OptimConfig = OptimConfig(),
                  data_seed: int | None = None, grad_clip: float = 0.0,
                  adam_out: dict | None = None, data: DataConfig | None = None,
                  activation_checkpointing: bool = False):
    """Train ``steps`` steps on one process. Returns (per-step losses, final state_dict).

    ``grad_clip > 0`` clips the summed gradients' global norm before each step
    (``clip_grad_norm_``: scale by ``max_norm / (norm + 1e-6)`` when that is < 1), which is
    DeepSpeed's ``gradient_clipping``. ``adam_out``: filled with ``{name: {"exp_avg": ...,
    "exp_avg_sq": ...}}`` after the last step (for checking migrated optimizer states).
    ``data``: what to train on (the app's ``data.*``; None = the shipped byte corpus at
    ``cfg.max_seq_len``), built by the runners' own factory. ``activation_checkpointing``:
    recompute each decoder layer in backward (``models.base.enable_activation_checkpointing``;
    the same losses, less memory)."""
    torch.manual_seed(seed)
    model = build_model(cfg, seed)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    opt = make_optimizer(model.parameters(), optim)
    dataset = make_dataset(data or DataConfig(), cfg, seed if data_seed is None else data_seed)
    scale = loss_share(micro_batch_size, global_batch_size)
    losses = [torch_step(model, opt, dataset.batch,
                         micro_batches(step, global_batch_size, micro_batch_size), scale,
                         grad_clip=grad_clip)
              for step in range(steps)]
    if adam_out is not None:
        for n, p in global_named_parameters(model):
            st = opt.state.get(p, {})
            adam_out[n] = {k: st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq") if k in st}
        for a, b in tied_params(cfg):       # one parameter, two names in the engines
            adam_out[b] = adam_out[a]
    return losses, {k: v.detach().clone() for k, v in global_state_dict(model).items()}


def torch_step(model, opt, fetch: Callable, ids_list: Iterable, scale: float, *,
               compute: Callable = nullcontext, reduce: Callable[[float], float] | None = None,
               grad_clip: float = 0.0) -> float:
    """One plain-PyTorch step, the single-process loop ``reference_run`` and ``engine=torch``
    (``app/runners/torch_runner.py``) share: for each micro-batch in ``ids_list``, ``fetch(ids) ->
    (inputs, targets)``, its mean loss × ``scale`` (its share of the global mean), backward
    (gradients sum), all inside ``compute()`` (a timing context); then ``reduce(loss) -> loss``
    (data parallel: sum the gradients and the loss over the replicas; None on one process),
    clipping of the summed gradients' global norm when ``grad_clip > 0`` and the optimizer
    step. Returns the step's loss: the global-batch mean once reduced."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for ids in ids_list:
        with compute():
            x, y = fetch(ids)
            loss = lm_loss(model(x), y) * scale
            loss.backward()
        total += loss.item()
    if reduce is not None:
        total = reduce(total)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=False)
    opt.step()
    return total
