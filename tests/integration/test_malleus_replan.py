"""Re-planning and checkpoints keep the math: train on plan A, hand each rank its slices of the state under
plan B (a naive all-gather "migrator" for the test), train on; equals one 10-step reference run.

This exercises the engine side of migration (DESIGN.md §6): ``local_state`` / ``load_local_state``
by global parameter name, with ZeRO-partitioned Adam states and TP sizes that change between
the plans. The real migrator (diff -> slice transfers) is a separate piece.
"""
from tests.integration.harness import run_distributed
from tests.cases import CFG, EPS, check, ds_config, plan_json
from tests.cases import HETERO


def _to_full(t, name, dim, tp_rank, tp_size, full):
    """Place local shard ``t`` of parameter ``name`` into the full tensor ``full[name]``."""
    import torch
    if dim is None:
        full[name] = t.clone()
        return
    shape = list(t.shape)
    shape[dim] *= tp_size
    f = full.setdefault(name, torch.zeros(shape))
    w = t.shape[dim]
    f.narrow(dim, tp_rank * w, w).copy_(t)


def gather_full_state(engine, world):
    """Collective: the whole model's params and Adam states as full tensors by global name (a
    naive all-gather "migrator"), plus this rank's ``local_state`` for its step counters."""
    import torch.distributed as dist

    st, info = engine.local_state(), {n: v[1:] for n, v in engine.local_shards().items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, (st, info))
    full = {k: {} for k in ("params", "exp_avg", "exp_avg_sq")}
    for s, inf in everyone:
        for k in full:
            for n, t in s[k].items():
                _to_full(t, n, *inf[n], full[k])
    return full, st


def load_full_state(engine, full, st):
    """Hand ``engine`` its slices of ``full`` (from :func:`gather_full_state`); returns them."""
    from malleus_ds.engine.tensor_parallel import shard

    mine = {k: {} for k in full}
    for n, (_t, dim, tr, ts) in engine.local_shards().items():
        for k in full:
            mine[k][n] = full[k][n] if dim is None else shard(full[k][n], dim, tr, ts)
    engine.load_local_state(dict(mine, step=st["step"], global_steps=st["global_steps"]))
    return mine


def _replan(rank, world, pa, pb, k1, k2, zero_a, zero_b):
    import malleus_ds
    from malleus_ds.plan import Plan

    a, *_ = malleus_ds.initialize(model=CFG, config=ds_config(zero_a), plan=Plan.from_json(pa))
    losses = [a.train_batch() for _ in range(k1)]
    full, st = gather_full_state(a, world)
    b, *_ = malleus_ds.initialize(model=CFG, config=ds_config(zero_b), plan=Plan.from_json(pb))
    load_full_state(b, full, st)
    losses += [b.train_batch() for _ in range(k2)]
    return losses, {n: (t.numpy(), d, x, y) for n, (t, d, x, y) in b.local_shards().items()}


def test_replan_hetero_to_other_layout_zero1_then_zero2():
    # A = HETERO (p0: [0] L0-1, TP2 [1,2] L1-4; p1: [3] all), ZeRO-1;
    # B: p0: TP2 [2,0] L0-3, [1] L3-4; p1: [3] all, ZeRO-2; micro-batches 5/3 -> 3/5
    pb = plan_json([(3, [([2, 0], (0, 3)), ([1], (3, 4))]), (5, [([3], (0, 4))])])
    res = run_distributed(_replan, 4, HETERO, pb, 5, 5, 1, 2, timeout=240)
    check(pb, res, steps=10, eps=EPS)      # losses of all 10 steps and final shards


def _save_load(rank, world, pj, ckpt_dir, k1, k2):
    import malleus_ds
    from malleus_ds.plan import Plan

    a, *_ = malleus_ds.initialize(model=CFG, config=ds_config(1), plan=Plan.from_json(pj))
    losses = [a.train_batch() for _ in range(k1)]
    a.save_checkpoint(ckpt_dir, client_state={"note": "hi"})
    b, *_ = malleus_ds.initialize(model=CFG, config=ds_config(1), plan=Plan.from_json(pj))
    _path, client = b.load_checkpoint(ckpt_dir)
    assert client == {"note": "hi"} and b.global_steps == k1
    losses += [b.train_batch() for _ in range(k2)]
    return losses, {n: (t.numpy(), d, x, y) for n, (t, d, x, y) in b.local_shards().items()}


def test_save_checkpoint_then_load_into_fresh_engine(tmp_path):
    res = run_distributed(_save_load, 4, HETERO, str(tmp_path), 3, 3, timeout=240)
    check(HETERO, res, steps=6, eps=EPS)
    assert (tmp_path / "latest").read_text() == "global_step3"
