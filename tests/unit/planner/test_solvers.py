"""Exactness of the planner's inner solvers against brute force on small cases."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from malleus_ds.problem import Memory
from malleus_ds.planner.batch import FixedPipeline, split_batches
from malleus_ds.planner.grouping import node_options
from malleus_ds.planner.partition import PipelineModel, layer_cap, split_layers


def compositions(total: int, parts: int):
    """All ways to write ``total`` as ``parts`` positive integers (ordered)."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0,) + cuts + (total,)
        yield [b[i + 1] - b[i] for i in range(parts)]


def brute_split(y, caps, L, m):
    best = math.inf
    for ls in compositions(L, len(y)):
        if any(l > c for l, c in zip(ls, caps)):
            continue
        t = [a * b for a, b in zip(y, ls)]
        best = min(best, sum(t) + (m - 1) * max(t))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_layers_matches_brute_force(seed):
    rnd = random.Random(seed)
    S = rnd.randint(1, 4)
    L = rnd.randint(S, 11)
    y = [rnd.choice([1.0, 1.3, 1.9, 2.5, 3.66, 7.22, 4.0 * 1.9]) for _ in range(S)]
    caps = [rnd.randint(1, L) for _ in range(S)]
    m = rnd.randint(1, 9)
    want = brute_split(y, caps, L, m)
    got = split_layers(y, caps, L, m)
    if want == math.inf:
        assert got is None
        return
    v, ls = got
    assert v == pytest.approx(want, rel=1e-12)
    assert sum(ls) == L and all(1 <= l <= c for l, c in zip(ls, caps))
    t = [a * b for a, b in zip(y, ls)]
    assert sum(t) + (m - 1) * max(t) == pytest.approx(v, rel=1e-12)


def _mem():
    return Memory(device_mb=20000, reserved_mb=1000, layer_static_mb=900, layer_activation_mb=300,
                  embedding_mb=800, extra_mb=1500)


@pytest.mark.parametrize("seed", range(25))
def test_pipeline_model_time_is_min_over_orders_and_splits(seed):
    """T(m) equals brute force over every stage order and layer split, with memory caps."""
    rnd = random.Random(100 + seed)
    tp = 4
    S = rnd.randint(1, 3)
    L = rnd.randint(S, 10)
    groups = tuple(sorted((rnd.choice([1.0, 1.5, 1.9, 3.66]), rnd.choice([1, 2, 4])) for _ in range(S)))
    mem = _mem()
    md = PipelineModel(groups, L, tp, mem)
    for m in range(1, 6):
        best = math.inf
        for perm in set(itertools.permutations(groups)):
            caps = [layer_cap(mem, tp, g, j, S, m, L) for j, (_, g) in enumerate(perm)]
            best = min(best, brute_split([a for a, _ in perm], caps, L, m))
        got = md.time(m)
        # the model tries a few memory-friendly orders, not all S!: it is exact for S <= 2 and
        # never better than the true optimum
        assert got >= best - 1e-9
        if S <= 2:
            assert got == pytest.approx(best, rel=1e-12) or (got == best == math.inf)
        if got < math.inf:
            order, ls = md.layout(m)
            assert sorted(order) == list(range(S)) and sum(ls) == L
            for j, (i, l) in enumerate(zip(order, ls)):
                assert l <= layer_cap(mem, tp, groups[i][1], j, S, m, L)


@pytest.mark.parametrize("seed", range(30))
def test_split_batches_matches_brute_force(seed):
    rnd = random.Random(200 + seed)
    n = rnd.randint(1, 3)
    models = [FixedPipeline(tuple(rnd.choice([1.0, 2.0, 3.5, 7.0]) * rnd.randint(1, 5)
                                  for _ in range(rnd.randint(1, 3)))) for _ in range(n)]
    mult = [rnd.randint(1, 2) for _ in range(n)]
    copies = [md for md, k in zip(models, mult) for _ in range(k)]
    M = rnd.randint(len(copies), 12)
    want = min(max(md.time(m) for md, m in zip(copies, ms))
               for ms in compositions(M, len(copies)))
    T, ms = split_batches(models, mult, M)
    assert T == pytest.approx(want, rel=1e-12)
    flat = [m for lst in ms for m in lst]
    assert sum(flat) == M and min(flat) >= 1
    assert max(md.time(m) for md, m in zip(copies, flat)) == pytest.approx(T, rel=1e-12)


