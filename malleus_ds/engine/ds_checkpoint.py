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
tensors by DeepSpeed's parameter name. :func:`ds_import.write_malleus` writes them as a
MalleusEngine checkpoint of a one-rank plan (``engine/checkpoint.py``'s format), which the
engine's loader then reads under whatever plan is running, as it reads its own: the weights,
the moments, Adam's step, the counters, the LR schedule and the optimizer's hyper-parameters.

Every file is read with ``torch.load(weights_only=True)`` plus DeepSpeed's four value classes
(``ds_compat.load_deepspeed_file``): loading never runs code. A folder that is not a DeepSpeed
checkpoint, a missing or truncated optimizer file, partitions that do not add up to the
recorded shapes, and a model whose names or shapes differ are each refused with a
:class:`~malleus_ds.files.ckpt_format.CheckpointError` naming the file and what to do.

Read: ZeRO 0, 1 and 2 with data parallelism, and PipelineEngine's folders of ZeRO-1 (each
layer's weights in ``layer_{i:02d}-model_states.pt``, each stage's ``param_shapes`` in
``mp_rank_{s:02d}_model_states.pt`` and its partitions in ``zero_pp_rank_{r}_mp_rank_{s:02d}``);
fp32 and bf16 runs (DeepSpeed's masters are fp32 either way); and universal checkpoint folders
(``ds_to_universal``'s, ``zero/<name>/*.pt``). Not yet: tensor-parallel saves (refused by
name).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Mapping

import torch

from ..files.ckpt_format import CheckpointError

MODEL_FILE = "mp_rank_00_model_states.pt"
#: the optimizer hyper-parameters carried into the continued run
_HYPER = ("lr", "betas", "eps", "weight_decay", "initial_lr")


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as full fp32 tensors by DeepSpeed's parameter name."""

    tag_dir: Path
    zero_stage: int
    dp: int
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    adam_step: int
    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict | None
    param_groups: list[dict] = field(default_factory=list)
    pipeline_stages: int = 1         # PipelineEngine's stages (1: no pipeline)
    loss_scaler: dict | None = None  # fp16: the scaler's state (precision.scaler_state's keys)


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


def _load(f: Path) -> dict:
    from ..files.safe_load import UnsafeFile
    from .ds_compat import load_deepspeed_file

    try:
        d = load_deepspeed_file(f, "cpu")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{f}: holds a {type(d).__name__}, not DeepSpeed's dict")
    return d


def _int(v, default: int = 0) -> int:
    if isinstance(v, torch.Tensor):
        return int(v.item())
    return default if v is None else int(v)


_LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


def _stage_file(s: int) -> str:
    return f"mp_rank_{s:02d}_model_states.pt"


def read_state(path, tag: str | None = None) -> DeepSpeedState:
    """A DeepSpeed checkpoint (root or tag folder) as full fp32 tensors (module doc)."""
    d = tag_folder(path, tag)
    ms = _load(d / MODEL_FILE)
    if (d / "zero" / "optimizer_state.pt").is_file():
        return _read_universal(d, ms)
    layers = sorted((int(m.group(1)), d / m.group(0)) for m in
                    (_LAYER_FILE.match(f.name) for f in d.iterdir()) if m)
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
            for k, v in _load(f).items():
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
    stage = _int((cfg.get("zero_optimization") or {}).get("stage"),
                 1 if zero_files[0] else 0)
    dp = _int(ms.get("dp_world_size"), max(1, len(zero_files[0])))
    common = dict(tag_dir=d, dp=dp, global_steps=_int(ms.get("global_steps")),
                  global_samples=_int(ms.get("global_samples")),
                  skipped_steps=_int(ms.get("skipped_steps")),
                  lr_scheduler=ms.get("lr_scheduler") or None)
    if stage == 0:
        if layers:
            raise CheckpointError(f"{d}: a PipelineEngine checkpoint without ZeRO (its optimizer "
                                  f"state per stage has no parameter names); malleus_ds reads "
                                  f"PipelineEngine checkpoints of ZeRO-1")
        return _read_stage0(d, ms, weights, common)
    if stage > 2:
        raise CheckpointError(f"{d}: a ZeRO-{stage} checkpoint; malleus_ds reads ZeRO 0, 1 and "
                              f"2 (ZeRO-3 shards the weights themselves)")
    out = None
    for s_ in range(stages):
        f = d / _stage_file(s_)
        if not f.is_file():
            raise CheckpointError(f"{d}: a checkpoint of {stages} pipeline stages lacks "
                                  f"{f.name}: a partial save (copy the whole folder)")
        part = _read_zero(d, ms if s_ == 0 else _load(f), weights, zero_files[s_], stage,
                          common)
        if out is None:
            out = part
        else:
            out.params.update(part.params)
            out.exp_avg.update(part.exp_avg)
            out.exp_avg_sq.update(part.exp_avg_sq)
    out.pipeline_stages = stages
    return out


def _read_universal(d: Path, ms: dict) -> DeepSpeedState:
    """A universal checkpoint (``ds_to_universal``'s output, or ``malleus-export --to
    deepspeed-universal``'s): each parameter's full fp32 weight and Adam moments in
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` (``{"param": tensor}``) and its step in
    ``step.pt``; the optimizer's hyper-parameters in ``zero/optimizer_state.pt``."""
    z = d / "zero"
    params, m1, m2, steps = {}, {}, {}, set()
    for sub in sorted(x for x in z.iterdir() if x.is_dir()):
        if not (sub / "fp32.pt").is_file():
            raise CheckpointError(f"{sub}: no fp32.pt (a universal checkpoint's parameter "
                                  f"folder holds fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt)")
        params[sub.name] = _param(sub / "fp32.pt")
        if (sub / "exp_avg.pt").is_file() and (sub / "exp_avg_sq.pt").is_file():
            m1[sub.name] = _param(sub / "exp_avg.pt").reshape(params[sub.name].shape)
            m2[sub.name] = _param(sub / "exp_avg_sq.pt").reshape(params[sub.name].shape)
        if (sub / "step.pt").is_file():
            steps.add(_int(_load_any(sub / "step.pt")))
    if not params:
        raise CheckpointError(f"{z}: no parameter folders: not a universal checkpoint")
    if m1 and len(m1) != len(params):
        raise CheckpointError(f"{z}: Adam's moments for {len(m1)} of {len(params)} parameters: "
                              f"a partial conversion")
    opt = _load(z / "optimizer_state.pt")
    return DeepSpeedState(tag_dir=d, zero_stage=_int((ms.get("ds_config") or {}).get(
        "zero_optimization", {}).get("stage"), 1), dp=_int(ms.get("dp_world_size"), 1),
        params=params, exp_avg=m1, exp_avg_sq=m2, adam_step=max(steps) if steps else 0,
        global_steps=_int(ms.get("global_steps")), global_samples=_int(ms.get("global_samples")),
        skipped_steps=_int(ms.get("skipped_steps")), lr_scheduler=ms.get("lr_scheduler") or None,
        param_groups=_hyper(opt.get("param_groups")))


def _load_any(f: Path):
    from ..files.safe_load import UnsafeFile
    from .ds_compat import load_deepspeed_file

    try:
        return load_deepspeed_file(f, "cpu")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None


def _param(f: Path) -> torch.Tensor:
    x = _load_any(f)
    t = x.get("param") if isinstance(x, dict) else None
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{f}: no 'param' tensor (not a universal checkpoint file)")
    return t.float()


def _read_stage0(d: Path, ms: dict, weights: Mapping, common: dict) -> DeepSpeedState:
    """Without ZeRO: the weights from the module and Adam's state from the optimizer's own
    ``state_dict``, whose parameter indices follow the module's parameters (a tied parameter
    once)."""
    opt = ms.get("optimizer")
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping):
        raise CheckpointError(f"{d / MODEL_FILE}: no optimizer state (saved without it? DeepSpeed "
                              f"writes it unless save_checkpoint(..., exclude_frozen_parameters) "
                              f"or a client optimizer without state_dict); a checkpoint to "
                              f"continue needs Adam's state")
    names, seen = [], {}
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen[key] = k
            names.append(k)
    order = [i for g in opt.get("param_groups") or () for i in g.get("params", ())]
    if len(order) != len(names):
        raise CheckpointError(f"{d / MODEL_FILE}: the optimizer holds {len(order)} parameters, "
                              f"the module {len(names)}: not one model's checkpoint")
    exp_avg, exp_avg_sq, steps = {}, {}, set()
    for i, name in zip(order, names):
        st = opt["state"].get(i) or opt["state"].get(str(i)) or {}
        if "exp_avg" not in st:
            continue                             # never stepped (step 0): fresh moments
        exp_avg[name] = st["exp_avg"].float().reshape(weights[name].shape)
        exp_avg_sq[name] = st["exp_avg_sq"].float().reshape(weights[name].shape)
        steps.add(_int(st.get("step")))
    return DeepSpeedState(zero_stage=0, params={n: weights[n].float() for n in names},
                          exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                          adam_step=max(steps) if steps else 0,
                          param_groups=_hyper(opt.get("param_groups")), **common)


