"""Bad input fails before training, with a clear message, on every rank, without a hang."""
from tests.integration.harness import run_distributed
from tests.cases import CFG, ds_config, plan_json

GOOD = plan_json([(4, [([0], (0, 2)), ([1], (2, 4))]), (4, [([2], (0, 4))])], suspended=[3])
BAD = {
    # Σ micro_batches = 7 != 8
    "invalid": (plan_json([(4, [([0], (0, 4))]), (3, [([1], (0, 4))])], suspended=[2, 3]),
                "global_batch_size=8"),
    # names rank 5 in a world of 4
    "world": (plan_json([(4, [([0], (0, 4))]), (4, [([5], (0, 4))])]), "outside the world of 4"),
    # 6 layers for a 4-layer model
    "layers": (plan_json([(8, [([0], (0, 6))])], L=6), "num_layers=6 does not match"),
    # TP group of 3 ranks: 3 does not divide the model's 4 heads
    "tp": (plan_json([(8, [([0, 1, 2], (0, 4))])], suspended=[3]), "does not divide the model's num_heads=4"),
}


def _try_all(rank, world, cases, out_dir):
    import malleus_ds
    from malleus_ds.plan import Plan

    out = {}
    for name, pj in cases.items():
        try:
            malleus_ds.initialize(model=CFG, config=ds_config(1), plan=Plan.from_json(pj))
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test inspects the message
            out[name] = f"{type(e).__name__}: {e}"
    # the world is still usable afterwards: a good plan trains, with a csv monitor and a
    # WarmupLR scheduler from the stock ds_config fields, and a data_iter on the pipeline ends
    cfg = dict(ds_config(1), csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "m"},
               scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                         "warmup_num_steps": 4}})
    eng, _opt, _dl, sched = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(GOOD))
    out["after"] = eng.train_batch()
    out["sched"] = type(sched).__name__
    if eng.located is not None:
        ids = eng.my_micro_batches(1)
        out["iter_loss"] = eng.train_batch(data_iter=iter([eng.data.batch(i) for i in ids]))
    else:
        out["iter_loss"] = eng.train_batch()
    out["lr"] = [g["lr"] for g in eng.optimizer.param_groups]   # WarmupLR (log) after 2 steps
    # model given as a whole StageModule: each rank copies its layers out of it
    from malleus_ds.models import build_model
    whole, *_ = malleus_ds.initialize(model=build_model(CFG, 0), config=ds_config(1),
                                      plan=Plan.from_json(GOOD))
    out["whole"] = whole.train_batch(step=0)
    return out


def test_bad_plans_fail_on_every_rank_then_good_plan_runs(tmp_path):
    import glob

    res = run_distributed(_try_all, 4, {k: v[0] for k, v in BAD.items()}, str(tmp_path), timeout=180)
    for rank, out in enumerate(res):
        for name, (_pj, needle) in BAD.items():
            assert "PlanError" in out[name] and needle in out[name], (rank, name, out[name])
        assert out["after"] == res[0]["after"] > 0
        assert out["sched"] == "WarmupLR" and 0 < out["lr"][0] < 1e-3
        assert out["iter_loss"] == res[0]["iter_loss"] > 0
        assert out["whole"] == out["after"]
    assert glob.glob(str(tmp_path / "**" / "*train_loss*"), recursive=True), list(tmp_path.rglob("*"))
