"""The run config's ``deepspeed.*`` section and what is resolved against the ds_config.

``deepspeed.config_file`` (a JSON file) and ``deepspeed.config`` (inline fields, merged over the
file) give one ds_config dict. A ds_config means here what it means to DeepSpeed: a file that
leaves ``gradient_clipping`` out clips at DeepSpeed's default, its ``"auto"`` values are filled
from ``train.*`` and the model the way the Hugging Face Trainer fills them, and its activation
checkpointing section turns on ``train.activation_checkpointing``. For engine=malleus every key
is reviewed (``interop/config_keys.py``): a note for one it ignores, an error for one it refuses.
:func:`check_even_batch` holds stock DeepSpeed's own batch rule, for its runner.

Every function raises :class:`ConfigError` with the field, the value and what to do.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from ..interop.sections import activation_checkpointing_source
from ..models.llama import ModelConfig
from .run_config import ConfigError, DeepSpeedSection, ParallelConfig, RunConfig, TrainConfig

#: DeepSpeed's ``gradient_clipping`` when a ds_config leaves it out (its runtime/constants.py)
DS_GRADIENT_CLIPPING = 1.0


def load_ds_config(path: str | Path) -> dict:
    """Read a ds_config JSON file; malformed JSON -> ConfigError with file, line and column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed.config_file={str(path)!r}: file not found")
    from ..files.safe_load import MAX_JSON_BYTES

    if p.stat().st_size > MAX_JSON_BYTES:
        raise ConfigError(f"deepspeed.config_file={str(p)!r} is {p.stat().st_size / 2**20:.1f} "
                          f"MiB; refused unread (a ds_config is at most "
                          f"{MAX_JSON_BYTES / 2**20:.0f} MiB)")
    try:
        d = json.loads(p.read_bytes())
    except UnicodeDecodeError as e:
        raise ConfigError(f"deepspeed.config_file={str(p)!r} is not text ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed.config_file={str(p)!r} is not valid JSON: {e.msg} at line "
                          f"{e.lineno} column {e.colno}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"deepspeed.config_file={str(p)!r} must hold a JSON object, "
                          f"got {type(d).__name__}")
    return d


def parse_deepspeed(s: Mapping[str, Any], search: tuple[str | Path, ...]) -> DeepSpeedSection:
    """``deepspeed.*`` -> the ds_config: the file (a relative path looked up in ``search``, then
    the CWD) with the inline fields merged over it, its ZeRO stage checked."""
    unknown = sorted(set(s) - {"config_file", "config"})
    if unknown:
        raise ConfigError(f"deepspeed has unknown fields {unknown}; allowed: "
                          f"['config', 'config_file']")
    f = s.get("config_file")
    cfg: dict = {}
    path = None
    if f:
        cand = [Path(f)] if os.path.isabs(f) else [Path(d) / f for d in search] + [Path(f)]
        hit = next((c for c in cand if c.is_file()), None)
        if hit is None:
            raise ConfigError(f"deepspeed.config_file={f!r}: file not found (looked in "
                              f"{[str(c) for c in cand]})")
        path = str(hit.resolve())
        cfg = load_ds_config(hit)
    inline = s.get("config") or {}
    if not isinstance(inline, Mapping):
        raise ConfigError(f"deepspeed.config must be a mapping of ds_config fields, got {inline!r}")
    cfg = _merge(cfg, inline)
    zo = cfg.get("zero_optimization", {})
    if not isinstance(zo, Mapping):
        raise ConfigError(f"ds_config zero_optimization must be an object, got {zo!r}")
    stage = zo.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(f"ds_config zero_optimization.stage={stage!r} must be 0, 1, 2 or 3")
    notes = ()
    if path is not None and "gradient_clipping" not in cfg:
        # a ds_config file means what it means to DeepSpeed, whose default clips at 1.0 (the
        # runners' 0.0 default is for configs given inline; the presets say 0.0 themselves)
        cfg = dict(cfg, gradient_clipping=DS_GRADIENT_CLIPPING)
        notes = (f"gradient_clipping: not in {f}, so {DS_GRADIENT_CLIPPING}, DeepSpeed's default "
                 f"(set it to 0.0 for no clipping)",)
    return DeepSpeedSection(config_file=path, config=cfg, notes=notes)


