"""Per-layer gradient sync (DESIGN.md §5), bucketed by rank set.

The bucket layout is the slice map's (``malleus_ds.layout.build_buckets``): every local
parameter is cut into *pieces*: for a TP-sharded weight, the finest chunks at the layer's finest
TP degree ``G`` (lcm of its holders' TP sizes) that this rank holds; for a weight TP
replicates (norms, embedding, head), the whole tensor. Each piece has a holder set (one rank per
pipeline for a chunk; every TP rank of every holding stage for a replicated weight). Pieces with
the same holder set go into one flat bucket, ordered by (layer, name, chunk) so every member lays
the bucket out identically, and the bucket is all-reduced with SUM once per step.

Summing is the rule: each micro-batch loss is already scaled by ``mbs / G``, so the sum over
micro-batches and pipelines is the global-batch gradient. (Stock DeepSpeed divides by the DP
group size instead, which is right only when every replica ran the same number of micro-batches.)
For replicated weights every TP rank of a pipeline holds the same full gradient, so only TP rank
0 of each stage contributes; the others add zeros, and all of them receive the sum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import Bucket, Piece


def view(t: torch.Tensor, pc: Piece) -> torch.Tensor:
    """The piece's elements of local tensor ``t`` as a view, in canonical order (split dim first,
    ``malleus_ds.layout``): flattening it gives the piece's slice of the bucket."""
    if pc.dim is None:
        return t.reshape(-1)
    return t.narrow(pc.dim, pc.start, pc.length).movedim(pc.dim, 0)


def flatten(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None,
            mask: bool = False, device=None) -> torch.Tensor:
    """Concatenate the bucket's pieces of ``tensors`` into one flat buffer (zeros where
    ``mask`` and the piece does not contribute)."""
    if out is None:
        out = torch.empty(bucket.numel, dtype=torch.float32, device=device)
    o = 0
    for pc in bucket.pieces:
        dst = out[o:o + pc.numel]
        if mask and not pc.contribute:
            dst.zero_()
        else:
            src = view(tensors[pc.name], pc)
            dst.view(src.shape).copy_(src)
        o += pc.numel
    return out


def flatten_range(bucket: Bucket, tensors: dict[str, torch.Tensor], lo: int, hi: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flat bucket (``flatten(...)[lo:hi]`` without building the
    whole bucket) into ``out`` (length ``hi - lo``)."""
    o = 0
    for pc in bucket.pieces:
        a, b = max(o, lo), min(o + pc.numel, hi)
        if a < b:
            v = view(tensors[pc.name], pc)
            dst = out[a - lo:b - lo]
            if a == o and b == o + pc.numel:
                dst.view(v.shape).copy_(v)
            else:       # a partial piece (at most the first and the last): via a flat copy
                dst.copy_(v.reshape(-1)[a - o:b - o])
        o += pc.numel
        if o >= hi:
            break
    return out


def unflatten(bucket: Bucket, flat: torch.Tensor, tensors: dict[str, torch.Tensor],
              lo: int = 0, hi: int | None = None) -> None:
    """Write ``flat`` (the whole bucket) back into the pieces of ``tensors`` overlapping [lo, hi)."""
    hi = bucket.numel if hi is None else hi
    o = 0
    for pc in bucket.pieces:
        a, b = max(o, lo), min(o + pc.numel, hi)
        if a < b:
            v = view(tensors[pc.name], pc)
            if a == o and b == o + pc.numel:
                v.copy_(flat[o:o + pc.numel].view(v.shape))
            else:   # partial piece: go through a contiguous copy
                tmp = v.contiguous().reshape(-1)
                tmp[a - o:b - o] = flat[a:b]
                v.copy_(tmp.view(v.shape))
        o += pc.numel


class GradSync:
    """Sum every bucket's gradients among its holders.

    ZeRO stage 0/1: all-reduce the whole flat bucket (every member gets every summed element).
    ZeRO stage 2: reduce-scatter, so each member receives only the summed gradients of its own
    ZeRO partition (half the traffic of an all-reduce; the reduced gradient is never stored
    whole). ``reduce`` returns, per bucket, ``(tensor, offset)``: the summed gradients of bucket
    elements ``[offset, offset + len(tensor))``.
    """

    def __init__(self, buckets: list[Bucket], groups, device=None, zero_stage: int = 0,
                 rank: int | None = None) -> None:
        self.buckets = buckets
        self.groups = [groups.get(b.ranks) if len(b.ranks) > 1 else None for b in buckets]
        self.scatter = [zero_stage >= 2 and len(b.ranks) > 1 for b in buckets]
        # every step overwrites [0, numel) (flatten writes every piece); only the padding a
        # reduce-scatter needs past numel must be zeros, so skip the memset of the rest
        self.flats = [torch.empty(b.padded_part * len(b.ranks) if sc else b.numel,
                                  dtype=torch.float32, device=device)
                      for b, sc in zip(buckets, self.scatter)]
        for b, f in zip(buckets, self.flats):
            f[b.numel:].zero_()
        self.parts = [torch.empty(b.padded_part, dtype=torch.float32, device=device) if sc else None
                      for b, sc in zip(buckets, self.scatter)]
        self.offsets = [b.ranks.index(rank) * b.padded_part if sc else 0
                        for b, sc in zip(buckets, self.scatter)]

    def reduce(self, grads: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        out = []
        for b, grp, flat, part, off in zip(self.buckets, self.groups, self.flats, self.parts,
                                           self.offsets):
            flatten(b, grads, flat[:b.numel], mask=True)
            if part is not None:
                dist.reduce_scatter_tensor(part, flat, group=grp)
                out.append((part, off))
            else:
                if grp is not None:
                    dist.all_reduce(flat, group=grp)
                out.append((flat, 0))
        return out
