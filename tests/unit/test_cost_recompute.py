"""Activation checkpointing in the planning problem and the cost model (pure, no processes): a
recomputed layer keeps only its input per micro-batch in flight and costs 4/3 of a plain one
(``cost.RECOMPUTE_FACTOR``); the flag and ``memory.layer_input_mb`` round-trip through the
problem JSON; the planner finds layouts that only fit with it; the running job's problem (start-up
memory check, adaptive loop) carries it."""
from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from malleus_ds.cost import (RECOMPUTE_FACTOR, check_memory, efficiency, evaluate,
                             stage_memory_mb, step_time, validate_for_problem)
from malleus_ds.job_layout import JobLayout
from malleus_ds.models.base import param_table
from malleus_ds.models.llama import PRESETS
from malleus_ds.plan import PlanError, static_plan
from malleus_ds.planner import plan as plan_layout
from malleus_ds.planner.config import PlannerConfig
from malleus_ds.planner.partition import PipelineModel, layer_cap
from malleus_ds.problem import Problem
from malleus_ds.adaptive.replan import job_problem, memory_model
from malleus_ds.simulate import build_timeline
from malleus_ds.adaptive.work import cost_units

QUICK = PlannerConfig(pop_size=8, max_generations=3, patience=2, polish_evals=50)


def problem(ac: bool, device_mb: float = 300.0, head=None, rates=None, L=8, pp=1, dp=4,
            memory=True) -> Problem:
    """4 GPUs, 8 layers; per layer 50 MB of state, 100 MB of activations per micro-batch of
    which its input is 5 MB; 20 MB per embedding."""
    d = {"version": 1, "name": "ac", "cluster": {"nodes": 1, "gpus_per_node": 4},
         "model": {"num_layers": L},
         "training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 1, "pp": pp,
                      "dp": dp, "activation_checkpointing": ac},
         "cost": {"tp_slowdown": {"1": 1.0}}, "rates": rates or {},
         "memory": {"device_mb": device_mb, "reserved_mb": 0, "layer_static_mb": 50,
                    "layer_activation_mb": 100, "layer_input_mb": 5, "embedding_mb": 20,
                    "extra_mb": 0} if memory else None}
    if head is not None:
        d["head_layers"] = head
    return Problem.from_json(d)


def test_the_flag_and_the_input_size_round_trip_through_json():
    pr = problem(True)
    assert pr.activation_checkpointing and pr.memory.layer_input_mb == 5
    js = pr.to_json()
    assert js["training"]["activation_checkpointing"] is True
    assert js["memory"]["layer_input_mb"] == 5
    assert Problem.from_json(js) == pr
    off = problem(False)
    assert not off.activation_checkpointing
    assert "activation_checkpointing" not in off.to_json()["training"]   # old files stay as they were
    assert Problem.from_json(off.to_json()) == off


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["memory"].pop("layer_input_mb"), r"memory.layer_input_mb is missing: with "
                                                  r"training.activation_checkpointing=true"),
    (lambda d: d["memory"].update(layer_input_mb=101),
     r"memory.layer_input_mb=101 is part of memory.layer_activation_mb=100"),
    (lambda d: d["training"].update(activation_checkpointing="yes"),
     r"training.activation_checkpointing='yes' must be true or false"),
])
def test_bad_problems_name_the_field(edit, match):
    d = problem(True).to_json()
    edit(d)
    with pytest.raises(PlanError, match=match):
        Problem.from_json(d)


def test_stage_memory_keeps_inputs_and_one_recomputed_layer():
    on, off = problem(True), problem(False)
    # 3 layers, stage 0 of 4 with 8 micro-batches: 4 in flight, embedding held
    assert stage_memory_mb(off, 3, 0, 4, 8, 1) == 3 * (50 + 100 * 4) + 20
    assert stage_memory_mb(on, 3, 0, 4, 8, 1) == 3 * (50 + 5 * 4) + 20 + 100
    # a TP group of 2 out of tp=4 holds twice the state and activations, the inputs whole
    tp4 = Problem.from_json({**on.to_json(), "training": {**on.to_json()["training"], "tp": 4,
                                                          "pp": 1, "dp": 1},
                             "cost": {"tp_slowdown": {"1": 1.0, "2": 2.0, "4": 4.0}}})
    assert stage_memory_mb(tp4, 3, 1, 3, 8, 2) == 3 * (50 * 2 + 5 * 2) + 100 * 2


