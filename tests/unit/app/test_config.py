"""Bad input gets a clear error naming the field and the numbers, before any process group."""
from __future__ import annotations

import json

import pytest

from malleus_ds.app import runners
from malleus_ds.app.config import ConfigError, build_run_config, load_ds_config
from tests.configs import cfg
from malleus_ds.emulation.straggler import StragglerSchedule




def test_defaults_infer_dp_and_cluster():
    c = cfg(world=4)
    assert (c.parallel.tp, c.parallel.pp, c.parallel.dp) == (1, 1, 4)
    assert (c.cluster.gpus_per_node, c.cluster.nodes) == (4, 1)
    assert c.train.optim.lr == 1e-3 and c.straggler.entries == ()
    assert c.model.num_layers == 4 and c.model.name == "tiny"


def test_model_overrides_apply():
    c = cfg(model={"name": "small", "num_layers": 3, "hidden_size": None})
    assert c.model.num_layers == 3 and c.model.hidden_size == 256


@pytest.mark.parametrize("parallel,world,pattern", [
    ({"tp": 1, "pp": 1, "dp": 3}, 2, r"tp=1 x pp=1 x dp=3 = 3 ranks does not match the world size 2"),
    ({"tp": 1, "pp": 3, "dp": None}, 4, r"parallel.tp=1 x parallel.pp=3 = 3 does not divide the world size 4"),
    ({"tp": 1, "pp": 8, "dp": None}, 8, r"parallel.pp=8 stages cannot hold model.num_layers=4"),
    ({"tp": 3, "pp": 1, "dp": None}, 3, r"parallel.tp: TP group size 3 does not divide the model's num_heads=4"),
    ({"tp": 0, "pp": 1, "dp": None}, 2, r"parallel.tp=0 must be >= 1"),
])
def test_layout_vs_world_size(parallel, world, pattern):
    with pytest.raises(ConfigError, match=pattern):
        cfg(world=world, parallel=parallel)


def test_tp_must_fit_in_a_node():
    with pytest.raises(ConfigError, match=r"parallel.tp=2 does not divide cluster.gpus_per_node=1"):
        cfg(world=2, parallel={"tp": 2}, cluster={"gpus_per_node": 1})
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_node=3 does not divide the world size 4"):
        cfg(world=4, cluster={"gpus_per_node": 3})


@pytest.mark.parametrize("train,pattern", [
    ({"global_batch_size": 10, "micro_batch_size": 4},
     r"train.global_batch_size=10 is not a multiple of train.micro_batch_size=4"),
    ({"global_batch_size": 1}, r"1 micro-batches cannot feed parallel.dp=2"),
    ({"steps": 0}, r"train.steps=0 must be >= 1"),
    ({"lr": "fast"}, r"train.lr='fast' must be a number"),
    ({"global_batch_size": 2.5}, r"train.global_batch_size=2.5 must be an integer"),
    ({"bogus": 1}, r"train has unknown fields \['bogus'\]"),
])
def test_batch_errors(train, pattern):
    with pytest.raises(ConfigError, match=pattern):
        cfg(train=train)


def test_deepspeed_needs_even_micro_batches_per_replica():
    c = cfg(world=2, engine="deepspeed", train={"global_batch_size": 6, "micro_batch_size": 2})
    with pytest.raises(ConfigError, match=r"3 micro-batches do not split evenly over "
                                          r"parallel.dp=2 replicas"):
        runners.validate(c)


def test_unknown_model_and_engine():
    with pytest.raises(ConfigError, match=r"model='huge' is not a known model size.*'tiny'"):
        cfg(model={"name": "huge"})
    with pytest.raises(ConfigError, match=r"model.hidden_size=30 is not divisible by "
                                          r"model.num_heads=4"):
        cfg(model={"hidden_size": 30})
    with pytest.raises(ConfigError, match=r"engine='jax' is not known"):
        cfg(engine="jax")


def test_malformed_ds_config(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 1,}}')
    with pytest.raises(ConfigError, match=r"ds.json' is not valid JSON: .* line 1 column"):
        cfg(deepspeed={"config_file": str(bad)})
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object, got list"):
        load_ds_config(bad)
    bad.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=5 must be 0, 1, 2 or 3"):
        cfg(deepspeed={"config_file": str(bad)})
    with pytest.raises(ConfigError, match=r"file not found"):
        cfg(deepspeed={"config_file": str(tmp_path / "missing.json")})


def test_ds_config_batch_fields_must_agree(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 1}}))
    with pytest.raises(ConfigError, match=r"ds_config train_batch_size=16 contradicts "
                                          r"train.global_batch_size=8"):
        cfg(engine="deepspeed", deepspeed={"config_file": str(f)})
    f.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": 2}}))
    c = cfg(engine="deepspeed", deepspeed={"config_file": str(f)})
    runners.validate(c)
    assert c.deepspeed.zero_stage == 2 and c.deepspeed.config_file == str(f.resolve())


