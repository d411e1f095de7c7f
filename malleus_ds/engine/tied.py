"""Tied parameters (input embedding = output head, ``tie_word_embeddings``) across stages.

The model is trained as if the pair were ONE parameter (what one process with the Hugging Face
model does). A plan puts the embedding on every pipeline's first stage and the head on its last,
so each holder keeps its own copy (two entries in the parameter table, initialised equal) and,
before the replica sum of gradient sync, each pipeline adds its two partial gradients
(Megatron's embedding-group all-reduce): TP rank 0 of the first stage and TP rank 0 of the last
stage swap their gradient and both keep ``g_embed + g_head`` (the same bits on both: IEEE
addition is commutative). The replica sum then gives both copies the full gradient of the tied
parameter, the same elementwise optimizer step keeps them equal, and the gradient norm counts the
head copy out (``ShardedOptimizer.owned_sq_norm(skip=...)``). A one-stage pipeline adds locally.
Other TP ranks of those stages are not touched: gradient sync takes replicated weights from TP
rank 0 only (``malleus_ds/engine/grad_sync.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Plan


class TiedSync:
    """Per plan and rank: what this rank does with the tied pairs' gradients each step."""

    def __init__(self, plan: Plan, rank: int, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs = tuple(pairs)
        self.local = False          # embedding and head on this stage: add in place
        self.peer: int | None = None
        self.first = False          # this rank holds the embedding copies (else the head's)
        loc = plan.locate(rank) if self.pairs else None
        if loc is None:
            return
        pipe = plan.pipelines[loc[0]]
        j, st = loc[1], pipe.stages[loc[1]]
        if len(pipe.stages) == 1:
            self.local = True
        elif st.ranks.index(rank) == 0 and j in (0, len(pipe.stages) - 1):
            self.first = j == 0
            self.peer = pipe.stages[-1].ranks[0] if self.first else pipe.stages[0].ranks[0]

    def names(self) -> tuple[str, ...]:
        """The gradients :meth:`__call__` reads and writes on this rank (none: nothing to do)."""
        if self.local:
            return tuple(n for pair in self.pairs for n in pair)
        if self.peer is None:
            return ()
        return tuple(a if self.first else b for a, b in self.pairs)

    @property
    def skip_in_norm(self) -> frozenset[str]:
        """Names counted once already (the head copies)."""
        return frozenset(b for _, b in self.pairs)

    @torch.no_grad()
    def __call__(self, grads: dict[str, torch.Tensor]) -> None:
        """Make both copies of every tied pair hold the pipeline's summed gradient."""
        if self.local:
            for a, b in self.pairs:
                s = grads[a] + grads[b]
                grads[a].copy_(s)
                grads[b].copy_(s)
            return
        if self.peer is None:
            return
        mine = [grads[a if self.first else b] for a, b in self.pairs]
        send = torch.cat([t.reshape(-1) for t in mine])
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.peer), dist.P2POp(dist.irecv, recv, self.peer)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        o = 0
        for t in mine:
            n = t.numel()
            t.add_(recv[o:o + n].view_as(t))
            o += n
