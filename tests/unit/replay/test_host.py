"""Ranks sharing a host's CPU cores (``replay/host.py``): fluid processor sharing, worked out on
paper, and its calibration from a run's healthy step lines."""
from __future__ import annotations

import numpy as np
import pytest

from malleus_ds.plan import Pipeline, Plan, Stage
from malleus_ds.replay.host import SharedHost, _shared, one_f_one_b, plan_graph, spans


def test_four_ranks_on_two_cores_take_turns():
    """4 healthy ranks of 0.15 s each on 2 cores: each gets half a core, 0.3 s; the rest
    (0.05 s per working rank) runs 4 on 2 too: 0.1 s."""
    h = SharedHost(cores=2.0, other_s=0.05, ranks_per_host=4)
    assert h.step_seconds([0.15] * 4, [1.0] * 4) == pytest.approx(0.3 + 0.1)
    # two without work: the others have a core each, and so has the rest
    assert h.step_seconds([0.15, 0.0, 0.15, 0.0], [1.0] * 4) == pytest.approx(0.15 + 0.05)
    # the calibrating rank's probe (0.05 s of CPU) runs before its compute
    assert h.step_seconds([0.15, 0.0, 0.15, 0.0], [1.0] * 4, lead=[0.05, 0, 0, 0]) == \
        pytest.approx(0.2 + 0.05)


def test_a_sleeping_straggler_hands_its_core_to_the_others():
    """Rank 1 at rate 6 wants a core 1/6 of its time: 3 + 1/6 wanting 2 cores, sigma = 2 /
    (19/6) = 12/19; the three others finish at 0.15 * 19/12 = 0.2375 s, by when rank 1 has
    done 0.2375 * (12/19) / 6 = 0.025 s of its 0.15; alone, the rest at 1/6 per second takes
    0.75 s more: 0.9875 s, against 6 x 0.15 = 0.9 on an idle host."""
    h = SharedHost(cores=2.0, other_s=0.0, ranks_per_host=4)
    assert h.step_seconds([0.15] * 4, [1.0, 6.0, 1.0, 1.0]) == pytest.approx(0.9875)


def test_probes_and_the_planner_take_cores_too():
    """2 ranks on 2 cores (no contention) and a planner searching: 3 want 2, each rank at 2/3
    of a core; a probe of an idle rank wants a core for its 0.1 s."""
    h = SharedHost(cores=2.0, other_s=0.02, ranks_per_host=2)
    assert h.step_seconds([0.1, 0.1], [1.0, 1.0]) == pytest.approx(0.12)
    # the planner on host 0 wants a core throughout: 0.15 s, and the rest 0.02 * 3/2
    assert h.step_seconds([0.1, 0.1], [1.0, 1.0], searching=True) == pytest.approx(0.15 + 0.03)
    # rank 1 idle probing 0.1 s: 2 want 2, nothing slows
    assert h.step_seconds([0.2, 0.0], [1.0, 1.0], probing=[False, True], probe_s=0.1) == \
        pytest.approx(0.2 + 0.02)
    # hosts of 2 ranks each: the job waits for its slowest; the planner only on host 0
    h2 = SharedHost(cores=1.0, other_s=0.0, ranks_per_host=2)
    assert h2.step_seconds([0.1, 0.1, 0.1, 0.0], [1.0] * 4) == pytest.approx(0.2)
    assert h2.step_seconds([0.1, 0.0, 0.1, 0.0], [1.0] * 4, searching=True) == \
        pytest.approx(0.2)


def test_a_probe_that_does_not_sustain_is_its_cpu_seconds_at_its_ranks_pace():
    """One core; rank 0 computes 0.2 s, idle rank 1 probes at rate 4. A sustained probe wants
    1/4 of a core for its 0.05 s wall: sigma 0.8 that long, 0.04 s done, 0.16 s left: 0.21 s.
    A probe of 0.05 s of CPU (a few runs of the block, the sleep emulation between them:
    ``sleeps``) takes 4 x 0.05 s of wall at 1/4 of a core: 0.16 s done by 0.2 s: 0.24 s."""
    h = SharedHost(cores=1.0, other_s=0.0, ranks_per_host=2)
    slept = SharedHost(cores=1.0, other_s=0.0, ranks_per_host=2, sleeps=True)
    kw = dict(probing=[False, True], probe_s=0.05)
    assert h.step_seconds([0.2, 0.0], [1.0, 4.0], **kw) == pytest.approx(0.21)
    assert slept.step_seconds([0.2, 0.0], [1.0, 4.0], **kw) == pytest.approx(0.24)
    assert not SharedHost.calibrate([{"compute_s": [0.1], "wait_s": [0.0]}], 1, 0.1, 0.1,
                                    sleeps=True).probes_sustain


