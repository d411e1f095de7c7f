"""Rank 0's link rates, their detection and the planning problem's link terms
(``adaptive/link_watch.py``), from synthetic per-step reductions; and the loop with no engine
(``control.py``) re-planning around a slow link with the real planner process: 4 ranks as
2 nodes of 2, data parallel over both nodes."""
from __future__ import annotations


import numpy as np
import pytest

from malleus_ds.adaptive.control import Controller
from malleus_ds.adaptive.detect import DetectConfig
from malleus_ds.adaptive.job import JobSpec
from malleus_ds.adaptive.link_watch import Links, LinkWatch
from malleus_ds.adaptive.settings import AdaptiveSettings
from malleus_ds.adaptive.work import cost_units
from malleus_ds.steploop import StepSums
from malleus_ds.job_layout import JobLayout
from malleus_ds.models.llama import PRESETS
from malleus_ds.plan import static_plan
from malleus_ds.problem import Problem
from tests.unit.adaptive.test_loop_synthetic import apply_decisions

WORLD, GPN = 4, 2
SPM = 0.004            # healthy seconds per MB of a ring member's share across nodes
MB = 3.0


def _spec(plan):
    return JobSpec.of_model(PRESETS["tiny"], plan, world=WORLD, job=JobLayout(WORLD, GPN))


def _ops(rng, rate=1.0, spread=(0.6, 2.7)):
    """One step: the reduction over all 4 ranks (crosses the link) at ``rate``, scattered as
    healthy readings of a small all-reduce on shared cores are; and pipeline receives that
    say nothing (their waits are the peers' lateness)."""
    s = MB * SPM * rate * rng.uniform(*spread) ** rng.choice([0.3, 1.0])
    return [("dp", (0, 1, 2, 3), MB, s), ("p2p", (2, 0), 0.01, rng.uniform(0.001, 1.0))]


def test_healthy_noise_is_not_a_slow_link_and_a_slow_one_is_read_within_a_few_steps():
    rng = np.random.default_rng(1)
    plan = static_plan(4, 8, 1, 1, 1, WORLD)
    w = LinkWatch(_spec(plan), DetectConfig(every=1))
    assert w.active and w.links == [(0, 1)]
    for _ in range(60):
        w.add(_ops(rng))
        assert w.check() is None, w.measured_map()
    for k in range(8):
        w.add(_ops(rng, rate=6.0))
        got = w.check()
        if got is not None:
            break
    assert got is not None and k <= 5, (k, w.measured_map())
    assert 3.0 <= got.nodes[(0, 1)] <= 12.0 and got.gpus == {}, got
    # the comm section: the healthy bandwidth of the reductions, one layer's fp32 gradients
    comm = w.comm_section(0.01)
    assert comm["layer_ms"] == pytest.approx(10.0)
    assert 1 / (comm["inter_node_gbps"] * 1e3) == pytest.approx(SPM, rel=0.35)
    assert comm["intra_node_gbps"] == comm["inter_node_gbps"]     # none ran inside a node
    cfg = PRESETS["tiny"]
    assert comm["grad_mb"] == pytest.approx(
        sum(np.prod(p.shape) for p in _spec(plan).param_table.owned(0)) * 4 / 1e6)
    assert comm["activation_mb"] == pytest.approx(cfg.max_seq_len * cfg.hidden_size * 4 / 1e6)
    pr = w.problem(Problem.from_json(_problem()), got, comm)
    assert pr.link_rate(0, 1) == got.nodes[(0, 1)] and pr.extra["comm"] == comm
    assert w.comm_section(None) is None


