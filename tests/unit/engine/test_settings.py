"""The ds_config "malleus" section and stock fields, parsed without processes."""
import json

import pytest

from malleus_ds.engine.settings import MalleusSettings, base_ds_config
from malleus_ds.interop.sections import optimizer_settings
from malleus_ds.plan import Plan
from tests.cases import HETERO


def test_plan_inline_path_and_unknown_keys(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(HETERO))
    a = MalleusSettings.from_config({"plan": HETERO, "seed": 3})
    b = MalleusSettings.from_config({"plan": str(f), "straggler": {"schedule": [{"rank": 1, "rate": 2}]}})
    assert a.plan == b.plan == Plan.from_json(HETERO) and a.seed == 3
    assert b.straggler == ({"rank": 1, "rate": 2},)
    with pytest.raises(ValueError, match=r"unknown keys \['plann'\]"):
        MalleusSettings.from_config({"plann": "x"})


def test_stock_fields():
    zero, make = optimizer_settings({"zero_optimization": {"stage": 2},
                                      "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9]}}})
    assert zero == 2
    import torch
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="stage=3"):
        optimizer_settings({"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="'SGD'"):
        optimizer_settings({"optimizer": {"type": "SGD"}})
    plan = Plan.from_json(HETERO)
    base = base_ds_config({"optimizer": {}, "zero_optimization": {}, "malleus": {},
                            "train_batch_size": 99, "gradient_clipping": 0.5}, plan, (0, 1))
    assert base == {"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 5, "train_batch_size": 5}


def test_precision_sections_parse_with_deepspeeds_models():
    import torch

    from malleus_ds.engine.engine import MalleusEngine
    from malleus_ds.engine.precision import Precision

    assert MalleusEngine.build_settings({}).precision == Precision()        # fp32, no scaler
    bf = MalleusEngine.build_settings({"bf16": {"enabled": True, "immediate_grad_update": True},
                                       "data_types": {"grad_accum_dtype": "fp32"}}).precision
    assert bf.dtype == torch.bfloat16 and bf.check_overflow and bf.immediate_grad_update
    assert bf.make_loss_scaler() is None
    assert not Precision.from_config({"bf16": {"enabled": True,
                                               "check_grad_overflow": False}}).check_overflow
    assert Precision.from_config({"bfloat16": {"enabled": True}}).dtype == torch.bfloat16
    fp = Precision.from_config({"fp16": {"enabled": True, "initial_scale_power": 8,
                                         "loss_scale_window": 5, "hysteresis": 3,
                                         "min_loss_scale": 2}})
    assert fp.dtype == torch.float16 and fp.check_overflow
    assert fp.dynamic_loss_args == {"init_scale": 256, "scale_window": 5, "delayed_shift": 3,
                                    "consecutive_hysteresis": False, "min_scale": 2}
    static = Precision.from_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.dynamic_loss_args is None and static.make_loss_scaler().cur_scale == 128
    for cfg, needle in [({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
                        ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
                         "accumulates"),
                        ({"data_types": {"param_dtype": "bf16"}}, "conflicts"),
                        ({"data_types": {"keep_in_fp32_modules": []}}, "does not support"),
                        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "loss_scale_window"),
                        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
                         "fp32 master"),
                        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
                         "fp32 master")]:
        with pytest.raises(ValueError, match=needle):
            MalleusEngine.build_settings(cfg)
    # the base engine never sees the precision sections (the subclass owns them)
    base = base_ds_config({"bf16": {"enabled": True}, "fp16": {"enabled": False},
                            "data_types": {}, "gradient_clipping": 0.5},
                           Plan.from_json(HETERO), (0, 1))
    assert not {"bf16", "fp16", "data_types"} & set(base)


def test_dynamic_loss_scaler_from_config_skips_lowers_and_raises(monkeypatch):
    """The engine's fp16 scaler is DeepSpeed's DynamicLossScaler built from the fp16 section;
    this pins the behaviour the engine relies on (overflow -> lower after `hysteresis`
    overflows, raise after `loss_scale_window` good steps, floor at min_loss_scale) and that its
    state survives local_state()/load_local_state()."""
    from deepspeed.runtime.fp16 import loss_scaler as ls

    from malleus_ds.engine.precision import Precision, load_scaler_state, scaler_state

    monkeypatch.setattr(ls.dist, "get_rank", lambda *a, **k: 0)   # it logs on rank 0 only
    s = Precision.from_config({"fp16": {"enabled": True, "initial_scale_power": 4,
                                        "loss_scale_window": 2, "hysteresis": 2,
                                        "min_loss_scale": 4}}).make_loss_scaler()
    assert isinstance(s, ls.DynamicLossScaler) and s.cur_scale == 16
    seen = []
    for overflow in [True, True, False, False, False, True, True, True]:
        s.update_scale(overflow)
        seen.append(s.cur_scale)
    # 1st overflow only spends hysteresis, 2nd halves; the scale doubles (and hysteresis is
    # refilled) once (iter - last_overflow_iter - 1) reaches the window, i.e. on the 3rd good step
    # with window 2; then one overflow spends hysteresis again, the next ones halve down to 4
    assert seen == [16, 8, 8, 8, 16, 16, 8, 4], seen
    with pytest.raises(Exception, match="minimum"):     # overflow at the floor: DeepSpeed stops
        s.update_scale(True)
    st = scaler_state(s)
    t = Precision.from_config({"fp16": {"enabled": True}}).make_loss_scaler()
    load_scaler_state(t, st)
    assert scaler_state(t) == st and t.cur_scale == 4
    assert scaler_state(None) is None


def test_deepspeed_autotp_is_refused_by_name():
    from malleus_ds.engine.engine import MalleusEngine

    with pytest.raises(ValueError, match=r"ds_config.tensor_parallel.autotp_size=2: MalleusEngine"):
        MalleusEngine.build_settings({"tensor_parallel": {"autotp_size": 2}})
    MalleusEngine.build_settings({"tensor_parallel": {"autotp_size": 1}})     # a no-op: fine


def test_optimizer_keys_of_other_peoples_configs():
    """``adam_w_mode=false`` is Adam with an L2 term (DeepSpeed's FusedAdam in that mode, torch's
    Adam); the legacy ``max_grad_norm`` is refused, as DeepSpeed refuses it;
    ``torch_adam`` is accepted; a value that is no number (an unfilled "auto") is named."""

    import torch

    p = torch.nn.Parameter(torch.ones(3))
    _, make = optimizer_settings({"optimizer": {"type": "Adam", "params": {
        "lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False, "torch_adam": True}}})
    opt = make([p])
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["weight_decay"] == 0.5
    p.grad = torch.zeros(3)
    opt.step()          # L2: the decay enters the gradient, so Adam's step is a full lr
    assert torch.allclose(p.detach(), torch.full((3,), 0.9), atol=1e-6)
    with pytest.raises(ValueError, match=r"optimizer.params.max_grad_norm=1.0 is refused, as "
                                         r"DeepSpeed refuses it: set the clip with the top-level "
                                         r"\"gradient_clipping\": 1.0 instead"):
        optimizer_settings({"optimizer": {"params": {"lr": 0.1, "max_grad_norm": 1.0}}})
    with pytest.raises(ValueError, match=r"optimizer.params.lr='auto' must be a number "
                                         r"\(\"auto\" is filled by launch/train.py"):
        optimizer_settings({"optimizer": {"params": {"lr": "auto"}}})
    with pytest.raises(ValueError, match="adam_w_mode='no' must be true or false"):
        optimizer_settings({"optimizer": {"params": {"adam_w_mode": "no"}}})


def _stock_optimizer(sec: dict, params):
    """What stock DeepSpeed's ``_configure_basic_optimizer`` builds for the optimizer section
    ``sec`` (torch_adam: no JIT compile), called on a stand-in with the methods it reads."""
    from types import SimpleNamespace

    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.engine import DeepSpeedEngine

    typ = sec["type"].lower() if sec["type"].lower() in DEEPSPEED_OPTIMIZERS else sec["type"]
    me = SimpleNamespace(optimizer_params=lambda: dict(sec["params"]),
                         optimizer_name=lambda: typ, zero_use_cpu_optimizer=lambda: False)
    me.get_optimizer_configuration = (
        lambda *a, **k: DeepSpeedEngine.get_optimizer_configuration(me, *a, **k))
    return DeepSpeedEngine._configure_basic_optimizer(me, params)


@pytest.mark.parametrize("typ,params", [
    ("Adam", {}), ("AdamW", {}), ("Adam", {"adam_w_mode": False}),
    ("AdamW", {"adam_w_mode": False}), ("adamw", {"adam_w_mode": False}),
    ("Adam", {"weight_decay": 0.1}), ("Adam", {"adam_w_mode": False, "weight_decay": 0.1})])
@pytest.mark.parametrize("torch_adam", [True, False])
def test_adam_and_adamw_as_deepspeed_builds_them(typ, params, torch_adam):
    """The class, decay mode and defaults of DeepSpeed's optimizer for ``type`` Adam/AdamW:
    type AdamW is AdamW whatever ``adam_w_mode`` says; ``weight_decay`` left out is 0 in
    DeepSpeed's own Adams (FusedAdam, DeepSpeedCPUAdam: their signatures, as building them
    compiles) and 0.01 with ``torch_adam`` in AdamW mode (torch.optim.AdamW's default)."""
    import inspect

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    p = [torch.nn.Parameter(torch.ones(2))]
    sec = {"type": typ, "params": dict(params, lr=0.1, **({"torch_adam": True} if torch_adam
                                                            else {}))}
    ours = optimizer_settings({"optimizer": sec})[1](p)
    if torch_adam:
        stock = _stock_optimizer(sec, p)
        cls, wd = type(stock), stock.param_groups[0]["weight_decay"]
    else:
        w_mode = typ.lower() == "adamw" or params.get("adam_w_mode", True)
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        default = {inspect.signature(c.__init__).parameters["weight_decay"].default
                   for c in (FusedAdam, DeepSpeedCPUAdam)}
        assert default == {0.0}
        wd = params.get("weight_decay", 0.0)
    assert type(ours) is cls
    assert ours.param_groups[0]["weight_decay"] == wd
    assert ours.param_groups[0]["lr"] == 0.1
