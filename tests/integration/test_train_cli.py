"""The app as users run it: torchrun, bare python, --multirun, bad input (the deepspeed launcher
on CPU: tests/integration/test_stream_logs.py, whose engine=deepspeed job it starts).

Each test starts real launcher subprocesses with a hard timeout, in a scratch working directory
(so a rank that creates stray folders would show up).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
TINY = ["model=tiny", "model.hidden_size=32", "model.max_seq_len=32", "train.global_batch_size=8",
        "train.micro_batch_size=1", "progress=false"]


def _env():
    e = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    e.pop("RANK", None), e.pop("LOCAL_RANK", None), e.pop("WORLD_SIZE", None)
    return e


def _run(cmd, cwd, timeout=180):
    p = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return p


def _torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            TRAIN]


def _metrics(d):
    return [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_two_ranks_writes_metrics_with_straggler(tmp_path):
    out = tmp_path / "run"
    p = _run(_torchrun(2) + TINY + ["engine=deepspeed", "train.steps=5", f"hydra.run.dir={out}",
                                    "straggler.schedule=[{rank:1,rate:3.0,start_step:3,end_step:100}]",
                                    "+deepspeed.config.csv_monitor={enabled:true,job_name:mon}",
                                    "+deepspeed.config.tensorboard={enabled:true,job_name:tb}"],
             cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = _metrics(out)
    assert [r["step"] for r in recs] == list(range(5))
    assert all(len(r["compute_s"]) == 2 and r["samples"] == 8 for r in recs)
    assert recs[2]["emulated_rates"] == {} and recs[3]["emulated_rates"] == {"1": 3.0}
    assert recs[4]["emulated_s"][1] > 0 and recs[4]["emulated_s"][0] == 0
    assert "rank 1 at rate 3" in p.stdout and "healthy" in p.stdout
    assert sorted(os.listdir(tmp_path)) == ["run"]            # no per-rank folders
    # DeepSpeed's monitor, enabled in the ds_config, writes into the run folder
    assert len((out / "mon" / "Train_Samples_train_loss.csv").read_text().splitlines()) == 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ev = EventAccumulator(str(out / "tb")).Reload()
    assert len(ev.Scalars("Train/Samples/train_loss")) == 5
    # same losses as the single-process reference on the same global batches
    from malleus_ds.models import model_config
    from malleus_ds.app.reference import reference_run
    ref, _ = reference_run(model_config("tiny", hidden_size=32, max_seq_len=32), seed=0, steps=5,
                           global_batch_size=8, micro_batch_size=1)
    np.testing.assert_allclose([r["loss"] for r in recs], ref, rtol=1e-5)


def test_python_single_process(tmp_path):
    out = tmp_path / "run"
    p = _run([sys.executable, TRAIN] + TINY + ["train.steps=2", f"hydra.run.dir={out}"],
             cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(_metrics(out)) == 2 and "engine=torch" in p.stdout
    # the interpreter's own shutdown runs: nothing of torch's, Triton's (nanobind's leak
    # report) or DeepSpeed's is left for the user to read after the summary
    assert "leaked" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-2000:]


def test_bad_layout_fails_cleanly_on_every_rank(tmp_path):
    p = _run(_torchrun(2) + TINY + ["engine=deepspeed", "parallel.dp=3",
                                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    assert p.returncode != 0
    msg = "tp=1 x pp=1 x dp=3 = 3 ranks does not match the world size 2"
    assert f"config error (rank 0): parallel layout {msg}" in p.stderr
    assert f"config error (rank 1): parallel layout {msg}" in p.stderr
    assert "malleus_ds/app/config.py" not in p.stderr       # a message, not our traceback
    assert "does not match the world size" not in p.stdout


@pytest.mark.slow
def test_multirun_launches_ranks_per_job(tmp_path):
    """The README's sweep, then launch/summarize.py: job 0 is healthy, job 1 has rank 1 emulated
    at rate 2 throughout. 8 steps (7 after the warm-up): enough for a measured straggler phase
    (phases.MIN_STEPS), so the per-step noise of 2 ranks on a shared CPU host could invent one
    in job 0's what-if account if a report read single steps (issue 31)."""
    sweep = tmp_path / "sweep"
    p = _run([sys.executable, TRAIN, "--multirun"] + TINY
             + ["nproc_per_node=2", "train.steps=8", f"hydra.sweep.dir={sweep}",
                "straggler.schedule=[],[{rank:1,rate:2.0}]"], cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _metrics(sweep / "0"), _metrics(sweep / "1")
    assert len(a) == len(b) == 8 and len(a[0]["compute_s"]) == 2
    assert a[0]["emulated_rates"] == {} and b[0]["emulated_rates"] == {"1": 2.0}
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    q = _run([sys.executable, str(REPO / "launch" / "summarize.py"), str(sweep)], cwd=tmp_path)
    assert q.returncode == 0, q.stderr
    assert "straggler.schedule=[{rank:1,rate:2.0}]" in q.stdout and "1.00x" in q.stdout
    healthy, slowed = q.stdout.split(f"\n{sweep / '0'}:\n")[1].split(f"\n{sweep / '1'}:\n")
    ratios = [[round(x / min(r["compute_s"]), 2) for x in r["compute_s"]] for r in a]
    assert "what-if: no straggler in this run" in healthy, (healthy, ratios)
    assert "rank 1 at rate 2" in slowed and "stragglers would have cost a static job" in slowed
