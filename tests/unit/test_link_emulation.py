"""``straggler.link_schedule`` (``emulation/links.py``): which messages cross a slowed link, the
clock's wait after them, and bad entries refused by name before any process group."""
from __future__ import annotations

import pytest

from malleus_ds.app.config import ConfigError, build_run_config
from malleus_ds.emulation.links import LinkSchedule
from malleus_ds.emulation.straggler import StragglerError
from malleus_ds.engine.clock import ComputeClock


def _cfg(links, engine="malleus", world=4):
    return build_run_config({"engine": engine, "cluster": {"nodes": 2, "gpus_per_node": 2},
                             "straggler": {"schedule": [], "link_schedule": links},
                             "train": {"global_batch_size": 8, "micro_batch_size": 1}},
                            world_size=world)


def test_which_messages_cross_a_slowed_link():
    s = LinkSchedule.parse([{"nodes": [1, 0], "rate": 4.0, "start_step": 2, "end_step": 5},
                            {"ranks": [2, 3], "rate": 2.0}], 4, 2)
    assert s.rate((1, 2), 2) == 4.0 and s.rate((2, 1), 4) == 4.0     # across nodes 0 and 1
    assert s.rate((1, 2), 1) == 1.0 and s.rate((1, 2), 5) == 1.0     # outside its steps
    assert s.rate((0, 1), 3) == 1.0                                   # inside node 0
    assert s.rate((2, 3), 0) == 2.0 and s.rate((0, 1, 2, 3), 3) == 4.0   # a group spanning both
    assert s.rate((0, 2, 3), 0) == 2.0


def test_the_clock_waits_rate_minus_one_times_the_message():
    slept = []
    clock = ComputeClock(links=LinkSchedule.parse([{"nodes": [0, 1], "rate": 3.0}], 4, 2),
                         sleep=slept.append)
    clock.start_step(0)
    assert clock.after_comm((0, 2), 0.5) == pytest.approx(1.0) and slept == [pytest.approx(1.0)]
    assert clock.after_comm((0, 1), 0.5) == 0.0
    assert clock.link_emulated_s == pytest.approx(1.0)
    clock.start_step(1)
    assert clock.link_emulated_s == 0.0
    with ComputeClock().comm((0, 2)):       # no schedule: nothing timed, nothing slept
        pass


def test_the_clock_slows_the_wire_not_the_wait_and_logs_the_message(monkeypatch):
    """A receive's wait holds its peer's lateness too: the emulation waits ``(rate - 1) x`` the
    fastest seconds per MB seen of that message, so a late peer's own emulated wait is not fed
    back into the next message (``ComputeClock.comm``); the log records wire + emulated wait."""
    from malleus_ds.engine import clock as clock_mod
    from malleus_ds.engine.comm_log import CommLog

    now = [0.0]
    monkeypatch.setattr(clock_mod.time, "perf_counter", lambda: now[0])
    slept = []
    clock = ComputeClock(links=LinkSchedule.parse([{"nodes": [0, 1], "rate": 3.0}], 4, 2),
                         sleep=slept.append)
    clock.comm_log = CommLog(lambda r: r // 2)
    clock.start_step(0)
    for took in (0.010, 0.050, 0.004):         # 2 MB each: 5, 25, then 2 ms/MB
        with clock.comm((2, 0), 2.0):
            now[0] += took
    assert slept == [pytest.approx(0.020), pytest.approx(0.020), pytest.approx(0.008)]
    # logged at its least: 4 ms of wire + 8 ms emulated over 2 MB
    assert clock.comm_log.values()[:3] == [1.0, 2.0, pytest.approx(0.006)]


@pytest.mark.parametrize("links,msg", [
    ([{"nodes": [0, 2], "rate": 2.0}], r"link_schedule\[0\].nodes: node 2 does not exist: the "
                                       r"job has 2 nodes \(0..1\), 2 ranks per node"),
    ([{"ranks": [1, 1], "rate": 2.0}], r"ranks=\[1, 1\]: a link joins two ranks; a rank to "
                                       r"itself is not one"),
    ([{"nodes": [0, 1], "rate": 0.5}], r"link_schedule\[0\].rate=0.5 must be a finite number "
                                       r">= 1.0"),
    ([{"ranks": [1, 2], "rate": 2.0}], r"ranks=\[1, 2\] are on nodes 0 and 1: name a link "
                                       r"between nodes by 'nodes'"),
    ([{"nodes": [0, 1], "ranks": [0, 1], "rate": 2.0}], r"exactly one of 'nodes'"),
    ([{"nodes": [0, 1], "rate": 2.0, "start_step": 5, "end_step": 5}],
     r"end_step=5 must be > start_step=5"),
    ([{"nodes": [0, 1], "rate": 2.0, "speed": 1}], r"unknown keys \['speed'\]"),
])
def test_bad_entries_are_refused_by_name(links, msg):
    with pytest.raises(ConfigError, match=msg):
        _cfg(links)
    with pytest.raises(StragglerError, match=msg):
        LinkSchedule.parse(links, 4, 2)


def test_only_engine_malleus_emulates_links():
    assert _cfg([{"nodes": [0, 1], "rate": 2.0}]).links.rate((0, 3), 0) == 2.0
    assert not _cfg([]).links
    with pytest.raises(ConfigError, match=r"straggler.link_schedule slows links of "
                                          r"engine=malleus's messages"):
        _cfg([{"nodes": [0, 1], "rate": 2.0}], engine="deepspeed")