def test_a_rank_slowed_by_sleeping_runs_each_span_at_a_whole_cores_demand_then_sleeps():
    """2 cores; ranks 0 and 1 compute 0.2 s, rank 2 0.1 s at rate 4. As fluid demand, rank 2
    wants 1/4: sigma 2/2.25, ranks 0-1 done at 0.225 s, rank 2 through 0.05 s by then and 0.2 s
    more alone: 0.425 s. Slowed by sleeping (``sleeps``) it runs as the emulation runs it.
    In one span: 2/3 of a core beside the two busy ranks, 0.15 s, then a sleep of 3x that:
    0.6 s. In two micro-batches' spans (forward 1/6, backward 2/6, twice): the first forward
    runs beside both busy ranks (0.025 s, then 0.075 s asleep), the first backward too
    (0.1-0.15 s, asleep to 0.3 s), and the rest alone (0.3-0.367 s, 0.367-0.5 s): 0.5 s. The
    busy ranks are done at 0.225 s."""
    work, rates = [0.2, 0.2, 0.1], [1.0, 1.0, 4.0]
    assert SharedHost(2.0, 0.0, 3).step_seconds(work, rates) == pytest.approx(0.425)
    slept = SharedHost(2.0, 0.0, 3, sleeps=True)
    assert slept.step_seconds(work, rates) == pytest.approx(0.6)
    two = [tuple((f, ()) for f in spans(2))] * 3
    assert slept.step_seconds(work, rates, graph=two) == pytest.approx(0.5)
    ends = _shared(np.array(work), 1.0 / np.array(rates), 2.0, [], sleeps=True, graph=two)
    assert ends == pytest.approx([0.225, 0.225, 0.5])
    # without sleeping, spans that wait for nothing change nothing
    assert SharedHost(2.0, 0.0, 3).step_seconds(work, rates, graph=two) == pytest.approx(0.425)


def test_a_ranks_spans_are_its_forwards_and_backwards_in_1f1b_order():
    """A forward is 1 part and a backward 2 per micro-batch; a pipeline stage runs its warm-up
    forwards first (``stages - stage - 1``) and their backwards last."""
    assert spans(2) == pytest.approx((1 / 6, 2 / 6, 1 / 6, 2 / 6))
    assert spans(3, warm=1) == pytest.approx(tuple(x / 9 for x in (1, 1, 2, 1, 2, 2)))
    assert spans(2, warm=5) == pytest.approx(tuple(x / 6 for x in (1, 1, 2, 2)))
    assert spans(0) == ()
    assert one_f_one_b(3, 1) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    plan = Plan(4, 8, 1, (Pipeline(3, (Stage((0,), (0, 2)), Stage((1,), (2, 4)))),
                          Pipeline(5, (Stage((2,), (0, 4)),))), suspended=(3,))
    got = plan_graph(plan, 4)
    assert [f for f, _ in got[0]] == pytest.approx(spans(3, 1))
    assert [f for f, _ in got[1]] == pytest.approx(spans(3, 0))
    assert [f for f, _ in got[2]] == pytest.approx(spans(5))
    assert got[3] == ()
    # stage 0 (F0 F1 B0 F2 B1 B2) waits for stage 1's backwards; stage 1 (F0 B0 F1 B1 F2 B2)
    # for stage 0's forwards; the data-parallel pipeline for nothing
    assert [d for _, d in got[0]] == [(), (), ((1, 1),), (), ((1, 3),), ((1, 5),)]
    assert [d for _, d in got[1]] == [((0, 0),), (), ((0, 1),), (), ((0, 3),), ()]
    assert all(d == () for _, d in got[2])


