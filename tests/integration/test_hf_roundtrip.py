"""Hugging Face in, Hugging Face out (issue: malleus-export): a local HF folder (Llama-3 style:
llama3 rope scaling, head_dim != hidden / heads, GQA; transformers' own random init, bf16 in
sharded safetensors) trains 3 steps through the app on 2 gloo ranks with TP=2
(``model=hf_local``), and a tied-embedding Qwen2 preset with PP=2 (``model=hf``); ``malleus-export``
turns each ``checkpoint.dir`` into a folder that ``AutoModelForCausalLM.from_pretrained`` loads,
whose weights and logits equal the one-process reference trained the same 3 steps. The same
layouts built as engines and exported live (``malleus_ds.export_engine``, collective) write the
same tensors bit for bit. The tied model's PP=2 checkpoint then resumes under TP=2 (another plan:
the tied copies reshard like any parameter) and continues the reference's losses."""
from __future__ import annotations

import json

import numpy as np
import torch

from tests.integration.harness import run_distributed

STEPS, G, SEQ, LR, EPS = 3, 8, 16, 1e-3, 1e-5
# model record -> (app model section, parallel)
TP2 = {"tp": 2, "pp": 1, "dp": 1}
PP2 = {"tp": 1, "pp": 2, "dp": 1}


def _hf_folder(d) -> None:
    """A local HF model folder the way real checkpoints come: Llama-3 style (``rope_scaling``
    "llama3", ``head_dim`` 32 != hidden / heads, GQA 4 heads / 2 KV heads) with transformers' own
    random init, saved in bf16 across several safetensors shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from malleus_ds.models.hf import HF_PRESETS

    c = dict(HF_PRESETS["tiny-llama"], num_key_value_heads=2, head_dim=32, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    c.pop("model_type")
    torch.manual_seed(123)
    LlamaForCausalLM(LlamaConfig(**c)).to(torch.bfloat16).save_pretrained(
        str(d), max_shard_size="100KB")
    assert len(list(d.glob("*.safetensors"))) > 1 and (d / "model.safetensors.index.json").is_file()


def _cases(tmp):
    return [("local", {"name": "hf", "hf_path": str(tmp / "src"), "max_seq_len": SEQ}, TP2),
            ("tied", {"name": "hf", "hf_config": "tiny-qwen2-tied", "max_seq_len": SEQ}, PP2)]


def _train(rank, world, tmp):
    """Worker: each case through the app (checkpoint at the end), then as an engine exported live."""
    from malleus_ds import export_engine, initialize
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config
    from malleus_ds.plan import static_plan

    for name, model, par in _cases(tmp):
        d = {"engine": "malleus", "progress": False, "model": model, "parallel": par,
             "train": {"steps": STEPS, "global_batch_size": G, "micro_batch_size": 1, "seed": 0,
                       "lr": LR, "eps": EPS},
             "deepspeed": {"config": {"zero_optimization": {"stage": 1}}},
             "malleus": {"adaptive": False}, "checkpoint": {"dir": str(tmp / f"ck_{name}")}}
        cfg = build_run_config(d, world_size=world)
        runners.run(cfg, runners.DistEnv.from_environ("cpu"))
        plan = static_plan(cfg.model.num_layers, G, 1, par["tp"], par["pp"], par["dp"])
        eng, *_ = initialize(model=cfg.model, plan=plan, config={
            "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}},
            "malleus": {"seed": 0, "adaptive": False}})
        for _ in range(STEPS):
            eng.train_batch()
        assert export_engine(eng, tmp / f"live_{name}") == tmp / f"live_{name}"
    return rank


def _resume(rank, world, tmp):
    """Worker: the tied case's checkpoint (saved under PP=2) continues 2 steps under TP=2."""
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    _, model, _ = _cases(tmp)[1]
    d = {"engine": "malleus", "progress": False, "model": model, "parallel": TP2,
         "train": {"steps": STEPS + 2, "global_batch_size": G, "micro_batch_size": 1, "seed": 0,
                   "lr": LR, "eps": EPS},
         "deepspeed": {"config": {"zero_optimization": {"stage": 1}}},
         "malleus": {"adaptive": False},
         "checkpoint": {"dir": str(tmp / "ck_tied"), "resume": True}}
    return list(runners.run(build_run_config(d, world_size=world),
                            runners.DistEnv.from_environ("cpu")).losses)


def _reference(model, steps=STEPS):
    from malleus_ds.app.reference import OptimConfig, reference_run

    losses, sd = reference_run(model, seed=0, steps=steps, global_batch_size=G,
                               micro_batch_size=1, optim=OptimConfig(lr=LR, eps=EPS))
    return losses, sd


def test_train_export_from_pretrained_equals_reference(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.cli import export_main as main
    from malleus_ds.models.hf import hf_name

    _hf_folder(tmp_path / "src")
    assert run_distributed(_train, 2, tmp_path, timeout=240) == [0, 1]
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    for name, model_d, _ in _cases(tmp_path):
        out = tmp_path / f"hf_{name}"
        assert main([str(tmp_path / f"ck_{name}"), str(out)]) == 0
        assert f"wrote {out}: config.json + model.safetensors" in capsys.readouterr().out
        model = build_run_config({"model": model_d}, world_size=1).model
        _, ref_sd = _reference(model)
        got = load_file(str(out / "model.safetensors"))
        assert ("lm_head.weight" in got) is not model.tied
        assert len(got) == len(ref_sd) - model.tied
        init = model.build_reference(seed=0).global_state_dict()
        for n, want in ref_sd.items():
            if model.tied and n == "head.lm_head.weight":
                continue
            # fp32 re-ordering (TP / pipeline sums) only: ~3e-8 absolute, while the 3 steps moved
            # the weights by ~3e-3
            err = (got[hf_name(n)] - want).abs().max() / want.abs().max()
            assert err <= 2e-5, f"{name} {n}: max rel err {err:.2e}"
            assert (want - init[n]).abs().max() > 1e-3, f"{name} {n}: not trained"
        # the live export of the same layout: the same tensors, bit for bit
        live = load_file(str(tmp_path / f"live_{name}" / "model.safetensors"))
        assert sorted(live) == sorted(got)
        for k in got:
            assert torch.equal(live[k], got[k]), f"{name} {k}"
        assert json.loads((tmp_path / f"live_{name}" / "config.json").read_text()) == \
            json.loads((out / "config.json").read_text())

        hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        ref = model.build_reference(seed=0).eval()
        ref.model.load_state_dict({hf_name(n): v for n, v in ref_sd.items()})
        with torch.no_grad():
            np.testing.assert_allclose(hf(input_ids=x).logits.numpy(), ref(x).numpy(),
                                       rtol=1e-5, atol=5e-6, err_msg=name)
    # the tied PP=2 checkpoint resumes under TP=2 and continues the one-process losses
    tied = build_run_config({"model": _cases(tmp_path)[1][1]}, world_size=1).model
    want, _ = _reference(tied, STEPS + 2)
    for r, got_losses in enumerate(run_distributed(_resume, 2, tmp_path, timeout=240)):
        np.testing.assert_allclose(got_losses, want[STEPS:], rtol=1e-5, err_msg=f"rank {r}")
    # the hf_local source's generation config travels along; the preset has no source folder
    assert (tmp_path / "hf_local" / "generation_config.json").is_file()
    assert not (tmp_path / "hf_tied" / "generation_config.json").exists()
