"""engine=deepspeed (stock ZeRO DP and PipelineEngine) computes the reference math.

Per-step losses on 2 gloo ranks equal a single-process ``reference_run`` on the same global
batches (rtol 1e-5 over 10 steps), which also pins DeepSpeed's loss/gradient scaling
(1/GAS, mean over dp) to our global-mean rule and its AdamW to ``OptimConfig``.
"""
from __future__ import annotations

import numpy as np
import pytest

from malleus_ds.models import model_config
from malleus_ds.reference import OptimConfig, reference_run
from tests.dist.harness import run_distributed

STEPS, G, MBS = 10, 8, 1
MODEL = {"name": "tiny", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "max_seq_len": 32}
LR = 3e-3


def _reference(**model):
    cfg = model_config(**{**MODEL, **model})
    losses, _ = reference_run(cfg, seed=3, steps=STEPS, global_batch_size=G, micro_batch_size=MBS,
                              optim=OptimConfig(lr=LR))
    return losses


def _rank_fn(rank, world, pp, ds_file, model=None):
    from pathlib import Path

    from malleus_ds import runners
    from malleus_ds.config import build_run_config

    conf = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"
    d = {"engine": "deepspeed", "model": {**MODEL, **(model or {})}, "progress": False,
         "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": MBS, "seed": 3,
                   "lr": LR},
         "parallel": {"tp": 1, "pp": pp, "dp": None}, "deepspeed": {"config_file": ds_file}}
    cfg = build_run_config(d, world_size=world, ds_search_dirs=(conf,))
    s = runners.run(cfg, runners.DistEnv.from_environ("cpu"))
    return list(s.losses)


@pytest.mark.parametrize("pp,ds_file", [(1, "zero1.json"), (2, "zero1.json"), (1, "zero2.json")],
                         ids=["zero1-dp2", "pipe-pp2", "zero2-dp2"])
def test_deepspeed_matches_reference(pp, ds_file):
    ref = _reference()
    got = run_distributed(_rank_fn, 2, pp, ds_file, timeout=240)
    for r, losses in enumerate(got):
        assert len(losses) == STEPS
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"rank {r}")
    assert ref[-1] < ref[0]  # it trains


def test_pipeline_with_data_parallel_and_uneven_layers_matches_reference():
    # 4 ranks = 2 stages x 2 replicas; 5 layers split 3 + 2 as static_plan does
    ref = _reference(num_layers=5)
    got = run_distributed(_rank_fn, 4, 2, "zero1.json", {"num_layers": 5}, timeout=240)
    for r, losses in enumerate(got):
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"rank {r}")


def _torch_rank_fn(rank, world):
    from malleus_ds import runners
    from malleus_ds.config import build_run_config

    d = {"engine": "torch", "model": MODEL, "progress": False,
         "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": MBS, "seed": 3,
                   "lr": LR}}
    cfg = build_run_config(d, world_size=world)
    return list(runners.run(cfg, runners.DistEnv.from_environ("cpu")).losses)


def test_torch_engine_data_parallel_matches_reference():
    ref = _reference()
    for losses in run_distributed(_torch_rank_fn, 2, timeout=120):
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
