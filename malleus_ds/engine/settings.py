"""The engine's view of the ``"malleus"`` section of a ds_config (``interop/malleus_section.py``),
and the config the base engine gets; the stock sections MalleusEngine reads itself are decoded
in ``interop/sections.py``.

Pure parsing (no process groups): every rank raises the same error for a bad config before any
collective, so bad input never hangs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..interop.malleus_section import (ADAPTIVE_KEYS, KEY, MIGRATE_BUCKET_MB, positive,
                                       section_keys)
from ..plan import Plan
from .precision import Precision

# ------------------------------------------------------------------ the whole malleus section


@dataclass(frozen=True)
class SwitchAt:
    """A scripted plan switch: before training step ``step``, migrate to ``plan``."""

    step: int
    plan: Plan
    where: str                        # "ds_config.malleus.switch[i]", for error messages


@dataclass(frozen=True)
class MalleusSettings:
    """The engine's keys of the ``"malleus"`` section of the ds_config; a field's default is the
    key's (``interop/malleus_section.py``)."""

    plan: Plan | None = None          # a plan object, a path to a plan JSON, or the JSON inline
    tp: int | None = None             # nominal TP degree; stage TP sizes must divide it (default: lcm in plan)
    gpus_per_node: int | None = None  # ranks per node; None: the engine sets the world (one node)
    seed: int = 0                     # model init and data order seed
    straggler: tuple = ()             # straggler schedule entries (emulation.RawSchedule: .method), off if empty
    #: from the stock "fp16" / "bf16" sections (build_settings), not a key of this section
    precision: Precision = field(default=Precision(), metadata={KEY: None})
    switch: tuple[SwitchAt, ...] = ()   # scripted plan switches, by step (runner: malleus.switch)
    #: packed bytes in flight per rank during a migration (MB)
    migrate_bucket_mb: float = MIGRATE_BUCKET_MB
    migrate_timeout_s: float = 300.0    # a migration transfer not done by then fails the job (s)
    #: recompute each decoder layer in backward (build_settings: the ds_config turns it on,
    #: ``interop.sections.activation_checkpointing_source``), not a key of this section
    recompute: bool = field(default=False, metadata={KEY: None})

    @staticmethod
    def from_config(sec: Mapping[str, Any] | None,
                    where: str = "ds_config.malleus") -> "MalleusSettings":
        """Parse and check ``sec``; errors name ``<where>.<key>`` and the value. The loop's keys
        (``ADAPTIVE_KEYS``, from its ``AdaptiveSettings`` in ``interop/malleus_section.py``) are
        accepted and left to the loop the app attaches, which parses them."""
        sec = dict(sec or {})
        known = {*section_keys(MalleusSettings), *ADAPTIVE_KEYS}
        unknown = sorted(set(sec) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
        d = MalleusSettings
        return MalleusSettings(plan=as_plan(sec.get("plan")), tp=sec.get("tp"),
                               gpus_per_node=sec.get("gpus_per_node"),
                               seed=int(sec.get("seed", d.seed)),
                               straggler=parse_straggler(sec.get("straggler"),
                                                         f"{where}.straggler"),
                               switch=parse_switch(sec.get("switch"), f"{where}.switch"),
                               migrate_bucket_mb=positive(sec, "migrate_bucket_mb",
                                                          d.migrate_bucket_mb, where),
                               migrate_timeout_s=positive(sec, "migrate_timeout_s",
                                                          d.migrate_timeout_s, where))


def parse_straggler(strag, where: str = "ds_config.malleus.straggler") -> tuple:
    """``straggler``: a list of schedule entries, or ``{schedule: [...], method: sleep|quota}``
    -> the entries with their method (``emulation.RawSchedule``; the entries themselves are
    checked when the engine builds its ``StragglerSchedule``)."""
    from ..emulation.straggler import RawSchedule, StragglerError, parse_method

    method = None
    if isinstance(strag, Mapping):
        unknown = sorted(set(strag) - {"schedule", "method"})
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; "
                             f"allowed: ['schedule', 'method']")
        method, strag = strag.get("method"), strag.get("schedule")
    try:
        method = parse_method(method, f"{where}.method")
    except StragglerError as e:
        raise ValueError(str(e)) from None
    return RawSchedule(tuple(strag or ()), method)


def parse_switch(entries, where: str = "ds_config.malleus.switch") -> tuple[SwitchAt, ...]:
    """``[{"step": K, "plan": PATH | {plan JSON}}, ...]`` with steps >= 1 in increasing order;
    every plan file is read and parsed here (validated against the job by the engine at start-up).
    Errors name the entry."""
    from ..plan import PlanError

    if entries is None or entries == []:
        return ()
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise ValueError(f"{where} must be a list of {{step, plan}} entries, "
                         f"got {entries!r}")
    out: list[SwitchAt] = []
    for i, e in enumerate(entries):
        entry = f"{where}[{i}]"
        if not isinstance(e, Mapping) or set(e) != {"step", "plan"}:
            raise ValueError(f"{entry}: expected {{step: K, plan: PATH}}, got {e!r}")
        step = e["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{entry}.step={step!r} must be an integer >= 1 (the switch happens "
                             f"before that training step)")
        if out and step <= out[-1].step:
            raise ValueError(f"{entry}.step={step} is not after the previous entry's step "
                             f"{out[-1].step}; list switches in increasing step order")
        try:
            plan = as_plan(e["plan"])
        except (PlanError, OSError) as err:
            raise ValueError(f"{entry}.plan: {err}") from None
        if plan is None:
            raise ValueError(f"{entry}.plan is missing")
        out.append(SwitchAt(step, plan, entry))
    return tuple(out)


def as_plan(p) -> Plan | None:
    if p is None or isinstance(p, Plan):
        return p
    if isinstance(p, Mapping):
        return Plan.from_json(p)
    return Plan.load(p)


def base_ds_config(user_cfg: dict, plan: Plan, loc) -> dict:
    """The config the base engine gets: batch sizes of this rank's pipeline (DP world = 1), and
    no optimizer / ZeRO / precision section (this subclass builds those; see the module
    docstring)."""
    from ..interop.compat import BATCH_KEYS, batch_keys

    base = {k: v for k, v in user_cfg.items()
            if k not in ("malleus", "optimizer", "zero_optimization", *BATCH_KEYS,
                         "fp16", "bf16", "bfloat16", "data_types",
                         # ignored (interop/config_keys.py): the base engine would start them
                         "flops_profiler", "comms_logger", "autotuning")}
    m = plan.pipelines[loc[0]].micro_batches if loc else 1
    base.update(batch_keys(plan.micro_batch_size, m, replicas=1))
    return base
