"""The re-split loop: each step's measured speeds -> one small all-reduce, left in flight for a
step -> every rank makes the same decision -> every rank takes the same new split.

At each optimizer-step boundary (after DeepSpeed's own ``step()``), :meth:`ResplitLoop.after_step`
issues **one** non-blocking all-reduce (sum) over the data-parallel group, of one float64 vector
of ``3 * W + 1`` slots (``W`` data-parallel ranks), and reads the one it issued a step earlier:

=================  ====================================================================
slots              what
=================  ====================================================================
``r``              rank ``r``'s compute seconds per sample in the step just run (its
                   forward + backward seconds, communication left out, divided by the
                   samples it ran: ``split.samples(r)``); 0 on every other rank
``W + r``          rank ``r``'s share in the split the step ran under, added by every
                   rank: the sum is ``W`` times it when the ranks agree (checked)
``2W + r``         rank ``r``'s seconds of straggler emulation in the step (0 without one)
``3W``             each rank's part of the step's loss over the global batch (its losses
                   given to ``backward``, weighted as ``MalleusDPEngine.global_loss``
                   does): the sum is the step's loss, read without a host sync per
                   micro-batch
=================  ====================================================================

It is the only collective the loop adds: nothing per micro-batch, nothing else per step. The
all-reduce of step ``k`` is waited for at step ``k + 1``'s boundary, after a whole step in
flight (on gloo ranks that share cores a blocking hop waits for every peer to be scheduled).
Then **every** rank hands every rank's seconds per sample of step ``k`` to its own
:class:`SplitPolicy`, and applies its answer with ``engine.set_split`` (the loader follows):
step ``k + 2`` runs it. A decision made from the timings of steps up to ``k`` takes effect at
step ``k + 2``, as when rank 0 decided alone and its decision rode the next all-reduce. The
policies agree without a message: each slot they read has one non-zero addend (the rank's own
reading), so its sum is that value bit for bit on every rank, whatever the reduction's order;
the policy must be deterministic (``app/dp_loop.py``'s is). The split slots check it: ranks that
ran different splits fail at the next read, naming both.

The policy is the caller's (``app/dp_loop.py`` builds it from the adaptive loop's rate estimator
and detector, which ``dp/`` does not import); without one the engine runs no loop and adds no
collective. When a step's all-reduce is read, every rank calls the loop's ``observers`` with
its :class:`StepFacts` (the app writes them to metrics.jsonl on rank 0): one step late, and the
last step's at :meth:`ResplitLoop.flush` (the engine's ``save_checkpoint`` and ``destroy``,
``MalleusTrainer.train``'s end, and the process's exit call it).

:meth:`ResplitLoop.state_dict` is what a checkpoint keeps (the decision read but not yet
applied, the policy's own state): a resumed run makes the decisions the uninterrupted one would.
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
    step_time_s: float              # this rank's wall time from the step's first forward to
                                    # its boundary (the loop's all-reduce is not waited there)
    compute_s: tuple[float, ...]    # per rank: forward + backward, communication left out
    emulated_s: tuple[float, ...]   # per rank: the straggler emulation's part of it
    shares: tuple[int, ...]         # the split the step ran under (samples per micro-batch)


class SplitPolicy(Protocol):
    """The re-split decision, called on every rank when a step's all-reduce is read, with the
    same arguments on every rank: it must answer the same on every rank (deterministic: no
    clocks, no randomness). ``state_dict`` / ``load_state_dict`` (optional): what a checkpoint
    keeps of it (plain lists, numbers and dicts)."""

    def decide(self, step: int, seconds_per_sample: Sequence[float],
               split: Split) -> tuple[Split, Sequence[float]] | None:
        """``step``: the step just run (0-based); ``seconds_per_sample[r]``: rank ``r``'s in
        it (0: no reading); ``split``: the split in force for the step after it. Returns the
        next split and the rates it was made for (one per rank), or None to keep ``split``."""


@dataclass
class _InFlight:
    """A step's all-reduce, issued and not yet read."""

    work: object                    # the collective's handle (``wait()``); None: already done
    sums: object                    # the tensor it reduces in place
    step: int
    split: Split
    step_time_s: float