def _hyper(groups) -> list[dict]:
    return [{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k in _HYPER}
            for g in groups or ()]


def _read_zero(d: Path, ms: dict, weights: Mapping, zero_files: list, stage: int,
               common: dict) -> DeepSpeedState:
    dp = common["dp"]
    ranks = [r for r, _ in zero_files]
    if ranks != list(range(dp)):
        missing = sorted(set(range(dp)) - set(ranks))
        raise CheckpointError(f"{d}: a ZeRO-{stage} checkpoint of {dp} data-parallel ranks lacks "
                              f"the optimizer file(s) of rank(s) {missing or ranks}: a partial "
                              f"save (copy the whole folder)")
    shapes = ms.get("param_shapes")
    if not isinstance(shapes, (list, tuple)) or not shapes:
        raise CheckpointError(f"{d / MODEL_FILE}: no param_shapes: not a ZeRO checkpoint "
                              f"DeepSpeed 0.9+ wrote")
    parts = []
    for r, f in zero_files:
        osd = _load(f).get("optimizer_state_dict")
        if not isinstance(osd, Mapping) or "single_partition_of_fp32_groups" not in osd:
            raise CheckpointError(f"{f}: no optimizer_state_dict with fp32 partitions (not a "
                                  f"ZeRO-1/2 optimizer file)")
        parts.append(osd)
    base = [p.get("base_optimizer_state") for p in parts]
    if any(not isinstance(b, Mapping) or "state" not in b for b in base):
        raise CheckpointError(f"{d}: an optimizer file has no base_optimizer_state (saved with "
                              f"elastic_checkpoint, which malleus_ds does not read)")
    params, exp_avg, exp_avg_sq, steps = {}, {}, {}, set()
    for g, group_shapes in enumerate(shapes):
        fp32, m1, m2 = [], [], []
        for r, (osd, b) in enumerate(zip(parts, base)):
            part = osd["single_partition_of_fp32_groups"][g]
            st = b["state"].get(g) or b["state"].get(str(g)) or {}
            n = part.numel()
            fp32.append(part.float().reshape(-1))
            if "exp_avg" in st:
                m1.append(st["exp_avg"].float().reshape(-1)[:n])
                m2.append(st["exp_avg_sq"].float().reshape(-1)[:n])
                steps.add(_int(st.get("step")))
        flat = torch.cat(fp32)
        mom = (torch.cat(m1), torch.cat(m2)) if len(m1) == len(parts) else None
        pads = (parts[0].get("param_alignment_paddings") or [None] * len(shapes))[g]
        off = 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            n = prod(shape)
            if off + n > flat.numel():
                raise CheckpointError(f"{d}: group {g}'s partitions hold {flat.numel()} elements, "
                                      f"fewer than its parameters need (at {name}): a partial or "
                                      f"mixed save")
            params[name] = flat[off:off + n].view(tuple(shape)).clone()
            if mom is not None:
                exp_avg[name] = mom[0][off:off + n].view(tuple(shape)).clone()
                exp_avg_sq[name] = mom[1][off:off + n].view(tuple(shape)).clone()
            off += n + (int(pads[i]) if pads else 0)
        if flat.numel() - off > 2 * dp:              # DeepSpeed pads to 2 x dp at most
            raise CheckpointError(f"{d}: group {g}'s partitions hold {flat.numel()} elements, "
                                  f"its parameters {off}: files of another save mixed in")
    for name in params:
        if name in weights and tuple(weights[name].shape) != tuple(params[name].shape):
            raise CheckpointError(f"{d}: {name} is {tuple(params[name].shape)} in the optimizer "
                                  f"files and {tuple(weights[name].shape)} in the module")
    from .precision import scaler_state

    scaler = parts[0].get("loss_scaler")
    return DeepSpeedState(zero_stage=stage, params=params, exp_avg=exp_avg,
                          exp_avg_sq=exp_avg_sq, adam_step=max(steps) if steps else 0,
                          param_groups=_hyper(base[0].get("param_groups")),
                          loss_scaler=scaler_state(scaler) if scaler is not None else None,
                          **common)
