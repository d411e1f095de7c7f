"""The save half of MalleusEngine's checkpoints (the format and how loading reads it:
``engine/checkpoint.py``).

:func:`snapshot_checkpoint` is the collective, step-boundary part (Adam's step and the save id
agreed, the tag folder prepared, this rank's holdings copied to host memory);
:func:`write_snapshot` writes the rank file and commits the save, on the training thread
(:func:`save_checkpoint`) or on a background thread of its own (``app/runners/background_save.py``).

What a save costs the CPU is kept to two copies of the rank's bytes: into a host buffer laid out
once per plan and reused (:class:`SaveBuffer`: no page faults, no zeroing by the kernel), and
from there to the disk (a raw rank file written with ``O_DIRECT``: no serialising, no page-cache
copy, no writeback later). On CPU ranks, whose cores also train, that is what a background save
takes from training (bench/RESULTS.md, "Raw rank files").
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist

from ..resilience.agreement import raise_if_any_failed
from ..files.ckpt_format import (
    FORMAT,
    LATEST,
    META,
    RAW_MAGIC,
    CheckpointError,
    meta_record,
    rank_file,
    raw_data_start)
from ..files.fileio import aligned_buffer, atomic_write, atomic_write_chunks, round_up
from ..layout import STATE_KINDS, intersect, plan_holdings
from ..migrate.apply import StateView, pack_parts
from ..migrate.file_reads import ONE_COPY, one_copy
from ..migrate.transfer import Transfer
from ..files.safe_load import UnsafeFile, check_plain
from .checkpoint import _agree_or_raise


# ----------------------------------------------------------------------------- save


#: each slice's offset in a rank file's data is a multiple of this (any dtype, cache lines)
_SLICE_ALIGN = 64


class SaveBuffer:
    """Page-aligned host memory holding one rank's share of a save (:func:`fill_buffer`), laid
    out once per plan: ``entries`` are ``(holding, (kind, name, lo, hi), dtype, byte offset)``.
    Every save of the plan reuses it: fresh memory costs the kernel's page faults and zeroing,
    as much again as the copy (bench/RESULTS.md, "Raw rank files"). ``busy`` while a snapshot
    that fills it is not yet written: a save made meanwhile gets a buffer of its own."""

    def __init__(self, entries: list, data_bytes: int) -> None:
        self.entries, self.data_bytes = entries, data_bytes
        self.mem = aligned_buffer(data_bytes)
        self.views = [torch.frombuffer(self.mem, dtype=dt, count=hi - lo, offset=off)
                      if hi > lo else torch.empty(0, dtype=dt)
                      for _, (_, _, lo, hi), dt, off in entries]
        self.busy = False
        self._copies = None

    def like(self) -> "SaveBuffer":
        return SaveBuffer(self.entries, self.data_bytes)

    def copies(self, sv: StateView, opt) -> tuple[list, list] | None:
        """``(destinations, sources)``: views of this buffer and of the live state (CPU), one
        pair per window of every entry, equal shapes; made at the first save that has every
        state (None before Adam's first step) and kept while the state's tensors are the same
        ones (checked at every save by their addresses: the views keep the old ones alive, so
        a replaced tensor cannot reuse an address)."""
        bases = [sv.buffer(kind, h.buf) if _has_state(opt, kind, h) else None
                 for h, (kind, *_), _, _ in self.entries]
        if any(b is None for b in bases):
            return None
        addrs = [b.data_ptr() for b in bases]
        if self._copies is None or self._copies[0] != addrs:
            dsts, srcs = [], []
            for (h, (kind, name, lo, hi), _, _), view in zip(self.entries, self.views):
                pos = 0
                for _, v in sv.views(kind, name, lo, hi):
                    n = v.numel()
                    if n:
                        dsts.append(view[pos:pos + n].view(v.shape))
                        srcs.append(v)
                    pos += n
            self._copies = (addrs, dsts, srcs)
        return self._copies[1], self._copies[2]

    @property
    def index(self) -> dict:
        """The raw rank file's slice index (``ckpt_format``)."""
        return {key: (str(dt).removeprefix("torch."), off) for _, key, dt, off in self.entries}

    def data(self) -> memoryview:
        """The bytes to write: the data, padded to a whole number of blocks."""
        return memoryview(self.mem)[:round_up(max(1, self.data_bytes))]


def _save_buffer(engine) -> SaveBuffer:
    """This rank's :class:`SaveBuffer`: of every holding, the runs
    :func:`~malleus_ds.migrate.file_reads.one_copy` gives this rank (replicas split what they
    share, so each element is written once), in canonical order; made at the plan's first save."""
    rt, rank, table = engine.runtime, engine.global_rank, engine.param_table
    if rt.save_buffer is None:
        sv = StateView(rt, table, rank, engine.precision.mixed)
        mine = {key: sorted((lo, hi) for lo, hi, r in runs if r == rank) for key, runs
                in one_copy(plan_holdings(engine.plan, table, rt.zero_stage,
                                          engine.precision.mixed)).items()}
        entries, off = [], 0
        for h in sorted(sv.holds(), key=lambda h: (h.kind, h.name, h.lo)):
            for lo, hi in intersect([(h.lo, h.hi)], mine.get((h.kind, h.name), [])):
                dt = rt.named[h.name].dtype if h.kind == "param" else torch.float32
                off = round_up(off, _SLICE_ALIGN)
                entries.append((h, (h.kind, h.name, lo, hi), dt, off))
                off += (hi - lo) * torch.empty(0, dtype=dt).element_size()
        rt.save_buffer = SaveBuffer(entries, off)
    buf = rt.save_buffer
    return buf.like() if buf.busy else buf


@torch.no_grad()
def fill_buffer(engine) -> SaveBuffer:
    """Copy this rank's share of the save into host memory (:func:`_save_buffer`), marked busy
    until written. On CPU ranks one batched copy from views of the live state cached with the
    buffer (:meth:`SaveBuffer.copies`); on an accelerator each run is packed there and copied
    over."""
    rt, rank = engine.runtime, engine.global_rank
    sv = StateView(rt, engine.param_table, rank, engine.precision.mixed)
    opt, buf = rt.optimizer, _save_buffer(engine)
    pairs = buf.copies(sv, opt) if engine.device.type == "cpu" else None
    if pairs is not None:
        _copy_all(*pairs)
        buf.busy = True
        return buf
    for (h, (kind, name, lo, hi), dt, _), view in zip(buf.entries, buf.views):
        if not _has_state(opt, kind, h):
            # before the first step Adam has no moments: they are zeros (StateView.buffer
            # would insert them into the state without a step, which AdamW then trips over)
            view.zero_()
            continue
        part = [Transfer(rank, rank, kind, name, lo, hi)]
        if engine.device.type == "cpu":
            pack_parts(sv, part, view)
        else:
            view.copy_(pack_parts(sv, part, torch.empty(hi - lo, dtype=dt, device=engine.device)))
    buf.busy = True
    return buf


def _has_state(opt, kind: str, h) -> bool:
    return kind not in STATE_KINDS or kind in opt.optimizer.state[opt.masters[h.buf]]


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if not dsts:            # a rank that writes nothing (suspended; replicas write its share)
        return
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:                   # pragma: no cover - older torch
        for d, s in zip(dsts, srcs):
            d.copy_(s)


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
    header: dict                # the rank file's fields but its slices: plain data
    buffer: SaveBuffer | None   # the slices, in host memory (None once written)
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
    meta = meta_record(sid, tag, plan, world, rt.zero_stage, prec.name, prec.mixed, adam_step,
                       (engine.global_steps, engine.skipped_steps, engine.global_samples),
                       engine.param_table)
    meta["stored"] = ONE_COPY
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
    buf = fill_buffer(engine)
    header = {"format": FORMAT, "save_id": sid, "rank": rank, "meta": meta, "engine": state,
              "index": buf.index, "data_bytes": buf.data_bytes}
    return Snapshot(Path(save_dir), tag, rank, meta, header, buf, save_latest)


def write_rank_file(path: Path, header: dict, buf: SaveBuffer) -> bool:
    """A raw rank file (``ckpt_format``): the header (``torch.save``, plain data) and the
    buffer's bytes, written from host memory straight to disk where the file system takes
    ``O_DIRECT`` (``fileio.atomic_write_chunks``). Returns whether it did."""
    import io

    from torch.utils.serialization import config

    hb = io.BytesIO()
    with config.patch({"save.compute_crc32": False}):
        torch.save(header, hb)
    hb = hb.getvalue()
    head = aligned_buffer(raw_data_start(len(hb)))
    head[:len(RAW_MAGIC) + 8 + len(hb)] = RAW_MAGIC + len(hb).to_bytes(8, "little") + hb
    return atomic_write_chunks(path, [memoryview(head), buf.data()])


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
        write_rank_file(rank_file(d, rank), snap.header, snap.buffer)
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree
        err = f"rank {rank} could not write {rank_file(d, rank)}: {type(e).__name__}: {e}"
    snap.buffer.busy, snap.buffer = False, None     # the next save may fill it again
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
