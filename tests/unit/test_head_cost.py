"""The output head in the cost model (``head_layers``): the last stage of every pipeline pays it
in the reference cost model, the simulator, the planner's exact layer split and the adaptive
loop's work units, so a healthy last stage neither looks slow nor gets a full share of layers."""
from __future__ import annotations

import itertools
import math

import pytest

from malleus_ds.job_layout import JobLayout
from malleus_ds.cost import evaluate, head_layers, stage_time
from malleus_ds.models.base import head_layer_units as model_head_layers, param_table
from malleus_ds.models.llama import model_config
from malleus_ds.plan import PlanError, static_plan
from malleus_ds.problem import Problem
from malleus_ds.planner.partition import PipelineModel
from malleus_ds.adaptive.replan import job_problem
from malleus_ds.simulate import build_timeline
from malleus_ds.adaptive.work import cost_units


def problem(head=None, rates=None, pp=2) -> Problem:
    d = {"version": 1, "name": "head", "cluster": {"nodes": 1, "gpus_per_node": 4},
         "model": {"num_layers": 8},
         "training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 1, "pp": pp,
                      "dp": 4 // pp},
         "cost": {"tp_slowdown": {"1": 1.0}}, "memory": None, "rates": rates or {}}
    if head is not None:
        d["head_layers"] = head
    return Problem.from_json(d)


def test_last_stage_pays_the_head_in_cost_and_simulation():
    plain, pr = problem(), problem(head=1.5, rates={"1": 2.0})
    assert head_layers(plain) == 0.0 and head_layers(pr) == 1.5
    plan = pr.static_plan()                     # pp=2 x dp=2: stage 1 of pipeline 0 is rank 1
    c = evaluate(pr, plan)
    for pipe, ts in zip(plan.pipelines, c.stage_times):
        first, last = pipe.stages
        assert ts[0] == pytest.approx(stage_time(pr, first))
        assert ts[1] == pytest.approx(stage_time(pr, last) + 1.5 * max(pr.rate(r) for r in last.ranks))
    assert c.step_time > evaluate(problem(rates={"1": 2.0}), plan).step_time
    sim = build_timeline(pr, plan).step_time         # heterogeneous stages: the formula bounds it
    assert build_timeline(problem(rates={"1": 2.0}), plan).step_time < sim <= c.step_time + 1e-9
    even = problem(head=1.5)
    assert build_timeline(even, even.static_plan()).step_time == pytest.approx(
        evaluate(even, even.static_plan()).step_time)
    assert Problem.from_json(pr.to_json()).extra["head_layers"] == 1.5
    with pytest.raises(PlanError, match=r"problem.head_layers=-1 must be a number >= 0"):
        head_layers(problem(head=-1))


def _brute(ys, L, m, head):
    best = math.inf
    S = len(ys)
    for order in itertools.permutations(range(S)):
        for cut in itertools.combinations(range(1, L), S - 1):
            ls = [b - a for a, b in zip((0, *cut), (*cut, L))]
            t = [ys[i] * l for i, l in zip(order, ls)]
            t[-1] += ys[order[-1]] * head
            best = min(best, sum(t) + (m - 1) * max(t))
    return best


@pytest.mark.parametrize("ys", [(1.0, 1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (3.0, 1.0)])
def test_layer_split_gives_the_last_stage_less_and_is_exact(ys):
    groups = tuple((y, 1) for y in ys)
    for head in (0.0, 0.5, 2.0):
        md = PipelineModel(groups, 12, 1, None, head=head)
        for m in (1, 4, 9):
            assert md.time(m) == pytest.approx(_brute(ys, 12, m, head), rel=1e-12)
    order, ls = PipelineModel(((1.0, 1), (1.0, 1), (1.0, 1), (1.0, 1)), 16, 1, None,
                              head=2.0).layout(8)
    assert ls[-1] < 4 and sum(ls) == 16     # the head's stage takes fewer layers


def test_work_units_and_job_problem_carry_the_head():
    plan = static_plan(8, 8, 1, 1, 2, 2)       # tp=1, pp=2, dp=2
    plain = cost_units(plan, 4, 1, {1: 1.0})
    units = cost_units(plan, 4, 1, {1: 1.0}, head=0.5)
    for pipe in plan.pipelines:
        first, last = pipe.stages
        for r in first.ranks:
            assert units[r] == plain[r]
        for r in last.ranks:
            assert units[r] == pytest.approx(plain[r] + 0.5 * pipe.micro_batches)
    pr = job_problem(plan, JobLayout(4, 4, 1), {1: 1.0}, None, head_layers=0.3)
    assert head_layers(pr) == 0.3 and head_layers(job_problem(plan, JobLayout(4, 4, 1), {1: 1.0}, None)) == 0


def test_model_head_layers_grows_with_the_vocabulary():
    small = model_config("tiny", max_seq_len=64)
    big = model_config("tiny", max_seq_len=64, vocab_size=32000)
    h_small = model_head_layers(param_table(small), 64, small.hidden_size)
    h_big = model_head_layers(param_table(big), 64, big.hidden_size)
    assert 0.2 < h_small < 0.4 and h_big == pytest.approx(h_small * 32000 / 256, rel=1e-3)
