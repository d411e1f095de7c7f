"""The Trainer's training dataloader: each rank's micro-batches of the current split, in the
stock Trainer's global sample order.

:class:`TrainerBatches` is ``dp.sampler.ResplitLoader`` over sample *indices* (its "dataset" is
``range(n)``, its collate ``list``): a batch sampler whose every item is one micro-batch's
indices for this rank under the current :class:`~malleus_ds.dp.split.Split`, read from the stock
Trainer's order (``hf/order.py``) instead of DeepSpeed's. :class:`ResplitDataLoader` is a plain
``torch.utils.data.DataLoader`` over it, with the Trainer's collator, so the Trainer's own
machinery works unchanged: ``len()`` (micro-batches per epoch), ``set_epoch`` (the next epoch's
permutation), and, on resume, accelerate's ``skip_first_batches`` (a ``SkipBatchSampler`` over
the batch sampler: skipped micro-batches are indices only, no sample is read). accelerate never
sees it, so it is not re-sharded.

Differences from stock, by design: an epoch is the order's *full* global batches (a last
partial one, which stock runs as a short accumulation, is left out), and samples are collated
in the training process (no loader workers: a step's split is decided at the previous step's
end, after any prefetching worker would have read ahead).
"""
from __future__ import annotations

from typing import Any

import torch

from malleus_ds.dp.sampler import ResplitLoader
from malleus_ds.dp.split import Split
from malleus_ds.hf.order import padded_length, trainer_order


def stock_sampler(sampler: Any, use_seedable_sampler: bool = True, data_seed: int | None = None):
    """The sampler accelerate's ``prepare_data_loader`` iterates in place of the Trainer's
    ``sampler``: a ``RandomSampler`` becomes accelerate's ``SeedableRandomSampler`` (seeded with
    ``data_seed``, or torch's initial seed when None, plus the epoch) when
    ``use_seedable_sampler``; any other sampler is iterated as it is."""
    if isinstance(sampler, torch.utils.data.RandomSampler) and use_seedable_sampler:
        from accelerate.data_loader import SeedableRandomSampler

        return SeedableRandomSampler(data_source=sampler.data_source,
                                     replacement=sampler.replacement,
                                     num_samples=sampler._num_samples,
                                     generator=sampler.generator, data_seed=data_seed)
    return sampler


class TrainerBatches(ResplitLoader):
    """Rank ``rank``'s micro-batches (lists of sample indices) of every step under the current
    split, in the order the stock Trainer's ``sampler`` gives (module doc).

    ``sampler``: the sampler accelerate iterates for the stock Trainer (its ``set_epoch`` is
    called with the epoch, as accelerate's loader does); ``split``: the first split (an equal one
    is stock's: ``per_device = split.per_micro_batch / world`` samples per rank);
    ``drop_last`` / ``even_batches``: the Trainer's ``dataloader_drop_last`` and accelerate's
    ``even_batches``."""

    def __init__(self, sampler: Any, split: Split, rank: int, drop_last: bool = False,
                 even_batches: bool = True):
        if split.per_micro_batch % split.world:
            raise ValueError(f"the split's {split.per_micro_batch} samples per micro-batch are "
                             f"not a whole batch for each of {split.world} ranks")
        self.sampler, self.even_batches = sampler, even_batches
        self.per_device = split.per_micro_batch // split.world
        n = len(sampler)
        super().__init__(range(n), split, rank, collate_fn=list, shuffle=False,
                         drop_last=drop_last)

    def order(self) -> list[int]:
        if self._order is None:
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(self.epoch)
            self._order = trainer_order(list(self.sampler), self._split.world, self.per_device,
                                        self.drop_last, self.even_batches)
        return self._order

    def steps_per_epoch(self) -> int:
        n = padded_length(len(self.dataset), self._split.world, self.per_device,
                          self.drop_last, self.even_batches)
        return n // self._split.global_batch


class ResplitDataLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` whose ``batch_sampler`` is a :class:`TrainerBatches`; ``set_epoch``
    goes to it."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