def _merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict:
    """``b`` over ``a``, nested mappings merged key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) \
            else v
    return out


def ds_source(ds: DeepSpeedSection) -> str:
    """Where the ds_config came from, for messages (inline ``deepspeed.config`` fields are
    merged over the file)."""
    return f" (deepspeed.config_file={ds.config_file} and deepspeed.config)" \
        if ds.config_file else ""


def fill_auto(ds: DeepSpeedSection, train: TrainConfig, model: ModelConfig,
              parallel: ParallelConfig) -> DeepSpeedSection:
    """The ds_config with every ``"auto"`` filled from ``train.*`` and the model, as the Hugging
    Face Trainer and accelerate fill it (``interop/auto.py``); one note per value."""
    from ..interop.auto import resolve_auto

    cfg, notes = resolve_auto(ds.config, train, model.hidden_size, parallel.dp,
                              error=ConfigError)
    return DeepSpeedSection(ds.config_file, cfg, ds.notes + tuple(notes)) if notes else ds


def review_for_malleus(ds: DeepSpeedSection) -> list[str]:
    """What MalleusEngine does with each key of the ds_config (``interop/config_keys.py``): a note
    per key it ignores, a ConfigError for one it refuses."""
    from ..interop.config_keys import review

    try:
        return review(ds.config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resolve_activation_checkpointing(t: TrainConfig, asked: Any,
                                     ds: DeepSpeedSection) -> TrainConfig:
    """``train.activation_checkpointing`` (true | false | null) resolved against the ds_config:
    null follows the ds_config (on when it enables DeepSpeed's activation checkpointing:
    ``interop.sections.activation_checkpointing_source``); true turns it on either way; false
    with a ds_config that turns it on is a contradiction, refused naming both."""
    try:
        src = activation_checkpointing_source(ds.config)
    except ValueError as e:
        raise ConfigError(f"{e}{ds_source(ds)}") from None
    if asked is False and src is not None:
        raise ConfigError(f"train.activation_checkpointing=false, but the ds_config{ds_source(ds)} "
                          f"turns activation checkpointing on with its {src}; drop "
                          f"train.activation_checkpointing (null follows the ds_config) or take "
                          f"the {src.split('=')[0]} out of the ds_config")
    on = bool(asked) or src is not None
    return replace(t, activation_checkpointing=on) if on != t.activation_checkpointing else t


def activation_checkpointing_note(cfg: RunConfig) -> str | None:
    """The start-up words for ``train.activation_checkpointing`` when it is on (None when off),
    naming the ds_config field when that is what turned it on."""
    if not cfg.train.activation_checkpointing:
        return None
    src = activation_checkpointing_source(cfg.deepspeed.config)
    why = f"the ds_config's {src}" if src is not None else "train.activation_checkpointing=true"
    return (f"activation checkpointing on ({why}): each decoder layer's activations are "
            f"recomputed in backward")


def check_even_batch(t: TrainConfig, p: ParallelConfig, ds: DeepSpeedSection) -> None:
    """Stock DeepSpeed needs the same micro-batch count on every replica, and batch fields in
    the ds_config that agree with ``train.*``. Raises ConfigError otherwise."""
    n = t.num_micro_batches
    if n % p.dp:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} / "
                          f"train.micro_batch_size={t.micro_batch_size} = {n} micro-batches do "
                          f"not split evenly over parallel.dp={p.dp} replicas; use a global batch "
                          f"that is a multiple of {t.micro_batch_size * p.dp}")
    c = ds.config
    from ..interop.compat import batch_keys

    want = batch_keys(t.micro_batch_size, n // p.dp, p.dp)
    for k, v in want.items():
        if k in c and c[k] not in (None, "auto") and c[k] != v:
            raise ConfigError(f"ds_config {k}={c[k]} contradicts the run: train.global_batch_size="
                              f"{t.global_batch_size}, train.micro_batch_size={t.micro_batch_size}, "
                              f"dp={p.dp} give {k}={v}; remove it from the JSON (train.* sets it) "
                              f"or set it to \"auto\"")
