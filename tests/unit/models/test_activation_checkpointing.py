"""Activation checkpointing on one process (``train.activation_checkpointing``): the knob and its
ds_config forms, recompute on a single model (our decoder, a Hugging Face model), its measured
memory drop. The planner's side is in tests/unit/test_cost_recompute.py, every engine's losses in
the dist equivalence tests."""
from __future__ import annotations

import pytest
import torch

from malleus_ds.app.config import ConfigError, activation_checkpointing_note, build_run_config
from malleus_ds.models import build_model, lm_loss, model_config
from malleus_ds.models.base import StageModule, enable_activation_checkpointing
from tests.peak_memory import peak_tensor_mb

# ------------------------------------------------------------------------- the knob


def cfg(train=None, ds=None, engine="torch", world=1):
    d = {"engine": engine, "model": {"name": "tiny"},
         "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 1, **(train or {})},
         "parallel": {"tp": 1, "pp": 1, "dp": None}}
    if ds is not None:
        d["deepspeed"] = {"config": ds}
    return build_run_config(d, world_size=world)


def test_off_by_default_and_on_when_asked():
    assert cfg().train.activation_checkpointing is False
    assert activation_checkpointing_note(cfg()) is None
    assert cfg({"activation_checkpointing": None}).train.activation_checkpointing is False
    c = cfg({"activation_checkpointing": True})
    assert c.train.activation_checkpointing is True
    assert "train.activation_checkpointing=true" in activation_checkpointing_note(c)


@pytest.mark.parametrize("ds,src", [
    ({"activation_checkpointing": {}}, "activation_checkpointing section"),
    ({"activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4}},
     "activation_checkpointing section"),
    ({"pipeline": {"activation_checkpoint_interval": 1}},
     "pipeline.activation_checkpoint_interval=1"),
])
def test_a_ds_config_that_enables_deepspeed_checkpointing_turns_it_on(ds, src):
    for asked in (None, True):
        c = cfg({"activation_checkpointing": asked}, ds=ds)
        assert c.train.activation_checkpointing is True
        assert f"the ds_config's {src}" in activation_checkpointing_note(c)


def test_interval_zero_or_null_section_is_off():
    assert not cfg(ds={"pipeline": {"activation_checkpoint_interval": 0}}).train.activation_checkpointing
    assert not cfg(ds={"activation_checkpointing": None}).train.activation_checkpointing


def test_false_against_a_ds_config_that_turns_it_on_is_an_error():
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing=false, but the "
                                          r"ds_config turns activation checkpointing on with "
                                          r"its activation_checkpointing section; drop "
                                          r"train.activation_checkpointing \(null follows the "
                                          r"ds_config\) or take the activation_checkpointing "
                                          r"section out"):
        cfg({"activation_checkpointing": False}, ds={"activation_checkpointing": {}})
    with pytest.raises(ConfigError, match=r"on with its pipeline.activation_checkpoint_interval"
                                          r"=1; .* take the pipeline.activation_checkpoint_"
                                          r"interval out of the ds_config"):
        cfg({"activation_checkpointing": False},
            ds={"pipeline": {"activation_checkpoint_interval": 1}})


@pytest.mark.parametrize("train,ds,match", [
    ({"activation_checkpointing": "yes"}, None,
     r"train.activation_checkpointing='yes' must be true, false or null"),
    (None, {"activation_checkpointing": {"partition_activations": "yes"}},
     r"activation_checkpointing.partition_activations='yes' must be true or false"),
    (None, {"activation_checkpointing": {"cpu_checkpointing": True}},
     r"cpu_checkpointing=true is not supported \(it moves the kept inputs to host memory\)"),
    (None, {"activation_checkpointing": {"partition_activation": False}},
     r"activation_checkpointing: unknown keys \['partition_activation'\]; DeepSpeed's are"),
    (None, {"activation_checkpointing": {"number_checkpoints": 0}},
     r"number_checkpoints=0 must be an integer >= 1 or null"),
    (None, {"activation_checkpointing": True},
     r"ds_config.activation_checkpointing must be an object"),
    (None, {"pipeline": {"activation_checkpoint_interval": 2}},
     r"pipeline.activation_checkpoint_interval=2: only 0 \(off\) or 1"),
])
def test_bad_values_name_the_field(train, ds, match):
    with pytest.raises(ConfigError, match=match):
        cfg(train, ds)


