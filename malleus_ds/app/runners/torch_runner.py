"""``engine=torch``: plain PyTorch AdamW — the reference every other engine is checked against.

On one process this is exactly :func:`malleus_ds.app.reference.reference_run` (both run
:func:`malleus_ds.app.reference.torch_step`). With several ranks
it is plain data parallelism with the same math: each rank runs its share of the micro-batches
(static plan order), each micro-batch loss is scaled by ``micro_batch_size / global_batch_size``,
and gradients are *summed* across ranks (all-reduce SUM) before the identical optimizer step.

Checkpoints (``checkpoint.dir``): every replica holds the whole state, so rank 0 alone writes
``global_step{N}/torch_state.pt`` (model and optimizer state dicts and the step); every rank
loads it on resume, under any world size.
"""
from __future__ import annotations

import time

from ...files.ckpt_format import TORCH_FORMAT, TORCH_STATE_FILE
from ..run_config import ConfigError, RunConfig
from ...files.fileio import atomic_write
from ...samples import loss_share
from .base import DistEnv, RunSummary
from .checkpoint import Checkpointer
from .common import ComputeClock, StepReporter, replica_micro_batches



def validate(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.tp != 1 or p.pp != 1:
        raise ConfigError(f"engine=torch is the data-parallel reference: it needs parallel.tp=1 "
                          f"and parallel.pp=1, got tp={p.tp} pp={p.pp}; use engine=deepspeed "
                          f"for pp>1 or engine=malleus for tp>1")


def _build_model(cfg: RunConfig, env: DistEnv):
    """The model (seeded, on the rank's device, with activation checkpointing when asked) and
    its optimizer."""
    import torch

    from ...models import build_model
    from ...models.base import enable_activation_checkpointing
    from ...optim import make_optimizer

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.train.seed).to(env.device)
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    return model, make_optimizer(model.parameters(), cfg.train.optim)


def _load_state(saved, env: DistEnv, model, opt) -> None:
    """Load the model and optimizer state of the checkpoint ``saved`` (plain data only: a file
    that names any class or function is refused)."""
    from ...files.safe_load import UnsafeFile, load_plain

    try:
        st = load_plain(saved.path / TORCH_STATE_FILE, "engine=torch checkpoint file",
                        mmap=False, map_location=env.device)
    except UnsafeFile as e:
        raise ConfigError(f"checkpoint.resume: {e}") from None
    if not isinstance(st, dict) or st.get("format") != TORCH_FORMAT or \
            st.get("step") != saved.step or not isinstance(st.get("model"), dict) or \
            not isinstance(st.get("optimizer"), dict):
        raise ConfigError(f"checkpoint {saved.path / TORCH_STATE_FILE}: not a {TORCH_FORMAT} file "
                          f"of step {saved.step}")
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    del st


def _summed_gradients(model, env: DistEnv):
    """The step's reduction: every gradient summed across ranks, not averaged (§5), and the
    loss total with them."""
    import torch
    import torch.distributed as dist

    def reduce(total: float) -> float:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        t = torch.tensor([total], dtype=torch.float64, device=env.device)
        dist.all_reduce(t)
        return float(t)
    return reduce


def run(cfg: RunConfig, env: DistEnv) -> RunSummary:
    """Train ``cfg`` with plain PyTorch AdamW on this rank (the module docstring)."""
    import torch
    import torch.distributed as dist

    from ...data import build_dataset
    from ..reference import torch_step

    model, opt = _build_model(cfg, env)
    data = build_dataset(cfg)
    scale = loss_share(cfg.train.micro_batch_size, cfg.train.global_batch_size)
    multi = dist.is_initialized() and env.world_size > 1
    ck = Checkpointer(cfg, env)
    if ck.resumed is not None:
        _load_state(ck.resumed, env, model, opt)

    def write(root, tag: str, done: int) -> None:
        if env.is_rank0:
            state = {"format": TORCH_FORMAT, "step": done, "model": model.state_dict(),
                     "optimizer": opt.state_dict()}
            atomic_write(root / tag / TORCH_STATE_FILE, lambda f: torch.save(state, f))

    def fetch(ids):
        return tuple(t.to(env.device) for t in data.batch(ids))

    reduce = _summed_gradients(model, env) if multi else None
    clock, reporter = ComputeClock(cfg, env), StepReporter(cfg, env, first_step=ck.start)
    for step in range(ck.start, cfg.train.steps):
        t0 = time.perf_counter()
        clock.start_step(step)
        total = torch_step(model, opt, fetch, replica_micro_batches(cfg, step, env.rank,
                                                                    env.world_size),
                           scale, compute=clock.compute, reduce=reduce)
        reporter.step_done(step, total, time.perf_counter() - t0, clock)
        ck.after_step(step + 1, write, reporter)
    ck.finish(cfg.train.steps, write, reporter)
    return reporter.finish(**ck.summary())
