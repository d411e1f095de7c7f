"""``malleus-export`` on hand-made checkpoints (no processes): a MalleusEngine checkpoint of any
plan, TP degree, ZeRO stage, world size and precision (rank files holding exactly the slices
``plan_holdings`` says each rank stores) exports the full tensors under Hugging Face names, bitwise;
engine=torch and engine=deepspeed (pp=1) files too; bad input is one clear line naming the path.
The multi-process round trip through the app is tests/integration/test_hf_roundtrip.py."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from malleus_ds.files.ckpt_format import FORMAT, rank_file
from malleus_ds.app.cli import export_main as main
from malleus_ds.export import ExportError, export_checkpoint, hf_tensors, build_config
from malleus_ds.layout import plan_holdings
from malleus_ds.models.base import param_table
from malleus_ds.models.hf import hf_name, load_hf_model
from malleus_ds.plan import Plan
from malleus_ds.files.ckpt_format import RUN_FORMAT
from tests.cases import plan_json, random_plan

# rank 0: embedding + layer 0; ranks 1-2: a TP2 stage with layers 1-3 + head; rank 3: all layers
HETERO = plan_json([(5, [([0], (0, 1)), ([1, 2], (1, 4))]), (3, [([3], (0, 4))])])


def _model(preset):
    return load_hf_model(preset, max_seq_len=16)


def _state(model, seed=0) -> dict[str, torch.Tensor]:
    """Random full tensors by global name (a tied pair equal, as the engines keep it)."""
    g = torch.Generator().manual_seed(seed)
    out = {s.name: torch.randn(s.shape, generator=g) for s in param_table(model)}
    for a, b in model.tied_params():
        out[b] = out[a].clone()
    return out


def _canonical(t: torch.Tensor, dim) -> torch.Tensor:
    return (t if dim is None else t.movedim(dim, 0)).reshape(-1)


def _run_json(model, engine="malleus", step=3, **kw) -> dict:
    return dict({"format": RUN_FORMAT, "engine": engine, "step": step, "world_size": 1,
                 "global_batch_size": 8, "micro_batch_size": 1, "data_seed": 0,
                 "model": model.describe(), "parallel": {"tp": 1, "pp": 1, "dp": 1},
                 "zero_stage": 0, "precision": "fp32", "data": None}, **kw)


def make_malleus_checkpoint(root: Path, model, state, pj: dict, zero: int, mixed: bool,
                            tag: str = "global_step3") -> Path:
    """What MalleusEngine.save_checkpoint + the app write, by hand: one file per rank holding
    its ``plan_holdings`` slices (parameters in bf16 under ``mixed``, fp32 masters), meta.json,
    run.json, latest."""
    plan = Plan.from_json(pj)
    table = param_table(model)
    world = max(r for p in plan.pipelines for s in p.stages for r in s.ranks)
    world = max([world, *plan.suspended]) + 1
    d = root / tag
    d.mkdir(parents=True)
    meta = {"format": FORMAT, "save_id": 11, "tag": tag, "plan": plan.to_json(),
            "world_size": world, "zero_stage": zero,
            "precision": {"name": "bf16" if mixed else "fp32", "mixed": mixed},
            "num_layers": plan.num_layers, "global_batch_size": plan.global_batch_size,
            "micro_batch_size": plan.micro_batch_size, "adam_step": 3, "global_steps": 3,
            "skipped_steps": 0, "global_samples": 24,
            "params": {s.name: [list(s.shape), s.split_dim] for s in table}}
    flat = {s.name: _canonical(state[s.name], s.split_dim) for s in table}
    slices: dict[int, dict] = {r: {} for r in range(world)}
    for (kind, name), entries in plan_holdings(plan, table, zero, mixed).items():
        for lo, hi, r in entries:
            v = flat[name][lo:hi]
            if kind == "param" and mixed:
                v = v.to(torch.bfloat16)
            elif kind in ("exp_avg", "exp_avg_sq"):
                v = torch.zeros_like(v)
            slices[r][(kind, name, lo, hi)] = v.clone()
    for r in range(world):
        engine = {"adam_step": 0, "global_steps": 0, "skipped_steps": 0, "global_samples": 0,
                  "loss_scaler": None, "lr_scheduler": None, "param_groups": [],
                  "client_state": {}}
        torch.save({"format": FORMAT, "save_id": 11, "rank": r, "meta": meta, "engine": engine,
                    "slices": slices[r]}, rank_file(d, r))
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "run.json").write_text(json.dumps(_run_json(model, world_size=world, zero_stage=zero,
                                                     precision="bf16" if mixed else "fp32")))
    (root / "latest").write_text(tag)
    return d


def _read(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def _expected(model, state) -> dict[str, torch.Tensor]:
    out = {hf_name(n): t for n, t in state.items()}
    if model.tied:
        out.pop("lm_head.weight")
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == torch.float32, k
        assert torch.equal(got[k], want[k]), k


# ----------------------------------------------------------------------------- malleus files


@pytest.mark.parametrize("preset,pj,zero,mixed", [
    ("tiny-llama", HETERO, 1, False),
    ("tiny-qwen2-tied", HETERO, 2, True),
    ("tiny-qwen2", random_plan(random.Random(1), 5, G=12), 0, True),
    ("tiny-qwen2-tied", random_plan(random.Random(4), 3, G=12), 1, False),
], ids=["llama-hetero-tp2-zero1", "tied-hetero-bf16-zero2", "qwen2-random-bf16-zero0",
        "tied-random-zero1"])
def test_any_layout_exports_the_full_tensors(tmp_path, preset, pj, zero, mixed):
    model = _model(preset)
    state = _state(model)
    make_malleus_checkpoint(tmp_path / "ck", model, state, pj, zero, mixed)
    out = export_checkpoint(tmp_path / "ck", tmp_path / "out")
    assert out == tmp_path / "out"
    # bitwise: under bf16 the fp32 masters are exported, not the bf16 parameters
    _assert_same(_read(out), _expected(model, state))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model.model_type
    assert cfg["tie_word_embeddings"] is model.tied
    assert cfg["dtype"] == "float32" and cfg["use_cache"] is True


def test_exported_folder_loads_in_transformers_tied_and_untied(tmp_path):
    from transformers import AutoModelForCausalLM

    for preset in ("tiny-qwen2-tied", "tiny-llama"):
        model = _model(preset)
        state = _state(model, seed=2)
        make_malleus_checkpoint(tmp_path / preset / "ck", model, state, HETERO, 1, False)
        out = export_checkpoint(tmp_path / preset / "ck" / "global_step3", tmp_path / preset / "o")
        lm = AutoModelForCausalLM.from_pretrained(str(out))
        assert type(lm).__name__ == model._lm_cls.__name__
        sd = lm.state_dict()
        for n, t in state.items():
            assert torch.equal(sd[hf_name(n)], t), n
        if model.tied:          # re-tied by transformers: one tensor
            assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
        x = torch.randint(0, model.vocab_size, (2, 8))
        ref = model._lm_cls(build_config(model.describe()))
        ref.load_state_dict(_expected(model, state), strict=not model.tied)
        if model.tied:
            ref.tie_weights()
        with torch.no_grad():
            torch.testing.assert_close(lm(input_ids=x).logits, ref(input_ids=x).logits,
                                       rtol=0, atol=0)


def test_dtype_bf16_and_force(tmp_path):
    model = _model("tiny-llama")
    state = _state(model)
    make_malleus_checkpoint(tmp_path / "ck", model, state, HETERO, 0, False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    (out / "model.safetensors.index.json").write_text("{}")      # an older sharded export
    with pytest.raises(ExportError, match=f"output folder {out} exists and is not empty"):
        export_checkpoint(tmp_path / "ck", out, dtype="bf16")
    export_checkpoint(tmp_path / "ck", out, dtype="bf16", force=True)
    got = _read(out)
    for k, t in _expected(model, state).items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], t.to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "notes.txt").read_text() == "keep"
    assert not (out / "model.safetensors.index.json").exists()
    with pytest.raises(ExportError, match="dtype='int8' must be one of"):
        export_checkpoint(tmp_path / "ck", tmp_path / "o2", dtype="int8")


# ----------------------------------------------------------------------------- other engines


def test_torch_and_deepspeed_checkpoints(tmp_path):
    from malleus_ds.files.ckpt_format import TORCH_FORMAT

    for preset in ("tiny-qwen2-tied", "tiny-llama"):
        model = _model(preset)
        ref = model.build_reference(seed=5)             # HFCausalLM: keys model.<HF name>
        want = _expected(model, ref.global_state_dict())
        d = tmp_path / preset / "torch" / "global_step2"
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps(_run_json(model, engine="torch", step=2)))
        torch.save({"format": TORCH_FORMAT, "step": 2, "model": ref.state_dict(),
                    "optimizer": {}}, d / "torch_state.pt")
        _assert_same(_read(export_checkpoint(d, tmp_path / preset / "o1")), want)

        d = tmp_path / preset / "ds" / "global_step2"
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps(_run_json(model, engine="deepspeed", step=2)))
        torch.save({"module": ref.state_dict(), "ds_version": "0.19"},
                   d / "mp_rank_00_model_states.pt")
        _assert_same(_read(export_checkpoint(d, tmp_path / preset / "o2")), want)
    # pipeline and bf16 DeepSpeed checkpoints are refused, naming the engine
    for kw, msg in (({"parallel": {"tp": 1, "pp": 2, "dp": 1}}, "engine=deepspeed with parallel.pp=2"),
                    ({"precision": "bf16"}, "engine=deepspeed in bf16")):
        d = tmp_path / f"ds{len(msg)}" / "global_step2"
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps(_run_json(model, engine="deepspeed", **kw)))
        with pytest.raises(ExportError, match=msg):
            export_checkpoint(d, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ----------------------------------------------------------------------------- names


def test_name_mapping_tied_and_untied():
    for preset, tied in (("tiny-llama", False), ("tiny-qwen2-tied", True)):
        model = _model(preset)
        state = _state(model)
        got = hf_tensors(state, build_config(model.describe()), "x")
        assert ("lm_head.weight" in got) is not tied
        assert got["model.embed_tokens.weight"] is state["embed.embed_tokens.weight"]
        assert got["model.layers.3.self_attn.q_proj.weight"] is state["blocks.3.self_attn.q_proj.weight"]
        assert got["model.norm.weight"] is state["head.norm.weight"]
        if not tied:
            assert got["lm_head.weight"] is state["head.lm_head.weight"]
        assert len(got) == len(state) - tied
    bad = dict(state)
    bad["blocks.3.mlp.up_proj.weight"] = bad["blocks.3.mlp.up_proj.weight"][:, :8]
    with pytest.raises(ExportError, match=r"x: model.layers.3.mlp.up_proj.weight has shape \(176, 8\)"):
        hf_tensors(bad, build_config(model.describe()), "x")
    del bad["blocks.0.mlp.up_proj.weight"]
    with pytest.raises(ExportError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"):
        hf_tensors(bad, build_config(model.describe()), "x")


# ----------------------------------------------------------------------------- bad input


def _cli_error(capsys, argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("malleus-export: error: "), err
    return err


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert "checkpoint directory /nope/ck does not exist" in _cli_error(capsys, ["/nope/ck", out])
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty'} is not a checkpoint: it has neither run.json" in _cli_error(
        capsys, [tmp_path / "empty", out])
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "latest").write_text("global_step9")
    err = _cli_error(capsys, [tmp_path / "stale", out])
    assert f"names 'global_step9' but {tmp_path / 'stale' / 'global_step9' / 'run.json'} does not" in err
    (tmp_path / "engine_only").mkdir()
    (tmp_path / "engine_only" / "meta.json").write_text("{}")
    assert "has no run.json: a MalleusEngine.save_checkpoint folder" in _cli_error(
        capsys, [tmp_path / "engine_only", out])
    assert not out.exists()

    # our own decoder: export writes Hugging Face folders only
    from malleus_ds.models import model_config

    own = tmp_path / "own" / "global_step1"
    own.mkdir(parents=True)
    rec = dict(_run_json(_model("tiny-llama")), model=model_config("tiny").describe())
    (own / "run.json").write_text(json.dumps(rec))
    err = _cli_error(capsys, [own, out])
    assert f"checkpoint {own} holds malleus_ds's own decoder (model='tiny')" in err
    assert "malleus-export writes Hugging Face folders" in err

    # a malleus checkpoint: out not empty / missing rank file / incomplete slices
    model = _model("tiny-llama")
    d = make_malleus_checkpoint(tmp_path / "ck", model, _state(model), HETERO, 1, False)
    out.mkdir()
    (out / "x").write_text("")
    assert f"output folder {out} exists and is not empty" in _cli_error(capsys, [d, out])
    # every parameter is held by both pipelines: drop TP slice 1 (rank 2) and rank 3's copy
    key = None
    for r in (2, 3):
        f = rank_file(d, r)
        ck = torch.load(f, weights_only=True)
        k = key or next(k for k in ck["slices"] if k[0] == "param" and "q_proj" in k[1])
        key = key or k
        for k2 in [k2 for k2 in ck["slices"] if k2[:2] == key[:2]]:
            del ck["slices"][k2]
        torch.save(ck, f)
    err = _cli_error(capsys, [d, tmp_path / "o3"])
    assert f"{d}: no rank stored elements [({key[2]}, {key[3]})] of {key[1]}" in err
    f.unlink()
    assert f"lacks {f}" in _cli_error(capsys, [d, tmp_path / "o3"])
    (d / "meta.json").unlink()
    assert f"checkpoint {d} has no meta.json" in _cli_error(capsys, [d, tmp_path / "o3"])
    assert not (tmp_path / "o3").exists()


def test_cli_reports_what_it_wrote(tmp_path, capsys):
    model = _model("tiny-qwen2-tied")
    make_malleus_checkpoint(tmp_path / "ck", model, _state(model), HETERO, 1, True)
    assert main([str(tmp_path / "ck"), str(tmp_path / "out"), "--dtype", "fp16"]) == 0
    line = capsys.readouterr().out.strip()
    n = model.num_params()                            # the tied matrix once
    size = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert line == (f"wrote {tmp_path / 'out'}: config.json + model.safetensors, "
                    f"{len(param_table(model).specs) - 1} tensors, {n:,} parameters, {size:,} "
                    f"bytes (fp16) from {tmp_path / 'ck' / 'global_step3'} (engine=malleus, step 3)")
