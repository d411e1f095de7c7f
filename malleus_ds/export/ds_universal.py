"""``malleus-export --to deepspeed-universal``: one of our checkpoints, under any plan, as a
DeepSpeed universal checkpoint that stock DeepSpeed continues from (issue 34: leave freely).

DeepSpeed's universal format (``deepspeed/checkpoint/ds_to_universal.py`` writes it,
``load_universal_checkpoint`` reads it with ``"checkpoint": {"load_universal": true}``), in
``OUT/<tag>/``:

* ``mp_rank_00_model_states.pt``: the module's weights, the LR scheduler's state and the step
  counters (DeepSpeed's model-states file, as its engine loads it);
* ``zero/<parameter name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: ``{"param": the full
  tensor}``, fp32; ``step.pt``: Adam's step. Each rank of the loading job cuts its own ZeRO
  partition out of them, so the job may have any data-parallel degree;
* ``zero/optimizer_state.pt``: the optimizer's hyper-parameters (``param_groups``) and
  ``ds_version``;
* ``OUT/latest_universal`` (and ``OUT/latest``): the tag.

Beyond the universal format, so that every layout stock DeepSpeed trains can continue it:

* **PipelineEngine** loads each parameter under its PipelineModule name
  (``{piece}.layer.{name}``: ``ds_import.pipeline_name``): the parameter folders are there
  under those names too (hard links to the same files). Its universal load takes the weights
  from ``fp32.pt`` and every stage's counters and LR schedule from the one model-states file.
  Tied models are left out (their PipelineModule names its tied piece otherwise);
* **ZeRO-0**: DeepSpeed's universal load leaves the optimizer of a run without ZeRO to the
  model-states file's ``optimizer``, and the weights to ``module``, as in a plain save: the file
  holds torch AdamW's ``state_dict`` over the module's parameters in order, so ZeRO-0 fp32
  continues it as a plain checkpoint (without ``load_universal``).

Our checkpoint's slices (any plan, world size, ZeRO stage, precision) are put together into full
fp32 tensors by global name: the fp32 masters (the parameters of an fp32 run) and Adam's moments.
Parameter names are our global names, which are engine=deepspeed's module names for the app's
models. A ``run.json`` beside them (``"universal": true``) lets the app continue it with
``engine=deepspeed checkpoint.resume=true`` under any data-parallel layout; the app's DeepSpeed
runner then turns on ``load_universal`` itself.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from ..engine.ds_ckpt_files import stage_file
from ..engine.ds_import import pipeline_name
from .hf_folder import ExportError
from .readers import Assembler, find_checkpoint, open_meta, read_slices

KINDS = ("exp_avg", "exp_avg_sq")


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
    import deepspeed

    from ..files.fileio import atomic_write, atomic_write_text
    from .hf_folder import check_out_dir

    d, run = find_checkpoint(checkpoint)
    if run.get("engine") != "malleus":
        raise ExportError(f"checkpoint {d} was saved by engine={run.get('engine')}: "
                          f"--to deepspeed-universal writes engine=malleus checkpoints (stock "
                          f"DeepSpeed's own files it loads already)")
    full, meta, state = read_full(d)
    out = Path(out)
    check_out_dir(out, force)
    tag = d.name
    t = out / tag
    (t / "zero").mkdir(parents=True, exist_ok=True)
    step = float(meta.get("adam_step", 0))

    def save(path: Path, obj) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(obj, f))

    names = list(full["fp32"])
    for n in names:
        for k in ("fp32", *KINDS):
            save(t / "zero" / n / f"{k}.pt", {"param": full[k][n].contiguous()})
        save(t / "zero" / n / "step.pt", torch.tensor(step))
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in (state or {}).get("param_groups") or [{}]]
    save(t / "zero" / "optimizer_state.pt",
         {"param_groups": groups, "ds_version": deepspeed.__version__,
          "dynamic_loss_scale": False, "overflow": False})
    from collections import OrderedDict

    client = dict((state or {}).get("client_state") or {})
    model_states = dict(client, **{
        "module": OrderedDict((n, full["fp32"][n]) for n in names),
        "buffer_names": [], "optimizer": None,
        "param_shapes": [OrderedDict((n, full["fp32"][n].shape) for n in names)],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": (state or {}).get("lr_scheduler"), "data_sampler": None,
        "random_ltd": None, "skipped_steps": int(meta.get("skipped_steps", 0)),
        "global_steps": int(meta.get("global_steps", 0)),
        "global_samples": int(meta.get("global_samples", 0)), "dp_world_size": 1,
        "mp_world_size": 1, "ds_config": {}, "ds_version": deepspeed.__version__})
    model_states["optimizer"] = torch_adam_state(names, full, step, groups)
    save(t / stage_file(0), model_states)
    if not _is_tied(run.get("model") or {}):
        for n in names:
            pn = pipeline_name(n, int(meta.get("num_layers", 0)))
            if pn is not None and pn != n:
                _link_folder(t / "zero" / n, t / "zero" / pn)
    rec = dict(run, engine="deepspeed", universal=True, world_size=None, parallel=None,
               zero_stage=None, precision=None)
    from ..files.ckpt_format import RUN_FILE

    atomic_write_text(t / RUN_FILE, json.dumps(rec, indent=1))
    for latest in ("latest_universal", "latest"):
        atomic_write_text(out / latest, tag)
    return t, rec


def torch_adam_state(names, full: Mapping, step: float, groups: list[dict]) -> dict:
    """torch AdamW's ``state_dict`` over ``names`` (the module's parameters in order, one
    group, as engine=deepspeed's client optimizer has them), for DeepSpeed ZeRO-0."""
    from ..optim import OptimConfig

    g = dict(groups[0]) if groups else {}
    oc = OptimConfig()
    probe = torch.optim.AdamW([torch.zeros(1)], lr=g.get("lr", oc.lr),
                              betas=tuple(g.get("betas", oc.betas)), eps=g.get("eps", oc.eps),
                              weight_decay=g.get("weight_decay", oc.weight_decay), foreach=True)
    group = dict(probe.state_dict()["param_groups"][0], **g, params=list(range(len(names))))
    group.pop("decoupled_weight_decay", None)   # the loading optimizer's own: AdamW or Adam
    state = {}
    if step > 0:
        state = {i: {"step": torch.tensor(step), "exp_avg": full["exp_avg"][n].contiguous(),
                     "exp_avg_sq": full["exp_avg_sq"][n].contiguous()}
                 for i, n in enumerate(names)}
    return {"state": state, "param_groups": [group]}


def _is_tied(record: Mapping) -> bool:
    if record.get("family") != "hf":
        return False                     # our own models tie nothing
    from .readers import _tied

    return _tied(record)


def _link_folder(src: Path, dst: Path) -> None:
    """``dst`` holding ``src``'s files as hard links (copies where the file system has none)."""
    import os
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        target.unlink(missing_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def summary(t: Path, rec: Mapping) -> str:
    return (f"wrote DeepSpeed universal checkpoint {t} (step {rec.get('step')}); stock "
            f"DeepSpeed continues it with \"checkpoint\": {{\"load_universal\": true}} "
            f"(launch/train.py engine=deepspeed checkpoint.dir={t.parent} "
            f"checkpoint.resume=true sets that itself)")
