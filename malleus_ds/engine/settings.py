"""The ``"malleus"`` section of a ds_config and the stock sections MalleusEngine reads itself.

Pure parsing (no process groups): every rank raises the same error for a bad config before any
collective, so bad input never hangs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..plan import Plan
from ..adaptive.pace_check import CheckConfig
from ..adaptive.detect import DetectConfig
from .precision import Precision

# ------------------------------------------------------------------ the adaptive loop's keys

ADAPTIVE_KEYS = ("adaptive", "detect", "check", "horizon_steps", "replan_at", "planner_time_limit_s",
                 "min_improvement", "migrate_gbps", "tp_slowdown", "device_mb")


_INT_DETECT = ("every", "window", "confirm", "cooldown", "probe_every")


def number(sec: Mapping[str, Any], key: str, default, ok, need: str, optional: bool = False):
    """``sec[key]`` (``default`` if absent) as a float that satisfies ``ok``, or None when
    ``optional`` and null; else ValueError ``ds_config.malleus.<key>=<value> must be <need>``."""
    v = sec.get(key, default)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
        raise ValueError(f"ds_config.malleus.{key}={v!r} must be {need}")
    return float(v)


@dataclass(frozen=True)
class AdaptiveSettings:
    """The adaptive keys of the ``malleus`` section (``malleus.*`` in the app)."""

    enabled: bool = True                 # malleus.adaptive: detect, re-plan and migrate by itself
    detect: DetectConfig = field(default_factory=DetectConfig)
    horizon_steps: int = 100             # a switch must pay for its migration within this many steps
    replan_at: tuple[int, ...] = ()      # forced re-plans before these steps (tests, demos)
    planner_time_limit_s: float | None = None   # None: the planner's automatic budget
    min_improvement: float = 0.05        # the planner keeps the running plan unless this much faster
    migrate_gbps: float = 1.0            # bandwidth assumed before the first migration is measured
    tp_slowdown: Mapping[int, float] | str = "measure"   # tp/g -> slowdown, "measure" or "ideal"
    device_mb: float | None = None       # memory per device for the planner; None: detected
    check: CheckConfig = field(default_factory=CheckConfig)   # the plan's promise vs its steps

    @staticmethod
    def from_config(sec: Mapping[str, Any]) -> "AdaptiveSettings":
        """Parse and check; ValueError naming ``ds_config.malleus.<key>`` and the value."""
        p = "ds_config.malleus"
        en = sec.get("adaptive", True)
        if not isinstance(en, bool):
            raise ValueError(f"{p}.adaptive={en!r} must be true or false")
        det = sec.get("detect") or {}
        if not isinstance(det, Mapping):
            raise ValueError(f"{p}.detect must be a mapping of {list(DetectConfig.__dataclass_fields__)}, "
                             f"got {det!r}")
        known = set(DetectConfig.__dataclass_fields__)
        unknown = sorted(set(det) - known)
        if unknown:
            raise ValueError(f"{p}.detect: unknown keys {unknown}; allowed: {sorted(known)}")
        for k, v in det.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"malleus.detect.{k}={v!r} must be a number")
            if k in _INT_DETECT and int(v) != v:
                raise ValueError(f"malleus.detect.{k}={v!r} must be an integer")
        dc = DetectConfig(**{k: (int(v) if k in _INT_DETECT else float(v)) for k, v in det.items()})
        dc.check()
        hz = sec.get("horizon_steps", 100)
        if isinstance(hz, bool) or not isinstance(hz, int) or hz < 1:
            raise ValueError(f"{p}.horizon_steps={hz!r} must be an integer >= 1 (steps over "
                             f"which a re-plan's gain must repay its migration)")
        ra = sec.get("replan_at") or ()
        if isinstance(ra, (str, bytes)) or not isinstance(ra, (list, tuple)):
            raise ValueError(f"{p}.replan_at must be a list of step numbers, got {ra!r}")
        for i, s in enumerate(ra):
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(f"{p}.replan_at[{i}]={s!r} must be an integer >= 1 (the re-plan "
                                 f"happens before that training step)")
            if i and s <= ra[i - 1]:
                raise ValueError(f"{p}.replan_at[{i}]={s} is not after replan_at[{i - 1}]="
                                 f"{ra[i - 1]}; list steps in increasing order")
        tl = number(sec, "planner_time_limit_s", None, lambda v: v > 0,
                    "a number > 0 (or null: auto)", optional=True)
        mi = number(sec, "min_improvement", 0.05, lambda v: 0 <= v < 1, "a number in [0, 1)")
        bw = number(sec, "migrate_gbps", 1.0, lambda v: v > 0, "a number > 0 (GB/s)")
        sd = sec.get("tp_slowdown", "measure")
        if sd is None:
            sd = "measure"
        if isinstance(sd, str):
            if sd not in ("measure", "ideal"):
                raise ValueError(f"{p}.tp_slowdown={sd!r} must be \"measure\" (time the layer's "
                                 f"TP shards at start-up), \"ideal\" (tp/g) or a map tp/g -> "
                                 f"slowdown")
        else:
            if not isinstance(sd, Mapping):
                raise ValueError(f"{p}.tp_slowdown must map tp/g to a slowdown, got {sd!r}")
            try:
                sd = {int(k): float(v) for k, v in sd.items()}
            except (TypeError, ValueError):
                raise ValueError(f"{p}.tp_slowdown={dict(sd)!r}: keys are integers tp/g, values "
                                 f"numbers") from None
        dm = number(sec, "device_mb", None, lambda v: v > 0, "a number > 0 (or null: detected)",
                    optional=True)
        return AdaptiveSettings(en, dc, hz, tuple(ra), tl, mi, bw, sd, dm,
                                _check_config(sec.get("check")))


_INT_CHECK = ("patience", "kept_after", "backoff", "severe_patience")


def _check_config(sec) -> CheckConfig:
    """``malleus.check``: a mapping of :class:`~malleus_ds.adaptive.pace_check.CheckConfig` fields."""
    known = sorted(CheckConfig.__dataclass_fields__)
    if sec is None:
        return CheckConfig()
    if not isinstance(sec, Mapping):
        raise ValueError(f"ds_config.malleus.check must be a mapping of {known}, got {sec!r}")
    unknown = sorted(set(sec) - set(known))
    if unknown:
        raise ValueError(f"ds_config.malleus.check: unknown keys {unknown}; allowed: {known}")
    out = {}
    for k, v in sec.items():
        if k == "enabled":
            if not isinstance(v, bool):
                raise ValueError(f"malleus.check.enabled={v!r} must be true or false")
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"malleus.check.{k}={v!r} must be a number")
        elif k in _INT_CHECK and int(v) != v:
            raise ValueError(f"malleus.check.{k}={v!r} must be an integer")
        out[k] = v if k == "enabled" else (int(v) if k in _INT_CHECK else float(v))
    cc = CheckConfig(**out)
    cc.check()
    return cc


# ------------------------------------------------------------------ the whole malleus section


@dataclass(frozen=True)
class SwitchAt:
    """A scripted plan switch: before training step ``step``, migrate to ``plan``."""

    step: int
    plan: Plan
    where: str                        # "ds_config.malleus.switch[i]", for error messages


@dataclass(frozen=True)
class MalleusSettings:
    """The ``"malleus"`` section of the ds_config."""

    plan: Plan | None = None          # a plan object, a path to a plan JSON, or the JSON inline
    tp: int | None = None             # nominal TP degree; stage TP sizes must divide it (default: lcm in plan)
    gpus_per_node: int | None = None  # ranks per node; None: the engine sets the world (one node)
    seed: int = 0                     # model init and data order seed
    straggler: tuple = ()             # straggler schedule entries (emulation.RawSchedule: .method), off if empty
    precision: Precision = Precision()  # from the stock "fp16" / "bf16" sections (build_settings)
    switch: tuple[SwitchAt, ...] = ()   # scripted plan switches, by step (runner: malleus.switch)
    migrate_bucket_mb: float = 256.0    # packed bytes in flight per rank during a migration (MB)
    migrate_timeout_s: float = 300.0    # a migration transfer not done by then fails the job (s)
    adaptive: AdaptiveSettings = AdaptiveSettings()   # the adaptive loop (control.py)
    #: recompute each decoder layer in backward (build_settings: the ds_config turns it on,
    #: :func:`activation_checkpointing_source`)
    recompute: bool = False

    @staticmethod
    def from_config(sec: Mapping[str, Any] | None) -> "MalleusSettings":
        sec = dict(sec or {})
        known = {"plan", "tp", "gpus_per_node", "seed", "straggler", "switch",
                 "migrate_bucket_mb", "migrate_timeout_s", *ADAPTIVE_KEYS}
        unknown = sorted(set(sec) - known)
        if unknown:
            raise ValueError(f"ds_config.malleus: unknown keys {unknown}; allowed: {sorted(known)}")
        return MalleusSettings(plan=as_plan(sec.get("plan")), tp=sec.get("tp"),
                               gpus_per_node=sec.get("gpus_per_node"), seed=int(sec.get("seed", 0)),
                               straggler=parse_straggler(sec.get("straggler")),
                               switch=parse_switch(sec.get("switch")),
                               migrate_bucket_mb=_positive(sec, "migrate_bucket_mb", 256.0),
                               migrate_timeout_s=_positive(sec, "migrate_timeout_s", 300.0),
                               adaptive=AdaptiveSettings.from_config(sec))


def parse_straggler(strag) -> tuple:
    """``straggler``: a list of schedule entries, or ``{schedule: [...], method: sleep|quota}``
    -> the entries with their method (``emulation.RawSchedule``; the entries themselves are
    checked when the engine builds its ``StragglerSchedule``)."""
    from ..emulation.straggler import RawSchedule, StragglerError, parse_method

    method = None
    if isinstance(strag, Mapping):
        unknown = sorted(set(strag) - {"schedule", "method"})
        if unknown:
            raise ValueError(f"ds_config.malleus.straggler has unknown keys {unknown}; "
                             f"allowed: ['schedule', 'method']")
        method, strag = strag.get("method"), strag.get("schedule")
    try:
        method = parse_method(method, "ds_config.malleus.straggler.method")
    except StragglerError as e:
        raise ValueError(str(e)) from None
    return RawSchedule(tuple(strag or ()), method)


def _positive(sec: Mapping[str, Any], key: str, default: float) -> float:
    return number(sec, key, default, lambda v: v > 0, "a number > 0")


def parse_switch(entries) -> tuple[SwitchAt, ...]:
    """``[{"step": K, "plan": PATH | {plan JSON}}, ...]`` with steps >= 1 in increasing order;
    every plan file is read and parsed here (validated against the job by the engine at start-up).
    Errors name the entry."""
    from ..plan import PlanError

    if entries is None or entries == []:
        return ()
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise ValueError(f"ds_config.malleus.switch must be a list of {{step, plan}} entries, "
                         f"got {entries!r}")
    out: list[SwitchAt] = []
    for i, e in enumerate(entries):
        where = f"ds_config.malleus.switch[{i}]"
        if not isinstance(e, Mapping) or set(e) != {"step", "plan"}:
            raise ValueError(f"{where}: expected {{step: K, plan: PATH}}, got {e!r}")
        step = e["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{where}.step={step!r} must be an integer >= 1 (the switch happens "
                             f"before that training step)")
        if out and step <= out[-1].step:
            raise ValueError(f"{where}.step={step} is not after the previous entry's step "
                             f"{out[-1].step}; list switches in increasing step order")
        try:
            plan = as_plan(e["plan"])
        except (PlanError, OSError) as err:
            raise ValueError(f"{where}.plan: {err}") from None
        if plan is None:
            raise ValueError(f"{where}.plan is missing")
        out.append(SwitchAt(step, plan, where))
    return tuple(out)


def as_plan(p) -> Plan | None:
    if p is None or isinstance(p, Plan):
        return p
    if isinstance(p, Mapping):
        return Plan.from_json(p)
    return Plan.load(p)


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
                         f"one of those (e.g. deepspeed=zero1)")
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
    if params.pop("adam_w_mode", True) is False:
        raise ValueError("ds_config.optimizer.params.adam_w_mode=false is not supported (AdamW only)")
    params.pop("torch_adam", None)          # we always run torch's AdamW
    fused = params.pop("fused", False)
    if not isinstance(fused, bool):
        raise ValueError(f"ds_config.optimizer.params.fused={fused!r} must be true or false")
    unknown = set(params) - {"lr", "betas", "eps", "weight_decay"}
    if unknown:
        raise ValueError(f"ds_config.optimizer.params: unsupported keys {sorted(unknown)}")
    oc = OptimConfig(**{k: (tuple(v) if k == "betas" else v) for k, v in params.items()})
    return zero, lambda ps: make_optimizer(ps, oc, fused=fused)


#: DeepSpeed's ``activation_checkpointing`` keys
#: (``deepspeed/runtime/activation_checkpointing/config.py``) and why each one that changes
#: where a checkpoint lives is refused: every engine here keeps each decoder layer's input whole
#: on the device and recomputes the layer from it, which is what the planner's memory model
#: counts (``cost.stage_memory_terms``).
_ACT_REFUSED = {
    "partition_activations": "it splits the kept inputs across model-parallel ranks",
    "cpu_checkpointing": "it moves the kept inputs to host memory",
    "contiguous_memory_optimization": "it copies the kept inputs into DeepSpeed's own buffers",
    "synchronize_checkpoint_boundary": "a diagnostic of DeepSpeed's configured checkpoint "
                                       "function, which no engine here configures",
    "profile": "a diagnostic of DeepSpeed's configured checkpoint function, which no engine "
               "here configures",
}
_ACT_KEYS = (*_ACT_REFUSED, "number_checkpoints")


def activation_checkpointing_source(user_cfg: Mapping[str, Any]) -> str | None:
    """What in the ds_config turns activation checkpointing on (``"activation_checkpointing
    section"`` or ``"pipeline.activation_checkpoint_interval=1"``), or None when nothing does
    (pure: the same answer and the same error on every rank).

    DeepSpeed has no ``enabled`` flag: a model calls ``deepspeed.checkpointing.checkpoint`` and
    the ``activation_checkpointing`` section configures it, so a ds_config that has the section
    asks for checkpointing. ``pipeline.activation_checkpoint_interval`` >= 1 makes
    ``PipelineEngine`` checkpoint by itself. Both count as on here, for every engine. Refused
    (ValueError naming the key): section keys that move or split the kept layer inputs
    (:data:`_ACT_REFUSED`), unknown keys, and an interval other than 1 (a chunk of several
    layers recomputed at once keeps fewer inputs but more activations at a time than the memory
    model counts). ``number_checkpoints`` only sizes DeepSpeed's contiguous buffers: any
    positive integer is accepted; every decoder layer is a checkpoint."""
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
    for k, why in _ACT_REFUSED.items():
        v = sec.get(k, False)
        if not isinstance(v, bool):
            raise ValueError(f"ds_config.activation_checkpointing.{k}={v!r} must be true or "
                             f"false")
        if v:
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


def base_ds_config(user_cfg: dict, plan: Plan, loc) -> dict:
    """The config the base engine gets: batch sizes of this rank's pipeline (DP world = 1), and
    no optimizer / ZeRO / precision section (this subclass builds those; see the module
    docstring)."""
    from .ds_compat import BATCH_KEYS, batch_keys

    base = {k: v for k, v in user_cfg.items()
            if k not in ("malleus", "optimizer", "zero_optimization", *BATCH_KEYS,
                         "fp16", "bf16", "bfloat16", "data_types")}
    m = plan.pipelines[loc[0]].micro_batches if loc else 1
    base.update(batch_keys(plan.micro_batch_size, m, replicas=1))
    return base
