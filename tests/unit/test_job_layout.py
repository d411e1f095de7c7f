"""The job layout (malleus_ds/job_layout.py): the one answer to node, TP and world questions,
and the callers that used to work them out themselves agree with it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from malleus_ds.job_layout import JobLayout, JobLayoutError, finest_tp, nominal_tp
from malleus_ds.plan import Pipeline, Plan, PlanError, Stage, static_plan, validate_plan

PKG = Path(__file__).resolve().parents[2] / "malleus_ds"


def test_node_answers_for_a_two_node_job():
    job = JobLayout(world=16, gpus_per_node=8, tp=4)
    assert job.nodes == 2
    assert [job.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert job.same_node(3, 7) and not job.same_node(7, 8)
    assert list(job.node_ranks(1)) == list(range(8, 16))
    assert job.nodes_of([9, 2, 10, 3]) == [0, 1]


@pytest.mark.parametrize("kw, words", [
    (dict(world=0, gpus_per_node=1), "world=0 must be an integer >= 1"),
    (dict(world=4, gpus_per_node=3), "gpus_per_node=3 does not divide the world size 4"),
    (dict(world=4, gpus_per_node=4, tp=0), "tp=0 must be an integer >= 1"),
    (dict(world=4, gpus_per_node=2.0), "gpus_per_node=2.0 must be an integer"),
    (dict(world=True, gpus_per_node=1), "world=True must be an integer"),
])
def test_a_shape_that_cannot_exist_is_refused_naming_the_field(kw, words):
    with pytest.raises(JobLayoutError, match=words.replace("(", r"\(")):
        JobLayout(**kw)


def test_nominal_and_finest_tp():
    a = Plan(4, 4, 1, (Pipeline(2, (Stage((0, 1), (0, 4)),)),
                       Pipeline(2, (Stage((2,), (0, 2)), Stage((3, 4, 5, 6), (2, 4))))), ())
    assert nominal_tp(a) == 4 and nominal_tp(a, at_least=3) == 12
    assert finest_tp([a.pipelines[0].stages[0], a.pipelines[1].stages[1]]) == 4
    assert finest_tp([a.pipelines[1].stages[0]]) == 1
    job = JobLayout.for_plans(8, a)
    assert (job.world, job.gpus_per_node, job.tp) == (8, 8, 4)
    assert JobLayout.for_plans(8, a, gpus_per_node=4, tp=8).tp == 8
    # a switch to a plan with a TP size the first did not have raises the nominal degree
    b = static_plan(4, 4, 1, 3, 1, 2)
    assert job.with_plans(b).tp == 12 and job.with_plans(a) is job


def test_a_tp_group_across_nodes_is_refused_by_the_layout_the_plan_is_checked_against():
    p = static_plan(4, 2, 1, 2, 1, 2)                      # TP groups (0, 1) and (2, 3)
    validate_plan(p, JobLayout(4, 2, 2))
    bad = Plan(4, 2, 1, (Pipeline(1, (Stage((1, 2), (0, 4)),)),
                         Pipeline(1, (Stage((0, 3), (0, 4)),))), ())
    with pytest.raises(PlanError, match=r"span nodes \[0, 1\] \(gpus_per_node=2\)"):
        validate_plan(bad, JobLayout(4, 2, 2))
    validate_plan(bad, JobLayout.one_node(4, 2))
    with pytest.raises(PlanError, match=r"pipelines\[1\].stages\[0\]: rank 2 is outside the world of 2 ranks"):
        validate_plan(p, JobLayout(2, 2, 2))


def test_the_planner_groups_and_the_cost_model_read_nodes_from_the_layout():
    from malleus_ds.cost import boundary_times
    from malleus_ds.planner.templates import SearchSpace
    from malleus_ds.problem import Problem

    pr = Problem.from_json({"version": 1, "name": "two", "cluster": {"nodes": 2, "gpus_per_node": 4},
                            "model": {"num_layers": 8},
                            "training": {"global_batch_size": 8, "micro_batch_size": 1,
                                         "tp": 2, "pp": 2, "dp": 2},
                            "comm": {"layer_ms": 1.0, "activation_mb": 8.0,
                                     "intra_node_gbps": 100.0, "inter_node_gbps": 10.0},
                            "rates": {"5": 3.0}})
    assert pr.job == JobLayout(8, 4, 2)
    space = SearchSpace(pr)
    assert space.special_nodes == [1]
    assert {r for o in space.options[0] for g in o.groups for r in g.ranks} <= set(range(4, 8))
    assert {r for g in space.base_pool for r in g.ranks} == set(range(4))
    st = static_plan(8, 8, 1, 2, 2, 2).pipelines[0].stages     # stages on ranks (0,1), (4,5)
    inside = static_plan(8, 8, 1, 2, 2, 1).pipelines[0].stages  # (0,1), (2,3)
    assert boundary_times(pr, st)[0] > boundary_times(pr, inside)[0] > 0


def test_no_file_above_the_layout_works_out_a_node_or_the_nominal_tp_itself():
    """`r // gpus_per_node` and `lcm(` of TP sizes appear only in job_layout.py."""
    found = []
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "job_layout.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                right = ast.unparse(node.right)
                if "gpus_per_node" in right or right.endswith("gpn"):
                    found.append(f"{f.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("lcm"):
                found.append(f"{f.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "work this out with malleus_ds/job_layout.py instead:\n" + "\n".join(found)


def test_the_pipelines_of_any_plan_run_every_micro_batch_of_the_step_once_in_order():
    from malleus_ds.samples import micro_batches, pipeline_micro_batches

    plan = Plan(4, 12, 2, (Pipeline(1, (Stage((0,), (0, 4)),)), Pipeline(3, (Stage((1,), (0, 4)),)),
                          Pipeline(2, (Stage((2,), (0, 2)), Stage((3,), (2, 4))))), ())
    for step in (0, 5):
        runs = [pipeline_micro_batches(step, plan, i) for i in range(3)]
        assert [len(r) for r in runs] == [1, 3, 2]
        assert [mb for r in runs for mb in r] == micro_batches(step, 12, 2)
    assert pipeline_micro_batches(1, plan, 0) == [[12, 13]]
