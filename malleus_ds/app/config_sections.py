"""The run config's sections, one parser each: ``train.*``, ``parallel.*``, ``cluster.*``,
``straggler.*``, ``checkpoint.*`` and ``malleus.*``.

Each takes its section as a plain mapping (plus what it depends on: the world size, the model,
the ds_config) and returns its typed part of :class:`RunConfig`, or raises :class:`ConfigError`
naming ``section.key``, the value and what to do. A section refuses keys it does not know, so a
misspelt override fails instead of being ignored. ``build_run_config`` (``config.py``) calls them
in a fixed order, which decides the first error a config with several mistakes reports.
"""
from __future__ import annotations

import os
from dataclasses import fields
from typing import Any, Mapping

from ..emulation.straggler import StragglerError, StragglerSchedule
from ..engine.settings import MalleusSettings, parse_switch
from ..interop.malleus_section import ADAPTIVE_KEYS, AdaptiveSettings, positive, section_keys
from ..job_layout import JobLayout, JobLayoutError
from ..models.llama import ModelConfig
from ..models.parse import check_layout
from .config_deepspeed import ds_source
from .run_config import (
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    DeepSpeedSection,
    MalleusConfig,
    ParallelConfig,
    TrainConfig)

STRAGGLER_KEYS = ("schedule", "method", "link_schedule")

#: The app's ``malleus.*`` keys (the engine's own ds_config ``malleus`` section has more), from
#: :class:`MalleusConfig`'s fields: its ``loop`` stands for the loop's keys
MALLEUS_KEYS = tuple(k for f in section_keys(MalleusConfig)
                     for k in (ADAPTIVE_KEYS if f == "loop" else (f,)))


def parse_train(t: Mapping[str, Any], ds: DeepSpeedSection, dp: int) -> tuple[TrainConfig, list]:
    """``train.*`` -> TrainConfig, and a note per batch field taken from the ds_config: a batch
    field left out (or null) comes from the ds_config's batch keys where it has them
    (``interop.batch.resolve_batch``; one that contradicts them is refused, naming both).
    ``activation_checkpointing`` is only type-checked here; it is resolved against the ds_config
    later (``config_deepspeed.resolve_activation_checkpointing``)."""
    from ..interop.batch import resolve_batch

    t = {k: v for k, v in t.items() if v is not None or k == "data_seed"}
    allowed = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise ConfigError(f"train has unknown fields {unknown}; allowed: {sorted(allowed)}")
    for k in ("global_batch_size", "micro_batch_size"):
        if k in t:
            t[k] = as_int(t[k], f"train.{k}")
    t["global_batch_size"], t["micro_batch_size"], notes = resolve_batch(
        ds.config, t, dp, ConfigError,
        (TrainConfig.global_batch_size, TrainConfig.micro_batch_size))
    for k in ("steps", "seed", "warmup_steps"):
        if k in t:
            t[k] = as_int(t[k], f"train.{k}")
    for k in ("lr", "eps", "weight_decay"):
        if k in t:
            t[k] = as_float(t[k], f"train.{k}")
    if "betas" in t:
        b = t["betas"]
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise ConfigError(f"train.betas={b!r} must be a pair [beta1, beta2]")
        t["betas"] = (as_float(b[0], "train.betas[0]"), as_float(b[1], "train.betas[1]"))
    if t.get("data_seed") is not None:
        t["data_seed"] = as_int(t["data_seed"], "train.data_seed")
    ac = t.pop("activation_checkpointing", None)
    if ac is not None and not isinstance(ac, bool):
        raise ConfigError(f"train.activation_checkpointing={ac!r} must be true, false or null "
                          f"(null: on when the ds_config enables DeepSpeed's activation "
                          f"checkpointing)")
    tc = TrainConfig(**t)
    _check_train(tc)
    return tc, notes


def _check_train(tc: TrainConfig) -> None:
    """The bounds of a typed ``train.*``."""
    if tc.steps < 1:
        raise ConfigError(f"train.steps={tc.steps} must be >= 1")
    for k in ("global_batch_size", "micro_batch_size"):
        if getattr(tc, k) < 1:
            raise ConfigError(f"train.{k}={getattr(tc, k)} must be >= 1")
    if tc.global_batch_size % tc.micro_batch_size:
        raise ConfigError(f"train.global_batch_size={tc.global_batch_size} is not a multiple of "
                          f"train.micro_batch_size={tc.micro_batch_size}")
    if tc.lr <= 0:
        raise ConfigError(f"train.lr={tc.lr} must be > 0")
    if tc.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={tc.warmup_steps} must be >= 0 (steps left out of "
                          f"the throughput summary; 0 = count every step)")


