"""The user-facing entry point ``malleus_ds.initialize``: the engine picked from the model.

* a plain ``torch.nn.Module`` (not a ``StageModule``): data parallel inside DeepSpeed's own
  engine, ZeRO-0/1/2/3 and offload as the ds_config says (``malleus_ds.dp``:
  ``MalleusDPEngine``), with each step's global batch split across ranks by speed. It takes
  what ``deepspeed.initialize`` takes for that (``args``, ``optimizer``, ``model_parameters``,
  ``training_data``, ``lr_scheduler``, ``collate_fn``, ``config`` / ``config_params``,
  ``dist_init_required``) plus ``loss`` (how the loss given to ``backward`` is normalised); the
  re-split loop (``app/dp_loop.py``: every rank decides the same from every rank's measured
  seconds per sample, one small non-blocking all-reduce per step) is attached unless
  ``malleus.adaptive`` is false;
* a model config (our ``ModelConfig``, a Hugging Face ``HFModel``), a ``StageModule`` or a stage
  builder: ``MalleusEngine`` (``malleus_ds/engine/``), pipelines and tensor parallelism by
  ``plan``, re-planned and migrated by the adaptive loop (``app/loop.py``). The engine knows no
  dataset and no loop; here, at the edge, a run built without ``data=`` gets the shipped byte
  corpus (``malleus_ds/data``), seeded by ``malleus.seed``, so it trains out of the box.

Anything else, or arguments of one engine given with the other's model, is a ValueError naming
what was given and what to pass instead, before any process group exists. Both paths refuse a
ds_config value ``"auto"`` (nothing here fills it). Rank 0 (``RANK``) prints one line naming the
engine picked and why. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like
``deepspeed.initialize`` (MalleusEngine's dataloader is None: it reads its own samples).
"""
from __future__ import annotations

import os

#: keywords that only the data-parallel path (a torch.nn.Module) takes
_DP_ONLY = ("optimizer", "model_parameters", "training_data", "lr_scheduler", "collate_fn",
            "loss", "dist_init_required")


def initialize(model=None, config=None, plan=None, *, data=None, args=None, optimizer=None,
               model_parameters=None, training_data=None, lr_scheduler=None, collate_fn=None,
               config_params=None, dist_init_required=None, loss=None):
    """Build the engine ``model`` calls for (module doc) and return ``(engine, optimizer,
    training_dataloader, lr_scheduler)``.

    ``config``: the ds_config (a dict or a JSON path; ``config_params`` is another name for it,
    as in ``deepspeed.initialize``). A ``torch.nn.Module`` goes to
    :func:`malleus_ds.dp.engine.initialize` with the DeepSpeed arguments and ``loss``
    (``"mean"``, the default, ``"sum"`` or ``"global"``); a ``ModelConfig`` / ``HFModel`` /
    ``StageModule`` / stage builder to :func:`malleus_ds.engine.initialize` with ``plan``
    (overrides ``malleus.plan``), ``data`` (default: the byte corpus) and ``args``, the
    adaptive loop attached."""
    if config is not None and config_params is not None:
        raise ValueError("a ds_config in both config= and config_params= (two names for one "
                         "thing): pass one")
    if config is None:
        config = config_params
    from_args = config is None and getattr(args, "deepspeed_config", None) is not None
    cfg = _checked_config(args.deepspeed_config if from_args else config)
    kind, why = _engine_for(model)
    given = {k: v for k, v in (("optimizer", optimizer), ("model_parameters", model_parameters),
                               ("training_data", training_data), ("lr_scheduler", lr_scheduler),
                               ("collate_fn", collate_fn), ("loss", loss),
                               ("dist_init_required", dist_init_required)) if v is not None}
    if kind == "dp":
        _refuse_malleus_engine_arguments(plan, data)
        return dp_engine(model, cfg, why, args=args, from_args=from_args, **given)
    if given:
        raise ValueError(f"{', '.join(f'{k}=' for k in given)} given with {why}: "
                         f"{'it is' if len(given) == 1 else 'they are'} for a torch.nn.Module "
                         f"(data parallel, as deepspeed.initialize takes them); MalleusEngine "
                         f"builds its own optimizer and scheduler from the ds_config and reads "
                         f"its samples from data= (an object with .batch(ids), or a factory)")
    return _malleus_engine(model, {} if from_args else cfg, plan, data, args, why)


def _engine_for(model) -> tuple[str, str]:
    """("dp" | "malleus", what ``model`` is, for the message), or ValueError naming it."""
    import torch

    from ..engine.model_input import is_model
    from ..models.base import StageModule

    if isinstance(model, StageModule):
        return "malleus", "a StageModule"
    if isinstance(model, torch.nn.Module):
        from deepspeed.pipe import PipelineModule

        if isinstance(model, PipelineModule):
            raise ValueError("model is a DeepSpeed PipelineModule: malleus_ds.initialize takes a "
                             "plain torch.nn.Module (data parallel, ZeRO-0/1/2/3) or a ModelConfig "
                             "/ HFModel / StageModule (pipelines and TP by plan); pass the "
                             "layers' model as one of those, or use deepspeed.initialize for "
                             "DeepSpeed's own pipeline")
        return "dp", "a torch.nn.Module"
    if is_model(model):
        return "malleus", f"a {type(model).__name__}"
    if callable(model) and is_model(getattr(model, "cfg", None)):
        return "malleus", "a stage builder"
    raise ValueError(f"model={_show(model)}: malleus_ds.initialize takes a torch.nn.Module (data "
                     f"parallel under DeepSpeed's ZeRO, MalleusDPEngine), or a ModelConfig, "
                     f"HFModel, StageModule or stage builder (pipelines and TP by plan, "
                     f"MalleusEngine)")