def test_user_ds_config_builds_engine_config(tmp_path):
    from malleus_ds.app.runners.deepspeed_runner import build_ds_config

    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 1},
                             "csv_monitor": {"enabled": True}}))
    c = build_run_config({"engine": "deepspeed",
                          "train": {"global_batch_size": 8, "micro_batch_size": 2},
                          "deepspeed": {"config_file": str(f), "config": {"gradient_clipping": 1.0}}},
                         world_size=2, run_dir=str(tmp_path))
    ds = build_ds_config(c)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 1.0 and ds["zero_optimization"]["stage"] == 1
    assert ds["csv_monitor"]["output_path"] == str(tmp_path)


def test_a_ds_config_file_clips_as_deepspeed_does(tmp_path):
    """A ds_config file without ``gradient_clipping`` clips at DeepSpeed's default (1.0), as the
    user's own DeepSpeed runs did, with a note; one that says, and inline configs, keep theirs
    (the runners' inline default is 0.0, engine=torch's math)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from malleus_ds.app.config import DS_GRADIENT_CLIPPING
    from malleus_ds.app.runners import deepspeed_runner, malleus_runner

    assert DS_GRADIENT_CLIPPING == GRADIENT_CLIPPING_DEFAULT
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    for engine in ("deepspeed", "malleus"):
        c = build_run_config({"engine": engine, "deepspeed": {"config_file": str(f)},
                              "train": {"global_batch_size": 8, "micro_batch_size": 1}},
                             world_size=2)
        assert c.deepspeed.config["gradient_clipping"] == 1.0
        assert any("gradient_clipping: not in" in n and "DeepSpeed's default" in n
                   for n in c.deepspeed.notes), c.deepspeed.notes
        if engine == "deepspeed":
            assert deepspeed_runner.build_ds_config(c)["gradient_clipping"] == 1.0
        else:
            plan = malleus_runner.load_plan(c)
            assert malleus_runner.build_ds_config(c, plan)["gradient_clipping"] == 1.0
    f.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0}))
    for ds in ({"config_file": str(f)}, {"config": {"zero_optimization": {"stage": 1}}}):
        c = build_run_config({"engine": "deepspeed", "deepspeed": ds,
                              "train": {"global_batch_size": 8, "micro_batch_size": 1}},
                             world_size=2)
        assert deepspeed_runner.build_ds_config(c)["gradient_clipping"] == 0.0
        assert not any("gradient_clipping" in n for n in c.deepspeed.notes)


def test_deepspeed_engine_limits():
    with pytest.raises(ConfigError, match=r"engine=deepspeed: parallel.tp=2 is not supported.*"
                                          r"engine=malleus"):
        runners.validate(cfg(world=2, engine="deepspeed", parallel={"tp": 2}))
    c = cfg(world=2, engine="deepspeed", parallel={"pp": 2},
            deepspeed={"config": {"zero_optimization": {"stage": 2}}})
    with pytest.raises(ConfigError, match=r"PipelineEngine supports ZeRO stage 0 or 1.*stage=2"):
        runners.validate(c)
    with pytest.raises(ConfigError, match=r"engine=torch is the data-parallel reference"):
        runners.validate(cfg(world=2, parallel={"pp": 2}))


@pytest.mark.parametrize("schedule,pattern", [
    ([{"rank": 2, "rate": 4.0}], r"straggler.schedule\[0\].rank=2 does not exist: the job has "
                                 r"world_size=2"),
    ([{"rank": 1, "rate": 0.5}], r"straggler.schedule\[0\].rate=0.5 must be a finite number >= 1.0"),
    ([{"rank": 1}], r"straggler.schedule\[0\].rate is required"),
    ([{"rank": 1, "rate": 2, "start_step": 5, "end_step": 5}],
     r"straggler.schedule\[0\]: end_step=5 must be > start_step=5"),
    ([{"rank": 1, "rate": 2, "speed": 3}], r"straggler.schedule\[0\] has unknown keys \['speed'\]"),
    ([{"rank": "one", "rate": 2}], r"straggler.schedule\[0\].rank='one' must be an integer"),
    ({"rank": 1, "rate": 2}, r"straggler.schedule must be a list"),
    ([3], r"straggler.schedule\[0\] must be a mapping"),
])
def test_malformed_straggler_schedule(schedule, pattern):
    with pytest.raises(ConfigError, match=pattern):
        cfg(straggler={"schedule": schedule})


def test_straggler_schedule_parses():
    c = cfg(straggler={"schedule": [{"rank": 1, "rate": 4, "start_step": 5, "end_step": 100}]})
    assert c.straggler == StragglerSchedule.parse([{"rank": 1, "rate": 4.0, "start_step": 5,
                                                    "end_step": 100}])


def test_an_elastic_restart_on_fewer_ranks_leaves_out_the_emulation_of_absent_ones():
    """After a lost node the survivors restart on 2 of 4 ranks: the entries for ranks 2-3 (or
    node 1) are left out and said; the job's own entries stay; the first start still refuses."""
    d = {"engine": "malleus", "model": {"name": "tiny"},
         "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 1},
         "straggler": {"schedule": [{"rank": 2, "rate": 3.0}, {"rank": 1, "rate": 2.0}],
                       "link_schedule": [{"ranks": [2, 3], "rate": 5.0},
                                         {"nodes": [0, 1], "rate": 5.0},
                                         {"ranks": [0, 1], "rate": 4.0}]},
         "cluster": {"gpus_per_node": 2}}
    c = build_run_config(d, world_size=2, elastic=True)
    assert [e.rank for e in c.straggler.entries] == [1]
    assert [(e.ends, e.by_rank) for e in c.links.entries] == [((0, 1), True)]
    tail = "this elastic restart has 2 ranks on 1 node(s); it applies again when the job is " \
           "back to its size"
    assert c.emulation_notes == (
        f"straggler.schedule[0] (rank=2) is left out: {tail}",
        f"straggler.link_schedule[0] (ranks=[2, 3]) is left out: {tail}",
        f"straggler.link_schedule[1] (nodes=[0, 1]) is left out: {tail}")
    assert build_run_config(d, world_size=4, elastic=True).emulation_notes == ()
    with pytest.raises(ConfigError, match=r"schedule\[0\].rank=2 does not exist"):
        build_run_config(d, world_size=2)


