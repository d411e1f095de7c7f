"""The optimizer's speed paths keep the math (engine/optimizer.py, reference.make_optimizer).

* multi-tensor (foreach) AdamW gives, bit for bit, the single-tensor loop's numbers, also when
  the elements are regrouped into flat ranges (what ZeRO partitions of a bucket do);
* ``optimizer.params.fused`` in the ds_config selects torch's fused kernel; a bad value is a
  clear error naming the field;
* the clipping norm over owned windows (device-side, fp64) equals the norm in fp64 of the same
  elements, with the tied head copy left out.
"""
from __future__ import annotations

import pytest
import torch

from malleus_ds.interop.sections import optimizer_settings
from malleus_ds.optim import OptimConfig, make_optimizer


def _run(params, grads_per_step, **kw):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    for grads in grads_per_step:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def test_foreach_equals_the_single_tensor_loop_bit_for_bit_even_regrouped():
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 37), (37,), (5, 64)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    loop = _run(params, steps, foreach=False)
    multi = _run(params, steps, foreach=True)
    assert all(torch.equal(a, b) for a, b in zip(loop, multi))
    # the same elements as two flat ranges cut across the tensors (a ZeRO split of a bucket)
    flat = torch.cat([p.reshape(-1) for p in params])
    cut = flat.numel() // 3
    fsteps = [[torch.cat([g.reshape(-1) for g in gs])[:cut],
               torch.cat([g.reshape(-1) for g in gs])[cut:]] for gs in steps]
    regrouped = torch.cat(_run([flat[:cut], flat[cut:]], fsteps, foreach=True))
    assert torch.equal(regrouped, torch.cat([p.reshape(-1) for p in loop]))


def test_make_optimizer_defaults_to_foreach_and_honours_fused():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = make_optimizer(p, OptimConfig())
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    opt = make_optimizer(p, OptimConfig(), fused=True)
    assert opt.defaults["fused"] is True


def test_ds_config_fused_reaches_the_optimizer_and_bad_values_are_named():
    _, make = optimizer_settings({"optimizer": {"type": "AdamW",
                                                "params": {"lr": 1e-3, "fused": True}}})
    assert make([torch.nn.Parameter(torch.zeros(2))]).defaults["fused"] is True
    _, make = optimizer_settings({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert make([torch.nn.Parameter(torch.zeros(2))]).defaults["foreach"] is True
    with pytest.raises(ValueError, match=r"optimizer.params.fused='yes'"):
        optimizer_settings({"optimizer": {"type": "AdamW", "params": {"fused": "yes"}}})


def test_fused_adamw_stays_within_fp32_rounding_of_the_loop():
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(300, generator=gen)]
    steps = [[torch.randn(300, generator=gen)] for _ in range(10)]
    loop, fused = _run(params, steps, foreach=False), _run(params, steps, fused=True)
    torch.testing.assert_close(fused[0], loop[0], rtol=1e-5, atol=1e-6)


def test_owned_norm_is_fp64_and_leaves_the_tied_copy_out():
    from malleus_ds.engine.optimizer import ShardedOptimizer
    from malleus_ds.layout import Bucket, Piece

    a = Piece("embed.w", None, 0, 0, True, 10)
    b = Piece("head.w", None, 0, 0, True, 6)
    c = Piece("layer.w", None, 0, 0, True, 7)
    bucket = Bucket(ranks=(0,), pieces=[a, b, c], numel=23)
    opt = ShardedOptimizer.__new__(ShardedOptimizer)
    opt.buckets, opt.owned, opt.device = [bucket], [(0, bucket.flat_size)], None
    flat = torch.randn(bucket.flat_size, generator=torch.Generator().manual_seed(2)) * 1e3
    got = opt.owned_sq_norm([(flat, 0)], frozenset({"head.w"}))
    assert got.dtype == torch.float64 and got.dim() == 0
    keep = torch.cat([flat[:10], flat[16:]]).double()
    assert float(got) == pytest.approx(float(keep.pow(2).sum()), rel=1e-14)
    assert float(opt.owned_sq_norm([(flat, 0)])) == pytest.approx(
        float(flat.double().pow(2).sum()), rel=1e-14)
