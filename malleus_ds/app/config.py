"""Parsing a run configuration: a plain dict -> a validated, frozen :class:`RunConfig`.

``launch/train.py`` turns Hydra's DictConfig into a plain dict and calls
:func:`build_run_config` on every rank; the core never sees omegaconf. Every check here runs on
every rank with only ``world_size`` known, so a bad input fails everywhere with the same message
instead of hanging a collective. Messages name the field and the numbers and say what to do.

The ``deepspeed.*`` section (the ds_config and what is resolved against it) is parsed by
``config_deepspeed.py``; the schema (``RunConfig`` and its sections, ``ConfigError``) is
``run_config.py``; the model and data sections are checked by ``models/parse.py`` and
``data/parse.py``, the device setting by ``device.py``. The names of all of these that callers
use are re-exported here.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Mapping

from ..adaptive.settings import ADAPTIVE_KEYS, AdaptiveSettings
from ..interop.malleus_section import section_keys
from ..engine.settings import MalleusSettings, parse_switch, positive
from ..data.parse import parse_data
from ..data.tokens import DataError
from .config_deepspeed import (  # noqa: F401  (re-exported)
    DS_GRADIENT_CLIPPING,
    activation_checkpointing_note,
    check_even_batch,
    ds_source,
    fill_auto,
    load_ds_config,
    parse_deepspeed,
    resolve_activation_checkpointing,
    review_for_malleus)
from .device import DeviceError, check_device
from ..emulation.straggler import StragglerError, StragglerSchedule
from ..job_layout import JobLayout, JobLayoutError
from ..models.llama import ModelConfig
from ..models.parse import ModelError, check_layout, parse_model
from .run_config import (
    ENGINES,
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    DeepSpeedSection,
    MalleusConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig)


def build_run_config(d: Mapping[str, Any], *, world_size: int, local_world_size: int | None = None,
                     run_dir: str | None = None,
                     ds_search_dirs: tuple[str | Path, ...] = (),
                     elastic: bool = False) -> RunConfig:
    """Plain dict (the Hydra config, resolved) -> validated :class:`RunConfig`.

    ``ds_search_dirs``: where a relative ``deepspeed.config_file`` is looked up (before the CWD).
    ``elastic``: the ranks run under torchrun's elastic agent, whose restarts may bring fewer (or
    more) ranks than the layout was written for (``_elastic_pp``).
    """
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    engine = str(d.get("engine", "torch"))
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} is not known; choose one of {list(ENGINES)}")
    _refuse_unknown_keys(d)
    try:
        model = parse_model(d.get("model") or {})
    except ModelError as e:
        raise ConfigError(str(e)) from None
    parallel = _parallel(d.get("parallel") or {}, world_size, model,
                         elastic=elastic and engine == "malleus")
    ds = parse_deepspeed(d.get("deepspeed") or {}, ds_search_dirs)
    train, batch_notes = _train(d.get("train") or {}, ds, parallel.dp)
    cluster = _cluster(d.get("cluster") or {}, world_size, local_world_size or world_size, parallel)
    straggler = _straggler(d.get("straggler") or {}, world_size)
    links = _links(d.get("straggler") or {}, world_size, cluster.gpus_per_node)
    if links and engine != "malleus":
        raise ConfigError(f"straggler.link_schedule slows links of engine=malleus's messages and "
                          f"reductions; engine={engine} sends its own: use engine=malleus, or "
                          f"leave straggler.link_schedule empty")
    train = resolve_activation_checkpointing(
        train, (d.get("train") or {}).get("activation_checkpointing"), ds)
    ds = fill_auto(ds, train, model, parallel)
    if engine == "malleus":
        batch_notes += review_for_malleus(ds)
    if batch_notes:
        ds = replace(ds, notes=tuple(batch_notes) + ds.notes)
    if train.num_micro_batches < parallel.dp:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} / "
                          f"train.micro_batch_size={train.micro_batch_size} = "
                          f"{train.num_micro_batches} micro-batches cannot feed parallel.dp="
                          f"{parallel.dp} replicas (each needs >= 1)")
    try:
        data = parse_data(d.get("data") or {}, model, train.global_batch_size)
    except DataError as e:
        raise ConfigError(str(e)) from None
    try:
        device = check_device(d.get("device", "auto"))
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    plan = _plan(d.get("plan", "static"), engine)
    _nproc_per_node(d.get("nproc_per_node", 1))
    ckpt = _checkpoint(d.get("checkpoint") or {})
    _max_restarts(d.get("max_restarts", 0), ckpt)
    compare_engines(d.get("compare"))
    comm = _seconds(d.get("comm_timeout_s", RunConfig.comm_timeout_s), "comm_timeout_s",
                    zero_ok=False)
    hang = _seconds(d.get("hang_timeout_s", RunConfig.hang_timeout_s), "hang_timeout_s",
                    zero_ok=True)
    log_every = d.get("log_every", RunConfig.log_every)
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ConfigError(f"log_every={log_every!r} must be an integer >= 1 (steps)")
    return RunConfig(engine=engine, model=model, train=train, parallel=parallel, cluster=cluster,
                     straggler=straggler, links=links, deepspeed=ds, world_size=world_size,
                     plan=plan,
                     run_dir=run_dir, device=device, progress=bool(d.get("progress", True)),
                     malleus=_malleus(d.get("malleus") or {}, engine, ds),
                     checkpoint=ckpt, data=data,
                     comm_timeout_s=comm,
                     hang_timeout_s=hang, log_every=log_every)


#: Top-level keys of the composed app config (conf/config.yaml; the experiment overlays only
#: set these). ``nproc_per_node`` is read by launch/train.py (ranks to spawn), not by the core.
TOP_LEVEL_KEYS = ("engine", "model", "train", "parallel", "cluster", "straggler", "deepspeed",
                  "device", "plan", "progress", "malleus", "checkpoint", "data", "comm_timeout_s",
                  "hang_timeout_s", "log_every", "nproc_per_node", "max_restarts", "compare")


def _refuse_unknown_keys(d: Mapping[str, Any]) -> None:
    """A misspelt or made-up key (``+checkpoint_dir=...``) would otherwise be ignored silently."""
    unknown = sorted(str(k) for k in set(d) - set(TOP_LEVEL_KEYS))
    if not unknown:
        return
    hints = [f"{k!r} -> {m[0]!r}?" for k in unknown
             for m in [difflib.get_close_matches(k, TOP_LEVEL_KEYS, n=1)] if m]
    hint = f" (did you mean {', '.join(hints)})" if hints else ""
    raise ConfigError(f"unknown top-level fields {unknown}{hint}; allowed: "
                      f"{sorted(TOP_LEVEL_KEYS)}")


def _plan(v: Any, engine: str) -> str:
    """``plan``: "static" or a plan JSON path; any other plan needs engine=malleus (the path
    itself is checked by the malleus runner)."""
    plan = "static" if v in (None, "", "static") else str(v)
    if plan != "static" and engine != "malleus":
        raise ConfigError(f"plan= only applies to engine=malleus; got engine={engine} with "
                          f"plan={plan!r}; drop plan= (or set plan=static) or use engine=malleus")
    return plan


def _nproc_per_node(v: Any) -> int:
    """``nproc_per_node``: local ranks a bare ``python launch/train.py`` starts (1 = in-process)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"nproc_per_node={v!r} must be an integer >= 1 (local ranks to start; "
                          f"1 = run in this process)")
    return v


