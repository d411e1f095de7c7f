"""A DeepSpeed user's own run continues under engine=malleus: their script trains transformers'
``LlamaForCausalLM`` (loaded from a local Hugging Face folder) with stock DeepSpeed ZeRO-1 on 2
ranks, its own loss and loop, and calls ``engine.save_checkpoint`` at step N; a
``malleus_ds.initialize`` engine over the same folder loads that DeepSpeed folder
(``engine.load_checkpoint``) on 4 ranks under a non-uniform TP=2 plan, and its losses of steps
N+1..N+M equal the user's DeepSpeed run going on (the Hugging Face names ``model.layers.0...``
mapped to ours, the weights, Adam's moments and step, the LR schedule carried). So do the app's
(``launch/train.py engine=malleus checkpoint.dir=<their folder> checkpoint.resume=true``): the
folder has no run.json, and the step comes from DeepSpeed's tag."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import torch

from tests.integration.harness import run_distributed
from tests.integration.test_deepspeed_checkpoint_import import M, N, SCHED, _other_plan

G, SEQ = 8, 16
OPT = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                   "weight_decay": 0.0, "torch_adam": True}}


def _cfg(src, world):
    from malleus_ds.app.config import build_run_config

    return build_run_config({"engine": "malleus", "model": {"name": "hf", "hf_path": str(src),
                                                            "max_seq_len": SEQ},
                             "train": {"steps": N + M, "global_batch_size": G,
                                       "micro_batch_size": 1, "seed": 3}},
                            world_size=world)


#: the user's ds_config (no gradient_clipping: DeepSpeed clips at 1.0, and so does the app
#: reading it from their file)
DS_CONFIG = {"train_batch_size": G, "train_micro_batch_size_per_gpu": 1,
             "zero_optimization": {"stage": 1}, "optimizer": OPT, "scheduler": SCHED,
             "steps_per_print": 10**9}


def _users_deepspeed_run(rank, world, src, ck):
    """The user's script: their model, their loss, their loop; a save at step N."""
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from malleus_ds.app.runners.common import replica_micro_batches
    from malleus_ds.data import build_dataset

    cfg = _cfg(src, world)                      # the same samples in the same order
    data = build_dataset(cfg)
    model = LlamaForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                   config=DS_CONFIG)
    losses = []
    for step in range(N + M):
        total = torch.zeros((), dtype=torch.float64)
        for ids in replica_micro_batches(cfg, step, rank, world):
            x, y = data.batch(ids)
            logits = eng(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            eng.backward(loss)
            eng.step()
            total += loss.detach().double()
        dist.all_reduce(total)
        losses.append(float(total) / (G))
        if step + 1 == N:
            eng.save_checkpoint(str(ck))
    return losses


def _malleus_continues(rank, world, src, ck, plan):
    from malleus_ds import initialize
    from malleus_ds.data import build_dataset
    from malleus_ds.plan import Plan

    cfg = _cfg(src, world)
    config = {k: v for k, v in DS_CONFIG.items() if not k.startswith("train_")}
    eng, *_ = initialize(model=cfg.model, plan=Plan.load(plan), data=build_dataset(cfg),
                         config=dict(config, malleus={"seed": 3, "adaptive": False}))
    eng.load_checkpoint(str(ck))
    return eng.global_steps, [eng.train_batch(step=s) for s in range(N, N + M)]


def _app_continues(rank, world, src, ck, plan, ds_file):
    """``launch/train.py engine=malleus deepspeed.config_file=<theirs> checkpoint.dir=<theirs>
    checkpoint.resume=true plan=...``: the batch from their ds_config too."""
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    cfg = build_run_config({
        "engine": "malleus", "progress": False, "plan": str(plan),
        "model": {"name": "hf", "hf_path": str(src), "max_seq_len": SEQ},
        "train": {"steps": N + M, "seed": 3},
        "deepspeed": {"config_file": str(ds_file)}, "malleus": {"adaptive": False},
        "checkpoint": {"dir": str(ck), "resume": True, "background": False}}, world_size=world)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = list(runners.run(cfg, runners.DistEnv.from_environ("cpu")).losses)
    return losses, out.getvalue()


def test_a_users_hf_llama_deepspeed_checkpoint_continues_under_malleus(tmp_path):
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from malleus_ds.models.hf import HF_PRESETS

    src = tmp_path / "llama"
    c = dict(HF_PRESETS["tiny-llama"], max_position_embeddings=SEQ)
    c.pop("model_type")
    torch.manual_seed(7)
    LlamaForCausalLM(LlamaConfig(**c)).save_pretrained(str(src))
    ck = tmp_path / "ck"
    full = run_distributed(_users_deepspeed_run, 2, src, ck, timeout=300)[0]
    assert (ck / f"global_step{N}").is_dir()
    assert not (ck / f"global_step{N}" / "run.json").exists()
    app_ck = tmp_path / "app_ck"
    shutil.copytree(ck, app_ck)
    got = run_distributed(_malleus_continues, 4, src, ck, _other_plan(tmp_path), timeout=300)
    for r, (steps, losses) in enumerate(got):
        assert steps == N
        np.testing.assert_allclose(losses, full[N:], rtol=2e-5, err_msg=f"rank {r}")
    ds_file = tmp_path / "ds_config.json"
    ds_file.write_text(json.dumps(DS_CONFIG))
    got = run_distributed(_app_continues, 4, src, app_ck, _other_plan(tmp_path), ds_file,
                          timeout=300)
    for r, (losses, _) in enumerate(got):
        np.testing.assert_allclose(losses, full[N:], rtol=2e-5, err_msg=f"rank {r}")
    assert "has no run.json (your own script saved it)" in got[0][1]
