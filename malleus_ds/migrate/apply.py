"""Engine state by slice: read and write a runtime's buffers by (kind, tensor, canonical interval).

The slice map (``malleus_ds.layout.holdings``) says where each held interval lives: a parameter
shard (``param``) or a bucket's optimizer range (``master`` / ``exp_avg`` / ``exp_avg_sq``). A
canonical interval of a parameter shard is, in memory, up to three 2-D strided windows of the
shard viewed split-dim-first (``(rows along the split dim, the rest)``): a partial first row, whole
rows, a partial last row — e.g. a column block of a row-parallel weight is whole rows of its
transposed view. Optimizer ranges are flat fp32 vectors. :func:`pack_parts` / :func:`unpack_parts`
move many such windows in one ``malleus_ds_kernels.pack`` call (one Triton launch on GPU).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Sequence

import torch

from malleus_ds_kernels.pack import pack, unpack, window_of

from ..views import as_rows, row_windows
from ..layout import Hold, ParamTable, holdings
from .transfer import Transfer


def canonical_2d(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``t`` viewed split-dim-first as (rows, cols), row-major = the canonical flat order."""
    return t.view(1, -1) if dim is None else as_rows(t.movedim(dim, 0))


class StateView:
    """Slices of one :class:`~malleus_ds.engine.runtime.PlanRuntime`'s state by global name."""

    def __init__(self, rt, table: ParamTable, rank: int, mixed: bool) -> None:
        self.rt, self.table = rt, table
        self.index: dict[tuple[str, str], list[Hold]] = {}
        for h in holdings(rt.plan, table, rank, rt.zero_stage, mixed, rt.buckets):
            self.index.setdefault((h.kind, h.name), []).append(h)
        for v in self.index.values():
            v.sort(key=lambda h: h.lo)
        self._starts = {k: [h.lo for h in v] for k, v in self.index.items()}
        self._canon: dict[str, torch.Tensor] = {}

    def holds(self, kind: str | None = None) -> Iterable[Hold]:
        for (k, _), hs in self.index.items():
            if kind is None or k == kind:
                yield from hs

    def buffer(self, kind: str, buf) -> torch.Tensor:
        """The tensor holding ``kind`` at buffer ``buf`` (param name or bucket index)."""
        if kind == "param":
            return self.rt.named[buf].data
        opt = self.rt.optimizer
        m = opt.masters[buf]
        if kind == "master":
            return m.data
        return opt.moments(m)[kind]

    def views(self, kind: str, name: str, lo: int, hi: int, natural: bool = False
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(base, view)`` pairs covering elements ``[lo, hi)`` of ``kind`` of ``name``, in order.

        ``natural``: a parameter slice made of whole indices along its split dim (every TP slice
        and every difference of TP slices) is returned as ONE view in the tensor's own memory
        order (``narrow`` along the split dim) instead of the canonical, split-dim-first order:
        for a row-parallel weight that avoids a transposing copy on both ends. Both ends of a
        transfer of the same kind must use the same setting (the packed layout differs)."""
        hs, starts = self.index.get((kind, name)), self._starts.get((kind, name))
        if not hs:
            raise KeyError(f"this rank holds no {kind} of {name}")
        out = []
        i = max(0, bisect_right(starts, lo) - 1)
        a = lo
        while a < hi:
            if i >= len(hs) or hs[i].lo > a or hs[i].hi <= a:
                raise KeyError(f"this rank does not hold {kind} {name}[{a}:{hi}]")
            h = hs[i]
            b = min(hi, h.hi)
            base = self.buffer(kind, h.buf)
            x = h.off + a - h.lo
            spec = self.table[name] if kind == "param" else None
            R = spec.numel // spec.shape[spec.split_dim] if spec and spec.split_dim is not None \
                else 0
            if natural and R and x % R == 0 and (b - a) % R == 0:
                out.append((base, base.narrow(spec.split_dim, x // R, (b - a) // R)))
            elif kind == "param":
                v = self._canon.get(name)
                if v is None:
                    v = self._canon[name] = canonical_2d(base, self.table[name].split_dim)
                out += [(base, w) for w in row_windows(v, x, b - a)]
            else:
                out.append((base, base[x:x + b - a]))
            a, i = b, i + 1
        return out


def _windows(view_pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    tensors: list[torch.Tensor] = []
    ids: dict[int, int] = {}
    wins = []
    for base, v in view_pairs:
        k = ids.get(id(base))
        if k is None:
            k = ids[id(base)] = len(tensors)
            tensors.append(base)
        wins.append(window_of(k, base, v))
    return tensors, wins


def pack_parts(sv: StateView, parts: Iterable[Transfer], out: torch.Tensor,
               natural: bool = False) -> torch.Tensor:
    """Pack the elements of ``parts`` (read from ``sv``) back to back into ``out`` (canonical
    order; ``natural``: see :meth:`StateView.views`)."""
    pairs = [p for t in parts for p in sv.views(t.kind, t.name, t.lo, t.hi, natural)]
    tensors, wins = _windows(pairs)
    return pack(tensors, wins, out) if wins else out[:0]


def unpack_parts(sv: StateView, parts: Iterable[Transfer], buf: torch.Tensor,
                 natural: bool = False) -> None:
    """Write ``buf`` (as packed by :func:`pack_parts` with the same ``natural``) into ``parts``."""
    pairs = [p for t in parts for p in sv.views(t.kind, t.name, t.lo, t.hi, natural)]
    tensors, wins = _windows(pairs)
    if wins:
        unpack(buf, tensors, wins)


def params_from_masters(sv: StateView, ranges: Iterable[tuple[str, int, int]], param_dtype,
                        rank: int, cap_bytes: int, device) -> None:
    """Low-precision parameters := casts of the fp32 masters over ``ranges`` (``(name, lo, hi)``
    in canonical order), the cast training does after a step, staged through buffers of at most
    ``cap_bytes``. What a switch and a checkpoint load both do for the ranges this rank holds a
    master of but did not receive the parameters for."""
    from .transfer import chunked

    parts = [Transfer(rank, rank, "master", n, lo, hi) for n, lo, hi in ranges]
    for group in chunked(parts, max(1, cap_bytes // 4)):
        buf = torch.empty(sum(t.numel for t in group), dtype=torch.float32, device=device)
        pack_parts(sv, group, buf)
        unpack_parts(sv, [Transfer(rank, rank, "param", t.name, t.lo, t.hi) for t in group],
                     buf.to(param_dtype))
