"""Full tensors from an app checkpoint, by reading files only: MalleusEngine slice files of any
plan (assembled), engine=torch state, DeepSpeed pp=1 module states."""
from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..files.safe_load import UnsafeFile, load_plain, read_json, read_small_text
from .hf_folder import (ExportError, Exported, _dtype, _hf_record, build_config, check_out_dir,
                        is_tied, write_folder)

# ----------------------------------------------------------------------------- assembling


class Assembler:
    """Full tensors from canonical flat intervals (``malleus_ds/layout.py``: the full tensor with
    its TP split dim moved to the front, flattened). ``specs``: name -> (shape, split dim)."""

    def __init__(self, specs: Mapping[str, tuple[Sequence[int], int | None]], where: str,
                 names: Sequence[str] | None = None) -> None:
        self.specs = {n: (tuple(int(x) for x in s), d) for n, (s, d) in specs.items()}
        self.where = where
        self.names = list(self.specs) if names is None else list(names)
        self._wanted = set(self.names)
        self.flat: dict[str, torch.Tensor] = {}
        self.cover: dict[str, list[tuple[int, int]]] = {}

    def wanted(self, name: str) -> bool:
        return name in self._wanted

    def add(self, name: str, lo: int, hi: int, flat: torch.Tensor) -> None:
        if name not in self.specs:
            raise ExportError(f"{self.where}: holds a slice of {name!r}, which its parameter "
                              f"table does not list")
        n = prod(self.specs[name][0])
        if not 0 <= lo < hi <= n or flat.numel() != hi - lo:
            raise ExportError(f"{self.where}: slice {name}[{lo}:{hi}] holds {flat.numel()} "
                              f"elements of a {n}-element tensor")
        buf = self.flat.get(name)
        if buf is None:
            buf = self.flat[name] = torch.empty(n, dtype=torch.float32)
        buf[lo:hi].copy_(flat.reshape(-1))
        self.cover.setdefault(name, []).append((lo, hi))

    def finish(self) -> dict[str, torch.Tensor]:
        from ..layout import merge, subtract

        out = {}
        for name in self.names:
            shape, d = self.specs[name]
            n = prod(shape)
            gaps = subtract([(0, n)], merge(self.cover.get(name, [])))
            if gaps:
                raise ExportError(f"{self.where}: no rank stored elements {gaps[:3]} of {name} "
                                  f"({n} elements): the checkpoint is incomplete")
            flat = self.flat[name]
            if d is None or len(shape) == 0:
                out[name] = flat.reshape(shape)
            else:
                moved = (shape[d],) + shape[:d] + shape[d + 1:]
                out[name] = flat.reshape(moved).movedim(0, d).contiguous()
        return out


def _tied(record: Mapping) -> bool:
    """Whether the recorded model ties its embeddings (read off the rebuilt config: a diff dict
    leaves out values equal to the defaults)."""
    return is_tied(build_config(record))


def _needed(names: Sequence[str], record: Mapping) -> list[str]:
    """The global names the export needs: a tied model's head copy is left out."""
    tied = _tied(record)
    return [n for n in names if not (tied and n == "head.lm_head.weight")]


# ----------------------------------------------------------------------------- readers


