"""``launch/train.py checkpoint.*``: save, stop, resume — for every engine, as users run it.

A run interrupted after k steps and resumed from its checkpoint (in a new process group, for
engine=malleus under another plan and world size) gives the per-step losses of one run that
never stopped (the single-process reference, rtol 1e-5), with step numbers continuing in the
resumed run's metrics.jsonl. Bad input fails on every rank with exit code 2. Each launch costs
~5-10 s of process start-up, so every test does as much as it can with few launches: the run
that saves is the app's config run on harness ranks (tests/integration/app_run.py: the same
Hydra composition and runner, without the launch), and every resume is a ``launch/train.py``
launch (which saves again at its end).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cases import plan_json
from tests.cases import HETERO
from tests.integration.app_run import run_app

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
ARGS = ["model=tiny", "model.max_seq_len=16", "progress=false"]
# 2-rank plans for the resumed engine=malleus run: one TP2 stage; a 2-stage pipeline
TP2 = plan_json([(8, [([0, 1], (0, 4))])])
PP2 = plan_json([(8, [([0], (0, 2)), ([1], (2, 4))])])


def _launch(n: int, args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """``n`` ranks under torchrun (n=0: a bare ``python launch/train.py``, one process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    pre = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}"] if n else [sys.executable]
    return subprocess.run(pre + [TRAIN] + ARGS + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in _rows(run_dir) if "event" not in r]


def _reference(steps: int) -> list[float]:
    from malleus_ds.models import model_config
    from malleus_ds.app.reference import reference_run

    ref, _ = reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=steps,
                           global_batch_size=8, micro_batch_size=1)
    return ref


def _ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])


@pytest.mark.slow
def test_malleus_resumes_under_another_plan_and_world_size(tmp_path):
    """4 ranks on HETERO save after 3 steps (the app's run, without its launch); 2 ranks resume
    under the static dp=2 plan with a scripted switch before the resumed step (skipped) and one
    after it (applied) to step 6."""
    hetero, tp2, pp2 = tmp_path / "hetero.json", tmp_path / "tp2.json", tmp_path / "pp2.json"
    hetero.write_text(json.dumps(dict(HETERO, global_batch_size=8)))
    tp2.write_text(json.dumps(TP2))
    pp2.write_text(json.dumps(PP2))
    ck, a, b = tmp_path / "ck", tmp_path / "a", tmp_path / "b"
    run_app(4, ([*ARGS, "engine=malleus", f"plan={hetero}", "train.steps=3",
                 f"checkpoint.dir={ck}", "checkpoint.every=3"], a))
    assert (ck / "latest").read_text() == "global_step3"
    assert sorted(f.name for f in (ck / "global_step3").glob("malleus_rank*.pt")) == [
        f"malleus_rank{r:05d}.pt" for r in range(4)]
    assert json.loads((ck / "global_step3" / "run.json").read_text())["step"] == 3
    # the every=3 save is also the end-of-run one: saved once
    assert [r["step"] for r in _rows(a) if r.get("event") == "checkpoint"] == [3]

    # the scripted switches alone: the adaptive loop off, so no re-plan from the rates the
    # checkpoint carried (tests/integration/test_restart.py checks those)
    p = _launch(2, ["engine=malleus", "plan=static", "train.steps=6", f"checkpoint.dir={ck}",
                    "checkpoint.resume=true", f"hydra.run.dir={b}", "malleus.adaptive=false",
                    f"malleus.switch=[{{step:1,plan:{tp2}}},{{step:4,plan:{pp2}}}]"], tmp_path)
    _ok(p)
    first, second = _steps(a), _steps(b)
    assert [r["step"] for r in first] == [0, 1, 2] and [r["step"] for r in second] == [3, 4, 5]
    assert all(len(r["compute_s"]) == 2 for r in second)
    assert [(e["event"], e["step"]) for e in _rows(b) if "event" in e] == [
        ("tp_slowdown", 3), ("migrate", 4), ("checkpoint", 6)]     # a TP=2 plan: table measured
    assert second[0]["plan"] != second[1]["plan"] == second[2]["plan"]
    np.testing.assert_allclose([r["loss"] for r in first + second], _reference(6), rtol=1e-5)
    assert f"resumed from step 3: {ck / 'global_step3'}" in p.stdout
    assert "malleus.switch entries at steps [1] were before it: skipped" in p.stdout
    assert f"checkpoints: 1 saved to {ck} (global_step6; latest = global_step6)" in p.stdout
    assert (ck / "latest").read_text() == "global_step6"


