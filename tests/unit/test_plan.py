"""Problem/Plan JSON round-trips and validation messages (DESIGN.md §3)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from malleus_ds.job_layout import JobLayout
from malleus_ds.plan import Pipeline, Plan, PlanError, Stage, static_plan, validate_plan
from malleus_ds.problem import Problem

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.json"))
assert EXAMPLES, "examples/*.json (the repo's example problems) are missing"


def small_problem(**over) -> dict:
    d = {"version": 1, "name": "t", "cluster": {"nodes": 2, "gpus_per_node": 4},
         "model": {"num_layers": 8},
         "training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 2, "pp": 2, "dp": 2},
         "cost": {"tp_slowdown": {"1": 1.0, "2": 1.9}},
         "memory": None, "rates": {"3": 2.5}, "current_plan": None}
    d.update(over)
    return d


def test_problem_round_trip_keeps_unknown_fields():
    d = small_problem(comm={"layer_ms": 1.0}, note="keep me")
    pr = Problem.from_json(d)
    again = Problem.from_json(json.loads(pr.dumps()))
    assert again == pr
    assert again.extra["note"] == "keep me" and again.extra["comm"] == {"layer_ms": 1.0}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_round_trip(path):
    pr = Problem.load(path)
    assert Problem.loads(pr.dumps()) == pr


def test_plan_round_trip_with_current_plan_and_extra():
    pl = static_plan(8, 8, 1, 2, 2, 2)
    d = pl.to_json()
    d["made_by"] = "test"
    pl2 = Plan.from_json(d)
    assert pl2 == pl and pl2.extra["made_by"] == "test"
    assert Plan.loads(pl2.dumps()).to_json() == d
    pr = Problem.from_json(small_problem(current_plan=d))
    assert Problem.loads(pr.dumps()).current_plan == pl


def test_static_plan_rank_formula():
    pl = static_plan(8, 8, 1, 2, 2, 2)
    # rank = tp_rank + tp*(dp_rank + dp*pp_rank)
    assert pl.pipelines[1].stages[1].ranks == (6, 7)
    assert pl.pipelines[0].stages[1].ranks == (4, 5)
    validate_plan(pl, JobLayout(8, 4, 2))


@pytest.mark.parametrize("bad, needle", [
    ({"version": 2}, "version=2"),
    ({"training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 3, "pp": 2, "dp": 2}}, "tp=3"),
    ({"training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 2, "pp": 2, "dp": 3}}, "12"),
    ({"rates": {"99": 2.0}}, "rank 99"),
    ({"rates": {"1": 0.5}}, "rates['1']=0.5"),
    ({"cost": {"tp_slowdown": {"1": 1.0}}}, "tp/g=2"),
    ({"model": {"num_layers": 0}}, "num_layers=0"),
])
def test_problem_errors_name_the_field(bad, needle):
    with pytest.raises(PlanError, match=None) as ei:
        Problem.from_json(small_problem(**bad))
    assert needle in str(ei.value)


def _plan(pipes, suspended=()):
    return Plan(8, 8, 1, tuple(Pipeline(m, tuple(Stage(tuple(r), tuple(l)) for r, l in st))
                              for m, st in pipes), tuple(suspended))


@pytest.mark.parametrize("pipes, susp, needle", [
    ([(8, [([0, 1], (0, 4)), ([0, 2], (4, 8))])], (), "rank 0 already appears"),
    ([(8, [([0, 1], (0, 3)), ([2, 3], (4, 8))])], (), "pipelines[0].stages[1].layers=[4, 8]"),
    ([(8, [([0, 1], (0, 4)), ([2, 3], (4, 7))])], (), "cover [0, 7)"),
    ([(8, [([3, 4], (0, 8))])], (), "span nodes"),
    ([(8, [([0, 1, 2], (0, 8))])], (), "size 3 does not divide tp=2"),
    ([(7, [([0, 1], (0, 8))])], (), "!= global_batch_size=8"),
    ([(8, [([0, 1], (0, 8))]), (0, [([2, 3], (0, 8))])], (), "pipelines[1].micro_batches=0"),
    ([(8, [([0, 1], (0, 8))])], (9,), "rank 9 is outside"),
])
def test_plan_errors_name_pipeline_stage_and_numbers(pipes, susp, needle):
    with pytest.raises(PlanError) as ei:
        validate_plan(_plan(pipes, susp), JobLayout(8, 4, 2))
    assert needle in str(ei.value)


def test_plan_from_json_rejects_garbage():
    for bad, needle in [([], "expected a JSON object"), ({"version": 1}, "missing field"),
                        ({**static_plan(8, 8, 1, 2, 2, 2).to_json(), "version": 0}, "version=0")]:
        with pytest.raises(PlanError) as ei:
            Plan.from_json(bad)
        assert needle in str(ei.value)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.loads("{nope")


def test_problem_with_rates_is_a_new_frozen_value():
    pr = Problem.from_json(small_problem())
    pr2 = pr.with_rates({})
    assert pr.rate(3) == 2.5 and pr2.rate(3) == 1.0
    with pytest.raises(Exception):
        pr.nodes = 3  # frozen
    assert replace(pr2, name="x").name == "x"


def test_malformed_inputs_raise_plan_error_only():
    """Fuzz: any field replaced by junk gives PlanError (never a TypeError/KeyError)."""
    import copy
    import random

    from malleus_ds.cost import validate_for_problem

    base = small_problem(current_plan=static_plan(8, 8, 1, 2, 2, 2).to_json())
    junk = [None, 1, -3, 2.5, "x", [], {}, [1, 2], {"a": 1}, True, "7", [[0, 1]], float("nan"),
            float("inf")]

    def paths(d, pre=()):
        items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
        for k, v in items:
            yield pre + (k,)
            yield from paths(v, pre + (k,))

    ps = list(paths(base))
    rnd = random.Random(0)
    for _ in range(1500):
        d = copy.deepcopy(base)
        p = rnd.choice(ps)
        cur = d
        for k in p[:-1]:
            cur = cur[k]
        cur[p[-1]] = rnd.choice(junk)
        try:
            pr = Problem.from_json(d)
            if pr.current_plan is not None:
                validate_for_problem(pr, pr.current_plan)
        except PlanError:
            pass


def test_with_rates_normalises_keys_and_validates():
    pr = Problem.from_json(small_problem())
    assert pr.with_rates({"5": 2}).rates == {5: 2.0}
    assert pr.with_rates({"5": 2}).rate(5) == 2.0
    with pytest.raises(PlanError, match="rank 8 is outside"):
        pr.with_rates({8: 2.0})
    assert pr.with_rates({1: 0.9}).rate(1) == 1.0          # measurement noise: healthy
    with pytest.raises(PlanError, match="finite number > 0"):
        pr.with_rates({1: float("nan")})


def test_random_plans_round_trip_and_validate():
    """Hypothesis: any structurally valid plan survives JSON and validates again."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @st.composite
    def plans(draw):
        L = draw(st.integers(1, 12))
        n_pipes = draw(st.integers(1, 3))
        ranks = iter(range(64))
        pipes = []
        for _ in range(n_pipes):
            S = draw(st.integers(1, min(L, 3)))
            cuts = sorted(draw(st.sets(st.integers(1, L - 1), min_size=S - 1, max_size=S - 1))
                          ) if S > 1 else []
            b = [0] + cuts + [L]
            stages = []
            for j in range(len(b) - 1):
                g = draw(st.sampled_from([1, 2]))
                first = next(ranks)
                if g == 2 and first % 2 == 0:
                    rs = (first, next(ranks))
                else:
                    rs = (first,)
                stages.append(Stage(rs, (b[j], b[j + 1])))
            pipes.append(Pipeline(draw(st.integers(1, 4)), tuple(stages)))
        gbs = sum(p.micro_batches for p in pipes)
        return Plan(L, gbs, 1, tuple(pipes), ())

    def _job(pl):       # the smallest world of whole 4-rank nodes that holds pl's ranks
        return JobLayout(4 * (max(pl.all_ranks) // 4 + 1), 4, 2)

    @settings(max_examples=60, deadline=None)
    @given(plans())
    def check(pl):
        validate_plan(pl, _job(pl))
        again = Plan.loads(pl.dumps())
        assert again == pl
        validate_plan(again, _job(again))

    check()


def test_a_problem_without_tp_slowdown_gets_the_engines_ideal_table():
    """The default table was powers of two here and every divisor in the adaptive loop: a tp=6 problem
    without ``cost.tp_slowdown`` was refused ("missing entry for tp/g=3") while the engine ran
    tp=6 with {1, 2, 3, 6}. Now both use problem.ideal_slowdown."""
    from malleus_ds.problem import ideal_slowdown

    d = small_problem(cluster={"nodes": 1, "gpus_per_node": 6}, cost={},
                      training={"global_batch_size": 8, "micro_batch_size": 1, "tp": 6, "pp": 1,
                                "dp": 1}, rates={})
    pr = Problem.from_json(d)
    assert dict(pr.tp_slowdown) == ideal_slowdown(6) == {1: 1.0, 2: 2.0, 3: 3.0, 6: 6.0}
    d4 = small_problem(cost={})
    assert dict(Problem.from_json(d4).tp_slowdown) == ideal_slowdown(2)


def test_nominal_tp_is_the_lcm_of_every_stage_and_the_floor():
    from malleus_ds.job_layout import nominal_tp

    a = static_plan(8, 8, 1, 2, 2, 2)                 # TP 2 everywhere
    b = static_plan(8, 8, 1, 4, 1, 2)                 # TP 4
    assert nominal_tp(a) == 2 and nominal_tp(a, b) == 4 and nominal_tp(a, at_least=3) == 6
    assert nominal_tp(static_plan(8, 8, 1, 1, 1, 8)) == 1
