"""A ds_config decoded once: :func:`decode` reads it (a dict or a JSON path) and checks every
section MalleusEngine decodes itself, in one pass, into a frozen :class:`DsConfig` that the app
builds at its entry and hands to the engine (``MalleusEngine(model, ds_config, ...)``); the engine
decodes a plain dict itself, once.

Pure (no process groups): every rank raises the same error for a bad config before any
collective. The order of the checks is the order of their errors: ``tensor_parallel``
(:func:`~.sections.check_unsupported`), every key against DeepSpeed's table
(:func:`~.config_keys.review`), ``optimizer`` / ``zero_optimization.stage``
(:func:`~.sections.optimizer_settings`), ``scheduler`` (:func:`~.sections.check_scheduler`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .config_keys import review
from .sections import check_scheduler, check_unsupported, load_config, optimizer_settings


@dataclass(frozen=True)
class DsConfig:
    """A ds_config, checked. ``config``: the ds_config itself (a private copy; nothing here or in
    the engine writes to it);
    ``notes``: one line per key MalleusEngine ignores (:func:`~.config_keys.review`);
    ``zero_stage`` and ``make_optimizer`` (parameters -> torch's Adam/AdamW) from ``optimizer``
    and ``zero_optimization`` (:func:`~.sections.optimizer_settings`)."""

    config: dict
    notes: tuple[str, ...]
    zero_stage: int
    make_optimizer: Callable


def decode(config: Any, notes: Sequence[str] | None = None) -> DsConfig:
    """``config`` (a ds_config dict, a path to its JSON file, None for ``{}``, or a
    :class:`DsConfig`, returned as it is) decoded and checked (module doc); a bad section raises
    ValueError naming the key and the value. ``notes``: the review the caller already made of
    the config this one derives from (the app reviews the user's ds_config when it reads it, and
    hands the engine a copy it filled in); None: reviewed here."""
    if isinstance(config, DsConfig):
        return config
    cfg = load_config(config)
    check_unsupported(cfg)
    if notes is None:
        notes = review(cfg)
    zero_stage, make_optimizer = optimizer_settings(cfg)
    check_scheduler(cfg)
    return DsConfig(config=cfg, notes=tuple(notes), zero_stage=zero_stage,
                    make_optimizer=make_optimizer)
