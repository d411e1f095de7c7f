"""Every LR scheduler DeepSpeed ships, under MalleusEngine, gives the learning rates (and, for
OneCycle, the momentum) of stock DeepSpeed step for step: both engines build the scheduler from
the same ``scheduler`` section and step it once per optimizer step (the ds_config key table,
``interop/config_keys.py``). A step that fp16 skips for overflow does not step it, as in DeepSpeed
(``DeepSpeedEngine._take_model_step``). One gloo rank, both engines in the same process."""
from __future__ import annotations

import pytest

from tests.cases import CFG, ds_config, plan_json
from tests.integration.harness import run_distributed

ONE = plan_json([(2, [([0], (0, 4))])], G=2)
STEPS = 7
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                 "warmup_type": "linear"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                      "total_num_steps": STEPS},
    "WarmupCosineLR": {"total_num_steps": STEPS, "warmup_num_steps": 2,
                       "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2,
                 "decay_step_size": 2, "decay_lr_rate": 0.5},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2,
                    "lr_range_test_step_rate": 1.5, "lr_range_test_staircase": True},
}
# fp16 forced to overflow on its first two steps (test_malleus_precision.py's FP16_FORCED)
# (its model and batches; here the scale's regrowth makes later steps overflow too)
FP16_FORCED = {"enabled": True, "loss_scale": 0, "initial_scale_power": 20,
               "loss_scale_window": 3, "hysteresis": 1, "min_loss_scale": 1}


def _groups(opt):
    return [(g["lr"], tuple(g.get("betas", ()))) for g in opt.param_groups[:1]]


def _both(rank, world):
    import deepspeed
    import torch

    import malleus_ds as me
    from malleus_ds.plan import Plan

    out = {}
    for typ, params in SCHEDULERS.items():
        sched = {"type": typ, "params": params}
        eng, *_ = me.initialize(model=CFG, config=dict(ds_config(0), scheduler=sched),
                                plan=Plan.from_json(ONE))
        ours = [_groups(eng.optimizer)]
        for _ in range(STEPS):
            eng.train_batch()
            ours.append(_groups(eng.optimizer))
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-5)
        ds, *_ = deepspeed.initialize(model=lin, optimizer=opt, config={
            "train_batch_size": 1, "gradient_clipping": 0.0, "scheduler": sched,
            "steps_per_print": 10**9})
        theirs = [_groups(ds.optimizer)]
        for _ in range(STEPS):
            loss = ds(torch.ones(1, 4)).sum()
            ds.backward(loss)
            ds.step()
            theirs.append(_groups(ds.optimizer))
        out[typ] = (ours, theirs)
    # fp16 skips its first two steps: the schedule stands still on them
    sched = {"type": "WarmupLR", "params": SCHEDULERS["WarmupLR"]}
    eng, *_ = me.initialize(model=CFG, config=dict(ds_config(0), scheduler=sched,
                                                   fp16=FP16_FORCED), plan=Plan.from_json(ONE))
    lrs, skipped = [], []
    for _ in range(STEPS):
        before = eng.skipped_steps
        eng.train_batch()
        skipped.append(eng.skipped_steps > before)
        lrs.append(eng.optimizer.param_groups[0]["lr"])
    out["fp16"] = (lrs, skipped)
    return out


@pytest.fixture(scope="module")
def result():
    return run_distributed(_both, 1, timeout=300)[0]


@pytest.mark.parametrize("typ", list(SCHEDULERS))
def test_learning_rates_equal_stock_deepspeeds(result, typ):
    ours, theirs = result[typ]
    assert ours == theirs
    assert len({lr for (lr, _), in ours}) > 2           # the schedule really moves


def test_a_skipped_fp16_step_does_not_step_the_schedule(result):
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    lrs, skipped = result["fp16"]
    # skipped at 2^20 and 2^19; the scale then grows back after 3 good steps and overflows again
    assert skipped[:3] == [True, True, False] and not all(skipped)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    ref = WarmupLR(opt, **SCHEDULERS["WarmupLR"])
    want = []
    for s in skipped:
        if not s:
            ref.step()
        want.append(opt.param_groups[0]["lr"])
    assert lrs == want
