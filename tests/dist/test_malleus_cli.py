"""``launch/train.py engine=malleus``: a plan file runs exactly that plan (with straggler
emulation, same losses as the reference); a bad one fails on every rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.dist.test_malleus_equivalence import HETERO

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


def test_plan_file_runs_and_matches_reference(tmp_path):
    plan = tmp_path / "hetero.json"
    plan.write_text(json.dumps(dict(HETERO, global_batch_size=8)))
    out = tmp_path / "run"
    # train.global_batch_size=16 is overridden by the plan's 8
    p = _torchrun(4, [f"plan={plan}", "train.steps=4", "train.global_batch_size=16",
                      f"hydra.run.dir={out}",
                      "straggler.schedule=[{rank:1,rate:3.0,start_step:2,end_step:100}]"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in recs] == [8] * 4 and all(len(r["compute_s"]) == 4 for r in recs)
    # rank 1 (TP=2 stage with rank 2) is slowed from step 2 on; nobody else sleeps
    assert recs[1]["emulated_s"] == [0.0] * 4 and recs[3]["emulated_s"][1] > 0
    assert [e for r, e in enumerate(recs[3]["emulated_s"]) if r != 1] == [0.0] * 3
    from malleus_ds.models import model_config
    from malleus_ds.reference import reference_run
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


def test_static_plan_with_tp2_dp2(tmp_path):
    out = tmp_path / "run"
    p = _torchrun(4, ["plan=static", "parallel.tp=2", "parallel.dp=2", "train.steps=3",
                      f"hydra.run.dir={out}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    from malleus_ds.models import model_config
    from malleus_ds.reference import reference_run
    ref, _ = reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=3,
                           global_batch_size=8, micro_batch_size=1)
    np.testing.assert_allclose([r["loss"] for r in recs], ref, rtol=1e-5)