def test_a_link_first_crossed_after_a_switch_made_for_it_learns_its_healthy_speed():
    """Belief: after a plan made for the link at 5x, the reductions crossing it first (no
    reference yet) teach the reference their seconds over 5; the link then reads 5 while slow
    and 1 once it recovers."""
    rng = np.random.default_rng(2)
    w = LinkWatch(_spec(static_plan(4, 8, 1, 1, 1, WORLD)), DetectConfig(every=1))
    w.planned_for(Links({(0, 1): 5.0}))
    for _ in range(20):
        w.add(_ops(rng, rate=5.0, spread=(0.9, 1.1)))
    assert w.measured_map().nodes[(0, 1)] == pytest.approx(5.0, rel=0.15)
    assert w.check() is None
    for _ in range(6):
        w.add(_ops(rng, spread=(0.9, 1.1)))
    assert w.measured_map().nodes[(0, 1)] == 1.0
    assert not w.normalised()


def test_a_job_on_one_node_has_no_links_unless_its_gpu_links_are_read():
    spec = JobSpec.of_model(PRESETS["tiny"], static_plan(4, 8, 1, 1, 1, 4))
    w = LinkWatch(spec, DetectConfig())          # TP=1: GPU links not read by default
    assert not w.active and w.check() is None and not w.normalised()
    w.add([("dp", (0, 1), 1.0, 0.1)])
    w = LinkWatch(spec, DetectConfig(gpu_links=True))
    assert w.active and w.links == [] and w.gpu.links == [(0, 1), (0, 2), (0, 3), (1, 2),
                                                            (1, 3), (2, 3)]
    tp2 = JobSpec.of_model(PRESETS["tiny"], static_plan(4, 8, 1, 2, 1, 2),
                           job=JobLayout(4, 4, 2))
    assert LinkWatch(tp2, DetectConfig()).active              # TP=2: read by default
    assert not LinkWatch(tp2, DetectConfig(gpu_links=False)).active


def _problem():
    return {"version": 1, "name": "t", "cluster": {"nodes": 2, "gpus_per_node": 2},
            "model": {"num_layers": 4},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 1, "pp": 1,
                         "dp": 4}}


class _Prober:
    """Stands for ``engine/link_probe.py``: remembers the link it was asked to time."""

    def __init__(self):
        self.asked, self.trips = [], []

    def exchange(self, a, b, mb, trips=None):
        self.asked.append((a, b, mb))
        self.trips.append(trips)


