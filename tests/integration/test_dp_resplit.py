"""malleus_ds.dp on 2 gloo ranks equals stock DeepSpeed under ZeRO-1, 2 and 3.

A tiny MLP regression, the same ds_config (AdamW, gradient clipping that bites), the same global
batch of 8 in 2 micro-batches per rank: stock ``deepspeed.initialize`` with its own dataloader,
against ``malleus_ds.dp.initialize`` with a fixed uneven split (3 + 1 samples per micro-batch:
rank 1 at the minimum share), with a split changed mid-run (3 + 1, then 1 + 3), and (ZeRO-3)
with a summed loss. In fp32 the per-step global-batch losses, the gradient norms DeepSpeed clips
by and the final parameters agree to rtol 1e-5; in bf16, to bf16's rounding. ``set_split``
refuses another batch or a step already started, and the engine refuses an unweighted
``loss.backward()``. DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint`` resume a ZeRO-3
run with an uneven split. All of it runs in one ``run_distributed`` call (the ranks are built once);
the tests compare its results.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.integration.harness import run_distributed

#: the shared run (15 engines on 2 ranks) takes 20 s or more on 2 cores, paid by the first test
pytestmark = pytest.mark.slow

STAGES, STEPS, N, MBS, GAS = (1, 2, 3), 4, 32, 2, 2
UNEVEN, FLIPPED = (3, 1), (1, 3)


def _ds_config(stage):
    return {"train_batch_size": 2 * MBS * GAS, "train_micro_batch_size_per_gpu": MBS,
            "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                      "torch_adam": True}},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


class _Data:
    """``n`` samples of a small regression, the same for a given ``n`` in every process."""

    def __init__(self, n: int = N):
        import torch

        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.sin(self.x[:, :2] * 2) + 0.1 * torch.randn(n, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class _Bf16Data(_Data):
    """The same samples, inputs in bf16 (DeepSpeed's bf16 does not cast a module's inputs)."""

    def __getitem__(self, i):
        import torch

        return {"x": self.x[i].to(torch.bfloat16), "y": self.y[i]}


def _bf16_config(stage):
    return {**_ds_config(stage), "bf16": {"enabled": True}}


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _params(eng):
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
        return {k: v.detach().clone() for k, v in eng.module.named_parameters()}


def _mean_loss(out, y):
    import torch.nn.functional as F

    return F.mse_loss(out.float(), y)


def _summed_loss(out, y):
    """The sum over the micro-batch's samples of each one's mean squared error."""
    import torch.nn.functional as F

    return F.mse_loss(out, y, reduction="sum") / y.shape[1]


def _train(eng, loader, global_loss, at_step=None, loss_fn=_mean_loss, steps=STEPS, skip=0):
    if skip:
        loader.resume_at(skip)                          # the steps a resumed run has done
    it, losses, sizes, norms = iter(loader), [], [], []
    for step in range(skip, skip + steps):
        if at_step is not None:
            at_step(eng, step)
        mine = []
        for _ in range(GAS):
            b = next(it)
            sizes.append(len(b["x"]))
            loss = loss_fn(eng(b["x"]), b["y"])
            eng.backward(loss)
            eng.step()
            mine.append(loss.item())
        losses.append(global_loss(mine))
        norms.append(float(eng.get_global_grad_norm()))
    return losses, _params(eng), sizes, norms


def _stock_loss(losses):
    import torch
    import torch.distributed as dist

    t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _resumed(ckpt):
    """ZeRO-3, the uneven split: 2 steps, save_checkpoint; an engine from another init loads
    it and runs steps 3 and 4."""
    import torch

    from malleus_ds.dp.engine import initialize
    from malleus_ds.dp.split import Split

    runs = []
    for first in (True, False):
        m = _model()
        if not first:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)                         # not the weights it resumes
        eng, _, loader, _ = initialize(model=m, model_parameters=m.parameters(),
                                       training_data=_Data(), config=_ds_config(3),
                                       split=Split(UNEVEN, GAS))
        if not first:
            eng.load_checkpoint(ckpt)
        runs.append(_train(eng, loader, eng.global_loss, steps=STEPS // 2,
                           skip=0 if first else STEPS // 2))
        if first:
            eng.save_checkpoint(ckpt)
    (l1, _, s1, n1), (l2, p2, s2, n2) = runs
    return l1 + l2, p2, s1 + s2, n1 + n2


def _ranks(rank, world, ckpt):
    import deepspeed

    from malleus_ds import dp
    from malleus_ds.dp.engine import initialize
    from malleus_ds.dp.split import Split

    out = {}
    for stage in STAGES:
        m = _model()
        eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                 training_data=_Data(), config=_ds_config(stage))
        loader.num_local_io_workers = 0                 # the same batches, collated in-process
        out[stage, "stock"] = _train(eng, loader, _stock_loss)

        m = _model()
        eng, _, loader, _ = initialize(model=m, model_parameters=m.parameters(),
                                       training_data=_Data(), config=_ds_config(stage),
                                       split=Split(UNEVEN, GAS))
        assert isinstance(eng, dp.engine.MalleusDPEngine) and eng.split.shares == UNEVEN
        out[stage, "uneven"] = _train(eng, loader, eng.global_loss)
        out[stage, "refused"] = _refusals(eng, loader)

        def flip(eng, step):
            if step == STEPS // 2:
                eng.set_split(Split(FLIPPED, GAS))

        m = _model()
        eng, _, loader, _ = initialize(model=m, model_parameters=m.parameters(),
                                       training_data=_Data(), config=_ds_config(stage),
                                       split=Split(UNEVEN, GAS))
        out[stage, "resplit"] = _train(eng, loader, eng.global_loss, flip)
        assert eng.split.shares == FLIPPED

        m = _model()
        eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                 training_data=_Bf16Data(),
                                                 config=_bf16_config(stage))
        loader.num_local_io_workers = 0
        out[stage, "stock-bf16"] = _train(eng, loader, _stock_loss)
        m = _model()
        eng, _, loader, _ = initialize(model=m, model_parameters=m.parameters(),
                                       training_data=_Bf16Data(), config=_bf16_config(stage),
                                       split=Split(UNEVEN, GAS))
        out[stage, "uneven-bf16"] = _train(eng, loader, eng.global_loss)

        if stage == 3:
            m = _model()
            eng, _, loader, _ = initialize(model=m, model_parameters=m.parameters(),
                                           training_data=_Data(), config=_ds_config(stage),
                                           split=Split(UNEVEN, GAS), loss="sum")
            out[stage, "sum"] = _train(eng, loader, eng.global_loss, loss_fn=_summed_loss)
    out[3, "resumed"] = _resumed(ckpt)
    return out


def _refusals(eng, loader):
    """What the engine refuses, in order: splits of another batch (2); an unweighted
    ``loss.backward()``; set_split after a backward whose step() has not run, after a step()
    mid-step, and while its loader is mid-step."""
    import torch.nn.functional as F

    from malleus_ds.dp.split import Split

    out, x, y = [], _Data().x[:3], _Data().y[:3]

    def refused(fn, *a):
        try:
            fn(*a)
        except (ValueError, RuntimeError) as e:
            out.append(str(e))

    for bad in (Split((2, 2), 1), Split((2, 2, 2), 2)):
        refused(eng.set_split, bad)
    refused(lambda: F.mse_loss(eng(x), y).backward())  # ZeRO allows loss.backward()
    even = Split((2, 2), GAS)
    eng.backward(F.mse_loss(eng(x), y))
    refused(eng.set_split, even)
    eng.step()
    refused(eng.set_split, even)
    eng.backward(F.mse_loss(eng(x), y))
    eng.step()                                          # a step boundary again
    eng.set_split(Split(UNEVEN, GAS))
    next(iter(loader))
    refused(eng.set_split, even)
    return out


@functools.lru_cache(maxsize=1)
def _results():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_ranks, 2, tmp, timeout=180)


def _close(got, want, what):
    (gl, gp, _, gn), (wl, wp, _, wn) = got, want
    np.testing.assert_allclose(gl, wl, rtol=1e-5, err_msg=f"{what}: losses")
    np.testing.assert_allclose(gn, wn, rtol=1e-5, err_msg=f"{what}: gradient norms")
    assert gp.keys() == wp.keys()
    for k in wp:
        np.testing.assert_allclose(gp[k].numpy(), wp[k].numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=f"{what}: {k}")


def _close_bf16(got, want, what):
    """Equal to bf16's rounding: losses and gradient norms to 2e-3, parameters to about one
    bf16 ulp of each tensor's scale."""
    (gl, gp, _, gn), (wl, wp, _, wn) = got, want
    np.testing.assert_allclose(gl, wl, rtol=2e-3, err_msg=f"{what}: losses")
    np.testing.assert_allclose(gn, wn, rtol=2e-3, err_msg=f"{what}: gradient norms")
    for k in wp:
        w = wp[k].float().numpy()
        np.testing.assert_allclose(gp[k].float().numpy(), w, rtol=2 ** -7,
                                   atol=2 ** -8 * np.abs(w).max(), err_msg=f"{what}: {k}")


