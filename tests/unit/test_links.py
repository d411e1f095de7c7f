"""Slow links in the planning problem, the cost model, the simulator and the planner (issue:
slow links): a boundary or a reduction crossing a link ``rate`` times slow costs ``rate`` times
its healthy inter-node time, worked out on paper; the planner cuts the cluster at the slow links
(pipelines across them, data-parallel groups on healthy links) where that wins, and the event
simulator agrees; bad link entries are refused by name."""
from __future__ import annotations

import pytest

from malleus_ds.cost import boundary_times, evaluate, reduce_time, step_time
from malleus_ds.plan import PlanError
from malleus_ds.planner.links import across_slow_links, segments
from malleus_ds.planner.search import plan
from malleus_ds.problem import Problem
from malleus_ds.simulate import build_timeline

COMM = {"layer_ms": 10.0, "activation_mb": 8.0, "intra_node_gbps": 100.0,
        "inter_node_gbps": 12.5, "grad_mb": 200.0}


def _problem(nodes=2, gpn=4, links=None, L=16, G=64, tp=1, **comm) -> Problem:
    d = {"version": 1, "name": f"{nodes}x{gpn}", "cluster": {"nodes": nodes, "gpus_per_node": gpn},
         "model": {"num_layers": L},
         "training": {"global_batch_size": G, "micro_batch_size": 1, "tp": tp, "pp": 1,
                      "dp": nodes * gpn // tp},
         "rates": {}, "comm": dict(COMM, **comm)}
    if links:
        d["link_rates"] = links
    return Problem.from_json(d)


def test_link_rates_round_trip_and_bad_entries_are_named():
    p = _problem(links={"1-0": 4.0})
    assert p.link_rates == {(0, 1): 4.0} and p.link_rate(1, 0) == 4.0 and p.link_rate(1, 1) == 1.0
    assert Problem.from_json(p.to_json()).link_rates == {(0, 1): 4.0}
    assert "link_rates" not in _problem().to_json()
    for bad, msg in (({"0-2": 2.0}, r"node 2 is outside 0..1"),
                     ({"1-1": 2.0}, r"node 1 to itself is not one"),
                     ({"0-1": 0.5}, r"link_rates\['0-1'\]=0.5 must be a finite number >= 1.0"),
                     ({"01": 2.0}, r"key '01' must name two nodes")):
        with pytest.raises(PlanError, match=msg):
            _problem(links=bad)
    with pytest.raises(PlanError, match=r"comm.grad_mb=-1 must be a finite number >= 0"):
        reduce_time(_problem(grad_mb=-1), _problem().static_plan())


def test_a_slow_link_slows_what_crosses_it_by_its_rate():
    """On paper: the static plan (dp=8, one stage each) reduces each layer's 200 MB in a ring of
    8 over the inter-node link: 2*7/8*200 MB / 12.5 GB/s = 28 ms = 2.8 units per layer, 44.8 for
    16 layers; at rate 4, 179.2. A 2-stage pipeline across the link pays its boundary 8 MB /
    12.5 GB/s / 10 ms = 0.064 units, 0.256 at rate 4; inside a node 8 / 100 / 10 = 0.008."""
    healthy, slow = _problem(), _problem(links={"0-1": 4.0})
    static = healthy.static_plan()
    assert reduce_time(healthy, static) == pytest.approx(44.8)
    assert reduce_time(slow, static) == pytest.approx(179.2)
    assert step_time(slow, static) - step_time(healthy, static) == pytest.approx(179.2 - 44.8)
    cross = across_slow_links(slow)
    assert [tuple(s.ranks for s in p.stages) for p in cross.pipelines] == [
        ((0,), (4,)), ((1,), (5,)), ((2,), (6,)), ((3,), (7,))]
    assert boundary_times(slow, cross.pipelines[0].stages) == pytest.approx((0.256,))
    assert boundary_times(healthy, cross.pipelines[0].stages) == pytest.approx((0.064,))
    # each layer's ring: 4 stages on one node, the intra-node bandwidth: 2*3/4*200/100/10 each
    assert reduce_time(slow, cross) == pytest.approx(16 * 0.3)
    assert evaluate(slow, cross).reduce_time == pytest.approx(4.8)


def test_the_planner_cuts_at_the_slow_link_and_the_simulator_agrees():
    slow = _problem(links={"0-1": 4.0})
    res = plan(slow, seed=0, time_limit=10)
    assert res.method == "links", res.summary()
    assert res.step_time < 0.5 * step_time(slow, slow.static_plan())
    sim_static = build_timeline(slow, slow.static_plan()).step_time
    sim_plan = build_timeline(slow, res.plan).step_time
    assert sim_plan < 0.5 * sim_static
    assert sim_plan <= res.step_time + 1e-9          # the closed form bounds the simulation
    # healthy links: the user's layout stands
    assert plan(_problem(), seed=0, time_limit=10).method == "static"


def test_four_nodes_one_slow_cut_keeps_reductions_on_healthy_links():
    """Nodes {0,1} and {2,3} joined by healthy links, every link between the halves 4x slow:
    two segments, 2-stage pipelines across the cut, each layer's ring on nodes 0-1 or 2-3."""
    slow = {f"{a}-{b}": 4.0 for a in (0, 1) for b in (2, 3)}
    p = _problem(nodes=4, gpn=2, links=slow)
    assert segments(p) == [[0, 1], [2, 3]]
    cross = across_slow_links(p)
    assert all(len(q.stages) == 2 for q in cross.pipelines) and len(cross.pipelines) == 4
    for q in cross.pipelines:
        assert {p.job.node_of(q.stages[0].ranks[0])} <= {0, 1}
        assert {p.job.node_of(q.stages[1].ranks[0])} <= {2, 3}
    res = plan(p, seed=0, time_limit=10)
    assert res.step_time <= step_time(p, cross) + 1e-9
    assert res.step_time < 0.6 * step_time(p, p.static_plan())


def test_no_slow_link_no_cut():
    assert across_slow_links(_problem()) is None
    assert across_slow_links(_problem(links={"0-1": 1.0})) is None
    # more segments than layers: no pipeline can take a stage in each
    assert across_slow_links(_problem(nodes=4, gpn=2, L=3, links={
        f"{a}-{b}": 2.0 for a in range(4) for b in range(a + 1, 4)})) is None


def test_where_nothing_helps_the_plan_says_why():
    """The plan stays as it is, and its notes say why: segments of unequal size (3 nodes, one
    cut off by slow links), or a cut that would cost more than it saves (activations outweigh
    the gradients)."""
    odd = _problem(nodes=3, gpn=2, G=48, links={"0-2": 4.0, "1-2": 4.0})
    res = plan(odd, seed=0, time_limit=5)
    assert res.method != "links"
    assert any("unequal numbers of TP groups (nodes [0, 1]: 4, nodes [2]: 2)" in n
               for n in res.notes), res.notes
    assert "note: slow links 0-2 x4, 1-2 x4" in res.summary()
    heavy = _problem(links={"0-1": 4.0}, activation_mb=2000.0, grad_mb=1.0)
    res = plan(heavy, seed=0, time_limit=5)
    assert res.method != "links"
    assert any("the one cut at them takes" in n and "cost more than the reductions" in n
               for n in res.notes), res.notes
    assert plan(_problem(links={"0-1": 4.0}), seed=0, time_limit=5).notes == ()


def _tp_plan(groups, L=16, G=64):
    """One single-stage pipeline per TP group, the batch split evenly."""
    from malleus_ds.plan import Plan

    return Plan.from_json({"version": 1, "num_layers": L, "global_batch_size": G,
                           "micro_batch_size": 1, "suspended": [],
                           "pipelines": [{"micro_batches": G // len(groups),
                                          "stages": [{"ranks": list(g), "layers": [0, L]}]}
                                         for g in groups]})


def test_tp_collectives_and_messages_pay_a_slow_gpu_link():
    """On paper: GPUs 0 and 1 of node 0 are joined by a link 4x slow (100 / 4 = 25 GB/s). A
    TP=2 group (0, 1) moves 2*1/2 of 8 MB per collective: 8 / 25 = 0.32 ms against the healthy
    0.08 that layer_ms holds, 0.024 units more; two per layer forward and two backward, 16
    layers: 0.768 + 0.768 a micro-batch. Groups (0, 2) and (1, 3) pay nothing. A boundary from
    rank 0 to rank 1 pays 0.032 instead of 0.008. The event simulator charges the same."""
    from dataclasses import replace

    from malleus_ds.cost import tp_times
    from malleus_ds.simulate import build_timeline

    slow = _problem(tp=2, grad_mb=0.0).with_link_rates({}, {"0-1": 4.0})
    assert slow.gpu_link_rates == {(0, 1): 4.0}
    assert Problem.from_json(slow.to_json()).gpu_link_rates == {(0, 1): 4.0}
    on = _tp_plan([(0, 1), (2, 3), (4, 5), (6, 7)])
    off = _tp_plan([(0, 2), (1, 3), (4, 5), (6, 7)])
    assert tp_times(slow, on.pipelines[0].stages[0]) == pytest.approx((0.768, 0.768))
    assert tp_times(slow, off.pipelines[0].stages[0]) == (0.0, 0.0)
    assert tp_times(_problem(tp=2), on.pipelines[0].stages[0]) == (0.0, 0.0)
    assert step_time(slow, on) - step_time(slow, off) == pytest.approx(16 * 1.536)
    for p in (on, off):
        assert build_timeline(slow, p).step_time == pytest.approx(step_time(slow, p))
    # recomputed layers run their forward's collectives again in backward
    f, b = tp_times(replace(slow, activation_checkpointing=True), on.pipelines[0].stages[0])
    assert b == pytest.approx(2 * f)
    one = _problem(grad_mb=0.0).with_link_rates({}, {"0-1": 4.0})
    pipe = across_slow_links(_problem(links={"0-1": 4.0})).pipelines[0]
    from malleus_ds.plan import Stage
    inner = (Stage((0,), (0, 8)), Stage((1,), (8, 16)))
    assert boundary_times(one, inner) == pytest.approx((0.032,))
    assert boundary_times(one, pipe.stages) == pytest.approx((0.064,))     # 0 -> 4: node link


def test_gpu_link_entries_are_checked_by_name():
    for bad, msg in (({"0-4": 2.0}, r"ranks 0 and 4 are on nodes 0 and 1; a link between "
                                    r"nodes goes in link_rates"),
                     ({"0-8": 2.0}, r"gpu_link_rates\['0-8'\]: rank 8 is outside 0..7"),
                     ({"2-2": 2.0}, r"rank 2 to itself is not one"),
                     ({"0-1": 0.9}, r"gpu_link_rates\['0-1'\]=0.9 must be a finite number")):
        with pytest.raises(PlanError, match=msg):
            _problem().with_link_rates({}, bad)
        with pytest.raises(PlanError, match=msg):
            Problem.from_json(dict(_problem().to_json(), gpu_link_rates=bad))


def test_the_planner_re_forms_tp_groups_off_a_slow_gpu_link():
    """Node 0's TP=2 groups (0, 1) and (2, 3) with the link 0-1 slow 8x: the planner trades
    ranks between them and keeps everything else; the
    simulator agrees the new layout is faster. With every rank in one TP=4 group there is
    nothing to trade: the plan keeps its groups."""
    from malleus_ds.planner.gpu_links import gpu_links_note, regroup_off_slow_gpu_links

    slow = _problem(tp=2, grad_mb=0.0).with_link_rates({}, {"0-1": 8.0})
    static = slow.static_plan()
    res = plan(slow, seed=0, time_limit=2.0)
    groups = {st.ranks for p in res.plan.pipelines for st in p.stages}
    assert not any({0, 1} <= set(g) for g in groups), groups
    assert step_time(slow, res.plan) < step_time(slow, static)
    assert build_timeline(slow, res.plan).step_time < build_timeline(slow, static).step_time
    re = regroup_off_slow_gpu_links(slow, static)
    assert [len(p.stages) for p in re.pipelines] == [len(p.stages) for p in static.pipelines]
    # node 0's groups re-formed, neither holding the slow pair nor putting it at the same
    # place of both (where data-parallel peers reduce): e.g. (0, 2) and (3, 1)
    node0 = [st.ranks for p in re.pipelines for st in p.stages if st.ranks[0] < 4]
    assert sorted(r for g in node0 for r in g) == [0, 1, 2, 3] and len(node0) == 2
    assert not any({0, 1} <= set(g) for g in node0), node0
    assert {0, 1} not in [{x, y} for x, y in zip(*node0)], node0
    assert [st.ranks for p in re.pipelines for st in p.stages if st.ranks[0] >= 4] == \
        [(4, 5), (6, 7)]
    four = _problem(tp=4, grad_mb=0.0).with_link_rates({}, {"0-1": 8.0})
    assert regroup_off_slow_gpu_links(four, four.static_plan()) is None
    # where nothing can help, the plan says so
    assert gpu_links_note(four, four.static_plan()) == (
        "slow GPU links GPUs 0-1 x8: kept inside a TP group: node 0's only TP group holds "
        "them: a group of 4 ranks has no other ranks of its node to trade with")
    assert gpu_links_note(slow, res.plan) is None
    res4 = plan(four, seed=0, time_limit=2.0)
    held = any({0, 1} <= set(st.ranks) for p in res4.plan.pipelines for st in p.stages)
    assert held == any("slow GPU links" in n for n in res4.notes), (res4.method, res4.notes)
    assert regroup_off_slow_gpu_links(_problem(tp=2), static) is None


def test_pipelines_across_a_slow_link_get_fewer_micro_batches():
    """Four two-stage pipelines, two of them (2-4, 3-5) with their boundary across nodes 0-1,
    the others inside a node; the link 20x slow and large activations: the planner's
    candidates include the running layout re-split, where the crossing pipelines run fewer
    micro-batches, and its answer is at least as fast."""
    from malleus_ds.plan import Pipeline, Plan, Stage
    from malleus_ds.planner.baselines import resplit

    def pipe(a, b, m):
        return Pipeline(m, (Stage((a,), (0, 8)), Stage((b,), (8, 16))))
    running = Plan(16, 64, 1, (pipe(0, 1, 16), pipe(2, 4, 16), pipe(3, 5, 16), pipe(6, 7, 16)))
    pr = Problem.from_json(dict(_problem(links={"0-1": 20.0}, grad_mb=0.0,
                                         activation_mb=64.0).to_json(),
                                current_plan=running.to_json()))
    re = resplit(pr, running)
    m = [p.micro_batches for p in re.pipelines]
    assert sum(m) == 64 and m[1] < m[0] and m[2] < m[0] and m[0] == m[3], m
    assert step_time(pr, re) < step_time(pr, running)
    assert plan(pr, seed=0, time_limit=2.0).step_time <= step_time(pr, re) * (1 + 1e-9)
