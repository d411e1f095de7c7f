"""``malleus_ds.initialize`` picks the engine from the model: a plain torch.nn.Module goes to
``malleus_ds.dp.initialize`` with DeepSpeed's arguments, a ModelConfig / HFModel / StageModule /
stage builder to MalleusEngine; everything else, and arguments of one engine given with the
other's model, is a ValueError naming both, before any process group. The builders are replaced
by recorders here: no process group, no engine."""
from __future__ import annotations

import json
import types

import pytest
import torch

import malleus_ds
from malleus_ds.app import api
from malleus_ds.app.dp_loop import SpeedSplit
from tests.cases import CFG

DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
      "zero_optimization": {"stage": 2}}


@pytest.fixture
def built(monkeypatch):
    """Which builder ran, with what: ("dp", kwargs) or ("malleus", (model, cfg, plan, data,
    args))."""
    calls = []

    class _Engine:
        def attach_loop(self, policy):
            calls.append(("loop", policy))

    def dp(**kw):
        calls.append(("dp", kw))
        return _Engine(), "optimizer", "loader", "scheduler"

    def malleus(model, cfg, plan, data, args, why):
        calls.append(("malleus", (model, cfg, plan, data, args, why)))
        return "engine", "optimizer", None, "scheduler"

    import malleus_ds.dp.engine as dp_engine

    monkeypatch.setattr(dp_engine, "initialize", dp)
    monkeypatch.setattr(api, "_malleus_engine", malleus)
    return calls


