"""Tensor-parallel slicing without processes: shards of a block recombine to the full block."""
import pytest
import torch

from malleus_ds.engine import tensor_parallel as tpmod
from malleus_ds.engine.tensor_parallel import TPError, apply_tp, check_tp_size, shard
from malleus_ds.models.llama import TP_PLAN as SHARD_DIM
from malleus_ds.models.llama import StageModule, model_config

CFG = model_config("tiny", max_seq_len=16)


def test_check_tp_size_messages():
    check_tp_size(CFG, 4)
    with pytest.raises(TPError, match="TP group size 3 does not divide the model's num_heads=4"):
        check_tp_size(CFG, 3)
    with pytest.raises(TPError, match="does not divide the model.s FFN width ffn=90"):
        check_tp_size(model_config("tiny", ffn_hidden_size=90), 4)


def test_shard_slices():
    w = torch.arange(24.).view(4, 6)
    assert torch.equal(torch.cat([shard(w, 1, r, 3) for r in range(3)], 1), w)
    assert torch.equal(shard(w, 0, 1, 2), w[2:])


@pytest.mark.parametrize("g", [2, 4])
def test_sharded_block_partials_sum_to_full(monkeypatch, g):
    """With the all-reduces turned into identities, each TP rank's attention/MLP output is a
    partial sum; the partial sums add up to the unsharded block's outputs and gradients."""
    class Done:
        def wait(self):
            return True
    monkeypatch.setattr(tpmod.dist, "all_reduce", lambda t, group=None, async_op=False: Done())
    full = StageModule(CFG, 1, 2, seed=3)
    blk = full.blocks["1"]
    x = torch.randn(2, 16, CFG.hidden_size)
    ref_attn = blk.attn(blk.attn_norm(x))
    ref_mlp = blk.mlp(blk.mlp_norm(x))
    attn_sum = mlp_sum = 0
    for r in range(g):
        part = apply_tp(StageModule(CFG, 1, 2, seed=3), None, r, g).blocks["1"]
        for name, p in part.named_parameters():
            d = SHARD_DIM.get(name)
            want = dict(blk.named_parameters())[name]
            assert torch.equal(p, want if d is None else shard(want.data, d, r, g)), name
        attn_sum = attn_sum + part.attn(part.attn_norm(x))
        mlp_sum = mlp_sum + part.mlp(part.mlp_norm(x))
    torch.testing.assert_close(attn_sum, ref_attn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlp_sum, ref_mlp, rtol=1e-5, atol=1e-6)
