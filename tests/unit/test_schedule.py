"""1F1B schedules without processes: matched sends, no deadlock, bounded buffers."""
import random

import pytest

from malleus_ds.schedule import (Backward, Forward, ScheduleError, SendAct, in_flight,
                                 max_in_flight, one_f_one_b, parse, plan_schedules,
                                 replay_streams, run_streams)
from malleus_ds.plan import Pipeline, Plan, Stage


def test_golden_two_stages_three_microbatches():
    assert [str(i) for i in one_f_one_b(0, 2, 3)] == \
        ["0F0", "0SA0", "0F1", "0SA1", "0RG0", "0B0", "0F2", "0SA2", "0RG1", "0B1", "0RG2", "0B2"]
    assert [str(i) for i in one_f_one_b(1, 2, 3)] == \
        ["1RA0", "1F0", "1B0", "1SG0", "1RA1", "1F1", "1B1", "1SG1", "1RA2", "1F2", "1B2", "1SG2"]


def test_parse_roundtrip():
    for ins in one_f_one_b(1, 3, 4):
        assert parse(str(ins)) == ins
    assert parse("12F3") == Forward(12, 3)


@pytest.mark.parametrize("S,m", [(1, 1), (1, 5), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3), (8, 17)])
def test_each_microbatch_once_and_bounded(S, m):
    streams = [one_f_one_b(j, S, m) for j in range(S)]
    replay_streams(streams)  # raises on deadlock / unmatched
    for j, st in enumerate(streams):
        fw = [i.micro_batch for i in st if isinstance(i, Forward)]
        bw = [i.micro_batch for i in st if isinstance(i, Backward)]
        assert fw == list(range(m)) and bw == list(range(m))
        assert max_in_flight(st) == min(S - j, m) == in_flight(j, S, m)   # §3 memory model


def test_random_heterogeneous_plans():
    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(1, 12)
        pipes = []
        r = 0
        for _p in range(rng.randint(1, 4)):
            S = rng.randint(1, L)
            cuts = sorted(rng.sample(range(1, L), S - 1)) if S > 1 else []
            b = [0] + cuts + [L]
            stages = []
            for j in range(S):
                g = rng.choice([1, 2])
                stages.append(Stage(tuple(range(r, r + g)), (b[j], b[j + 1])))
                r += g
            pipes.append(Pipeline(rng.randint(1, 9), tuple(stages)))
        plan = Plan(L, sum(p.micro_batches for p in pipes), 1, tuple(pipes))
        sched = plan_schedules(plan)
        assert set(sched) == set(plan.active_ranks)
        for p in plan.pipelines:
            replay_streams([sched[s.ranks[0]] for s in p.stages])


def test_simulate_catches_deadlock_and_unmatched():
    # both stages receive first: deadlock
    a = [parse("0RG0"), parse("0F0"), parse("0SA0")]
    b = [parse("1RA0"), parse("1F0")]
    with pytest.raises(ScheduleError, match="deadlock"):
        replay_streams([[parse("0RG0"), parse("0SA0")], [parse("1RA0"), parse("1SG0")]])
    with pytest.raises(ScheduleError, match="never received"):
        replay_streams([a[1:], b[1:]])


def test_run_streams_times_two_stages():
    # forward 1, backward 2 on both stages; an activation takes 0.5 to arrive, a gradient 0
    streams = [one_f_one_b(j, 2, 2) for j in range(2)]
    ev = run_streams(streams,
                     duration=lambda i: {"F": 1.0, "B": 2.0}.get(i.code, 0.0),
                     latency=lambda i: 0.5 if isinstance(i, SendAct) else 0.0)
    at = {str(e): (e.start, e.end) for e in ev}
    assert at["0F0"] == (0.0, 1.0) and at["0F1"] == (1.0, 2.0)
    assert at["1RA0"] == (1.5, 1.5) and at["1F0"] == (1.5, 2.5) and at["1B0"] == (2.5, 4.5)
    assert at["0B0"] == (4.5, 6.5)                    # waits for stage 1's gradient
    assert at["1F1"] == (4.5, 5.5) and at["1B1"] == (5.5, 7.5) and at["0B1"] == (7.5, 9.5)
    assert max(e.end for e in ev) == 9.5
    # zero durations: the same execution order as the deadlock check, every time 0
    zero = run_streams(streams)
    assert [str(e) for e in zero] == replay_streams(streams)
    assert {(e.start, e.end) for e in zero} == {(0.0, 0.0)}
