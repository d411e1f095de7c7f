"""GPU path of the app (skipped without CUDA): torchrun + NCCL + engine=deepspeed on cuda gives
the reference losses (looser tolerance: GPU kernels sum in a different order)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.gpu_app import reference_losses, run_app_on_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("extra", [[], ["parallel.pp=2"]], ids=["zero1", "pipe"])
def test_deepspeed_on_gpu_matches_reference(tmp_path, extra):
    n = min(2, torch.cuda.device_count())
    if "parallel.pp=2" in extra and n < 2:
        pytest.skip("pp=2 needs 2 GPUs")
    got = run_app_on_cuda(tmp_path / "run", n, ["engine=deepspeed", *extra])
    np.testing.assert_allclose(got, reference_losses(), rtol=1e-4)
