"""The step's one world all-reduce and its slot layout (DESIGN.md §5-6).

Every step of a MalleusEngine ends with one all-reduce over every rank of a float64 vector:

==========================  =================================================================
slot                        what each rank puts there (the sum is what every rank reads)
==========================  =================================================================
``LOSS``                    the global batch's loss sum: the last stage's TP rank 0 of each
                            pipeline, 0 elsewhere
``NONFINITE``               with fp16/bf16: the count of non-finite summed-gradient elements
                            this rank holds (one rank's inf/nan makes its bucket's sum
                            non-finite, so every rank takes the same skip decision)
``READY``                   rank 0: 1.0 when an adaptive-loop decision waits to be broadcast
``COMPUTE + d``             rank d: its compute seconds this step
``PROBE + d``               rank d: its probe's seconds per cost unit (0: no probe)
``EMULATED + d``            rank d: the straggler emulation's seconds in its compute
``WAIT + d``                rank d: its seconds in compute spans waiting for a core
``LINK + d``                rank d: the seconds its slow-link emulation slept
``STOP + d``                rank d: the stop signal it raised (0: none), read as the largest
``COMM + d*SLOTS + i``      rank d: its timed communication of the step, ``comm_log.py``
                            (zeros: none timed); only in a job whose ranks log it (``comm``)
==========================  =================================================================

:class:`StepReduction` owns the layout: the engine fills its own slots (:meth:`vector`,
:meth:`add_nonfinite`), runs the all-reduce and reads the sums back once as a
:class:`~malleus_ds.steploop.StepSums`, which the attached loop observes and a runner reports
(metrics.jsonl's per-rank seconds; the stop signal every rank then agrees on). Nothing else
knows an index.
"""
from __future__ import annotations

import numpy as np
import torch

from ..steploop import StepSums
from .comm_log import SLOTS, CommOps

__all__ = ["StepReduction", "StepSums"]


class StepReduction:
    """The slot layout of the step's all-reduce for a world of ``world`` ranks (module doc)."""

    LOSS, NONFINITE, READY = 0, 1, 2
    COMPUTE = 3

    def __init__(self, world: int, rank: int, comm: bool = False) -> None:
        """``comm``: the ranks log their communication (``engine._log_comm``, the same on every
        rank): the vector carries :data:`~malleus_ds.engine.comm_log.SLOTS` numbers per rank
        more; without it a job pays nothing for them."""
        if not 0 <= rank < world:
            raise ValueError(f"StepReduction: rank {rank} outside a world of {world}")
        self.world, self.rank = world, rank
        self.PROBE = self.COMPUTE + world
        self.EMULATED = self.PROBE + world
        self.WAIT = self.EMULATED + world
        self.LINK = self.WAIT + world
        self.STOP = self.LINK + world
        self.COMM = self.STOP + world
        self.comm = bool(comm)
        self.size = self.COMM + (world * SLOTS if comm else 0)

    def vector(self, *, ready: bool, compute_s: float, probe_per_unit: float,
               device, comm: list[float] | None = None, emulated_s: float = 0.0,
               wait_s: float = 0.0, link_s: float = 0.0, stop: int = 0) -> torch.Tensor:
        """This rank's contribution, all its slots but the loss and the non-finite count;
        ``comm``: its comm log's numbers (``CommLog.values``; None: not logged); ``emulated_s``,
        ``wait_s``, ``link_s``: its clock's (``ComputeClock``); ``stop``: the signal number it
        was asked to stop by (0: none)."""
        vals = [0.0] * self.size
        vals[self.READY] = 1.0 if ready else 0.0
        me = self.rank
        vals[self.COMPUTE + me] = float(compute_s)
        vals[self.PROBE + me] = float(probe_per_unit) if probe_per_unit > 0 else 0.0
        vals[self.EMULATED + me] = float(emulated_s)
        vals[self.WAIT + me] = float(wait_s)
        vals[self.LINK + me] = float(link_s)
        vals[self.STOP + me] = float(stop)
        if comm is not None:
            if not self.comm:
                raise ValueError("StepReduction.vector: comm values for a reduction built "
                                 "without comm slots (StepReduction(..., comm=True))")
            if len(comm) != SLOTS:
                raise ValueError(f"StepReduction.vector: {len(comm)} comm values, expected "
                                 f"{SLOTS}")
            at = self.COMM + self.rank * SLOTS
            vals[at:at + SLOTS] = [float(x) for x in comm]
        return torch.tensor(vals, dtype=torch.float64, device=device)     # one copy to the device

    def set_loss(self, v: torch.Tensor, loss_sum) -> None:
        """The loss sum (a tensor on the device: no host read per micro-batch)."""
        v[self.LOSS] = loss_sum

    def add_nonfinite(self, v: torch.Tensor, flats) -> None:
        """Count the non-finite elements of the summed gradient buckets, on the device."""
        for f, _ in flats:
            v[self.NONFINITE] += (~torch.isfinite(f)).sum()

    def read(self, summed: torch.Tensor) -> StepSums:
        """The sums, read to the host once (on GPU: the step's one wait on the all-reduce)."""
        s = summed.tolist()
        if len(s) != self.size:
            raise ValueError(f"StepReduction.read: {len(s)} values, expected {self.size}")
        def ranks(at: int) -> np.ndarray:
            return np.asarray(s[at:at + self.world], dtype=float)

        probe = ranks(self.PROBE)
        probe[probe <= 0] = np.nan
        comm = np.asarray(s[self.COMM:], dtype=float).reshape(self.world, SLOTS) \
            if self.comm else np.zeros(0)
        return StepSums(loss=s[self.LOSS], overflow=s[self.NONFINITE] > 0,
                        ready=s[self.READY] > 0.5, compute_s=ranks(self.COMPUTE),
                        probe_s=probe, comm=CommOps(comm) if comm.any() else (),
                        emulated_s=ranks(self.EMULATED), wait_s=ranks(self.WAIT),
                        link_s=ranks(self.LINK), stop=int(ranks(self.STOP).max()))