def open_meta(tag_dir: Path) -> tuple[Path, dict, int, bool, dict]:
    """A MalleusEngine checkpoint's ``(tag folder, meta.json, world size, mixed precision?,
    parameter specs name -> (shape, split dim))``; ExportError naming the file otherwise."""
    from ..files.ckpt_format import CheckpointError, resolve

    try:
        d, meta = resolve(tag_dir.parent, tag_dir.name)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    try:
        world = int(meta["world_size"])
        mixed = bool(meta["precision"]["mixed"])
        specs = {n: (s, dim) for n, (s, dim) in meta["params"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{d / 'meta.json'}: malformed ({type(e).__name__}: {e})") from None
    return d, meta, world, mixed, specs


def read_slices(d: Path, meta: dict, world: int, asms: Mapping[str, Assembler]) -> dict:
    """Every rank file's slices of the kinds in ``asms`` (saved kind -> its Assembler) added to
    their Assembler (the names it wants); returns rank 0's engine state."""
    from ..files.ckpt_format import CheckpointError, open_rank_file, rank_file

    missing = [r for r in range(world) if not rank_file(d, r).is_file()]
    if missing:
        raise ExportError(f"checkpoint {d} was saved by {world} ranks but lacks "
                          f"{rank_file(d, missing[0])}"
                          + (f" (and {len(missing) - 1} more rank files)" if len(missing) > 1
                             else ""))
    state = {}
    for r in range(world):
        try:
            ck = open_rank_file(d, r, meta)
        except CheckpointError as e:
            raise ExportError(str(e)) from None
        if r == 0:
            state = ck.get("engine") or {}
        where = rank_file(d, r)
        for key, t in ck.get("slices", {}).items():
            try:
                k, name, lo, hi = key
            except (TypeError, ValueError):
                raise ExportError(f"{where}: malformed slice key {key!r}") from None
            if k in asms and asms[k].wanted(name):
                asms[k].add(name, int(lo), int(hi), t)
        del ck                                  # unmaps the file
    return state


def read_malleus(tag_dir: Path, record: Mapping) -> dict[str, torch.Tensor]:
    """Full fp32 tensors (masters under bf16/fp16, else parameters) from MalleusEngine's per-rank
    slice files, whatever plan and world size saved them."""
    d, meta, world, mixed, specs = open_meta(tag_dir)
    kind = "master" if mixed else "param"
    asm = Assembler(specs, str(d), _needed(list(specs), record))
    read_slices(d, meta, world, {kind: asm})
    return asm.finish()


def _state_by_global(sd: Mapping[str, torch.Tensor], f: Path, record: Mapping,
                     prefix: str = "model.") -> dict[str, torch.Tensor]:
    """A reference model's state dict (``HFCausalLM``: ``model.<HF name>``) -> our global names."""
    from ..interop.names import global_name

    out = {}
    for k, v in sd.items():
        if not k.startswith(prefix):
            raise ExportError(f"{f}: key {k!r} is not a weight of the reference model "
                              f"(expected '{prefix}<Hugging Face name>')")
        try:
            out[global_name(k[len(prefix):])] = v
        except KeyError:
            raise ExportError(f"{f}: key {k!r} is not a Llama-family weight") from None
    if _tied(record):
        out.pop("head.lm_head.weight", None)
    return {k: v.float() for k, v in out.items()}


def read_torch(tag_dir: Path, record: Mapping, step: int | None) -> dict[str, torch.Tensor]:
    from ..files.ckpt_format import TORCH_FORMAT as FORMAT, TORCH_STATE_FILE as STATE_FILE

    f = tag_dir / STATE_FILE
    if not f.is_file():
        raise ExportError(f"checkpoint {tag_dir} (engine=torch) has no {STATE_FILE}")
    try:
        st = load_plain(f, "engine=torch checkpoint file")
    except UnsafeFile as e:
        raise ExportError(str(e)) from None
    if not isinstance(st, dict) or st.get("format") != FORMAT or not isinstance(st.get("model"), dict):
        raise ExportError(f"{f}: not a {FORMAT} file")
    if step is not None and st.get("step") != step:
        raise ExportError(f"{f} holds step {st.get('step')}, its run.json step {step}: the "
                          f"folder mixes two saves")
    return _state_by_global(st["model"], f, record)


def read_deepspeed(tag_dir: Path, record: Mapping, run: Mapping) -> dict[str, torch.Tensor]:
    pp = int((run.get("parallel") or {}).get("pp", 1))
    if pp != 1:
        raise ExportError(f"checkpoint {tag_dir} was saved by engine=deepspeed with parallel.pp="
                          f"{pp}: malleus-export reads stock DeepSpeed checkpoints of pp=1 only "
                          f"(not PipelineEngine's per-layer files); train with engine=malleus, "
                          f"whose checkpoints export under any layout")
    prec = run.get("precision", "fp32")
    if prec != "fp32":
        raise ExportError(f"checkpoint {tag_dir} was saved by engine=deepspeed in {prec}: its "
                          f"fp32 weights live only in DeepSpeed's ZeRO optimizer files, which "
                          f"malleus-export does not read; train with engine=malleus (its fp32 "
                          f"masters export) or in fp32")
    f = tag_dir / "mp_rank_00_model_states.pt"
    if not f.is_file():
        raise ExportError(f"checkpoint {tag_dir} (engine=deepspeed) has no {f.name}")
    from ..interop.compat import load_deepspeed_file

    try:    # DeepSpeed's own file: plain data and DeepSpeed's few value classes, nothing else
        st = load_deepspeed_file(f, "cpu")
    except UnsafeFile as e:
        raise ExportError(str(e)) from None
    if not isinstance(st, dict) or not isinstance(st.get("module"), Mapping):
        raise ExportError(f"{f}: no 'module' state dict (not a DeepSpeed model-states file)")
    return _state_by_global(st["module"], f, record)


# ----------------------------------------------------------------------------- checkpoints


def find_checkpoint(ckpt_dir) -> tuple[Path, dict]:
    """``(tag folder, run.json)`` of an app checkpoint root (``latest``) or tag folder."""
    from ..files.ckpt_format import LATEST, RUN_FILE, RUN_FORMAT as FORMAT

    p = Path(ckpt_dir)
    if not p.exists():
        raise ExportError(f"checkpoint directory {p} does not exist")
    if not p.is_dir():
        raise ExportError(f"checkpoint {p} is not a folder (give checkpoint.dir or one of its "
                          f"global_step* folders)")
    if (p / RUN_FILE).is_file():
        d = p
    elif (p / LATEST).is_file():
        try:
            tag = read_small_text(p / LATEST, "'latest' file").strip()
        except UnsafeFile as e:
            raise ExportError(str(e)) from None
        d = p / tag
        if not tag or not (d / RUN_FILE).is_file():
            raise ExportError(f"{p / LATEST} names {tag!r} but {d / RUN_FILE} does not exist: an "
                              f"unfinished save, or not a checkpoint written by launch/train.py")
    elif (p / "meta.json").is_file():
        raise ExportError(f"{p} has no {RUN_FILE}: a MalleusEngine.save_checkpoint folder without "
                          f"the app's record of the model; export a checkpoint written by "
                          f"launch/train.py (checkpoint.dir=...), or call "
                          f"malleus_ds.export_engine(engine, out_dir) on the running engine")
    else:
        raise ExportError(f"{p} is not a checkpoint: it has neither {RUN_FILE} (a checkpoint "
                          f"folder) nor '{LATEST}' (a checkpoint.dir written by launch/train.py)")
    rf = d / RUN_FILE
    try:
        run = read_json(rf, "checkpoint run record")
    except UnsafeFile as e:
        raise ExportError(str(e)) from None
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        raise ExportError(f"{rf}: not a {FORMAT} record")
    return d, run


def _export_checkpoint(ckpt_dir, out_dir, dtype: str | None = None, force: bool = False
                       ) -> tuple[Exported, Path, dict]:
    d, run = find_checkpoint(ckpt_dir)
    record = _hf_record(run.get("model"), f"checkpoint {d}")
    _dtype(dtype)
    check_out_dir(out_dir, force)       # before reading any weights
    engine = run.get("engine")
    if engine == "malleus":
        state = read_malleus(d, record)
    elif engine == "torch":
        state = read_torch(d, record, run.get("step"))
    elif engine == "deepspeed":
        state = read_deepspeed(d, record, run)
    else:
        raise ExportError(f"checkpoint {d}: engine={engine!r} is not one malleus-export reads "
                          f"(malleus, torch, deepspeed)")
    return write_folder(out_dir, record, state, where=f"checkpoint {d}", dtype=dtype,
                        force=force), d, run


def export_checkpoint(ckpt_dir, out_dir, dtype: str | None = None, force: bool = False) -> Path:
    """Write the app checkpoint ``ckpt_dir`` (root with ``latest``, or a tag folder) as a Hugging
    Face folder ``out_dir``; returns ``out_dir``. ``dtype``: None/"fp32", "bf16" or "fp16"."""
    return _export_checkpoint(ckpt_dir, out_dir, dtype, force)[0].path
