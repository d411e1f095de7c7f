"""The stock ds_config sections MalleusEngine reads itself, each decoded by one pure function:
the file (:func:`load_config`), ``zero_optimization.stage`` (:func:`check_zero_stage`),
``optimizer`` (:func:`optimizer_settings`), ``scheduler`` (:func:`check_scheduler`),
``activation_checkpointing`` (:func:`activation_checkpointing_source`) and ``tensor_parallel``
(:func:`check_unsupported`).

Pure parsing (no process groups): every rank raises the same error for a bad config before any
collective, so bad input never hangs.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping


def load_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    from ..files.safe_load import read_json

    path = Path(config)
    if not path.is_file():
        raise ValueError(f"ds_config: file not found: {path}")
    d = read_json(path, "ds_config")
    if not isinstance(d, dict):
        raise ValueError(f"ds_config {path} must hold a JSON object, got {type(d).__name__}")
    return d


#: ZeRO stages MalleusEngine runs: 0, or optimizer states (1) and gradients (2) sharded across
#: each layer's replicas. ZeRO-3 would shard the parameters themselves.
ZERO_STAGES = (0, 1, 2)


def check_zero_stage(stage) -> int:
    """The one rule for the ZeRO stage under MalleusEngine (engine, optimizer and the app's
    start-up check use it): ``stage`` as an int, or ValueError naming the field."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO_STAGES:
        raise ValueError(f"ds_config.zero_optimization.stage={stage!r}: MalleusEngine supports "
                         f"0, 1 and 2 (sharding across each layer's replicas), not ZeRO-3; use "
                         f"one of those (e.g. deepspeed=zero1), or, for ZeRO-3, give "
                         f"malleus_ds.initialize your own torch.nn.Module (MalleusDPEngine: "
                         f"DeepSpeed's ZeRO-3, each step's batch split by measured speed)")
    return stage


def optimizer_settings(user_cfg: dict):
    """(zero stage, optimizer factory) from the stock ``optimizer`` / ``zero_optimization`` fields."""
    from ..optim import OptimConfig, make_optimizer

    zero = check_zero_stage((user_cfg.get("zero_optimization") or {}).get("stage", 0))
    sec = user_cfg.get("optimizer") or {}
    typ = str(sec.get("type", "AdamW"))
    params = dict(sec.get("params") or {})
    if typ.lower() not in ("adam", "adamw"):
        raise ValueError(f"ds_config.optimizer.type={typ!r}: MalleusEngine supports Adam/AdamW "
                         f"(torch.optim.AdamW, decoupled weight decay)")
    mode = params.pop("adam_w_mode", True)
    if not isinstance(mode, bool):
        raise ValueError(f"ds_config.optimizer.params.adam_w_mode={mode!r} must be true or false")
    # DeepSpeed's _configure_basic_optimizer: type "AdamW" is AdamW whatever adam_w_mode says;
    # only type "Adam" with adam_w_mode=false is Adam with an L2 term
    mode = mode or typ.lower() == "adamw"
    # we always run torch's Adam/AdamW. DeepSpeed's own (FusedAdam, DeepSpeedCPUAdam) default
    # weight_decay to 0, as OptimConfig does; with torch_adam DeepSpeed passes the params to
    # torch.optim.AdamW, whose default is 0.01 (torch.optim.Adam's is 0)
    if params.pop("torch_adam", False) and mode:
        params.setdefault("weight_decay", 0.01)
    if "max_grad_norm" in params:           # DeepSpeed refuses it too (_configure_basic_optimizer)
        raise ValueError(f"ds_config.optimizer.params.max_grad_norm={params['max_grad_norm']!r} "
                         f"is refused, as DeepSpeed refuses it: set the clip with the top-level "
                         f"\"gradient_clipping\": {params['max_grad_norm']!r} instead")
    for k in ("lr", "eps", "weight_decay"):
        if k in params and (isinstance(params[k], bool)
                            or not isinstance(params[k], (int, float))):
            raise ValueError(f"ds_config.optimizer.params.{k}={params[k]!r} must be a number"
                             + (" (\"auto\" is filled by launch/train.py from train.*, or by "
                                "the Hugging Face Trainer)" if params[k] == "auto" else ""))
    fused = params.pop("fused", False)
    if not isinstance(fused, bool):
        raise ValueError(f"ds_config.optimizer.params.fused={fused!r} must be true or false")
    unknown = set(params) - {"lr", "betas", "eps", "weight_decay"}
    if unknown:
        raise ValueError(f"ds_config.optimizer.params: unsupported keys {sorted(unknown)}")
    oc = OptimConfig(**{k: (tuple(v) if k == "betas" else v) for k, v in params.items()},
                     decoupled=mode)
    return zero, lambda ps: make_optimizer(ps, oc, fused=fused)


