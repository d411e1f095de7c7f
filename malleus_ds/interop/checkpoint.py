"""Continue from a checkpoint that stock DeepSpeed wrote, under any plan and world size.

DeepSpeed's files (``deepspeed/runtime/engine.py``, ``_save_checkpoint`` and
``_save_zero_checkpoint``) hold, in one tag folder:

* ``mp_rank_00_model_states.pt``: the module's weights (``module``), the engine's counters
  (``global_steps``, ``global_samples``, ``skipped_steps``), the LR scheduler's state, the
  data-parallel degree, ``param_shapes`` (ZeRO: the parameters of each optimizer group in
  order, the layout of its flat buffer) and, without ZeRO, the optimizer's own
  ``state_dict`` (``optimizer``);
* under ZeRO-1/2, one ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank:
  its partition of each group's flat fp32 master (``single_partition_of_fp32_groups``, the
  padding already cut off) and the base optimizer's state of the same partition (Adam's
  ``exp_avg`` / ``exp_avg_sq``, padded like the partition: ``group_paddings``).

:func:`read_state` puts each group's partitions back together and cuts them by
``param_shapes`` (with ``param_alignment_paddings`` where DeepSpeed recorded them), as
DeepSpeed's own ``zero_to_fp32`` does for the weights, here for the Adam moments too: full fp32
tensors by DeepSpeed's parameter name. :func:`checkpoint_import.write_malleus` writes them as a
MalleusEngine checkpoint of a one-rank plan (``engine/checkpoint.py``'s format), which the
engine's loader then reads under whatever plan is running, as it reads its own: the weights,
the moments, Adam's step, the counters, the LR schedule and the optimizer's hyper-parameters.

Every file is read with ``torch.load(weights_only=True)`` plus DeepSpeed's four value classes
(``compat.load_deepspeed_file``): loading never runs code. A folder that is not a DeepSpeed
checkpoint, a missing or truncated optimizer file, partitions that do not add up to the
recorded shapes, and a model whose names or shapes differ are each refused with a
:class:`~malleus_ds.files.ckpt_format.CheckpointError` naming the file and what to do.

Read: ZeRO 0, 1 and 2 with data parallelism, in fp32, fp16 and bf16 (``checkpoint_zero``: ZeRO's
partitions; ``checkpoint_plain``: without ZeRO, the torch optimizer's state, FP16_UnfusedOptimizer's
and FP16_Optimizer's masters, with DeepSpeed's fp16 gradient units undone); PipelineEngine's
folders (each layer's weights in ``layer_{i:02d}-model_states.pt``; each stage's optimizer in
``mp_rank_{s:02d}_model_states.pt``, or under ZeRO-1 its ``param_shapes`` there and its
partitions in ``zero_pp_rank_{r}_mp_rank_{s:02d}``, or in bf16 without ZeRO BF16_Optimizer's
partitions, named by their ``param_slice_mappings``); and universal checkpoint folders
(``ds_to_universal``'s, ``zero/<name>/*.pt``: ``checkpoint_universal``). Not yet: tensor-parallel
(Megatron) saves, refused by name.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from ..files.ckpt_format import CheckpointError
from .checkpoint_files import (LAYER_FILE, MODEL_FILE, DeepSpeedState, as_int, load,
                            stage_file)
from .checkpoint_plain import read_pipeline_stage0, read_stage0
from .checkpoint_universal import read_universal
from .checkpoint_zero import read_zero

__all__ = ["DeepSpeedState", "MODEL_FILE", "is_deepspeed_checkpoint", "read_state",
           "read_steps", "tag_folder"]


def is_deepspeed_checkpoint(path) -> bool:
    """Is ``path`` a DeepSpeed checkpoint root (a ``latest`` naming a tag folder with
    :data:`MODEL_FILE`) or tag folder?"""
    p = Path(path)
    if (p / MODEL_FILE).is_file() or any(p.glob("layer_*-model_states.pt")):
        return True
    for name in ("latest", "latest_universal"):
        latest = p / name
        if latest.is_file():
            try:
                tag = latest.read_text(errors="replace").strip()[:256]
            except OSError:
                return False
            if (p / tag / MODEL_FILE).is_file() or any((p / tag).glob("layer_*-model_states.pt")):
                return True
    return False


def tag_folder(path, tag: str | None = None) -> Path:
    """The tag folder of a DeepSpeed checkpoint root (``tag``, else its ``latest``) or the
    folder itself when it is one."""
    from ..files.safe_load import UnsafeFile, read_small_text

    p = Path(path)
    if tag is not None:
        p = p / str(tag)
    elif not (p / MODEL_FILE).is_file():
        for latest in ("latest", "latest_universal"):
            if (p / latest).is_file():
                try:
                    p = p / read_small_text(p / latest, f"DeepSpeed '{latest}' file").strip()
                except UnsafeFile as e:
                    raise CheckpointError(str(e)) from None
                break
    if not (p / MODEL_FILE).is_file():
        raise CheckpointError(f"{p} is not a DeepSpeed checkpoint: it has no {MODEL_FILE} (a "
                              f"folder deepspeed's save_checkpoint wrote, or its root with a "
                              f"'latest' file)")
    return p



def read_steps(path, tag: str | None = None) -> int:
    """The optimizer steps a DeepSpeed checkpoint (root or tag folder) was saved after."""
    d = tag_folder(path, tag)
    return as_int(load(d / MODEL_FILE).get("global_steps"))


def read_state(path, tag: str | None = None) -> DeepSpeedState:
    """A DeepSpeed checkpoint (root or tag folder) as full fp32 tensors (module doc)."""
    d = tag_folder(path, tag)
    ms = load(d / MODEL_FILE)
    if (d / "zero" / "optimizer_state.pt").is_file():
        return read_universal(d, ms)
    layers = sorted((int(m.group(1)), d / m.group(0)) for m in
                    (LAYER_FILE.match(f.name) for f in d.iterdir()) if m)
    mp = int(ms.get("mp_world_size") or 1)
    dims = ms.get("checkpoint_parallel_dimensions") or {}
    tp = int(dims.get("tensor_parallel", dims.get("tp", 1)) or 1) if layers else mp
    if tp != 1:
        raise CheckpointError(f"{d / MODEL_FILE}: saved with tensor parallelism ({tp}), which "
                              f"malleus_ds does not read yet")
    stages = mp if layers else 1
    if layers:              # PipelineEngine: each layer's weights in a file of its own
        weights = {}
        for i, f in layers:
            for k, v in load(f).items():
                weights[f"{i}.{k}"] = v
    else:
        module = ms.get("module")
        if not isinstance(module, Mapping):
            raise CheckpointError(f"{d / MODEL_FILE}: no 'module' state dict (not a DeepSpeed "
                                  f"model-states file)")
        buffers = set(ms.get("buffer_names") or ())
        weights = {k: v for k, v in module.items() if k not in buffers}
    cfg = ms.get("ds_config") if isinstance(ms.get("ds_config"), Mapping) else {}
    zero_files = {s_: sorted((int(m.group(1)), d / m.group(0)) for m in
                             (re.match(rf"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_{s_:02d}_"
                                       rf"optim_states\.pt$", f.name) for f in d.iterdir()) if m)
                  for s_ in range(stages)}
    stage = as_int((cfg.get("zero_optimization") or {}).get("stage"),
                   1 if zero_files[0] else 0)
    dp = as_int(ms.get("dp_world_size"), max(1, len(zero_files[0])))
    common = dict(tag_dir=d, dp=dp, global_steps=as_int(ms.get("global_steps")),
                  global_samples=as_int(ms.get("global_samples")),
                  skipped_steps=as_int(ms.get("skipped_steps")),
                  lr_scheduler=ms.get("lr_scheduler") or None)
    if stage == 0 and not zero_files[0]:
        if layers:
            return read_pipeline_stage0(d, ms, stages, weights, common)
        return read_stage0(d, d / MODEL_FILE, ms, weights, common)
    if stage > 2:
        raise CheckpointError(f"{d}: a ZeRO-{stage} checkpoint; malleus_ds reads ZeRO 0, 1 and "
                              f"2 (ZeRO-3 shards the weights themselves)")
    out = None
    for s_ in range(stages):
        f = d / stage_file(s_)
        if not f.is_file():
            raise CheckpointError(f"{d}: a checkpoint of {stages} pipeline stages lacks "
                                  f"{f.name}: a partial save (copy the whole folder)")
        part = read_zero(d, ms if s_ == 0 else load(f), weights, zero_files[s_], stage,
                         common)
        if out is None:
            out = part
        else:
            out.params.update(part.params)
            out.exp_avg.update(part.exp_avg)
            out.exp_avg_sq.update(part.exp_avg_sq)
    out.pipeline_stages = stages
    return out

