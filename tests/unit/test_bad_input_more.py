"""More bad input (issue 9, item 5): each gets one clear message naming the field and the value,
raised by :func:`build_run_config` (every rank, before any process group), by
``launch/summarize.py`` (one line on stderr, exit 2) or by the planner (the memory numbers)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from malleus_ds.app.config import TOP_LEVEL_KEYS, ConfigError, build_run_config
from malleus_ds.emulation.straggler import StragglerError, StragglerSchedule
from malleus_ds.plan import PlanError
from malleus_ds.problem import Problem
from malleus_ds.planner import PlannerConfig, plan

REPO = Path(__file__).resolve().parents[2]
SUMMARIZE = REPO / "launch" / "summarize.py"


def build(world=2, **top):
    d = {"engine": "torch", "model": {"name": "tiny"},
         "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 1}}
    d.update(top)
    return build_run_config(d, world_size=world)


# --- device ---------------------------------------------------------------------------------


def test_device_cuda_without_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device=cuda but no CUDA GPU is visible \(torch\.cuda"
                                          r"\.is_available\(\) is False\); use device=cpu or "
                                          r"device=auto"):
        build(device="cuda")
    assert build(device="cpu").device == "cpu" and build(device="auto").device == "auto"


def test_device_cuda_with_a_gpu_passes(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build(device="cuda").device == "cuda"


# --- straggler.schedule ---------------------------------------------------------------------


@pytest.mark.parametrize("raw", [4, 2.5, "rank1", {"rank": 1, "rate": 2.0}, True])
def test_straggler_schedule_not_a_list(raw):
    with pytest.raises(StragglerError, match=r"straggler.schedule must be a list of "
                                             r"\{rank, rate, start_step, end_step\} entries"):
        StragglerSchedule.parse(raw, 2)
    with pytest.raises(ConfigError, match=rf"straggler.schedule must be a list .*got "
                                          rf"{_re(repr(raw))} \({type(raw).__name__}\)"):
        build(straggler={"schedule": raw})


def test_straggler_schedule_int_names_value_and_type():
    with pytest.raises(ConfigError, match=r"got 4 \(int\)"):
        build(straggler={"schedule": 4})


def test_straggler_schedule_empty_forms():
    assert not StragglerSchedule.parse(None) and not StragglerSchedule.parse([])
    assert not StragglerSchedule.parse(())
    assert not build(straggler={"schedule": None}).straggler


def test_straggler_section_must_be_a_mapping_with_schedule():
    with pytest.raises(ConfigError, match=r"straggler must be a mapping with key 'schedule', "
                                          r"got 4"):
        build(straggler=4)
    with pytest.raises(ConfigError, match=r"straggler has unknown fields \['rank'\]; "
                                          r"allowed: \['schedule', 'method', "
                                          r"'link_schedule'\]"):
        build(straggler={"schedule": [], "rank": 1})


# --- nproc_per_node -------------------------------------------------------------------------


@pytest.mark.parametrize("v", [0, -2, 2.5, 2.0, "two", None, True])
def test_bad_nproc_per_node(v):
    with pytest.raises(ConfigError, match=rf"nproc_per_node={_re(repr(v))} must be an integer "
                                          rf">= 1 \(local ranks to start; 1 = run in this "
                                          rf"process\)"):
        build(nproc_per_node=v)


def test_good_nproc_per_node():
    build(nproc_per_node=1)
    build(nproc_per_node=4)
    build()                                         # absent: 1


# --- train.warmup_steps ---------------------------------------------------------------------


def test_negative_warmup_steps():
    with pytest.raises(ConfigError, match=r"train.warmup_steps=-1 must be >= 0"):
        build(train={"steps": 2, "global_batch_size": 8, "micro_batch_size": 1,
                     "warmup_steps": -1})
    c = build(train={"steps": 2, "global_batch_size": 8, "micro_batch_size": 1, "warmup_steps": 0})
    assert c.train.warmup_steps == 0


# --- plan with another engine ---------------------------------------------------------------


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
@pytest.mark.parametrize("plan_path", ["/no/such/plan.json", "plans/a.json"])
def test_plan_needs_engine_malleus(engine, plan_path):
    with pytest.raises(ConfigError, match=rf"plan= only applies to engine=malleus; got "
                                          rf"engine={engine} with plan='{_re(plan_path)}'"):
        build(engine=engine, plan=plan_path)


@pytest.mark.parametrize("engine", ["torch", "deepspeed", "malleus"])
def test_plan_static_is_fine_with_every_engine(engine):
    for p in ("static", None, ""):
        assert build(engine=engine, plan=p).plan == "static"


def test_plan_path_kept_for_engine_malleus():
    assert build(engine="malleus", plan="/x/plan.json").plan == "/x/plan.json"


# --- unknown top-level keys -----------------------------------------------------------------


def test_unknown_top_level_key_is_refused_with_the_known_keys():
    with pytest.raises(ConfigError) as ei:
        build(checkpoint_dir="/tmp/ck")
    msg = str(ei.value)
    assert "unknown top-level fields ['checkpoint_dir']" in msg
    assert "did you mean 'checkpoint_dir' -> 'checkpoint'?" in msg
    assert "allowed: ['checkpoint', 'cluster', 'comm_timeout_s'," in msg
    for k in TOP_LEVEL_KEYS:
        assert repr(k) in msg


def test_unknown_key_without_a_close_match():
    with pytest.raises(ConfigError, match=r"unknown top-level fields \['zzz'\]; allowed: \["):
        build(zzz=1)


def test_every_key_the_composed_config_has_is_known():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = REPO / "conf"
    for exp in [None, *sorted(p.stem for p in (conf / "experiment").glob("*.yaml"))]:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            c = compose(config_name="config", overrides=[f"experiment={exp}"] if exp else [])
        keys = set(OmegaConf.to_container(c, resolve=True))
        assert keys <= set(TOP_LEVEL_KEYS), (exp, keys - set(TOP_LEVEL_KEYS))


# --- launch/summarize.py --------------------------------------------------------------------


# --- planner: no valid plan -----------------------------------------------------------------


def _problem(device_mb, rates=None):
    return Problem.from_json({
        "version": 1, "name": "big", "cluster": {"nodes": 2, "gpus_per_node": 8},
        "model": {"num_layers": 80},
        "training": {"global_batch_size": 16, "micro_batch_size": 1, "tp": 8, "pp": 2, "dp": 1},
        "cost": {"tp_slowdown": {"1": 1.0, "2": 1.9, "4": 3.66, "8": 7.22}},
        "memory": {"device_mb": device_mb, "reserved_mb": 4096, "layer_static_mb": 1100,
                   "layer_activation_mb": 250, "embedding_mb": 1200, "extra_mb": 3000},
        "rates": rates or {}})


def _re(s: str) -> str:
    return re.escape(s)


QUICK = PlannerConfig(pop_size=8, max_generations=3, patience=2, polish_evals=50)


@pytest.mark.parametrize("rates", [None, {"3": 4.0}], ids=["healthy", "straggler"])
def test_no_valid_plan_says_which_memory_term_fails_by_how_much(rates):
    with pytest.raises(PlanError) as ei:
        plan(_problem(40000, rates), config=QUICK)
    msg = str(ei.value)
    assert "no valid plan found" in msg
    # the static plan's fullest stage, worded as check_memory / malleus-sim word it
    assert ("the static plan's pipelines[0].stages[0] (ranks [0, 1, 2, 3, 4, 5, 6, 7], layers "
            "[0, 40]) needs 68200 MB > budget 35904 MB (device_mb - reserved_mb)") in msg
    # (80 x 1350 + 2 x 1200) x 8 / 16 + 3000 = 58200 MB on every layout
    assert ("no layout can fit: 80 layers x (layer_static_mb 1100 + layer_activation_mb 250) + "
            "2 x embedding_mb 1200, x tp 8 / 16 GPUs, + extra_mb 3000 = 58200 MB per GPU > "
            "budget 35904 MB (device_mb 40000 - reserved_mb 4096), 22296 MB short") in msg


def test_no_valid_plan_extra_mb_alone():
    pr = _problem(6000)                     # budget 1904 MB < extra_mb 3000
    with pytest.raises(PlanError, match=r"no layout can fit: extra_mb 3000 alone = 3000 MB per "
                                        r"GPU > budget 1904 MB .*1096 MB short"):
        plan(pr, config=QUICK)


def test_no_valid_plan_first_stage():
    pr = _problem(9000)                     # budget 4904 MB < 1200 + 1350 + 3000 = 5550 MB
    with pytest.raises(PlanError, match=r"no layout can fit: the first stage: embedding_mb 1200 \+ "
                                        r"one layer \(layer_static_mb 1100 \+ layer_activation_mb "
                                        r"250\) \+ extra_mb 3000 = 5550 MB per GPU > budget 4904 "
                                        r"MB .*646 MB short"):
        plan(pr, config=QUICK)


def test_no_valid_plan_floor_within_budget_says_so():
    with pytest.raises(PlanError, match=r"every layout needs >= 58200 MB per GPU \(80 layers .*"
                                        r"\), within the budget 59904 MB"):
        plan(_problem(64000), config=QUICK)