def check_scheduler(user_cfg: Mapping[str, Any]) -> None:
    """The ``scheduler`` section, built as DeepSpeed builds it (``_scheduler_from_config``: a
    class of ``deepspeed.runtime.lr_schedules`` or ``torch.optim.lr_scheduler``, with its
    ``params``) over a throwaway optimizer: a bad type or params raise ValueError naming the
    section, here, before any process group, rather than in the engine on every rank."""
    sec = user_cfg.get("scheduler")
    if sec is None:
        return
    if not isinstance(sec, Mapping) or not isinstance(sec.get("type"), str):
        raise ValueError(f"ds_config.scheduler={sec!r} must be an object with a \"type\" "
                         f"(WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or "
                         f"a torch.optim.lr_scheduler class) and its \"params\"")
    import torch
    from deepspeed.runtime import lr_schedules

    typ, params = sec["type"], sec.get("params") or {}
    cls = getattr(lr_schedules, typ, None) or getattr(torch.optim.lr_scheduler, typ, None)
    if cls is None or not isinstance(cls, type):
        raise ValueError(f"ds_config.scheduler.type={typ!r} is not a DeepSpeed scheduler "
                         f"({', '.join(lr_schedules.VALID_LR_SCHEDULES)}) nor a "
                         f"torch.optim.lr_scheduler class")
    if not isinstance(params, Mapping):
        raise ValueError(f"ds_config.scheduler.params={params!r} must be an object")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    try:
        cls(opt, **params)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise ValueError(f"ds_config.scheduler ({typ}) params {dict(params)!r}: {e}") from None


#: DeepSpeed's ``activation_checkpointing`` keys
#: (``deepspeed/runtime/activation_checkpointing/config.py``). Every engine here keeps each
#: decoder layer's input whole on the device and recomputes the layer from it, which is what
#: the planner's memory model counts (``cost.stage_memory_terms``). The key that would move the
#: kept inputs off the device is refused (the memory model would not hold); the ones that only
#: tune where on the device they sit, or are diagnostics, are ignored with a note
#: (``config_keys.review``): the math is the same.
_ACT_REFUSED = {
    "cpu_checkpointing": "it moves the kept inputs to host memory",
}
#: ... and what is done instead of each ignored one
ACT_IGNORED = {
    "partition_activations": "each decoder layer's input is kept whole on its rank, not split "
                             "across the TP group (the planner's memory model counts that)",
    "contiguous_memory_optimization": "the kept inputs stay where autograd put them",
    "synchronize_checkpoint_boundary": "a diagnostic of DeepSpeed's checkpoint function, "
                                       "which no engine here configures",
    "profile": "a diagnostic of DeepSpeed's checkpoint function, which no engine here "
               "configures",
}
_ACT_KEYS = (*_ACT_REFUSED, *ACT_IGNORED, "number_checkpoints")