def _max_restarts(v: Any, ckpt: CheckpointConfig) -> int:
    """``max_restarts``: torchrun restarts of the ranks a bare ``python launch/train.py
    nproc_per_node=N`` starts (launch/train.py); each must continue from a checkpoint."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"max_restarts={v!r} must be an integer >= 0 (0 = no restarts)")
    if v and ckpt.resume != "auto":
        raise ConfigError(f"max_restarts={v} needs checkpoint.resume=auto (and checkpoint.dir): "
                          f"with checkpoint.resume={str(ckpt.resume).lower()} a restart would "
                          + ("fail: the first start has no checkpoint yet" if ckpt.resume else
                             "train again from step 0")
                          + "; add checkpoint.dir=PATH checkpoint.resume=auto")
    return v


def compare_engines(v: Any) -> tuple[str, ...]:
    """``compare``: engines that each run the whole config, one after the other, for a
    side-by-side table (launch/train.py, malleus_ds/report/compare.py); empty = a normal run."""
    from ..report.compare import COMPARABLE

    if v is None:
        return ()
    if isinstance(v, str) or not isinstance(v, (list, tuple)):
        raise ConfigError(f"compare={v!r} must be a list of engines, e.g. "
                          f"compare=[deepspeed,malleus] (or [] for a normal run)")
    out = tuple(str(e) for e in v)
    bad = [e for e in out if e not in COMPARABLE]
    if bad:
        raise ConfigError(f"compare={list(out)}: {bad} not comparable engines; choose from "
                          f"{list(COMPARABLE)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"compare={list(out)} names an engine twice")
    return out


STRAGGLER_KEYS = ("schedule", "method", "link_schedule")


def _links(s: Mapping[str, Any], world_size: int, gpus_per_node: int):
    """``straggler.link_schedule``: emulated slow links (``emulation/links.py``), between the
    job layout's nodes (``cluster.gpus_per_node`` ranks each) or two ranks of a node."""
    from ..emulation.links import LinkSchedule

    try:
        return LinkSchedule.parse(s.get("link_schedule") if isinstance(s, Mapping) else None,
                                  world_size, gpus_per_node)
    except StragglerError as e:
        raise ConfigError(str(e)) from None


