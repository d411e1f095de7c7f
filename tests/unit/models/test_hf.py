"""The Hugging Face adapter (malleus_ds/models/hf.py) without processes: our stages run
transformers' own layers and equal ``*ForCausalLM`` bitwise; names, TP plan, tied copies, loading
a local folder (only the files a stage needs), and the configuration errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from malleus_ds.app.config import ConfigError, build_run_config
from malleus_ds.models.base import EMBED, HEAD, StageModule, param_table
from malleus_ds.models.hf import HF_PRESETS, global_name, hf_name, load_hf_model

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen2-tied", "tiny-mistral"]


@pytest.mark.parametrize("preset", TINY)
def test_stages_equal_transformers_forward(preset):
    m = load_hf_model(preset)
    ref = m.build_reference(seed=5)
    x = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    want = ref(x)
    whole = StageModule(m, 0, m.num_layers, 5)
    assert torch.equal(whole(x), want)
    parts = [StageModule(m, a, b, 5) for a, b in ((0, 1), (1, 3), (3, m.num_layers))]
    h = x
    for p in parts:                     # hidden states only between stages
        h = p(h)
    assert torch.equal(h, want)


@pytest.mark.parametrize("preset", TINY)
def test_param_table_matches_transformers_names(preset):
    m = load_hf_model(preset)
    table = param_table(m)
    ref = m.build_reference(seed=0)
    hf = dict(ref.model.named_parameters(remove_duplicate=False))
    assert {hf_name(s.name) for s in table} == set(hf)
    for s in table:
        assert tuple(hf[hf_name(s.name)].shape) == s.shape, s.name
        assert global_name(hf_name(s.name)) == s.name
    sd = ref.global_state_dict()
    assert set(sd) == {s.name for s in table}
    split = {s.name.split(".", 2)[2]: s.split_dim for s in table if s.owner == 0}
    assert split["self_attn.q_proj.weight"] == 0 and split["self_attn.o_proj.weight"] == 1
    assert split["mlp.down_proj.weight"] == 1 and split["input_layernorm.weight"] is None
    if "qwen2" in preset:              # q/k/v biases split with their output features
        assert split["self_attn.k_proj.bias"] == 0
    assert m.tied_params() == ((("embed.embed_tokens.weight", "head.lm_head.weight"),)
                               if preset.endswith("tied") else ())


def test_tied_copies_start_equal_and_reference_is_tied():
    m = load_hf_model("tiny-qwen2-tied")
    emb, head = m.build_layer(EMBED, 3), m.build_layer(HEAD, 3)
    assert torch.equal(emb.embed_tokens.weight, head.lm_head.weight)
    ref = m.build_reference(3).model
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert m.num_params() == sum(p.numel() for p in ref.parameters())


def test_tp_must_divide_kv_heads_and_row_biases_refused():
    q = load_hf_model("tiny-qwen2")            # 4 heads, 2 KV heads
    q.check_tp(2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*whole KV heads"):
        q.check_tp(4, "pipelines[0].stages[0]")
    biased = load_hf_model("tiny-llama")
    biased.hf_config.attention_bias = True
    biased = type(biased)(biased.hf_config, name="biased")
    biased.check_tp(1)
    with pytest.raises(ValueError, match=r"self_attn.o_proj.bias.*only TP=1"):
        biased.check_tp(2)


def _save_folder(tmp_path: Path, preset: str, shard_kb: int | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(HF_PRESETS[preset])
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path / preset
    kw = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    model.save_pretrained(out, **kw)
    return out


def test_local_folder_loads_weights_and_opens_only_needed_files(tmp_path, monkeypatch):
    folder = _save_folder(tmp_path, "tiny-llama", shard_kb=200)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 2 and (folder / "model.safetensors.index.json").is_file()
    m = load_hf_model(hf_path=str(folder))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder)
    x = torch.randint(0, 256, (1, 12))
    assert torch.allclose(StageModule(m, 0, m.num_layers, 0)(x), hf(input_ids=x).logits,
                          rtol=0, atol=1e-6)
    import safetensors

    opened = []
    real = safetensors.safe_open

    def spy(f, *a, **k):
        opened.append(Path(f).name)
        return real(f, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    m2 = load_hf_model(hf_path=str(folder))
    m2.build_layer(3, seed=0)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    need = {index[k] for k in index if k.startswith("model.layers.3.")}
    assert set(opened) == need and len(need) < len(files)
    st = m2.load_stats                  # what the app's start-up line reports
    assert st["tensors"] == sum(k.startswith("model.layers.3.") for k in index)
    assert {Path(f).name for f in st["files"]} == need and st["of_files"] == len(files)
    assert st["bytes"] == sum(p.numel() * 4 for p in m2.build_layer(3, seed=0).parameters())


def test_tied_folder_without_lm_head_loads(tmp_path):
    folder = _save_folder(tmp_path, "tiny-qwen2-tied")
    m = load_hf_model(hf_path=str(folder))
    assert m.tied
    emb, head = m.build_layer(EMBED, 0), m.build_layer(HEAD, 0)
    assert torch.equal(emb.embed_tokens.weight, head.lm_head.weight)


def _run_config(model: dict, **kw):
    return build_run_config({"engine": "malleus", "model": model, **kw}, world_size=2)


def test_long_context_configs_default_to_2048_token_samples(tmp_path, capsys):
    """A Llama 3 config says max_position_embeddings=131072: without model.max_seq_len the
    samples are 2048 tokens (said on the start-up line), not 131072; a set value wins, and a
    Mistral with a 4096-token sliding window trains by default."""
    from malleus_ds.models.hf import DEFAULT_MAX_SEQ_LEN

    f = tmp_path / "config.json"
    f.write_text(json.dumps(dict(HF_PRESETS["tiny-llama"], max_position_embeddings=131072)))
    m = _run_config({"name": "hf", "hf_config": str(f)}).model
    assert m.max_seq_len == DEFAULT_MAX_SEQ_LEN == 2048
    assert m.seq_len_note == ("model.max_seq_len=2048 (the default; the config allows 131072: "
                              "set model.max_seq_len to train longer samples)")
    m = _run_config({"name": "hf", "hf_config": str(f), "max_seq_len": 8192}).model
    assert m.max_seq_len == 8192 and m.seq_len_note is None
    m = _run_config({"name": "hf", "hf_config": "tiny-llama"}).model     # 64: under the cap
    assert m.max_seq_len == 64 and m.seq_len_note is None
    f.write_text(json.dumps(dict(HF_PRESETS["tiny-mistral"], max_position_embeddings=32768,
                                 sliding_window=4096)))
    assert _run_config({"name": "hf", "hf_config": str(f)}).model.max_seq_len == 2048


def test_model_hf_config_errors(tmp_path):
    assert _run_config({"name": "hf", "hf_config": "tiny-qwen2"}).model.num_kv_heads == 2
    with pytest.raises(ConfigError, match=r"model=hf has unknown fields \['hidden_size'\]"):
        _run_config({"name": "hf", "hf_config": "tiny-llama", "hidden_size": 8})
    with pytest.raises(ConfigError, match=r"both set: for a local folder use model=hf_local"):
        _run_config({"name": "hf", "hf_config": "tiny-llama", "hf_path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"neither a preset .* nor a config.json"):
        _run_config({"name": "hf", "hf_config": "tiny-gpt"})
    with pytest.raises(ConfigError, match=r"model.hf_path=.*no config.json"):
        _run_config({"name": "hf", "hf_path": str(tmp_path)})
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ConfigError, match=r"model_type='gpt2' is not supported; supported: "
                                          r"\['llama', 'mistral', 'qwen2'\]"):
        _run_config({"name": "hf", "hf_config": str(f)})
    f.write_text(json.dumps(dict(HF_PRESETS["tiny-mistral"], sliding_window=16)))
    with pytest.raises(ConfigError, match=r"sliding_window=16 < max_seq_len=64"):
        _run_config({"name": "hf", "hf_config": str(f)})
    assert _run_config({"name": "hf", "hf_config": str(f), "max_seq_len": 16}).model.max_seq_len == 16
    f.write_text(json.dumps(dict(HF_PRESETS["tiny-llama"], vocab_size=128)))
    with pytest.raises(ConfigError, match=r"data=bytes feeds byte ids 0..255 but "
                                          r"model.vocab_size=128 < 256"):
        _run_config({"name": "hf", "hf_config": str(f)})
    f.write_text(json.dumps(dict(HF_PRESETS["tiny-llama"], attention_dropout=0.1)))
    with pytest.raises(ConfigError, match=r"attention_dropout=0.1 must be 0"):
        _run_config({"name": "hf", "hf_config": str(f)})
    with pytest.raises(ConfigError, match=r"parallel.tp: TP group size 4 does not divide the "
                                          r"model's num_key_value_heads=2"):
        build_run_config({"engine": "malleus", "model": {"name": "hf", "hf_config": "tiny-qwen2"},
                          "parallel": {"tp": 4}}, world_size=4)
    m = _run_config({"name": "hf", "hf_config": "tiny-llama", "num_layers": 2}).model
    assert m.num_layers == 2 and len(param_table(m).owned(1)) == 9


def test_unsupported_local_folder_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ConfigError, match=rf"model.hf_path={tmp_path}: model_type='gpt2' is not "
                                          r"supported; supported: \['llama', 'mistral', 'qwen2'\]"):
        _run_config({"name": "hf", "hf_path": str(tmp_path)})


def test_hf_local_composes(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    folder = _save_folder(tmp_path, "tiny-qwen2")
    conf = Path(__file__).resolve().parents[3] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        c = compose(config_name="config", overrides=["model=hf_local", f"model.hf_path={folder}"])
    rc = build_run_config(OmegaConf.to_container(c, resolve=True), world_size=1,
                          ds_search_dirs=(conf / "deepspeed",))
    assert rc.model.path == str(folder) and rc.model.model_type == "qwen2"
    assert rc.model.describe()["config"]["num_key_value_heads"] == 2
