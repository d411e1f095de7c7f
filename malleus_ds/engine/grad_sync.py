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

from contextlib import nullcontext

import torch
import torch.distributed as dist

from ..layout import Bucket, Piece
from .comm_log import tensor_mb
from ..views import part_views


class GradSync:
    """The fp32 gradient buffers of one plan, and the sum of every bucket among its holders.

    The buckets ARE the gradient accumulators (Megatron's ``main_grad``): after each
    micro-batch's backward (or per parameter as soon as its gradient is ready), the engine adds
    every parameter's gradient straight into its pieces' windows of the flat buffers
    (:meth:`accumulate`, one ``_foreach_add_`` for all of them) and drops ``param.grad``, so the
    summed fp32 gradient exists once, in the buckets, with no per-parameter accumulator beside
    it. A piece that does not contribute (a non-zero TP rank's copy of a replicated weight) is
    never added: it stays zero. Summing into a zeroed buffer gives the bits autograd's own
    accumulation would (``0 + g1 + g2 + ...``).

    ZeRO stage 0/1: all-reduce the whole flat bucket (every member gets every summed element).
    ZeRO stage 2: reduce-scatter, so each member receives only the summed gradients of its own
    ZeRO partition (half the traffic of an all-reduce). :meth:`reduce` returns, per bucket,
    ``(tensor, offset)``: the summed gradients of bucket elements ``[offset, offset + len)``.
    """

    def __init__(self, buckets: list[Bucket], groups, device=None, zero_stage: int = 0,
                 rank: int | None = None, shapes: dict[str, torch.Size] | None = None) -> None:
        self.buckets = buckets
        self.groups = [groups.get(b.ranks) if len(b.ranks) > 1 else None for b in buckets]
        self.scatter = [zero_stage >= 2 and len(b.ranks) > 1 for b in buckets]
        self.offsets = [b.ranks.index(rank) * b.padded_part if sc else 0
                        for b, sc in zip(buckets, self.scatter)]
        self.device, self._shapes = device, dict(shapes or {})
        # allocated by the first step (:meth:`zero_`), not here: a plan switch builds this
        # object while the previous plan's state is still alive, and gradients are not needed
        # until the next step, after the old plan is gone
        self.flats: list[torch.Tensor] = []
        self.parts: list[torch.Tensor | None] = []
        self._targets: dict = {}

    def _allocate(self) -> None:
        # member-major flat buffers (``Bucket.entries``), zeroed at the start of every step
        dev = self.device
        self.flats = [torch.zeros(b.flat_size, dtype=torch.float32, device=dev)
                      for b in self.buckets]
        self.parts = [torch.empty(b.padded_part, dtype=torch.float32, device=dev) if sc
                      else None for b, sc in zip(self.buckets, self.scatter)]
        self._targets = _targets(self.buckets, self.flats, self._shapes)

    def zero_(self) -> None:
        """Start a step: every accumulator at zero (padding stays zero throughout); the first
        call allocates the buffers."""
        if not self.flats and self.buckets:
            self._allocate()
        elif self.flats:
            torch._foreach_zero_(self.flats)

    @torch.no_grad()
    def accumulate(self, grads) -> None:
        """Add ``{name: gradient}`` (any dtype; local parameter shapes) into the buckets."""
        if grads and self.buckets and not self.flats:
            raise RuntimeError("GradSync.accumulate before zero_(): no gradient buffers this step")
        dsts, srcs = [], []
        for name, g in grads.items():
            for (pc, a, b), ds in self._targets.get(name, ()):
                dsts += ds
                srcs += part_views(g, pc, a, b)
        if dsts:
            torch._foreach_add_(dsts, srcs)

    def read(self, name: str) -> torch.Tensor:
        """A new fp32 tensor shaped like parameter ``name``: its accumulated gradient where this
        rank contributes, zeros elsewhere."""
        out = torch.zeros(self._shapes[name], dtype=torch.float32, device=self.device)
        for (pc, a, b), ds in self._targets.get(name, ()):
            for w, d in zip(part_views(out, pc, a, b), ds):
                w.copy_(d)
        return out

    def write(self, name: str, t: torch.Tensor) -> None:
        """Overwrite parameter ``name``'s contributing windows with ``t``'s elements."""
        for (pc, a, b), ds in self._targets.get(name, ()):
            for w, d in zip(part_views(t, pc, a, b), ds):
                d.copy_(w)

    def reduce(self, clock=None) -> list[tuple[torch.Tensor, int]]:
        """Each bucket reduced over its replicas; ``clock``: a ``ComputeClock`` that times each
        reduction (``ComputeClock.comm``: its link emulation slows the reductions that cross a
        slow link, its comm log records them)."""
        if len(self.flats) != len(self.buckets):
            raise RuntimeError("GradSync.reduce before zero_(): no gradient buffers this step")
        out = []
        timed = clock is not None and (clock.links is not None or clock.comm_log is not None)
        for b, grp, flat, part, off in zip(self.buckets, self.groups, self.flats, self.parts,
                                           self.offsets):
            ctx = clock.comm(b.ranks, tensor_mb(flat), "dp") \
                if timed and grp is not None else nullcontext()
            with ctx:
                if part is not None:
                    dist.reduce_scatter_tensor(part, flat, group=grp)
                elif grp is not None:
                    dist.all_reduce(flat, group=grp)
            out.append((part, off) if part is not None else (flat, 0))
        return out

    def free(self) -> None:
        """Release the buffers (a plan switch, before the next plan's state is allocated:
        gradients are scratch between steps)."""
        self.flats, self.parts, self._targets = [], [], {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flats + self.parts if t is not None)


def _targets(buckets: list[Bucket], flats: list[torch.Tensor], shapes: dict[str, torch.Size]
             ) -> dict[str, list[tuple[tuple[Piece, int, int], list[torch.Tensor]]]]:
    """Per parameter name: each contributing piece part ``(piece, a, b)`` with the views of the
    flat buffer its windows (``part_views``) are added into, shaped like those windows."""
    out: dict[str, list] = {}
    for bucket, flat in zip(buckets, flats):
        for pc, a, b, f in bucket.entries():
            if not pc.contribute:
                continue
            meta = torch.empty(shapes[pc.name], device="meta")
            ds, o = [], f
            for w in part_views(meta, pc, a, b):
                n = w.numel()
                ds.append(flat[o:o + n].view(w.shape))
                o += n
            out.setdefault(pc.name, []).append(((pc, a, b), ds))
    return out
