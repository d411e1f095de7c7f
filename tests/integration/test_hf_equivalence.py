"""Hugging Face models through every engine, with the math of one process (issue: bring your own
model). The reference is transformers' own ``*ForCausalLM`` trained by plain PyTorch AdamW
(``reference_run``; its first-step logits equal our stages' bitwise: tests/unit/models/test_hf.py).

* MalleusEngine, 4 gloo ranks: a tiny Llama (untied), a tiny Qwen2 (GQA 4 heads / 2 KV heads,
  q/k/v biases) and a tied-embedding Qwen2, each on a heterogeneous plan (a TP=2 stage beside
  TP=1 stages, 2-stage and 1-stage pipelines, uneven micro-batches) and across a live
  ``switch_plan`` (other stage counts, a suspended rank, a one-stage pipeline holding both tied
  copies): per-step losses equal the reference (rtol 1e-5), final parameters too, and the two
  copies of a tied weight stay identical.
* Stock DeepSpeed: ZeRO data parallel on transformers' own model, and PipelineEngine over the
  generated layer list (TiedLayerSpec for the tied model): the same losses. Its four cases run
  in one ``run_distributed`` call (the ranks are built once, each case's engine in turn).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.cases import plan_json, tp_slice

STEPS, G, EPS, LR = 6, 8, 1e-5, 2e-3
SEQ = 16

# rank 0 = stage 0 (embedding + layer 0), ranks 1-2 = TP2 stage (layers 1-3 + head); rank 3 alone
HETERO = plan_json([(5, [([0], (0, 1)), ([1, 2], (1, 4))]), (3, [([3], (0, 4))])])
# after the switch: 2 stages with other cuts and a one-stage TP2 pipeline; rank 1 suspended
AFTER = plan_json([(3, [([3], (0, 2)), ([0], (2, 4))]), (5, [([2, 1], (0, 4))])])
AFTER_SUSPENDED = plan_json([(6, [([2], (0, 3)), ([0], (3, 4))]), (2, [([3], (0, 4))])],
                            suspended=[1])
CASES = [("tiny-llama", 1, 0.0, AFTER), ("tiny-qwen2", 2, 0.0, AFTER_SUSPENDED),
         ("tiny-qwen2-tied", 1, 1.0, AFTER)]          # clipping: the tied copy counted once
SWITCH_AT = 3


def _model(preset):
    from malleus_ds.models.hf import load_hf_model

    return load_hf_model(preset, max_seq_len=SEQ)


def _ds_config(zero, clip):
    return {"zero_optimization": {"stage": zero}, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}}}


def _malleus(rank, world):
    import malleus_ds
    from malleus_ds.plan import Plan

    out = {}
    for preset, zero, clip, after in CASES:
        eng, *_ = malleus_ds.initialize(model=_model(preset), config=_ds_config(zero, clip),
                                        plan=Plan.from_json(HETERO))
        losses = []
        for step in range(STEPS):
            if step == SWITCH_AT:
                eng.switch_plan(Plan.from_json(after))
            losses.append(eng.train_batch())
        shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
        out[preset] = (losses, shards)
    return out


@functools.lru_cache(maxsize=None)
def _reference(preset, clip=0.0):
    from malleus_ds.app.reference import OptimConfig, reference_run

    return reference_run(_model(preset), seed=0, steps=STEPS, global_batch_size=G,
                         micro_batch_size=1, optim=OptimConfig(lr=LR, eps=EPS), grad_clip=clip)


def test_malleus_engine_on_hf_models_equals_transformers_reference():
    res = run_distributed(_malleus, 4, timeout=300)
    for preset, _zero, clip, _after in CASES:
        ref_losses, ref_sd = _reference(preset, clip)
        assert ref_losses[-1] < ref_losses[0]
        seen = set()
        for rank, per in enumerate(res):
            losses, shards = per[preset]
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5,
                                       err_msg=f"{preset} rank {rank} losses")
            for n, (arr, dim, tr, ts) in shards.items():
                full = tp_slice(ref_sd[n].numpy(), dim, tr, ts)
                err = np.abs(arr - full).max() / np.abs(full).max()
                assert err <= 5e-5, f"{preset} rank {rank} {n}: max rel err {err:.2e}"
                seen.add(n)
            if preset.endswith("tied") and "head.lm_head.weight" in shards \
                    and "embed.embed_tokens.weight" in shards:
                np.testing.assert_array_equal(shards["embed.embed_tokens.weight"][0],
                                              shards["head.lm_head.weight"][0])
        assert seen == set(ref_sd), f"{preset}: held by no rank: {sorted(set(ref_sd) - seen)}"
    # the tied copies on different ranks are bitwise equal too
    emb = [per["tiny-qwen2-tied"][1].get("embed.embed_tokens.weight") for per in res]
    head = [per["tiny-qwen2-tied"][1].get("head.lm_head.weight") for per in res]
    held = [t[0] for t in emb + head if t is not None]
    assert len(held) >= 2
    for t in held[1:]:
        np.testing.assert_array_equal(t, held[0])


#: (preset, pp, activation checkpointing) per case; the plain ZeRO runs first: a
#: PipelineEngine leaves its grid in DeepSpeed's module globals (deepspeed.utils.groups), which a
#: later ZeRO engine in the same process would take for its model parallelism
DS_CASES = {"gqa-zero1-dp2": ("tiny-qwen2", 1, False),
            "gqa-zero1-dp2-recompute": ("tiny-qwen2", 1, True),
            "tied-pipeline-pp2": ("tiny-qwen2-tied", 2, False),
            "tied-pipeline-pp2-recompute": ("tiny-qwen2-tied", 2, True)}
_CALLS = [0]


def _deepspeed(rank, world):
    from pathlib import Path

    import torch

    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    # transformers' decoder layers run here (a pre-hook: recomputes stop early)
    torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, _: _CALLS.__setitem__(0, _CALLS[0]
                                          + type(mod).__name__.endswith("DecoderLayer")))
    conf = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"
    out = {}
    for case, (preset, pp, ac) in DS_CASES.items():
        _CALLS[0] = 0
        d = {"engine": "deepspeed", "progress": False,
             "model": {"name": "hf", "hf_config": preset, "max_seq_len": SEQ},
             "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": 1, "seed": 0,
                       "lr": LR, "eps": EPS, "activation_checkpointing": ac},
             "parallel": {"tp": 1, "pp": pp, "dp": None},
             "deepspeed": {"config_file": "zero1.json"}}
        cfg = build_run_config(d, world_size=world, ds_search_dirs=(conf,))
        out[case] = list(runners.run(cfg, runners.DistEnv.from_environ("cpu")).losses), _CALLS[0]
    return out


@functools.lru_cache(maxsize=1)
def _deepspeed_results():
    return run_distributed(_deepspeed, 2, timeout=300)


@pytest.mark.parametrize("case", ["tied-pipeline-pp2", "gqa-zero1-dp2",
                                  "tied-pipeline-pp2-recompute", "gqa-zero1-dp2-recompute"])
def test_stock_deepspeed_on_hf_models_equals_reference(case):
    """With activation checkpointing (DeepSpeed's over the generated layer list; transformers'
    gradient_checkpointing_enable on its own model under ZeRO) the losses stay the plain
    reference's and every decoder layer runs twice."""
    preset, pp, ac = DS_CASES[case]
    ref, _ = _reference(preset)
    plain = _model(preset).num_layers // pp * G // (2 // pp) * STEPS
    for r, per in enumerate(_deepspeed_results()):
        losses, calls = per[case]
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"{preset} rank {r}")
        assert calls == plain * (2 if ac else 1), (preset, r, calls, plain)
