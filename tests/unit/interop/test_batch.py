"""The batch from ``train.*`` and the ds_config's batch keys (``interop/batch.py``): DeepSpeed's
derivation where ``train.*`` does not say, an error naming both where they disagree."""
from __future__ import annotations

import pytest

from malleus_ds.app.config import ConfigError, build_run_config
from malleus_ds.interop.batch import resolve_batch


def resolve(ds, dp=2, **train):
    return resolve_batch(ds, train, dp, ConfigError)


@pytest.mark.parametrize("ds,dp,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 2, (32, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, (16, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 8}, 2, (32, 2)),
    ({"train_batch_size": 12}, 4, (12, 3)),                       # no accumulation: 12 / 4
    ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3)),          # 3 x 1 x 4
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, 2, (4, 2)),
])
def test_deepspeeds_rules_where_train_does_not_say(ds, dp, want):
    G, B, notes = resolve(ds, dp)
    assert (G, B) == want
    assert len(notes) == 2 and all("from the ds_config" in n for n in notes)


def test_train_fields_win_where_the_ds_config_does_not_say():
    assert resolve({}, global_batch_size=24, micro_batch_size=3) == (24, 3, [])
    assert resolve({"train_batch_size": "auto"}) == (8, 1, [])        # the defaults
    assert resolve({}, micro_batch_size=2) == (8, 2, [])
    # both given and agreeing with every key the ds_config has
    assert resolve({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 4}, global_batch_size=16,
                   micro_batch_size=2) == (16, 2, [])


def test_only_the_accumulation_given():
    """accelerate's configs: batch sizes "auto", gradient_accumulation_steps 1: the default
    micro-batch, the batch derived from it (a note each)."""
    G, B, notes = resolve({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                           "gradient_accumulation_steps": 1})
    assert (G, B) == (2, 1) and len(notes) == 2
    assert resolve({"gradient_accumulation_steps": 4})[:2] == (8, 1)
    assert resolve({"gradient_accumulation_steps": 4}, global_batch_size=16)[:2] == (16, 2)
    with pytest.raises(ConfigError, match=r"train.global_batch_size=10, ds_config gradient_"
                                          r"accumulation_steps=4: 10 is not a multiple of 4 x "
                                          r"dp=2"):
        resolve({"gradient_accumulation_steps": 4}, global_batch_size=10)


def test_one_given_the_other_derived():
    # train.global_batch_size given, the micro-batch from the ds_config (accumulation derived)
    G, B, notes = resolve({"train_micro_batch_size_per_gpu": 2}, global_batch_size=32)
    assert (G, B) == (32, 2) and notes == [
        "train.micro_batch_size=2 from the ds_config's train_micro_batch_size_per_gpu at dp=2"]
    # train.micro_batch_size given, the accumulation from the ds_config
    assert resolve({"gradient_accumulation_steps": 4}, micro_batch_size=3)[:2] == (24, 3)


@pytest.mark.parametrize("ds,train,pattern", [
    ({"train_batch_size": 16}, {"global_batch_size": 8},
     r"ds_config train_batch_size=16 contradicts train.global_batch_size=8"),
    ({"train_micro_batch_size_per_gpu": 4}, {"global_batch_size": 8, "micro_batch_size": 2},
     r"ds_config train_micro_batch_size_per_gpu=4 contradicts train.micro_batch_size=2"),
    ({"gradient_accumulation_steps": 3}, {"global_batch_size": 8, "micro_batch_size": 2},
     r"gradient_accumulation_steps=3 contradicts train.global_batch_size=8, "
     r"train.micro_batch_size=2 at dp=2 \(2 x 3 x 2 = 12\)"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
     {"global_batch_size": 32},
     r"train.global_batch_size=32, ds_config train_micro_batch_size_per_gpu=2, ds_config "
     r"gradient_accumulation_steps=4: 2 x 4 x dp=2 = 16, not 32"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4}, {},
     r"2 x 4 x dp=2 = 16, not 30 \(DeepSpeed refuses this too\)"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, {},
     r"30 is not a multiple of 4 x dp=2"),
    ({"train_batch_size": 15}, {}, r"train_batch_size=15: 15 is not a multiple of 1 x dp=2"),
    ({"train_batch_size": 0}, {}, r"ds_config train_batch_size=0 must be an integer >= 1"),
    ({"train_batch_size": "16"}, {}, r"ds_config train_batch_size='16' must be an integer"),
])
def test_contradictions_name_both(ds, train, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve(ds, **train)


def test_the_app_takes_the_batch_from_the_ds_config():
    """A DeepSpeed user's ds_config names the batch; the run config gets it, with one note per
    field, and the engines' batch checks then agree with it."""
    from malleus_ds.app import runners

    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}
    for engine in ("deepspeed", "malleus", "torch"):
        c = build_run_config({"engine": engine, "model": {"name": "tiny"},
                              "train": {"steps": 2, "global_batch_size": None,
                                        "micro_batch_size": None},
                              "deepspeed": {"config": ds}}, world_size=2)
        assert (c.train.global_batch_size, c.train.micro_batch_size) == (16, 2)
        assert [n for n in c.deepspeed.notes if "from the ds_config" in n] == [
            "train.global_batch_size=16 from the ds_config's gradient_accumulation_steps, "
            "train_batch_size, train_micro_batch_size_per_gpu at dp=2",
            "train.micro_batch_size=2 from the ds_config's gradient_accumulation_steps, "
            "train_batch_size, train_micro_batch_size_per_gpu at dp=2"]
        runners.validate(c)
    with pytest.raises(ConfigError, match=r"ds_config train_batch_size=16 contradicts "
                                          r"train.global_batch_size=8"):
        build_run_config({"engine": "malleus", "model": {"name": "tiny"},
                          "train": {"global_batch_size": 8}, "deepspeed": {"config": ds}},
                         world_size=2)
