"""One parameter naming, three spellings (``interop/names.py``): ours <-> Hugging Face and ours
<-> DeepSpeed's PipelineModule are round trips over every parameter of a model."""
from __future__ import annotations

import pytest

from malleus_ds.interop.names import from_pipeline, global_name, hf_name, pipeline_name

LAYERS = 3
OURS = ["embed.embed_tokens.weight", "head.norm.weight", "head.lm_head.weight",
        *(f"blocks.{i}.{p}" for i in range(LAYERS)
          for p in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"))]


@pytest.mark.parametrize("name", OURS)
def test_ours_hf_ours(name):
    assert global_name(hf_name(name)) == name


@pytest.mark.parametrize("name", OURS)
def test_ours_pipeline_ours(name):
    assert from_pipeline(pipeline_name(name, LAYERS), LAYERS) == name


def test_the_spellings():
    assert hf_name("embed.embed_tokens.weight") == "model.embed_tokens.weight"
    assert hf_name("blocks.2.mlp.down_proj.weight") == "model.layers.2.mlp.down_proj.weight"
    assert hf_name("head.norm.weight") == "model.norm.weight"
    assert hf_name("head.lm_head.weight") == "lm_head.weight"
    assert pipeline_name("embed.embed_tokens.weight", LAYERS) == "0.layer.embed_tokens.weight"
    assert pipeline_name("blocks.0.mlp.down_proj.weight", LAYERS) == "1.layer.mlp.down_proj.weight"
    assert pipeline_name("head.norm.weight", LAYERS) == f"{LAYERS + 1}.layer.norm.weight"


def test_hf_round_trip_from_their_side():
    for hf in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               "model.norm.weight", "lm_head.weight"):
        assert hf_name(global_name(hf)) == hf


def test_names_outside_the_scheme():
    with pytest.raises(KeyError, match="not a model parameter name"):
        hf_name("other.weight")
    with pytest.raises(KeyError, match="not a Llama-family parameter name"):
        global_name("transformer.h.0.weight")
    assert pipeline_name("other.weight", LAYERS) is None
    assert pipeline_name("blocks.x.weight", LAYERS) is None
    assert from_pipeline("embed.embed_tokens.weight", LAYERS) is None
