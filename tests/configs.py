"""A run config for tests: the app's defaults for a tiny model, with sections overridden."""
from malleus_ds.app.config import build_run_config


def cfg(world=2, **sections):
    d = {"engine": "torch", "model": {"name": "tiny"},
         "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 1},
         "parallel": {"tp": 1, "pp": 1, "dp": None}}
    for k, v in sections.items():
        d[k] = {**d[k], **v} if isinstance(d.get(k), dict) and isinstance(v, dict) else v
    return build_run_config(d, world_size=world)
