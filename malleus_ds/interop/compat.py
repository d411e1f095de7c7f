"""Small, documented adjustments to DeepSpeed internals (pinned to deepspeed ~= 0.19.8).

``skip_shm_comm_build()``: on the CPU accelerator, ``deepspeed.comm.torch.TorchBackend``
JIT-compiles a shared-memory all-reduce op (45-90 s of g++) that only DeepSpeed *inference*
uses (``inference_all_reduce``); training collectives go through torch.distributed. We skip
that build unless ``MALLEUS_BUILD_SHM_OP=1``. GPUs are unaffected (no such op is built there).

``load_weights_only(engine)``: DeepSpeed 0.19's ``TorchCheckpointEngine.load`` hard-codes
``torch.load`` with weights_only turned off and has no setting for it, so resuming a DeepSpeed
checkpoint could run code a shared file names. The files DeepSpeed writes for our engines (ZeRO
0-2, PipelineEngine, fp32/bf16; found with ``torch.serialization.get_unsafe_globals_in_checkpoint``)
are plain data except four small value classes: the ZeRO optimizer's ``loss_scaler``
(``LossScaler`` / ``DynamicLossScaler``: numbers in its ``__dict__``), ``ZeroStageEnum`` and
``fragment_address`` (a dataclass of two ints). The engine's checkpoint engine is swapped for one
that loads with ``weights_only=True``, those four allowed for that call only; anything else a
file names is refused (``safe_load.UnsafeFile``) before it is called.
"""
from __future__ import annotations

import contextlib
import functools
import os


#: the ds_config keys that fix the batch (DeepSpeed checks train = micro x accumulation x DP)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def batch_keys(micro_batch_size: int, micro_batches: int, replicas: int) -> dict[str, int]:
    """The ds_config batch fields for ``replicas`` data-parallel replicas that each run
    ``micro_batches`` micro-batches of ``micro_batch_size``: the one place they are written
    (stock DeepSpeed's whole-job config, MalleusEngine's per-pipeline base config with one
    replica, and the check that a user's JSON agrees with ``train.*``)."""
    return {"train_batch_size": micro_batch_size * micro_batches * replicas,
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": micro_batches}


def skip_shm_comm_build() -> None:
    if os.environ.get("MALLEUS_BUILD_SHM_OP") == "1":
        return
    import importlib

    # not `import deepspeed.comm.torch as m`: deepspeed.comm has an attribute `torch` (the real
    # torch package) that shadows the submodule in that form, so the patch would miss.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


def load_weights_only(engine) -> bool:
    """Make ``engine.load_checkpoint`` read files with ``weights_only=True`` (module doc).
    False when the engine uses another checkpoint engine (left as it is)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ce = getattr(engine, "checkpoint_engine", None)
    if type(ce) is not TorchCheckpointEngine:
        return False
    ce.__class__ = _weights_only_engine_class()
    return True


def load_deepspeed_file(path, map_location=None):
    """One file DeepSpeed wrote, as plain data plus DeepSpeed's four value classes (module doc);
    ``safe_load.UnsafeFile`` for anything else."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from ..files.safe_load import load_plain

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum,
                                           fragment_address]):
        return load_plain(path, "DeepSpeed checkpoint file", mmap=False,
                          map_location=map_location,
                          writer="DeepSpeed's own files name no other class")


@contextlib.contextmanager
def weights_only_loads():
    """While it is open, ``torch.load`` anywhere reads as :func:`load_deepspeed_file` does
    (plain data plus DeepSpeed's four value classes): DeepSpeed's universal-checkpoint loader
    calls ``torch.load(..., weights_only=False)`` itself, past its checkpoint engine."""
    import torch

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    orig = torch.load

    def load(f, *args, **kw):
        kw["weights_only"] = True
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum,
                                               fragment_address]):
            return orig(f, *args, **kw)

    torch.load = load
    try:
        yield
    finally:
        torch.load = orig


@functools.lru_cache(maxsize=1)
def _weights_only_engine_class():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyTorchCheckpointEngine(TorchCheckpointEngine):
        """TorchCheckpointEngine whose ``load`` unpickles plain data only (and DeepSpeed's four
        value classes)."""

        def load(self, path: str, map_location=None):
            return load_deepspeed_file(path, map_location)

    return WeightsOnlyTorchCheckpointEngine


def init_deepspeed_comm() -> None:
    """Let DeepSpeed's comm layer wrap an existing torch.distributed world (or start one)."""
    import deepspeed.comm as dscomm
    import torch.distributed as tdist

    skip_shm_comm_build()
    if tdist.is_initialized():
        dscomm.init_distributed(dist_backend=tdist.get_backend(), dist_init_required=False)
    else:
        dscomm.init_distributed()
