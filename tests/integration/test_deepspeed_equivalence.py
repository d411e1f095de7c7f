"""engine=deepspeed (stock ZeRO DP and PipelineEngine) computes the reference math.

Per-step losses on 2 gloo ranks equal a single-process ``reference_run`` on the same global
batches (rtol 1e-5 over 10 steps), which also pins DeepSpeed's loss/gradient scaling
(1/GAS, mean over dp) to our global-mean rule and its AdamW to ``OptimConfig``; with
``train.activation_checkpointing`` too (engine=deepspeed and engine=torch), where every decoder
layer is counted running twice.

Every 2-rank case runs in one ``run_distributed`` call (the ranks are built once, each case's
engine in turn); the tests compare its results.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from malleus_ds.models import model_config
from malleus_ds.app.reference import OptimConfig, reference_run
from tests.integration.harness import run_distributed

#: the shared run and the 4-rank case take 20 s or more on 2 cores
pytestmark = pytest.mark.slow

STEPS, G, MBS = 10, 8, 1
MODEL = {"name": "tiny", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "max_seq_len": 32}
LR = 3e-3


@functools.lru_cache(maxsize=None)
def _reference(num_layers=None):
    cfg = model_config(**{**MODEL, **({"num_layers": num_layers} if num_layers else {})})
    losses, _ = reference_run(cfg, seed=3, steps=STEPS, global_batch_size=G, micro_batch_size=MBS,
                              optim=OptimConfig(lr=LR))
    return losses


def count_block_calls():
    """Count every decoder layer call of our model in this process (``ModelConfig.run_block``,
    what StageModule and the pipeline's PipeLayer call): with activation checkpointing each layer
    runs twice per micro-batch, its forward and its recompute. Returns the counter (one per
    process, patched in once; set ``counter[0] = 0`` to count afresh)."""
    from malleus_ds.models.llama import ModelConfig

    run = ModelConfig.run_block
    if hasattr(run, "calls"):
        return run.calls
    calls = [0]

    def counted(block, x, ctx):
        calls[0] += 1
        return run(block, x, ctx)

    counted.calls = calls
    ModelConfig.run_block = staticmethod(counted)
    return calls


def _job(world, engine, pp=1, ds_file="zero1.json", model=None, ac=False):
    """This rank's per-step losses and decoder layer calls of one run of the app's runner."""
    from pathlib import Path

    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    calls = count_block_calls()
    calls[0] = 0
    conf = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"
    d = {"engine": engine, "model": {**MODEL, **(model or {})}, "progress": False,
         "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": MBS, "seed": 3,
                   "lr": LR, "activation_checkpointing": ac}}
    if engine == "deepspeed":
        d |= {"parallel": {"tp": 1, "pp": pp, "dp": None}, "deepspeed": {"config_file": ds_file}}
    cfg = build_run_config(d, world_size=world, ds_search_dirs=(conf,))
    s = runners.run(cfg, runners.DistEnv.from_environ("cpu"))
    return list(s.losses), calls[0]


#: every 2-rank case: (pp, ds_config file, activation checkpointing)
DS_CASES = {"zero1-dp2": (1, "zero1.json", False), "pipe-pp2": (2, "zero1.json", False),
            "zero2-dp2": (1, "zero2.json", False), "zero1-dp2-recompute": (1, "zero1.json", True),
            "pipe-pp2-recompute": (2, "zero1.json", True)}
TORCH_CASES = {"plain": False, "recompute": True}


def _two_ranks(rank, world):
    # the pipelines last: a PipelineEngine leaves its grid in DeepSpeed's module globals
    # (deepspeed.utils.groups), which a later ZeRO engine in the same process would take for its
    # model parallelism (the app runs one job per process)
    order = sorted(DS_CASES, key=lambda k: DS_CASES[k][0] > 1)
    out = {("torch", k): _job(world, "torch", ac=ac) for k, ac in TORCH_CASES.items()}
    out |= {("deepspeed", k): _job(world, "deepspeed", *DS_CASES[k][:2], ac=DS_CASES[k][2])
            for k in order}
    return out


@functools.lru_cache(maxsize=1)
def _results():
    return run_distributed(_two_ranks, 2, timeout=300)


@pytest.mark.parametrize("case", list(DS_CASES))
def test_deepspeed_matches_reference(case):
    """With ``train.activation_checkpointing`` (torch.utils.checkpoint under ZeRO,
    ``PipelineModule(activation_checkpoint_interval=1)`` in the pipeline) the losses are those of
    the plain reference, and every layer call happens twice."""
    pp, _ds_file, ac = DS_CASES[case]
    ref = _reference()
    # each rank: its layers (4 / pp) x its micro-batches (8 / dp) x steps, twice when recomputed
    per_rank = MODEL["num_layers"] // pp * (G // MBS // (2 // pp)) * STEPS
    for r, res in enumerate(_results()):
        losses, calls = res["deepspeed", case]
        assert len(losses) == STEPS
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"rank {r}")
        assert calls == per_rank * (2 if ac else 1), (r, calls)
    assert ref[-1] < ref[0]  # it trains


def _four_ranks(rank, world):
    return _job(world, "deepspeed", 2, "zero1.json", {"num_layers": 5})


def test_pipeline_with_data_parallel_and_uneven_layers_matches_reference():
    # 4 ranks = 2 stages x 2 replicas; 5 layers split 3 + 2 as static_plan does
    ref = _reference(num_layers=5)
    got = run_distributed(_four_ranks, 4, timeout=240)
    for r, (losses, _) in enumerate(got):
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"rank {r}")


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_torch_engine_data_parallel_matches_reference(case):
    ac = TORCH_CASES[case]
    ref = _reference()
    for res in _results():
        losses, calls = res["torch", case]
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        assert calls == MODEL["num_layers"] * G // 2 * STEPS * (2 if ac else 1)
