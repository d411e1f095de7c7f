"""Rank sets and gradient buckets from a plan, without processes."""
import random

from malleus_ds.engine.groups import plan_rank_sets, sync_rank_sets
from malleus_ds.layout import EMBED, HEAD, build_buckets, local_shards
from malleus_ds.models.llama import model_config, param_table
from malleus_ds.plan import Plan
from tests.dist.test_malleus_cases import random_plan
from tests.dist.test_malleus_equivalence import HETERO

CFG = model_config("tiny", max_seq_len=16)


TABLE = param_table(CFG)


def test_hetero_rank_sets():
    plan = Plan.from_json(HETERO)
    assert sync_rank_sets(plan) == {(0, 3), (1, 3), (2, 3), (1, 2, 3)}
    sets = plan_rank_sets(plan, 4)
    assert sets[:4] == [(0,), (1,), (2,), (3,)] and (1, 2) in sets     # TP group
    assert sets == sorted(sets, key=lambda s: (len(s), s))             # one global order


def _elements(plan: Plan, world: int):
    """(name, global position) of every element -> {rank: bucket ranks}; and bucket layouts."""
    holders: dict = {}
    layouts: dict = {}
    for r in range(world):
        shards = local_shards(plan, TABLE, r)
        for b in build_buckets(plan, TABLE, r):
            keys = []
            for pc in b.pieces:
                sh = shards[pc.name]
                off = pc.start + (sh.tp_rank * sh.shape[pc.dim] if pc.dim is not None else 0)
                keys.append((pc.name, pc.dim, off, pc.length if pc.dim is not None else pc.numel))
                # the canonical interval agrees with the local view's position
                assert pc.glo == sh.interval[0] + pc.start * (pc.numel // pc.length
                                                              if pc.dim is not None else 0)
                holders.setdefault(keys[-1], {})[r] = b.ranks
            layouts.setdefault(b.ranks, {})[r] = (keys, b.numel)
    return holders, layouts


def test_buckets_consistent_for_random_plans():
    rng = random.Random(7)
    for _ in range(40):
        world = rng.randint(2, 7)
        plan = Plan.from_json(random_plan(rng, world, G=12))
        holders, layouts = _elements(plan, world)
        for rs, per_rank in layouts.items():
            assert set(per_rank) == set(rs), (rs, sorted(per_rank))     # every member has it
            first = next(iter(per_rank.values()))
            assert all(v == first for v in per_rank.values()), rs     # identical layout
        for key, per_rank in holders.items():
            sets = set(per_rank.values())
            assert len(sets) == 1 and set(per_rank) == set(next(iter(sets))), key
        # every pipeline holds every layer exactly once: sharded chunks have one rank per pipeline
        for (name, dim, _o, _n), per_rank in holders.items():
            if dim is not None:
                assert len(per_rank) == len(plan.pipelines), name
        # replicated embedding/head: held by every TP rank of first/last stages
        emb = [k for k in holders if k[0].startswith("embed.")]
        assert emb and all(set(holders[k]) == {r for p in plan.pipelines for r in p.stages[0].ranks}
                           for k in emb)


def test_partition_covers_bucket_once():
    plan = Plan.from_json(HETERO)
    for r in range(4):
        for b in build_buckets(plan, TABLE, r):
            parts = sorted(b.partition(m) for m in b.ranks)
            assert parts[0][0] == 0 and parts[-1][1] == b.flat_size
            assert all(a[1] == c[0] for a, c in zip(parts, parts[1:]))
    assert EMBED == -1 and HEAD == -2


def _random_buckets(seed: int, plans: int, max_world: int):
    """(rank, bucket) of every rank of ``plans`` random valid plans."""
    rng = random.Random(seed)
    for _ in range(plans):
        world = rng.randint(2, max_world)
        plan = Plan.from_json(random_plan(rng, world, G=12))
        for r in range(world):
            for b in build_buckets(plan, TABLE, r):
                yield r, b


def test_flat_layout_covers_every_piece_once_and_partitions_are_per_piece():
    from malleus_ds.layout import Bucket, Piece, piece_parts

    for _r, b in _random_buckets(3, 30, 7):
        seen, slots = {}, []
        for pc, a, e, f in b.entries():
            seen.setdefault(pc.name + str(pc.glo), []).append((a, e))
            slots.append((f, f + e - a))
        for pc in b.pieces:
            got = sorted(seen[pc.name + str(pc.glo)])
            assert got[0][0] == 0 and got[-1][1] == pc.numel
            assert all(x[1] == y[0] for x, y in zip(got, got[1:]))
        slots.sort()
        assert all(x[1] <= y[0] for x, y in zip(slots, slots[1:]))
        assert slots[-1][1] <= b.flat_size
    # a piece's ZeRO part depends only on its size and the rank set, not on its bucket-mates
    p1, p2 = Piece("a", 0, 0, 4, True, 10, 0), Piece("b", 0, 0, 4, True, 7, 0)
    alone, shared = Bucket((0, 3), [p1], 10), Bucket((0, 3), [p2, p1], 17)
    part = {(pc.name, a, e) for pc, a, e, _ in alone.segments(*alone.partition(3))}
    part2 = {(pc.name, a, e) for pc, a, e, _ in shared.segments(*shared.partition(3))
             if pc.name == "a"}
    assert part == part2 == {("a", 5, 10)} and piece_parts(10, 2) == [(0, 5), (5, 10)]


def test_padding_is_the_complement_of_the_entries():
    for r, b in _random_buckets(5, 20, 6):
        used = [(f, f + e - a) for _pc, a, e, f in b.entries()]
        cover = sorted(used + b.padding())
        assert cover[0][0] == 0 and cover[-1][1] == b.flat_size
        assert all(x[1] == y[0] for x, y in zip(cover, cover[1:]))
        lo, hi = b.partition(r)
        assert all(lo <= x < y <= hi for x, y in b.padding(lo, hi))
