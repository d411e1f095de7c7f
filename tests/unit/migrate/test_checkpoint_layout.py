"""Which saved file each element comes from when a checkpoint loads under another plan (pure).

For random pairs of plans on different world sizes, ZeRO stages and precisions, every element
this rank holds now is read exactly once (or derived: a low-precision parameter where the rank
holds its master), from a saved rank whose file holds it, inside one stored slice."""
from __future__ import annotations

import random

import pytest

from malleus_ds.files.ckpt_format import CheckpointError
from malleus_ds.migrate.file_reads import one_copy, plan_reads, wants
from malleus_ds.migrate.transfer import HolderIndex
from malleus_ds.migrate.transfer import chunked
from malleus_ds.layout import holdings, merge, plan_holdings, subtract
from malleus_ds.models.llama import model_config, param_table
from malleus_ds.plan import Plan
from tests.cases import random_plan

TABLE = param_table(model_config("tiny", max_seq_len=16))


def _disjoint_union(ivs) -> list[tuple[int, int]]:
    """The union of ``ivs``, asserting no element is in two of them."""
    ivs = sorted(ivs)
    assert all(a[1] <= b[0] for a, b in zip(ivs, ivs[1:])), f"overlapping reads {ivs}"
    return merge(ivs)


def _check_pair(saved_plan, saved_world, saved_zero, saved_prec, plan, world, zero, prec,
                optimizer_states=True, one=True):
    saved_mixed, mixed = saved_prec != "fp32", prec != "fp32"
    saved = plan_holdings(saved_plan, TABLE, saved_zero, saved_mixed)
    if one:                           # every element stored once (the default since session 13)
        saved = one_copy(saved)
    stored = {}                       # (kind, name, rank) -> its stored slices (one per holding)
    for (kind, name), es in saved.items():
        for lo, hi, r in es:
            stored.setdefault((kind, name, r), []).append((lo, hi))
    fp32 = "master" if saved_mixed else "param"
    files_per_rank = []
    for rank in range(world):
        holds = holdings(plan, TABLE, rank, zero, mixed)
        ws = wants(holds, mixed=mixed, saved_mixed=saved_mixed,
                   same_param_dtype=saved_prec == prec, optimizer_states=optimizer_states)
        home = rank if rank < saved_world else 0
        reads = plan_reads(ws, saved, rank, saved_world, home)
        got: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for r in reads:
            assert 0 <= r.file_rank < saved_world
            assert any(a <= r.lo and r.hi <= b for a, b in stored[(r.src_kind, r.name, r.file_rank)]), r
            if r.kind == "param":
                assert r.src_kind == ("param" if saved_prec == prec or not saved_mixed else fp32)
            elif r.kind == "master":
                assert r.src_kind == fp32
            else:
                assert r.src_kind == r.kind
            got.setdefault((r.kind, r.name), []).append((r.lo, r.hi))
        held: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for h in holds:
            held.setdefault((h.kind, h.name), []).append((h.lo, h.hi))
        for (kind, name), ivs in held.items():
            want = merge(ivs)
            if kind in ("exp_avg", "exp_avg_sq") and not optimizer_states:
                want = []
            if mixed and kind == "param":         # derived from this rank's masters instead
                want = subtract(want, merge(held.get(("master", name), [])))
            assert _disjoint_union(got.pop((kind, name), [])) == want, f"rank {rank}: {kind} {name}"
        assert not got, f"rank {rank} reads what it does not hold: {sorted(got)[:3]}"
        files_per_rank.append(len({r.file_rank for r in reads} | {home}))
    return files_per_rank


@pytest.mark.parametrize("seed", range(12))
def test_every_held_element_read_exactly_once(seed):
    rng = random.Random(seed)
    w0, w1 = rng.randint(2, 6), rng.randint(2, 6)   # random_plan may suspend one rank
    p0 = Plan.from_json(random_plan(rng, w0, G=12))
    p1 = Plan.from_json(random_plan(rng, w1, G=12))
    for prec0, prec1 in (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp32"),
                         ("bf16", "fp16")):
        _check_pair(p0, w0, rng.choice([0, 1, 2]), prec0, p1, w1, rng.choice([0, 1, 2]), prec1,
                    optimizer_states=rng.random() < 0.8, one=rng.random() < 0.7)


@pytest.mark.parametrize("seed", range(8))
def test_one_copy_stores_every_held_element_once_and_shares_the_writing(seed):
    rng = random.Random(100 + seed)
    w = rng.randint(2, 6)
    plan = Plan.from_json(random_plan(rng, w, G=12))
    for zero, mixed in ((0, False), (1, True), (2, False)):
        held = plan_holdings(plan, TABLE, zero, mixed)
        stored = one_copy(held)
        assert set(stored) == set(held)
        for key, entries in held.items():
            runs = sorted(stored[key])
            assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:])), f"{key}: stored twice"
            assert merge((lo, hi) for lo, hi, _ in runs) == merge((lo, hi) for lo, hi, _ in entries)
            own = {}
            for lo, hi, r in entries:
                own.setdefault(r, []).append((lo, hi))
            for lo, hi, r in runs:    # a rank stores only what it held
                assert any(a <= lo and hi <= b for a, b in own[r]), (key, lo, hi, r)
            # each piece held by k ranks: every holder stores floor or ceil of 1/k of it
            idx = HolderIndex(entries)
            for i, holders in enumerate(idx.holders):
                a, b = idx.cuts[i], idx.cuts[i + 1]
                for r in holders:
                    got = sum(max(0, min(hi, b) - max(lo, a)) for lo, hi, q in runs if q == r)
                    assert (b - a) // len(holders) <= got <= -(-(b - a) // len(holders)), \
                        (key, a, b, holders, r, got)


def test_same_plan_reads_only_its_own_file():
    rng = random.Random(7)
    pj = random_plan(rng, 4, G=12)
    p = Plan.from_json(pj)
    counts = _check_pair(p, 4, 1, "bf16", p, 4, 1, "bf16", one=False)
    assert counts == [1, 1, 1, 1]
    # one copy: the replicas' files too, but never more than the ranks of the plan
    assert all(1 <= c <= 4 for c in _check_pair(p, 4, 1, "bf16", p, 4, 1, "bf16"))


def test_missing_kind_is_a_clear_error():
    p = Plan.from_json(random_plan(random.Random(1), 2, G=12))
    holds = holdings(p, TABLE, 0, 0, False)
    ws = wants(holds, mixed=False, saved_mixed=False, same_param_dtype=True)
    with pytest.raises(CheckpointError, match="the checkpoint holds no .* of blocks"):
        plan_reads(ws, {}, 0, 2)


def test_chunked_splits_at_the_cap():
    from malleus_ds.engine.checkpoint import Read

    reads = [Read(0, "param", "param", "a", 0, 10), Read(1, "master", "master", "b", 5, 8)]
    groups = list(chunked(reads, 4))
    assert [sum(r.hi - r.lo for r in g) for g in groups] == [4, 4, 4, 1]
    assert merge((r.lo, r.hi) for g in groups for r in g if r.name == "a") == [(0, 10)]
