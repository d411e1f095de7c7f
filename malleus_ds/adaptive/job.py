"""What the adaptive loop knows of the job it adapts: plain values, frozen at start.

The loop (``control.py``) never reads an engine. The app builds a :class:`JobSpec` from the
engine it attaches the loop to (``app/loop.py``); a simulator or a test builds one from a model
config and a plan alone (:meth:`JobSpec.of_model`). What changes while the job runs comes in
through the loop's hooks: the plan and job layout after each switch, the migration it took, the
per-step timings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..interop.malleus_section import MIGRATE_BUCKET_MB
from ..job_layout import JobLayout
from ..layout import ParamTable


@dataclass(frozen=True)
class JobSpec:
    """The job as the loop plans for it."""

    rank: int                    # this process's rank (rank 0 detects and plans)
    world: int
    job: JobLayout               # world, node shape, nominal TP at start (a switch may change it)
    param_table: ParamTable      # every parameter's global name and shape: transfer bytes, memory
    model_cfg: Any               # the model config: hidden size, memory per layer
    seq_len: int
    micro_batch_size: int
    mixed: bool = False          # bf16 / fp16 parameters with fp32 masters
    param_bytes: int = 4         # bytes of one parameter as trained (2 under bf16 / fp16)
    zero_stage: int = 1
    device: str = "cpu"          # where the model runs (its memory, when malleus.device_mb is unset)
    migrate_bucket_mb: float = MIGRATE_BUCKET_MB   # the migration's staging buffers
    recompute: bool = False      # activation checkpointing: a layer recomputed in backward
    #: the memory (MB) one rank may use on its device, as the app measured it
    #: (``app/loop.device_memory_mb``; None: on CPU, the host's RAM shared by its ranks)
    device_mb: float | None = None
    #: a job known only as a planning problem (a replay, ``replay/job.py``): the loop plans with
    #: this problem (its memory, TP slowdowns, output head) instead of building one from the
    #: model's sizes; ``param_table`` then stands for its state, ``model_cfg`` may be None
    problem: Any = None

    @staticmethod
    def of_model(model_cfg, plan, rank: int = 0, world: int | None = None,
                 job: JobLayout | None = None, seq_len: int | None = None,
                 **kw) -> "JobSpec":
        """A job of ``model_cfg`` (a ``ModelConfig``) starting under ``plan``, with no engine."""
        from ..models.base import param_table

        w = world if world is not None else len(plan.all_ranks)
        return JobSpec(rank=rank, world=w, job=job or JobLayout.one_node(w),
                       param_table=param_table(model_cfg), model_cfg=model_cfg,
                       seq_len=seq_len or model_cfg.max_seq_len,
                       micro_batch_size=plan.micro_batch_size, **kw)
