"""app/dp_loop.py: rank 0's re-split decision from every rank's seconds per sample, through the
adaptive loop's rate estimator and detector (hysteresis) and dp.split.split_for. Pure: the
readings are given."""
from __future__ import annotations

import random

from malleus_ds.app.dp_loop import SpeedSplit, attach_dp_loop
from malleus_ds.dp.settings import DPSettings
from malleus_ds.dp.split import Split
from malleus_ds.interop.malleus_section import DetectConfig

EVEN = Split((2, 2), 2)


def _run(readings, detect=DetectConfig(window=3, confirm=2, cooldown=2), split=EVEN):
    """Feed one reading per step, applying each decision at once; returns (step, split, rates)
    of every decision."""
    pol, out = SpeedSplit(detect), []
    for step, sps in enumerate(readings):
        d = pol.decide(step, sps, split)
        if d is not None:
            split = d[0]
            out.append((step, split.shares, tuple(d[1])))
    return out


def test_a_rank_three_times_slower_gets_the_smallest_share_after_confirmation():
    got = _run([[1.0, 1.0]] * 3 + [[1.0, 3.0]] * 6)
    # step 0 is left out; steps 3 and 4 make the window's median slow: two detections in a row
    assert got == [(5, (3, 1), (1.0, 3.0))]


def test_noise_within_the_thresholds_never_re_splits():
    rnd = random.Random(0)
    readings = [[rnd.uniform(0.85, 1.15), rnd.uniform(0.85, 1.15)] for _ in range(200)]
    assert _run(readings) == []


def test_one_spike_is_not_a_shift():
    assert _run([[1.0, 1.0]] * 4 + [[1.0, 5.0]] + [[1.0, 1.0]] * 6) == []


def test_the_first_step_and_the_first_under_a_new_split_are_left_out():
    pol = SpeedSplit(DetectConfig(window=1, confirm=1, cooldown=0))
    assert pol.decide(0, [1.0, 9.0], EVEN) is None          # the run's first step: left out
    new, rates = pol.decide(1, [1.0, 3.0], EVEN)
    assert new.shares == (3, 1) and list(rates) == [1.0, 3.0]
    assert pol.decide(2, [1.0, 3.0], new) is None           # the last step under EVEN
    assert pol.decide(3, [9.0, 1.0], new) is None           # the new split's first: left out
    assert pol.decide(4, [1.0, 1.0], new)[0] == EVEN        # rank 1 recovered


def test_a_split_that_rounds_to_the_current_one_is_no_decision():
    # rank 1 1.5x slower: 4 samples per micro-batch split 2.4 / 1.6 -> (2, 2), the current one
    pol = SpeedSplit(DetectConfig(window=1, confirm=1, cooldown=0))
    assert [pol.decide(k, [1.0, 1.5], EVEN) for k in range(4)] == [None] * 4


def test_attach_follows_adaptive():
    class _Engine:
        def attach_loop(self, policy):
            self.policy = policy
            return "loop"

    eng = _Engine()
    assert attach_dp_loop(eng, DPSettings(adaptive=False)) is None and not hasattr(eng, "policy")
    assert attach_dp_loop(eng, DPSettings(detect=DetectConfig(window=4))) == "loop"
    assert eng.policy.detect.window == 4


def test_a_policy_restored_from_its_state_decides_as_the_uninterrupted_one():
    """A checkpoint's state (plain JSON values) taken after any step, loaded into a new policy:
    every later decision and its rates are the uninterrupted policy's."""
    import json

    import pytest

    rnd = random.Random(1)
    readings = [[rnd.uniform(0.9, 1.1), rnd.uniform(0.9, 1.1) * (3.0 if 4 <= k < 14 else 1.0)]
                for k in range(24)]
    detect = DetectConfig(window=3, confirm=2, cooldown=2)
    want, split, pol = [], EVEN, SpeedSplit(detect)
    for step, sps in enumerate(readings):
        d = pol.decide(step, sps, split)
        if d is not None:
            split = d[0]
        want.append((split, None if d is None else list(d[1])))
    assert len({s for s, _ in want}) > 1                    # it re-split, and back
    for cut in range(len(readings)):
        split, pol = EVEN, SpeedSplit(detect)
        for step in range(cut + 1):
            d = pol.decide(step, readings[step], split)
            split = d[0] if d is not None else split
        resumed = SpeedSplit(detect)
        resumed.load_state_dict(json.loads(json.dumps(pol.state_dict())))
        for step in range(cut + 1, len(readings)):
            d = resumed.decide(step, readings[step], split)
            split = d[0] if d is not None else split
            assert (split, None if d is None else list(d[1])) == want[step], (cut, step)
    bad = SpeedSplit(detect).state_dict() | {"planned": [1.0, 1.0, 1.0],
                                             "last": {"shares": [2, 2], "micro_batches": 2}}
    with pytest.raises(ValueError, match=r"state is for 3 ranks; last.shares=\[2, 2\]"):
        SpeedSplit(detect).load_state_dict(bad)
