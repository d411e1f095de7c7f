"""A campaign's fault schedule is a pure function of its seed (``chaos/schedule.py``)."""
from __future__ import annotations

from collections import Counter

import pytest

from malleus_ds.chaos.schedule import AT_LAUNCH, DEATHS, KINDS, Fault, draw


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert draw(3, 36, 4) == draw(3, 36, 4)
    assert any(draw(s, 36, 4) != draw(3, 36, 4) for s in range(4, 10))


def test_every_kind_is_drawn_and_every_fault_fits_the_job():
    seen = Counter()
    for seed in range(300):
        s = draw(seed, 36, 4)
        assert 2 <= len(s.faults) <= 4
        assert s.deaths <= 2 and s.count("sigterm") <= 1
        for f in s.faults:
            seen[f.kind] += 1
            assert 3 <= f.step <= 32 and 0 <= f.rank < 4
            assert f.until is None or f.step < f.until <= 36
            if f.kind == "slow_link":
                assert f.peer is not None and f.peer != f.rank
        assert [f.step for f in s.live()] == sorted(f.step for f in s.live())
        assert not [f for f in s.live() if f.kind in AT_LAUNCH]
    assert set(seen) == set(KINDS), seen
    # a long campaign of 50 seeds meets every kind about 20 times or more
    fifty = Counter(f.kind for seed in range(50) for f in draw(seed, 36, 4).faults)
    assert min(fifty.values()) >= 8, fifty


def test_kinds_can_be_chosen_and_bad_input_is_named():
    s = draw(1, 24, 2, kinds=("kill", "freeze"))
    assert {f.kind for f in s.faults} <= {"kill", "freeze", "straggler"}
    with pytest.raises(ValueError, match=r"fault kinds \['explode'\]"):
        draw(1, 24, 2, kinds=("explode",))
    with pytest.raises(ValueError, match=r"world=1, steps=24"):
        draw(1, 24, 1)
    with pytest.raises(ValueError, match="fault kind 'boom'"):
        Fault("boom", 3)


def test_the_printed_schedule_names_every_fault():
    s = draw(0, 36, 4)
    lines = s.lines()
    assert lines[0] == f"seed 0: {len(s.faults)} fault(s), 36 steps, 4 ranks"
    assert len(lines) == 1 + len(s.faults)
    assert s.json()["faults"][0]["kind"] == sorted(s.faults, key=lambda f: f.step)[0].kind
    assert all(k in DEATHS or k not in ("hang", "kill") for k in KINDS)


def test_an_undo_that_cannot_be_done_yet_is_kept_for_the_next_try():
    from malleus_ds.chaos.inject import Injection

    tries = []

    def unlink():
        tries.append(1)
        if len(tries) == 1:
            raise OSError(30, "Read-only file system")

    inj = Injection(Fault("disk_full", 5, until=8), done=True)
    inj._undo.append(unlink)
    assert inj.end() is False and len(tries) == 1
    assert inj.end() is True and len(tries) == 2
    assert inj.end() is True and len(tries) == 2        # done once: never again
