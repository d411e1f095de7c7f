"""A job never hangs silently and never loses its output (launch/train.py, app/runners/guard.py,
watchdog.py): a frozen rank is named and stops the job; SIGTERM stops every rank cleanly, with
a checkpoint that resumes to the same losses; concurrent runs get their own folders."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from malleus_ds.resilience.procs import descendants, is_running, rank_pid

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
TINY = ["model=tiny", "model.max_seq_len=16", "progress=false"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "MALLEUS_DS_WRAPPED"):
        env.pop(k, None)
    return env


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _wait(cond, timeout, what):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _rank_pid(root: int, rank: int) -> int:
    pid = rank_pid(root, rank)
    assert pid is not None, f"no process of rank {rank} under {root}"
    return pid


def _sigterm_after_three_steps(cmd, out: Path, cwd: Path):
    """Start ``cmd``, SIGTERM it once three steps are in ``out``/metrics.jsonl; returns (the
    process, its stderr, seconds from the signal to its exit, the job's pids at the signal)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: len(_lines(out / "metrics.jsonl")) >= 3, 120, "three steps")
        procs = descendants(p.pid)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        return p, err, time.monotonic() - t0, procs
    finally:
        if p.poll() is None:
            for pid in descendants(p.pid):
                os.kill(pid, signal.SIGKILL)
            p.kill()


def _assert_all_gone(procs) -> None:
    left = [pid for pid in procs if Path(f"/proc/{pid}").exists()
            and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
    assert not left, f"processes of the job still running: {left}"


def test_a_frozen_rank_is_named_and_the_job_exits_within_the_bound_under_load(tmp_path):
    """SIGSTOP one of two ranks on a loaded machine (two busy processes on the 2 cores): the live
    rank names it and exits within ``hang_timeout_s + 30 s``; so does the whole job, with no one
    killing the frozen process by hand (a peer on its host does: the launcher's SIGTERM cannot
    reach a stopped process, and torchrun would wait 30 s before its own SIGKILL)."""
    hang = 6
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           TRAIN, *TINY, "engine=malleus", "malleus.adaptive=false", "train.steps=100000",
           f"hang_timeout_s={hang}", f"hydra.run.dir={out}"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        _wait(lambda: len(_lines(out / "metrics.jsonl")) >= 3, 180, "three steps")
        victim, live = _rank_pid(p.pid, 1), _rank_pid(p.pid, 0)
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        _wait(lambda: not is_running(live), hang + 30, "the live rank to exit")
        _, err = p.communicate(timeout=hang + 30 - (time.monotonic() - t0) + 5)
        took = time.monotonic() - t0
    finally:
        for h in hogs:
            h.kill()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            for pid in descendants(p.pid):
                os.kill(pid, signal.SIGKILL)
            p.kill()
    assert took <= hang + 30, f"the job ended {took:.1f} s after the freeze (bound {hang + 30})"
    assert p.returncode != 0
    ev = next(e for e in _lines(out / "metrics.jsonl") if e.get("event") == "hang")
    assert [s["rank"] for s in ev["stuck"]] == [1], ev
    assert "rank 0: hang: rank 1 in step" in err and "hang_timeout_s" in err, err[-3000:]
    assert "killed frozen rank 1" in err, err[-3000:]


@pytest.mark.slow
def test_sigterm_to_the_wrapper_checkpoints_stops_every_rank_and_resumes(tmp_path):
    out, ck = tmp_path / "run", tmp_path / "ck"
    base = [sys.executable, TRAIN, *TINY, "nproc_per_node=2", "engine=malleus",
            "malleus.adaptive=false", f"checkpoint.dir={ck}"]
    p, err, took, procs = _sigterm_after_three_steps(
        base + ["train.steps=100000", f"hydra.run.dir={out}"], out, tmp_path)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 10, f"the job took {took:.1f} s to stop (checkpoint included)"
    time.sleep(0.5)
    _assert_all_gone(procs)
    rows = _lines(out / "metrics.jsonl")            # every line parses
    steps = [r for r in rows if "event" not in r]
    assert "stopped by SIGTERM after step" in err and "Traceback" not in err, err[-3000:]
    assert err.count("\n") < 15, err
    n = len(steps)
    assert (ck / "latest").read_text().strip() == f"global_step{n}"
    # resume for two more steps: the same losses as one process straight through
    r = subprocess.run(base + [f"train.steps={n + 2}", "checkpoint.resume=true",
                               f"hydra.run.dir={tmp_path / 'resumed'}"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    from malleus_ds.models import model_config
    from malleus_ds.app.reference import reference_run

    ref, _ = reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=n + 2,
                           global_batch_size=8, micro_batch_size=1)
    resumed = [x["loss"] for x in _lines(tmp_path / "resumed" / "metrics.jsonl") if "event" not in x]
    assert len(resumed) == 2
    np.testing.assert_allclose([x["loss"] for x in steps] + resumed, ref, rtol=1e-5)


def test_two_runs_started_at_once_get_their_own_folders(tmp_path):
    cmd = [sys.executable, TRAIN, *TINY, "train.steps=3"]
    ps = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in ps:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    files = sorted((tmp_path / "outputs").glob("*/*/metrics.jsonl"))
    assert len(files) == 2, files
    for f in files:
        assert [r["step"] for r in _lines(f)] == [0, 1, 2]


def test_sigterm_to_torchrun_stops_every_rank(tmp_path):
    """As SLURM or Kubernetes would: SIGTERM to the launcher itself (engine=deepspeed here)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           TRAIN, *TINY, "engine=deepspeed", "train.steps=100000", f"hydra.run.dir={out}"]
    p, err, took, procs = _sigterm_after_three_steps(cmd, out, tmp_path)
    assert p.returncode != 0 and took < 10, (p.returncode, took)
    _assert_all_gone(procs)
    rows = _lines(out / "metrics.jsonl")                # every line parses
    assert len([r for r in rows if "event" not in r]) >= 3
    assert "stopped by SIGTERM after step" in err, err[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_the_launcher_only(cmd, out: Path, cwd: Path, sig: int):
    """Start ``cmd`` (a launcher), and once three steps are in metrics.jsonl send ``sig`` to the
    launcher process alone, as ``kill`` does. Returns (its output, seconds until no process of
    the job is left, the job's pids at the signal)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait(lambda: len(_lines(out / "metrics.jsonl")) >= 3, 120, "three steps")
        procs = descendants(p.pid)
        assert len(procs) >= 2, procs
        os.kill(p.pid, sig)
        took = _wait(lambda: not any(is_running(q) for q in procs), 60,
                     "every process of the job to exit")
        text, _ = p.communicate(timeout=30)
        return text, took, procs
    finally:
        for pid in descendants(p.pid) + [p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def _assert_stopped_cleanly(text: str, out: Path, ck: Path | None) -> None:
    rows = _lines(out / "metrics.jsonl")                # every line parses
    steps = [r["step"] for r in rows if "event" not in r]
    assert steps == list(range(len(steps))) and len(steps) >= 3, steps
    assert f"stopped after step {len(steps)}: the launcher exited without stopping the ranks" \
        in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    if ck is not None:       # every rank saved the same step: rank 0 commits only after all did
        assert (ck / "latest").read_text().strip() == f"global_step{len(steps)}"
        assert (ck / f"global_step{len(steps)}" / "run.json").is_file()


def test_sigterm_to_the_deepspeed_runner_stops_every_rank(tmp_path):
    """``kill -TERM <pid of deepspeed>``: DeepSpeed's runner dies without passing the signal on
    to deepspeed.launcher.launch; the ranks notice their launcher is gone and stop as for SIGTERM:
    the same step everywhere, a checkpoint, metrics closed, one line, nothing left after 10 s."""
    out, ck = tmp_path / "run", tmp_path / "ck"
    ds = str(Path(sys.executable).parent / "deepspeed")
    cmd = [ds, "--num_gpus", "2", "--master_port", str(_free_port()), TRAIN, *TINY,
           "engine=malleus", "malleus.adaptive=false", "train.steps=100000",
           f"checkpoint.dir={ck}", f"hydra.run.dir={out}"]
    text, took, procs = _stop_the_launcher_only(cmd, out, tmp_path, signal.SIGTERM)
    assert took < 10, f"the job's processes took {took:.1f} s to exit"
    _assert_stopped_cleanly(text, out, ck)


def test_a_killed_torchrun_agent_does_not_leave_its_ranks_running(tmp_path):
    """``kill -9`` of the launcher (torchrun's agent here): nobody can pass anything on."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           TRAIN, *TINY, "engine=deepspeed", "train.steps=100000", f"hydra.run.dir={out}"]
    text, took, procs = _stop_the_launcher_only(cmd, out, tmp_path, signal.SIGKILL)
    assert took < 10, f"the job's processes took {took:.1f} s to exit"
    _assert_stopped_cleanly(text, out, None)
