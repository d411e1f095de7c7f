"""A campaign's fault schedule is a pure function of its seed (``chaos/schedule.py``)."""
from __future__ import annotations

from collections import Counter

import pytest

from malleus_ds.chaos.schedule import AT_LAUNCH, DEATHS, KINDS, SLOWDOWNS, Fault, Schedule, draw


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
    # the long campaign in bench/RESULTS.md (65 seeds of 4-6 faults) meets every kind 20 times
    long = Counter(f.kind for seed in range(65) for f in draw(seed, 36, 4, faults=(4, 6)).faults)
    assert min(long.values()) >= 20, long


def test_a_node_is_lost_only_from_an_even_world_of_four_and_never_with_a_sigterm():
    many = [draw(seed, 36, 4) for seed in range(300)]
    lost = [s for s in many if s.two_nodes]
    assert lost and all(s.count("node_loss") == 1 and not s.count("sigterm") for s in lost)
    for s in lost:
        f = next(f for f in s.faults if f.kind == "node_loss")
        assert f.rank == 1 and f.step + 2 <= f.until <= 34, f      # back before the last steps
        assert s.restarts_allowed == sum({"hang": 1, "kill": 1, "node_loss": 2}.get(g.kind, 0)
                                         for g in s.faults)
    for world in (2, 3, 5):
        assert not any(draw(seed, 36, world).two_nodes for seed in range(300))


def test_stock_meets_the_same_slowdowns_and_nothing_else():
    s = Schedule(4, 36, 4, (Fault("straggler", 3, 1, until=8, rate=3.0), Fault("kill", 5, 2),
                            Fault("slow_link", 4, 0, until=7, rate=5.0, peer=1),
                            Fault("quota", 9, 0, until=12, rate=3.0),
                            Fault("freeze", 14, 1, seconds=1.0), Fault("disk_full", 20, until=24)))
    assert [f.kind for f in s.slowdowns().faults] == ["straggler", "quota", "freeze"]
    assert set(SLOWDOWNS) <= set(KINDS) and not set(SLOWDOWNS) & set(DEATHS)


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
