"""ZeRO-1/2 folders: each data-parallel rank's partition of every group's flat fp32 master
and of Adam's moments, put back together and cut by ``param_shapes``."""
from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Mapping

import torch

from ..files.ckpt_format import CheckpointError
from .checkpoint_files import MODEL_FILE, DeepSpeedState, as_int, hyper, load


def read_zero(d: Path, ms: dict, weights: Mapping, zero_files: list, stage: int,
              common: dict) -> DeepSpeedState:
    dp = common["dp"]
    ranks = [r for r, _ in zero_files]
    if ranks != list(range(dp)):
        missing = sorted(set(range(dp)) - set(ranks))
        raise CheckpointError(f"{d}: a ZeRO-{stage} checkpoint of {dp} data-parallel ranks lacks "
                              f"the optimizer file(s) of rank(s) {missing or ranks}: a partial "
                              f"save (copy the whole folder)")
    parts = []
    for r, f in zero_files:
        osd = load(f).get("optimizer_state_dict")
        if not isinstance(osd, Mapping) or "single_partition_of_fp32_groups" not in osd:
            raise CheckpointError(f"{f}: no optimizer_state_dict with fp32 partitions (not a "
                                  f"ZeRO-1/2 optimizer file)")
        parts.append(osd)
    base = [p.get("base_optimizer_state") for p in parts]
    if any(not isinstance(b, Mapping) or "state" not in b for b in base):
        raise CheckpointError(f"{d}: an optimizer file has no base_optimizer_state (saved with "
                              f"elastic_checkpoint, which malleus_ds does not read)")
    shapes = ms.get("param_shapes")
    if (not isinstance(shapes, (list, tuple)) or not shapes) and all(
            p.get("param_slice_mappings") for p in parts):
        return _from_slice_mappings(d, parts, base, weights, stage, common)
    if not isinstance(shapes, (list, tuple)) or not shapes:
        raise CheckpointError(f"{d / MODEL_FILE}: no param_shapes: not a ZeRO checkpoint "
                              f"DeepSpeed 0.9+ wrote")
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
                steps.add(as_int(st.get("step")))
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
    from ..files.ckpt_format import scaler_state

    scaler = parts[0].get("loss_scaler")
    return DeepSpeedState(zero_stage=stage, params=params, exp_avg=exp_avg,
                          exp_avg_sq=exp_avg_sq, adam_step=max(steps) if steps else 0,
                          param_groups=hyper(base[0].get("param_groups")),
                          loss_scaler=scaler_state(scaler) if scaler is not None else None,
                          **common)


def _from_slice_mappings(d: Path, parts: list, base: list, weights: Mapping, stage: int,
                         common: dict) -> DeepSpeedState:
    """BF16_Optimizer's files (bf16 without ZeRO, as PipelineEngine runs it): no
    ``param_shapes``, but each rank's ``param_slice_mappings`` names the parameters whose
    pieces its partition holds (``fragment_address(numel, start)`` within the partition); the
    partitions, put back together, hold each parameter contiguously."""
    params, m1, m2, steps = {}, {}, {}, set()
    for g in range(len(parts[0]["single_partition_of_fp32_groups"])):
        flat, mom, offs, at = [], ([], []), [], 0
        for osd, b in zip(parts, base):
            part = osd["single_partition_of_fp32_groups"][g].float().reshape(-1)
            st = b["state"].get(g) or b["state"].get(str(g)) or {}
            offs.append(at)
            at += part.numel()
            flat.append(part)
            if "exp_avg" in st:
                mom[0].append(st["exp_avg"].float().reshape(-1)[:part.numel()])
                mom[1].append(st["exp_avg_sq"].float().reshape(-1)[:part.numel()])
                steps.add(as_int(st.get("step")))
        flat_t = torch.cat(flat)
        moms = (torch.cat(mom[0]), torch.cat(mom[1])) if len(mom[0]) == len(parts) else None
        frags: dict[str, list[tuple[int, int]]] = {}
        for r, osd in enumerate(parts):
            for name, fa in osd["param_slice_mappings"][g].items():
                start, numel = (fa.start, fa.numel) if hasattr(fa, "start") else (fa[1], fa[0])
                frags.setdefault(name, []).append((offs[r] + int(start), int(numel)))
        for name, fr in frags.items():
            fr.sort()
            lo, n = fr[0][0], sum(k for _, k in fr)
            if any(a + k != b for (a, k), (b, _) in zip(fr, fr[1:])) or lo + n > flat_t.numel():
                raise CheckpointError(f"{d}: {name}'s pieces in the optimizer files do not join "
                                      f"up: a partial save or files of another run mixed in")
            if name not in weights or weights[name].numel() != n:
                has = tuple(weights[name].shape) if name in weights else "no such parameter"
                raise CheckpointError(f"{d}: {name} holds {n} elements in the optimizer files, "
                                      f"{has} in the module: not one model's checkpoint")
            shape = tuple(weights[name].shape)
            params[name] = flat_t[lo:lo + n].view(shape).clone()
            if moms is not None:
                m1[name] = moms[0][lo:lo + n].view(shape).clone()
                m2[name] = moms[1][lo:lo + n].view(shape).clone()
    return DeepSpeedState(zero_stage=stage, params=params, exp_avg=m1, exp_avg_sq=m2,
                          adam_step=max(steps) if steps else 0,
                          param_groups=hyper(base[0].get("param_groups")), **common)
