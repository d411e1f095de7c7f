"""Simulator: 1F1B timeline, summary and Gantt PNG."""
from __future__ import annotations

import pytest

from malleus_ds.cost import boundary_times, evaluate, stage_time
from malleus_ds.plan import Pipeline, Plan, Stage
from malleus_ds.problem import Problem
from malleus_ds.schedule import Backward, Forward, one_f_one_b
from malleus_ds.simulate import build_timeline, gantt, summarize


def problem(rates=None) -> Problem:
    return Problem.from_json({
        "version": 1, "name": "sim", "cluster": {"nodes": 2, "gpus_per_node": 4},
        "model": {"num_layers": 8},
        "training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 2, "pp": 2, "dp": 2},
        "cost": {"tp_slowdown": {"1": 1.0, "2": 1.9}}, "memory": None, "rates": rates or {}})


def test_each_stage_runs_the_engines_1f1b():
    pr = problem({"2": 3.0})
    pl = Plan(8, 8, 1, (Pipeline(5, (Stage((0, 1), (0, 5)), Stage((3,), (5, 8)))),
                        Pipeline(3, (Stage((4, 5), (0, 2)), Stage((6,), (2, 4)),
                                     Stage((7,), (4, 8))))), (2,))
    tl = build_timeline(pr, pl)
    for i, p in enumerate(pl.pipelines):
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            engine = [str(x) for x in one_f_one_b(j, S, p.micro_batches)
                      if isinstance(x, (Forward, Backward))]
            assert [str(o) for o in tl.rank_ops(s.ranks[0])] == engine


def test_uniform_pipeline_matches_cost_model():
    pr = problem()
    pl = pr.static_plan()
    tl = build_timeline(pr, pl)
    assert tl.step_time == pytest.approx(evaluate(pr, pl).step_time)
    # every F/B of every micro-batch, in dependency order
    assert len(tl.ops) == sum(2 * len(p.stages) * p.micro_batches for p in pl.pipelines)
    done = {(o.pipeline, o.stage, o.kind, o.micro_batch): o for o in tl.ops}
    for o in tl.ops:
        if o.kind == "F" and o.stage > 0:
            assert o.start >= done[(o.pipeline, o.stage - 1, "F", o.micro_batch)].end - 1e-9
        if o.kind == "B":
            nxt = (o.pipeline, o.stage + 1, "B", o.micro_batch)
            if nxt in done:
                assert o.start >= done[nxt].end - 1e-9
    assert str(tl.ops[0]) == "0F0"
    # per-rank view: rank 5 is tp_rank 1 of (dp 0, pp 1) -> stage 1 of pipeline 0
    ops5 = tl.rank_ops(5)
    assert [str(o) for o in ops5][:3] == ["1F0", "1B0", "1F1"]
    assert all(o.pipeline == 0 and o.stage == 1 for o in ops5)


def test_summary_and_straggler():
    pr = problem({"2": 3.0})
    pl = pr.static_plan()
    s = summarize(pr, pl)
    assert s.model_step_time == pytest.approx(evaluate(pr, pl).step_time)
    assert 0.0 < s.bubble_share < 1.0 and s.efficiency < 1.0
    assert "pipeline 1" in s.text() and "eta" in s.text()
    # heterogeneous stages: simulated time never exceeds the 1F1B formula's bound here
    assert s.simulated_step_time <= s.model_step_time + 1e-9


def test_gantt_png(tmp_path):
    pr = problem({"2": 3.0})
    pl = Plan(8, 8, 1, (Pipeline(5, (Stage((0, 1), (0, 5)), Stage((3,), (5, 8)))),
                        Pipeline(3, (Stage((4, 5), (0, 4)), Stage((6, 7), (4, 8))))), (2,))
    out = tmp_path / "g.png"
    gantt(pr, pl, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_head_and_node_boundaries_come_from_the_cost_model():
    # 2 nodes x 4 GPUs; stages on ranks 0 | 1 (same node) | 4 (next node)
    d = problem().to_json()
    d["comm"] = {"layer_ms": 10.0, "activation_mb": 50.0, "intra_node_gbps": 500.0,
                 "inter_node_gbps": 25.0}
    d["head_layers"] = 1.5
    pr = Problem.from_json(d)
    stages = (Stage((0,), (0, 3)), Stage((1,), (3, 6)), Stage((4,), (6, 8)))
    pl = Plan(8, 8, 1, (Pipeline(8, stages),), tuple(r for r in range(8) if r not in (0, 1, 4)))
    assert boundary_times(pr, stages) == pytest.approx((50 / 500 / 10, 50 / 25 / 10))
    assert boundary_times(problem(), stages) == (0.0, 0.0)
    tl = build_timeline(pr, pl)
    op = {(o.stage, o.kind, o.micro_batch): o for o in tl.ops}
    for j, c in enumerate(boundary_times(pr, stages)):    # the message delay of each boundary
        assert op[(j + 1, "F", 0)].start - op[(j, "F", 0)].end == pytest.approx(c)
    assert tl.busy[0] == pytest.approx(tuple(
        8 * stage_time(pr, s, last=j == 2) for j, s in enumerate(stages)))
    assert tl.busy[0][2] == pytest.approx(8 * 1.9 * (2 + 1.5))       # the head: last stage only
