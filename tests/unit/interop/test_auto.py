"""``"auto"`` in a user's ds_config (``interop/auto.py``), filled from ``train.*`` as the Hugging
Face Trainer and accelerate fill it; the transformers and accelerate configs as they ship."""
from __future__ import annotations

import pytest

from malleus_ds.app.config import ConfigError, build_run_config
from malleus_ds.interop.auto import auto_paths, resolve_auto
from malleus_ds.app.run_config import TrainConfig

#: transformers' docs ZeRO-2 config (docs/source/en/deepspeed.md), as users copy it
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                               "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                  "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True,
                          "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

TRAIN = TrainConfig(steps=20, global_batch_size=16, micro_batch_size=2, lr=3e-4,
                    betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)


def test_every_auto_of_the_transformers_config_is_filled_from_train():
    out, notes = resolve_auto(HF_ZERO2, TRAIN, hidden=128, dp=2)
    assert auto_paths(out) == []
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.99], "eps": 1e-6,
                                          "weight_decay": 0.1}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                          "warmup_num_steps": 1}
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"],
            out["gradient_accumulation_steps"]) == (16, 2, 4)
    assert out["gradient_clipping"] == 1.0 and out["fp16"]["enabled"] is False
    assert out["fp16"]["loss_scale_window"] == 1000                   # the rest untouched
    assert out["zero_optimization"]["reduce_bucket_size"] == 128 * 128
    assert HF_ZERO2["optimizer"]["params"]["lr"] == "auto"            # the input untouched
    assert len(notes) == len(auto_paths(HF_ZERO2)) == 14
    assert 'ds_config optimizer.params.lr="auto" -> 0.0003 (train.lr)' in notes


def test_zero3_and_decay_schedules_are_filled_too():
    cfg = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": "auto"},
           "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto",
                                                             "warmup_num_steps": 5}},
           "pipeline": {"stages": "auto"}}
    out, notes = resolve_auto(cfg, TRAIN, hidden=64, dp=1)
    z = out["zero_optimization"]
    assert (z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"],
            z["stage3_gather_16bit_weights_on_model_save"]) == (int(0.9 * 64 * 64), 640, False)
    assert out["scheduler"]["params"] == {"total_num_steps": 20, "warmup_num_steps": 5}
    assert out["pipeline"]["stages"] == "auto" and len(notes) == 4    # DeepSpeed's own


def test_an_auto_no_rule_fills_is_named():
    with pytest.raises(ValueError, match=r'ds_config optimizer.params.momentum, '
                                         r'scheduler.params.cycle_min_lr="auto": no rule fills '
                                         r'them'):
        resolve_auto({"optimizer": {"params": {"momentum": "auto"}},
                      "scheduler": {"params": {"cycle_min_lr": "auto"}}}, TRAIN, 64, 1)


def test_the_app_fills_auto_before_any_process_group(tmp_path):
    """``deepspeed.config_file`` with the transformers config: the run's ds_config holds the
    values, and the notes say where each came from; a bad "auto" is a ConfigError."""
    import json

    f = tmp_path / "hf.json"
    f.write_text(json.dumps(HF_ZERO2))
    d = {"engine": "malleus", "model": {"name": "tiny", "num_layers": 2, "hidden_size": 32},
         "train": {"steps": 3, "global_batch_size": 8, "micro_batch_size": 2, "lr": 0.01},
         "deepspeed": {"config_file": str(f)}}
    rc = build_run_config(d, world_size=2)
    assert auto_paths(rc.deepspeed.config) == []
    assert rc.deepspeed.config["optimizer"]["params"]["lr"] == 0.01
    assert rc.deepspeed.config["gradient_accumulation_steps"] == 2
    assert any("gradient_clipping" in n for n in rc.deepspeed.notes)
    bad = dict(HF_ZERO2, optimizer={"type": "AdamW", "params": {"lr": "auto", "foo": "auto"}})
    f.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r'ds_config optimizer.params.foo="auto"'):
        build_run_config(d, world_size=2)


def test_initialize_names_auto_before_any_process_group():
    """``malleus_ds.initialize`` has no ``train.*`` to fill "auto" from: it names the paths
    before the engine (and its process group) exists."""
    import torch.distributed as dist

    import malleus_ds

    with pytest.raises(ValueError, match=r'ds_config optimizer.params.lr, train_batch_size="auto": '
                                         r'malleus_ds.initialize takes the values themselves'):
        malleus_ds.initialize(model=None, config={"optimizer": {"params": {"lr": "auto"}},
                                                  "train_batch_size": "auto"})
    assert not dist.is_initialized()
