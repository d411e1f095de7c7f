"""Rank sets and gradient buckets from a plan, without processes."""
import random

import pytest

from malleus_ds.engine.groups import plan_rank_sets, sync_rank_sets
from malleus_ds.layout import EMBED, HEAD, build_buckets, local_shards
from malleus_ds.models.llama import model_config, param_table
from malleus_ds.plan import Plan
from tests.cases import random_plan
from tests.cases import HETERO

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


# ---------------------------------------------------------------------- group lifetime (fakes)


class _FakeDist:
    """``new_group`` / ``destroy_process_group`` / ``all_reduce`` for ``world`` simulated ranks,
    one thread each (``all_reduce`` meets at a barrier, like the real collective): every rank's
    creations and destructions are logged, and the live groups of each rank tracked."""

    def __init__(self, world: int):
        import threading

        self.world = world
        self.local = threading.local()
        self.created = {r: [] for r in range(world)}      # rank -> [ranks] in creation order
        self.live = {r: {} for r in range(world)}         # rank -> {token: ranks}
        self.reduces = {r: 0 for r in range(world)}
        self._slots = [None] * world
        self._barrier = threading.Barrier(world, timeout=60)
        self._next = iter(range(10**9))

    def install(self, monkeypatch):
        import torch.distributed as dist

        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroy)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def new_group(self, ranks):
        r = self.local.rank
        tok = ("pg", r, next(self._next))
        self.created[r].append(tuple(ranks))
        self.live[r][tok] = tuple(ranks)
        return tok

    def destroy(self, tok):
        r = self.local.rank
        assert tok in self.live[r], f"rank {r} destroyed {tok} twice or never created it"
        del self.live[r][tok]

    def all_reduce(self, t, op=None):
        import torch.distributed as dist

        assert op == dist.ReduceOp.MIN
        r = self.local.rank
        self.reduces[r] += 1
        self._slots[r] = t.clone()
        self._barrier.wait()
        out = self._slots[0]
        for s in self._slots[1:]:
            assert s.shape == out.shape, "ranks disagree on the number of registered engines"
            out = out.minimum(s)
        self._barrier.wait()
        t.copy_(out)

    def run(self, fn):
        """``fn(rank)`` on every simulated rank at once; returns their results by rank."""
        import threading

        out, errs = {}, []

        def go(r):
            self.local.rank = r
            try:
                out[r] = fn(r)
            except BaseException as e:      # noqa: BLE001 - re-raised below
                errs.append(e)
                self._barrier.abort()

        ts = [threading.Thread(target=go, args=(r,)) for r in range(self.world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
        return out


class _Engine:
    """Stands for a MalleusEngine: only identity and weak references matter to the cache."""


def _plans(seed: int, world: int, n: int):
    rng = random.Random(seed)
    return [Plan.from_json(random_plan(rng, world, G=12)) for _ in range(n)]


def _recent(held, k=3):
    """The rank sets of the last ``k`` distinct layouts in ``held`` (plans, in the order they
    were held): the lifetime rule of malleus_ds/migrate/group_sets.py, written out by hand."""
    fams = []
    for plan in held:
        fam = frozenset(plan_rank_sets(plan, plan_world[0]))
        if fam in fams:
            fams.remove(fam)
        fams.append(fam)
    return set().union(*fams[-k:])


plan_world = [6]


def test_fifty_switches_keep_the_recent_layouts_groups(monkeypatch):
    from malleus_ds.engine.groups import GroupCache

    world = plan_world[0] = 6
    fake = _FakeDist(1)
    fake.install(monkeypatch)
    fake.local.rank = 0
    singles = {(r,) for r in range(world)}
    pool = _plans(11, world, 6)
    rng = random.Random(3)
    plans = [pool[0]] + [rng.choice(pool) for _ in range(50)]
    cache, eng = GroupCache(), _Engine()
    cache.ensure(plan_rank_sets(plans[0], world))
    cache.hold(eng, plan_rank_sets(plans[0], world))
    peak, backs = 0, 0
    for i, plan in enumerate(plans[1:], 1):
        before = cache.created
        sets = plan_rank_sets(plan, world)
        recent = _recent(plans[:i])
        cache.ensure(sets)
        made = fake.created[0][len(fake.created[0]) - (cache.created - before):]
        assert made == sorted(made, key=lambda s: (len(s), s))      # one global order
        assert set(made) == set(sets) - recent - singles         # a recent layout's: none
        backs += plan in plans[max(0, i - 2):i] and plan != plans[i - 1]
        peak = max(peak, cache.count())
        gone = cache.release_unused(sets, owner=eng)
        assert set(cache.sets()) == _recent(plans[:i + 1]) | singles     # the last 3 layouts'
        assert not set(gone) & (set(sets) | singles)
        assert sorted(fake.live[0].values()) == sorted(cache.sets())   # torch's view agrees
    assert backs > 5, "the sequence needs switches back to a recent layout"
    assert fake.reduces[0] == 0          # one engine: no agreement collective at all
    assert cache.destroyed > 0 and cache.created - cache.destroyed == cache.count()
    bound = max(len(_recent(plans[:i + 1], k=4) | singles) for i in range(len(plans)))
    assert peak <= bound                # mid-switch: 3 recent layouts + the new one, never more


def test_engines_dropped_at_different_times_keep_every_rank_in_step(monkeypatch):
    """Three engines in one process on every rank: C never switches (its groups must survive),
    A is dropped at a different switch on each rank (garbage collection is not collective),
    B switches 50 times among a few plans that include A's and C's. Every rank must create the
    same groups in the same order, and the count stays bounded."""
    from malleus_ds.engine.groups import GroupCache

    world = 4
    fake = _FakeDist(world)
    fake.install(monkeypatch)
    pool = _plans(5, world, 6)      # more layouts than the 3 recent ones kept
    a_plan, c_plan = pool[0], pool[1]
    seq = [pool[(i * 7 + i // 3) % len(pool)] for i in range(50)]
    singles = {(r,) for r in range(world)}

    def rank_fn(r):
        cache = GroupCache()
        engines = {}
        for name, plan in (("A", a_plan), ("C", c_plan), ("B", a_plan)):
            cache.ensure(plan_rank_sets(plan, world))
            engines[name] = _Engine()
            cache.hold(engines[name], plan_rank_sets(plan, world))
        drop_at = 5 + 9 * r                   # rank r drops A before switch 5, 14, 23, 32
        held = set(plan_rank_sets(c_plan, world))
        counts, owners = [], []
        for i, plan in enumerate(seq):
            if i == drop_at:
                del engines["A"]
            sets = plan_rank_sets(plan, world)
            cache.ensure(sets)
            cache.release_unused(sets, owner=engines["B"])
            assert held <= set(cache.sets()), f"rank {r}: C's groups destroyed at switch {i}"
            counts.append(cache.count())
            owners.append(cache.owners())
        return counts, owners

    res = fake.run(rank_fn)
    logs = [fake.created[r] for r in range(world)]
    assert all(log == logs[0] for log in logs), "ranks created different groups or orders"
    counts, owners = res[0]
    assert all(res[r] == res[0] for r in range(world))
    # A stays registered until the last rank dropped it (switch 32), then it is forgotten
    assert owners[:32] == [3] * 32 and owners[32:] == [2] * 18
    c_sets = set(plan_rank_sets(c_plan, world))
    a_sets = set(plan_rank_sets(a_plan, world))
    plan_world[0] = world
    held = [a_plan, c_plan, a_plan]
    for i, (n, plan) in enumerate(zip(counts, seq)):
        held.append(plan)
        live = c_sets | _recent(held) | singles | (a_sets if i < 32 else set())
        assert n == len(live), (i, n, len(live))
    # and A's sets that no one else uses were destroyed after the agreement
    gone = a_sets - c_sets - singles - _recent(held)
    assert gone, "the test needs A to hold a set nobody else uses"
    for r in range(world):
        assert not gone & set(fake.live[r].values())


def test_release_refuses_sets_that_were_never_created(monkeypatch):
    from malleus_ds.engine.groups import GroupCache

    fake = _FakeDist(1)
    fake.install(monkeypatch)
    fake.local.rank = 0
    cache, eng, other = GroupCache(), _Engine(), _Engine()
    cache.ensure([(0,), (1,), (0, 1)])
    cache.hold(eng, [(0, 1)])
    cache.hold(other, [(0, 1)])
    with pytest.raises(KeyError, match=r"no process group for ranks \[1, 2\] \(1 sets missing\)"):
        cache.release_unused([(0, 1), (1, 2)], owner=eng)
    assert fake.reduces[0] == 0          # refused before the agreement collective
    assert cache.sets() == [(0,), (1,), (0, 1)]


def test_a_new_world_starts_an_empty_cache(monkeypatch):
    import types

    import torch.distributed as dist
    from malleus_ds.engine.groups import GroupCache

    fake = _FakeDist(1)
    fake.install(monkeypatch)
    fake.local.rank = 0
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=object()))
    cache = GroupCache()
    cache.ensure([(0,), (0, 1)])
    first = cache.get((0, 1))
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=object()))   # re-initialised
    cache.ensure([(0, 1)])
    assert cache.sets() == [(0, 1)] and cache.get((0, 1)) is not first


def test_mpu_follows_the_running_plan():
    from malleus_ds.engine.mpu import PlanMPU
    from malleus_ds.engine.runtime import StageSpec

    mpu = PlanMPU(3, "self", "tp(2,3)", 1, 2, 0, 2)
    mpu.follow(StageSpec((1, 2), 0, 4, "tp(0..3)"), 3)
    assert (mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(),
            mpu.get_model_parallel_world_size()) == ("tp(0..3)", 0, 4)
    assert (mpu.get_pipeline_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_world_size()) == (2, 3)
    mpu.follow(StageSpec(None), 0)                     # suspended under the new plan
    assert mpu.get_model_parallel_group() == "self" and mpu.get_model_parallel_world_size() == 1
    assert mpu.get_data_parallel_group() == "self" and mpu.get_data_parallel_world_size() == 1