NO_CGROUP = "no cgroup cpu controller is mounted (looked for /x/cpu/cpu.cfs_quota_us)"
SLOW1 = [{"rank": 1, "rate": 3.0, "start_step": 2}]


def test_straggler_method_sleep_default_quota_and_unknown():
    assert cfg().straggler.method == "sleep"
    assert cfg(straggler={"schedule": SLOW1, "method": None}).straggler.method == "sleep"
    c = cfg(straggler={"schedule": SLOW1, "method": "quota"})
    assert c.straggler.method == "quota" and c.straggler.rate(1, 2) == 3.0
    with pytest.raises(ConfigError, match=r"straggler.method='nice' is not known; choose one of "
                                          r"\['sleep', 'quota', 'compete'\]"):
        cfg(straggler={"schedule": SLOW1, "method": "nice"})


def test_straggler_method_quota_refused_where_the_machine_cannot(monkeypatch):
    import malleus_ds.emulation.cpu_quota as cq

    monkeypatch.setattr(cq, "unavailable_reason", lambda: NO_CGROUP)
    for engine in ("torch", "deepspeed", "malleus"):
        c = cfg(engine=engine, straggler={"schedule": SLOW1, "method": "quota"})
        with pytest.raises(ConfigError, match=r"^straggler.method=quota: no cgroup cpu controller "
                                              r"is mounted \(looked for /x/cpu/cpu.cfs_quota_us\); "
                                              r"use straggler.method=compete or "
                                              r"straggler.method=sleep$"):
            runners.validate(c)
        runners.validate(cfg(engine=engine, straggler={"schedule": SLOW1}))      # sleep: fine
        runners.validate(cfg(engine=engine, straggler={"schedule": [], "method": "quota"}))


def test_ds_config_malleus_straggler_method(monkeypatch):
    import malleus_ds.emulation.cpu_quota as cq
    from malleus_ds.engine.settings import MalleusSettings
    from malleus_ds.emulation.straggler import StragglerSchedule as S

    st = MalleusSettings.from_config({"straggler": {"schedule": SLOW1, "method": "quota"}}).straggler
    assert st == tuple(SLOW1) and st.method == "quota" and S.parse(st).method == "quota"
    assert MalleusSettings.from_config({"straggler": SLOW1}).straggler.method == "sleep"
    with pytest.raises(ValueError, match=r"ds_config.malleus.straggler.method='fast' is not known"):
        MalleusSettings.from_config({"straggler": {"schedule": SLOW1, "method": "fast"}})
    with pytest.raises(ValueError, match=r"ds_config.malleus.straggler has unknown keys \['rate'\]"):
        MalleusSettings.from_config({"straggler": {"schedule": SLOW1, "rate": 2}})

    def malleus(strag):
        return cfg(engine="malleus", deepspeed={"config": {"malleus": {"straggler": strag}}})

    monkeypatch.setattr(cq, "unavailable_reason", lambda: NO_CGROUP)
    with pytest.raises(ConfigError, match=r"ds_config.malleus.straggler.method=quota: no cgroup "
                                          r"cpu .*; use ds_config.malleus.straggler.method=compete or "
                                          r"ds_config.malleus.straggler.method=sleep"):
        runners.validate(malleus({"schedule": SLOW1, "method": "quota"}))
    with pytest.raises(ConfigError, match=r"ds_config.malleus.straggler.schedule\[0\].rank=5 does "
                                          r"not exist: the job has world_size=2"):
        runners.validate(malleus([{"rank": 5, "rate": 2}]))
    runners.validate(malleus({"schedule": SLOW1, "method": "sleep"}))


def test_malleus_engine_resolves_to_its_module():
    c = cfg(engine="malleus")
    assert c.plan == "static"
    try:
        mod = runners.get_runner("malleus")
    except ConfigError as e:  # until issue 4 lands
        assert "malleus_ds.app.runners.malleus_runner does not exist yet" in str(e)
    else:
        assert mod.__name__ == "malleus_ds.app.runners.malleus_runner" and hasattr(mod, "run")
