"""The user-facing entry point ``malleus_ds.initialize``: the engine plus the app's defaults.

The engine (``malleus_ds/engine/``) knows no dataset and no loop; here, at the edge, a run built
without ``data=`` gets the shipped byte corpus (``malleus_ds/data``), seeded by
``malleus.seed``, so ``malleus_ds.initialize(model=..., config=...)`` trains out of the box, and
the adaptive loop is attached (``app/loop.py``; its ``malleus.*`` settings are checked before
the engine is built, so a bad one fails on every rank before any collective).
"""
from __future__ import annotations


def initialize(model=None, config=None, plan=None, *, data=None, args=None):
    """``malleus_ds.engine.initialize`` (model, ds_config and plan as documented there) with
    ``data`` defaulting to the byte corpus and the adaptive loop attached; returns
    ``(engine, optimizer, None, lr_scheduler)`` like ``deepspeed.initialize``."""
    from ..adaptive.settings import AdaptiveSettings
    from ..data import ByteCorpus
    from ..engine import initialize as engine_initialize
    from ..interop.auto import auto_paths
    from ..interop.ds_config import decode
    from ..interop.sections import load_config
    from .loop import attach_loop

    cfg = load_config(config)
    auto = auto_paths(cfg)
    if auto:
        raise ValueError(f"ds_config {', '.join(auto)}=\"auto\": malleus_ds.initialize "
                         f"takes the values themselves (\"auto\" is filled by the Hugging "
                         f"Face Trainer or accelerate from their arguments, and by "
                         f"launch/train.py from train.*); set them")
    notes = _notes(cfg)
    sec = cfg.get("malleus")
    settings = AdaptiveSettings.from_config(sec if isinstance(sec, dict) else {})
    ds = decode(cfg, notes)             # the ds_config, decoded once; the engine takes it
    out = engine_initialize(model, ds, plan, data=ByteCorpus if data is None else data,
                            args=args)
    attach_loop(out[0], settings)
    return out


def _notes(cfg: dict) -> list[str]:
    """What MalleusEngine does with the ds_config's keys (``interop/config_keys.py``): a config it
    cannot honour fails here, on every rank, before any collective; rank 0 (``RANK``) prints a
    line per key it ignores. Returns the notes."""
    import os

    from ..interop.config_keys import review

    notes = review(cfg)
    if os.environ.get("RANK", "0") == "0":
        for n in notes:
            print(f"[malleus_ds] note: {n}", flush=True)
    return notes
