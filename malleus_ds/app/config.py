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
from typing import Any, Mapping

from ..data.parse import parse_data
from ..data.tokens import DataError
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
from ..models.parse import ModelError, parse_model
from .device import DeviceError, check_device
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
    parallel = parse_parallel(d.get("parallel") or {}, world_size, model,
                              elastic=elastic and engine == "malleus")
    ds = parse_deepspeed(d.get("deepspeed") or {}, ds_search_dirs)
    train, batch_notes = parse_train(d.get("train") or {}, ds, parallel.dp)
    cluster = parse_cluster(d.get("cluster") or {}, world_size, local_world_size or world_size,
                            parallel)
    straggler = parse_straggler(d.get("straggler") or {}, world_size)
    links = parse_links(d.get("straggler") or {}, world_size, cluster.gpus_per_node)
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
    return RunConfig(engine=engine, model=model, train=train, parallel=parallel, cluster=cluster,
                     straggler=straggler, links=links, deepspeed=ds, world_size=world_size,
                     plan=plan,
                     run_dir=run_dir, device=device, progress=bool(d.get("progress", True)),
                     malleus=parse_malleus(d.get("malleus") or {}, engine, ds),
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

