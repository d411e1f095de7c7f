"""conf/plan_sweep.yaml composes, and launch/plan.py turns it into frozen objects."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _launch_plan():
    spec = importlib.util.spec_from_file_location("launch_plan", REPO / "launch" / "plan.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["launch_plan"] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("overrides", [[], ["planner=fast", "rates=12"],
                                       ["stragglers=[1,9]", "rates=[2.0,3.5]"], ["rates=null"]])
def test_plan_sweep_config_composes_to_a_job(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="plan_sweep", overrides=overrides)
    job = _launch_plan().to_job(cfg)
    assert job.problem.num_gpus == 64
    if "rates=null" in overrides:
        assert job.problem.rates == {}
    elif "stragglers=[1,9]" in overrides:
        assert job.problem.rates == {1: 2.0, 9: 3.5}
    else:
        assert job.problem.rates == {9: 12.0 if "rates=12" in overrides else 4.0}
    assert job.planner.pop_size > 0


def test_plan_sweep_bad_rates_is_an_error():
    from hydra import compose, initialize_config_dir

    from malleus_ds.plan import PlanError

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="plan_sweep", overrides=["rates=[1.5,2]"])
    with pytest.raises(PlanError, match="2 values for 1 stragglers"):
        _launch_plan().to_job(cfg)
