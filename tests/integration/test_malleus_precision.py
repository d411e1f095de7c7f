"""MalleusEngine with the stock "bf16" / "fp16" ds_config sections (engine/precision.py).

The reference here is the mixed-precision analogue of ``reference_run``, written the DeepSpeed
way: the whole model cast to bf16/fp16, fp32 masters made from those casts, torch AdamW on the
masters, per micro-batch the low-precision gradients added into fp32 accumulators, (fp16) the
fp32 loss multiplied by DeepSpeed's loss scale and the summed gradients divided by it, a step
with a non-finite gradient skipped, the masters cast back into the model after each step.

* One rank holding the whole model runs exactly this arithmetic: losses equal to rtol 1e-6.
* The 4-rank HETERO plan (two pipelines with 2 and 1 stages; layers 1-3 on a TP=2 group next to
  a TP=1 rank) is compared within bf16 tolerance: TP splits every row-parallel matmul into
  partial sums that are rounded to bf16 (8 significant bits) and then all-reduced in bf16, so
  activations differ from the single-process order by O(2^-8) relative, and that propagates
  through 10 Adam steps. Losses agree to LOSS_RTOL_BF16 = 1e-3 (observed 8e-5). Master weights:
  each tensor's relative Frobenius error <= PARAM_RTOL_BF16 = 3e-2 (observed 6e-3), and every
  element within 2 * lr * steps of the reference: Adam moves an element by at most ~lr per
  step whatever its gradient, so an element whose tiny gradient flips sign under the bf16
  re-ordering can drift by 2 * lr per step (observed max 1.7e-3 after 10 steps), while a wrong
  update rule, a lost step or bf16 masters would break the Frobenius bound.
* fp16 (11 significant bits) is checked the same way, 8x tighter: losses 1e-4 (observed 5e-6),
  Frobenius 5e-3 (observed 8e-4).
"""
from __future__ import annotations

import numpy as np

from tests.integration.harness import run_distributed
from tests.cases import CFG, EPS, ds_config, plan_json, tp_slice
from tests.cases import HETERO, SUSPENDED

ONE = plan_json([(8, [([0], (0, 4))])])
# re-plan target for HETERO: p0 TP2 [2, 0] layers 0-3 then [1]; p1 [3] all; micro-batches 3/5
REPLAN_B = plan_json([(3, [([2, 0], (0, 3)), ([1], (3, 4))]), (5, [([3], (0, 4))])])
STEPS = 8
LR = 1e-3                  # ds_config()'s AdamW lr
CLIP = 0.05                # small enough to clip every step (the fp32 clipping test uses it)
LOSS_RTOL_BF16, PARAM_RTOL_BF16 = 1e-3, 3e-2
LOSS_RTOL_FP16, PARAM_RTOL_FP16 = 1e-4, 5e-3     # fp16 keeps 11 significant bits, bf16 8
# fp16 scaler forced to overflow: at 2^20 and 2^19 the scaled fp16 backward overflows, at 2^18
# it fits (this model, these batches). hysteresis 1 halves the scale on every overflow, so steps
# 0 and 1 are skipped, then training goes on; window 3 raises the scale after 3 good steps.
FP16_FORCED = {"enabled": True, "loss_scale": 0, "initial_scale_power": 20,
               "loss_scale_window": 3, "hysteresis": 1, "min_loss_scale": 1}


def mp_config(zero: int, **prec) -> dict:
    return dict(ds_config(zero), **prec)


# ---------------------------------------------------------------------- the reference


