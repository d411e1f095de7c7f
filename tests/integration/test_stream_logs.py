"""Logs that stream (app/runners/stream.py) from a real 2-rank job whose stdout is a pipe (no
terminal): progress lines on stdout and in train.log as the run goes, throughput / step time /
per-rank compute in the ds_config's DeepSpeed monitor; a monitor without its package is a config
error at start-up.

The engine=deepspeed job (a PipelineEngine, pp=2) is started by the ``deepspeed`` launcher on CPU
(``deepspeed --num_gpus 2 launch/train.py``, as docs/getting-started.md says it runs): it writes
its metrics and no folder but its run folder; the engine=malleus job by torchrun."""
import csv
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
LINE = re.compile(r"^\[malleus_ds\] step (\d+)/6 loss \d+\.\d{4} \| \d+\.\d samples/s \| "
                  r"step \d+\.\d{3} s \| slowest rank [01] \(compute \d+\.\d{3} s\)$")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["deepspeed", "malleus"])
def test_progress_lines_stream_to_stdout_and_train_log_and_monitor_gets_throughput(tmp_path,
                                                                                   engine):
    out = tmp_path / "run"
    if engine == "deepspeed":       # the deepspeed launcher (its CPU launch), a PipelineEngine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2",
                  "--master_port", str(port), TRAIN, "parallel.pp=2"]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node=2", TRAIN]
    cmd = launch + ["model=tiny", "model.max_seq_len=16", f"engine={engine}", "train.steps=6",
                    "log_every=2", "progress=false", f"hydra.run.dir={out}",
                    "+deepspeed.config.csv_monitor={enabled:true,job_name:mon}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    assert sorted(os.listdir(tmp_path)) == ["run"]            # no per-rank folders
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 6, metrics
    lines = [x for x in p.stdout.splitlines() if x.startswith("[malleus_ds] step ")]
    assert [LINE.match(x).group(1) for x in lines] == ["2", "4", "6"], p.stdout
    # before the end-of-run summary, not with it
    assert p.stdout.index(lines[-1]) < p.stdout.index("== malleus_ds run:")
    # start-up: a line when building starts, one when training starts (and in train.log)
    ready = [x for x in p.stdout.splitlines() if x.startswith("[malleus_ds] ready after ")]
    building = f"[malleus_ds] building engine={engine} model=tiny on 2 rank(s)"
    assert len(ready) == 1 and ready[0].endswith("; training steps 1-6"), p.stdout
    assert p.stdout.index(building) < p.stdout.index(ready[0]) < p.stdout.index(lines[0])
    log = (out / "train.log").read_text().splitlines()
    assert [x.split(" - ", 1)[1] for x in log if "[malleus_ds.progress]" in x] == ready + lines
    mon = out / "mon"
    for tag, rows in (("samples_per_s", 6), ("step_time_s", 6), ("compute_s_rank0", 6),
                      ("compute_s_rank1", 6), ("train_loss", 6)):
        with open(mon / f"Train_Samples_{tag}.csv") as f:
            got = list(csv.reader(f))
        assert got[0] == ["step", tag] and len(got) == rows + 1, (tag, got)
        assert [int(r[0]) for r in got[1:]] == [8 * k for k in range(1, 7)], tag
        assert all(float(r[1]) > 0 for r in got[1:]), (tag, got)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_monitor_without_its_package_is_a_config_error_at_start_up(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, TRAIN, "model=tiny", "engine=deepspeed", "nproc_per_node=2",
           f"hydra.run.dir={out}", "+deepspeed.config.wandb={enabled:true}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    assert ("config error: ds_config wandb.enabled=true needs the 'wandb' package: "
            "pip install wandb (or set wandb.enabled=false)") in p.stderr
    assert "launching" not in p.stdout          # no rank was started
