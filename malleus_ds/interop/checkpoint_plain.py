"""Folders without ZeRO: the weights from the module and Adam's state from the optimizer's own
``state_dict``, in one of three formats (``deepspeed/runtime/engine.py`` picks the wrapper):

* fp32: the torch optimizer's ``state_dict``; its parameter indices follow the module's
  parameters (a tied parameter once), checked by shape;
* fp16 or bf16 with a client or ``torch_adam`` optimizer: ``FP16_UnfusedOptimizer``'s, which adds
  the fp32 master of every parameter (``fp32_groups``, a list per group) and the loss scaler;
* fp16 with DeepSpeed's FusedAdam (the GPU default): ``FP16_Optimizer``'s, whose master is one
  flat fp32 tensor per group (``fp32_groups_flat``) and whose Adam state is flat the same way.

The fp16 formats name no parameter. Each master is matched to the module's parameter whose
half-precision weights it rounds to, trying the module's order first (DeepSpeed's groups
follow it unless the user grouped the parameters otherwise, as the Hugging Face Trainer does
for weight decay); a master that rounds to no parameter is refused.

**DeepSpeed's fp16 without ZeRO steps Adam on gradients divided by the loss scale.** Its
``engine.backward`` scales the loss only for ZeRO optimizers, while FP16_Optimizer's and
FP16_UnfusedOptimizer's ``step`` divide the gradients by ``cur_scale`` all the same (open
DeepSpeed PR #8393; measured here on 0.19.8: the moments are ``1/cur_scale`` of a bf16 run's).
Adam's moments in such a file are in those units: ``exp_avg`` is ``1/cur_scale`` and
``exp_avg_sq`` ``1/cur_scale**2`` of the true gradients'. Continued as they are, the first
steps would be up to ``cur_scale`` times too large, so the reader multiplies them back by the
current scale and says so (:attr:`DeepSpeedState.notes`). The continued run takes correctly
scaled steps from there; DeepSpeed itself would go on with ``eps`` in effect ``cur_scale``
times larger. Releases from :data:`FP16_STAGE0_FIXED_IN` on are read as they are.

PipelineEngine writes one such file per stage (``mp_rank_{s:02d}_model_states.pt``), holding the
stage's optimizer; the stage's parameters are the next ones in layer order
(:func:`read_pipeline_stage0`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from ..files.ckpt_format import CheckpointError
from .checkpoint_files import DeepSpeedState, as_int, hyper, load, stage_file

#: the first DeepSpeed release whose fp16 without ZeRO scales the loss in engine.backward (PR
#: #8393, open as of 0.19.8); None: every release writes moments in 1/cur_scale units
FP16_STAGE0_FIXED_IN: str | None = None


def read_stage0(d: Path, f: Path, ms: dict, weights: Mapping, common: dict) -> DeepSpeedState:
    """A DeepSpeed folder without ZeRO (module doc); ``f`` is the model-states file ``ms``."""
    return DeepSpeedState(zero_stage=0, **_optimizer_state(f, ms, weights, unique_names(weights)),
                          **common)


def _unscaled_moments(f: Path, ms: dict, opt: Mapping, weights: Mapping, out: dict) -> None:
    """Undo DeepSpeed's fp16-without-ZeRO gradient units in ``out``'s moments (module doc)."""
    scale = float(opt.get("cur_scale") or 1.0)
    fp16 = any(w.dtype == torch.float16 for w in weights.values())
    if not fp16 or scale == 1.0 or not out["exp_avg"] or not _unscaled_release(
            ms.get("ds_version")):
        return
    for name in out["exp_avg"]:
        out["exp_avg"][name].mul_(scale)
        out["exp_avg_sq"][name].mul_(scale * scale)
    out["notes"] = [f"{f.name}: DeepSpeed {ms.get('ds_version') or '(version not recorded)'} "
                    f"fp16 without ZeRO stepped Adam on gradients divided by the loss scale "
                    f"(DeepSpeed PR #8393); Adam's moments were multiplied back by the scale "
                    f"{scale:g} (exp_avg_sq by its square), so the continued run takes correctly "
                    f"scaled steps"]


def _unscaled_release(version) -> bool:
    if FP16_STAGE0_FIXED_IN is None or not version:
        return True
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(version)) < Version(FP16_STAGE0_FIXED_IN)
    except InvalidVersion:
        return True


def read_pipeline_stage0(d: Path, ms0: dict, stages: int, weights: Mapping,
                         common: dict) -> DeepSpeedState:
    """PipelineEngine without ZeRO: stage ``s``'s optimizer holds the next parameters in layer
    order (``weights``' keys, ``"{layer}.{name}"``): in fp32 the next ``n_s`` (ending on a layer
    boundary), in fp16/bf16 those its masters round to."""
    files = []
    for s in range(stages):
        f = d / stage_file(s)
        if not f.is_file():
            raise CheckpointError(f"{d}: a checkpoint of {stages} pipeline stages lacks "
                                  f"{f.name}: a partial save (copy the whole folder)")
        files.append((f, ms0 if s == 0 else load(f)))
    buffers = {b for _, ms in files for b in ms.get("buffer_names") or ()}
    weights = {k: v for k, v in weights.items() if k not in buffers}
    left = unique_names(weights)
    out = None
    for s, (f, ms) in enumerate(files):
        part = _optimizer_state(f, ms, weights, left, partial=True)
        n = len(part["params"])
        plain = not ({"fp32_groups", "fp32_groups_flat"} & set(_opt(f, ms)))
        if n == 0 or (plain and n < len(left)
                      and left[n].split(".", 1)[0] == left[n - 1].split(".", 1)[0]):
            raise CheckpointError(f"{f}: stage {s}'s optimizer holds {n} parameters, which do not "
                                  f"end on a layer boundary of the layer files (a tied or "
                                  f"frozen parameter?); malleus_ds reads fp32 PipelineEngine "
                                  f"checkpoints without tied layers, or any with ZeRO-1")
        left = [x for x in left if x not in part["params"]]
        if out is None:
            out = part
        else:
            for k in ("params", "exp_avg", "exp_avg_sq"):
                out[k].update(part[k])
            out["notes"] += part["notes"]
            out["adam_step"] = max(out["adam_step"], part["adam_step"])
    if left:
        raise CheckpointError(f"{d}: the stages' optimizers hold no state for {len(left)} of the "
                              f"layer files' parameters ({left[0]}, ...): a partial save or "
                              f"files of another run mixed in")
    return DeepSpeedState(zero_stage=0, pipeline_stages=stages, **out, **common)


def unique_names(weights: Mapping) -> list[str]:
    """The module's parameter names in order, a tied (storage-sharing) parameter once."""
    names, seen = [], set()
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            names.append(k)
    return names