def mp_reference(dtype_name: str, steps: int, G: int = 8, mbs: int = 1, fp16: dict | None = None,
                 clip: float = 0.0):
    """Single process, mixed precision, DeepSpeed's recipe (module docstring); ``clip``: global
    gradient-norm clipping of the unscaled fp32 gradients. Returns (losses, masters by name,
    skipped steps, loss scale before each step)."""
    from unittest import mock

    import torch
    from deepspeed.runtime.fp16 import loss_scaler as ls
    from deepspeed.runtime.precision_config import get_float16_config

    from malleus_ds.data import ByteCorpus
    from malleus_ds.models import build_model, lm_loss
    from malleus_ds.app.reference import OptimConfig, make_optimizer, micro_batches

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model = build_model(CFG, 0)
    names, params = zip(*model.named_parameters())
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(dtype)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = make_optimizer(masters, OptimConfig(lr=1e-3, eps=EPS))
    scaler = None
    if fp16 is not None:
        c = get_float16_config({"fp16": fp16})
        scaler = (ls.DynamicLossScaler(dtype=torch.float16, **c.dynamic_loss_scale_args())
                  if c.loss_scale == 0 else ls.LossScaler(scale=c.loss_scale))
    data = ByteCorpus(CFG.max_seq_len, seed=0)
    losses, skipped, scales = [], [], []
    for step in range(steps):
        scale = float(scaler.cur_scale) if scaler is not None else 1.0
        scales.append(scale)
        acc = [torch.zeros(p.shape) for p in params]
        total = 0.0
        for ids in micro_batches(step, G, mbs):
            x, y = data.batch(ids)
            loss = lm_loss(model(x), y) * (mbs / G)
            total += loss.item()
            (loss * scale if scale != 1.0 else loss).backward()
            with torch.no_grad():
                for a, p in zip(acc, params):
                    a.add_(p.grad)
                    p.grad = None
        losses.append(total)
        overflow = any(not bool(torch.isfinite(a).all()) for a in acc)
        if scaler is not None:
            with mock.patch.object(ls.dist, "get_rank", return_value=0):   # logs on "rank 0"
                scaler.update_scale(overflow)
        if overflow:
            skipped.append(step)
            continue
        for m, a in zip(masters, acc):
            m.grad = a.mul_(1.0 / scale) if scale != 1.0 else a
        if clip:      # DeepSpeed's gradient_clipping: x max_norm / (norm + 1e-6) when < 1;
            # the norm in float64 like the engine, so an fp16 cast of the masters cannot flip
            norm = sum(float(m.grad.double().pow(2).sum()) for m in masters) ** 0.5
            coef = min(1.0, clip / (norm + 1e-6))
            for m in masters:
                m.grad = m.grad * coef
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return losses, {n: m.detach().numpy() for n, m in zip(names, masters)}, skipped, scales


_REF: dict = {}


def reference(dtype_name, steps, fp16=None, clip=0.0):
    key = (dtype_name, steps, repr(fp16), clip)
    if key not in _REF:
        _REF[key] = mp_reference(dtype_name, steps, fp16=fp16, clip=clip)
    return _REF[key]


# ---------------------------------------------------------------------- rank workers


def _train(pj, cfg, steps, before_step=None):
    """Train ``steps`` steps; losses, fp32 masters (with shard info), dtypes, scaler history.
    ``before_step(k, engine)``: called before each step ``k`` (saves, gathers)."""
    import torch

    import malleus_ds
    from malleus_ds.plan import Plan

    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(pj))
    losses, scales = [], []
    for k in range(steps):
        if before_step is not None:
            before_step(k, eng)
        scales.append(eng.cur_scale)
        losses.append(eng.train_batch())
    st = eng.local_state()
    shards = eng.local_shards()
    masters = {n: (st["params"][n].numpy(), *shards[n][1:]) for n in shards}
    lp = {n: shards[n][0] for n in shards}
    dtypes = {str(t.dtype) for t in lp.values()} | {"masters:" + str(t.dtype)
                                                    for t in st["params"].values()}
    # the low-precision parameters are exactly the casts of the fp32 masters
    cast_ok = all(torch.equal(lp[n], st["params"][n].to(lp[n].dtype)) for n in lp)
    return {"losses": losses, "masters": masters, "dtypes": dtypes, "cast_ok": cast_ok,
            "skipped_steps": eng.skipped_steps, "scales": scales, "scaler": st["loss_scaler"],
            "bf16": eng.bfloat16_enabled(), "fp16": eng.fp16_enabled(),
            "data_types": tuple(str(d) for d in eng.get_data_types())}


def _one_rank(rank, world):
    bf16 = _train(ONE, mp_config(0, bf16={"enabled": True}), STEPS)
    imm = _train(ONE, mp_config(0, bf16={"enabled": True, "immediate_grad_update": True}), STEPS)
    fp16 = _train(ONE, mp_config(0, fp16=FP16_FORCED), STEPS)
    # clipping acts on the unscaled fp32 gradients (scale 2^16: no overflow in these steps)
    clip = _train(ONE, dict(mp_config(0, fp16=dict(FP16_FORCED, initial_scale_power=16)),
                            gradient_clipping=CLIP), 4)
    return bf16, imm, fp16, clip