def test_the_loop_replans_around_a_slow_link_and_back_with_no_engine():
    """The real loop and planner process: healthy for 20 steps, then the link 20x slow until
    step 45. The loop reads it, asks the planner with the link's rate and the measured comm
    section, and adopts two-stage pipelines cut at the link (every reduction inside a node);
    it probes the link (one round trip's reading per probe, in the next step's all-reduce:
    healthy at first, then held), sees it recover, and goes back to data parallel."""
    rng = np.random.default_rng(3)
    first = plan = static_plan(4, 8, 1, 1, 1, WORLD)
    spec = _spec(plan)
    prober = _Prober()
    ctl = Controller(spec, AdaptiveSettings(detect=DetectConfig(every=1, probe_every=2),
                                            tp_slowdown="ideal", planner_time_limit_s=0.5),
                     plan, link_prober=prober)
    events, plans, probed = [], [], 0
    try:
        for step in range(80):
            plan = apply_decisions(ctl, step, plan, events)
            plans.append(plan)
            rate = 20.0 if 20 <= step < 45 else 1.0
            units = cost_units(plan, WORLD, 1, {1: 1.0}, ctl.head)
            comp = units * 0.002 * rng.uniform(0.97, 1.03, WORLD)
            # the first stages' reduction crosses the link when they sit on both nodes
            crossing = len({r // GPN for p in plan.pipelines for r in p.stages[0].ranks}) > 1
            ops = _ops(rng, rate=rate, spread=(0.8, 1.25)) if crossing else \
                [("dp", (0, 1), MB, MB * SPM * rng.uniform(0.9, 1.1))]
            if len(prober.asked) > probed:         # a probe after the last step's all-reduce
                a, b, mb = prober.asked[-1]
                probed = len(prober.asked)
                ops.append(("probe", (a, b), 2 * mb, 2 * mb * 0.01 * rate
                            * rng.uniform(0.9, 1.1)))
            ready, _ = ctl.contribute(float(comp[0]), 0.0)
            ctl.observe(step, StepSums(loss=0.0, overflow=False, ready=ready, compute_s=comp,
                                       probe_s=np.full(WORLD, np.nan), comm=tuple(ops)))
            ctl.after_reduce(step)
            reduce_s = ops[0][3] if crossing else 0.0
            ctl.step_done(float(comp.max()) + reduce_s)
            ctl.wait_planner()
    finally:
        ctl.close()
    link = [e for e in events if e["trigger"] == "link" and e["adopted"]]
    why = "\n".join(map(str, events))
    assert [e for e in events if e["detected"] < 21] == [], why
    assert link and link[0]["detected"] <= 20 + 8 and link[0]["link_rates"]["0-1"] >= 5.0, why
    cut = plans[link[0]["step"]]
    for p in cut.pipelines:      # cut at the link: stage 0 on one node, stage 1 on the other
        assert [{r // GPN for r in st.ranks} for st in p.stages] in ([{0}, {1}], [{1}, {0}]), \
            cut.to_json()
    # the link is probed by the first ranks of its two nodes: every step at the start (the
    # probes' healthy reference), then every 10 steps, every step again once it is held
    assert prober.asked and set(prober.asked) == {(0, 2, 0.1)}, prober.asked
    # three round trips a probe (the quickest is the reading): a link held at 20x is not slow
    # enough to be probed with one
    assert set(prober.trips) == {None}, prober.trips
    back = [e for e in link if e["detected"] >= 45]
    assert back and back[0]["link_rates"] == {} and back[0]["detected"] <= 45 + 12, why
    assert plans[-1] == first


def test_the_loop_replans_around_a_slow_gpu_link_with_no_engine():
    """One node of 4 ranks, TP=2 groups (0, 1) and (2, 3), data parallel between them (the
    GPU links are read by default: the nominal TP degree is 2). From step 20 the link between
    GPUs 0 and 1 is 20x slow until step 45: group (0, 1)'s TP collectives take 20x their time,
    every other op and every rank's compute stay healthy. The loop reads the GPU link (and no
    slow GPU), asks the planner with it, and adopts TP groups formed off it: neither group holds
    both GPUs, nor puts them at the same place (the data-parallel peers). No op crosses the
    link then; its probes (GPUs 0 and 1 exchange a round trip) see it recover, and the loop
    plans for a healthy node (keeping the new groups: as fast, and a migration would cost)."""
    rng = np.random.default_rng(5)
    plan = static_plan(4, 8, 1, 2, 1, 2)
    spec = JobSpec.of_model(PRESETS["tiny"], plan, world=4, job=JobLayout(4, 4, 2))
    prober, probed = _Prober(), 0
    ctl = Controller(spec, AdaptiveSettings(detect=DetectConfig(every=1, probe_every=2),
                                            tp_slowdown="ideal", planner_time_limit_s=0.5),
                     plan, link_prober=prober)
    cfg = PRESETS["tiny"]
    act_mb = cfg.max_seq_len * cfg.hidden_size * 4 / 1e6
    events, plans = [], []
    try:
        for step in range(80):
            plan = apply_decisions(ctl, step, plan, events)
            plans.append(plan)
            units = cost_units(plan, 4, 2, {1: 1.0, 2: 2.0}, ctl.head)
            comp = units * 0.002 * rng.uniform(0.97, 1.03, 4)
            groups = [st.ranks for p in plan.pipelines for st in p.stages]
            ops, tp_s = [], 0.0
            for g in groups:       # 4 collectives a layer and micro-batch, 2(g-1)/g = 1
                mb = 4 * 4 * plan.pipelines[0].micro_batches * act_mb
                slow = 20.0 if 20 <= step < 45 and {0, 1} <= set(g) else 1.0
                s = mb * SPM * slow * rng.uniform(0.9, 1.1)
                ops.append(("tp", tuple(sorted(g)), mb, s))
                tp_s = max(tp_s, s)
            for pair in zip(*groups):          # the data-parallel peers' reductions
                slow = 20.0 if 20 <= step < 45 and set(pair) == {0, 1} else 1.0
                ops.append(("dp", tuple(sorted(pair)), MB, MB * SPM * slow
                            * rng.uniform(0.9, 1.1)))
            if len(prober.asked) > probed:         # a probe after the last step's all-reduce
                a, b, mb = prober.asked[-1]
                probed = len(prober.asked)
                slow = 20.0 if 20 <= step < 45 and {a, b} == {0, 1} else 1.0
                ops.append(("probe", (a, b), 2 * mb, 2 * mb * 0.01 * slow
                            * rng.uniform(0.9, 1.1)))
            ready, _ = ctl.contribute(float(comp[0]), 0.0)
            ctl.observe(step, StepSums(loss=0.0, overflow=False, ready=ready, compute_s=comp,
                                       probe_s=np.full(4, np.nan), comm=tuple(ops)))
            ctl.after_reduce(step)
            ctl.step_done(float(comp.max()) + tp_s)
            ctl.wait_planner()
    finally:
        ctl.close()
    why = "\n".join(map(str, events))
    assert [e for e in events if e["detected"] < 21] == [], why
    link = [e for e in events if e["trigger"] == "link" and e["adopted"]]
    assert link and link[0]["detected"] <= 20 + 8, why
    assert link[0]["link_rates"] == {} and link[0]["gpu_link_rates"]["0-1"] >= 5.0, why
    assert all(e["measured_rates"] == [1.0] * 4 for e in link), why      # no slow GPU
    groups = [st.ranks for p in plans[link[0]["step"]].pipelines for st in p.stages]
    assert not any({0, 1} <= set(g) for g in groups), groups
    assert {0, 1} not in [set(p) for p in zip(*groups)], groups
    # probed: the adjacent GPUs at the start, the held link after
    assert (0, 1, 0.1) in prober.asked and set(prober.asked) <= {(0, 1, 0.1), (1, 2, 0.1),
                                                                 (2, 3, 0.1)}, prober.asked
    back = [e for e in events if e["trigger"] == "link" and e["detected"] >= 45]
    assert back and "gpu_link_rates" not in back[0] and back[0]["detected"] <= 45 + 12, why


def test_link_probes_take_each_kind_of_link_in_turn():
    """2 nodes of 2 GPUs with TP=2: node links and GPU links are both read, each with its own
    probe reference (``link_rates.MIN_HISTORY`` probes): the warm-up probes them in turn,
    every step, for LINK_WARMUP steps per kind."""
    from malleus_ds.adaptive.probing import LINK_WARMUP

    plan = static_plan(4, 8, 1, 2, 1, 2)
    spec = JobSpec.of_model(PRESETS["tiny"], plan, world=4, job=JobLayout(4, 2, 2))
    ctl = Controller(spec, AdaptiveSettings(detect=DetectConfig(every=1)), plan,
                     link_prober=_Prober())
    try:
        assert ctl.measures_links
        got = [ctl.probing.link_to_probe(s) for s in range(2 * LINK_WARMUP)]
        assert got == [((0, 2), None), ((0, 1), None)] * LINK_WARMUP, got
        ctl.seen = 2 * LINK_WARMUP           # warmed up: every 5 x probe_every steps
        assert [s for s in range(40) if ctl.probing.link_to_probe(s) is not None] == [0, 10, 20, 30]
        # held links: every step for LINK_WARMUP steps, three round trips; then every
        # probe_every steps, one round trip for a link held at ONE_TRIP_RATE or more
        ctl.probing.held_links, ctl.probing.held_since = Links({(0, 1): 150.0}, {(2, 3): 20.0}), 100
        got = [ctl.probing.link_to_probe(s) for s in range(100, 100 + LINK_WARMUP + 8)]
        assert got[:LINK_WARMUP] == [((0, 2), None), ((2, 3), None)] * (LINK_WARMUP // 2)
        assert [g for g in got[LINK_WARMUP:] if g] == [((0, 2), 1), ((2, 3), None)] * 2, got
    finally:
        ctl.close()
