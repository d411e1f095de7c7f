"""The global sample order the stock Hugging Face Trainer trains on under accelerate.

The stock Trainer builds ``DataLoader(dataset, sampler=S, batch_size=b, drop_last=d)`` (``S``:
``Trainer._get_train_sampler``, a ``RandomSampler`` by default) and accelerate's
``prepare_data_loader`` turns it into one shard per rank: a ``RandomSampler`` becomes accelerate's
``SeedableRandomSampler`` (``use_seedable_sampler``, the Trainer's default: seeded with
``data_seed`` or torch's initial seed, plus the epoch), and ``BatchSamplerShard`` deals the
sampler's batches of ``b`` round-robin, batch ``j`` to rank ``j % W``, padding the epoch's end
with samples from its start (``even_batches``) so that every rank gets as many full batches.
So micro-step ``i`` of every rank covers the contiguous block ``P[i*W*b:(i+1)*W*b]`` of the
epoch's padded permutation ``P``, rank ``r`` taking the block's ``r``-th run of ``b``.

:func:`trainer_order` gives that order in ``dp.split``'s layout: each block rewritten so that
dealing its positions round-robin over the ranks (``Split.assign`` with an equal split) hands
every rank exactly its stock batch, and an uneven split keeps each block's *set* of samples.
Pure (the sampler is iterated by the caller).
"""
from __future__ import annotations

from typing import Sequence


def padded_length(n: int, world: int, per_device: int, drop_last: bool,
                  even_batches: bool = True) -> int:
    """How many positions of an epoch's ``n`` sampler indices ``BatchSamplerShard`` deals:
    whole rounds of ``world`` batches of ``per_device`` (``drop_last``), the last round padded
    to whole (``even_batches``), or all of them."""
    rnd = world * per_device
    if drop_last:
        return n // rnd * rnd
    return -(-n // rnd) * rnd if even_batches else n


def stock_positions(ids: Sequence[int], world: int, per_device: int, drop_last: bool,
                    even_batches: bool = True) -> list[int]:
    """The epoch's sampler indices ``ids`` as ``BatchSamplerShard`` deals them: batch ``j`` is
    ``out[j*per_device:(j+1)*per_device]`` and goes to rank ``j % world``; the padding repeats
    the epoch's first indices (cyclically when the epoch is shorter than the padding)."""
    ids = list(ids)
    total = padded_length(len(ids), world, per_device, drop_last, even_batches)
    if total <= len(ids):
        return ids[:total]
    if not ids:
        return []
    pad = total - len(ids)
    reps = -(-pad // len(ids))
    return ids + (ids * reps)[:pad]


def trainer_order(ids: Sequence[int], world: int, per_device: int, drop_last: bool,
                  even_batches: bool = True) -> list[int]:
    """The global order (``dp.sampler``'s sense) of the epoch whose sampler indices are ``ids``:
    :func:`stock_positions`, each block of ``world * per_device`` rewritten from rank-major
    (rank ``r``'s batch is the block's ``r``-th run of ``per_device``) to round-robin (rank
    ``r`` at positions ``r, r + world, ...``)."""
    pos = stock_positions(ids, world, per_device, drop_last, even_batches)
    m = world * per_device
    out: list[int] = []
    for k in range(0, len(pos) - len(pos) % m, m):
        block = pos[k:k + m]
        out.extend(block[r * per_device + j] for j in range(per_device) for r in range(world))
    return out + pos[len(pos) - len(pos) % m:]
