"""The re-split loop: each step's measured speeds -> rank 0 decides -> one small all-reduce ->
every rank takes the same new split.

At each optimizer-step boundary (after DeepSpeed's own ``step()``), :meth:`ResplitLoop.after_step`
makes **one** all-reduce (sum) over the data-parallel group, of one float64 vector of
``4 * W + 1`` slots (``W`` data-parallel ranks):

=================  ====================================================================
slots              what
=================  ====================================================================
``r``              rank ``r``'s compute seconds per sample in the step just run (its
                   forward + backward seconds, communication left out, divided by the
                   samples it ran: ``split.samples(r)``); 0 on every other rank
``W + r``          rank 0's pending decision: rank ``r``'s share of the next split
                   (samples per micro-batch); zeros when rank 0 has none
``2W + r``         the rates (healthy = 1.0) that decision was made for; zeros with it
``3W + r``         rank ``r``'s seconds of straggler emulation in the step (0 without one)
``4W``             each rank's part of the step's loss over the global batch (its losses
                   given to ``backward``, weighted as ``MalleusDPEngine.global_loss``
                   does): the sum is the step's loss, read without a host sync per
                   micro-batch
=================  ====================================================================

It is the only collective the loop adds: nothing per micro-batch, nothing else per step. Every
rank reads the same sums: a decision in them is applied there, on every rank, with
``engine.set_split`` (the loader follows), so the step after the all-reduce runs it. Rank 0 then
hands every rank's seconds per sample to its :class:`SplitPolicy`, whose answer rides in the
next step's all-reduce: a decision made from the timings of steps up to ``k`` takes effect at
step ``k + 2``.

The policy is the caller's (``app/dp_loop.py`` builds it from the adaptive loop's rate estimator
and detector, which ``dp/`` does not import); without one the engine runs no loop and adds no
collective. After each all-reduce every rank calls the loop's ``observers`` with the step's
:class:`StepFacts` (the app writes them to metrics.jsonl on rank 0).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .split import Split


@dataclass(frozen=True)
class StepFacts:
    """One optimizer step as every rank reads it from the loop's all-reduce."""

    step: int                       # 0-based
    loss: float                     # over the global batch, as ``global_loss`` gives it
    samples: int                    # the global batch
    step_time_s: float              # this rank's wall time from the step's first forward
    compute_s: tuple[float, ...]    # per rank: forward + backward, communication left out
    emulated_s: tuple[float, ...]   # per rank: the straggler emulation's part of it
    shares: tuple[int, ...]         # the split the step ran under (samples per micro-batch)


class SplitPolicy(Protocol):
    """Rank 0's decision, called after each step's all-reduce."""

    def decide(self, step: int, seconds_per_sample: Sequence[float],
               split: Split) -> tuple[Split, Sequence[float]] | None:
        """``step``: the step just run (0-based); ``seconds_per_sample[r]``: rank ``r``'s in
        it (0: no reading); ``split``: the split in force from now on. Returns the next split
        and the rates it was made for (one per rank), or None to keep ``split``."""


class ResplitLoop:
    """The per-step exchange of one :class:`~malleus_ds.dp.engine.MalleusDPEngine` (module
    doc). ``events``: every re-split applied, as ``{"event": "resplit", "step", "from", "to",
    "rates"}`` (``step``: the first step run under ``to``), the same on every rank."""

    def __init__(self, engine, policy: SplitPolicy):
        self.engine, self.policy = engine, policy
        self.world, self.rank = engine.dp_world_size, engine.dp_rank()
        self._pending: tuple[Split, Sequence[float]] | None = None     # rank 0's decision
        self.events: list[dict] = []
        #: every rank's seconds per sample in the last step (from the last all-reduce)
        self.last_seconds_per_sample: list[float] = []
        #: called on every rank with each step's :class:`StepFacts`, after its all-reduce
        self.observers: list[Callable[[StepFacts], None]] = []

    def vector(self, seconds_per_sample: float, emulated_s: float = 0.0) -> list[float]:
        """This rank's addend to the step's sum (module doc), but the loss slot."""
        w = self.world
        v = [0.0] * (4 * w + 1)
        v[self.rank] = seconds_per_sample
        v[3 * w + self.rank] = emulated_s
        if self._pending is not None:
            split, rates = self._pending
            v[w:2 * w] = [float(s) for s in split.shares]
            v[2 * w:3 * w] = [float(x) for x in rates]
        return v

    def read(self, sums: Sequence[float], micro_batches: int
             ) -> tuple[list[float], Split | None, list[float]]:
        """(every rank's seconds per sample, rank 0's decision or None, its rates) from the
        summed vector."""
        w = self.world
        shares = [int(round(x)) for x in sums[w:2 * w]]
        if not any(shares):
            return list(sums[:w]), None, []
        return list(sums[:w]), Split(tuple(shares), micro_batches), list(sums[2 * w:3 * w])

    def after_step(self, step: int, split: Split, compute_s: float, loss_part=0.0,
                   emulated_s: float = 0.0, started: float | None = None) -> None:
        """The boundary of step ``step`` (0-based), run under ``split``, in which this rank
        computed for ``compute_s`` seconds (``emulated_s`` of them the straggler emulation's)
        and its losses make ``loss_part`` of the step's (a tensor on the device, or a number),
        from ``started`` (``time.perf_counter``): the all-reduce, the decision it carries
        applied, the observers told, rank 0's next decision made."""
        import torch
        from deepspeed import comm as dist

        eng = self.engine
        mine = compute_s / split.samples(self.rank)
        t = torch.tensor(self.vector(mine, emulated_s), dtype=torch.float64, device=eng.device)
        t[-1] += loss_part                  # on the device: no host read of the loss
        dist.all_reduce(t, group=eng.data_parallel_group)
        sums = t.tolist()
        sps, decided, rates = self.read(sums, split.micro_batches)
        self._pending = None
        self.last_seconds_per_sample = sps
        if decided is not None and decided != eng.split:
            self.events.append({"event": "resplit", "step": step + 1,
                                "from": list(eng.split.shares), "to": list(decided.shares),
                                "rates": [round(x, 3) for x in rates]})
            eng.set_split(decided)
        if self.observers:                  # after the decision: its event is in ``events``
            w = self.world
            facts = StepFacts(step, sums[-1], split.global_batch,
                              time.perf_counter() - started if started is not None else 0.0,
                              tuple(x * split.samples(r) for r, x in enumerate(sps)),
                              tuple(sums[3 * w:4 * w]), tuple(split.shares))
            for fn in self.observers:
                fn(facts)
        if self.rank == 0:
            self._pending = self.policy.decide(step, sps, eng.split)