def activation_checkpointing_source(user_cfg: Mapping[str, Any]) -> str | None:
    """What in the ds_config turns activation checkpointing on (``"activation_checkpointing
    section"`` or ``"pipeline.activation_checkpoint_interval=1"``), or None when nothing does
    (pure: the same answer and the same error on every rank).

    DeepSpeed has no ``enabled`` flag: a model calls ``deepspeed.checkpointing.checkpoint`` and
    the ``activation_checkpointing`` section configures it, so a ds_config that has the section
    asks for checkpointing. ``pipeline.activation_checkpoint_interval`` >= 1 makes
    ``PipelineEngine`` checkpoint by itself. Both count as on here, for every engine. Refused
    (ValueError naming the key): ``cpu_checkpointing`` (it moves the kept layer inputs off the
    device, :data:`_ACT_REFUSED`), unknown keys, and an interval other than 1 (a chunk of several
    layers recomputed at once keeps fewer inputs but more activations at a time than the memory
    model counts). The keys that only tune where the kept inputs sit, or are diagnostics
    (:data:`ACT_IGNORED`), are accepted and ignored with a note (``config_keys.review``).
    ``number_checkpoints`` only sizes DeepSpeed's contiguous buffers: any positive integer is
    accepted; every decoder layer is a checkpoint."""
    out = None
    pipe = user_cfg.get("pipeline")
    iv = pipe.get("activation_checkpoint_interval") if isinstance(pipe, Mapping) else None
    if iv is not None:
        if isinstance(iv, bool) or not isinstance(iv, int) or iv not in (0, 1):
            raise ValueError(f"ds_config.pipeline.activation_checkpoint_interval={iv!r}: only 0 "
                             f"(off) or 1 (every decoder layer recomputed from its own input) "
                             f"are supported; the memory model counts one layer's "
                             f"activations at a time")
        if iv == 1:
            out = "pipeline.activation_checkpoint_interval=1"
    if "activation_checkpointing" not in user_cfg:
        return out
    sec = user_cfg["activation_checkpointing"]
    if sec is None:
        return out
    if not isinstance(sec, Mapping):
        raise ValueError(f"ds_config.activation_checkpointing must be an object (DeepSpeed's "
                         f"section, e.g. {{}}), got {sec!r}")
    unknown = sorted(set(sec) - set(_ACT_KEYS))
    if unknown:
        raise ValueError(f"ds_config.activation_checkpointing: unknown keys {unknown}; "
                         f"DeepSpeed's are {sorted(_ACT_KEYS)}")
    for k in (*_ACT_REFUSED, *ACT_IGNORED):
        v = sec.get(k, False)
        if not isinstance(v, bool):
            raise ValueError(f"ds_config.activation_checkpointing.{k}={v!r} must be true or "
                             f"false")
    for k, why in _ACT_REFUSED.items():
        if sec.get(k, False):
            raise ValueError(f"ds_config.activation_checkpointing.{k}=true is not supported "
                             f"({why}); every engine keeps each decoder layer's input on the "
                             f"device and recomputes the layer from it; set it false or drop it")
    n = sec.get("number_checkpoints")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"ds_config.activation_checkpointing.number_checkpoints={n!r} must be "
                         f"an integer >= 1 or null")
    return "activation_checkpointing section"


def check_unsupported(user_cfg: dict) -> None:
    """Stock ds_config sections MalleusEngine cannot honour, refused by name (pure: the same
    error on every rank before any collective). ``tensor_parallel.autotp_size > 1`` would make
    DeepSpeed build its own TP mesh and replace our plan-aware ``mpu`` (the plan sets TP here:
    ``malleus.plan`` / ``malleus.tp``)."""
    tp = user_cfg.get("tensor_parallel")
    if isinstance(tp, dict):
        size = tp.get("autotp_size", tp.get("tp_size", 1))
        if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 1:
            key = "autotp_size" if "autotp_size" in tp else "tp_size"
            raise ValueError(f"ds_config.tensor_parallel.{key}={size}: MalleusEngine sets tensor "
                             f"parallelism from its plan (each stage's TP group; "
                             f"malleus.plan / malleus.tp); drop the tensor_parallel section")