def test_layer_cap_inverts_the_recompute_formula():
    rnd = random.Random(0)
    for _ in range(300):
        pr = problem(True, device_mb=rnd.uniform(150, 3000))
        m = pr.memory
        S, j, mb, L = rnd.randint(1, 4), 0, rnd.randint(1, 8), 8
        j = rnd.randrange(S)
        cap = layer_cap(m, pr.tp, 1, j, S, mb, L, recompute=True)
        fits = [stage_memory_mb(pr, n, j, S, mb, 1) <= m.budget_mb + 1e-9 for n in (cap, cap + 1)]
        assert (cap == 0 or fits[0]) and (cap == L or not fits[1]), (cap, fits)


def test_step_time_grows_by_the_recompute_factor():
    for rates in ({}, {"1": 3.0}):
        on, off = problem(True, rates=rates, memory=False), problem(False, rates=rates,
                                                                  memory=False)
        for plan in (off.static_plan(), problem(False, pp=2, dp=2).static_plan()):
            assert step_time(on, plan) == pytest.approx(step_time(off, plan) * RECOMPUTE_FACTOR)
            assert efficiency(on, plan) == pytest.approx(efficiency(off, plan))
    # the head is not recomputed: the last stage pays y * (4/3 l + h)
    on, off = problem(True, head=0.6, pp=2, dp=2), problem(False, head=0.6, pp=2, dp=2)
    plan = on.static_plan()
    last = evaluate(on, plan).stage_times[0][-1]
    assert last == pytest.approx(4 * RECOMPUTE_FACTOR + 0.6)
    assert evaluate(off, plan).stage_times[0][-1] == pytest.approx(4 + 0.6)


def test_simulator_runs_a_longer_backward_and_matches_the_formula():
    on, off = problem(True, pp=4, dp=1, memory=False), problem(False, pp=4, dp=1, memory=False)
    plan = on.static_plan()
    t_on, t_off = build_timeline(on, plan), build_timeline(off, plan)
    assert t_on.step_time == pytest.approx(evaluate(on, plan).step_time)   # uniform: exact
    f_on = {(o.stage, o.micro_batch): o.end - o.start for o in t_on.ops if o.kind == "F"}
    f_off = {(o.stage, o.micro_batch): o.end - o.start for o in t_off.ops if o.kind == "F"}
    assert f_on == pytest.approx(f_off)                       # the forward is not recomputed
    b_on = [o.end - o.start for o in t_on.ops if o.kind == "B"]
    b_off = [o.end - o.start for o in t_off.ops if o.kind == "B"]
    assert b_on == pytest.approx([2 * (4 / 3 - 1 / 3)] * 32)   # 2 layers a stage, 8 mbs x 4
    assert b_off == pytest.approx([2 * 2 / 3] * 32)


def _brute(ys, L, m, head, c):
    best = math.inf
    for order in itertools.permutations(range(len(ys))):
        for cut in itertools.combinations(range(1, L), len(ys) - 1):
            ls = [b - a for a, b in zip((0, *cut), (*cut, L))]
            t = [ys[i] * l * c for i, l in zip(order, ls)]
            t[-1] += ys[order[-1]] * head
            best = min(best, sum(t) + (m - 1) * max(t))
    return best


@pytest.mark.parametrize("ys", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (3.0, 1.0)])
def test_the_planners_layer_split_is_exact_with_recompute(ys):
    groups = tuple((y, 1) for y in ys)
    for head in (0.0, 0.7):
        md = PipelineModel(groups, 10, 1, None, head=head, recompute=True)
        for m in (1, 5):
            assert md.time(m) == pytest.approx(_brute(ys, 10, m, head, RECOMPUTE_FACTOR))


def test_a_problem_without_a_valid_plan_gets_one_with_recompute():
    off, on = problem(False), problem(True)
    # without: every layout needs >= (8 x 150 + 2 x 20) / 4 = 310 MB > 300 MB per GPU
    with pytest.raises(PlanError, match=r"no layout can fit: 8 layers x \(layer_static_mb 50 \+ "
                                        r"layer_activation_mb 100\) .* = 310 MB per GPU"):
        plan_layout(off, config=QUICK)
    res = plan_layout(on, config=QUICK)
    validate_for_problem(on, res.plan)                  # fits with recompute ...
    with pytest.raises(PlanError, match="needs .* MB > budget 300 MB"):
        check_memory(off, res.plan)                     # ... and only with it
    assert res.step_time == pytest.approx(step_time(off, res.plan) * RECOMPUTE_FACTOR)
    # and with recompute, the static plan's full replicas (8 x 55 + 2 x 20 + 100 = 580 MB) do not
    with pytest.raises(PlanError, match="needs 580 MB > budget 300 MB"):
        check_memory(on, on.static_plan())
    # a recompute floor that does not fit either is worded with its terms
    with pytest.raises(PlanError, match=r"no layout can fit: the first stage: embedding_mb 20 \+ "
                                        r"one layer \(layer_static_mb 50 \+ layer_input_mb 5 \+ "
                                        r"its recomputed layer_activation_mb 100\) \+ extra_mb 0 "
                                        r"= 175 MB per GPU"):
        plan_layout(problem(True, device_mb=170), config=QUICK)


