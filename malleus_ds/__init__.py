"""malleus_ds: straggler-resilient non-uniform hybrid parallelism (Malleus) on DeepSpeed.

Kept light: importing ``malleus_ds`` imports neither torch nor deepspeed. Names below load on
first use:

- ``malleus_ds.initialize(model=..., config=ds_config, ...)`` — shaped like
  ``deepspeed.initialize``, the engine picked from the model (``malleus_ds.app.api``): a plain
  ``torch.nn.Module`` trains data parallel under DeepSpeed's own ZeRO-0/1/2/3 with each step's
  batch split across ranks by speed (``MalleusDPEngine``, ``malleus_ds/dp/``; DeepSpeed's
  ``optimizer``, ``model_parameters``, ``training_data``, ... keywords); a ``ModelConfig`` /
  ``HFModel`` / ``StageModule`` gets MalleusEngine, pipelines and TP by ``plan=``, re-planned and
  migrated (the shipped byte corpus is the default ``data=``);
- ``malleus_ds.export_engine(engine, out_dir)`` — a running engine as a Hugging Face folder
  (collective; ``malleus_ds/export/``);
- ``malleus_ds.build_run_config`` / ``RunConfig`` — the app's validated run configuration;
- ``malleus_ds.Plan`` / ``Problem`` / ``static_plan`` — the plan contract (DESIGN.md §3).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "initialize": ("malleus_ds.app.api", "initialize"),
    "export_engine": ("malleus_ds.export", "export_engine"),
    "build_run_config": ("malleus_ds.app.config", "build_run_config"),
    "RunConfig": ("malleus_ds.app.config", "RunConfig"),
    "ConfigError": ("malleus_ds.app.config", "ConfigError"),
    "Plan": ("malleus_ds.plan", "Plan"),
    "Problem": ("malleus_ds.problem", "Problem"),
    "static_plan": ("malleus_ds.plan", "static_plan"),
}


def __getattr__(name: str):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'malleus_ds' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
