"""DeepSpeed checkpoint files: their names, loading them without running code, and the state
record the readers (``checkpoint_zero``, ``checkpoint_plain``, ``checkpoint_universal``) fill for
``checkpoint.read_state``."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..files.ckpt_format import CheckpointError

MODEL_FILE = "mp_rank_00_model_states.pt"
#: the optimizer hyper-parameters carried into the continued run
HYPER = ("lr", "betas", "eps", "weight_decay", "initial_lr")


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as full fp32 tensors by DeepSpeed's parameter name."""

    tag_dir: Path
    zero_stage: int
    dp: int
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    adam_step: int
    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict | None
    param_groups: list[dict] = field(default_factory=list)
    pipeline_stages: int = 1         # PipelineEngine's stages (1: no pipeline)
    loss_scaler: dict | None = None  # fp16: the scaler's state (ckpt_format.scaler_state's keys)
    notes: list[str] = field(default_factory=list)  # what the reader changed, for the user



def load(f: Path) -> dict:
    from ..files.safe_load import UnsafeFile
    from .compat import load_deepspeed_file

    try:
        d = load_deepspeed_file(f, "cpu")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{f}: holds a {type(d).__name__}, not DeepSpeed's dict")
    return d


def as_int(v, default: int = 0) -> int:
    if isinstance(v, torch.Tensor):
        return int(v.item())
    return default if v is None else int(v)


LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


def stage_file(s: int) -> str:
    return f"mp_rank_{s:02d}_model_states.pt"



def load_any(f: Path):
    from ..files.safe_load import UnsafeFile
    from .compat import load_deepspeed_file

    try:
        return load_deepspeed_file(f, "cpu")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None



def hyper(groups) -> list[dict]:
    return [{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k in HYPER}
            for g in groups or ()]