def test_the_running_jobs_memory_model_and_problem_carry_it():
    cfg = PRESETS["7b"]
    table = param_table(cfg)
    mem = memory_model(table, cfg, 1, 4096, True, 81920.0)
    # Megatron: 2*s*b*h bytes at 16 bits kept per layer, out of s*b*h*(34 + 5*a*s/h)
    assert mem.layer_input_mb == pytest.approx(2 * 4096 * 4096 / 2 ** 20)
    assert mem.layer_activation_mb == pytest.approx(4096 * 4096 * (34 + 5 * 32 * 4096 / 4096)
                                                    / 2 ** 20)
    assert memory_model(table, cfg, 1, 4096, False, 81920.0).layer_input_mb == \
        pytest.approx(2 * mem.layer_input_mb)             # fp32 activations
    plan = static_plan(32, 16, 1, 1, 4, 2)
    off = job_problem(plan, JobLayout(8, 8, 1), {1: 1.0}, mem)
    on = job_problem(plan, JobLayout(8, 8, 1), {1: 1.0}, mem, activation_checkpointing=True)
    assert not off.activation_checkpointing and on.activation_checkpointing
    # 8 layers of a 7B stage with 4 micro-batches in flight: ~46 GB of activations, ~0.5 GB kept
    need = [stage_memory_mb(p, 8, 0, 4, 8, 1) for p in (off, on)]
    assert need[0] - need[1] > 40_000
    assert Problem.from_json(on.to_json()) == on


def test_the_start_up_memory_check_counts_recompute():
    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.runners.fit import start_problem
    from malleus_ds.app.runners.job import load_plan
    from malleus_ds.app.runners.malleus_runner import build_ds_config

    def job(ac):
        d = {"engine": "malleus", "model": {"name": "tiny", "max_seq_len": 64},
             "train": {"steps": 2, "global_batch_size": 8, "micro_batch_size": 1,
                       "activation_checkpointing": ac},
             "parallel": {"tp": 1, "pp": 2, "dp": None},
             "malleus": {"migrate_bucket_mb": 0.01, "device_mb": 1e6}}
        c = build_run_config(d, world_size=2)
        p = load_plan(c)
        return start_problem(c, p, build_ds_config(c, p), "cpu")[0], p

    (off, p), (on, _) = job(None), job(True)
    assert on.activation_checkpointing and not off.activation_checkpointing
    peak = [max(stage_memory_mb(pr, s.num_layers, j, 2, q.micro_batches, 1)
                for q in p.pipelines for j, s in enumerate(q.stages)) for pr in (off, on)]
    assert peak[1] < peak[0]


def test_the_adaptive_loop_counts_recomputed_layers_in_its_units():
    from malleus_ds.adaptive.control import Controller
    from malleus_ds.engine.precision import Precision
    from malleus_ds.adaptive.settings import AdaptiveSettings
    from malleus_ds.app.loop import job_spec

    cfg = PRESETS["tiny"]
    plan = static_plan(4, 8, 1, 1, 2, 2)
    got = {}
    for ac in (False, True):
        eng = SimpleNamespace(global_rank=1, world_size=4, plan=plan, located=plan.locate(1),
                              settings=SimpleNamespace(migrate_bucket_mb=64.0, recompute=ac),
                              job=JobLayout.one_node(4), param_table=param_table(cfg),
                              model_cfg=cfg, seq_len=cfg.max_seq_len, precision=Precision(),
                              zero_stage=1, device="cpu", migrations=[])
        ctl = Controller(job_spec(eng), AdaptiveSettings(enabled=False, tp_slowdown="ideal"),
                         plan)
        got[ac] = ctl
        assert ctl.session.job_problem().activation_checkpointing is ac
    head = got[True].head
    assert head > 0
    assert list(got[True].units) == pytest.approx(
        list(cost_units(plan, 4, 1, {1: 1.0}, head, RECOMPUTE_FACTOR)))
    # the last stages' share of the work shrinks: the head is not recomputed
    last = [r for pipe in plan.pipelines for r in pipe.stages[-1].ranks]
    first = [r for pipe in plan.pipelines for r in pipe.stages[0].ranks]
    ratio = {ac: got[ac].units[last[0]] / got[ac].units[first[0]] for ac in got}
    assert ratio[True] < ratio[False]
