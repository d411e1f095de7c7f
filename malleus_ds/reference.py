"""The single-process reference: plain PyTorch AdamW on the whole model (DESIGN.md §5).

Every distributed engine is checked against :func:`reference_run` on the same data: the global
batch of step ``k`` is ``global_batch_ids(k, G)`` (``samples.py``); each micro-batch's mean loss
is scaled by ``micro_batch_size / global_batch_size`` and gradients are summed, so the step
minimises the global-batch mean. The logged loss is that global-batch mean.
"""
from __future__ import annotations

import torch

from .data import DataConfig, make_dataset
from .models import ModelConfig, build_model, lm_loss
from .models.base import global_named_parameters, global_state_dict, tied_params
from .optim import OptimConfig, make_optimizer
from .samples import loss_share, micro_batches


def reference_run(cfg: ModelConfig, *, seed: int, steps: int, global_batch_size: int,
                  micro_batch_size: int, optim: OptimConfig = OptimConfig(),
                  data_seed: int | None = None, grad_clip: float = 0.0,
                  adam_out: dict | None = None, data: DataConfig | None = None):
    """Train ``steps`` steps on one process. Returns (per-step losses, final state_dict).

    ``grad_clip > 0`` clips the summed gradients' global norm before each step
    (``clip_grad_norm_``: scale by ``max_norm / (norm + 1e-6)`` when that is < 1), which is
    DeepSpeed's ``gradient_clipping``. ``adam_out``: filled with ``{name: {"exp_avg": ...,
    "exp_avg_sq": ...}}`` after the last step (for checking migrated optimizer states).
    ``data``: what to train on (the app's ``data.*``; None = the shipped byte corpus at
    ``cfg.max_seq_len``), built by the runners' own factory."""
    torch.manual_seed(seed)
    model = build_model(cfg, seed)
    opt = make_optimizer(model.parameters(), optim)
    dataset = make_dataset(data or DataConfig(), cfg, seed if data_seed is None else data_seed)
    scale = loss_share(micro_batch_size, global_batch_size)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids in micro_batches(step, global_batch_size, micro_batch_size):
            x, y = dataset.batch(ids)
            loss = lm_loss(model(x), y) * scale
            loss.backward()
            total += loss.item()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=False)
        opt.step()
        losses.append(total)
    if adam_out is not None:
        for n, p in global_named_parameters(model):
            st = opt.state.get(p, {})
            adam_out[n] = {k: st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq") if k in st}
        for a, b in tied_params(cfg):       # one parameter, two names in the engines
            adam_out[b] = adam_out[a]
    return losses, {k: v.detach().clone() for k, v in global_state_dict(model).items()}
