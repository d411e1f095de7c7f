"""Checkpoints that load under any plan, ZeRO stage, precision or world size (DESIGN.md §6-7).

"Checkpoints are per-rank files named by global parameter name; loading one under another plan
or world size uses the same transfer plan, reading slices from files instead of peers."

File format (one tag directory ``save_dir/tag/``):

* ``malleus_rank{r:05d}.pt``, one per rank of the SAVING world, holding::

      {"format": FORMAT, "save_id": int, "rank": r,
       "meta": {... the same fields as meta.json ...},
       "engine": {"adam_step", "global_steps", "skipped_steps", "global_samples",
                  "loss_scaler", "lr_scheduler", "param_groups", "client_state"},
       "slices": {(kind, name, lo, hi): 1-D tensor}}

  as a raw rank file (``ckpt_format.py``): a small ``torch.save`` header of everything but the
  slices, with an index of where each slice's bytes are, then the bytes themselves, written
  from the host memory a save copies them into, with ``O_DIRECT`` where the file system takes it
  (``checkpoint_save.py``); loading maps the file and reads only the slices it needs. Files of
  the older format (one ``torch.save`` zip of the same dict) load as well.
  ``slices`` is the rank's share of what it held (``malleus_ds.layout.holdings``), one flat
  tensor per run in canonical order (split dim first, flattened): its parameter shards in the
  parameter dtype (``param``) and, per bucket, the fp32 ``master`` (bf16/fp16 only), ``exp_avg``
  and ``exp_avg_sq`` of the range it owned — under ZeRO-1/2 only its partition. What several
  ranks hold (a parameter's data-parallel replicas; under ZeRO-0 the optimizer state too) is
  split among them (``migrate/file_reads.one_copy``; ``meta["stored"] = "one-copy"``), so every
  element is written once and the replicas share the writing. Nothing is gathered: a save
  moves no bytes between ranks. (A checkpoint without ``stored`` was written before that: each
  rank stored all it held; it loads as such.)
* ``meta.json`` (rank 0, written LAST, so it is the commit record: a directory without it is an
  unfinished save): format, save_id, plan JSON, world size, ZeRO stage, precision, Adam step and
  counters, batch sizes, and the parameter table (name -> [shape, split dim]) so a checkpoint of
  another model is refused by name, not by a shape error deep in a copy.
* ``save_dir/latest``: the tag (rank 0, after meta.json, only with ``save_latest``).

Every file is written under a temporary name, fsync'ed and renamed, so a crash never leaves a half
file under a final name; ``save_id`` (rank 0's random number, the same in every file of one save)
catches a tag directory that mixes files of two saves. Saving lives in
``engine/checkpoint_save.py``; the file names, format strings and checked readers in
``ckpt_format.py``.

Loading (:func:`load_checkpoint`): for each interval this rank holds NOW, the saved plan's
holdings (``plan_holdings`` with the saved ZeRO stage and precision) say which saved ranks held
it, split at every saved holding boundary exactly like the live transfer plan (the read
planning is pure and lives beside it: ``migrate/file_reads.py``);
each needed file is opened once with ``mmap=True`` and only the slices read are paged in, through
a staging buffer of at most ``malleus.migrate_bucket_mb`` per copy (never a whole-model tensor).
What was not stored is derived per the RUNNING precision, as a live switch does: fp32 masters are
the parameters (packed from them); under bf16/fp16 parameters are casts of the masters where
this rank holds a master, read from the saved parameters elsewhere. Precision may differ between
save and load: an fp32 checkpoint's parameters serve as masters, a bf16/fp16 checkpoint's masters
serve as fp32 parameters (or are cast into another low-precision dtype).
"""
from __future__ import annotations

from bisect import bisect_right
from pathlib import Path
from typing import Any

import torch

from ..resilience.agreement import raise_if_any_failed
from ..layout import STATE_KINDS, plan_holdings
from ..files.ckpt_format import (
    MAX_WORLD,
    META,
    CheckpointError,
    open_rank_file,
    rank_file,
    resolve,
    table_json)
from ..migrate.apply import StateView, params_from_masters, unpack_parts
from ..migrate.file_reads import ONE_COPY, Read, one_copy, plan_reads, wants
from ..migrate.transfer import Transfer, chunked
from ..plan import Plan

# ----------------------------------------------------------------------------- files


def _agree_or_raise(engine, err: str | None, what: str) -> None:
    """Every rank raises CheckpointError if any rank failed (``agreement.raise_if_any_failed``:
    through the job's store, not the communicator; the name is ``what`` up to its first "(",
    the same on every rank where a path might not be)."""
    raise_if_any_failed(what.split("(", 1)[0], err, what, CheckpointError)


