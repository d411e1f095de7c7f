"""The checkpoint disk fills up while a job trains: the saves that fail cost a warning and a
retry, not the job (``app/runners/checkpoint.py``).

A real full disk: ``checkpoint.dir`` is on a small tmpfs mounted for the test, filled to the
last byte before the job starts. Event-driven: once metrics.jsonl shows a failed save, the test
frees the disk; the job goes on to its last step with no restart, every step's loss equal to
one process's, and ``latest`` on a complete checkpoint.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from malleus_ds.chaos.inject import fill
from malleus_ds.report.metrics import read_live
from tests.integration.test_checkpoint_cli import ARGS, TRAIN, _reference, _rows

#: its one job takes 20 s or more on 2 cores
pytestmark = pytest.mark.slow

STEPS = 12


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``where``; the reason when this machine cannot."""
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    return None if p.returncode == 0 else f"cannot mount a tmpfs: {p.stderr.strip()}"


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    why = _mount_tmpfs(disk, "16m")
    if why:
        pytest.skip(why)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_full_checkpoint_disk_costs_warnings_and_retries_not_the_job(small_disk, tmp_path):
    ck, run = small_disk / "ck", tmp_path / "run"
    filler = fill(small_disk)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, TRAIN, *ARGS, "nproc_per_node=2", "engine=malleus",
           "malleus.adaptive=false", f"train.steps={STEPS}", f"checkpoint.dir={ck}",
           "checkpoint.every=2", "checkpoint.keep=2", f"hydra.run.dir={run}"]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    freed_after = None
    deadline = time.monotonic() + 180
    try:
        while p.poll() is None and time.monotonic() < deadline and freed_after is None:
            failed = [r for r in read_live(run) if r.get("event") == "checkpoint_failed"]
            if failed:
                filler.unlink()                 # the disk has room again
                freed_after = failed[0]["step"]
            time.sleep(0.05)
        out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
    (tmp_path / "out.txt").write_text(out)
    assert freed_after is not None, out[-3000:]
    assert p.returncode == 0, out[-4000:]
    assert "[malleus_ds] warning: " in out and "No space left on device" in out, out[-3000:]
    rows = _rows(run)
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    np.testing.assert_allclose([r["loss"] for r in steps], _reference(STEPS), rtol=1e-5)
    assert not [r for r in rows if r.get("event") == "restart"]
    failed = [r for r in rows if r.get("event") == "checkpoint_failed"]
    assert failed and failed[0]["latest"] is None and failed[0]["then"].startswith(
        "training goes on; trying again after step"), failed
    saved = [r["step"] for r in rows if r.get("event") == "checkpoint"]
    assert saved and saved[-1] == STEPS, rows
    assert (ck / "latest").read_text() == f"global_step{STEPS}"
    # only committed folders stay: each failed save's half-written folder was removed
    left = sorted(d.name for d in ck.iterdir() if d.is_dir())
    assert all((ck / d / "run.json").is_file() for d in left), left
    assert "checkpoint saves that failed and were tried again" in out
