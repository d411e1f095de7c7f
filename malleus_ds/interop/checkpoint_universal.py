"""Universal checkpoint folders (``ds_to_universal``'s output, or ``malleus-export --to
deepspeed-universal``'s)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..files.ckpt_format import CheckpointError
from .checkpoint_files import DeepSpeedState, as_int, hyper, load, load_any


def read_universal(d: Path, ms: dict) -> DeepSpeedState:
    """A universal checkpoint (``ds_to_universal``'s output, or ``malleus-export --to
    deepspeed-universal``'s): each parameter's full fp32 weight and Adam moments in
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` (``{"param": tensor}``) and its step in
    ``step.pt``; the optimizer's hyper-parameters in ``zero/optimizer_state.pt``."""
    z = d / "zero"
    params, m1, m2, steps = {}, {}, {}, set()
    for sub in sorted(x for x in z.iterdir() if x.is_dir()):
        if not (sub / "fp32.pt").is_file():
            raise CheckpointError(f"{sub}: no fp32.pt (a universal checkpoint's parameter "
                                  f"folder holds fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt)")
        params[sub.name] = _param(sub / "fp32.pt")
        if (sub / "exp_avg.pt").is_file() and (sub / "exp_avg_sq.pt").is_file():
            m1[sub.name] = _param(sub / "exp_avg.pt").reshape(params[sub.name].shape)
            m2[sub.name] = _param(sub / "exp_avg_sq.pt").reshape(params[sub.name].shape)
        if (sub / "step.pt").is_file():
            steps.add(as_int(load_any(sub / "step.pt")))
    if not params:
        raise CheckpointError(f"{z}: no parameter folders: not a universal checkpoint")
    if m1 and len(m1) != len(params):
        raise CheckpointError(f"{z}: Adam's moments for {len(m1)} of {len(params)} parameters: "
                              f"a partial conversion")
    opt = load(z / "optimizer_state.pt")
    zero = (ms.get("ds_config") or {}).get("zero_optimization", {})
    return DeepSpeedState(tag_dir=d, zero_stage=as_int(zero.get("stage"), 1),
        dp=as_int(ms.get("dp_world_size"), 1),
        params=params, exp_avg=m1, exp_avg_sq=m2, adam_step=max(steps) if steps else 0,
        global_steps=as_int(ms.get("global_steps")),
        global_samples=as_int(ms.get("global_samples")),
        skipped_steps=as_int(ms.get("skipped_steps")), lr_scheduler=ms.get("lr_scheduler") or None,
        param_groups=hyper(opt.get("param_groups")))



def _param(f: Path) -> torch.Tensor:
    x = load_any(f)
    t = x.get("param") if isinstance(x, dict) else None
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{f}: no 'param' tensor (not a universal checkpoint file)")
    return t.float()
