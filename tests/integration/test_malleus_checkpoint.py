"""Checkpoints load under any plan, ZeRO stage, precision and world size (engine/checkpoint.py).

One 4-rank run (a module fixture) trains HETERO under ZeRO-1 in fp32 and in bf16 and saves both;
fresh engines on other plans load them. Checked:

* fp32, 4 ranks -> plan D with ZeRO-2: the whole model's parameters and Adam moments right after
  the load equal those right before the save (bit for bit), and 3 more steps give the losses,
  parameters and Adam states of one 6-step single-process reference;
* fp32, 4 ranks -> a 3-rank plan with a TP2 stage and ZeRO-0: the same, on another world size;
* bf16, 4 ranks -> plan B (TP2, ZeRO-2): fp32 masters and moments bit-identical, and every bf16
  parameter is the cast of its master;
* across precisions: an fp32 checkpoint into a bf16 engine (its parameters become the masters),
  a bf16 checkpoint into an fp32 engine (its masters become the parameters), bit for bit;
* ``load_optimizer_states=False``: weights loaded, moments zero, Adam step 0;
* rank files in the older format (a ``torch.save`` zip each) load bit for bit;
* errors (missing directory, no ``latest``, a missing rank file, an unfinished save, another
  model's layer count): the same message on every rank, engine not broken;
* the checkpoint files are never modified by loading.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.integration.harness import run_distributed
from tests.rank_files import to_zip
from tests.cases import CFG, EPS, check, ds_config, plan_json
from tests.cases import HETERO
from tests.integration.test_malleus_replan import gather_full_state
from tests.integration.test_malleus_switch import B, D, _check_adam, _full_equal

# 3 ranks: a TP2 pipeline next to a TP1 one (replica sets mix TP sizes)
THREE = plan_json([(5, [([2, 0], (0, 4))]), (3, [([1], (0, 4))])])
# 3 ranks, one 3-stage pipeline
# 3 ranks, rank 2 suspended (it holds nothing)
SUSPENDED = plan_json([(8, [([0], (0, 2)), ([1], (2, 4))])], suspended=[2])
THREE_PP = plan_json([(8, [([0], (0, 1)), ([1], (1, 3)), ([2], (3, 4))])])
K1, K2 = 3, 3            # steps before the save, after the load
BF16 = {"bf16": {"enabled": True}}
# fp16 whose dynamic scaler overflows on steps 0 and 1 (see test_malleus_precision.FP16_FORCED),
# with a warm-up LR schedule: the scaler, the skipped steps and the schedule must carry over
FP16_SCHED = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 20,
                       "loss_scale_window": 3, "hysteresis": 1, "min_loss_scale": 1},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                           "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": 10}}}


def _bf16(zero: int) -> dict:
    return dict(ds_config(zero), **BF16)


def _engine(pj, cfg, model=CFG):
    import malleus_ds
    from malleus_ds.plan import Plan

    return malleus_ds.initialize(model=model, config=cfg, plan=Plan.from_json(pj))[0]


def _result(eng, losses):
    """(losses, shards), adam in the shape ``_check_adam`` takes."""
    st = eng.local_state()
    shards = {n: (t.float().numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
    adam = {n: (st["exp_avg"][n].numpy(), st["exp_avg_sq"][n].numpy()) for n in st["exp_avg"]}
    return (losses, shards), None, None, adam


def _params_are_master_casts(eng, full) -> bool:
    """Every low-precision parameter equals its fp32 master (from ``full``) cast down."""
    import torch

    from malleus_ds.engine.tensor_parallel import shard

    for n, (t, dim, tr, ts) in eng.local_shards().items():
        m = full["params"][n] if dim is None else shard(full["params"][n], dim, tr, ts)
        if not torch.equal(t, m.to(t.dtype)):
            return False
    return True


def _masters_are_params(eng) -> bool:
    """fp32: every fp32 master equals its bucket range of the parameters."""
    import torch

    from malleus_ds.views import flatten

    opt = eng.optimizer
    data = {n: p.data for n, p in eng.named.items()}
    return all(torch.equal(m.data, flatten(b, data)[lo:hi])
               for b, (lo, hi), m in zip(opt.buckets, opt.ranges, opt.masters) if m is not None)


def _save_side(rank, world, root):
    root = Path(root)
    # fp32: HETERO ZeRO-1, save, fresh engine on D ZeRO-2 loads and trains on
    a = _engine(HETERO, ds_config(1))
    losses = [a.train_batch() for _ in range(K1)]
    full32, _ = gather_full_state(a, world)
    a.save_checkpoint(root / "fp32", client_state={"rank": rank})
    reuse = _buffer_reuse(a, root / "again")
    b = _engine(D, ds_config(2))
    path, client = b.load_checkpoint(root / "fp32")
    assert client == {"rank": rank}, client
    assert Path(path).name == f"malleus_rank{rank:05d}.pt"
    assert (b.global_steps, b.global_samples, b.optimizer.step_count()) == (K1, 8 * K1, K1)
    diff32 = _full_equal(full32, gather_full_state(b, world)[0])
    losses += [b.train_batch() for _ in range(K2)]
    res = _result(b, losses)
    # bf16: HETERO ZeRO-1, save, fresh engine on B (TP2) ZeRO-2 loads
    c = _engine(HETERO, _bf16(1))
    for _ in range(2):
        c.train_batch()
    full16, _ = gather_full_state(c, world)
    c.save_checkpoint(root / "bf16", tag="two")
    e = _engine(B, _bf16(2))
    e.load_checkpoint(root / "bf16")
    after16 = gather_full_state(e, world)[0]
    return (res, diff32, _full_equal(full16, after16), _params_are_master_casts(e, after16),
            (full32, full16) if rank == 0 else None, reuse)


def _buffer_reuse(eng, root):
    """Saves of one plan reuse its host buffer; a save made while another is unwritten gets a
    buffer of its own (engine/checkpoint_save.SaveBuffer)."""
    from malleus_ds.engine.checkpoint_save import write_snapshot

    buf = eng.runtime.save_buffer
    eng.save_checkpoint(root, tag="x")
    first = eng.snapshot_checkpoint(root, tag="y")
    second = eng.snapshot_checkpoint(root, tag="z")
    got = (eng.runtime.save_buffer is buf, first.buffer is buf, second.buffer is not buf, buf.busy)
    write_snapshot(first)
    write_snapshot(second)
    got += (buf.busy,)
    # a state tensor replaced (not written in place): the cached copies follow the new one
    import torch

    from malleus_ds.files.ckpt_format import open_rank_file, resolve

    opt = eng.runtime.optimizer
    st = opt.optimizer.state[next(m for m in opt.masters if m is not None)]
    old = st["exp_avg"]
    st["exp_avg"] = torch.full_like(old, 7.0)
    eng.save_checkpoint(root, tag="w")
    st["exp_avg"] = old
    d, meta = resolve(root, "w")
    ck = open_rank_file(d, eng.global_rank, meta)
    sevens = [bool((t == 7.0).all()) for k, t in ck["slices"].items() if k[0] == "exp_avg"]
    return got + (any(sevens),)


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    res = run_distributed(_save_side, 4, str(root), timeout=240)
    return root, res, _digest(root)


def test_load_under_other_plan_and_zero_stage_equals_reference(saved):
    root, res, _ = saved
    assert all(r[1] == 0.0 for r in res), [r[1] for r in res]        # bit-identical after load
    check(D, [r[0][0] for r in res], steps=K1 + K2, eps=EPS)
    _check_adam([r[0] for r in res], K1 + K2)
    assert (root / "fp32" / "latest").read_text() == f"global_step{K1}"
    d = root / "fp32" / f"global_step{K1}"
    assert sorted(p.name for p in d.iterdir()) == ["malleus_rank0000%d.pt" % r
                                                   for r in range(4)] + ["meta.json"]


def test_bf16_load_under_other_plan_is_bit_identical(saved):
    _root, res, _ = saved
    assert all(r[2] == 0.0 for r in res), [r[2] for r in res]        # masters and moments
    assert all(r[3] for r in res)                                    # bf16 params = casts
    assert all(r[5] == (True, True, True, True, False, True) for r in res), [r[5] for r in res]


def _load_side(rank, world, root, full32, full16, first_losses):
    import torch.distributed as dist

    from malleus_ds.engine.checkpoint import CheckpointError
    from malleus_ds.models.llama import model_config
    from malleus_ds.plan import Plan

    root = Path(root)
    out = {}
    # another world size, plan, ZeRO stage: equal the reference after 3 more steps
    a = _engine(THREE, ds_config(0))
    _path, client = a.load_checkpoint(root / "fp32")
    out["client"] = client
    out["diff32"] = _full_equal(full32, gather_full_state(a, world)[0])
    losses = list(first_losses) + [a.train_batch() for _ in range(K2)]
    out["train"] = _result(a, losses)
    # weights only: the saved parameters, zero moments, step 0
    a.load_checkpoint(root / "fp32", load_optimizer_states=False)
    st = gather_full_state(a, world)[0]
    out["weights_only"] = (_full_equal({"params": full32["params"], "exp_avg": {},
                                        "exp_avg_sq": {}},
                                       {"params": st["params"], "exp_avg": {}, "exp_avg_sq": {}}),
                           max(float(t.abs().max()) for k in ("exp_avg", "exp_avg_sq")
                               for t in st[k].values()),
                           a.optimizer.step_count(), a.global_steps)
    # fp32 checkpoint -> bf16 engine: the fp32 parameters become the masters
    b = _engine(THREE, _bf16(1))
    b.load_checkpoint(root / "fp32")
    after = gather_full_state(b, world)[0]
    out["fp32_to_bf16"] = (_full_equal(full32, after), _params_are_master_casts(b, after))
    # bf16 checkpoint -> fp32 engine: the masters become the parameters. First a switch that
    # only moves micro-batches, so the engine's optimizer reused every bucket: the load must
    # still rewrite those masters
    a.switch_plan(Plan.from_json(plan_json([(4, [([2, 0], (0, 4))]), (4, [([1], (0, 4))])])))
    a.load_checkpoint(root / "bf16", tag="two")
    out["bf16_to_fp32"] = (_full_equal(full16, gather_full_state(a, world)[0]),
                           _masters_are_params(a))
    # errors: the same message on every rank, nothing half-loaded
    if rank == 0:
        import shutil

        src = root / "fp32" / f"global_step{K1}"
        shutil.copytree(src, root / "broken" / "no_rank_file")
        (root / "broken" / "no_rank_file" / "malleus_rank00002.pt").unlink()
        shutil.copytree(src, root / "broken" / "unfinished")
        (root / "broken" / "unfinished" / "meta.json").unlink()
        # the older rank-file format (one torch.save zip per rank) still loads
        shutil.copytree(src, root / "zip" / "old")
        for f in (root / "zip" / "old").glob("malleus_rank*.pt"):
            to_zip(f)
    dist.barrier()
    a.load_checkpoint(root / "zip", tag="old")
    out["zip"] = _full_equal(full32, gather_full_state(a, world)[0])
    # a suspended rank holds nothing: it writes a rank file without slices, after a step too
    s = _engine(SUSPENDED, ds_config(1))
    s.train_batch()
    s.save_checkpoint(root / "suspended")
    want = gather_full_state(s, world)[0]
    a.load_checkpoint(root / "suspended")
    out["suspended"] = _full_equal(want, gather_full_state(a, world)[0])
    two = _engine(plan_json([(3, [([0], (0, 1)), ([1], (1, 2))]), (5, [([2], (0, 2))])], L=2),
                  ds_config(1), model_config("tiny", max_seq_len=16, num_layers=2))
    errors = {}
    for key, eng, args in (("missing_dir", a, (root / "nope",)), ("no_latest", a, (root,)),
                           ("no_rank_file", a, (root / "broken", "no_rank_file")),
                           ("unfinished", a, (root / "broken", "unfinished")),
                           ("num_layers", two, (root / "fp32",))):
        try:
            eng.load_checkpoint(*args)
            errors[key] = None
        except CheckpointError as e:
            errors[key] = str(e)
    # a client state that is not plain data: refused before anything is written, on every rank
    try:
        a.save_checkpoint(root / "unplain", client_state={"x": object()} if rank == 1 else {})
        errors["unplain_save"] = None
    except CheckpointError as e:
        errors["unplain_save"] = str(e)
    dist.barrier()
    out["unplain_written"] = (root / "unplain").exists()
    out["errors"] = errors
    out["broken"] = getattr(a, "_broken", None)
    # fp16 loss scaler, skipped steps and LR schedule, into another plan and ZeRO stage
    f = _engine(THREE, dict(ds_config(1), **FP16_SCHED))
    for _ in range(4):
        f.train_batch()
    before = gather_full_state(f, world)[0]
    keep = lambda e: (e.cur_scale, e.skipped_steps, e.global_steps, e.optimizer.step_count(),
                      e.optimizer.param_groups[0]["lr"], e.lr_scheduler.state_dict())
    want = keep(f)
    f.save_checkpoint(root / "fp16")
    g = _engine(THREE_PP, dict(ds_config(2), **FP16_SCHED))
    g.load_checkpoint(root / "fp16")
    out["fp16"] = (want, keep(g), _full_equal(before, gather_full_state(g, world)[0]),
                   (f.train_batch(), g.train_batch()))
    return out


def test_load_on_three_ranks_across_precisions_and_errors(saved):
    root, res, digest = saved
    full32, full16 = res[0][4]
    first = res[0][0][0][0][:K1]
    out = run_distributed(_load_side, 3, str(root), full32, full16, first, timeout=240)
    for r, o in enumerate(out):
        assert o["client"] == {"rank": r}
        assert o["diff32"] == 0.0
        assert o["weights_only"] == (0.0, 0.0, 0, K1)
        assert o["fp32_to_bf16"] == (0.0, True)
        assert o["bf16_to_fp32"] == (0.0, True)
        assert o["zip"] == 0.0
        assert o["suspended"] == 0.0
        assert o["broken"] is None
        want, got, diff, (loss_f, loss_g) = o["fp16"]
        assert want[:4] == (2.0 ** 18, 2, 4, 2) and want[4] > 0, want    # 2 skipped steps
        assert got == want and diff == 0.0
        # the next step on the two plans: equal up to fp16 re-ordering (TP vs pipeline)
        assert abs(loss_f - loss_g) <= 1e-3 * abs(loss_f), (loss_f, loss_g)
    check(THREE, [o["train"][0] for o in out], steps=K1 + K2, eps=EPS)
    _check_adam([o["train"] for o in out], K1 + K2)
    errs = out[0]["errors"]
    for o in out:
        assert o["errors"] == errs            # the same message on every rank
    assert "does not exist" in errs["missing_dir"]
    assert "no 'latest' file" in errs["no_latest"]
    assert "saved by 4 ranks but lacks 1 rank file(s): malleus_rank00002.pt" in errs["no_rank_file"]
    assert "save did not finish" in errs["unfinished"]
    assert "num_layers=4, this engine runs num_layers=2" in errs["num_layers"]
    assert "failed on rank(s) [1]: rank 1: nothing saved: rank 1's engine state['client_state']" \
           "['x'] holds a object: checkpoints hold plain data only" in errs["unplain_save"]
    assert not any(o["unplain_written"] for o in out)
    # loading never touched the files
    now = _digest(root)
    assert {k: now[k] for k in digest} == digest
