"""A rank's timed communication in the step's all-reduce (``engine/comm_log.py``,
``engine/step_reduce.py``): what each rank puts in its slots, and the operations rank 0 reads
back from the sum: a receive per rank and peer at its least seconds per MB, a bucket reduction
per rank set at the least of its members' seconds (the member that arrived last)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from malleus_ds.engine.comm_log import PROBE, SLOTS, TP, CommLog, bucket_key, decode
from malleus_ds.engine.step_reduce import StepReduction


def node_of(r: int) -> int:
    return r // 2


def test_a_rank_reports_its_least_receive_per_peer_and_its_largest_crossing_bucket():
    log = CommLog(node_of)
    log.add("p2p", (1, 0), 2.0, 0.010)          # 5 ms/MB
    log.add("p2p", (1, 0), 2.0, 0.004)          # 2 ms/MB: the least
    log.add("p2p", (1, 3), 1.0, 0.001)
    log.add("dp", (0, 1), 50.0, 0.05)           # inside node 0: larger, but does not cross
    log.add("dp", (1, 3), 10.0, 0.02)           # across nodes 0-1
    log.add("dp", (1, 3), 10.0, 0.01)           # a second bucket of the same set: summed
    v = log.values()
    assert len(v) == SLOTS
    assert v[0:3] == [1.0, 2.0, pytest.approx(0.002)]
    assert v[3:6] == [4.0, 1.0, pytest.approx(0.001)]
    assert v[6:10] == [bucket_key((1, 3)), 2.0, 20.0, pytest.approx(0.03)]
    assert v[TP:] == [0.0] * 7                  # no TP collective, no link probe
    log.start_step()
    assert log.values() == [0.0] * SLOTS
    log.add("dp", (0, 1), 50.0, 0.05)           # no crossing bucket: the largest inside
    assert log.values()[6:10] == [bucket_key((0, 1)), 2.0, 50.0, 0.05]


def test_a_link_probe_is_carried_to_the_next_steps_slots_at_its_quickest_round_trip():
    log = CommLog(node_of)
    log.add("probe", (0, 2), 0.5, 0.009)        # timed after step k's all-reduce...
    log.add("probe", (0, 2), 0.5, 0.004)
    log.add("probe", (0, 2), 0.5, 0.007)
    log.start_step()                            # ...step k+1 starts
    v = log.values()
    assert v[PROBE:] == [3.0, 0.5, 0.004]
    assert log.values()[PROBE:] == [0.0] * 3    # reported once
    ops = decode(np.array([v, [0.0] * SLOTS]))
    assert ops == [("probe", (0, 2), 0.5, 0.004)]


def test_the_step_reduction_carries_every_ranks_slots_and_decodes_them():
    world, mb = 4, 8.0
    logs = [CommLog(node_of) for _ in range(world)]
    waits = [0.030, 0.012, 0.020, 0.045]        # rank 1 arrived last: 12 ms is the reduction
    for r, log in enumerate(logs):
        log.add("dp", (0, 1, 2, 3), mb, waits[r])
    logs[2].add("p2p", (2, 0), 0.5, 0.001)
    # TP groups {0, 1} and {2, 3}: each member's quickest collective of the step
    for r, log in enumerate(logs):
        grp = (0, 1) if r < 2 else (2, 3)
        for s in (0.004 + 0.001 * r, 0.002 + 0.001 * r, 0.009):
            log.add("tp", grp, 0.25, s)
    total = torch.zeros(StepReduction(world, 0, comm=True).size, dtype=torch.float64)
    for r, log in enumerate(logs):
        red = StepReduction(world, r, comm=True)
        total += red.vector(ready=False, compute_s=0.1, probe_per_unit=0.0, device="cpu",
                            comm=log.values())
    sums = StepReduction(world, 0, comm=True).read(total)
    assert np.allclose(sums.compute_s, 0.1)
    ops = {(k, r): (m, s) for k, r, m, s in sums.comm}
    assert ops[("p2p", (2, 0))] == (0.5, pytest.approx(0.001))
    # a ring member moves 2 (k-1)/k of the bucket
    assert ops[("dp", (0, 1, 2, 3))] == (pytest.approx(2 * 3 / 4 * mb), pytest.approx(0.012))
    # a TP group: its quickest collective, on the member that waited least (a ring member
    # of two moves the whole 0.25 MB)
    assert ops[("tp", (0, 1))] == (pytest.approx(0.25), pytest.approx(0.002))
    assert ops[("tp", (2, 3))] == (pytest.approx(0.25), pytest.approx(0.004))
    assert set(ops) == {("p2p", (2, 0)), ("dp", (0, 1, 2, 3)), ("tp", (0, 1)), ("tp", (2, 3))}


def test_no_comm_slots_read_as_no_ops_and_a_bad_count_is_refused():
    red = StepReduction(2, 0, comm=True)
    v = red.vector(ready=True, compute_s=0.2, probe_per_unit=0.0, device="cpu")
    assert red.read(v).comm == ()
    with pytest.raises(ValueError, match="3 comm values, expected"):
        red.vector(ready=False, compute_s=0.0, probe_per_unit=0.0, device="cpu",
                   comm=[0.0] * 3)
    # a job whose ranks do not log pays no slots for it, and cannot be given comm values
    plain = StepReduction(2, 0)
    assert plain.size == red.size - 2 * SLOTS
    assert plain.read(plain.vector(ready=False, compute_s=0.1, probe_per_unit=0.0,
                                   device="cpu")).comm == ()
    with pytest.raises(ValueError, match="without comm slots"):
        plain.vector(ready=False, compute_s=0.0, probe_per_unit=0.0, device="cpu",
                     comm=[0.0] * SLOTS)
    assert decode(np.zeros((2, SLOTS))) == []
