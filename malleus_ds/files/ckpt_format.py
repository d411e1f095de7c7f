"""The checkpoint file formats: names, format strings and the checked readers of the files.

Bottom layer: the engine (``engine/checkpoint.py`` writes and loads), the app (``app/runners/``
writes run records around it) and ``malleus-export`` (reads any of them) all take the formats
from here; none reaches into another's files.

MalleusEngine's tag folder (``save_dir/tag/``; details in ``engine/checkpoint.py``):

* ``malleus_rank{r:05d}.pt`` per rank of the saving world (:func:`rank_file`), checked by
  :func:`open_rank_file`: ``{"format": FORMAT, "save_id", "rank", "meta", "engine":
  {ENGINE_FIELDS}, "slices": {(kind, name, lo, hi): 1-D tensor}}``, loaded as plain data only.
  Written as a *raw rank file* (:data:`RAW_MAGIC`): the magic, the header's length (8 bytes,
  little-endian), the header (a ``torch.save`` image of every field but ``slices``, plus
  ``"index": {(kind, name, lo, hi): (dtype name, byte offset)}`` and ``"data_bytes"``), zeros up
  to the next :data:`~malleus_ds.files.fileio.DIRECT_ALIGN` boundary (:func:`raw_data_start`), then the
  slices' bytes, each at its offset from there; the slices are views of the memory-mapped file.
  Files written before that are ``torch.save`` zip archives of the same dict; both load;
* ``meta.json`` (:data:`META`, the commit record, written last), read by :func:`resolve`;
* ``save_dir/latest`` (:data:`LATEST`): the newest tag.

The app's checkpoint folder (``checkpoint.dir``, ``app/runners/checkpoint.py``): ``latest`` and one
folder per save holding ``run.json`` (:data:`RUN_FILE`, format :data:`RUN_FORMAT`) next to the
engine's files; ``engine=torch`` writes :data:`TORCH_STATE_FILE` (format :data:`TORCH_FORMAT`).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from .fileio import round_up
from .safe_load import UnsafeFile, load_plain, load_plain_bytes, read_json, read_small_text

# ------------------------------------------------------------------ the app's checkpoint folder

#: run.json's format string (app/runners/resume.py)
RUN_FORMAT = "malleus_ds-run-checkpoint-v1"
RUN_FILE = "run.json"
#: engine=torch's state file and its format string (app/runners/torch_runner.py)
TORCH_STATE_FILE = "torch_state.pt"
TORCH_FORMAT = "malleus_ds-torch-state-v1"

# ------------------------------------------------------------------ MalleusEngine's tag folder

FORMAT = "malleus-checkpoint-v1"
#: the largest world a checkpoint record may claim (a damaged one must not loop for ever)
MAX_WORLD = 2**20
META = "meta.json"
LATEST = "latest"
#: a raw rank file's first 8 bytes (a torch.save zip archive starts with "PK")
RAW_MAGIC = b"MALLEUSr"
#: the most a raw rank file's header may claim (ours: kilobytes; a damaged length must not be
#: read into memory)
MAX_HEADER_BYTES = 64 * 2**20
#: the dtypes a raw rank file's slices may have, by the name its index gives
RAW_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "float64": torch.float64}


def raw_data_start(header_len: int) -> int:
    """Where a raw rank file's slice bytes begin, after the magic, the length and the header."""
    return round_up(len(RAW_MAGIC) + 8 + header_len)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the numbers."""


def rank_file(d: Path, rank: int) -> Path:
    return d / f"malleus_rank{rank:05d}.pt"


def table_json(table) -> dict[str, list]:
    """``meta.json``'s ``params``: each parameter's full shape and split dim, by global name."""
    return {s.name: [list(s.shape), s.split_dim] for s in table}


def meta_record(sid: int, tag: str, plan, world: int, zero_stage: int, precision: str,
                mixed: bool, adam_step: int, counters: tuple[int, int, int], table) -> dict:
    """A save's ``meta.json`` (module doc of ``engine/checkpoint.py``); ``counters``: global
    steps, skipped steps, global samples. The one record every writer of this format fills in (a
    save, and ``interop/checkpoint_import.write_malleus``'s conversion of a DeepSpeed
    checkpoint)."""
    return {"format": FORMAT, "save_id": sid, "tag": tag, "plan": plan.to_json(),
            "world_size": world, "zero_stage": zero_stage,
            "precision": {"name": precision, "mixed": mixed},
            "num_layers": plan.num_layers, "global_batch_size": plan.global_batch_size,
            "micro_batch_size": plan.micro_batch_size, "adam_step": adam_step,
            "global_steps": counters[0], "skipped_steps": counters[1],
            "global_samples": counters[2], "params": table_json(table)}


def scaler_state(scaler) -> dict | None:
    """The loss scaler's mutable state, for checkpoints and re-planning."""
    if scaler is None:
        return None
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {k: getattr(scaler, k) for k in keys if hasattr(scaler, k)}


