"""``launch/train.py engine=malleus``: a plan file runs exactly that plan (with straggler
emulation, same losses as the reference); a bad one fails on every rank. ``plan=static`` with
``parallel.tp=2 parallel.dp=2`` and scripted ``malleus.switch`` entries share one 4-rank job
(:func:`switch_job`): its first plan is the static TP2 x DP2 layout, its log shows the TP slowdown
measured at start-up for the job's TP degree (4: a switch target has a TP4 stage) and both
migrations, and its losses equal the reference."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cases import HETERO

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
ARGS = ["model=tiny", "model.max_seq_len=16", "progress=false", "engine=malleus"]


def _torchrun(n, args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           TRAIN] + ARGS + args
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_plan_file_runs_and_matches_reference(tmp_path):
    plan = tmp_path / "hetero.json"
    plan.write_text(json.dumps(dict(HETERO, global_batch_size=8)))
    out = tmp_path / "run"
    # train.global_batch_size=16 is overridden by the plan's 8
    p = _torchrun(4, [f"plan={plan}", "train.steps=4", "train.global_batch_size=16",
                      f"hydra.run.dir={out}",
                      "straggler.schedule=[{rank:1,rate:3.0,start_step:2,end_step:100}]"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in rows if "event" not in r]
    assert [r["event"] for r in rows if "event" in r] == ["tp_slowdown"]   # a TP=2 stage
    assert [r["samples"] for r in recs] == [8] * 4 and all(len(r["compute_s"]) == 4 for r in recs)
    assert all(len(r["wait_s"]) == 4 and min(r["wait_s"]) >= 0 for r in recs)   # per rank
    # rank 1 (TP=2 stage with rank 2) is slowed from step 2 on; nobody else sleeps
    assert recs[1]["emulated_s"] == [0.0] * 4 and recs[3]["emulated_s"][1] > 0
    assert [e for r, e in enumerate(recs[3]["emulated_s"]) if r != 1] == [0.0] * 3
    from malleus_ds.models import model_config
    from malleus_ds.app.reference import reference_run
    ref, _ = reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=4,
                           global_batch_size=8, micro_batch_size=1)
    np.testing.assert_allclose([r["loss"] for r in recs], ref, rtol=1e-5)


def test_plan_naming_more_ranks_than_launched_fails_on_every_rank(tmp_path):
    plan = tmp_path / "hetero.json"
    plan.write_text(json.dumps(HETERO))
    p = _torchrun(2, [f"plan={plan}", "train.steps=2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert p.returncode != 0
    text = p.stdout + p.stderr
    assert text.count("outside the world of 2 ranks") >= 2, text[-3000:]


@pytest.fixture(scope="module")
def switch_job(tmp_path_factory):
    """One 4-rank job: ``plan=static parallel.tp=2 parallel.dp=2`` for 6 steps, switched live
    to B before step 2 and to C (one TP4 stage) before step 4. (process, metrics rows)."""
    from tests.integration.test_malleus_switch import B, C

    tmp_path = tmp_path_factory.mktemp("switch_job")
    pb, pc = tmp_path / "b.json", tmp_path / "c.json"
    pb.write_text(json.dumps(B))
    pc.write_text(json.dumps(C))
    out = tmp_path / "run"
    p = _torchrun(4, ["plan=static", "parallel.tp=2", "parallel.dp=2", "train.steps=6",
                      f"hydra.run.dir={out}",
                      f"malleus.switch=[{{step:2,plan:{pb}}},{{step:4,plan:{pc}}}]"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@functools.lru_cache(maxsize=None)
def _reference(steps):
    from malleus_ds.models import model_config
    from malleus_ds.app.reference import reference_run

    return reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=steps,
                         global_batch_size=8, micro_batch_size=1)[0]


def test_static_plan_with_tp2_dp2(switch_job):
    """``plan=static parallel.tp=2 parallel.dp=2`` starts on two TP2 replicas and trains the
    reference's losses (also across the job's two switches)."""
    p, rows = switch_job
    recs = [r for r in rows if "event" not in r]
    assert "plan: 2 pipelines: [TP2 0-4] x4 | [TP2 0-4] x4" in p.stdout, p.stdout[-2000:]
    # the TP slowdown measured at start-up (engine/tp_cost.py): one event, one summary line,
    # for the job's TP degree: parallel.tp=2 raised to 4 by the switch to C's TP4 stage
    sd = [r for r in rows if r.get("event") == "tp_slowdown"]
    assert len(sd) == 1 and sd[0]["tp"] == 4, sd
    assert sd[0]["ideal"] == {"1": 1.0, "2": 2.0, "4": 4.0}, sd
    assert set(sd[0]["table"]) == {"1", "2", "4"} and sd[0]["table"]["1"] == 1.0
    assert sd[0]["table"]["2"] >= 1.0 and sd[0]["table"]["4"] >= 1.0
    assert "TP slowdown measured at start-up" in p.stdout, p.stdout[-2000:]
    np.testing.assert_allclose([r["loss"] for r in recs], _reference(6), rtol=1e-5)


def test_scripted_switches_from_the_command_line(switch_job):
    """'malleus.switch=[{step:2,plan:B},{step:4,plan:C}]' switches live: migrate events in
    metrics.jsonl, steps tagged with their plan, same losses as the reference, a summary that
    lists the migrations."""
    p, rows = switch_job
    events = [r for r in rows if r.get("event") in ("replan", "migrate")]
    steps = [r for r in rows if "event" not in r]
    assert [(e["event"], e["step"]) for e in events] == [("migrate", 2), ("migrate", 4)]
    assert all(e["bytes"] > 0 and e["seconds"] > 0 and e["peak_extra_bytes"] > 0 for e in events)
    assert events[0]["to"] == events[1]["from"] == steps[2]["plan"] != steps[1]["plan"]
    assert steps[5]["plan"] == events[1]["to"]
    np.testing.assert_allclose([r["loss"] for r in steps], _reference(6), rtol=1e-5)
    assert p.stdout.count("migrate before step") == 2, p.stdout[-2000:]


def test_bad_switch_entries_fail_at_start_on_every_rank(tmp_path):
    from tests.integration.test_malleus_switch import C

    pc = tmp_path / "c.json"
    pc.write_text(json.dumps(C))
    bad = {
        "missing": (f"malleus.switch=[{{step:2,plan:{tmp_path / 'nope.json'}}}]", "file not found"),
        "order": (f"malleus.switch=[{{step:3,plan:{pc}}},{{step:2,plan:{pc}}}]",
                  "is not after the previous entry's step 3"),
        "world": (f"malleus.switch=[{{step:1,plan:{pc}}}]", "outside the world of 2 ranks"),
    }
    # every rank runs the same checks (config.py + the runner's validate) before any process
    # group: one real 2-rank job shows both ranks say it; the other entries are checked in-process
    from malleus_ds.app.config import ConfigError, build_run_config
    from malleus_ds.app.runners import validate
    for name, (arg, msg) in bad.items():
        if name == "world":
            p = _torchrun(2, ["plan=static", "train.steps=4", f"hydra.run.dir={tmp_path / name}",
                              arg], tmp_path)
            text = p.stdout + p.stderr
            assert p.returncode != 0, name
            assert text.count(msg) >= 2 and "malleus.switch[" in text, (name, text[-2000:])
            continue
        from hydra.core.override_parser.overrides_parser import OverridesParser
        switch = OverridesParser.create().parse_override(arg).value()
        with pytest.raises(ConfigError, match=r"malleus\.switch\[") as e:
            validate(build_run_config({"engine": "malleus", "model": {"name": "tiny",
                                                                   "max_seq_len": 16},
                                       "malleus": {"switch": switch}}, world_size=2))
        assert msg in str(e.value), (name, str(e.value))
