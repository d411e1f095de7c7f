"""``malleus-export --to deepspeed-universal``: one of our checkpoints, under any plan, as a
DeepSpeed universal checkpoint that stock DeepSpeed continues from.

Our checkpoint's slices (any plan, world size, ZeRO stage, precision) are put together into full
fp32 tensors by global name: the fp32 masters (the parameters of an fp32 run) and Adam's moments;
``interop/universal.py`` writes them in DeepSpeed's universal format (its module doc says what
goes where). A ``run.json`` beside them (``"universal": true``) lets the app continue it with
``engine=deepspeed checkpoint.resume=true`` under any data-parallel layout; the app's DeepSpeed
runner then turns on ``load_universal`` itself.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from ..interop.universal import KINDS, write_tag
from .hf_folder import ExportError
from .readers import Assembler, find_checkpoint, open_meta, read_slices


def read_full(tag_dir: Path) -> tuple[dict, dict, dict]:
    """Our checkpoint at ``tag_dir`` as ``({kind: {name: full fp32 tensor}}, meta, engine
    state)``: kinds ``fp32`` (masters under bf16/fp16, else the parameters), ``exp_avg``,
    ``exp_avg_sq``."""
    d, meta, world, mixed, specs = open_meta(tag_dir)
    fp32 = "master" if mixed else "param"
    stepped = int(meta.get("adam_step", 0)) > 0      # never stepped: no moments saved
    asms = {fp32: Assembler(specs, f"{d} (fp32)")}
    if stepped:
        asms.update({k: Assembler(specs, f"{d} ({k})") for k in KINDS})
    state = read_slices(d, meta, world, asms)
    full = {"fp32": asms[fp32].finish()}
    full.update({k: asms[k].finish() if stepped else
                 {n: torch.zeros_like(t) for n, t in full["fp32"].items()} for k in KINDS})
    return full, meta, state


def write_universal(checkpoint, out, force: bool = False) -> tuple[Path, dict]:
    """Write the app checkpoint ``checkpoint`` (its root or a tag folder) as a universal
    checkpoint in ``out`` (module doc). Returns (the tag folder written, its run.json)."""
    from ..files.fileio import atomic_write_text
    from .hf_folder import check_out_dir

    d, run = find_checkpoint(checkpoint)
    if run.get("engine") != "malleus":
        raise ExportError(f"checkpoint {d} was saved by engine={run.get('engine')}: "
                          f"--to deepspeed-universal writes engine=malleus checkpoints (stock "
                          f"DeepSpeed's own files it loads already)")
    full, meta, state = read_full(d)
    out = Path(out)
    check_out_dir(out, force)
    t = out / d.name
    write_tag(t, full, meta, state, pipeline_names=not _is_tied(run.get("model") or {}))
    rec = dict(run, engine="deepspeed", universal=True, world_size=None, parallel=None,
               zero_stage=None, precision=None)
    from ..files.ckpt_format import RUN_FILE

    atomic_write_text(t / RUN_FILE, json.dumps(rec, indent=1))
    for latest in ("latest_universal", "latest"):
        atomic_write_text(out / latest, d.name)
    return t, rec


def _is_tied(record: Mapping) -> bool:
    if record.get("family") != "hf":
        return False                     # our own models tie nothing
    from .readers import _tied

    return _tied(record)


def summary(t: Path, rec: Mapping) -> str:
    return (f"wrote DeepSpeed universal checkpoint {t} (step {rec.get('step')}); stock "
            f"DeepSpeed continues it with \"checkpoint\": {{\"load_universal\": true}} "
            f"(launch/train.py engine=deepspeed checkpoint.dir={t.parent} "
            f"checkpoint.resume=true sets that itself)")
