"""engine=malleus checks the precision sections of the ds_config before any process group."""
import pytest

from malleus_ds.app import runners
from malleus_ds.app.run_config import ConfigError
from tests.configs import cfg


def _malleus(ds_extra):
    return cfg(world=2, engine="malleus", plan="static",
               deepspeed={"config": {"zero_optimization": {"stage": 1}, **ds_extra}})


def test_both_precisions_rejected_before_launch():
    c = _malleus({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        runners.validate(c)


def test_zero3_rejected_before_launch_with_the_engines_own_rule():
    from malleus_ds.engine.optimizer import ShardedOptimizer
    from malleus_ds.interop.sections import optimizer_settings

    msg = (r"zero_optimization.stage=3: MalleusEngine supports 0, 1 and 2 .*deepspeed=zero1\), "
           r"or, for ZeRO-3, give malleus_ds.initialize your own torch.nn.Module \(MalleusDPEngine")
    c = cfg(world=2, engine="malleus", plan="static",
            deepspeed={"config": {"zero_optimization": {"stage": 3}}})
    with pytest.raises(ConfigError, match="engine=malleus: ds_config." + msg):
        runners.validate(c)
    with pytest.raises(ValueError, match=msg):                 # the same words in the engine
        optimizer_settings({"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=msg):
        ShardedOptimizer([], None, {}, 0, 3, None)
    for stage in (0, 1, 2):
        runners.validate(cfg(world=2, engine="malleus", plan="static",
                             deepspeed={"config": {"zero_optimization": {"stage": stage}}}))


def test_bf16_passes_validation():
    runners.validate(_malleus({"bf16": {"enabled": True}}))


def test_monitors_default_to_the_run_folder_for_every_stock_engine(tmp_path):
    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.runners import deepspeed_runner, malleus_runner

    mon = {"csv_monitor": {"enabled": True}, "tensorboard": {"enabled": True, "output_path": "/x"}}
    for engine, mod in (("malleus", malleus_runner), ("deepspeed", deepspeed_runner)):
        c = build_run_config({"engine": engine, "plan": "static", "model": {"name": "tiny"},
                              "train": {"steps": 1, "global_batch_size": 8, "micro_batch_size": 1},
                              "deepspeed": {"config": mon}}, world_size=2, run_dir=str(tmp_path))
        ds = (mod.build_ds_config(c, malleus_runner.load_plan(c)) if engine == "malleus"
              else mod.build_ds_config(c))
        assert ds["csv_monitor"]["output_path"] == str(tmp_path), engine
        assert ds["tensorboard"]["output_path"] == "/x", engine        # the user's own wins


@pytest.mark.parametrize("m, pattern", [
    ({"detect": {"every": 0}}, r"malleus.detect.every=0 must be"),
    ({"detect": {"healthy": 0.5}}, r"malleus.detect.healthy=0.5 must be"),
    ({"detect": {"change": 0}}, r"malleus.detect.change=0"),
    ({"replan_at": [5, 3]}, r"malleus.replan_at\[1\]=3 is not after replan_at\[0\]=5"),
    ({"replan_at": [12]}, r"malleus.replan_at\[0\]=12 is not before the run's end "
                          r"\(train.steps=10\)"),
    ({"horizon_steps": 0}, r"malleus.horizon_steps=0 must be an integer >= 1"),
    ({"adaptive": "on"}, r"malleus.adaptive='on' must be true or false"),
])
def test_adaptive_settings_rejected_before_launch(m, pattern):
    """Parsed once, into the run config (``malleus.*`` in the user's words, not rewritten from
    the engine's ``ds_config.malleus.*``); the run's end is checked by the runner."""
    with pytest.raises(ConfigError, match=r"^(engine=malleus: )?" + pattern):
        runners.validate(cfg(world=2, engine="malleus", plan="static", malleus=m,
                             train={"steps": 10},
                             deepspeed={"config": {"zero_optimization": {"stage": 1}}}))


def test_the_ds_config_malleus_section_fills_what_the_app_leaves_unset():
    ds = {"zero_optimization": {"stage": 1},
          "malleus": {"horizon_steps": 7, "planner_time_limit_s": 0.5, "migrate_bucket_mb": 8}}
    c = cfg(world=2, engine="malleus", plan="static", deepspeed={"config": ds},
            malleus={"horizon_steps": 9})
    assert c.malleus.loop.horizon_steps == 9                  # the app's wins
    assert c.malleus.loop.planner_time_limit_s == 0.5 and c.malleus.migrate_bucket_mb == 8
    with pytest.raises(ConfigError, match=r"ds_config.malleus: unknown keys \['horizon'\]"):
        cfg(world=2, engine="malleus", deepspeed={"config": {"malleus": {"horizon": 3}}})
    with pytest.raises(ConfigError, match=r"engine=malleus: malleus.migrate_timeout_s=0 must be"):
        cfg(world=2, engine="malleus", malleus={"migrate_timeout_s": 0})


def test_replan_at_needs_engine_malleus():
    with pytest.raises(ConfigError, match="malleus.replan_at is set but engine=deepspeed"):
        cfg(world=2, engine="deepspeed", malleus={"replan_at": [3]})


def test_app_and_engine_reject_a_plan_with_the_same_words(tmp_path):
    """One plan check (engine/plan_check.py): a TP=4 stage on a model with 2 KV heads is refused
    at the app's start-up and by the engine's own check, naming the stage and the field."""
    import json

    from malleus_ds.app.config import build_run_config
    from malleus_ds.engine.engine import MalleusEngine
    from malleus_ds.engine.settings import MalleusSettings
    from malleus_ds.models.hf import load_hf_model
    from malleus_ds.plan import Plan, PlanError
    from tests.cases import plan_json

    pj = plan_json([(8, [([0, 1, 2, 3], (0, 4))])])
    f = tmp_path / "tp4.json"
    f.write_text(json.dumps(pj))
    words = (r"pipelines\[0\]\.stages\[0\]: TP group size 4 does not divide the model's "
             r"num_key_value_heads=2")
    c = build_run_config({"engine": "malleus", "plan": str(f),
                          "model": {"name": "hf", "hf_config": "tiny-qwen2"}}, world_size=4)
    with pytest.raises(ConfigError, match=rf"engine=malleus plan={f}: plan {words}"):
        runners.validate(c)
    with pytest.raises(PlanError, match=rf"^{words}"):
        MalleusEngine.build_plan(Plan.from_json(pj), load_hf_model("tiny-qwen2"), 4,
                                 MalleusSettings(gpus_per_node=4), {})   # as the engine resolves it
