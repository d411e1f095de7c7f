"""Optimizer ranges kept in place across a switch (migrate/alias.py), checked without processes
against an element-by-element map of every storage."""
import random

from malleus_ds.layout import build_buckets
from malleus_ds.migrate.alias import range_aliases
from malleus_ds.models.llama import model_config, param_table
from malleus_ds.plan import Plan
from tests.cases import random_plan

TABLE = param_table(model_config("tiny", max_seq_len=16))


def _ranges(plan, rank, zero):
    """[(size, segs)] of ``rank``'s optimizer ranges, as ShardedOptimizer lays them out."""
    out = []
    for b in build_buckets(plan, TABLE, rank):
        lo, hi = b.partition(rank) if zero >= 1 else (0, b.flat_size)
        out.append((hi - lo, [(pc.name, a, e, f - lo) for pc, a, e, f in b.segments(lo, hi)]))
    return out


def _elements(size, segs):
    """position -> (name, canonical index); padding positions are absent."""
    return {off + k: (n, lo + k) for n, lo, hi, off in segs for k in range(hi - lo)}


def _check(old, new, sizes):
    """``old``: j -> (storage, offset, segs); ``new``: i -> (size, segs). Returns the aliases
    after checking them element by element."""
    got = range_aliases(old, new, sizes)
    mem = {}        # (storage, position) -> element
    for st, off, segs in old.values():
        for q, e in _elements(1 << 40, segs).items():
            assert (st, off + q) not in mem
            mem[st, off + q] = e
    used = {}
    for i, (st, p) in got.items():
        size, segs = new[i]
        want = _elements(size, segs)
        assert 0 <= p and p + size <= sizes[st]
        for q in range(size):
            assert used.setdefault((st, p + q), i) == i, f"ranges {i} and {used[st, p + q]} overlap"
            # a real element sits where it did; padding falls on old padding or unused memory
            assert mem.get((st, p + q)) == want.get(q), (i, q, mem.get((st, p + q)), want.get(q))
    for st in {st for st, _ in got.values()}:       # a storage is kept only as a whole
        assert all((s, q) in used for (s, q) in mem if s == st), f"storage {st} partly kept"
    return got


def test_a_split_bucket_is_two_views_and_merging_back_is_one():
    x, y = [("x", 0, 8, 0)], [("y", 4, 10, 0)]
    both = [("x", 0, 8, 0), ("y", 4, 10, 8)]
    got = _check({0: ("S", 0, both)}, {0: (8, x), 1: (6, y)}, {"S": 14})
    assert got == {0: ("S", 0), 1: ("S", 8)}
    got = _check({0: ("S", 0, x), 1: ("S", 8, y)}, {0: (14, both)}, {"S": 14})
    assert got == {0: ("S", 0)}
    # order swapped in the new range: the elements are not where they were
    assert _check({0: ("S", 0, both)}, {0: (14, [("y", 4, 10, 0), ("x", 0, 8, 6)])},
                  {"S": 14}) == {}


def test_a_storage_kept_only_in_part_is_released():
    both = [("x", 0, 8, 0), ("y", 0, 8, 8)]
    # y moves to another range layout (a different offset inside its new range): x alone
    # would keep all 16 elements alive, so neither stays
    assert _check({0: ("S", 0, both)}, {0: (8, [("x", 0, 8, 0)]), 1: (9, [("y", 0, 8, 1)])},
                  {"S": 16}) == {}
    # a window that would swallow another range's old elements is refused
    assert _check({0: ("S", 0, both)}, {0: (12, [("x", 0, 8, 0)])}, {"S": 16}) == {}


def test_random_plan_pairs_keep_elements_in_place():
    rng = random.Random(3)
    for _ in range(8):
        world = rng.randint(3, 6)
        pa = Plan.from_json(random_plan(rng, world, G=12))
        pb = Plan.from_json(random_plan(rng, world, G=12))
        za = rng.randint(0, 2)
        zb = za if rng.random() < 0.8 else rng.randint(0, 2)
        for r in range(world):
            old_r = [(n, s) for n, s in _ranges(pa, r, za) if n > 0]
            # old ranges share storages at random (as after an earlier split), side by side
            old, sizes, k = {}, {}, 0
            while k < len(old_r):
                g = rng.randint(1, 3)
                off = 0
                for j in range(k, min(k + g, len(old_r))):
                    old[j] = (("st", k), off, old_r[j][1])
                    off += old_r[j][0]
                sizes["st", k] = off
                k += g
            new = dict(enumerate(_ranges(pb, r, zb)))
            _check(old, new, sizes)         # whatever it keeps is right (rarely anything)
            # the same plan again: every range stays where it is
            same = {i: v for i, v in enumerate(_ranges(pa, r, za)) if v[0] > 0}
            assert set(_check(old, same, sizes)) == set(same)