def parse_parallel(p: Mapping[str, Any], world: int, model: ModelConfig,
                   elastic: bool = False) -> ParallelConfig:
    """``parallel.*``: ``tp`` x ``pp`` x ``dp`` must be the world size (``dp`` null: inferred).
    With ``elastic``, a world that ``pp`` does not tile takes :func:`elastic_pp` stages."""
    unknown = sorted(set(p) - {"tp", "pp", "dp"})
    if unknown:
        raise ConfigError(f"parallel has unknown fields {unknown}; allowed: ['dp', 'pp', 'tp']")
    tp = as_int(1 if p.get("tp") is None else p["tp"], "parallel.tp")
    pp = as_int(1 if p.get("pp") is None else p["pp"], "parallel.pp")
    for k, v in (("tp", tp), ("pp", pp)):
        if v < 1:
            raise ConfigError(f"parallel.{k}={v} must be >= 1")
    asked = None
    if p.get("dp") is None and elastic and world % (tp * pp) and world % tp == 0:
        asked, pp = pp, elastic_pp(world // tp, pp, model.num_layers)
    if p.get("dp") is None:
        if world % (tp * pp):
            raise ConfigError(f"parallel.tp={tp} x parallel.pp={pp} = {tp * pp} does not divide "
                              f"the world size {world}; launch a multiple of {tp * pp} ranks")
        dp = world // (tp * pp)
    else:
        dp = as_int(p["dp"], "parallel.dp")
        if dp < 1:
            raise ConfigError(f"parallel.dp={dp} must be >= 1")
        if tp * pp * dp != world:
            raise ConfigError(f"parallel layout tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} ranks "
                              f"does not match the world size {world} (ranks launched); set "
                              f"parallel.dp=null to infer dp, or launch {tp * pp * dp} ranks")
    try:
        check_layout(model, tp, pp)
    except ValueError as e:             # ModelError, TPError
        raise ConfigError(str(e)) from None
    return ParallelConfig(tp, pp, dp, asked_pp=asked)


def elastic_pp(groups: int, pp: int, num_layers: int) -> int:
    """Stages for a world of ``groups`` TP groups that ``pp`` does not tile (an elastic restart
    after a node left or joined): the fewest stages >= ``pp`` that tile it (no more layers per
    rank than the layout was written for), else the most that do (more layers per rank: the
    start-up memory check, ``app/runners/fit.py``, says whether they still fit)."""
    tiles = [s for s in range(1, min(groups, num_layers) + 1) if groups % s == 0]
    return min((s for s in tiles if s >= pp), default=max(tiles))


def parse_cluster(c: Mapping[str, Any], world: int, local_world: int,
                  par: ParallelConfig) -> ClusterConfig:
    """``cluster.*``: the job layout's nodes (``gpus_per_node`` null: the local world size);
    a TP group stays inside one node."""
    unknown = sorted(set(c) - {"gpus_per_node", "nodes"})
    if unknown:
        raise ConfigError(f"cluster has unknown fields {unknown}; allowed: "
                          f"['gpus_per_node', 'nodes']")
    gpn = c.get("gpus_per_node")
    gpn = local_world if gpn is None else as_int(gpn, "cluster.gpus_per_node")
    try:
        nodes = JobLayout(world, gpn).nodes
    except JobLayoutError as e:
        raise ConfigError(f"cluster.{e.detail}") from None
    if c.get("nodes") is not None and as_int(c["nodes"], "cluster.nodes") != nodes:
        raise ConfigError(f"cluster.nodes={c['nodes']} but world size {world} / "
                          f"cluster.gpus_per_node={gpn} = {nodes} nodes")
    if gpn % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide cluster.gpus_per_node={gpn}: "
                          f"a TP group must stay inside one node")
    return ClusterConfig(gpn, nodes)


def parse_straggler(s: Mapping[str, Any], world_size: int) -> StragglerSchedule:
    """``straggler.schedule`` and ``straggler.method`` (sleep | quota | compete; emulation/straggler.py).
    Whether this machine can apply ``quota`` or ``compete`` is checked at runner start-up
    (``app/runners/__init__.py``)."""
    if not isinstance(s, Mapping):
        raise ConfigError(f"straggler must be a mapping with key 'schedule', got {s!r} "
                          f"(allowed keys: {list(STRAGGLER_KEYS)})")
    unknown = sorted(set(s) - set(STRAGGLER_KEYS))
    if unknown:
        raise ConfigError(f"straggler has unknown fields {unknown}; allowed: "
                          f"{list(STRAGGLER_KEYS)}")
    try:
        return StragglerSchedule.parse(s.get("schedule"), world_size, s.get("method") or "sleep")
    except StragglerError as e:
        raise ConfigError(str(e)) from None


def parse_links(s: Mapping[str, Any], world_size: int, gpus_per_node: int):
    """``straggler.link_schedule``: emulated slow links (``emulation/links.py``), between the
    job layout's nodes (``cluster.gpus_per_node`` ranks each) or two ranks of a node."""
    from ..emulation.links import LinkSchedule

    try:
        return LinkSchedule.parse(s.get("link_schedule") if isinstance(s, Mapping) else None,
                                  world_size, gpus_per_node)
    except StragglerError as e:
        raise ConfigError(str(e)) from None


