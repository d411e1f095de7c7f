"""Small, documented adjustments to DeepSpeed internals (pinned to deepspeed ~= 0.19.8).

``skip_shm_comm_build()``: on the CPU accelerator, ``deepspeed.comm.torch.TorchBackend``
JIT-compiles a shared-memory all-reduce op (45-90 s of g++) that only DeepSpeed *inference*
uses (``inference_all_reduce``); training collectives go through torch.distributed. We skip
that build unless ``MALLEUS_BUILD_SHM_OP=1``. GPUs are unaffected (no such op is built there).
"""
from __future__ import annotations

import os


def skip_shm_comm_build() -> None:
    if os.environ.get("MALLEUS_BUILD_SHM_OP") == "1":
        return
    import importlib

    # not `import deepspeed.comm.torch as m`: deepspeed.comm has an attribute `torch` (the real
    # torch package) that shadows the submodule in that form, so the patch would miss.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None
