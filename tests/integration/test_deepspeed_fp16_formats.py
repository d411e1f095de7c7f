"""DeepSpeed's fp16 files without ZeRO name no parameter (``interop/checkpoint_plain.py``): a user's
own model with the Hugging Face Trainer's two parameter groups (weights with decay, then biases
and norms without), so the optimizer's order is not the module's. Stock DeepSpeed (one rank)
trains it in fp16 under FP16_UnfusedOptimizer and under FP16_Optimizer (FusedAdam's flat
masters), and ``read_state`` gives back each parameter's fp32 master and Adam moments by name,
as DeepSpeed holds them in memory (the moments in true gradient units)."""
from __future__ import annotations

import pytest
import torch

from tests.integration.harness import run_distributed
from tests.integration.test_deepspeed_checkpoint_import import _cpu_fp16


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.mid = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.norm(self.inp(x)))))


def _train_and_save(rank, world, out, fused):
    import deepspeed

    _cpu_fp16(fused)
    torch.manual_seed(0)
    net = Net()
    named = list(net.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight") and "norm" not in n],
               "weight_decay": 0.1},
              {"params": [p for n, p in named if not (n.endswith("weight") and "norm" not in n)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "fp16": {"enabled": True, "initial_scale_power": 8},
           "zero_allow_untested_optimizer": True}
    eng, dsopt, *_ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    assert type(dsopt).__name__ == ("FP16_Optimizer" if fused else "FP16_UnfusedOptimizer")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g).half()
        y = torch.randn(4, 4, generator=g).half()
        eng.backward(((eng(x) - y) ** 2).float().mean())
        eng.step()
    eng.save_checkpoint(str(out))
    name = {id(p): n for n, p in eng.module.named_parameters()}
    scale = float(dsopt.loss_scale_config.cur_scale)
    want = {}
    if fused:
        for fp16s, flat in zip(dsopt.fp16_groups, dsopt.fp32_groups_flat):
            st = dsopt.optimizer.state[flat]
            off = 0
            for p in fp16s:
                k = p.numel()
                want[name[id(p)]] = tuple(t[off:off + k].reshape(p.shape).clone() for t in (
                    flat.detach(), st["exp_avg"] * scale, st["exp_avg_sq"] * scale ** 2))
                off += k
    else:
        for fp16s, fp32s in zip(dsopt.fp16_groups, dsopt.fp32_groups):
            for p, m in zip(fp16s, fp32s):
                st = dsopt.optimizer.state[m]
                want[name[id(p)]] = (m.detach().clone(), st["exp_avg"] * scale,
                                     st["exp_avg_sq"] * scale ** 2)
    return want


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused-flat"])
def test_fp16_masters_are_found_by_value_in_any_group_order(tmp_path, fused):
    from malleus_ds.interop.checkpoint import read_state

    want = run_distributed(_train_and_save, 1, tmp_path / "ck", fused, timeout=300)[0]
    st = read_state(tmp_path / "ck")
    assert st.zero_stage == 0 and st.adam_step == 4          # 3 steps + DeepSpeed's first
    assert sorted(st.params) == sorted(want)
    for n, (master, m1, m2) in want.items():
        torch.testing.assert_close(st.params[n], master, rtol=0, atol=0, msg=n)
        torch.testing.assert_close(st.exp_avg[n], m1, msg=n)
        torch.testing.assert_close(st.exp_avg_sq[n], m2, msg=n)
    assert [g["weight_decay"] for g in st.param_groups] == [0.1, 0.0]
    assert st.loss_scaler["cur_scale"] == 256.0 and len(st.notes) == 1


def test_a_master_of_another_model_is_refused(tmp_path):
    """A master that rounds to none of the module's parameters (files of two runs mixed) is
    refused by name; so is an fp32 optimizer whose order is not the module's."""
    from malleus_ds.interop.checkpoint_plain import read_stage0
    from malleus_ds.files.ckpt_format import CheckpointError

    w = {"a": torch.ones(2, 3, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float16)}
    inner = {"state": {}, "param_groups": [{"params": [0, 1], "lr": 1e-3}]}
    ms = {"optimizer": {"cur_scale": 1.0, "optimizer_state_dict": inner,
                        "fp32_groups": [[torch.ones(2, 3), torch.full((3,), 0.5)]]}}
    with pytest.raises(CheckpointError, match=r"fp32 master of shape \(3,\) in group 0 rounds "
                                              r"to none of the module's remaining 1"):
        read_stage0(tmp_path, tmp_path / "f.pt", ms, w, {})
    w32 = {k: v.float() for k, v in w.items()}
    plain = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3),
                                         "step": torch.tensor(1.0)},
                                     1: {"exp_avg": torch.zeros(2, 3),
                                         "exp_avg_sq": torch.zeros(2, 3),
                                         "step": torch.tensor(1.0)}},
                           "param_groups": [{"params": [0, 1]}]}}
    with pytest.raises(CheckpointError, match=r"parameter 0 is \(3,\), the module's a \(2, 3\): "
                                              r"its parameters are not in the module's order"):
        read_stage0(tmp_path, tmp_path / "f.pt", plain, w32, {})
