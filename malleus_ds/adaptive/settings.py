"""The adaptive loop's settings: the ``malleus.*`` keys of the loop (``adaptive``, ``detect``,
``check``, ``horizon_steps``, ...), parsed once into a frozen :class:`AdaptiveSettings`.

Pure parsing (no process groups): every rank raises the same error for a bad setting before any
collective, so bad input never hangs. The app parses them (``malleus_ds.initialize``, the
malleus runner) before it builds the engine, which passes these keys over
(``engine/settings.py``, ``LOOP_KEYS``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..interop.malleus_section import KEY, section_keys
from .detect import DetectConfig
from .pace_check import CheckConfig

_INT_DETECT = ("every", "window", "confirm", "cooldown", "probe_every")
_BOOL_DETECT = ("gpu_links",)


def number(sec: Mapping[str, Any], key: str, default, ok, need: str, optional: bool = False,
           where: str = "ds_config.malleus"):
    """``sec[key]`` (``default`` if absent) as a float that satisfies ``ok``, or None when
    ``optional`` and null; else ValueError ``<where>.<key>=<value> must be <need>``."""
    v = sec.get(key, default)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
        raise ValueError(f"{where}.{key}={v!r} must be {need}")
    return float(v)


@dataclass(frozen=True)
class AdaptiveSettings:
    """The adaptive keys of the ``malleus`` section (``malleus.*`` in the app); a field's default
    is the key's (``interop/malleus_section.py``)."""

    #: malleus.adaptive: detect, re-plan and migrate by itself
    enabled: bool = field(default=True, metadata={KEY: "adaptive"})
    #: ``malleus.detect.*``: when a measured rate shift re-plans
    detect: DetectConfig = field(default_factory=DetectConfig)
    check: CheckConfig = field(default_factory=CheckConfig)   # the plan's promise vs its steps
    horizon_steps: int = 100             # a switch must pay for its migration within this many steps
    replan_at: tuple[int, ...] = ()      # forced re-plans before these steps (tests, demos)
    planner_time_limit_s: float | None = None   # None: the planner's automatic budget
    min_improvement: float = 0.05        # the planner keeps the running plan unless this much faster
    migrate_gbps: float = 1.0            # bandwidth assumed before the first migration is measured
    tp_slowdown: Mapping[int, float] | str = "measure"   # tp/g -> slowdown, "measure" or "ideal"
    device_mb: float | None = None       # memory per device for the planner; None: detected

    @staticmethod
    def from_config(sec: Mapping[str, Any],
                    where: str = "ds_config.malleus") -> "AdaptiveSettings":
        """Parse and check; ValueError naming ``<where>.<key>`` and the value (``where``: the
        section as the user wrote it: ``ds_config.malleus`` for ``malleus_ds.initialize``,
        ``malleus`` for the app's config)."""
        p, D = where, AdaptiveSettings
        en = sec.get("adaptive", D.enabled)
        if not isinstance(en, bool):
            raise ValueError(f"{p}.adaptive={en!r} must be true or false")
        dc = _detect_config(sec.get("detect") or {}, p)
        hz = sec.get("horizon_steps", D.horizon_steps)
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
        tl = number(sec, "planner_time_limit_s", D.planner_time_limit_s, lambda v: v > 0,
                    "a number > 0 (or null: auto)", optional=True, where=p)
        mi = number(sec, "min_improvement", D.min_improvement, lambda v: 0 <= v < 1,
                    "a number in [0, 1)", where=p)
        bw = number(sec, "migrate_gbps", D.migrate_gbps, lambda v: v > 0, "a number > 0 (GB/s)",
                    where=p)
        sd = _tp_slowdown(sec.get("tp_slowdown", D.tp_slowdown), p)
        dm = number(sec, "device_mb", D.device_mb, lambda v: v > 0,
                    "a number > 0 (or null: detected)", optional=True, where=p)
        return AdaptiveSettings(enabled=en, detect=dc, check=_check_config(sec.get("check"), p),
                                horizon_steps=hz, replan_at=tuple(ra), planner_time_limit_s=tl,
                                min_improvement=mi, migrate_gbps=bw, tp_slowdown=sd,
                                device_mb=dm)


def _detect_config(det, p: str) -> DetectConfig:
    """``<p>.detect``: a mapping of :class:`~malleus_ds.adaptive.detect.DetectConfig` fields."""
    if not isinstance(det, Mapping):
        raise ValueError(f"{p}.detect must be a mapping of "
                         f"{list(DetectConfig.__dataclass_fields__)}, got {det!r}")
    known = set(DetectConfig.__dataclass_fields__)
    unknown = sorted(set(det) - known)
    if unknown:
        raise ValueError(f"{p}.detect: unknown keys {unknown}; allowed: {sorted(known)}")
    for k, v in det.items():
        if k in _BOOL_DETECT:
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{p}.detect.{k}={v!r} must be true, false or null")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{p}.detect.{k}={v!r} must be a number")
        if k in _INT_DETECT and int(v) != v:
            raise ValueError(f"{p}.detect.{k}={v!r} must be an integer")
    dc = DetectConfig(**{k: (v if k in _BOOL_DETECT else int(v) if k in _INT_DETECT
                             else float(v)) for k, v in det.items()})
    try:
        dc.check()
    except ValueError as e:
        raise ValueError(f"{p}.{e}") from None
    return dc


def _tp_slowdown(sd, p: str) -> Mapping[int, float] | str:
    """``<p>.tp_slowdown``: "measure", "ideal" or a map tp/g -> slowdown (null: the default)."""
    if sd is None:
        sd = AdaptiveSettings.tp_slowdown
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
    return sd


#: the loop's keys of the ``malleus`` section, from :class:`AdaptiveSettings`'s fields
ADAPTIVE_KEYS = section_keys(AdaptiveSettings)

_INT_CHECK = ("patience", "kept_after", "backoff", "severe_patience")


def _check_config(sec, where: str) -> CheckConfig:
    """``<where>.check``: a mapping of :class:`~malleus_ds.adaptive.pace_check.CheckConfig`
    fields."""
    p = f"{where}.check"
    known = sorted(CheckConfig.__dataclass_fields__)
    if sec is None:
        return CheckConfig()
    if not isinstance(sec, Mapping):
        raise ValueError(f"{p} must be a mapping of {known}, got {sec!r}")
    unknown = sorted(set(sec) - set(known))
    if unknown:
        raise ValueError(f"{p}: unknown keys {unknown}; allowed: {known}")
    out = {}
    for k, v in sec.items():
        if k == "enabled":
            if not isinstance(v, bool):
                raise ValueError(f"{p}.enabled={v!r} must be true or false")
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{p}.{k}={v!r} must be a number")
        elif k in _INT_CHECK and int(v) != v:
            raise ValueError(f"{p}.{k}={v!r} must be an integer")
        out[k] = v if k == "enabled" else (int(v) if k in _INT_CHECK else float(v))
    cc = CheckConfig(**out)
    try:
        cc.check()
    except ValueError as e:
        raise ValueError(f"{where}.{e}") from None
    return cc
