"""engine=malleus's start-up memory check (app/runners/fit.py) and the layout an elastic restart
takes when ``parallel.pp`` does not tile its world (config_sections.elastic_pp); no processes."""
from __future__ import annotations

import pytest

from malleus_ds.app.config import _elastic_pp
from malleus_ds.cost import stage_memory_mb
from malleus_ds.app.run_config import ConfigError
from malleus_ds.app.runners.base import DistEnv
from malleus_ds.app.runners.fit import _replan, check_fits, start_problem
from malleus_ds.app.runners.job import load_plan
from malleus_ds.app.runners.malleus_runner import build_ds_config
from tests.configs import cfg

TINY = {"name": "tiny", "max_seq_len": 16}


def _job(world: int, pp: int, device_mb: float | None = None, elastic: bool = False):
    mal = {"migrate_bucket_mb": 0.01}
    if device_mb is not None:
        mal["device_mb"] = device_mb
    from malleus_ds.app.config import build_run_config

    d = {"engine": "malleus", "model": TINY,
         "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 1},
         "parallel": {"tp": 1, "pp": pp, "dp": None}, "malleus": mal}
    c = build_run_config(d, world_size=world, elastic=elastic)
    p = load_plan(c)
    return c, p, build_ds_config(c, p)


def peak_mb(world: int, pp: int) -> float:
    """The fullest stage of the static layout, in MB (the memory model's)."""
    c, p, ds = _job(world, pp, device_mb=1e6)
    pr, _ = start_problem(c, p, ds, "cpu")
    return max(stage_memory_mb(pr, s.num_layers, j, len(q.stages), q.micro_batches, len(s.ranks))
               for q in p.pipelines for j, s in enumerate(q.stages))


def test_elastic_pp_takes_the_fewest_stages_at_least_asked_else_the_most():
    assert _elastic_pp(2, 4, 4) == 2          # 4 stages on 2 ranks: the most that tile
    assert _elastic_pp(4, 3, 8) == 4          # 3 stages do not tile 4: 4 (no more per rank)
    assert _elastic_pp(6, 4, 8) == 6
    assert _elastic_pp(6, 4, 5) == 3          # never more stages than layers
    assert _elastic_pp(5, 2, 8) == 5


def test_an_elastic_restart_retiles_the_pipeline_and_says_what_was_asked():
    c, plan, _ = _job(2, 4, elastic=True)
    assert (c.parallel.tp, c.parallel.pp, c.parallel.dp, c.parallel.asked_pp) == (1, 2, 1, 4)
    assert [len(p.stages) for p in plan.pipelines] == [2]
    with pytest.raises(ConfigError, match=r"parallel.tp=1 x parallel.pp=4 = 4 does not divide "
                                          r"the world size 2"):
        _job(2, 4, elastic=False)         # a first start gets the plain error
    assert cfg(world=4, engine="malleus", parallel={"pp": 4}).parallel.asked_pp is None
    with pytest.raises(ConfigError, match="does not divide"):     # other engines: unchanged
        from malleus_ds.app.config import build_run_config
        build_run_config({"engine": "deepspeed", "model": TINY, "parallel": {"pp": 4}},
                         world_size=2, elastic=True)


def test_a_plan_that_fits_starts_unchanged():
    c, p, ds = _job(1, 1, device_mb=1e6)
    fit = check_fits(c, p, ds, DistEnv())
    assert fit.plan == p and fit.note is None


def test_survivors_that_cannot_hold_the_model_get_the_numbers():
    four, two = peak_mb(4, 4), peak_mb(2, 2)
    assert four < two
    dev = (four + two) / 2 / 0.9              # reserved: 10% of the device
    c, p, ds = _job(4, 4, device_mb=dev)
    pr, limit = start_problem(c, p, ds, "cpu")
    from malleus_ds.cost import check_memory
    check_memory(pr, p)                       # the 4-rank layout fits ...
    c, p, ds = _job(2, 4, device_mb=dev, elastic=True)
    pr, limit = start_problem(c, p, ds, "cpu")
    kind, text = _replan(pr, 2.0, "why", 2)   # ... the 2 survivors cannot hold it
    assert kind == "error", text
    assert "the 2 ranks of this job cannot hold the model" in text
    assert "no layout can fit" in text and "MB per GPU > budget" in text
    assert "malleus.device_mb" in text
    c1, p1, ds1 = _job(1, 1, device_mb=dev)
    with pytest.raises(ConfigError, match="the 1 ranks of this job cannot hold the model"):
        check_fits(c1, p1, ds1, DistEnv())


def test_a_layout_that_fits_is_planned_when_the_static_one_does_not():
    # 2 ranks: one pipeline of 2 stages holds half the model each, two replicas hold all of it
    pipelined, replicated = peak_mb(2, 2), peak_mb(2, 1)
    dev = (pipelined + replicated) / 2 / 0.9
    c, p, ds = _job(2, 1, device_mb=dev)
    pr, limit = start_problem(c, p, ds, "cpu")
    kind, text = _replan(pr, 2.0, "why", 2)
    assert kind == "plan", text
    from malleus_ds.cost import check_memory
    from malleus_ds.plan import Plan

    new = Plan.from_json(text)
    check_memory(pr, new)
    assert max(len(q.stages) for q in new.pipelines) >= 2
    assert new.global_batch_size == p.global_batch_size