# ----------------------------------------------------------------------------- load: checks


def check_compatible(d: Path, meta: dict, plan: Plan, table) -> Plan:
    """The saved plan, after checking the checkpoint fits the running job: same model (layers,
    parameter names, shapes, split dims), same global and micro batch size, all rank files there."""
    for f in ("num_layers", "global_batch_size", "micro_batch_size"):
        if meta.get(f) != getattr(plan, f):
            raise CheckpointError(f"checkpoint {d} has {f}={meta.get(f)}, this engine runs "
                                  f"{f}={getattr(plan, f)}; a checkpoint loads only into the same "
                                  f"model and global batch")
    saved, mine = meta.get("params", {}), table_json(table)
    for n in sorted(set(saved) | set(mine)):
        if saved.get(n) != mine.get(n):
            raise CheckpointError(f"checkpoint {d}: parameter {n} is [shape, split dim] "
                                  f"{saved.get(n)} there and {mine.get(n)} in this engine's model")
    try:
        sp = Plan.from_json(meta["plan"])
    except Exception as e:  # noqa: BLE001 - a PlanError or a malformed field
        raise CheckpointError(f"{d / META}: unreadable plan ({e})") from None
    W = meta.get("world_size")
    holders = sp.all_ranks
    if isinstance(W, bool) or not isinstance(W, int) or not 1 <= W <= MAX_WORLD \
            or any(r >= W for r in holders):
        raise CheckpointError(f"{d / META}: world_size={W!r} is not a world of 1..{MAX_WORLD} "
                              f"ranks holding its plan; the record is damaged")
    missing = [r for r in range(W) if not rank_file(d, r).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {d} was saved by {W} ranks but lacks "
                              f"{len(missing)} rank file(s): {rank_file(d, missing[0]).name}"
                              + (f" ... {rank_file(d, missing[-1]).name}" if len(missing) > 1 else ""))
    return sp


# ----------------------------------------------------------------------------- load: copy


class _Index:
    """One file's slices by (kind, name), sorted, for interval lookup."""

    def __init__(self, f: Path, slices: dict) -> None:
        self.f = f
        self.by: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
        for (kind, name, lo, hi), t in slices.items():
            if t.dim() != 1 or t.numel() != hi - lo:
                raise CheckpointError(f"{f}: {kind} {name}[{lo}:{hi}] holds {tuple(t.shape)}, "
                                      f"expected {hi - lo} elements")
            self.by.setdefault((kind, name), []).append((lo, hi, t))
        for v in self.by.values():
            v.sort(key=lambda e: e[0])
        self.starts = {k: [e[0] for e in v] for k, v in self.by.items()}

    def slice(self, kind: str, name: str, lo: int, hi: int) -> torch.Tensor:
        v = self.by.get((kind, name), [])
        i = bisect_right(self.starts.get((kind, name), []), lo) - 1
        if i < 0 or v[i][1] < hi:
            raise CheckpointError(f"{self.f}: has no {kind} of {name}[{lo}:{hi}], although the "
                                  f"saved plan says this rank held it")
        a, _, t = v[i]
        return t[lo - a:hi - a]