def resolve(load_dir, tag=None) -> tuple[Path, dict]:
    """``(tag directory, meta.json)``; CheckpointError (the same on every rank: it reads only
    shared files) if anything is missing. Pure apart from reading files."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{root} has no '{LATEST}' file; pass tag=... (the "
                                  f"subdirectory to load) or save with save_latest=True")
        try:
            tag = read_small_text(latest, "'latest' file").strip()
        except UnsafeFile as e:
            raise CheckpointError(str(e)) from None
    d = root / str(tag)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint {d} does not exist (tag {tag!r} in {root})")
    mf = d / META
    if not mf.is_file():
        raise CheckpointError(f"checkpoint {d} has no {META}: its save did not finish (or it was "
                              f"not written by MalleusEngine.save_checkpoint)")
    try:
        meta = read_json(mf, "checkpoint record")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        meta = meta if isinstance(meta, dict) else {}
        raise CheckpointError(f"{mf}: format {meta.get('format')!r}, this engine reads {FORMAT!r}")
    return d, meta


#: the engine-state fields of a rank file and the types they must have
ENGINE_FIELDS = {"adam_step": int, "global_steps": int, "skipped_steps": int,
                  "global_samples": int, "loss_scaler": (dict, type(None)),
                  "lr_scheduler": (dict, type(None)), "param_groups": list, "client_state": dict}


def open_rank_file(d: Path, r: int, meta: dict) -> dict:
    """Saved rank ``r``'s file, memory-mapped (slices are paged in when read), loaded as plain
    data (``weights_only=True``: a file that names any class or function is refused, whoever
    wrote it) and checked field by field against its format and meta.json."""
    f = rank_file(d, r)
    try:
        ck = _open_raw(f) if _is_raw(f) else load_plain(f, "MalleusEngine checkpoint file")
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT or ck.get("rank") != r:
        got = (f"format {ck.get('format')!r}, rank {ck.get('rank')!r}" if isinstance(ck, dict)
               else f"a {type(ck).__name__}")
        raise CheckpointError(f"{f}: not a {FORMAT} file of rank {r} ({got}): the folder holds "
                              f"a file that is not this save's; copy the checkpoint again or use "
                              f"another tag")
    if ck.get("save_id") != meta["save_id"]:
        raise CheckpointError(f"{f}: written by another save (id {ck.get('save_id')}) than "
                              f"{d / META} (id {meta['save_id']}); {d} mixes two checkpoints")
    extra = sorted(set(ck) - {"format", "save_id", "rank", "meta", "engine", "slices"})
    st, sl = ck.get("engine"), ck.get("slices")
    bad = (f"unexpected keys {extra}" if extra else
           "no 'engine' state" if not isinstance(st, dict) else
           "no 'slices'" if not isinstance(sl, dict) else None)
    if bad is None:
        bad = next((f"engine[{k!r}] is {st.get(k)!r}" for k, t in ENGINE_FIELDS.items()
                    if not isinstance(st.get(k), t) or isinstance(st.get(k), bool)), None)
    if bad is None:
        bad = next((f"slice key {k!r}" for k, v in sl.items()
                    if not (isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], str)
                            and isinstance(k[1], str) and isinstance(k[2], int)
                            and isinstance(k[3], int) and isinstance(v, torch.Tensor))), None)
    if bad is not None:
        raise CheckpointError(f"{f}: not a well-formed {FORMAT} file ({bad}); it was altered "
                              f"or written by something else: copy it again or use another tag")
    return ck


def _is_raw(f: Path) -> bool:
    try:
        with open(f, "rb") as fh:
            return fh.read(len(RAW_MAGIC)) == RAW_MAGIC
    except OSError:
        return False            # load_plain names what is wrong with it


def _open_raw(f: Path) -> dict:
    """A raw rank file (module docstring): the header as plain data (``weights_only``), its
    ``index`` checked against the file's size, ``slices`` as views of the file mapped
    copy-on-write (pages are read when a slice is). Raises :class:`UnsafeFile`."""
    what = "MalleusEngine checkpoint file"
    with open(f, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(len(RAW_MAGIC) + 8)
        n = int.from_bytes(head[len(RAW_MAGIC):], "little") if len(head) == len(RAW_MAGIC) + 8 \
            else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - len(head)):
            raise UnsafeFile(f"{f}: a raw rank file of {size} bytes claiming a {n}-byte header: "
                             f"the {what} is truncated or corrupted (an interrupted copy?); copy "
                             f"it again from its source, or use another checkpoint (tag)")
        ck = load_plain_bytes(fh.read(n), f, what)
        start = raw_data_start(n)
        index, data_bytes = (ck.get("index"), ck.get("data_bytes")) if isinstance(ck, dict) \
            else (None, None)
        if not isinstance(index, dict) or type(data_bytes) is not int \
                or not 0 <= data_bytes <= size - start:
            got = (f"{data_bytes!r} data bytes after byte {start}" if isinstance(index, dict)
                   else "no slice index")
            raise UnsafeFile(f"{f}: a raw rank file of {size} bytes with {got}: the {what} is "
                             f"truncated or corrupted; copy it again from its source, or use "
                             f"another checkpoint (tag)")
        mem = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if data_bytes else None
    ck["slices"] = {key: _raw_slice(f, mem, start, data_bytes, key, entry)
                    for key, entry in index.items()}
    del ck["index"], ck["data_bytes"]
    return ck


def _raw_slice(f: Path, mem, start: int, data_bytes: int, key, entry) -> torch.Tensor:
    ok = (isinstance(key, tuple) and len(key) == 4 and type(key[2]) is int
          and type(key[3]) is int and key[2] <= key[3] and isinstance(entry, tuple)
          and len(entry) == 2 and entry[0] in RAW_DTYPES and type(entry[1]) is int)
    if ok:
        dt, off, n = RAW_DTYPES[entry[0]], entry[1], key[3] - key[2]
        size = torch.empty(0, dtype=dt).element_size()
        ok = 0 <= off and off % size == 0 and off + n * size <= data_bytes
    if not ok:
        raise UnsafeFile(f"{f}: slice {key!r} at {entry!r} is not one of {sorted(RAW_DTYPES)} "
                         f"at an offset within the file's {data_bytes} data bytes: the raw rank "
                         f"file is corrupted; copy it again from its source, or use another "
                         f"checkpoint (tag)")
    if n == 0:
        return torch.empty(0, dtype=dt)
    return torch.frombuffer(mem, dtype=dt, count=n, offset=start + off)
