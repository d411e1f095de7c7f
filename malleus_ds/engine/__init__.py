"""MalleusEngine and its parts: schedule, groups, tensor_parallel, grad_sync, optimizer, engine.

``initialize`` imports DeepSpeed lazily, so ``import malleus_ds.engine.tensor_parallel`` stays light.
"""
from __future__ import annotations


def initialize(model=None, config=None, plan=None, *, data=None, args=None):
    """Build a :class:`~malleus_ds.engine.engine.MalleusEngine`, shaped like
    ``deepspeed.initialize``: returns ``(engine, optimizer, None, lr_scheduler)``.

    ``model``: a ``ModelConfig``, a whole ``StageModule`` or a stage builder (see MalleusEngine).
    ``config``: a ds_config dict or JSON path, or one decoded already
    (``malleus_ds.interop.ds_config.decode``); its ``"malleus"`` section takes ``plan`` (path,
    JSON object or Plan), ``tp``, ``gpus_per_node``, ``seed``, ``straggler``, ``switch``; the
    adaptive loop's keys (``adaptive``, ``detect``, ``horizon_steps``, ``replan_at``, ...;
    docs/adaptive-loop.md) are passed over to whoever attaches a loop
    (``malleus_ds.initialize`` does: ``app/loop.py``; this engine alone runs none). ``plan`` (a Plan or
    path) overrides ``malleus.plan``. Stock fields honoured: ``optimizer`` (Adam/AdamW),
    ``scheduler``, ``zero_optimization.stage`` (0/1/2), ``gradient_clipping`` (DeepSpeed's default
    is 1.0), ``bf16`` / ``fp16`` (fp32 masters, fp32 gradient sync, loss scaling; see
    ``precision.py``), ``monitor``, ``steps_per_print``, ``wall_clock_breakdown``.
    """
    from .engine import MalleusEngine

    engine = MalleusEngine(model, config, plan, data=data, args=args)
    return engine, engine.optimizer, None, engine.lr_scheduler
