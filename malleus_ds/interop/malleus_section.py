"""The ``malleus`` section of a ds_config (``malleus.*`` in the app's config): its one typed
home, below the engine, the adaptive loop and the app. The section is read through three frozen
dataclasses, whose fields are its keys and defaults:

* the adaptive loop's, :class:`AdaptiveSettings` (``adaptive``, ``detect``: a
  :class:`DetectConfig`, ``check``: a :class:`CheckConfig`, ``horizon_steps``, ...), defined
  and parsed here (``adaptive/settings.py`` re-exports it for the loop);
* the engine's, ``engine/settings.MalleusSettings`` (the plan, the job's shape, the seed, the
  scripted switches, the migration limits; it also holds the precision, an engine type, so it
  lives there); it accepts the loop's keys (:data:`ADAPTIVE_KEYS`) and leaves them to the loop;
* the app's, ``app/run_config.MalleusConfig``: the switches and migration limits, and the loop's
  view as its ``loop`` field.

A view's key list is derived from its fields (:func:`section_keys`), in field order: a field
whose key differs from its name says so in its metadata (:data:`KEY`), and a field set from
elsewhere than the section (the precision, from the ``fp16`` / ``bf16`` sections) has key None.

Pure parsing (no process groups, no torch): every rank raises the same error for a bad setting
before any collective, so bad input never hangs. The app parses the loop's keys
(``malleus_ds.initialize``, the malleus runner) before it builds the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

#: the metadata entry naming a field's key in the section (None: not a key of the section)
KEY = "malleus_key"


def section_keys(cls) -> tuple[str, ...]:
    """The section's keys that dataclass ``cls`` reads, in field order (module doc)."""
    out = []
    for f in fields(cls):
        key = f.metadata.get(KEY, f.name)
        if key is not None:
            out.append(key)
    return tuple(out)


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


def positive(sec: Mapping[str, Any], key: str, default: float,
             where: str = "ds_config.malleus") -> float:
    """``sec[key]`` (``default`` if absent) as a float > 0; else ValueError naming
    ``<where>.<key>`` and the value (the engine's migration limits)."""
    return number(sec, key, default, lambda v: v > 0, "a number > 0", where=where)


#: ``malleus.migrate_bucket_mb``'s default: packed migration bytes in flight per rank (MB). The
#: engine's ``MalleusSettings`` reads the key; the loop's ``JobSpec`` and the replay, which plan
#: the migration's staging buffers without an engine, take the same default from here
MIGRATE_BUCKET_MB = 256.0


# ------------------------------------------------------------ malleus.detect.*, malleus.check.*

#: a smoothed measured rate below this counts as healthy (1.0): DESIGN.md §6; the default of
#: :attr:`DetectConfig.healthy`, and the threshold ``whatif.py`` and ``malleus-plot`` use
HEALTHY = 1.2


