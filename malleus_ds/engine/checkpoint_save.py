"""The save half of MalleusEngine's checkpoints (the format and how loading reads it:
``engine/checkpoint.py``).

:func:`snapshot_checkpoint` is the collective, step-boundary part (Adam's step and the save id
agreed, the tag folder prepared, this rank's holdings copied to host memory);
:func:`write_snapshot` writes the rank file and commits the save, on the training thread
(:func:`save_checkpoint`) or on a background thread of its own (``runners/background_save.py``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist

from ..agreement import raise_if_any_failed
from ..ckpt_format import FORMAT, LATEST, META, CheckpointError, rank_file
from ..fileio import atomic_write
from ..layout import STATE_KINDS, intersect, plan_holdings
from ..migrate.apply import StateView, pack_parts
from ..migrate.file_reads import ONE_COPY, one_copy
from ..migrate.transfer import Transfer
from ..safe_load import UnsafeFile, check_plain
from .checkpoint import _agree_or_raise, _table_json


# ----------------------------------------------------------------------------- save


def _held_slices(engine) -> dict[tuple[str, str, int, int], torch.Tensor]:
    """This rank's share of the save as CPU flat tensors in canonical order: of every holding,
    the runs :func:`~malleus_ds.migrate.file_reads.one_copy` gives this rank (replicas split what
    they share, so each element is written once)."""
    rt, rank, table = engine.runtime, engine.global_rank, engine.param_table
    mixed = engine.precision.mixed
    sv = StateView(rt, table, rank, mixed)
    if rt.save_runs is None:     # the whole plan's holdings: once per plan, not per save
        rt.save_runs = {key: sorted((lo, hi) for lo, hi, r in runs if r == rank) for key, runs
                        in one_copy(plan_holdings(engine.plan, table, rt.zero_stage,
                                                  mixed)).items()}
    mine: dict[tuple[str, str], list[tuple[int, int]]] = rt.save_runs
    opt = rt.optimizer
    out = {}
    for h in sorted(sv.holds(), key=lambda h: (h.kind, h.name, h.lo)):
        for lo, hi in intersect([(h.lo, h.hi)], mine.get((h.kind, h.name), [])):
            key = (h.kind, h.name, lo, hi)
            if h.kind in STATE_KINDS and h.kind not in opt.optimizer.state[opt.masters[h.buf]]:
                # before the first step Adam has no moments: they are zeros (StateView.buffer
                # would insert them into the state without a step, which AdamW then trips over)
                out[key] = torch.zeros(hi - lo, dtype=torch.float32)
                continue
            dt = rt.named[h.name].dtype if h.kind == "param" else torch.float32
            buf = torch.empty(hi - lo, dtype=dt, device=engine.device)
            pack_parts(sv, [Transfer(rank, rank, h.kind, h.name, lo, hi)], buf)
            out[key] = buf.cpu()
    return out


def _engine_state(engine, meta: dict, client_state) -> dict:
    """The small, non-tensor part of a rank file: plain data only (checked by the caller)."""
    from .precision import scaler_state

    sched, opt = engine.lr_scheduler, engine.runtime.optimizer
    return {"adam_step": meta["adam_step"], "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps, "global_samples": engine.global_samples,
            "loss_scaler": scaler_state(engine.loss_scaler),
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in opt.param_groups],
            "client_state": client_state or {}}


@dataclass
class Snapshot:
    """One rank's part of a save, copied to host memory at a step boundary
    (:func:`snapshot_checkpoint`); :func:`write_snapshot` writes and commits it, on this thread
    or in the background while training goes on. Holds no reference to the engine."""

    save_dir: Path
    tag: str
    rank: int
    meta: dict
    payload: dict               # the rank file (module docstring): host tensors, plain data
    save_latest: bool

    @property
    def dir(self) -> Path:
        return self.save_dir / self.tag


def snapshot_checkpoint(engine, save_dir, tag=None, client_state=None,
                        save_latest: bool = True) -> Snapshot:
    """The collective, step-boundary part of a save: Adam's step and the save id agreed, the
    engine state checked to be plain data, the tag folder prepared (an older save under it
    uncommitted), and this rank's holdings copied to host memory. Collective."""
    rank, world = engine.global_rank, engine.world_size
    plan, rt, prec = engine.plan, engine.runtime, engine.precision
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    d = Path(save_dir) / tag
    # Adam's step (a suspended rank has no moments: take the max) and rank 0's save id, at once
    sid = int.from_bytes(os.urandom(7), "little") if rank == 0 else 0
    agree = torch.tensor([rt.optimizer.step_count(), sid], dtype=torch.int64, device=engine.device)
    tdist.all_reduce(agree, op=tdist.ReduceOp.MAX)
    adam_step, sid = (int(x) for x in agree.cpu())
    meta = {"format": FORMAT, "save_id": sid, "tag": tag, "plan": plan.to_json(),
            "world_size": world, "zero_stage": rt.zero_stage,
            "precision": {"name": prec.name, "mixed": prec.mixed},
            "num_layers": plan.num_layers, "global_batch_size": plan.global_batch_size,
            "micro_batch_size": plan.micro_batch_size, "adam_step": adam_step,
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples, "params": _table_json(engine.param_table),
            "stored": ONE_COPY}
    err = None
    state = _engine_state(engine, meta, client_state)
    try:    # before anything is touched: a file we write must load with weights_only=True
        check_plain(state, f"rank {rank}'s engine state")
    except UnsafeFile as e:
        err = f"nothing saved: {e}"
    _agree_or_raise(engine, err, f"save_checkpoint({d})")
    try:
        d.mkdir(parents=True, exist_ok=True)
        if rank == 0:       # an older save under this tag is uncommitted from here on
            (d / META).unlink(missing_ok=True)
    except OSError as e:
        err = f"cannot prepare {d}: {e}"
    _agree_or_raise(engine, err, f"save_checkpoint({d})")
    payload = {"format": FORMAT, "save_id": sid, "rank": rank, "meta": meta, "engine": state,
               "slices": _held_slices(engine)}
    return Snapshot(Path(save_dir), tag, rank, meta, payload, save_latest)


