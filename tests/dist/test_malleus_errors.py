"""Bad input fails before training, with a clear message, on every rank, without a hang."""
from tests.dist.harness import run_distributed
from tests.dist.test_malleus_cases import CFG, ds_config, plan_json

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


def _try_all(rank, world, cases):
    import malleus_ds
    from malleus_ds.plan import Plan

    out = {}
    for name, pj in cases.items():
        try:
            malleus_ds.initialize(model=CFG, config=ds_config(1), plan=Plan.from_json(pj))
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test inspects the message
            out[name] = f"{type(e).__name__}: {e}"
    # the world is still usable afterwards: a good plan trains one step
    eng, *_ = malleus_ds.initialize(model=CFG, config=ds_config(1), plan=Plan.from_json(GOOD))
    out["after"] = eng.train_batch()
    return out


def test_bad_plans_fail_on_every_rank_then_good_plan_runs():
    res = run_distributed(_try_all, 4, {k: v[0] for k, v in BAD.items()}, timeout=180)
    for rank, out in enumerate(res):
        for name, (_pj, needle) in BAD.items():
            assert "PlanError" in out[name] and needle in out[name], (rank, name, out[name])
        assert out["after"] == res[0]["after"] > 0
