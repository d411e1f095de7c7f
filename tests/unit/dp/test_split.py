"""dp/split.py: exact cover of a step's global batch, shares proportional to speed (largest
remainder), the minimum share, stock's assignment on an equal split, and errors that name the
numbers."""
from __future__ import annotations

import json
import random

import pytest

from malleus_ds.dp.split import Split, split_for


def _stock(order, world, micro_batches):
    """Stock DeepSpeed's assignment of one step: rank r's sampler takes order[r::world] and its
    loader cuts that into micro-batches of mbs."""
    mbs = len(order) // world // micro_batches
    out = []
    for r in range(world):
        mine = list(order[r::world])
        out.append(tuple(tuple(mine[k * mbs:(k + 1) * mbs]) for k in range(micro_batches)))
    return tuple(out)


@pytest.mark.parametrize("rates,gb,gas", [([1, 1], 8, 2), ([1, 3], 16, 1), ([0.2, 1, 5, 1], 48, 3),
                                          ([1, 1, 1], 9, 3), ([7, 1], 40, 4)])
def test_every_sample_of_the_step_lands_once(rates, gb, gas):
    s = split_for(rates, gb, gas)
    order = random.Random(0).sample(range(1000), gb)
    got = s.assign(order)
    flat = [i for rank in got for mb in rank for i in mb]
    assert sorted(flat) == sorted(order)
    for r, rank in enumerate(got):
        assert len(rank) == gas                                     # same count on every rank
        assert all(len(mb) == s.shares[r] for mb in rank)
    # each micro-batch slot keeps stock's set of samples: block k of the order
    m = gb // gas
    for k in range(gas):
        assert sorted(i for rank in got for i in rank[k]) == sorted(order[k * m:(k + 1) * m])
    assert s.rank_ids(order, 1) == got[1]


def test_equal_split_is_stocks_assignment():
    for world, mbs, gas in [(2, 1, 4), (2, 3, 2), (4, 2, 3), (3, 5, 1)]:
        gb = world * mbs * gas
        s = Split.equal(world, gb, gas)
        assert s.shares == (mbs,) * world
        assert all(s.weight(r) == 1.0 for r in range(world))
        order = random.Random(world).sample(range(500), gb)
        assert s.assign(order) == _stock(order, world, gas)


def test_shares_are_proportional_by_largest_remainder():
    # speeds 1 : 2 : 3 of 12 per micro-batch: exactly 2, 4, 6
    assert split_for([6.0, 3.0, 2.0], 24, 2).shares == (2, 4, 6)
    # speeds 1 : 1 : 1 of 10: quotas 3.33 each; one extra sample to the lowest rank
    assert split_for([1, 1, 1], 10, 1).shares == (4, 3, 3)
    # quotas 10 * (0.5, 0.3, 0.2) / ... : speeds 5, 3, 2 of 7 -> 3.5, 2.1, 1.4 -> 3, 2, 1 + 1 to 3.5
    assert split_for([1 / 5, 1 / 3, 1 / 2], 7, 1).shares == (4, 2, 1)
    # only ratios matter
    assert split_for([2, 4], 30, 1) == split_for([0.5, 1.0], 30, 1) == Split((20, 10), 1)
    s = split_for([1, 2, 4, 8], 64, 4)
    assert sum(s.shares) == 16 and s.global_batch == 64
    quota = [16 * (1 / x) / sum(1 / y for y in [1, 2, 4, 8]) for x in [1, 2, 4, 8]]
    assert all(abs(a - q) < 1 for a, q in zip(s.shares, quota))


def test_a_slow_rank_gets_the_minimum_share_and_keeps_its_micro_batches():
    s = split_for([1.0, 1000.0], 16, 2)
    assert s.shares == (7, 1) and s.micro_batches == 2
    s = split_for([1.0, 1000.0, 1.0, 1.0], 32, 2, min_share=2)
    assert s.shares[1] == 2 and sum(s.shares) == 16
    # the others share the rest in proportion: 14 over three equal ranks -> 5, 5, 4 (ties low)
    assert s.shares == (5, 2, 5, 4)
    # two slow ranks, both pinned; pinning one raises the other's quota below min: both pinned
    s = split_for([1.0, 50.0, 60.0], 20, 1, min_share=3)
    assert s.shares == (14, 3, 3)


def test_weights_make_deepspeeds_average_the_global_mean():
    s = Split((3, 1), 2)
    # DeepSpeed: mean over 2 ranks of each rank's sum of w * L / gas; want sum n_r L / B
    assert s.weight(0) == 3 * 2 / 4 and s.weight(1) == 1 * 2 / 4
    assert s.weight(0, "sum") == s.weight(1, "sum") == 2 / 4
    assert s.weight(1, "global") == 1.0
    with pytest.raises(ValueError, match="loss='tokens'"):
        s.weight(0, "tokens")
    with pytest.raises(ValueError, match="rank 2"):
        s.weight(2)


def test_json_carries_the_shares():
    s = split_for([1, 4], 20, 2)
    assert json.loads(json.dumps(s.json())) == {"shares": [8, 2], "micro_batches": 2,
                                                "global_batch": 20}
    assert s.samples(0) == 16 and s.samples(1) == 4
    with pytest.raises(AttributeError):
        s.shares = (5, 5)                                           # frozen


@pytest.mark.parametrize("call,match", [
    (lambda: split_for([1, 1, 1], 4, 2), r"global_batch=4 is not a multiple of micro_batches=2"
                                         r"|global_batch=4 is too small"),
    (lambda: split_for([1, 1, 1], 4, 1, min_share=2), r"global_batch=4 is too small.*3 ranks "
                                                      r"min_share=2.*needs global_batch >= 6"),
    (lambda: split_for([1, 1], 6, 4), r"global_batch=6 is not a multiple of micro_batches=4"),
    (lambda: split_for([1, 0], 8, 1), r"rank 1's rate 0 .* > 0; rates=\[1, 0\]"),
    (lambda: split_for([-2.0, 1], 8, 1), r"rank 0's rate -2.0"),
    (lambda: split_for([1, float("nan")], 8, 1), r"rank 1's rate nan"),
    (lambda: split_for([1, None], 8, 1), r"rank 1's rate None"),
    (lambda: split_for([], 8, 1), r"rates=\[\]"),
    (lambda: split_for([1, 1], 8, 0), r"micro_batches=0"),
    (lambda: split_for([1, 1], 8, 1, world=3), r"2 rates for 3 ranks"),
    (lambda: split_for([1, 1], 8, 1, min_share=0), r"min_share=0"),
    (lambda: Split((3, 0), 1), r"rank 1: 0 in shares=\[3, 0\]"),
    (lambda: Split((2, 2), 2).assign(range(6)), r"order has 6 samples; the split covers 8 "
                                                r"\(2 micro-batches x 4\)"),
])
def test_bad_input_names_the_numbers(call, match):
    with pytest.raises(ValueError, match=match):
        call()