def test_a_plain_module_goes_to_the_data_parallel_engine(built, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    m = torch.nn.Linear(2, 2)
    data, params, collate = [1, 2], list(m.parameters()), (lambda b: b)
    out = malleus_ds.initialize(model=m, config=DS, model_parameters=params,
                                training_data=data, collate_fn=collate)
    assert out[1:] == ("optimizer", "loader", "scheduler")
    [(kind, kw), (loop, policy)] = built
    assert loop == "loop" and isinstance(policy, SpeedSplit)
    assert kind == "dp" and kw["model"] is m and kw["model_parameters"] is params
    assert kw["training_data"] is data and kw["collate_fn"] is collate
    assert kw["config"] == DS and kw["config"] is not DS      # a checked copy
    assert kw["loss"] == "mean" and kw["args"] is None
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[malleus_ds] engine: MalleusDPEngine (a torch.nn.Module: data parallel "
                     "under DeepSpeed's ZeRO-2; each step's batch is split by measured speed)"]


def test_deepspeeds_other_keywords_and_loss_pass_through(built):
    m = torch.nn.Linear(2, 2)
    opt, sched = object(), object()
    malleus_ds.initialize(model=m, config_params=DS, optimizer=opt, lr_scheduler=sched,
                          dist_init_required=False, loss="sum")
    [(_, kw), _] = built
    assert kw["optimizer"] is opt and kw["lr_scheduler"] is sched
    assert kw["dist_init_required"] is False and kw["loss"] == "sum" and kw["config"] == DS


def test_a_config_in_args_is_left_to_deepspeeds_reading(built, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    args = types.SimpleNamespace(deepspeed_config=str(path))
    malleus_ds.initialize(model=torch.nn.Linear(2, 2), args=args)
    [(_, kw), _] = built
    assert kw["args"] is args and kw["config"] is None


def test_only_rank_0_says_which_engine(built, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    malleus_ds.initialize(model=torch.nn.Linear(2, 2), config=DS)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("model,what", [(CFG, "a ModelConfig"), ("stage", "a StageModule"),
                                        ("builder", "a stage builder")])
def test_a_model_config_or_stage_module_goes_to_malleus_engine(built, model, what):
    if model == "stage":
        from malleus_ds.models.base import StageModule

        model = StageModule(CFG, 0, 1, 0)
    elif model == "builder":
        def model(s, e):
            return None
        model.cfg = CFG
    plan = object()
    out = malleus_ds.initialize(model=model, config={"gradient_clipping": 1.0}, plan=plan,
                                data="d")
    assert out == ("engine", "optimizer", None, "scheduler")
    [(kind, (m, cfg, p, data, args, why))] = built
    assert kind == "malleus" and m is model and p is plan and data == "d"
    assert cfg == {"gradient_clipping": 1.0} and why == what


def test_malleus_engine_says_which_engine(capsys, monkeypatch):
    """The real path up to the engine: the review, the loop's settings, then the line."""
    import malleus_ds.engine as engine_pkg

    monkeypatch.setenv("RANK", "0")

    def stop(*a, **k):
        raise RuntimeError("no engine here")

    monkeypatch.setattr(engine_pkg, "initialize", stop)
    with pytest.raises(RuntimeError, match="no engine here"):
        malleus_ds.initialize(model=CFG, config={})
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[malleus_ds] engine: MalleusEngine (a ModelConfig: pipelines and TP by plan, "
        "re-planned and migrated)")


@pytest.mark.parametrize("kw,match", [
    ({"model": None}, r"model=None: malleus_ds.initialize takes a torch.nn.Module"),
    ({"model": "gpt2"}, r"model=a str: .*ModelConfig, HFModel, StageModule or stage builder"),
    ({"model": {"layers": 2}}, r"model=a dict"),
    ({"model": torch.nn.Linear(2, 2), "plan": "plan.json"},
     r"plan= given with a torch.nn.Module: .*drop plan=, or pass the model as a ModelConfig"),
    ({"model": torch.nn.Linear(2, 2), "data": object()},
     r"data= given with a torch.nn.Module: .*pass training_data="),
    ({"model": CFG, "training_data": [1]},
     r"training_data= given with a ModelConfig: it is for a torch.nn.Module"),
    ({"model": CFG, "optimizer": object(), "loss": "sum"},
     r"optimizer=, loss= given with a ModelConfig: they are for a torch.nn.Module"),
    ({"model": CFG, "config_params": {}}, r"config= and config_params="),
])
def test_what_does_not_fit_is_refused_naming_it(built, kw, match):
    kw.setdefault("config", DS)
    with pytest.raises(ValueError, match=match):
        malleus_ds.initialize(**kw)
    assert built == []


def test_a_pipeline_module_is_refused():
    from deepspeed.pipe import PipelineModule

    pm = PipelineModule.__new__(PipelineModule)     # building one needs a process group; the
    torch.nn.Module.__init__(pm)                    # type is what the dispatch reads
    with pytest.raises(ValueError, match="model is a DeepSpeed PipelineModule: .* use "
                                         "deepspeed.initialize"):
        malleus_ds.initialize(model=pm, config=DS)


@pytest.mark.parametrize("model", [torch.nn.Linear(2, 2), CFG])
def test_auto_is_refused_on_both_paths(built, model):
    with pytest.raises(ValueError, match=r'ds_config train_batch_size="auto": '
                                         r'malleus_ds.initialize takes the values themselves'):
        malleus_ds.initialize(model=model, config={**DS, "train_batch_size": "auto"})
    assert built == []


def test_auto_in_args_deepspeed_config_is_refused_too(built, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS, "gradient_clipping": "auto"}))
    with pytest.raises(ValueError, match=r'gradient_clipping="auto"'):
        malleus_ds.initialize(model=torch.nn.Linear(2, 2),
                              args=types.SimpleNamespace(deepspeed_config=str(path)))


def test_adaptive_false_attaches_no_loop_and_says_so(built, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    malleus_ds.initialize(model=torch.nn.Linear(2, 2),
                          config={**DS, "malleus": {"adaptive": False}})
    assert [k for k, _ in built] == ["dp"]
    assert capsys.readouterr().out.strip().endswith(
        "ZeRO-2; the split stays equal (ds_config.malleus.adaptive is false))")


@pytest.mark.parametrize("sec,match", [
    ({"plan": "p.json", "switch": []}, r"ds_config.malleus: plan, switch not read by the "
                                       r"data-parallel engine .* it reads straggler, adaptive, "
                                       r"detect"),
    ({"detect": {"window": 0}}, r"ds_config.malleus.detect.window=0 must be >= 1"),
    ({"adaptive": "yes"}, r"ds_config.malleus.adaptive='yes' must be true or false"),
    ({"straggler": [{"rank": 1, "rate": 0.5}]}, r"straggler.schedule\[0\].rate"),
    ({"straggler": {"method": "nap"}}, r"ds_config.malleus.straggler.method='nap'"),
])
def test_the_malleus_section_is_checked_before_any_process_group(built, sec, match):
    with pytest.raises(ValueError, match=match):
        malleus_ds.initialize(model=torch.nn.Linear(2, 2), config={**DS, "malleus": sec})
    assert built == []