def _save(obj, f) -> None:
    """``torch.save`` without the zip's CRC32: ``torch.load`` never checks it (a flipped byte in
    a tensor loads silently either way, with or without ``mmap``), and computing it costs 0.23 s
    of CPU per 384 MB (bench/RESULTS.md), taken from training while a background save writes."""
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        torch.save(obj, f)


def write_snapshot(snap: Snapshot, agree=None) -> None:
    """Write ``snap``'s rank file, then rank 0 commits ``meta.json`` (and ``latest`` with
    ``save_latest``) once every rank's file is complete. ``agree(err, what)``: every rank learns
    whether any failed and raises (default: the default group's agreement; a background writer
    passes one of its own so its calls never interleave with the training thread's). No
    collective: safe on a thread of its own."""
    agree = agree or (lambda err, what: raise_if_any_failed(what.split("(", 1)[0], err, what,
                                                             CheckpointError))
    d, rank, err = snap.dir, snap.rank, None
    try:
        atomic_write(rank_file(d, rank), lambda f: _save(snap.payload, f))
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree
        err = f"rank {rank} could not write {rank_file(d, rank)}: {type(e).__name__}: {e}"
    snap.payload = {}       # the host copies go as soon as they are on disk
    agree(err, f"save_checkpoint({d})")        # every rank file is complete
    if rank == 0:
        try:
            atomic_write(d / META, lambda f: f.write(json.dumps(snap.meta, indent=1) + "\n"), "w")
            if snap.save_latest:
                atomic_write(snap.save_dir / LATEST, lambda f: f.write(snap.tag), "w")
        except OSError as e:
            err = f"rank 0 could not commit {d / META}: {e}"
    agree(err, f"save_checkpoint({d})")        # `latest` names a committed checkpoint


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True
                    ) -> bool:
    """See the module docstring: :func:`snapshot_checkpoint` then :func:`write_snapshot`, on
    this thread. Collective."""
    write_snapshot(snapshot_checkpoint(engine, save_dir, tag, client_state, save_latest))
    return True
