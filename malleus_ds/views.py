"""Canonical-order views of parameter slices and the flat bucket layout (DESIGN.md §5-6).

The slice map (``malleus_ds/layout.py``) orders every parameter split dim first, flattened; a
*piece* is a TP chunk (or a whole replicated tensor) of one local tensor. These functions give
that order as views of the local tensors, without copies, and copy between them and flat
buffers: the gradient buckets (``engine/grad_sync.py``), the ZeRO shards
(``engine/optimizer.py``), the migration's pack/unpack (``migrate/apply.py``) and checkpoint
slices all use the one layout. torch + ``layout`` only.
"""
from __future__ import annotations

import torch

from .layout import Bucket, Piece


def view(t: torch.Tensor, pc: Piece) -> torch.Tensor:
    """The piece's elements of local tensor ``t`` as a view, in canonical order (split dim first,
    ``malleus_ds.layout``): flattening it gives the piece's slice of the bucket."""
    if pc.dim is None:
        return t.reshape(-1)
    return t.narrow(pc.dim, pc.start, pc.length).movedim(pc.dim, 0)


def row_windows(v: torch.Tensor, x: int, n: int) -> list[torch.Tensor]:
    """Views of elements ``[x, x + n)`` of 2-D ``v`` in row-major order (at most three)."""
    if n <= 0:
        return []
    C = v.shape[1]
    r0, c0 = divmod(x, C)
    r1, c1 = divmod(x + n, C)
    if r0 == r1:
        return [v[r0, c0:c1]]
    out = []
    if c0:
        out.append(v[r0, c0:])
        r0 += 1
    if r1 > r0:
        out.append(v[r0:r1])
    if c1:
        out.append(v[r1, :c1])
    return out


def as_rows(v: torch.Tensor) -> torch.Tensor:
    """A split-dim-first tensor as a 2-D VIEW (rows along the split dim): row-major order is the
    canonical order. Raises rather than copy (writes through a copy would be lost)."""
    if v.dim() == 2:
        return v
    try:
        return v.view(v.shape[0], -1)
    except RuntimeError:
        raise ValueError(f"a parameter slice of shape {tuple(v.shape)} (split dim first) has no "
                         f"2-D view; slicing supports parameters of <= 2 dims or splits whose "
                         f"other dims merge") from None


def part_views(t: torch.Tensor, pc: Piece, a: int, b: int) -> list[torch.Tensor]:
    """Views of piece-local elements ``[a, b)`` (canonical order) of local tensor ``t``."""
    v = view(t, pc)
    if v.dim() == 1:
        return [v[a:b]]
    return row_windows(as_rows(v), a, b - a)


def _copy_in(dst: torch.Tensor, views: list[torch.Tensor]) -> None:
    o = 0
    for w in views:
        n = w.numel()
        dst[o:o + n].view(w.shape).copy_(w)
        o += n


def _copy_out(src: torch.Tensor, views: list[torch.Tensor]) -> None:
    o = 0
    for w in views:
        n = w.numel()
        w.copy_(src[o:o + n].view(w.shape))
        o += n


def zero_padding(flat: torch.Tensor, bucket: Bucket, lo: int = 0) -> None:
    """Zero the padding positions of ``flat``, which holds flat range ``[lo, lo + len)``."""
    for a, b in bucket.padding(lo, lo + flat.numel()):
        flat[a - lo:b - lo].zero_()


def flatten(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None,
            mask: bool = False, device=None) -> torch.Tensor:
    """The bucket's pieces of ``tensors`` in its flat, member-major layout
    (``Bucket.entries``; zeros where ``mask`` and the piece does not contribute). ``out`` (length
    ``flat_size``) must have zeros in its padding; a new one is zero-filled."""
    if out is None:
        out = torch.zeros(bucket.flat_size, dtype=torch.float32, device=device)
    for pc, a, b, f in bucket.entries():
        dst = out[f:f + b - a]
        if mask and not pc.contribute:
            dst.zero_()
        else:
            _copy_in(dst, part_views(tensors[pc.name], pc, a, b))
    return out


def flatten_range(bucket: Bucket, tensors: dict[str, torch.Tensor], lo: int, hi: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Flat elements ``[lo, hi)`` (``flatten(...)[lo:hi]`` without building the whole buffer)
    into ``out`` (length ``hi - lo``; padding written as zeros)."""
    zero_padding(out, bucket, lo)
    for pc, a, b, f in bucket.entries():
        x, y = max(f, lo), min(f + b - a, hi)
        if x < y:
            _copy_in(out[x - lo:y - lo], part_views(tensors[pc.name], pc, a + x - f, a + y - f))
    return out


def unflatten(bucket: Bucket, flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``flat`` (the whole flat buffer, ``flat_size``) back into the pieces of ``tensors``."""
    for pc, a, b, f in bucket.entries():
        _copy_out(flat[f:f + b - a], part_views(tensors[pc.name], pc, a, b))