def _opt(f: Path, ms: dict) -> dict:
    opt = ms.get("optimizer")
    inner = opt.get("optimizer_state_dict", opt) if isinstance(opt, Mapping) else None
    if not isinstance(inner, Mapping) or not isinstance(inner.get("state"), Mapping):
        raise CheckpointError(f"{f}: no optimizer state (saved without it? DeepSpeed writes it "
                              f"unless save_checkpoint(..., exclude_frozen_parameters) or a "
                              f"client optimizer without state_dict); a checkpoint to continue "
                              f"needs Adam's state")
    return opt


def _optimizer_state(f: Path, ms: dict, weights: Mapping, names: list[str],
                     partial: bool = False) -> dict:
    """params, exp_avg, exp_avg_sq, adam_step, param_groups, loss_scaler and notes of the
    parameters ``names`` (module order) from the optimizer state in ``ms``; ``partial``: it may
    hold only some of them (a pipeline stage's: the first ones in fp32)."""
    opt = _opt(f, ms)
    inner = opt.get("optimizer_state_dict", opt)
    groups = inner.get("param_groups") or ()
    state = inner["state"]
    params, m1, m2, steps = {}, {}, {}, set()

    def moments(idx, name, sl=None):
        st = state.get(idx) or state.get(str(idx)) or {}
        if "exp_avg" not in st:
            return                                   # never stepped (step 0): fresh moments
        shape = weights[name].shape
        for out, k in ((m1, "exp_avg"), (m2, "exp_avg_sq")):
            t = st[k].float().reshape(-1)
            out[name] = (t if sl is None else t[sl]).reshape(shape).clone()
        steps.add(as_int(st.get("step")))

    if "fp32_groups_flat" in opt or "fp32_groups" in opt:
        match = _Matcher(f, weights, names)
        for g, group in enumerate(opt.get("fp32_groups_flat") or opt.get("fp32_groups")):
            idxs = list(groups[g].get("params", ())) if g < len(groups) else []
            if isinstance(group, torch.Tensor):      # FP16_Optimizer: one flat master
                flat, off = group.float().reshape(-1), 0
                while off < flat.numel():
                    name = match.flat(flat, off, g)
                    n = weights[name].numel()
                    params[name] = flat[off:off + n].reshape(weights[name].shape).clone()
                    moments(idxs[0], name, slice(off, off + n))
                    off += n
            else:                                    # FP16_UnfusedOptimizer: one per parameter
                if len(idxs) != len(group):
                    raise CheckpointError(f"{f}: group {g} has {len(group)} fp32 masters and "
                                          f"{len(idxs)} optimizer entries: not one save")
                for idx, master in zip(idxs, group):
                    name = match.one(master.float(), g)
                    params[name] = master.float().clone()
                    moments(idx, name)
        if not partial:
            match.all_taken()
    else:
        order = [i for g in groups for i in g.get("params", ())]
        if len(order) > len(names) or (len(order) < len(names) and not partial):
            raise CheckpointError(f"{f}: the optimizer holds {len(order)} parameters, the "
                                  f"module {len(names)}: not one model's checkpoint")
        for i, name in zip(order, names):
            st = state.get(i) or state.get(str(i)) or {}
            if "exp_avg" in st and tuple(st["exp_avg"].shape) != tuple(weights[name].shape):
                raise CheckpointError(f"{f}: the optimizer's parameter {i} is "
                                      f"{tuple(st['exp_avg'].shape)}, the module's {name} "
                                      f"{tuple(weights[name].shape)}: its parameters are not in "
                                      f"the module's order (grouped by hand?), which an fp32 "
                                      f"save without ZeRO cannot tell apart")
            params[name] = weights[name].float().clone()
            moments(i, name)
    out = dict(params=params, exp_avg=m1, exp_avg_sq=m2, adam_step=max(steps) if steps else 0,
               param_groups=hyper(groups), loss_scaler=_scaler(opt), notes=[])
    if "cur_scale" in opt:
        _unscaled_moments(f, ms, opt, weights, out)
    return out


