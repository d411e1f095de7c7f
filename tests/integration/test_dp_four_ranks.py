"""MalleusDPEngine on 4 gloo ranks: under ZeRO-1, 2 and 3, a fixed uneven split with three ranks
at the smallest share (one sample per micro-batch) trains exactly as stock
``deepspeed.initialize`` does on the same data (fp32: losses, gradient norms and parameters to
rtol 1e-5); a re-split mid-run under ZeRO-3 keeps that; in bf16 under ZeRO-3 the uneven split
matches stock to bf16 rounding. The model, data and loop are test_dp_resplit's (2 ranks there);
one ``run_distributed`` call builds every engine."""
from __future__ import annotations

import functools

import pytest

from tests.integration.harness import run_distributed
from tests.integration.test_dp_resplit import (GAS, MBS, _Bf16Data, _close, _close_bf16, _Data,
                                               _ds_config, _model, _stock_loss, _train)

WORLD, STEPS = 4, 3
#: rank 0 takes 5 of each micro-batch's 8 samples; ranks 1-3 the smallest share, one each
UNEVEN, MOVED = (5, 1, 1, 1), (1, 1, 1, 5)
N = WORLD * MBS * GAS * STEPS


def _config(stage, bf16=False):
    c = {**_ds_config(stage), "train_batch_size": WORLD * MBS * GAS}
    return {**c, "bf16": {"enabled": True}} if bf16 else c


def _ranks(rank, world):
    import deepspeed

    from malleus_ds.dp.engine import initialize
    from malleus_ds.dp.split import Split

    def stock(stage, data, bf16=False):
        m = _model()
        eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                 training_data=data,
                                                 config=_config(stage, bf16))
        loader.num_local_io_workers = 0
        return _train(eng, loader, _stock_loss, steps=STEPS)

    def ours(stage, data, bf16=False, at_step=None):
        m = _model()
        eng, _, loader, _ = initialize(model=m, model_parameters=m.parameters(),
                                       training_data=data, config=_config(stage, bf16),
                                       split=Split(UNEVEN, GAS))
        return _train(eng, loader, eng.global_loss, at_step, steps=STEPS)

    def move(eng, step):
        if step == 1:
            eng.set_split(Split(MOVED, GAS))

    out = {}
    for stage in (1, 2, 3):
        out[stage, "stock"] = stock(stage, _Data(N))
        out[stage, "uneven"] = ours(stage, _Data(N))
    out[3, "moved"] = ours(3, _Data(N), at_step=move)
    out[3, "stock-bf16"] = stock(3, _Bf16Data(N), bf16=True)
    out[3, "uneven-bf16"] = ours(3, _Bf16Data(N), bf16=True)
    return out


@functools.lru_cache(maxsize=1)
def _results():
    return run_distributed(_ranks, WORLD, timeout=240)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_three_ranks_at_the_smallest_share_equal_stock(stage):
    res = _results()
    want = res[0][stage, "stock"]
    assert want[0][-1] < want[0][0]
    for r in range(WORLD):
        _close(res[r][stage, "uneven"], want, f"stage {stage} rank {r} {UNEVEN}")
        assert res[r][stage, "uneven"][2] == [UNEVEN[r]] * STEPS * GAS
        assert res[r][stage, "stock"][2] == [MBS] * STEPS * GAS


def test_a_resplit_mid_run_on_four_ranks_under_zero3_equals_stock():
    res = _results()
    for r in range(WORLD):
        _close(res[r][3, "moved"], res[0][3, "stock"], f"rank {r} {UNEVEN} then {MOVED}")
        assert res[r][3, "moved"][2] == [UNEVEN[r]] * GAS + [MOVED[r]] * (STEPS - 1) * GAS


def test_bf16_on_four_ranks_under_zero3_equals_stock_to_bf16_rounding():
    res = _results()
    for r in range(WORLD):
        _close_bf16(res[r][3, "uneven-bf16"], res[0][3, "stock-bf16"], f"rank {r}")