def test_split_batches_with_pipeline_models_matches_brute_force():
    rnd = random.Random(7)
    for _ in range(15):
        models = [PipelineModel(tuple(sorted((rnd.choice([1.0, 1.9, 4.0]), 4)
                                             for _ in range(rnd.randint(1, 3)))), 8, 4, None)
                  for _ in range(2)]
        M = rnd.randint(2, 10)
        want = min(max(models[0].time(a), models[1].time(M - a)) for a in range(1, M))
        T, _ = split_batches(models, [1, 1], M)
        assert T == pytest.approx(want, rel=1e-12)


def test_split_batches_infeasible():
    assert split_batches([FixedPipeline((1.0,))], [3], 2) is None


def test_node_options_nominal_first_and_suspension():
    sd = {1: 1.0, 2: 1.9, 4: 3.66, 8: 7.22}
    opts = node_options(range(8, 16), 8, {9: 4.0}, sd)
    assert [len(g.ranks) for g in opts[0].groups] == [8] and opts[0].suspended == ()
    assert opts[0].groups[0].y == 4.0
    assert any(9 in o.suspended for o in opts)
    for o in opts:
        ranks = sorted(r for g in o.groups for r in g.ranks) + list(o.suspended)
        assert sorted(ranks) == list(range(8, 16))
        assert all(8 % len(g.ranks) == 0 for g in o.groups)
    # throughput strictly increases with the number of groups along the kept options
    tps = [o.throughput for o in sorted(opts[1:], key=lambda o: len(o.groups))]
    assert tps == sorted(tps)


@pytest.mark.parametrize("seed", range(15))
def test_frontier_with_stage_constants_matches_brute_force(seed):
    from malleus_ds.planner.partition import frontier

    rnd = random.Random(300 + seed)
    S = rnd.randint(1, 4)
    L = rnd.randint(S, 10)
    y = [rnd.choice([1.0, 1.9, 3.66]) for _ in range(S)]
    c = [rnd.choice([0.0, 0.3, 1.7]) for _ in range(S)]
    caps = [L] * S
    m = rnd.randint(1, 6)
    want = math.inf
    for ls in compositions(L, S):
        t = [a * b + k for a, b, k in zip(y, ls, c)]
        want = min(want, sum(t) + (m - 1) * max(t))
    sig, cm, _ = frontier(y, caps, L, c)
    assert float((sig + (m - 1) * cm).min()) == pytest.approx(want, rel=1e-12)


def test_layer_cap_is_the_largest_count_the_cost_model_accepts():
    """The planner's cap inverts cost.stage_memory_mb (one formula): cap layers fit the budget,
    cap + 1 do not, over random memory models, group sizes and stage positions."""
    from dataclasses import replace

    from malleus_ds.cost import stage_memory_mb
    from malleus_ds.problem import Problem

    rnd = random.Random(7)
    base = Problem(name="cap", nodes=1, gpus_per_node=8, num_layers=40, global_batch_size=16,
                   micro_batch_size=1, tp=4, pp=2, dp=1, tp_slowdown={1: 1.0}, memory=None,
                   rates={})
    for _ in range(400):
        mem = Memory(device_mb=rnd.uniform(2000, 40000), reserved_mb=rnd.uniform(0, 1000),
                     layer_static_mb=rnd.choice([0.0, rnd.uniform(10, 2000)]),
                     layer_activation_mb=rnd.uniform(0, 900), embedding_mb=rnd.uniform(0, 3000),
                     extra_mb=rnd.uniform(0, 2000))
        pr = replace(base, memory=mem)
        S, g, L = rnd.randint(1, 6), rnd.choice([1, 2, 4]), 40
        j, m = rnd.randrange(S), rnd.randint(1, 9)
        cap = layer_cap(mem, pr.tp, g, j, S, m, L)
        assert 0 <= cap <= L
        fits = [stage_memory_mb(pr, n, j, S, m, g) <= mem.budget_mb + 1e-9 for n in (cap, cap + 1)]
        if cap > 0:
            assert fits[0], (mem, S, g, j, m, cap)
        if cap < L and (cap > 0 or fits[0]):
            assert not fits[1], (mem, S, g, j, m, cap)
