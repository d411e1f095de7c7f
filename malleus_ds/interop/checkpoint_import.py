"""DeepSpeed checkpoints into MalleusEngine: the state ``checkpoint.read_state`` reads,
written as a MalleusEngine checkpoint of a one-rank plan (:func:`write_malleus`) that the
engine's any-plan loader reads like its own; DeepSpeed's parameter names mapped to our global
names (:func:`name_in`); the collective conversion an engine runs before it loads such a folder
(:func:`import_deepspeed`: ``MalleusEngine.load_checkpoint`` and the app's resume call it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from ..files.ckpt_format import CheckpointError
from .checkpoint import DeepSpeedState, read_state, tag_folder
from .names import from_pipeline, global_name


def write_malleus(state: DeepSpeedState, out_dir, table, ties, num_layers: int,
                  global_batch_size: int, micro_batch_size: int,
                  name_of: Callable[[str], str | None], client_state: dict | None = None
                  ) -> Path:
    """``state`` as a MalleusEngine checkpoint of a one-rank plan in ``out_dir`` (the tag
    folder): ``malleus_rank00000.pt`` and ``meta.json``, which ``load_checkpoint`` reads under
    any plan. ``table``: the running model's parameter table; ``ties``: its tied pairs (a tied
    copy takes its partner's tensors); ``name_of``: DeepSpeed's parameter name -> our global
    name (None: not a weight of the model); ``client_state``: what ``load_checkpoint`` returns
    as the saved client state. Returns ``out_dir``."""
    from ..files.ckpt_format import FORMAT, META, rank_file
    from ..files.fileio import atomic_write, atomic_write_text
    from ..layout import holdings
    from ..plan import static_plan
    from ..files.safe_load import UnsafeFile, check_plain
    from ..files.ckpt_format import meta_record

    by_global: dict[str, str] = {}
    for n in state.params:
        g = name_of(n)
        if g is not None:
            by_global[g] = n
    for a, b in ties:
        for x, y in ((a, b), (b, a)):
            if x not in by_global and y in by_global:
                by_global[x] = by_global[y]
    missing = [s.name for s in table if s.name not in by_global]
    if missing:
        raise CheckpointError(f"{state.tag_dir}: holds no {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + f": a checkpoint of another model (it has "
                              f"{sorted(state.params)[:3]} ...)")
    for s in table:
        got = tuple(state.params[by_global[s.name]].shape)
        if got != tuple(s.shape):
            raise CheckpointError(f"{state.tag_dir}: {s.name} is {got} there and "
                                  f"{tuple(s.shape)} in this model: a checkpoint of another "
                                  f"model shape")
    plan = static_plan(num_layers, global_batch_size, micro_batch_size, 1, 1, 1)
    spec = {s.name: s for s in table}
    moments = bool(state.exp_avg)
    src = {"param": state.params, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq}
    slices = {}
    for h in holdings(plan, table, 0, 0, False):
        if h.kind != "param" and not moments:
            t = torch.zeros(spec[h.name].numel)
        else:
            t = src[h.kind][by_global[h.name]]
            d = spec[h.name].split_dim
            t = (t.movedim(d, 0) if d is not None else t).reshape(-1)
        slices[(h.kind, h.name, h.lo, h.hi)] = t[h.lo:h.hi].float().contiguous().clone()
    sid = int.from_bytes(os.urandom(7), "little")
    out = Path(out_dir)
    counters = (state.global_steps, state.skipped_steps, state.global_samples)
    meta = meta_record(sid, out.name, plan, 1, 0, "fp32", False,
                       state.adam_step if moments else 0, counters, table)
    meta["from"] = {"deepspeed": str(state.tag_dir), "zero_stage": state.zero_stage,
                    "dp": state.dp, "pipeline_stages": state.pipeline_stages,
                    "notes": list(state.notes)}
    engine = {"adam_step": meta["adam_step"], "global_steps": state.global_steps,
              "skipped_steps": state.skipped_steps, "global_samples": state.global_samples,
              "loss_scaler": state.loss_scaler, "lr_scheduler": state.lr_scheduler,
              "param_groups": state.param_groups, "client_state": dict(client_state or {})}
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)
    try:    # as a save checks: what we write must load with weights_only=True
        check_plain(engine, f"{state.tag_dir}'s engine state")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    data = {"format": FORMAT, "save_id": sid, "rank": 0, "meta": meta, "engine": engine,
            "slices": slices}
    atomic_write(rank_file(out, 0), lambda f: torch.save(data, f))
    atomic_write_text(out / META, json.dumps(meta))       # last: the commit record
    return out


#: the folder, inside a DeepSpeed checkpoint's tag folder, that holds it converted
CONVERTED = "malleus"


def name_in(table_names, num_layers: int | None = None) -> Callable[[str], str | None]:
    """DeepSpeed's parameter name -> our global name in ``table_names``: the name itself (a
    MalleusEngine model), a Hugging Face Llama name (``model.layers.0...``), either under one
    wrapper prefix (``model.``: engine=deepspeed's module; ``module.``), or engine=deepspeed's
    PipelineModule name ``{i}.layer.{name}`` (piece 0 the embedding, 1..``num_layers`` the
    decoder layers, then the head)."""
    names = set(table_names)

    def name_of(n: str) -> str | None:
        cands = [n]
        piece = from_pipeline(n, num_layers) if num_layers else None
        if piece is not None:
            cands.append(piece)
        for pre in ("model.", "module."):
            if n.startswith(pre):
                cands.append(n[len(pre):])
        for c in list(cands):
            try:
                cands.append(global_name(c))
            except KeyError:
                pass
        return next((c for c in cands if c in names), None)
    return name_of


def import_deepspeed(engine, load_dir, tag=None, client_state: dict | None = None
                     ) -> tuple[str, str]:
    """Collective: rank 0 converts the DeepSpeed checkpoint at ``load_dir`` (``tag``) into
    MalleusEngine's format in the tag folder's :data:`CONVERTED` subfolder (read_state +
    write_malleus, for the engine's model and batch); every rank learns rank 0's error (a
    CheckpointError). Returns ``(root, tag)`` for ``load_checkpoint``."""
    from ..models.base import tied_params
    from ..resilience.agreement import raise_if_any_failed

    err, d = None, None
    try:
        d = tag_folder(load_dir, tag)
    except CheckpointError as e:
        err = str(e)
    if err is None and engine.global_rank == 0:
        try:
            st = read_state(d)
            for note in st.notes:
                print(f"[malleus_ds] note: {note}", flush=True)
            write_malleus(st, d / CONVERTED, engine.param_table, tied_params(engine.model_cfg),
                          engine.plan.num_layers, engine.plan.global_batch_size,
                          engine.plan.micro_batch_size,
                          name_in((s.name for s in engine.param_table), engine.plan.num_layers),
                          client_state)
        except Exception as e:  # noqa: BLE001 - every rank raises it (below)
            err = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    raise_if_any_failed("import-deepspeed", err, f"reading DeepSpeed checkpoint {load_dir}",
                        CheckpointError)
    return str(d), CONVERTED
