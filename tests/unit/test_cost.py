"""Reference cost model (DESIGN.md §3) and the optional communication terms."""
from __future__ import annotations

import random

import pytest

from malleus_ds.cost import (boundary_times, capacity_fraction, check_memory, comm_spec,
                             efficiency, evaluate, healthy_step_time, stage_memory_mb, stage_time,
                             step_time, validate_for_problem)
from malleus_ds.plan import Pipeline, Plan, PlanError, Stage
from malleus_ds.problem import Problem
from malleus_ds.schedule import (Backward, Forward, SendAct, SendGrad, one_f_one_b,
                                 run_streams)

SD8 = {"1": 1.0, "2": 1.9, "4": 3.66, "8": 7.22}
MEM = {"device_mb": 81920, "reserved_mb": 4096, "layer_static_mb": 1100, "layer_activation_mb": 250,
       "embedding_mb": 1200, "extra_mb": 3000}


def problem(rates=None, comm=None, memory=MEM) -> Problem:
    d = {"version": 1, "name": "c", "cluster": {"nodes": 8, "gpus_per_node": 8},
         "model": {"num_layers": 80},
         "training": {"global_batch_size": 64, "micro_batch_size": 1, "tp": 8, "pp": 4, "dp": 2},
         "cost": {"tp_slowdown": SD8}, "memory": memory, "rates": rates or {}}
    if comm:
        d["comm"] = comm
    return Problem.from_json(d)


def test_static_healthy_step_time_formula():
    pr = problem()
    # 4 stages of 20 layers, 32 micro-batches: 80 + 31*20
    assert healthy_step_time(pr) == pytest.approx(700.0)
    assert efficiency(pr, pr.static_plan()) == pytest.approx(1.0)


def test_one_straggler_sets_the_pace():
    pr = problem({9: 4.0})
    c = evaluate(pr, pr.static_plan())
    # rank 9 is in (dp=1, pp=0): stage 0 of pipeline 1 runs at 4x
    assert c.pipeline_times == pytest.approx((700.0, 20 * 4 + 60 + 31 * 80))
    assert capacity_fraction(pr) == pytest.approx((63 + 0.25) / 64)
    assert efficiency(pr, pr.static_plan()) == pytest.approx(700 / 2620 / ((63 + 0.25) / 64))


def test_smaller_group_uses_slowdown_table():
    pr = problem({9: 4.0})
    st = Stage((8, 10, 11, 12), (0, 10))
    from malleus_ds.cost import stage_time
    assert stage_time(pr, st) == pytest.approx(1.9 * 10)
    st1 = Stage((9,), (0, 1))
    assert stage_time(pr, st1) == pytest.approx(7.22 * 4.0)


def test_memory_formula_and_rejection():
    pr = problem()
    # stage 0 of 4, 20 layers, full group: (20*(1100+250*4) + 1200) * 1 + 3000
    assert stage_memory_mb(pr, 20, 0, 4, 32, 8) == pytest.approx(20 * 2100 + 1200 + 3000)
    # in flight = min(S-j, m): one micro-batch -> one activation
    assert stage_memory_mb(pr, 20, 0, 4, 1, 8) == pytest.approx(20 * 1350 + 1200 + 3000)
    # a quarter-size group holds 4x the bytes per layer
    assert stage_memory_mb(pr, 5, 1, 4, 32, 2) == pytest.approx(5 * (1100 + 750) * 4 + 3000)
    big = Plan(80, 64, 1, (Pipeline(64, (Stage(tuple(range(8)), (0, 80)),)),), tuple(range(8, 64)))
    with pytest.raises(PlanError) as ei:
        check_memory(pr, big)
    assert "pipelines[0].stages[0]" in str(ei.value) and "budget 77824 MB" in str(ei.value)
    validate_for_problem(pr, pr.static_plan())


def test_comm_terms_only_when_given():
    pr = problem()
    assert comm_spec(pr) is None
    comm = {"layer_ms": 10.0, "activation_mb": 50.0, "intra_node_gbps": 500.0, "inter_node_gbps": 25.0}
    pc = problem(comm=comm)
    cs = comm_spec(pc)
    assert cs.boundary(False) == pytest.approx(50 / 25 / 10)
    # static plan: every boundary crosses nodes (stage j on node j*dp...), c = 0.2 per send
    c = evaluate(pc, pc.static_plan())
    assert c.stage_times[0] == pytest.approx((20.2, 20.4, 20.4, 20.2))
    assert c.step_time == pytest.approx(sum((20.2, 20.4, 20.4, 20.2)) + 31 * 20.4)
    assert step_time(pc, pc.static_plan()) > step_time(pr, pr.static_plan())


def test_comm_section_is_validated():
    with pytest.raises(PlanError, match="comm.layer_ms"):
        comm_spec(problem(comm={"layer_ms": 0, "activation_mb": 1, "intra_node_gbps": 1,
                                "inter_node_gbps": 1}))


