"""launch/train.py with real processes: a multirun inside a launcher is refused, and the spawning
app validates before it starts ranks."""
from __future__ import annotations

from pathlib import Path


TRAIN = Path(__file__).resolve().parents[2] / "launch" / "train.py"


def test_multirun_inside_a_launcher_is_refused():
    import os
    import subprocess
    import sys

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    p = subprocess.run([sys.executable, str(TRAIN), "--multirun", "train.steps=1"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--multirun inside torchrun/deepspeed is not supported" in p.stderr


def test_spawning_app_validates_before_starting_ranks(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    p = subprocess.run([sys.executable, str(TRAIN), "nproc_per_node=2", "engine=deepspeed",
                        "parallel.tp=2", f"hydra.run.dir={tmp_path}"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "config error: engine=deepspeed: parallel.tp=2 is not supported" in p.stderr
    assert "launching" not in p.stdout                      # no rank was started