def test_engine_malleus_hands_it_to_the_engine_in_its_settings():
    """Resolved once (``config_deepspeed.resolve_activation_checkpointing``) and handed over in
    the engine's settings, not written back into the ds_config."""
    from malleus_ds.engine.engine import MalleusEngine
    from malleus_ds.app.runners.job import load_plan
    from malleus_ds.app.runners.malleus_runner import build_ds_config, engine_settings

    for asked, on in ((None, False), (True, True)):
        c = cfg({"activation_checkpointing": asked}, engine="malleus", world=2)
        ds = build_ds_config(c, load_plan(c))
        assert "activation_checkpointing" not in ds and "malleus" not in ds
        assert engine_settings(c, load_plan(c), ds).recompute is on
    # the user's own section is kept as it is, and it turns recompute on (read once)
    c = cfg(ds={"activation_checkpointing": {"number_checkpoints": 4}}, engine="malleus", world=2)
    ds = build_ds_config(c, load_plan(c))
    assert ds["activation_checkpointing"] == {"number_checkpoints": 4}
    assert c.train.activation_checkpointing and engine_settings(c, load_plan(c), ds).recompute
    assert MalleusEngine.build_settings(ds).recompute         # the engine alone reads it alike
    with pytest.raises(ValueError, match="settings were given, and the ds_config has a malleus"):
        MalleusEngine.build_settings({"malleus": {"seed": 1}}, engine_settings(c, load_plan(c), ds))


# ------------------------------------------------------------------------- one model

SEQ = 16


def _hf():
    from malleus_ds.models.hf import load_hf_model

    return load_hf_model("tiny-llama", max_seq_len=SEQ)


def _layers(model):
    """The decoder layers of a reference model (ours: the StageModule's blocks)."""
    return list(model.blocks.values()) if isinstance(model, StageModule) \
        else list(model.model.model.layers)


def _count_calls(model):
    calls = [0] * len(_layers(model))
    for i, layer in enumerate(_layers(model)):
        # a pre-hook: the recompute stops early, once it has what backward needs
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("which", ["ours", "hf-llama"])
def test_recompute_gives_the_same_loss_and_gradients_and_runs_each_layer_twice(which):
    m = model_config("tiny", max_seq_len=SEQ) if which == "ours" else _hf()
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, m.vocab_size, (2, SEQ), generator=g) for _ in range(2))
    out = {}
    for ac in (False, True):
        model = build_model(m, 3)
        if ac:
            enable_activation_checkpointing(model)
        calls = _count_calls(model)
        loss = lm_loss(model(x), y)
        loss.backward()
        out[ac] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls)
        with torch.no_grad():                    # no backward coming: nothing is recomputed
            model(x)
        assert calls == [(2 if ac else 1) + 1] * len(calls), (ac, calls)
    assert out[True][0] == out[False][0]
    for n, grad in out[False][1].items():
        assert torch.equal(out[True][1][n], grad), n


@pytest.mark.parametrize("which", ["ours", "hf-llama"])
def test_a_middle_stage_recomputes_from_its_received_activation(which):
    """What an engine's stage without the embedding does: its input is a received activation
    that requires grad; the gradient sent back to the previous stage is the plain one."""
    m = model_config("tiny", max_seq_len=SEQ) if which == "ours" else _hf()
    h = torch.randn(2, SEQ, m.hidden_size, generator=torch.Generator().manual_seed(1))
    got = []
    for ac in (False, True):
        stage = StageModule(m, 1, 3, seed=5)
        if ac:
            enable_activation_checkpointing(stage)
        x = h.clone().requires_grad_()
        out = stage(x)
        out.backward(torch.ones_like(out))
        got.append((out.detach(), x.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_enable_refuses_what_it_cannot_checkpoint():
    with pytest.raises(TypeError, match="neither a StageModule nor a model with its own"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_peak_memory_drops_with_recompute_measured():
    """A long sequence through 8 layers, forward and backward: with recompute each layer keeps
    only its input (B*T*H fp32 = 0.25 MB here) instead of all its activations, measured by the
    CPU allocator's events (tests/peak_memory.py)."""
    m = model_config("tiny", num_layers=8, max_seq_len=512)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, m.vocab_size, (2, 512), generator=g) for _ in range(2))
    peak = {}
    for ac in (False, True):
        model = build_model(m, 0)
        if ac:
            enable_activation_checkpointing(model)
        peak[ac] = peak_tensor_mb(lambda: lm_loss(model(x), y).backward())
    # measured 48.2 MB plain, 9.1 MB with recompute (the gradients, 0.9 MB, in both)
    assert peak[False] > 20 and peak[True] < 0.4 * peak[False], peak