def test_switch_peak_counts_old_state_plus_what_moves_in():
    """Old state without its gradient buffers + the new state a rank does not hold + buffers."""
    from dataclasses import replace

    from malleus_ds.cost import check_switch_memory, switch_peak_mb

    mem = dict(MEM, layer_grad_mb=300, switch_buffer_mb=500)
    pr = problem(memory=mem)
    st = pr.static_plan()                       # 4 stages of 20 layers, TP 8, 2 pipelines
    emb = 1200 * 800 / 1100          # the embedding's state: the same share as a layer's
    assert switch_peak_mb(pr, st, st)[0] == pytest.approx((20 * 800 + emb) + 500 + 3000)
    # pipeline 0: stage 1 (ranks 16-23) takes layers [10, 20) from stage 0, which keeps [0, 10)
    # (a group of 8 keeps its own shards)
    p0 = st.pipelines[0]
    s0, s1 = p0.stages[0], p0.stages[1]
    moved = replace(st, pipelines=(replace(p0, stages=(replace(s0, layers=(0, 10)),
                                                       replace(s1, layers=(10, 40)))
                                         + p0.stages[2:]),) + st.pipelines[1:])
    pk = switch_peak_mb(pr, st, moved)
    assert pk[0] == pytest.approx(20 * 800 + emb + 500 + 3000)          # nothing moves in
    assert pk[16] == pytest.approx(20 * 800 + 10 * 800 + 500 + 3000)    # 10 layers move in
    # halving the group (TP 8 -> 4): each rank keeps its 1/8 and receives another 1/8
    half = replace(st, pipelines=(replace(p0, stages=(replace(s0, ranks=s0.ranks[:4]),)
                                         + p0.stages[1:]),) + st.pipelines[1:],
                   suspended=st.suspended + s0.ranks[4:])
    assert switch_peak_mb(pr, st, half)[0] == pytest.approx(2 * (20 * 800 + emb) + 500 + 3000)
    tight = problem(memory=dict(mem, device_mb=4096 + 20 * 800 + 10 * 800 + 3000 + 400))
    check_switch_memory(tight, st, st)
    with pytest.raises(PlanError, match=r"needs 27500 MB on rank 16 at its peak"):
        check_switch_memory(tight, st, moved)


def test_memory_switch_terms_are_optional_and_checked():
    assert problem().memory.layer_grad_mb == 0.0
    with pytest.raises(PlanError, match=r"memory.layer_grad_mb=2000 is part of"):
        problem(memory=dict(MEM, layer_grad_mb=2000))
    with pytest.raises(PlanError, match=r"memory.switch_buffer_mb=-1"):
        problem(memory=dict(MEM, switch_buffer_mb=-1))
    pr = problem(memory=dict(MEM, layer_grad_mb=300))
    assert Problem.from_json(pr.to_json()).memory == pr.memory


def _simulated_pipeline_time(pr: Problem, pipe: Pipeline) -> float:
    """The cost model's own rule run event by event (``schedule.run_streams``): a stage's
    compute ``stage_time`` splits into forward t/3 and backward 2t/3, and each send keeps its
    stage busy for the boundary's ``boundary_times`` term (the sender pays), and a group's TP
    collectives (``tp_times``) add to its forward and backward; no latency."""
    from malleus_ds.cost import tp_times

    S = len(pipe.stages)
    comp = [stage_time(pr, s, last=j == S - 1) for j, s in enumerate(pipe.stages)]
    tp = [tp_times(pr, s) for s in pipe.stages]
    c = boundary_times(pr, pipe.stages)

    def duration(ins):
        if isinstance(ins, Forward):
            return comp[ins.stage] / 3 + tp[ins.stage][0]
        if isinstance(ins, Backward):
            return comp[ins.stage] * 2 / 3 + tp[ins.stage][1]
        if isinstance(ins, SendAct):
            return c[ins.stage]
        if isinstance(ins, SendGrad):
            return c[ins.stage - 1]
        return 0.0

    events = run_streams([one_f_one_b(j, S, pipe.micro_batches) for j in range(S)], duration)
    return max(e.end for e in events)


def test_closed_form_1f1b_against_the_event_simulator():
    """``sum t + (m-1) max t`` is exact when m = 1, S = 1 or the last stage is one of the
    slowest (uniform stages included); otherwise the last stage waits less than the formula
    assumes and the formula is an upper bound. Random plans, rates, heads and comm sections."""
    rng = random.Random(0)
    comm = {"layer_ms": 10.0, "activation_mb": 50.0, "intra_node_gbps": 500.0,
            "inter_node_gbps": 25.0}
    exact = bound = 0
    for _ in range(300):
        L = rng.randint(2, 24)
        pipes, r = [], 0
        for _p in range(rng.randint(1, 3)):
            S = rng.randint(1, min(L, 6))
            b = [0] + sorted(rng.sample(range(1, L), S - 1)) + [L]
            stages = []
            for j in range(S):
                g = rng.choice([1, 2, 2])
                stages.append(Stage(tuple(range(r, r + g)), (b[j], b[j + 1])))
                r += g
            pipes.append(Pipeline(rng.randint(1, 12), tuple(stages)))
        extra = {}
        if rng.random() < 0.5:
            extra["head_layers"] = rng.choice([0.5, 1.5])
        if rng.random() < 0.5:
            extra["comm"] = comm
        # (constructed directly: the plan need not fill the cluster to be costed)
        pr = Problem(name="r", nodes=(r + 3) // 4, gpus_per_node=4, num_layers=L,
                     global_batch_size=1, micro_batch_size=1, tp=2, pp=1, dp=1,
                     tp_slowdown={1: 1.0, 2: 1.9}, memory=None,
                     rates={k: rng.choice([1.0, 1.0, 1.0, 2.0, 3.5]) for k in range(r)},
                     extra=extra)
        plan = Plan(L, sum(p.micro_batches for p in pipes), 1, tuple(pipes))
        cost = evaluate(pr, plan)
        for pipe, ts, closed in zip(plan.pipelines, cost.stage_times, cost.pipeline_times):
            sim = _simulated_pipeline_time(pr, pipe)
            if pipe.micro_batches == 1 or len(ts) == 1 or ts[-1] >= max(ts):
                assert sim == pytest.approx(closed, rel=1e-9), (ts, pipe.micro_batches)
                exact += 1
            else:
                assert sim <= closed * (1 + 1e-9), (ts, pipe.micro_batches)
                bound += sim < closed * (1 - 1e-6)
    assert exact > 100 and bound > 100         # both cases were exercised
