"""Each rank's share of a data-parallel step's global batch, proportional to its speed.

ZeRO-1/2/3 in DeepSpeed line up their collectives only if every rank runs the same *number* of
micro-batches per step; the *sizes* of those micro-batches may differ. So a step here is
``micro_batches`` micro-batch slots, and slot ``k`` holds ``M = global_batch / micro_batches``
samples that the ranks share: rank ``r`` takes ``shares[r]`` of them in every slot (the same
share in each slot of a step), ``sum(shares) == M``.

Which samples: the step's global batch is a list of ``global_batch`` sample ids in the global
order (what stock DeepSpeed's ``DistributedSampler`` and accumulation give: see
``dp/sampler.py``). Slot ``k`` is the contiguous block ``order[k*M:(k+1)*M]`` and its positions
are dealt round-robin over the ranks that still need samples, lowest rank first. With equal
shares this is exactly stock's assignment (rank ``r`` takes positions ``r, r+W, r+2W, ...`` of
each block), so a healthy job sees the very samples stock DeepSpeed would, on the same ranks; an
uneven split keeps each slot's *set* of samples and only moves them between ranks.

Pure: no ``torch.distributed``; the same inputs give the same split on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

#: how a rank's loss is normalised (see :meth:`Split.weight`)
LOSS_KINDS = ("mean", "sum", "global")


@dataclass(frozen=True)
class Split:
    """A step's split: ``shares[r]`` samples per micro-batch on rank ``r``, ``micro_batches``
    micro-batches on every rank. Build one with :func:`split_for` or :meth:`Split.equal`."""

    shares: tuple[int, ...]
    micro_batches: int

    def __post_init__(self):
        if not self.shares:
            raise ValueError("a split needs at least one rank, got shares=()")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches!r} must be an integer >= 1")
        bad = [(r, s) for r, s in enumerate(self.shares)
               if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"every share must be an integer >= 1 sample per micro-batch; got "
                             f"{', '.join(f'rank {r}: {s!r}' for r, s in bad)} in "
                             f"shares={list(self.shares)}")
        object.__setattr__(self, "shares", tuple(self.shares))

    @classmethod
    def equal(cls, world: int, global_batch: int, micro_batches: int) -> "Split":
        """Stock DeepSpeed's split: ``global_batch / (micro_batches * world)`` samples per
        micro-batch on every rank."""
        return split_for([1.0] * world, global_batch, micro_batches)

    @property
    def world(self) -> int:
        return len(self.shares)

    @property
    def per_micro_batch(self) -> int:
        """``M``: the samples of one micro-batch slot over all ranks."""
        return sum(self.shares)

    @property
    def global_batch(self) -> int:
        return self.per_micro_batch * self.micro_batches

    def samples(self, rank: int) -> int:
        """The samples rank ``rank`` runs in a step."""
        return self.shares[rank] * self.micro_batches

    def weight(self, rank: int, loss: str = "mean") -> float:
        """What rank ``rank`` multiplies its micro-batch loss by before DeepSpeed's backward,
        so that DeepSpeed's gradient (the mean over ``world`` ranks of each rank's gradient, each
        divided by ``micro_batches``) is the mean gradient over the step's global batch.

        ``loss``:

        * ``"mean"``: the loss is the mean over the rank's micro-batch samples (what a plain
          ``F.mse_loss`` / ``F.cross_entropy`` gives): weight ``shares[r] * world / M``, 1.0 on
          an equal split.
        * ``"sum"``: the loss is the sum over the rank's micro-batch samples: weight
          ``world / M`` (the same on every rank, 1/mbs on an equal split).
        * ``"global"``: the loss is already normalised over the whole step (e.g. by the global
          token count, as the HF Trainer's ``average_tokens_across_devices`` does) so that
          DeepSpeed's own averaging gives the wanted gradient: weight 1.0, no reweighting.
        """
        if loss not in LOSS_KINDS:
            raise ValueError(f"loss={loss!r}: must be one of {', '.join(LOSS_KINDS)}")
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a split of {self.world} ranks")
        if loss == "mean":
            return self.shares[rank] * self.world / self.per_micro_batch
        if loss == "sum":
            return self.world / self.per_micro_batch
        return 1.0

    def assign(self, order: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """``out[r][k]``: the sample ids rank ``r`` runs in micro-batch ``k`` of the step whose
        global batch is ``order`` (``global_batch`` ids, in the global order). Every id of
        ``order`` lands exactly once."""
        order = list(order)
        if len(order) != self.global_batch:
            raise ValueError(f"the step's order has {len(order)} samples; the split covers "
                             f"{self.global_batch} ({self.micro_batches} micro-batches x "
                             f"{self.per_micro_batch})")
        m = self.per_micro_batch
        out: list[list[tuple[int, ...]]] = [[] for _ in self.shares]
        for k in range(self.micro_batches):
            block = order[k * m:(k + 1) * m]
            taken: list[list[int]] = [[] for _ in self.shares]
            pos = 0
            while pos < m:      # one round: one sample to each rank still short of its share
                for r, s in enumerate(self.shares):
                    if len(taken[r]) < s:
                        taken[r].append(block[pos])
                        pos += 1
            for r in range(self.world):
                out[r].append(tuple(taken[r]))
        return tuple(tuple(x) for x in out)

    def rank_ids(self, order: Sequence[int], rank: int) -> tuple[tuple[int, ...], ...]:
        """Rank ``rank``'s micro-batches (sample ids) of the step whose global batch is
        ``order``."""
        return self.assign(order)[rank]

    def json(self) -> dict:
        """The split as a metrics line carries it (plain JSON values)."""
        return {"shares": list(self.shares), "micro_batches": self.micro_batches,
                "global_batch": self.global_batch}


def _check_rates(rates: Sequence[float]) -> list[float]:
    out = []
    for r, x in enumerate(rates):
        if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) \
                or not math.isfinite(x) or x <= 0:
            raise ValueError(f"rank {r}'s rate {x!r} (seconds per sample) must be a finite "
                             f"number > 0; rates={list(rates)}")
        out.append(float(x))
    return out


def split_for(rates: Sequence[float], global_batch: int, micro_batches: int,
              min_share: int = 1, world: int | None = None) -> Split:
    """The split of ``global_batch`` samples over ``len(rates)`` ranks, ``micro_batches``
    micro-batches each, with shares proportional to each rank's speed ``1 / rates[r]`` (rates
    in seconds per sample; only their ratios matter).

    Per micro-batch slot of ``M = global_batch / micro_batches`` samples: a rank whose
    proportional share is below ``min_share`` gets ``min_share`` (the smallest share the
    collectives allow: it still runs every micro-batch and joins every collective) and the
    others share the rest in proportion, again; the proportional shares are then rounded by
    largest remainder (Hamilton), ties to the lower rank, so they sum to ``M`` exactly.
    ``world``: the ranks the caller expects (checked against ``len(rates)``).
    """
    if world is not None and len(rates) != world:
        raise ValueError(f"{len(rates)} rates for {world} ranks: one rate per rank; "
                         f"rates={list(rates)}")
    rates = _check_rates(rates)
    world = len(rates)
    if world < 1:
        raise ValueError("a split needs at least one rank's rate, got rates=[]")
    for name, v, lo in (("global_batch", global_batch, 1), ("micro_batches", micro_batches, 1),
                        ("min_share", min_share, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    if global_batch % micro_batches:
        raise ValueError(f"global_batch={global_batch} is not a multiple of "
                         f"micro_batches={micro_batches}: every rank runs the same number of "
                         f"micro-batches, so each micro-batch slot needs a whole number of "
                         f"samples")
    m = global_batch // micro_batches
    if m < world * min_share:
        raise ValueError(f"global_batch={global_batch} is too small to split: "
                         f"{micro_batches} micro-batches of {m} samples cannot give each of "
                         f"{world} ranks min_share={min_share} samples per micro-batch "
                         f"(needs global_batch >= {world * min_share * micro_batches})")
    speed = [1.0 / x for x in rates]
    pinned = [False] * world
    while True:             # pin the ranks whose proportional share falls below min_share
        free = [r for r in range(world) if not pinned[r]]
        left = m - min_share * (world - len(free))
        total = sum(speed[r] for r in free)
        quota = {r: left * speed[r] / total for r in free}
        low = [r for r in free if quota[r] < min_share]
        if not low:
            break
        for r in low:
            pinned[r] = True
    shares = [min_share] * world
    for r in free:
        shares[r] = int(math.floor(quota[r]))
    rest = m - sum(shares)
    by_remainder = sorted(free, key=lambda r: (-(quota[r] - shares[r]), r))
    for r in by_remainder[:rest]:
        shares[r] += 1
    return Split(tuple(shares), micro_batches)