def _show(model) -> str:
    return "None" if model is None else f"a {type(model).__name__}"


def _refuse_malleus_engine_arguments(plan, data) -> None:
    if plan is not None:
        raise ValueError("plan= given with a torch.nn.Module: a plan lays out MalleusEngine's "
                         "pipelines and TP (a ModelConfig, HFModel or StageModule); a "
                         "torch.nn.Module trains data parallel: drop plan=, or pass the model "
                         "as a ModelConfig / HFModel")
    if data is not None:
        raise ValueError("data= given with a torch.nn.Module: data= is MalleusEngine's sample "
                         "source; for a torch.nn.Module pass training_data= (a map-style "
                         "dataset), as to deepspeed.initialize")


def _checked_config(config) -> dict:
    """The ds_config as a dict (a copy), refused where a value is ``"auto"``."""
    from ..interop.auto import auto_paths
    from ..interop.sections import load_config

    cfg = load_config(config)
    auto = auto_paths(cfg)
    if auto:
        raise ValueError(f"ds_config {', '.join(auto)}=\"auto\": malleus_ds.initialize "
                         f"takes the values themselves (\"auto\" is filled by the Hugging "
                         f"Face Trainer or accelerate from their arguments, and by "
                         f"launch/train.py from train.*); set them")
    return cfg


def _zero_stage(cfg: dict) -> object:
    return (cfg.get("zero_optimization") or {}).get("stage", 0)


def dp_engine(model, cfg: dict, why: str, *, args=None, from_args: bool = False, **given):
    """``malleus_ds.dp.initialize`` with the re-split loop attached (``app/dp_loop.py``) unless
    ``malleus.adaptive`` is false: ``malleus_ds.initialize``'s data-parallel path, and the engine
    that ``malleus_ds.hf.MalleusTrainer`` has accelerate build. ``cfg``: the ds_config (a dict,
    its ``"auto"`` values filled); its ``malleus`` section is checked before any process group.
    ``why``: what ``model`` is, for rank 0's line naming the engine. ``from_args``: the
    ds_config is ``args.deepspeed_config`` (``cfg`` is then only read for the section).
    ``given``: ``dp.initialize``'s other arguments (``loss`` defaults to ``"mean"``). Returns
    ``dp.initialize``'s four values."""
    from ..dp.settings import DPSettings
    from .dp_loop import attach_dp_loop

    settings = DPSettings.from_config(cfg.get("malleus"))
    how = ("each step's batch is split by measured speed" if settings.adaptive else
           "the split stays equal (ds_config.malleus.adaptive is false)")
    _say(f"MalleusDPEngine ({why}: data parallel under DeepSpeed's ZeRO-{_zero_stage(cfg)}; "
         f"{how})")
    from ..dp.engine import initialize as dp_initialize

    given.setdefault("loss", "mean")
    out = dp_initialize(args=args, model=model, config=None if from_args else cfg, **given)
    attach_dp_loop(out[0], settings)
    return out


def _malleus_engine(model, cfg: dict, plan, data, args, why: str):
    """``malleus_ds.engine.initialize`` with ``data`` defaulting to the byte corpus and the
    adaptive loop attached (its ``malleus.*`` settings are checked before the engine is built,
    so a bad one fails on every rank before any collective)."""
    from ..adaptive.settings import AdaptiveSettings
    from ..data import ByteCorpus
    from ..engine import initialize as engine_initialize
    from ..interop.ds_config import decode
    from .loop import attach_loop

    notes = _notes(cfg)
    sec = cfg.get("malleus")
    settings = AdaptiveSettings.from_config(sec if isinstance(sec, dict) else {})
    ds = decode(cfg, notes)             # the ds_config, decoded once; the engine takes it
    _say(f"MalleusEngine ({why}: pipelines and TP by plan, re-planned and migrated)")
    out = engine_initialize(model, ds, plan, data=ByteCorpus if data is None else data,
                            args=args)
    attach_loop(out[0], settings)
    return out


def _say(engine: str) -> None:
    """Rank 0's one line naming the engine picked."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[malleus_ds] engine: {engine}", flush=True)


def _notes(cfg: dict) -> list[str]:
    """What MalleusEngine does with the ds_config's keys (``interop/config_keys.py``): a config it
    cannot honour fails here, on every rank, before any collective; rank 0 (``RANK``) prints a
    line per key it ignores. Returns the notes."""
    from ..interop.config_keys import review

    notes = review(cfg)
    if os.environ.get("RANK", "0") == "0":
        for n in notes:
            print(f"[malleus_ds] note: {n}", flush=True)
    return notes
