"""The process groups' lifetime rule (malleus_ds/migrate/group_sets.py), without processes: the
pure rule, its mirror for the replay, and the engine's GroupCache following the same rule."""
import random

import pytest

from malleus_ds.plan import Plan
from malleus_ds.migrate.group_sets import (RECENT_PLANS, GroupMirror, RecentSets, doomed, missing,
                                    plan_rank_sets)
from tests.cases import random_plan


def _pj(pipes, L=8, G=16):
    """A plan of 4 ranks: ``pipes`` = [(micro-batches, [(ranks, (lo, hi)), ...]), ...]."""
    return Plan.from_json({"version": 1, "num_layers": L, "global_batch_size": G,
                           "micro_batch_size": 1, "suspended": [],
                           "pipelines": [{"micro_batches": m, "stages": [
                               {"ranks": list(r), "layers": list(lh)} for r, lh in st]}
                               for m, st in pipes]})


def layouts():
    """A: pipelines 0|1 and 2|3; B, C, D: pipelines 0|2 and 1|3, three stage cuts. A's
    gradient sets (0, 2) and (1, 3) are in none of B, C, D; A2 re-splits A's micro-batches."""
    A = _pj([(8, [((0,), (0, 4)), ((1,), (4, 8))]), (8, [((2,), (0, 4)), ((3,), (4, 8))])])
    A2 = _pj([(11, [((0,), (0, 4)), ((1,), (4, 8))]), (5, [((2,), (0, 4)), ((3,), (4, 8))])])
    def cut(k):
        return _pj([(8, [((0,), (0, 4)), ((2,), (4, 8))]), (8, [((1,), (0, k)), ((3,), (k, 8))])])
    return A, A2, cut(4), cut(2), cut(6)


def test_recent_sets_keep_the_last_distinct_layouts():
    r = RecentSets(2)
    r.held([(0, 1)])
    r.held([(1, 0)])                     # the same layout again: still one
    assert len(r) == 1 and r.sets() == {(0, 1)}
    r.held([(2, 3)])
    r.held([(0, 1)])                     # back to the first: it becomes the most recent
    r.held([(4, 5)])
    assert r.sets() == {(0, 1), (4, 5)}
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        RecentSets(0)


def test_missing_and_doomed_keep_the_global_order_and_the_singletons():
    assert missing([(0,), (0, 1)], [(2, 3), (1, 0), (1,), (0, 1, 2)]) == [(1,), (2, 3), (0, 1, 2)]
    assert doomed([(0,), (1, 2), (0, 1, 2), (0, 3)], used=[(0, 3)]) == [(1, 2), (0, 1, 2)]


def test_mirror_a_resplit_and_a_switch_back_create_no_group():
    A, A2, B, C, D = layouts()
    g = GroupMirror(A, 4)
    assert set(plan_rank_sets(A, 4)) == g.live and RECENT_PLANS == 3
    assert g.switch(A2) == []                        # only micro-batches moved
    made = g.switch(B)
    assert set(made) == set(plan_rank_sets(B, 4)) - set(plan_rank_sets(A, 4)) and made
    assert g.switch(A) == [] and g.switch(B) == []   # back and forth: nothing new
    assert g.switch(C) and g.switch(A) == []         # A is one of the last 3 layouts (C, B, A)
    g.switch(B), g.switch(C), g.switch(D)            # A falls out: (B, C, D)
    assert (0, 2) not in g.live
    again = g.switch(A)
    assert {(0, 2), (1, 3)} <= set(again)            # a layout not seen for 3: made afresh
    assert g.created - g.destroyed == len(g.live)


def test_the_engines_cache_follows_the_mirrors_rule(monkeypatch):
    """GroupCache (with a fake torch.distributed) and GroupMirror, the same 60 switches among
    6 random layouts: the same groups created, destroyed and alive after each switch."""
    from malleus_ds.engine.groups import GroupCache
    from tests.unit.test_layout import _Engine, _FakeDist

    world = 6
    fake = _FakeDist(1)
    fake.install(monkeypatch)
    fake.local.rank = 0
    rng = random.Random(7)
    pool = [Plan.from_json(random_plan(rng, world, G=12)) for _ in range(6)]
    seq = [rng.choice(pool) for _ in range(60)]
    cache, eng = GroupCache(), _Engine()
    cache.ensure(plan_rank_sets(seq[0], world))
    cache.hold(eng, plan_rank_sets(seq[0], world))
    mirror = GroupMirror(seq[0], world)
    zero = 0
    for plan in seq[1:]:
        before = cache.created
        sets = plan_rank_sets(plan, world)
        assert mirror.would_create(plan) == missing(cache.sets(), sets)
        cache.ensure(sets)
        cache.release_unused(sets, owner=eng)
        made = mirror.switch(plan)
        assert cache.created - before == len(made)
        zero += not made
        assert set(cache.sets()) == mirror.live
    assert (cache.created, cache.destroyed) == (mirror.created, mirror.destroyed)
    assert cache.destroyed > 0 and zero > 10     # both kinds of switch happened
