"""malleus-plan / malleus-sim: outputs, exit codes and messages."""
from __future__ import annotations

import json

import pytest

from malleus_ds.app.cli import plan_main, sim_main
from malleus_ds.cost import validate_for_problem
from malleus_ds.plan import Plan
from malleus_ds.problem import Problem


def write_problem(tmp_path, **over):
    d = {"version": 1, "name": "cli", "cluster": {"nodes": 2, "gpus_per_node": 4},
         "model": {"num_layers": 8},
         "training": {"global_batch_size": 8, "micro_batch_size": 1, "tp": 2, "pp": 2, "dp": 2},
         "cost": {"tp_slowdown": {"1": 1.0, "2": 1.9}}, "memory": None, "rates": {"2": 3.0}}
    d.update(over)
    p = tmp_path / "problem.json"
    p.write_text(json.dumps(d))
    return p


def test_plan_then_sim(tmp_path, capsys):
    prob = write_problem(tmp_path)
    out = tmp_path / "plan.json"
    assert plan_main([str(prob), "-o", str(out), "--seed", "1", "--time-limit", "5"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("cli: method=") and "eta=" in line and "baselines eta" in line
    pr = Problem.load(prob)
    validate_for_problem(pr, Plan.load(out))
    png = tmp_path / "g.png"
    assert sim_main([str(prob), str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "step time" in text and "baselines eta: static=" in text and png.exists()


def test_plan_to_stdout(tmp_path, capsys):
    prob = write_problem(tmp_path)
    assert plan_main([str(prob), "--time-limit", "5"]) == 0
    cap = capsys.readouterr()
    Plan.loads(cap.out)
    assert "method=" in cap.err


def test_sim_defaults_to_static(tmp_path, capsys):
    prob = write_problem(tmp_path)
    assert sim_main([str(prob)]) == 0
    assert "(static)" in capsys.readouterr().out


@pytest.mark.parametrize("content, needle", [
    (None, "file not found"),
    ("{not json", "not valid JSON"),
    ('{"version": 7}', "version=7"),
    ('{"version": 1, "cluster": {"nodes": 1, "gpus_per_node": 4}}', "problem.model"),
])
def test_bad_problem_exit_2(tmp_path, capsys, content, needle):
    p = tmp_path / "bad.json"
    if content is not None:
        p.write_text(content)
    for main in (plan_main, sim_main):
        assert main([str(p)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "error:" in err


def test_bad_plan_and_args_exit_2(tmp_path, capsys):
    prob = write_problem(tmp_path)
    bad = tmp_path / "plan.json"
    d = Problem.load(prob).static_plan().to_json()
    d["pipelines"][0]["micro_batches"] = 3
    bad.write_text(json.dumps(d))
    assert sim_main([str(prob), str(bad)]) == 2
    assert "global_batch_size=8" in capsys.readouterr().err
    assert plan_main([str(prob), "--time-limit", "0"]) == 2
    assert "--time-limit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        plan_main([])
    assert ei.value.code == 2
    bad_comm = write_problem(tmp_path, comm={"layer_ms": -1})
    assert plan_main([str(bad_comm)]) == 2
    assert "comm.layer_ms" in capsys.readouterr().err


def test_multi_objective_writes_pareto_plans(tmp_path, capsys):
    prob = write_problem(tmp_path)
    pr = Problem.load(prob)
    d = json.loads(prob.read_text())
    d["current_plan"] = pr.static_plan().to_json()
    prob.write_text(json.dumps(d))
    out = tmp_path / "plan.json"
    pdir = tmp_path / "pareto"
    assert plan_main([str(prob), "-o", str(out), "--multi-objective", "--pareto-dir", str(pdir),
                      "--time-limit", "5"]) == 0
    text = capsys.readouterr().out
    files = sorted(pdir.glob("pareto_*.json"))
    assert files and "pareto[0]" in text
    for f in files:
        validate_for_problem(pr, Plan.load(f))