@dataclass(frozen=True)
class DetectConfig:
    """When a measured rate shift triggers re-planning (Malleus's defaults)."""

    every: int = 1          # run detection every N steps (cheap: numpy on rank 0)
    window: int = 5         # median over the last N per-step rates (smoothing)
    healthy: float = HEALTHY  # a smoothed rate below this counts as healthy (1.0)
    change: float = 0.3     # re-plan when |r - p| >= change * p for some rank (relative)...
    confirm: int = 2        # ...in this many consecutive detections (hysteresis)
    cooldown: int = 2       # detections skipped after a planning attempt
    probe_every: int = 2    # a rank without work times its probe every N steps
    #: a link's smoothed rate below this counts as healthy (``adaptive/link_watch.py``): the
    #: waits on a collective scatter far more from step to step than compute (a small
    #: all-reduce on a loaded host reads well over twice its median now and then on a healthy
    #: link)
    link_healthy: float = 2.0
    #: MB a link held slow is probed with (a round trip every ``probe_every`` steps, one held
    #: link at a time: ``engine/link_probe.py``); 0: not probed
    link_probe_mb: float = 0.1
    #: also read the links between the GPUs of a node (TP collectives, reductions inside a
    #: node: ``adaptive/link_watch.py``): true, false, or None (the default): where the job's
    #: nominal TP degree is above 1, whose collectives cross those links on every layer
    gpu_links: bool | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming ``malleus.detect.<field>=<value>`` for a bad field."""
        rules = (("every", self.every >= 1, ">= 1"), ("window", self.window >= 1, ">= 1"),
                 ("healthy", self.healthy >= 1.0, ">= 1.0 (1.0 = healthy)"),
                 ("change", self.change > 0, "> 0 (relative, e.g. 0.3 = 30%)"),
                 ("confirm", self.confirm >= 1, ">= 1"), ("cooldown", self.cooldown >= 0, ">= 0"),
                 ("probe_every", self.probe_every >= 1, ">= 1"),
                 ("link_healthy", self.link_healthy >= 1.0, ">= 1.0 (1.0 = healthy)"),
                 ("link_probe_mb", self.link_probe_mb >= 0, ">= 0 (0: links are not probed)"),
                 ("gpu_links", self.gpu_links in (None, True, False),
                  "true, false or null (null: where the job's TP degree is above 1)"))
        for name, ok, need in rules:
            if not ok:  # NaN fails every comparison, so it is rejected too
                raise ValueError(f"detect.{name}={getattr(self, name)!r} must be {need}")


@dataclass(frozen=True)
class CheckConfig:
    """When a measured step time breaks the plan's promise (``malleus.check.*``)."""

    margin: float = 0.3      # measured > expected × (1 + margin) is a miss...
    patience: int = 3        # ...in this many judged steps in a row
    kept_after: int = 6      # judged steps without a miss: the promise is kept
    backoff: int = 8         # judged steps after a miss before the next may count (doubles)
    severe: float = 2.0      # a step this many times its promise...
    severe_patience: int = 2  # ...in this many judged steps in a row is a miss at once
    enabled: bool = True

    def check(self) -> None:
        """Raise ``ValueError`` naming ``malleus.check.<field>=<value>`` for a bad field."""
        rules = (("margin", self.margin > 0, "> 0 (relative, e.g. 0.3 = 30% slower)"),
                 ("patience", self.patience >= 1, ">= 1"),
                 ("kept_after", self.kept_after >= self.patience, ">= patience"),
                 ("backoff", self.backoff >= 0, ">= 0"),
                 ("severe", self.severe > 1 + self.margin, "> 1 + margin"),
                 ("severe_patience", self.severe_patience >= 1, ">= 1"))
        for name, ok, need in rules:
            if not ok:
                raise ValueError(f"check.{name}={getattr(self, name)!r} must be {need}"
                                 + (f" ({self.patience})" if name == "kept_after" else ""))


# ------------------------------------------------------------------ the adaptive loop's keys

_INT_DETECT = ("every", "window", "confirm", "cooldown", "probe_every")
_BOOL_DETECT = ("gpu_links",)


@dataclass(frozen=True)
class AdaptiveSettings:
    """The adaptive keys of the ``malleus`` section (``malleus.*`` in the app); a field's default
    is the key's."""

    #: malleus.adaptive: detect, re-plan and migrate by itself
    enabled: bool = field(default=True, metadata={KEY: "adaptive"})
    #: ``malleus.detect.*``: when a measured rate shift re-plans
    detect: DetectConfig = field(default_factory=DetectConfig)
    check: CheckConfig = field(default_factory=CheckConfig)   # the plan's promise vs its steps
    horizon_steps: int = 100             # a switch must pay for its migration within this many steps
    replan_at: tuple[int, ...] = ()      # forced re-plans before these steps (tests, demos)
    planner_time_limit_s: float | None = None   # None: the planner's automatic budget
    min_improvement: float = 0.05        # the planner keeps the running plan unless this much faster
    migrate_gbps: float = 1.0            # GB/s per rank, assumed until a switch is measured
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
    """``<p>.detect``: a mapping of :class:`DetectConfig` fields."""
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
    """``<where>.check``: a mapping of :class:`CheckConfig` fields."""
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
