"""The replay's policies on hand-sized cases (``malleus_ds/replay/run.py``), where the answer
can be worked out on paper, and the command (``malleus-sim replay`` / ``trace``)."""
from __future__ import annotations

import json

import pytest

from malleus_ds.app.cli import sim_main
from malleus_ds.problem import Problem
from malleus_ds.replay.run import ReplayError, capacity_bound
from malleus_ds.replay.summary import DETECTED, replay
from malleus_ds.replay.trace import Event, make_trace


#: a small model's memory terms (MB per GPU): the malleus policy sizes migrations from them
MEMORY = {"device_mb": 80000, "reserved_mb": 4000, "layer_static_mb": 100,
          "layer_activation_mb": 10, "embedding_mb": 50, "extra_mb": 0}


def dp_problem(gpus=4, G=28, memory=True) -> Problem:
    """Pure data parallelism: one 4-layer stage per GPU, ``G`` micro-batches of 1."""
    return Problem.from_json({
        "version": 1, "name": f"dp{gpus}", "cluster": {"nodes": 1, "gpus_per_node": gpus},
        "model": {"num_layers": 4},
        "training": {"global_batch_size": G, "micro_batch_size": 1, "tp": 1, "pp": 1,
                     "dp": gpus},
        "cost": {"tp_slowdown": {"1": 1.0}}, "rates": {}, "current_plan": None,
        **({"memory": MEMORY} if memory else {})})


def test_one_gpu_at_rate_2_static_runs_at_half_and_oracle_reaches_the_bound():
    """4 GPUs of pure DP, 28 micro-batches (7 each). GPU 3 at rate 2 for the whole hour:
    static takes 7 x 2 = 14 units a step (1/2); the oracle gives it 4 and the others 8 (step
    8: 7/8), which is the capacity bound (3 + 1/2) / 4. Re-splitting the micro-batches alone
    (rebalance-data) does the same here: pure DP has nothing else to change."""
    tr = make_trace([Event(0.0, 3600.0, 3, 2.0)], 4, hours=1.0)
    res = replay(dp_problem(), tr, step_s=1.0, planner_time_limit_s=2.0,
                 policies=["static", "rebalance-data", "oracle"])
    st, orc = res["policies"]["static"], res["policies"]["oracle"]
    assert res["healthy_samples_per_s"] == pytest.approx(28.0)
    assert st["vs_healthy"] == pytest.approx(0.5)
    assert res["capacity_bound"] == pytest.approx(0.875)
    assert orc["vs_healthy"] == pytest.approx(0.875)
    assert orc["vs_static"] == pytest.approx(1.75)
    assert st["gpu_hours_lost"] == pytest.approx(4 * 0.5)            # half of 4 GPU-hours
    assert orc["switches"] == 0 and st["switches"] == 0
    assert res["policies"]["rebalance-data"]["vs_healthy"] == pytest.approx(0.875)
    assert res["segment_steps"][0]["rebalance_step_s"] == pytest.approx(8 / 7)


def test_an_event_in_part_of_the_trace_is_weighted_by_its_time():
    """GPU 0 at rate 4 for 900 of 3600 s: static runs at 1/4 then, 1 otherwise."""
    tr = make_trace([Event(900.0, 1800.0, 0, 4.0)], 4, hours=1.0)
    res = replay(dp_problem(), tr, step_s=0.5, policies=["static"])
    assert res["policies"]["static"]["vs_healthy"] == pytest.approx(0.75 + 0.25 / 4)
    assert res["capacity_bound"] == pytest.approx(0.75 + 0.25 * (3 + 0.25) / 4)
    assert [e["slow_gpus"] for e in res["segment_steps"]] == [0, 1, 0]
    assert "oracle" not in res["policies"] and "oracle_step_s" not in res["segment_steps"][1]


def test_the_oracle_switches_at_each_change_and_plans_once_per_rate_vector():
    ev = [Event(600.0, 1200.0, 1, 3.0), Event(1800.0, 2400.0, 1, 3.0)]
    res = replay(dp_problem(), make_trace(ev, 4, hours=1.0), step_s=1.0,
                 planner_time_limit_s=2.0, policies=["static", "oracle"])
    assert res["policies"]["oracle"]["switches"] == 4       # in, out, in, out
    slow = [e for e in res["segment_steps"] if e["slow_gpus"]]
    assert slow[0]["planning_s"] > 0 or slow[1]["planning_s"] > 0
    assert res["policies"]["oracle"]["vs_healthy"] <= res["capacity_bound"] + 1e-9


def test_capacity_bound_of_no_straggler_is_one():
    assert capacity_bound(make_trace([], 8, hours=1.0).segments(), 8) == 1.0


def test_bad_input_is_named():
    tr = make_trace([], 8, hours=1.0)
    with pytest.raises(ReplayError, match="the trace is for 8 GPUs, the problem has 4"):
        replay(dp_problem(), tr, 1.0)
    tr = make_trace([], 4, hours=1.0)
    with pytest.raises(ReplayError, match=r"--step-s=0 must be > 0"):
        replay(dp_problem(), tr, 0.0)
    with pytest.raises(ReplayError, match=r"'dp4' has no memory section: the malleus policy"):
        replay(dp_problem(memory=False), tr, 1.0, policies=["static", "malleus"])
    # without memory the fixed policies still run; no break-even (a switch's bytes unknown)
    slow = make_trace([Event(60.0, 600.0, 3, 2.0)], 4, hours=1.0)
    res = replay(dp_problem(memory=False), slow, 1.0, policies=["static", "oracle"],
                 planner_time_limit_s=1.0)
    assert res["break_even"] == [] and res["policies"]["oracle"]["vs_static"] > 1.0
    with pytest.raises(ReplayError, match=r"unknown policy 'fast'"):
        replay(dp_problem(), tr, 1.0, policies=["fast"])