def _straggler(s: Mapping[str, Any], world_size: int) -> StragglerSchedule:
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


def _seconds(v: Any, name: str, zero_ok: bool) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``zero_ok``: 0 turns the feature off)."""
    try:
        x = float(v) if not isinstance(v, bool) else float("nan")
    except (TypeError, ValueError):
        x = float("nan")
    if not (x >= 0 if zero_ok else x > 0) or x == float("inf"):
        bound = ">= 0 (0 = off)" if zero_ok else "> 0"
        raise ConfigError(f"{name}={v!r} must be a finite number of seconds {bound}")
    return x


#: The app's ``malleus.*`` keys (the engine's own ds_config ``malleus`` section has more), from
#: :class:`MalleusConfig`'s fields: its ``loop`` stands for the loop's keys
MALLEUS_KEYS = tuple(k for f in section_keys(MalleusConfig)
                     for k in (ADAPTIVE_KEYS if f == "loop" else (f,)))


def _malleus(m: Mapping[str, Any], engine: str, ds: DeepSpeedSection) -> MalleusConfig:
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


def _checkpoint(c: Mapping[str, Any]) -> CheckpointConfig:
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
    every = _int(0 if c.get("every") is None else c["every"], "checkpoint.every")
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
    keep = _int(0 if c.get("keep") is None else c["keep"], "checkpoint.keep")
    if keep < 0:
        raise ConfigError(f"checkpoint.keep={keep} must be >= 0 (the newest N checkpoints stay, "
                          f"older ones are deleted; 0 = keep all)")
    return CheckpointConfig(dir=None if d is None else os.path.abspath(os.fspath(d)),
                            every=every, resume=resume, background=background, keep=keep)


def _train(t: Mapping[str, Any], ds: DeepSpeedSection, dp: int) -> tuple[TrainConfig, list]:
    """``train.*`` -> TrainConfig, and a note per batch field taken from the ds_config: a batch
    field left out (or null) comes from the ds_config's batch keys where it has them
    (``interop.batch.resolve_batch``; one that contradicts them is refused, naming both)."""
    from ..interop.batch import resolve_batch

    t = {k: v for k, v in t.items() if v is not None or k == "data_seed"}
    allowed = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise ConfigError(f"train has unknown fields {unknown}; allowed: {sorted(allowed)}")
    for k in ("global_batch_size", "micro_batch_size"):
        if k in t:
            t[k] = _int(t[k], f"train.{k}")
    t["global_batch_size"], t["micro_batch_size"], notes = resolve_batch(
        ds.config, t, dp, ConfigError,
        (TrainConfig.global_batch_size, TrainConfig.micro_batch_size))
    for k in ("steps", "seed", "warmup_steps"):
        if k in t:
            t[k] = _int(t[k], f"train.{k}")
    for k in ("lr", "eps", "weight_decay"):
        if k in t:
            t[k] = _float(t[k], f"train.{k}")
    if "betas" in t:
        b = t["betas"]
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise ConfigError(f"train.betas={b!r} must be a pair [beta1, beta2]")
        t["betas"] = (_float(b[0], "train.betas[0]"), _float(b[1], "train.betas[1]"))
    if t.get("data_seed") is not None:
        t["data_seed"] = _int(t["data_seed"], "train.data_seed")
    ac = t.pop("activation_checkpointing", None)     # resolved against the ds_config later
    if ac is not None and not isinstance(ac, bool):
        raise ConfigError(f"train.activation_checkpointing={ac!r} must be true, false or null "
                          f"(null: on when the ds_config enables DeepSpeed's activation "
                          f"checkpointing)")
    tc = TrainConfig(**t)
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
    return tc, notes


def _parallel(p: Mapping[str, Any], world: int, model: ModelConfig,
              elastic: bool = False) -> ParallelConfig:
    unknown = sorted(set(p) - {"tp", "pp", "dp"})
    if unknown:
        raise ConfigError(f"parallel has unknown fields {unknown}; allowed: ['dp', 'pp', 'tp']")
    tp = _int(1 if p.get("tp") is None else p["tp"], "parallel.tp")
    pp = _int(1 if p.get("pp") is None else p["pp"], "parallel.pp")
    for k, v in (("tp", tp), ("pp", pp)):
        if v < 1:
            raise ConfigError(f"parallel.{k}={v} must be >= 1")
    asked = None
    if p.get("dp") is None and elastic and world % (tp * pp) and world % tp == 0:
        asked, pp = pp, _elastic_pp(world // tp, pp, model.num_layers)
    if p.get("dp") is None:
        if world % (tp * pp):
            raise ConfigError(f"parallel.tp={tp} x parallel.pp={pp} = {tp * pp} does not divide "
                              f"the world size {world}; launch a multiple of {tp * pp} ranks")
        dp = world // (tp * pp)
    else:
        dp = _int(p["dp"], "parallel.dp")
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


def _elastic_pp(groups: int, pp: int, num_layers: int) -> int:
    """Stages for a world of ``groups`` TP groups that ``pp`` does not tile (an elastic restart
    after a node left or joined): the fewest stages >= ``pp`` that tile it (no more layers per
    rank than the layout was written for), else the most that do (more layers per rank: the
    start-up memory check, ``app/runners/fit.py``, says whether they still fit)."""
    tiles = [s for s in range(1, min(groups, num_layers) + 1) if groups % s == 0]
    return min((s for s in tiles if s >= pp), default=max(tiles))


def _cluster(c: Mapping[str, Any], world: int, local_world: int,
             par: ParallelConfig) -> ClusterConfig:
    unknown = sorted(set(c) - {"gpus_per_node", "nodes"})
    if unknown:
        raise ConfigError(f"cluster has unknown fields {unknown}; allowed: "
                          f"['gpus_per_node', 'nodes']")
    gpn = c.get("gpus_per_node")
    gpn = local_world if gpn is None else _int(gpn, "cluster.gpus_per_node")
    try:
        nodes = JobLayout(world, gpn).nodes
    except JobLayoutError as e:
        raise ConfigError(f"cluster.{e.detail}") from None
    if c.get("nodes") is not None and _int(c["nodes"], "cluster.nodes") != nodes:
        raise ConfigError(f"cluster.nodes={c['nodes']} but world size {world} / "
                          f"cluster.gpus_per_node={gpn} = {nodes} nodes")
    if gpn % par.tp:
        raise ConfigError(f"parallel.tp={par.tp} does not divide cluster.gpus_per_node={gpn}: "
                          f"a TP group must stay inside one node")
    return ClusterConfig(gpn, nodes)


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"{where}={v!r} must be an integer")
    return int(v)


def _float(v: Any, where: str) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"{where}={v!r} must be a number")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={v!r} must be a number") from None
