"""The ds_config is decoded once per rank (``interop/ds_config.py``): building an engine the way
the app does, through ``malleus_ds.initialize`` and through the app's engine=malleus runner,
runs the key review, the optimizer decoder and the scheduler check once each. One gloo rank in
a process of its own (the harness), counting the calls there."""
from __future__ import annotations

import pytest

from malleus_ds.interop.ds_config import DsConfig, decode

SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                         "warmup_num_steps": 2}}
COUNTED = ("review", "optimizer_settings", "check_scheduler")


def _count_calls() -> dict[str, int]:
    """Every module of the package that holds one of :data:`COUNTED` gets a counting wrapper
    (function-level imports read the defining module's, which is wrapped too)."""
    import sys

    import malleus_ds.app.api  # noqa: F401  (every holder loaded before the wrapping)
    import malleus_ds.app.config  # noqa: F401
    import malleus_ds.app.runners.malleus_runner  # noqa: F401
    import malleus_ds.engine.engine  # noqa: F401
    from malleus_ds.interop import config_keys, sections

    counts = dict.fromkeys(COUNTED, 0)
    originals = {"review": config_keys.review,
                 "optimizer_settings": sections.optimizer_settings,
                 "check_scheduler": sections.check_scheduler}

    def counted(name, f):
        def call(*a, **k):
            counts[name] += 1
            return f(*a, **k)
        return call

    for mod in [m for n, m in sys.modules.items() if n.startswith("malleus_ds")]:
        for name, f in originals.items():
            if getattr(mod, name, None) is f:
                setattr(mod, name, counted(name, f))
    return counts


def _build(rank, world, path):
    counts = _count_calls()
    if path == "initialize":
        import malleus_ds
        from malleus_ds.plan import Plan
        from tests.cases import CFG, ds_config, plan_json

        malleus_ds.initialize(model=CFG, config=dict(ds_config(1), scheduler=SCHED),
                              plan=Plan.from_json(plan_json([(2, [([0], (0, 4))])], G=2)))
    else:
        import tempfile

        from malleus_ds.app import runners
        from malleus_ds.app.config import build_run_config
        from malleus_ds.app.runners.base import DistEnv

        with tempfile.TemporaryDirectory() as run_dir:
            c = build_run_config(
                {"engine": "malleus", "plan": "static", "model": {"name": "tiny"},
                 "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1},
                 "deepspeed": {"config": {"zero_optimization": {"stage": 1},
                                          "scheduler": SCHED}}},
                world_size=1, run_dir=run_dir)
            runners.run(c, DistEnv.from_environ(c.device))
    return counts


@pytest.mark.parametrize("path", ["initialize", "runner"])
def test_the_ds_config_is_decoded_once_per_rank(path):
    from tests.integration.harness import run_distributed

    [counts] = run_distributed(_build, 1, path)
    assert counts == dict.fromkeys(COUNTED, 1)


def test_decode_checks_in_order_and_passes_a_decoded_one_through():
    ds = decode({"zero_optimization": {"stage": 2}, "wall_clock_breakdown": True})
    assert isinstance(ds, DsConfig) and ds.zero_stage == 2 and decode(ds) is ds
    assert any("wall_clock_breakdown" in n for n in ds.notes)
    assert decode(None).config == {} and decode({}, notes=["given"]).notes == ("given",)
    with pytest.raises(ValueError, match="tensor_parallel.autotp_size=2"):
        decode({"tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "SGD"}})
    with pytest.raises(ValueError, match="optimizer.type='SGD'"):
        decode({"optimizer": {"type": "SGD"}, "scheduler": {"type": "Nope"}})
    with pytest.raises(ValueError, match="scheduler.type='Nope'"):
        decode({"scheduler": {"type": "Nope"}})
