"""GPU path of the app (skipped without CUDA): torchrun + NCCL + engine=deepspeed on cuda gives
the reference losses (looser tolerance: GPU kernels sum in a different order)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TRAIN = str(Path(__file__).resolve().parents[2] / "launch" / "train.py")


@pytest.mark.parametrize("extra", [[], ["parallel.pp=2"]], ids=["zero1", "pipe"])
def test_deepspeed_on_gpu_matches_reference(tmp_path, extra):
    n = min(2, torch.cuda.device_count())
    if "parallel.pp=2" in extra and n < 2:
        pytest.skip("pp=2 needs 2 GPUs")
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RANK", "LOCAL_RANK")}
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={n}", TRAIN, "engine=deepspeed", "device=cuda",
                        "train.steps=5", "progress=false", f"hydra.run.dir={out}", *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    from malleus_ds.models import model_config
    from malleus_ds.reference import reference_run
    ref, _ = reference_run(model_config("tiny"), seed=0, steps=5, global_batch_size=8,
                           micro_batch_size=1)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