@torch.no_grad()
def _copy_in(sv: StateView, idx: _Index, reads: list[Read], rank: int, cap_bytes: int,
             device) -> None:
    """Copy ``reads`` out of one file into the running state, per destination dtype through a
    CPU staging buffer of at most ``cap_bytes`` (the cast to the running dtype happens here)."""
    by_dtype: dict[torch.dtype, list[Read]] = {}
    for r in reads:
        dt = sv.rt.named[r.name].dtype if r.kind == "param" else torch.float32
        by_dtype.setdefault(dt, []).append(r)
    for dt, rs in by_dtype.items():
        size = torch.empty(0, dtype=dt).element_size()
        for group in chunked(rs, max(1, cap_bytes // size)):
            stage = torch.empty(sum(r.hi - r.lo for r in group), dtype=dt)
            o = 0
            for r in group:
                stage[o:o + r.hi - r.lo].copy_(idx.slice(r.src_kind, r.name, r.lo, r.hi))
                o += r.hi - r.lo
            unpack_parts(sv, [Transfer(r.file_rank, rank, r.kind, r.name, r.lo, r.hi)
                              for r in group], stage.to(device))


@torch.no_grad()
def _derive_unsaved(rt, sv: StateView, mixed: bool, rank: int, cap_bytes: int, device) -> None:
    """What the files did not provide: low-precision parameters as casts of the masters this rank
    holds (the cast training does after a step), or fp32 masters from the parameters."""
    if not mixed:
        # every master := its range of the parameters (a switch leaves no bucket marked reused)
        rt.optimizer.reused = set()
        rt.optimizer.refresh_masters()
        return
    params_from_masters(sv, [(h.name, h.lo, h.hi) for h in sv.holds("master")],
                        rt.optimizer.param_dtype, rank, cap_bytes, device)


def _load_state(engine, d: Path, meta: dict, saved_plan: Plan, optimizer_states: bool) -> dict:
    """Read this rank's current holdings out of the files; returns the saved engine state."""
    rt, rank, table = engine.runtime, engine.global_rank, engine.param_table
    mixed = engine.precision.mixed
    W = int(meta["world_size"])
    sp_name, saved_mixed = meta["precision"]["name"], bool(meta["precision"]["mixed"])
    home = rank if rank < W else 0          # the file whose engine state / client_state we take
    sv = StateView(rt, table, rank, mixed)
    ws = wants(sv.holds(), mixed=mixed, saved_mixed=saved_mixed,
               same_param_dtype=sp_name == engine.precision.name,
               optimizer_states=optimizer_states)
    saved = plan_holdings(saved_plan, table, int(meta["zero_stage"]), saved_mixed)
    if meta.get("stored") == ONE_COPY:      # else an older save: every rank stored all it held
        saved = one_copy(saved)
    reads = plan_reads(ws, saved, rank, W, home)
    by_file: dict[int, list[Read]] = {}
    for r in reads:
        by_file.setdefault(r.file_rank, []).append(r)
    cap = max(1, int(engine.settings.migrate_bucket_mb * 2**20))
    state = None
    for fr in [home] + sorted(set(by_file) - {home}):
        ck = open_rank_file(d, fr, meta)
        if fr == home:
            state = ck["engine"]
        if fr in by_file:
            _copy_in(sv, _Index(rank_file(d, fr), ck["slices"]), by_file[fr], rank, cap,
                     engine.device)
        del ck                              # unmaps the file
    _derive_unsaved(rt, sv, mixed, rank, cap, engine.device)
    opt = rt.optimizer
    if not optimizer_states:               # fresh moments (a trained engine may have some)
        for m in opt.masters:
            if m is not None:
                for k in STATE_KINDS:
                    if k in opt.optimizer.state[m]:
                        opt.optimizer.state[m][k].zero_()
    opt.set_step(int(meta["adam_step"]) if optimizer_states else 0)
    return state


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> tuple[str, Any]:
    """See the module docstring. Collective. Returns ``(path of the file the engine state came
    from, client_state)`` like DeepSpeed; ``client_state`` is the one this rank saved (rank 0's
    for a rank beyond the saving world). ``load_optimizer_states=False``: weights only (fp32
    masters still come from the file under mixed precision), Adam moments zero, step 0."""
    from .precision import load_scaler_state

    # checks read only shared files: the same error on every rank, before any collective
    d, meta = resolve(load_dir, tag)
    saved_plan = check_compatible(d, meta, engine.plan, engine.param_table)
    err = state = None
    try:
        state = _load_state(engine, d, meta, saved_plan, load_optimizer_states)
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        err = f"{type(e).__name__}: {e}"
        # this rank's state may be half-written: train_batch refuses until a load succeeds
        engine._broken = f"load_checkpoint({d}) failed ({err[:300]}); load a checkpoint again"
    try:
        _agree_or_raise(engine, err, f"load_checkpoint({d})")
    except CheckpointError as e:
        engine._broken = getattr(engine, "_broken", None) or f"load_checkpoint({d}) failed: {e}"
        raise
    engine._broken = None
    engine.global_steps = int(state["global_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    engine.global_samples = int(state["global_samples"])
    load_scaler_state(engine.loss_scaler, state["loss_scaler"])
    engine.optimizer.overflow = False
    if load_optimizer_states or load_lr_scheduler_states:
        # the LR (and the other hyper-parameters) the saved schedule had reached: a scheduler
        # steps after the optimizer, so without this the first step would use the initial LR
        for g, sg in zip(engine.optimizer.param_groups, state["param_groups"]):
            g.update(sg)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"]:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    W = int(meta["world_size"])
    home = engine.global_rank if engine.global_rank < W else 0
    return str(rank_file(d, home)), state["client_state"]
