"""Export from a running MalleusEngine (collective): each TP slice sent to rank 0 once."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..resilience.agreement import raise_if_any_failed
from .hf_folder import ExportError, _dtype, _hf_record, _summary, check_out_dir, write_folder
from .readers import Assembler, _needed

# ----------------------------------------------------------------------------- running engine


def _senders(plan, table, names: Sequence[str]) -> dict[tuple[str, int, int], int]:
    """``(name, lo, hi) -> rank`` that sends that TP slice: its lowest holder (pure: the same
    on every rank)."""
    from ..layout import plan_holdings

    out: dict[tuple[str, int, int], int] = {}
    wanted = set(names)
    for (kind, name), entries in plan_holdings(plan, table, 0, False).items():
        if kind != "param" or name not in wanted:
            continue
        for lo, hi, r in entries:
            key = (name, lo, hi)
            out[key] = min(out.get(key, r), r)
    return out


def export_engine(engine, out_dir, dtype: str | None = None, force: bool = False) -> Path:
    """Collective on a running MalleusEngine: gather every full tensor (fp32 masters under
    bf16/fp16) to rank 0, which writes the folder. Every rank returns ``out_dir`` or raises the
    same :class:`ExportError`."""
    import torch.distributed as tdist

    cfg = engine.model_cfg
    desc = cfg.describe()
    record = _hf_record(desc, f"engine model {getattr(cfg, 'name', '?')}")   # same on every rank
    _dtype(dtype)
    rank = engine.global_rank

    def agree(err: str | None) -> None:     # through the store (agreement.py), never a hang
        raise_if_any_failed("export", err, "export", ExportError)

    err = None
    if rank == 0:
        try:
            check_out_dir(out_dir, force)
        except ExportError as e:
            err = str(e)
    agree(err)
    table = engine.param_table
    names = _needed([s.name for s in table], record)
    senders = _senders(engine.plan, table, names)
    params = engine.local_params()          # collective under bf16/fp16 (masters gathered)
    mine = []
    for n, t in params.items():
        spec = table[n]
        if spec.split_dim is None:
            lo, hi = 0, spec.numel
        else:
            lo, hi = spec.tp_interval(engine.tp_rank, engine.tp_size)
        if senders.get((n, lo, hi)) != rank:
            continue
        flat = t.detach().float()
        if spec.split_dim is not None:
            flat = flat.movedim(spec.split_dim, 0)
        mine.append((n, lo, hi, flat.reshape(-1).cpu().clone()))
    got = [None] * engine.world_size if rank == 0 else None
    tdist.gather_object(mine, got, dst=0)
    err = None
    if rank == 0:
        try:
            specs = {s.name: (s.shape, s.split_dim) for s in table}
            asm = Assembler(specs, "engine", names)
            for part in got:
                for n, lo, hi, flat in part:
                    asm.add(n, lo, hi, flat)
            res = write_folder(out_dir, record, asm.finish(), where="engine", dtype=dtype,
                               force=force)
            print(f"[malleus_ds] {_summary(res)}", flush=True)
        except (ExportError, OSError) as e:
            err = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
        del got
    agree(err)
    return Path(out_dir)