def test_a_tensor_parallel_stages_ranks_keep_step_span_by_span():
    """Ranks 0 and 1 form one TP stage: each span waits for its peer's previous one."""
    plan = Plan(2, 2, 1, (Pipeline(1, (Stage((0, 1), (0, 4)),)),))
    got = plan_graph(plan, 2)
    assert [d for _, d in got[0]] == [(), ((1, 0),)]
    assert [d for _, d in got[1]] == [(), ((0, 0),)]
    # rank 1 at 3x: 0.3 s of forward, rank 0's backward (0.2 s) waits for it: 0.5 s; rank
    # 1's backward 0.6 s: 0.9 s
    ends = _shared(np.array([0.3, 0.3]), np.array([1.0, 1 / 3]), 2.0, graph=got)
    assert ends == pytest.approx([0.5, 0.3 + 0.6])


def test_calibration_reads_cores_and_the_rest_from_healthy_steps():
    """Each rank computed 0.15 s and waited 0.15 s for a core (4 on 2): 2 cores; the mean step
    0.4 s less the compute wall 0.3 s leaves 0.1 s, 0.05 s of CPU per rank shared 4 on 2."""
    lines = [{"step": k, "step_time_s": 0.4, "compute_s": [0.15] * 4, "wait_s": [0.15] * 4}
             for k in range(5)]
    h = SharedHost.calibrate(lines, 4, step_s=0.4, busiest_s=0.15)
    assert h.cores == pytest.approx(2.0) and h.other_s == pytest.approx(0.05)
    assert h.step_seconds([0.15] * 4, [1.0] * 4) == pytest.approx(0.4)   # the healthy step
    # no waits: as many cores as ranks, the rest as measured
    calm = [dict(x, wait_s=[0.0] * 4, step_time_s=0.2) for x in lines]
    h = SharedHost.calibrate(calm, 4, step_s=0.2, busiest_s=0.15)
    assert h.cores == pytest.approx(4.0) and h.other_s == pytest.approx(0.05)
    # a run before wait_s was written: no host model
    old = [{k: v for k, v in x.items() if k != "wait_s"} for x in lines]
    assert SharedHost.calibrate(old, 4, step_s=0.4, busiest_s=0.15) is None
    with pytest.raises(ValueError, match="SharedHost: cores 0"):
        SharedHost(0, 0.1, 2)


def test_a_pipelines_stages_wait_for_each_others_spans():
    """A 2-stage pipeline of ranks 0 -> 1, one micro-batch, 0.3 s of work each (forward 0.1,
    backward 0.2). Two cores: rank 0's forward to 0.1 s, rank 1's forward and backward to
    0.4 s, rank 0's backward to 0.6 s, where the ranks' own work says 0.3."""
    plan = Plan(2, 1, 1, (Pipeline(1, (Stage((0,), (0, 2)), Stage((1,), (2, 4)))),))
    g = plan_graph(plan, 2)
    h = SharedHost(cores=2.0, other_s=0.0, ranks_per_host=2)
    assert h.step_seconds([0.3, 0.3], [1.0, 1.0]) == pytest.approx(0.3)
    assert h.step_seconds([0.3, 0.3], [1.0, 1.0], graph=g) == pytest.approx(0.6)
    # rank 0 at 2x, slowed by sleeping: its forward 0.1 s then 0.1 s asleep before it sends
    # (rank 1 from 0.2 s to 0.5 s), its backward 0.2 s then 0.2 s asleep: 0.9 s
    slept = SharedHost(cores=2.0, other_s=0.0, ranks_per_host=2, sleeps=True)
    assert slept.step_seconds([0.3, 0.3], [2.0, 1.0], graph=g) == pytest.approx(0.9)
    # one core, a third rank with 0.3 s and no pipeline: rank 0's forward shares it (to
    # 0.2 s), then rank 1's forward (to 0.4 s) and half its backward (to 0.6 s, when rank 2
    # is through); the other half alone (0.7 s), then rank 0's backward alone: 0.9 s
    plan3 = Plan(3, 2, 1, (Pipeline(1, (Stage((0,), (0, 2)), Stage((1,), (2, 4)))),
                           Pipeline(1, (Stage((2,), (0, 4)),))))
    ends = _shared(np.array([0.3, 0.3, 0.3]), np.ones(3), 1.0, graph=plan_graph(plan3, 3))
    assert ends == pytest.approx([0.9, 0.7, 0.6])
    # spans that wait for one another in a circle never end: a clear error, not a hang
    loop = [((1.0, ((1, 0),)),), ((1.0, ((0, 0),)),)]
    with pytest.raises(ValueError, match="never end"):
        _shared(np.array([0.1, 0.1]), np.ones(2), 1.0, graph=loop)