def parse_checkpoint(c: Mapping[str, Any]) -> CheckpointConfig:
    """``checkpoint.*``. ``dir`` is made absolute here (against the CWD every rank shares), so
    the summary and the saved files name one folder whatever the ranks' later CWD."""
    allowed = [f.name for f in fields(CheckpointConfig)]
    if not isinstance(c, Mapping):
        raise ConfigError(f"checkpoint must be a mapping with keys {allowed}, got {c!r}")
    unknown = sorted(set(c) - set(allowed))
    if unknown:
        raise ConfigError(f"checkpoint has unknown fields {unknown}; allowed: {allowed}")
    d = c.get("dir")
    if isinstance(d, int) and not isinstance(d, bool):
        d = str(d)                      # Hydra reads `checkpoint.dir=2024` as a number
    if d is not None and (not isinstance(d, (str, os.PathLike)) or not str(d).strip()):
        raise ConfigError(f"checkpoint.dir={d!r} must be a folder path (or null for none)")
    every = as_int(0 if c.get("every") is None else c["every"], "checkpoint.every")
    if every < 0:
        raise ConfigError(f"checkpoint.every={every} must be >= 0 (0 = save only at the end "
                          f"of the run)")
    resume = False if c.get("resume") is None else c["resume"]
    if isinstance(resume, str) and resume.strip().lower() == "auto":
        resume = "auto"
    elif not isinstance(resume, bool):
        raise ConfigError(f"checkpoint.resume={resume!r} must be true, false or auto (continue "
                          f"from checkpoint.dir/latest if there is one, else start fresh)")
    if d is None and (every > 0 or resume):
        what = (f"checkpoint.every={every}" if every > 0 else
                f"checkpoint.resume={'auto' if resume == 'auto' else 'true'}")
        raise ConfigError(f"{what} needs checkpoint.dir (the folder to save to / resume from); "
                          f"set checkpoint.dir=PATH")
    background = True if c.get("background") is None else c["background"]
    if not isinstance(background, bool):
        raise ConfigError(f"checkpoint.background={background!r} must be true or false")
    keep = as_int(0 if c.get("keep") is None else c["keep"], "checkpoint.keep")
    if keep < 0:
        raise ConfigError(f"checkpoint.keep={keep} must be >= 0 (the newest N checkpoints stay, "
                          f"older ones are deleted; 0 = keep all)")
    return CheckpointConfig(dir=None if d is None else os.path.abspath(os.fspath(d)),
                            every=every, resume=resume, background=background, keep=keep)


def parse_malleus(m: Mapping[str, Any], engine: str, ds: DeepSpeedSection) -> MalleusConfig:
    """``malleus.*``, parsed once into :class:`MalleusConfig` (errors name ``malleus.<key>``).
    The ds_config's own ``malleus`` section (``malleus_ds.initialize``'s way to set these)
    supplies the keys the app leaves unset (null); the app's win. A switch or a forced re-plan
    with another engine is refused."""
    if not isinstance(m, Mapping):
        raise ConfigError(f"malleus must be a mapping with keys {list(MALLEUS_KEYS)}, got {m!r}")
    unknown = sorted(set(m) - set(MALLEUS_KEYS))
    if unknown:
        raise ConfigError(f"malleus has unknown fields {unknown}; allowed: {list(MALLEUS_KEYS)}")
    out = {k: v for k, v in m.items() if v is not None}
    for k, what in (("switch", "live plan switches"), ("replan_at", "forced re-plans")):
        if out.get(k) and engine != "malleus":
            raise ConfigError(f"malleus.{k} is set but engine={engine}: {what} need "
                              f"engine=malleus")
    if engine != "malleus":
        return MalleusConfig()
    sec = ds.config.get("malleus") or {}
    if not isinstance(sec, Mapping):
        raise ConfigError(f"ds_config{ds_source(ds)} malleus must be an object, got {sec!r}")
    merged = {**{k: v for k, v in sec.items() if k in MALLEUS_KEYS and v is not None}, **out}
    try:
        own = MalleusSettings.from_config(sec)  # the ds_config's own section, in its own words
        return MalleusConfig(   # an empty malleus.switch (the YAML's []) keeps the ds_config's
            switch=parse_switch(out["switch"], "malleus.switch") if out.get("switch")
            else own.switch,
            migrate_bucket_mb=positive(merged, "migrate_bucket_mb",
                                       MalleusConfig.migrate_bucket_mb, "malleus"),
            migrate_timeout_s=positive(merged, "migrate_timeout_s",
                                       MalleusConfig.migrate_timeout_s, "malleus"),
            loop=AdaptiveSettings.from_config(merged, "malleus"))
    except ValueError as e:
        raise ConfigError(f"engine=malleus: {e}") from None


def as_int(v: Any, where: str) -> int:
    """``v`` as an int (a whole float passes, a bool does not), else ConfigError at ``where``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"{where}={v!r} must be an integer")
    return int(v)


def as_float(v: Any, where: str) -> float:
    """``v`` as a float (not a bool), else ConfigError naming ``where``."""
    if isinstance(v, bool):
        raise ConfigError(f"{where}={v!r} must be a number")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={v!r} must be a number") from None
