"""The user-facing entry point ``malleus_ds.initialize``: the engine plus the app's defaults.

The engine (``malleus_ds/engine/``) knows no dataset; here, at the edge, a run built without
``data=`` gets the shipped byte corpus (``malleus_ds/data``), seeded by ``malleus.seed``, so
``malleus_ds.initialize(model=..., config=...)`` trains out of the box, as it always has.
"""
from __future__ import annotations


def initialize(model=None, config=None, plan=None, *, data=None, args=None):
    """``malleus_ds.engine.initialize`` (model, ds_config and plan as documented there) with
    ``data`` defaulting to the byte corpus; returns ``(engine, optimizer, None, lr_scheduler)``
    like ``deepspeed.initialize``."""
    from ..data import ByteCorpus
    from ..engine import initialize as engine_initialize

    return engine_initialize(model, config, plan, data=ByteCorpus if data is None else data,
                             args=args)