@pytest.mark.slow
def test_deepspeed_zero1_resumes_under_the_same_layout_only(tmp_path):
    ck, a, b = tmp_path / "ck", tmp_path / "a", tmp_path / "b"
    ds = ["engine=deepspeed", "deepspeed=zero1", f"checkpoint.dir={ck}"]
    run_app(2, ([*ARGS, *ds, "train.steps=2"], a))
    assert (ck / "latest").read_text() == "global_step2"
    assert (ck / "global_step2" / "mp_rank_00_model_states.pt").is_file()   # stock files
    _ok(_launch(2, ds + ["train.steps=4", "checkpoint.resume=true", f"hydra.run.dir={b}"],
                tmp_path))
    first, second = _steps(a), _steps(b)
    assert [r["step"] for r in first + second] == [0, 1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in first + second], _reference(4), rtol=1e-5)
    # another world size: refused before any process group, naming both layouts
    p = _launch(0, ds + ["train.steps=6", "checkpoint.resume=true",
                         f"hydra.run.dir={tmp_path / 'c'}"], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert ("saved by engine=deepspeed with world_size 2, this run has 1: stock DeepSpeed "
            "checkpoints load only under the layout that saved them") in p.stderr, p.stderr[-2000:]
    # the bare launch's config error line (what checkpoint.every=-1 got before)
    assert [ln for ln in p.stderr.splitlines() if "saved by engine=deepspeed" in ln][0] \
        .startswith("[malleus_ds] config error (rank 0): "), p.stderr[-2000:]


def test_torch_resume_and_nothing_left_to_run(tmp_path):
    ck, a, b = tmp_path / "ck", tmp_path / "a", tmp_path / "b"
    t = ["engine=torch", f"checkpoint.dir={ck}"]
    run_app(1, ([*ARGS, *t, "train.steps=2"], a))
    p = _launch(0, t + ["train.steps=4", "checkpoint.resume=true", f"hydra.run.dir={b}"],
                tmp_path)
    _ok(p)
    first, second = _steps(a), _steps(b)
    assert [r["step"] for r in first + second] == [0, 1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in first + second], _reference(4), rtol=1e-5)
    assert "resumed from step 2" in p.stdout
    assert sorted(os.listdir(ck)) == ["global_step2", "global_step4", "latest"]
    # the checkpoint already reached train.steps: a clear note, exit 0, nothing trained
    p = _launch(0, t + ["train.steps=4", "checkpoint.resume=true",
                        f"hydra.run.dir={tmp_path / 'c'}"], tmp_path)
    _ok(p)
    assert ("nothing to run: the checkpoint is at step 4 and train.steps=4; raise train.steps "
            "to train further") in p.stdout
    assert not (tmp_path / "c" / "metrics.jsonl").exists()


def test_bad_checkpoint_input_fails_on_every_rank(tmp_path):
    missing = tmp_path / "nothing-here"
    p = _launch(2, ["engine=torch", f"checkpoint.dir={missing}", "checkpoint.resume=true",
                    f"hydra.run.dir={tmp_path / 'a'}"], tmp_path, timeout=120)
    assert p.returncode != 0
    for r in (0, 1):
        assert (f"config error (rank {r}): checkpoint.resume=true but checkpoint.dir={missing} "
                f"does not exist: there is no checkpoint to continue from") in p.stderr, \
            p.stderr[-3000:]
    assert not missing.exists()
    # a bare launch's config error (exit code 2, "config error (rank 0): ..."): the refused
    # world size in test_deepspeed_zero1_resumes_under_the_same_layout_only; the checkpoint
    # section's own checks (checkpoint.every=-1, ...): tests/unit/app/runners/test_checkpoint.py
