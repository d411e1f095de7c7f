"""Reading a checkpoint under another plan is a transfer plan whose sources are files (DESIGN.md
§6): pure planning, no file is opened here (``engine/checkpoint.py`` opens them).

:func:`wants` lists what this rank must fill under the running plan (from its holdings,
``layout.holdings``); :func:`plan_reads` picks, for every part, the saved rank whose file holds
it, cut at every saved holding boundary as the live transfer plan (``transfer.py``) cuts them.
:func:`one_copy` says which rank's file stores each element when a save writes every element once
(replicas split what they share), for the saver and the reader alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..files.ckpt_format import CheckpointError
from ..layout import STATE_KINDS, Hold, merge, subtract
from .transfer import HolderIndex


@dataclass(frozen=True)
class Want:
    """Fill elements ``[lo, hi)`` of ``kind`` of ``name`` (running engine) from the checkpoint's
    ``src_kind`` (the same kind, or the other fp32 copy of the weights across precisions)."""

    kind: str
    src_kind: str
    name: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Read:
    """Copy elements ``[lo, hi)`` of ``src_kind`` of ``name`` from saved rank ``file_rank``'s file
    into ``kind`` of this rank's running state."""

    file_rank: int
    src_kind: str
    kind: str
    name: str
    lo: int
    hi: int


def wants(holds: Iterable[Hold], *, mixed: bool, saved_mixed: bool, same_param_dtype: bool,
          optimizer_states: bool = True) -> list[Want]:
    """What this rank must read, from its current ``holds`` (``layout.holdings``), in a
    deterministic order. ``mixed`` / ``saved_mixed``: bf16/fp16 now / in the checkpoint;
    ``same_param_dtype``: the checkpoint's parameters have the running parameter dtype."""
    by: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for h in holds:
        by.setdefault((h.kind, h.name), []).append((h.lo, h.hi))
    ivs = {k: merge(v) for k, v in by.items()}
    fp32 = "master" if saved_mixed else "param"      # the checkpoint's fp32 weights
    out = []
    for (kind, name), iv in sorted(ivs.items()):
        if kind in STATE_KINDS:
            src = kind if optimizer_states else None
        elif kind == "master":
            src = fp32
        elif not mixed:
            src = fp32
        else:
            # low-precision parameters where this rank has a master are casts of it (derived
            # after the reads, as training does); elsewhere read the saved parameters if they
            # have this dtype, else cast the saved fp32 weights
            iv = subtract(iv, ivs.get(("master", name), []))
            src = "param" if same_param_dtype else fp32
        if src is not None:
            out += [Want(kind, src, name, a, b) for a, b in iv]
    return out


#: ``meta["stored"]`` of a checkpoint whose files hold every element once (:func:`one_copy`);
#: absent: every rank stored all it held (older checkpoints)
ONE_COPY = "one-copy"


def one_copy(saved: dict[tuple[str, str], list[tuple[int, int, int]]]
             ) -> dict[tuple[str, str], list[tuple[int, int, int]]]:
    """What each rank's file stores when every element is written once: ``saved``
    (``plan_holdings``: ``(kind, name) -> [(lo, hi, rank)]``) cut at every holding boundary, each
    piece held by ``k`` ranks (data-parallel replicas of a parameter; under ZeRO-0 of the
    optimizer state too) split into ``k`` near-equal runs, the i-th stored by the i-th lowest
    holder. So the replicas share the writing, each element is on disk once, and the result is
    again a ``plan_holdings`` map the reader (:func:`plan_reads`) takes as it is. Pure and
    deterministic: the saver and every reader compute the same."""
    out: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for key, entries in saved.items():
        idx = HolderIndex(entries)
        runs = out.setdefault(key, [])
        for i, holders in enumerate(idx.holders):
            a, b, k = idx.cuts[i], idx.cuts[i + 1], len(holders)
            for j, r in enumerate(holders):
                lo, hi = a + (b - a) * j // k, a + (b - a) * (j + 1) // k
                if hi > lo:
                    runs.append((lo, hi, r))
    return out


def plan_reads(ws: Sequence[Want], saved: dict[tuple[str, str], list[tuple[int, int, int]]],
               rank: int, saved_world: int, home: int | None = None) -> list[Read]:
    """Which saved rank's file each part of each want comes from. ``saved``: ``plan_holdings``
    of the saved plan (saved ZeRO stage and precision). Every element is read exactly once, from
    one saved holder, and each read lies inside ONE saved holding (cut at every holding boundary,
    as the live transfer plan cuts them). Holder choice: a file this rank opens anyway (``home``,
    then files already chosen) first, so few files are opened; then the holder ``(h - rank) mod
    saved_world`` nearest, which spreads the ranks' reads over the files."""
    used = {home} if home is not None else set()
    sources: dict[tuple[str, str], HolderIndex] = {}
    out = []
    for w in ws:
        key = (w.src_kind, w.name)
        src = sources.get(key)
        if src is None:
            entries = saved.get(key)
            if not entries:
                raise CheckpointError(f"the checkpoint holds no {w.src_kind} of {w.name} (this "
                                      f"rank needs elements [{w.lo}, {w.hi}) of it as {w.kind})")
            src = sources[key] = HolderIndex(entries)
        try:
            for a, b, holders in src.split(w.lo, w.hi):
                h = min(holders, key=lambda r: (r not in used, (r - rank) % saved_world))
                used.add(h)
                out.append(Read(h, w.src_kind, w.kind, w.name, a, b))
        except ValueError as e:
            raise CheckpointError(f"the checkpoint's {w.src_kind} of {w.name}: {e}") from None
    return out
