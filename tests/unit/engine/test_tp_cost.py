"""The TP slowdown measured at start-up (malleus_ds/engine/tp_cost.py).

* ``slowdown_table`` on hand-computed times: ratios to the full-TP shard, key 1 = 1.0, a wider
  shard never cheaper, a size that could not be timed falls back to ideal, bad times refused.
* ``time_shards`` times a real layer of our decoder and of a Hugging Face model sharded like the
  engine shards it (same parameter counts), and a full layer reads slower than a quarter shard.
* ``measure`` without a process group, and the settings key that chooses the table.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from malleus_ds.adaptive.settings import AdaptiveSettings
from malleus_ds.engine.tp_cost import (
    _sharded_layer,
    group_sizes,
    measure,
    slowdown_table,
    time_shards)
from malleus_ds.models.llama import model_config


def test_group_sizes_are_the_divisors():
    assert group_sizes(1) == [1] and group_sizes(6) == [1, 2, 3, 6] and group_sizes(8) == [1, 2, 4, 8]


def test_slowdown_table_hand_case():
    # t(g) for tp=4: the full-TP quarter shard 1 ms, the half 1.8 ms, the whole layer 3.3 ms
    sd = slowdown_table({4: 1e-3, 2: 1.8e-3, 1: 3.3e-3}, 4)
    assert sd == pytest.approx({1: 1.0, 2: 1.8, 4: 3.3})


def test_slowdown_table_stays_physical():
    # noise made the half shard read faster than the quarter: clamped to 1.0, never below
    sd = slowdown_table({4: 1e-3, 2: 0.9e-3, 1: 2.0e-3}, 4)
    assert sd == pytest.approx({1: 1.0, 2: 1.0, 4: 2.0})
    # the whole layer read faster than the half: clamped to the half's cost
    sd = slowdown_table({4: 1e-3, 2: 2.5e-3, 1: 2.0e-3}, 4)
    assert sd == pytest.approx({1: 1.0, 2: 2.5, 4: 2.5})
    # a size that could not be timed (a model the TP size cannot split) gets the ideal tp/g
    sd = slowdown_table({4: 1e-3, 1: 3.0e-3}, 4)
    assert sd == pytest.approx({1: 1.0, 2: 2.0, 4: 3.0})
    # no full-TP time at all: ideal everywhere
    assert slowdown_table({}, 4) == {1: 1.0, 2: 2.0, 4: 4.0}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_slowdown_table_refuses_bad_times(bad):
    with pytest.raises(ValueError, match="group size 2 is"):
        slowdown_table({4: 1e-3, 2: bad, 1: 3e-3}, 4)


def _linear_params(m: nn.Module) -> int:
    return sum(p.numel() for mod in m.modules() if isinstance(mod, nn.Linear)
               for p in mod.parameters())


def test_sharded_layer_holds_one_gth_of_the_linears():
    cfg = model_config("small")
    full = _linear_params(_sharded_layer(cfg, 1, "cpu", torch.float32))
    for g in (2, 4):
        assert _linear_params(_sharded_layer(cfg, g, "cpu", torch.float32)) * g == full


def test_a_full_layer_reads_slower_than_a_quarter_shard():
    cfg = model_config("small")
    t = time_shards(cfg, [1, 2, 4], 2, 128, "cpu", torch.float32, repeats=3)
    assert set(t) == {1, 2, 4} and all(v > 0 for v in t.values())
    # 4x the matmul work: even a loaded 2-core machine keeps it above 1.3x (measured ~2.5x)
    assert t[1] > 1.3 * t[4]
    sd = slowdown_table(t, 4)
    assert sd[1] == 1.0 and 1.0 <= sd[2] <= sd[4]


def test_time_shards_uses_the_injected_timer_and_skips_sizes_the_model_refuses():
    cfg = model_config("tiny", num_heads=4)          # 4 heads: TP 3 cannot split it
    ticks = itertools.count()
    t = time_shards(cfg, [1, 3, 4], 1, 8, "cpu", torch.float32, repeats=2,
                    timer=lambda: float(next(ticks)))
    assert set(t) == {1, 4} and t == {1: 1.0, 4: 1.0}      # one tick per timed run


def test_hugging_face_layers_time_too():
    pytest.importorskip("transformers")
    from malleus_ds.models.hf import load_hf_model

    cfg = load_hf_model("tiny-qwen2")                # GQA: 4 heads, 2 KV heads
    t = time_shards(cfg, group_sizes(2), 1, 16, "cpu", torch.float32, repeats=1)
    assert set(t) == {1, 2}
    full = _linear_params(_sharded_layer(cfg, 1, "cpu", torch.float32))
    assert _linear_params(_sharded_layer(cfg, 2, "cpu", torch.float32)) * 2 == full


def test_measure_without_a_process_group():
    assert measure(model_config("tiny"), 1, 1, 8, "cpu", torch.float32) == {1: 1.0}
    sd = measure(model_config("tiny"), 2, 1, 16, "cpu", torch.float32, repeats=1)
    assert set(sd) == {1, 2} and sd[1] == 1.0 and sd[2] >= 1.0


def test_settings_choose_the_table():
    assert AdaptiveSettings.from_config({}).tp_slowdown == "measure"
    assert AdaptiveSettings.from_config({"tp_slowdown": "ideal"}).tp_slowdown == "ideal"
    assert AdaptiveSettings.from_config({"tp_slowdown": {"1": 1, "2": 1.9}}).tp_slowdown == \
        {1: 1.0, 2: 1.9}
    with pytest.raises(ValueError, match=r"ds_config.malleus.tp_slowdown='fast' must be \"measure\""):
        AdaptiveSettings.from_config({"tp_slowdown": "fast"})
