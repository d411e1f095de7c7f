"""Parsing a run configuration: a plain dict -> a validated, frozen :class:`RunConfig`.

``launch/train.py`` turns Hydra's DictConfig into a plain dict and calls
:func:`build_run_config` on every rank; the core never sees omegaconf. Every check here runs on
every rank with only ``world_size`` known, so a bad input fails everywhere with the same message
instead of hanging a collective. Messages name the field and the numbers and say what to do.

This module holds the entry point and the top-level keys (``engine``, ``plan``, ``compare``,
the timeouts, ...). The sections are parsed by ``config_sections.py`` (train, parallel,
cluster, straggler, checkpoint, malleus) and ``config_deepspeed.py`` (the ds_config and what is
resolved against it); the schema (``RunConfig`` and its sections, ``ConfigError``) is
``run_config.py``; the model and data sections are checked by ``models/parse.py`` and
``data/parse.py``, the device setting by ``device.py``. The names of all of these that callers
use are re-exported here.
"""
from __future__ import annotations

import difflib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from ..data.parse import parse_data
from ..data.tokens import DataError
from ..job_layout import JobLayout
from ..models.llama import ModelConfig
from ..models.parse import ModelError, parse_model
from .config_deepspeed import (  # noqa: F401  (re-exported)
    DS_GRADIENT_CLIPPING,
    activation_checkpointing_note,
    check_even_batch,
    fill_auto,
    load_ds_config,
    parse_deepspeed,
    resolve_activation_checkpointing,
    review_for_malleus)
from .config_sections import (  # noqa: F401  (re-exported)
    MALLEUS_KEYS,
    STRAGGLER_KEYS,
    parse_checkpoint,
    parse_cluster,
    parse_links,
    parse_malleus,
    parse_parallel,
    parse_straggler,
    parse_train)
from .config_sections import elastic_pp as _elastic_pp  # noqa: F401  (the name tests use)
from .device import DeviceError, check_device
from .run_config import (  # noqa: F401  (re-exported)
    ENGINES,
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    DeepSpeedSection,
    MalleusConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig)

_T = TypeVar("_T")


def build_run_config(d: Mapping[str, Any], *, world_size: int, local_world_size: int | None = None,
                     run_dir: str | None = None,
                     ds_search_dirs: tuple[str | Path, ...] = (),
                     elastic: bool = False) -> RunConfig:
    """Plain dict (the Hydra config, resolved) -> validated :class:`RunConfig`.

    ``ds_search_dirs``: where a relative ``deepspeed.config_file`` is looked up (before the CWD).
    ``elastic``: the ranks run under torchrun's elastic agent, whose restarts may bring fewer (or
    more) ranks than the layout was written for (``config_sections.elastic_pp``).
    The sections are parsed in a fixed order, each with what the earlier ones gave; the first
    mistake found is the one reported.
    """
    engine = _engine(d, world_size)
    model = _reraised(ModelError, parse_model, d.get("model") or {})
    parallel = parse_parallel(d.get("parallel") or {}, world_size, model,
                              elastic=elastic and engine == "malleus")
    ds = parse_deepspeed(d.get("deepspeed") or {}, ds_search_dirs)
    train, batch_notes = parse_train(d.get("train") or {}, ds, parallel.dp)
    cluster = parse_cluster(d.get("cluster") or {}, world_size, local_world_size or world_size,
                            parallel)
    straggler_sec, left_out = _on_this_world(d.get("straggler") or {}, world_size,
                                             cluster.gpus_per_node, elastic)
    straggler, links = _stragglers(straggler_sec, world_size, cluster.gpus_per_node, engine)
    train = resolve_activation_checkpointing(
        train, (d.get("train") or {}).get("activation_checkpointing"), ds)
    ds = _resolve_ds_config(ds, train, model, parallel, engine, batch_notes)
    _check_replicas_fed(train, parallel)
    data = _reraised(DataError, parse_data, d.get("data") or {}, model, train.global_batch_size)
    device = _reraised(DeviceError, check_device, d.get("device", "auto"))
    top = _top_level_settings(d, engine)
    return RunConfig(engine=engine, model=model, train=train, parallel=parallel, cluster=cluster,
                     straggler=straggler, links=links, deepspeed=ds, world_size=world_size,
                     run_dir=run_dir, device=device, data=data, emulation_notes=left_out, **top,
                     malleus=parse_malleus(d.get("malleus") or {}, engine, ds))


def _reraised(error: type[Exception], parse: Callable[..., _T], *args: Any) -> _T:
    """``parse(*args)``, its own ``error`` turned into a ConfigError with the same words."""
    try:
        return parse(*args)
    except error as e:
        raise ConfigError(str(e)) from None


