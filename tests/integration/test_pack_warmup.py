"""Engine start-up warms the pack kernel (kernels/pack.py), in ranks."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch


ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
Recipe = Callable[[torch.Tensor], torch.Tensor]


# -------------------------------------------------------------------------------- case maker


def _engine_with_spy(rank, world, precision):
    """Worker: build a 1-rank MalleusEngine with the start-up warm-up spied on; train a step."""
    import malleus_ds
    import malleus_ds.engine.engine as E
    from malleus_ds.plan import Plan
    from tests.cases import CFG, ds_config, plan_json

    calls, real = [], E.warm_up_pack

    def spy(device, dtypes):
        calls.append((str(device), sorted(str(d) for d in dtypes)))
        calls.append(real(device, dtypes))
        return calls[-1]
    E.warm_up_pack = spy
    cfg = ds_config(1)
    if precision:
        cfg[precision] = {"enabled": True}
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg,
                                    plan=Plan.from_json(plan_json([(8, [([0], (0, 4))])])))
    return calls, eng.train_batch()


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_engine_start_up_warms_the_pack_kernel(precision):
    # malleus_ds/engine/engine.py build_engine_state: once, for the param dtype and fp32 (the
    # wire dtypes of a migration); on CPU the real warm_up returns 0 and training is unharmed
    from tests.integration.harness import run_distributed
    (calls, loss), = run_distributed(_engine_with_spy, 1, precision, timeout=120)
    want = ["torch.bfloat16", "torch.float32"] if precision else ["torch.float32"]
    assert calls == [("cpu", want), 0]
    assert loss == loss and 0 < loss < 100
