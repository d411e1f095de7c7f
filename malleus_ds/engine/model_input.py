"""What ``MalleusEngine(model=...)`` accepts: a model config with the interface of
``malleus_ds/models/base.py`` (our ``ModelConfig`` or a Hugging Face ``HFModel``), a whole
``StageModule`` (each rank copies its layers out of it), or a callable ``(start, end) ->
StageModule`` carrying its config as ``.cfg``; :func:`model_builder` turns each into (model
config, ``make_stage``)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..models.base import StageModule, enable_activation_checkpointing


def is_model(obj) -> bool:
    """A model config implementing the interface of ``malleus_ds/models/base.py``."""
    return all(hasattr(obj, a) for a in ("build_layer", "run_block", "tp_plan", "num_layers"))


def model_builder(model, seed: int,
                  recompute: bool = False) -> tuple[object, Callable[..., nn.Module]]:
    """(model config, ``make_stage(start, end, init=True)``). ``recompute``: every stage it
    makes recomputes its decoder layers in backward (activation checkpointing), so a plan
    switch's stages do too."""
    cfg, make = _builder(model, seed)
    if not recompute:
        return cfg, make
    return cfg, lambda s, e, init=True: enable_activation_checkpointing(make(s, e, init))


def _builder(model, seed: int) -> tuple[object, Callable[..., nn.Module]]:
    if isinstance(model, StageModule):
        full = model

        def from_full(s: int, e: int, init: bool = True) -> nn.Module:
            st = StageModule(full.cfg, s, e, seed)
            src = dict(full.named_parameters())
            with torch.no_grad():
                for n, p in st.named_parameters():
                    p.copy_(src[n])
            return st
        return full.cfg, from_full
    if is_model(model):
        return model, lambda s, e, init=True: StageModule(model, s, e, seed, init=init)
    if callable(model):
        probe_cfg = getattr(model, "cfg", None)
        if not is_model(probe_cfg):
            raise TypeError("model: a callable stage builder must carry its model config as .cfg")
        return probe_cfg, lambda s, e, init=True: model(s, e)
    raise TypeError(f"model: expected a model config (ModelConfig, HFModel), a StageModule or a "
                    f"stage builder, got {type(model).__name__}")