def _engine(d: Mapping[str, Any], world_size: int) -> str:
    """The world size and ``engine`` checked, and every top-level key known."""
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    engine = str(d.get("engine", "torch"))
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} is not known; choose one of {list(ENGINES)}")
    _refuse_unknown_keys(d)
    return engine


def _on_this_world(s: Any, world: int, gpus_per_node: int,
                   elastic: bool) -> tuple[Any, tuple[str, ...]]:
    """Under torchrun's elastic agent a restart may bring fewer ranks than the emulation's
    schedules were written for (a node was lost): their entries for ranks or nodes this start
    does not have are left out, each said in one line, and apply again once the job is back to
    its size. Otherwise (and for a malformed entry, which the parsers name) ``s`` as given."""
    if not elastic or not isinstance(s, Mapping):
        return s, ()
    nodes = JobLayout(world, gpus_per_node).nodes      # parse_cluster has checked the shape
    limits = {"rank": world, "ranks": world, "nodes": nodes}

    def absent(e) -> str | None:
        for key, limit in limits.items():
            v = e.get(key) if isinstance(e, Mapping) else None
            vs = v if isinstance(v, (list, tuple)) else [v]
            if v is not None and all(isinstance(x, int) for x in vs) and max(vs) >= limit:
                return f"{key}={v}"
        return None

    out, said = dict(s), []
    for name in ("schedule", "link_schedule"):
        entries = s.get(name)
        if not isinstance(entries, (list, tuple)):
            continue
        keep = []
        for i, e in enumerate(entries):
            why = absent(e)
            if why is None:
                keep.append(e)
            else:
                said.append(f"straggler.{name}[{i}] ({why}) is left out: this elastic restart "
                            f"has {world} ranks on {nodes} node(s); it applies again when the "
                            f"job is back to its size")
        out[name] = keep
    return out, tuple(said)


def _stragglers(s: Mapping[str, Any], world_size: int, gpus_per_node: int, engine: str):
    """``straggler.*``: the slow ranks' schedule and the slow links' (engine=malleus only: the
    emulation slows the messages and reductions that engine sends)."""
    straggler = parse_straggler(s, world_size)
    links = parse_links(s, world_size, gpus_per_node)
    if links and engine != "malleus":
        raise ConfigError(f"straggler.link_schedule slows links of engine=malleus's messages and "
                          f"reductions; engine={engine} sends its own: use engine=malleus, or "
                          f"leave straggler.link_schedule empty")
    return straggler, links


def _resolve_ds_config(ds: DeepSpeedSection, train: TrainConfig, model: ModelConfig,
                       parallel: ParallelConfig, engine: str,
                       batch_notes: list[str]) -> DeepSpeedSection:
    """The ds_config with its ``"auto"`` values filled and, for engine=malleus, its keys
    reviewed; the batch and review notes go first among its notes."""
    ds = fill_auto(ds, train, model, parallel)
    if engine == "malleus":
        batch_notes += review_for_malleus(ds)
    if batch_notes:
        ds = replace(ds, notes=tuple(batch_notes) + ds.notes)
    return ds


def _check_replicas_fed(train: TrainConfig, parallel: ParallelConfig) -> None:
    """Every data-parallel replica gets at least one micro-batch per step."""
    if train.num_micro_batches < parallel.dp:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} / "
                          f"train.micro_batch_size={train.micro_batch_size} = "
                          f"{train.num_micro_batches} micro-batches cannot feed parallel.dp="
                          f"{parallel.dp} replicas (each needs >= 1)")


def _top_level_settings(d: Mapping[str, Any], engine: str) -> dict[str, Any]:
    """The top-level keys that are not sections, checked in order, plus ``checkpoint.*`` (which
    ``max_restarts`` depends on): RunConfig's fields they set, by name."""
    plan = _plan(d.get("plan", "static"), engine)
    _nproc_per_node(d.get("nproc_per_node", 1))
    ckpt = parse_checkpoint(d.get("checkpoint") or {})
    _max_restarts(d.get("max_restarts", 0), ckpt)
    compare_engines(d.get("compare"))
    comm = _seconds(d.get("comm_timeout_s", RunConfig.comm_timeout_s), "comm_timeout_s",
                    zero_ok=False)
    hang = _seconds(d.get("hang_timeout_s", RunConfig.hang_timeout_s), "hang_timeout_s",
                    zero_ok=True)
    log_every = d.get("log_every", RunConfig.log_every)
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ConfigError(f"log_every={log_every!r} must be an integer >= 1 (steps)")
    return dict(plan=plan, checkpoint=ckpt, comm_timeout_s=comm, hang_timeout_s=hang,
                log_every=log_every, progress=bool(d.get("progress", True)))


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
