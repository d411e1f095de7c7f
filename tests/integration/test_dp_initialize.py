"""``malleus_ds.initialize(model=<torch.nn.Module>, ...)`` on 2 gloo ranks under ZeRO-2 builds
MalleusDPEngine with DeepSpeed's own arguments (``model_parameters``, ``training_data``,
``config``) and trains exactly as stock ``deepspeed.initialize`` does: the same per-step losses,
gradient norms and final parameters (fp32, rtol 1e-5). The model, data and ds_config are
test_dp_resplit's."""
from __future__ import annotations

import functools

from tests.integration.harness import run_distributed
from tests.integration.test_dp_resplit import (GAS, MBS, STEPS, _close, _Data, _ds_config, _model,
                                               _stock_loss, _train)


def _ranks(rank, world):
    import deepspeed

    import malleus_ds
    from malleus_ds.dp.engine import MalleusDPEngine

    m = _model()
    eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                             training_data=_Data(), config=_ds_config(2))
    loader.num_local_io_workers = 0
    stock = _train(eng, loader, _stock_loss)

    m = _model()
    eng, opt, loader, sched = malleus_ds.initialize(model=m, model_parameters=m.parameters(),
                                                    training_data=_Data(), config=_ds_config(2))
    assert isinstance(eng, MalleusDPEngine) and opt is eng.optimizer and sched is None
    return stock, _train(eng, loader, eng.global_loss), eng.zero_optimization_stage()


@functools.lru_cache(maxsize=1)
def _results():
    return run_distributed(_ranks, 2, timeout=120)


def test_initialize_with_a_module_equals_stock_deepspeed_under_zero2():
    res = _results()
    for r in range(2):
        stock, ours, stage = res[r]
        assert stage == 2
        _close(ours, res[0][0], f"rank {r} malleus_ds.initialize")
        _close(stock, res[0][0], f"rank {r} stock")
        assert ours[2] == [MBS] * STEPS * GAS                # the equal split: stock's batches
