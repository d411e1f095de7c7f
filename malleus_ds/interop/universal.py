"""A DeepSpeed universal checkpoint written from full fp32 tensors by global name, so that stock
DeepSpeed continues it (``malleus-export --to deepspeed-universal``: ``export/ds_universal.py``
puts our checkpoint's slices together and hands them here).

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
  (``{piece}.layer.{name}``: ``names.pipeline_name``): the parameter folders are there
  under those names too (hard links to the same files). Its universal load takes the weights
  from ``fp32.pt`` and every stage's counters and LR schedule from the one model-states file.
  Tied models are left out (their PipelineModule names its tied piece otherwise);
* **ZeRO-0**: DeepSpeed's universal load leaves the optimizer of a run without ZeRO to the
  model-states file's ``optimizer``, and the weights to ``module``, as in a plain save: the file
  holds torch AdamW's ``state_dict`` over the module's parameters in order, so ZeRO-0 fp32
  continues it as a plain checkpoint (without ``load_universal``).

Parameter names are our global names, which are engine=deepspeed's module names for the app's
models.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from .checkpoint_files import stage_file
from .names import pipeline_name

KINDS = ("exp_avg", "exp_avg_sq")


def write_tag(t: Path, full: Mapping[str, Mapping], meta: Mapping, state: Mapping | None,
              pipeline_names: bool) -> None:
    """The universal checkpoint's files in the tag folder ``t`` (module doc): ``full``: ``{kind:
    {global name: full fp32 tensor}}`` for kinds ``fp32``, ``exp_avg``, ``exp_avg_sq``;
    ``meta``: the counters (``adam_step``, ``global_steps``, ``skipped_steps``,
    ``global_samples``, ``num_layers``); ``state``: the engine state (``param_groups``,
    ``client_state``, ``lr_scheduler``); ``pipeline_names``: add the PipelineModule names (not
    for tied models)."""
    import deepspeed

    from ..files.fileio import atomic_write

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
    if pipeline_names:
        for n in names:
            pn = pipeline_name(n, int(meta.get("num_layers", 0)))
            if pn is not None and pn != n:
                _link_folder(t / "zero" / n, t / "zero" / pn)


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
