from __future__ import annotations

import pytest
import torch

from malleus_ds.models import (PRESETS, StageModule, build_layer, build_model, lm_loss,
                               model_config)
from malleus_ds.app.runners.deepspeed_runner import static_parts
from malleus_ds.plan import static_plan


def test_presets_and_overrides():
    assert {"tiny", "small", "medium", "7b", "13b", "70b"} <= set(PRESETS)
    assert model_config("tiny", num_layers=6).num_layers == 6
    assert 6e9 < model_config("7b").num_params() < 7.5e9
    with pytest.raises(ValueError, match="not a known model size"):
        model_config("3b")


def test_stages_compose_to_the_whole_model():
    cfg = model_config("tiny", hidden_size=32, max_seq_len=16)
    full = build_model(cfg, seed=1)
    parts = [StageModule(cfg, 0, 1, seed=1), StageModule(cfg, 1, 3, seed=1),
             StageModule(cfg, 3, 4, seed=1)]
    x = torch.randint(0, 256, (2, 16))
    h = x
    for p in parts:
        h = p(h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)
    assert torch.equal(build_layer(cfg, 2, 1).mlp.w_up.weight, full.blocks["2"].mlp.w_up.weight)
    assert lm_loss(full(x), x).item() > 0


def test_pipeline_partition_matches_static_plan():
    for layers, pp in [(4, 2), (5, 2), (7, 3), (8, 4)]:
        plan = static_plan(layers, 4, 1, tp=1, pp=pp, dp=1)
        parts = static_parts(layers, pp)
        for s, st in enumerate(plan.pipelines[0].stages):
            # items: 0 = embedding, 1 + l = block l, L + 1 = head
            lo, hi = parts[s], parts[s + 1]
            blocks = [i - 1 for i in range(lo, hi) if 1 <= i <= layers]
            assert blocks == list(range(st.start, st.end))
        assert parts[0] == 0 and parts[-1] == layers + 2