@pytest.mark.parametrize("stage", STAGES)
def test_uneven_split_equals_stock_deepspeed(stage):
    res = _results()
    stock = res[0][stage, "stock"]
    assert stock[0][-1] < stock[0][0]                   # it trains
    assert min(stock[3]) > 0.05                         # and clipping bites: the norm it clips
    for r in range(2):
        _close(res[r][stage, "stock"], stock, f"stage {stage} rank {r} stock")
        _close(res[r][stage, "uneven"], stock, f"stage {stage} rank {r} uneven {UNEVEN}")
        assert res[r][stage, "stock"][2] == [MBS] * STEPS * GAS
        assert res[r][stage, "uneven"][2] == [UNEVEN[r]] * STEPS * GAS


@pytest.mark.parametrize("stage", STAGES)
def test_a_resplit_mid_run_keeps_equal_to_stock(stage):
    res = _results()
    half = STEPS // 2 * GAS
    for r in range(2):
        _close(res[r][stage, "resplit"], res[0][stage, "stock"],
               f"stage {stage} rank {r} {UNEVEN} then {FLIPPED}")
        assert res[r][stage, "resplit"][2] == [UNEVEN[r]] * half + [FLIPPED[r]] * half


@pytest.mark.parametrize("stage", STAGES)
def test_set_split_refuses_another_batch_and_mid_step_and_an_unweighted_backward(stage):
    for r in range(2):
        got = _results()[r][stage, "refused"]
        assert len(got) == 6, got
        assert "covers 2 ranks, a batch of 4 in 1 micro-batches; this engine has 2 " \
               "data-parallel ranks, train_batch_size=8 and gradient_accumulation_steps=2" \
               in got[0]
        assert "covers 3 ranks" in got[1]
        assert "under the split [3, 1] each rank's loss must be weighted by its share: call " \
               "engine.backward(loss), not loss.backward()" in got[2]
        assert all("set_split at a step boundary" in x for x in got[3:])
        assert "a backward ran and its step() has not" in got[3]
        assert "1 of the step's 2 micro-batches have run" in got[4]
        assert "its dataloader has started the step" in got[5]


def test_a_summed_loss_under_zero3_equals_stock():
    """loss="sum": each rank's loss sums its samples' losses; weighted by world / M."""
    res = _results()
    for r in range(2):
        _close(res[r][3, "sum"], res[0][3, "stock"], f"rank {r} summed loss {UNEVEN}")


@pytest.mark.parametrize("stage", STAGES)
def test_uneven_split_in_bf16_equals_stock_to_bf16_rounding(stage):
    """bf16 rounds each rank's partial gradients (and ZeRO-1 accumulates them in bf16), so an
    uneven split's sums differ from stock's by rounding: losses to 2e-3, parameters to about one
    bf16 ulp (2^-8 relative), gradient norms to 2e-3."""
    res = _results()
    for r in range(2):
        assert res[r][stage, "uneven-bf16"][2] == [UNEVEN[r]] * STEPS * GAS
        _close_bf16(res[r][stage, "uneven-bf16"], res[0][stage, "stock-bf16"], f"rank {r}")


def test_deepspeeds_checkpoint_resumes_an_uneven_run_under_zero3():
    res = _results()
    for r in range(2):
        _close(res[r][3, "resumed"], res[r][3, "uneven"], f"rank {r} saved and resumed")