def _four_ranks(rank, world, ckpt_dir):
    import malleus_ds
    from malleus_ds.plan import Plan

    out = {}
    try:      # both modes enabled: a clear error on every rank, before any collective
        malleus_ds.initialize(model=CFG, config=mp_config(1, bf16={"enabled": True},
                                                            fp16={"enabled": True}),
                              plan=Plan.from_json(HETERO))
        out["both"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out["both"] = f"{type(e).__name__}: {e}"
    # the bf16 run (10 steps) also saves a checkpoint before step 2 and hands its state over
    # to a re-planned engine before step 3 (neither changes the run: its losses stay checked)
    cfg = mp_config(1, bf16={"enabled": True})
    handed = {}

    def save_and_gather(k, eng):
        from tests.integration.test_malleus_replan import gather_full_state

        if k == 2:
            eng.save_checkpoint(ckpt_dir)
        if k == 3:
            handed["state"] = gather_full_state(eng, world)

    out["bf16"] = _train(HETERO, cfg, 10, save_and_gather)
    out["fp16"] = _train(HETERO, mp_config(2, fp16=FP16_FORCED), STEPS)
    out["suspended"] = _train(SUSPENDED, mp_config(2, bf16={"enabled": True}), 4)
    # checkpoint carries the fp32 masters: 2 steps, save, fresh engine loads, 2 more steps
    # reproduce the first 4 losses of the uninterrupted run bit for bit (bf16 copies would not)
    b, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(HETERO))
    b.load_checkpoint(ckpt_dir)
    out["ckpt"] = out["bf16"]["losses"][:2] + [b.train_batch() for _ in range(2)]
    # re-plan (TP sizes change): local_state hands over fp32 masters; the new engine's masters
    # are exactly the old ones, its bf16 parameters their casts
    out["replan"] = _replan_bf16(out["bf16"]["losses"][:3], *handed["state"], 3)
    return out


def _replan_bf16(losses, full, st, k2):
    """Engine REPLAN_B (ZeRO-2, bf16) loads ``full`` (gathered from HETERO after
    ``len(losses)`` steps), trains ``k2`` steps: (all losses, its state exactly the handed one)."""
    import torch

    import malleus_ds
    from malleus_ds.plan import Plan
    from tests.integration.test_malleus_replan import load_full_state

    b, *_ = malleus_ds.initialize(model=CFG, config=mp_config(2, bf16={"enabled": True}),
                                  plan=Plan.from_json(REPLAN_B))
    mine = load_full_state(b, full, st)
    st_b, lp_b = b.local_state(), b.local_shards()
    exact = all(torch.equal(st_b["params"][n], mine["params"][n]) and
                torch.equal(lp_b[n][0], mine["params"][n].to(torch.bfloat16)) for n in lp_b)
    return losses + [b.train_batch() for _ in range(k2)], exact


# ---------------------------------------------------------------------- checks


def _check_masters(masters_by_rank, ref_masters, atol, fro_rtol=None):
    """Every held fp32 master shard vs the reference slice: elementwise ``atol`` and, if given,
    relative Frobenius error per tensor ``fro_rtol``."""
    seen = set()
    for rank, masters in enumerate(masters_by_rank):
        for n, (arr, dim, tr, ts) in masters.items():
            assert arr.dtype == np.float32, (rank, n, arr.dtype)
            full = tp_slice(ref_masters[n], dim, tr, ts)
            np.testing.assert_allclose(arr, full, rtol=0, atol=atol, err_msg=f"rank {rank} {n}")
            if fro_rtol is not None:
                err = np.linalg.norm(arr - full) / np.linalg.norm(full)
                assert err <= fro_rtol, f"rank {rank} {n}: relative Frobenius error {err:.2e}"
            seen.add(n)
    assert seen == set(ref_masters)


