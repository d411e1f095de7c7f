"""engine=deepspeed (stock ZeRO DP and PipelineEngine) computes the reference math.

Per-step losses on 2 gloo ranks equal a single-process ``reference_run`` on the same global
batches (rtol 1e-5 over 10 steps), which also pins DeepSpeed's loss/gradient scaling
(1/GAS, mean over dp) to our global-mean rule and its AdamW to ``OptimConfig``; with
``train.activation_checkpointing`` too (engine=deepspeed and engine=torch), where every decoder
layer is counted running twice.
"""
from __future__ import annotations

import numpy as np
import pytest

from malleus_ds.models import model_config
from malleus_ds.app.reference import OptimConfig, reference_run
from tests.integration.harness import run_distributed

STEPS, G, MBS = 10, 8, 1
MODEL = {"name": "tiny", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "max_seq_len": 32}
LR = 3e-3


def _reference(**model):
    cfg = model_config(**{**MODEL, **model})
    losses, _ = reference_run(cfg, seed=3, steps=STEPS, global_batch_size=G, micro_batch_size=MBS,
                              optim=OptimConfig(lr=LR))
    return losses


def count_block_calls():
    """Count every decoder layer call of our model in this process (``ModelConfig.run_block``,
    what StageModule and the pipeline's PipeLayer call): with activation checkpointing each layer
    runs twice per micro-batch, its forward and its recompute. Returns the counter."""
    from malleus_ds.models.llama import ModelConfig

    calls = [0]
    run = ModelConfig.run_block

    def counted(block, x, ctx):
        calls[0] += 1
        return run(block, x, ctx)

    ModelConfig.run_block = staticmethod(counted)
    return calls


def _rank_fn(rank, world, pp, ds_file, model=None, ac=False):
    from pathlib import Path

    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    calls = count_block_calls()
    conf = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"
    d = {"engine": "deepspeed", "model": {**MODEL, **(model or {})}, "progress": False,
         "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": MBS, "seed": 3,
                   "lr": LR, "activation_checkpointing": ac},
         "parallel": {"tp": 1, "pp": pp, "dp": None}, "deepspeed": {"config_file": ds_file}}
    cfg = build_run_config(d, world_size=world, ds_search_dirs=(conf,))
    s = runners.run(cfg, runners.DistEnv.from_environ("cpu"))
    return list(s.losses), calls[0]


@pytest.mark.parametrize("pp,ds_file,ac", [(1, "zero1.json", False), (2, "zero1.json", False),
                                           (1, "zero2.json", False), (1, "zero1.json", True),
                                           (2, "zero1.json", True)],
                         ids=["zero1-dp2", "pipe-pp2", "zero2-dp2", "zero1-dp2-recompute",
                              "pipe-pp2-recompute"])
def test_deepspeed_matches_reference(pp, ds_file, ac):
    """With ``train.activation_checkpointing`` (torch.utils.checkpoint under ZeRO,
    ``PipelineModule(activation_checkpoint_interval=1)`` in the pipeline) the losses are those of
    the plain reference, and every layer call happens twice."""
    ref = _reference()
    got = run_distributed(_rank_fn, 2, pp, ds_file, None, ac, timeout=240)
    # each rank: its layers (4 / pp) x its micro-batches (8 / dp) x steps, twice when recomputed
    per_rank = MODEL["num_layers"] // pp * (G // MBS // (2 // pp)) * STEPS
    for r, (losses, calls) in enumerate(got):
        assert len(losses) == STEPS
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"rank {r}")
        assert calls == per_rank * (2 if ac else 1), (r, calls)
    assert ref[-1] < ref[0]  # it trains


def test_pipeline_with_data_parallel_and_uneven_layers_matches_reference():
    # 4 ranks = 2 stages x 2 replicas; 5 layers split 3 + 2 as static_plan does
    ref = _reference(num_layers=5)
    got = run_distributed(_rank_fn, 4, 2, "zero1.json", {"num_layers": 5}, timeout=240)
    for r, (losses, _) in enumerate(got):
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"rank {r}")


def _torch_rank_fn(rank, world, ac=False):
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    calls = count_block_calls()
    d = {"engine": "torch", "model": MODEL, "progress": False,
         "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": MBS, "seed": 3,
                   "lr": LR, "activation_checkpointing": ac}}
    cfg = build_run_config(d, world_size=world)
    return list(runners.run(cfg, runners.DistEnv.from_environ("cpu")).losses), calls[0]


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "recompute"])
def test_torch_engine_data_parallel_matches_reference(ac):
    ref = _reference()
    for losses, calls in run_distributed(_torch_rank_fn, 2, ac, timeout=120):
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        assert calls == MODEL["num_layers"] * G // 2 * STEPS * (2 if ac else 1)
