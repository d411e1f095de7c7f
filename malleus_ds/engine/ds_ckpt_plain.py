"""Folders without ZeRO: the weights from the module and Adam's state from the optimizer's own
``state_dict``."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..files.ckpt_format import CheckpointError
from .ds_ckpt_files import MODEL_FILE, DeepSpeedState, as_int, hyper


def read_stage0(d: Path, ms: dict, weights: Mapping, common: dict) -> DeepSpeedState:
    """Without ZeRO: the weights from the module and Adam's state from the optimizer's own
    ``state_dict``, whose parameter indices follow the module's parameters (a tied parameter
    once)."""
    opt = ms.get("optimizer")
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping):
        raise CheckpointError(f"{d / MODEL_FILE}: no optimizer state (saved without it? DeepSpeed "
                              f"writes it unless save_checkpoint(..., exclude_frozen_parameters) "
                              f"or a client optimizer without state_dict); a checkpoint to "
                              f"continue needs Adam's state")
    names, seen = [], {}
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen[key] = k
            names.append(k)
    order = [i for g in opt.get("param_groups") or () for i in g.get("params", ())]
    if len(order) != len(names):
        raise CheckpointError(f"{d / MODEL_FILE}: the optimizer holds {len(order)} parameters, "
                              f"the module {len(names)}: not one model's checkpoint")
    exp_avg, exp_avg_sq, steps = {}, {}, set()
    for i, name in zip(order, names):
        st = opt["state"].get(i) or opt["state"].get(str(i)) or {}
        if "exp_avg" not in st:
            continue                             # never stepped (step 0): fresh moments
        exp_avg[name] = st["exp_avg"].float().reshape(weights[name].shape)
        exp_avg_sq[name] = st["exp_avg_sq"].float().reshape(weights[name].shape)
        steps.add(as_int(st.get("step")))
    return DeepSpeedState(zero_stage=0, params={n: weights[n].float() for n in names},
                          exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                          adam_step=max(steps) if steps else 0,
                          param_groups=hyper(opt.get("param_groups")), **common)