def test_the_command_writes_a_trace_replays_it_and_writes_json_and_plot(tmp_path, capsys):
    prob = tmp_path / "p.json"
    prob.write_text(json.dumps(dp_problem(gpus=16, G=64).to_json()))
    csv = tmp_path / "t.csv"
    assert sim_main(["trace", "--gpus", "16", "--hours", "6", "--regime", "mixed",
                     "--seed", "2", "--gpus-per-node", "4", "-o", str(csv)]) == 0
    assert "wrote" in capsys.readouterr().out
    out_json, png = tmp_path / "r.json", tmp_path / "r.png"
    assert sim_main(["replay", str(prob), str(csv), "--step-s", "2", "--hours", "6",
                     "--planner-time-limit", "1", "--json", str(out_json),
                     "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "capacity bound" in text and "oracle" in text and "static" in text
    res = json.loads(out_json.read_text())
    assert set(res["policies"]) == {"static", "rebalance-data", "oracle", "malleus", "restart"}
    for p in res["policies"].values():
        assert p["samples_per_s"] <= res["capacity_samples_per_s"] + 1e-6
    pol = res["policies"]
    assert pol["oracle"]["vs_static"] >= pol["rebalance-data"]["vs_static"] - 1e-9
    assert pol["rebalance-data"]["vs_static"] >= 1.0 - 1e-9
    assert png.stat().st_size > 10_000
    # detection in steps, per event and over the run (issue 52, item 4)
    ev = [e for e in res["events"] if e["policy"] == "malleus" and e["trigger"] in DETECTED
          and not e["first"]]          # a re-split at once and the planner's: one request
    assert ev and all(isinstance(e["detection_steps"], int) and e["detection_steps"] >= 0
                      for e in ev), ev
    d = res["detection"]
    assert d["events"] == len(ev) and d["max_steps"] == max(e["detection_steps"] for e in ev)
    assert d["median_steps"] >= 1, ev     # a change is seen in a step's timings, at the earliest
    assert f"detection (malleus, {d['events']} changes): median {d['median_steps']} steps" in text
    # bad input: exit 2, one line naming the field
    assert sim_main(["replay", str(prob), str(csv), "--step-s", "2", "--hours", "1"]) == 2
    assert "after --hours=1" in capsys.readouterr().err
    assert sim_main(["trace", "--gpus", "0", "--hours", "1", "--regime", "mixed",
                     "-o", str(csv)]) == 2


def test_the_commands_loop_and_cost_options_are_checked_by_name(tmp_path, capsys):
    prob = tmp_path / "p.json"
    prob.write_text(json.dumps(dp_problem().to_json()))
    csv = tmp_path / "t.csv"
    csv.write_text("start_s,end_s,gpu,rate\n60,600,3,2.0\n")
    base = ["replay", str(prob), str(csv), "--step-s", "1", "--hours", "0.25"]
    cfg = tmp_path / "loop.json"
    cfg.write_text(json.dumps({"detect": {"window": 0}}))
    assert sim_main(base + ["--loop-config", str(cfg)]) == 2
    assert "--loop-config.detect.window=0 must be >= 1" in capsys.readouterr().err
    assert sim_main(base + ["--loop-config", str(tmp_path / "none.json")]) == 2
    assert "--loop-config: cannot read" in capsys.readouterr().err
    assert sim_main(base + ["--switch-costs", "nvlink_gbps=-1"]) == 2
    assert "--switch-costs: nvlink_gbps=-1.0 must be > 0" in capsys.readouterr().err
    cfg.write_text(json.dumps({"horizon_steps": 500}))
    assert sim_main(base + ["--loop-config", str(cfg), "--policies", "static,malleus",
                            "--restart-costs", "init_s=10"]) == 0
    assert "malleus" in capsys.readouterr().out


def test_the_detection_summary_counts_the_detectors_changes_against_its_latency():
    from malleus_ds.adaptive.settings import AdaptiveSettings
    from malleus_ds.replay.summary import detection_summary, detector_latency_steps

    st = AdaptiveSettings()
    lat = detector_latency_steps(st)
    d = st.detect
    assert lat == (d.window // 2 + d.confirm) * d.every + d.every
    ev = [{"policy": "malleus", "trigger": t, "detection_steps": n}
          for t, n in (("onset", 3), ("recovery", lat + 2), ("change", 1), ("forced", 99),
                       ("missed", 50))]
    ev.append({"policy": "restart", "trigger": "restart", "detection_steps": 70})
    # a re-split at once shares its request with the planner's decision: counted by that one
    ev.insert(0, {"policy": "malleus", "trigger": "onset", "detection_steps": 40, "first": True})
    assert detection_summary(ev, st) == {"events": 3, "median_steps": 3, "max_steps": lat + 2,
                                         "latency_steps": lat, "over": 1}
    assert detection_summary(ev[4:], st) is None
