"""The layout genome: every decoded + evaluated layout becomes a valid plan whose reference-model
step time equals the search's own value (so the search optimises what it returns)."""
from __future__ import annotations

import numpy as np
import pytest

from malleus_ds.cost import step_time, validate_for_problem
from malleus_ds.planner.placement import build_plan, moved_units
from malleus_ds.planner.templates import SearchSpace

from .test_search import example, random_problem


@pytest.mark.parametrize("seed", range(12))
def test_every_genome_decodes_to_a_valid_plan_with_the_same_step_time(seed):
    pr = random_problem(1000 + seed)
    if all(pr.rate(r) == 1.0 for r in pr.rates):
        pr = pr.with_rates({pr.num_gpus - 1: 3.0})       # the search needs a straggler
    space = SearchSpace(pr)
    rng = np.random.default_rng(seed)
    genomes = space.seeds() + [rng.integers(space.xl, space.xu + 1) for _ in range(20)]
    n_ok = 0
    for x in genomes:
        T, lay, ev = space.evaluate(x)
        if ev is None:
            continue
        p = build_plan(space, lay, ev)
        validate_for_problem(pr, p)
        assert step_time(pr, p) == pytest.approx(T, rel=1e-9)
        n_ok += 1
    assert n_ok > 0


def test_placement_with_current_plan_keeps_state():
    pr = example("problem_64gpu_one_slow")
    space = SearchSpace(pr)
    x = space.seeds()[0]
    T, lay, ev = space.evaluate(x)
    fresh = build_plan(space, lay, ev)
    again = build_plan(space, lay, ev, old=fresh)       # same layout, placed against itself
    assert moved_units(fresh, again) == pytest.approx(0.0)
    assert step_time(pr, again) == pytest.approx(T)


def test_fixed_number_of_pipelines():
    from malleus_ds.planner import PlannerConfig, plan

    pr = example("problem_64gpu_one_slow")
    res = plan(pr, seed=0, config=PlannerConfig(num_pipelines=2, pop_size=12, max_generations=5,
                                                patience=3))
    validate_for_problem(pr, res.plan)
    if res.method == "search":
        assert len(res.plan.pipelines) <= 2


def test_the_running_plan_warm_starts_the_search_as_a_genome():
    """A plan the space built (a layout placed into ranks) encodes back into a genome of that
    space whose layout is the plan's: the same step time; the running plan seeds a re-plan."""
    pr = example("problem_64gpu_one_slow")
    space = SearchSpace(pr)
    for x in space.seeds()[:6]:
        T, lay, ev = space.evaluate(x)
        if ev is None:
            continue
        p = build_plan(space, lay, ev)
        back = space.from_plan(p)
        assert len(back) == 2 and all(int(g[0]) == len(p.pipelines) for g in back)
        assert min(space.evaluate(g)[0] for g in back) == pytest.approx(T, rel=1e-9)
    # a plan with more pipelines than the space allows does not encode
    small = SearchSpace(pr, num_pipelines=1)
    assert small.from_plan(build_plan(space, lay, ev)) == [] or len(ev.ms) == 1