class ResplitLoop:
    """The per-step exchange of one :class:`~malleus_ds.dp.engine.MalleusDPEngine` (module
    doc). ``events``: every re-split applied, as ``{"event": "resplit", "step", "from", "to",
    "rates"}`` (``step``: the first step run under ``to``), the same on every rank."""

    #: what :meth:`state_dict` writes (``load_state_dict`` refuses another)
    STATE_VERSION = 1

    def __init__(self, engine, policy: SplitPolicy):
        self.engine, self.policy = engine, policy
        self.world, self.rank = engine.dp_world_size, engine.dp_rank()
        self._inflight: _InFlight | None = None     # the last step's all-reduce, unread
        #: the decision read from the last step's all-reduce, applied at the next boundary
        self._decided: tuple[Split, Sequence[float]] | None = None
        self.events: list[dict] = []
        #: every rank's seconds per sample in the last step read (one step behind the engine)
        self.last_seconds_per_sample: list[float] = []
        #: called on every rank with each step's :class:`StepFacts`, when its all-reduce is read
        self.observers: list[Callable[[StepFacts], None]] = []

    def vector(self, seconds_per_sample: float, split: Split,
               emulated_s: float = 0.0) -> list[float]:
        """This rank's addend to the step's sum (module doc), but the loss slot."""
        w = self.world
        v = [0.0] * (3 * w + 1)
        v[self.rank] = seconds_per_sample
        v[w:2 * w] = [float(s) for s in split.shares]
        v[2 * w + self.rank] = emulated_s
        return v

    def read(self, sums: Sequence[float], split: Split) -> list[float]:
        """Every rank's seconds per sample from the summed vector of a step this rank ran under
        ``split``; RuntimeError when the ranks ran different splits."""
        w = self.world
        want = [float(w * s) for s in split.shares]
        if list(sums[w:2 * w]) != want:
            raise RuntimeError(f"the data-parallel ranks ran different splits: rank {self.rank} "
                               f"ran {list(split.shares)}, the ranks' shares sum to "
                               f"{[round(x, 3) for x in sums[w:2 * w]]} (want {want}: every rank "
                               f"the same); a split policy must decide the same on every rank, "
                               f"and set_split be called with the same split on every rank")
        return list(sums[:w])

    def after_step(self, step: int, split: Split, compute_s: float, loss_part=0.0,
                   emulated_s: float = 0.0, started: float | None = None) -> None:
        """The boundary of step ``step`` (0-based), run under ``split``, in which this rank
        computed for ``compute_s`` seconds (``emulated_s`` of them the straggler emulation's)
        and its losses make ``loss_part`` of the step's (a tensor on the device, or a number),
        from ``started`` (``time.perf_counter``): this step's all-reduce issued, the last
        step's read (:meth:`flush`), the decision it gave applied (the next step runs it)."""
        import torch
        from deepspeed import comm as dist

        eng = self.engine
        took = time.perf_counter() - started if started is not None else 0.0
        mine = compute_s / split.samples(self.rank)
        t = torch.tensor(self.vector(mine, split, emulated_s), dtype=torch.float64,
                         device=eng.device)
        t[-1] += loss_part                  # on the device: no host read of the loss
        work = dist.all_reduce(t, group=eng.data_parallel_group, async_op=True)
        self.flush()                        # the last step's, in flight for a whole step
        self._inflight = _InFlight(work, t, step, split, took)
        decided, self._decided = self._decided, None
        if decided is not None and decided[0] != eng.split:
            new, rates = decided
            self.events.append({"event": "resplit", "step": step + 1,
                                "from": list(eng.split.shares), "to": list(new.shares),
                                "rates": [round(float(x), 3) for x in rates]})
            eng.set_split(new)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Read the step's all-reduce still in flight (if any): the observers told, the policy's
        decision made (applied at the next step boundary). No collective of its own: every rank
        may call it alone (it waits for the peers to issue theirs). ``timeout_s``: give up after
        that long (a peer gone: the step is left unread, False), for a teardown."""
        f = self._inflight
        if f is None:
            return True
        if f.work is not None and timeout_s is not None:
            end = time.monotonic() + timeout_s
            while not f.work.is_completed():
                if time.monotonic() > end:
                    return False
                time.sleep(0.001)
        self._inflight = None
        if f.work is not None:
            f.work.wait()
        sums = f.sums.tolist()
        sps = self.read(sums, f.split)
        self.last_seconds_per_sample = sps
        eng = self.engine
        if self.observers:
            w = self.world
            facts = StepFacts(f.step, sums[-1], f.split.global_batch, f.step_time_s,
                              tuple(x * f.split.samples(r) for r, x in enumerate(sps)),
                              tuple(sums[2 * w:3 * w]), tuple(f.split.shares))
            for fn in self.observers:
                fn(facts)
        self._decided = self.policy.decide(f.step, sps, eng.split)
        return True

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps (plain values): the decision read but not applied yet, and
        the policy's state (its ``state_dict()``; None without one). Reads the step in flight
        first (:meth:`flush`)."""
        self.flush()
        d = self._decided
        get = getattr(self.policy, "state_dict", None)
        return {"version": self.STATE_VERSION,
                "decided": None if d is None else {"shares": list(d[0].shares),
                                                   "rates": [float(x) for x in d[1]]},
                "policy": get() if get is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """The state :meth:`state_dict` wrote, for this loop's world and the engine's batch
        (the caller checks those); ValueError naming the field otherwise."""
        if not isinstance(state, dict) or state.get("version") != self.STATE_VERSION:
            raise ValueError(f"the re-split loop's checkpoint state must be a dict of version "
                             f"{self.STATE_VERSION}, got "
                             f"{state.get('version') if isinstance(state, dict) else state!r}")
        d = state.get("decided")
        decided = None
        if d is not None:
            shares, rates = d.get("shares"), d.get("rates")
            if not isinstance(shares, list) or not isinstance(rates, list) \
                    or len(shares) != self.world or len(rates) != self.world:
                raise ValueError(f"the re-split loop's checkpoint state: decided={d!r} needs "
                                 f"{self.world} shares and {self.world} rates")
            decided = (Split(tuple(shares), self.engine.split.micro_batches), rates)
        put = getattr(self.policy, "load_state_dict", None)
        if put is not None and state.get("policy") is not None:
            put(state["policy"])
        self._inflight, self._decided = None, decided
