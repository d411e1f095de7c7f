"""Shared by the GPU tests (no tests here): run the training app on CUDA via torchrun and read
back its per-step losses; and the single-process reference they are compared with."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[2] / "launch" / "train.py")


def run_app_on_cuda(out: Path, nproc: int, overrides: list[str]) -> list[float]:
    """``torchrun --nproc_per_node nproc launch/train.py device=cuda train.steps=5 ...``; the
    losses from ``out/metrics.jsonl``."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RANK", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", TRAIN, "device=cuda", "train.steps=5",
                        "progress=false", f"hydra.run.dir={out}", *overrides],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "event" not in r]


def reference_losses() -> list[float]:
    """The app's defaults (model=tiny, global batch 8, micro-batch 1, seed 0) on one process."""
    from malleus_ds.models import model_config
    from malleus_ds.app.reference import reference_run
    ref, _ = reference_run(model_config("tiny"), seed=0, steps=5, global_batch_size=8,
                           micro_batch_size=1)
    return ref