def _scaler(opt: Mapping) -> dict | None:
    """FP16_Optimizer's and FP16_UnfusedOptimizer's loss scaler (their own keys, the names
    ``ckpt_format.scaler_state`` uses); None for fp32."""
    if "cur_scale" not in opt:
        return None
    out = {"cur_scale": float(opt["cur_scale"])}
    for k in ("cur_iter", "last_overflow_iter"):
        if k in opt:
            out[k] = as_int(opt[k])
    return out


class _Matcher:
    """Hands the module's parameter names to fp32 masters by value: the next name in module
    order when the master rounds to its (fp16/bf16) weights, else the first that does."""

    def __init__(self, f: Path, weights: Mapping, names: list[str]) -> None:
        self.f, self.weights, self.left = f, weights, list(names)

    def _equal(self, name: str, master: torch.Tensor) -> bool:
        w = self.weights[name]
        return master.numel() == w.numel() and torch.equal(master.to(w.dtype).reshape(w.shape),
                                                           w)

    def _take(self, fits, where: str) -> str:
        for name in self.left:
            if fits(name):
                self.left.remove(name)
                return name
        raise CheckpointError(f"{self.f}: the fp32 master {where} rounds to none of the module's "
                              f"remaining {len(self.left)} parameters: not this module's "
                              f"optimizer (files of another run mixed in?)")

    def one(self, master: torch.Tensor, g: int) -> str:
        return self._take(lambda n: self._equal(n, master),
                          f"of shape {tuple(master.shape)} in group {g}")

    def flat(self, flat: torch.Tensor, off: int, g: int) -> str:
        def fits(n):
            k = self.weights[n].numel()
            return off + k <= flat.numel() and self._equal(n, flat[off:off + k])
        return self._take(fits, f"at element {off} of group {g}'s flat buffer")

    def all_taken(self) -> None:
        if self.left:
            raise CheckpointError(f"{self.f}: the optimizer holds no master for "
                                  f"{len(self.left)} of the module's parameters ({self.left[0]}, "
                                  f"...): frozen parameters, which malleus_ds would train")