def test_one_rank_bf16_and_fp16_equal_the_mixed_precision_reference():
    (bf16, imm, fp16, clip), = run_distributed(_one_rank, 1, timeout=180)
    ref_losses, ref_masters, _, _ = reference("bf16", STEPS)
    for r in (bf16, imm):
        assert r["dtypes"] == {"torch.bfloat16", "masters:torch.float32"} and r["cast_ok"]
        assert r["bf16"] and not r["fp16"] and r["data_types"] == ("torch.bfloat16", "torch.float32")
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-6)
        _check_masters([r["masters"]], ref_masters, atol=1e-6)
    # immediate_grad_update only changes when the fp32 accumulation happens, not the numbers
    assert imm["losses"] == bf16["losses"]
    assert ref_losses[-1] < ref_losses[0]

    f_losses, f_masters, f_skipped, f_scales = reference("fp16", STEPS, FP16_FORCED)
    assert f_skipped[:2] == [0, 1] and len(f_skipped) < STEPS - 2, f_skipped   # forced overflow
    assert fp16["dtypes"] == {"torch.float16", "masters:torch.float32"} and fp16["cast_ok"]
    assert fp16["fp16"] and fp16["skipped_steps"] == len(f_skipped)
    assert fp16["scales"] == f_scales
    np.testing.assert_allclose(fp16["losses"], f_losses, rtol=1e-6)
    _check_masters([fp16["masters"]], f_masters, atol=1e-6)

    c_losses, c_masters, c_skipped, _ = reference(
        "fp16", 4, dict(FP16_FORCED, initial_scale_power=16), clip=CLIP)
    assert not c_skipped and clip["skipped_steps"] == 0
    np.testing.assert_allclose(clip["losses"], c_losses, rtol=1e-6)
    _check_masters([clip["masters"]], c_masters, atol=1e-6)


def test_four_ranks_hetero_bf16_fp16_overflow_checkpoint_and_bad_config(tmp_path):
    res = run_distributed(_four_ranks, 4, str(tmp_path), timeout=300)
    for rank, out in enumerate(res):
        assert out["both"].startswith("ValueError") and "both true" in out["both"], (rank, out["both"])

    # bf16 on TP=2 next to TP=1: within bf16 tolerance, masters fp32, params their bf16 casts
    ref_losses, ref_masters, _, _ = reference("bf16", 10)
    for rank, out in enumerate(res):
        r = out["bf16"]
        assert r["losses"] == res[0]["bf16"]["losses"], f"rank {rank}: every rank returns the same loss"
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=LOSS_RTOL_BF16)
        assert r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]
        assert r["dtypes"] <= {"torch.bfloat16", "masters:torch.float32"} and r["cast_ok"]
        assert r["skipped_steps"] == 0
    _check_masters([o["bf16"]["masters"] for o in res], ref_masters, 2 * LR * 10, PARAM_RTOL_BF16)

    # a suspended rank (2) next to 2-stage and 1-stage pipelines, ZeRO-2, bf16
    for rank, out in enumerate(res):
        np.testing.assert_allclose(out["suspended"]["losses"], ref_losses[:4], rtol=LOSS_RTOL_BF16)
    assert res[2]["suspended"]["masters"] == {}

    # fp16, dynamic scale forced to overflow: every rank skips the same steps with the same
    # scale history as the reference, then trains on and matches it
    f_losses, f_masters, f_skipped, f_scales = reference("fp16", STEPS, FP16_FORCED)
    for rank, out in enumerate(res):
        r = out["fp16"]
        assert r["scales"] == f_scales, (rank, r["scales"], f_scales)
        assert r["skipped_steps"] == len(f_skipped) > 0
        assert r["scaler"] == res[0]["fp16"]["scaler"] and r["scaler"]["cur_scale"] < 2 ** 24
        kept = [k for k in range(STEPS) if k not in f_skipped]
        np.testing.assert_allclose(np.array(r["losses"])[kept], np.array(f_losses)[kept],
                                   rtol=LOSS_RTOL_FP16)
    _check_masters([o["fp16"]["masters"] for o in res], f_masters, 2 * LR * STEPS, PARAM_RTOL_FP16)

    # the checkpoint carried the fp32 masters (and Adam states): bit-identical continuation
    for rank, out in enumerate(res):
        assert out["ckpt"] == out["bf16"]["losses"][:4], (rank, out["ckpt"])
    # re-planning moved the fp32 masters exactly; training goes on within bf16 tolerance
    for rank, out in enumerate(res):
        losses, exact = out["replan"]
        assert exact, rank
        np.testing.assert_allclose(losses, ref_losses[:6], rtol=LOSS_RTOL_BF16)
