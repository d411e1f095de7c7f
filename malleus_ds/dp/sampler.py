"""The global sample order stock DeepSpeed trains on, and a per-rank loader over a split of it.

Stock DeepSpeed (``deepspeed_io``) gives each rank a ``DistributedSampler(dataset, world,
rank)`` (shuffled, seed 0, the epoch never advanced by DeepSpeed itself) and cuts its indices
into micro-batches of ``train_micro_batch_size_per_gpu``. Rank ``r``'s sampler takes positions
``r, r+W, r+2W, ...`` of one padded permutation, so step ``s`` (``gradient_accumulation_steps``
micro-batches on every rank) covers positions ``[s*B, (s+1)*B)`` of it, ``B`` the global batch:
that permutation is the *global order* (:func:`global_order`, built from torch's own sampler so
it stays torch's), and a step's global batch is a contiguous chunk of it.

:class:`ResplitLoader` yields one rank's micro-batches of each step under the current
:class:`~malleus_ds.dp.split.Split` (``Split.assign``): with an equal split, exactly the batches
stock's loader yields on that rank. A new split takes effect at the loader's next step.

Differences from stock, by design: an epoch is the global order's *full* global batches (a last
partial one, which stock runs as short micro-batches, is left out), and batches are collated in
this process (no loader workers).
"""
from __future__ import annotations

from typing import Callable

from malleus_ds.dp.split import Split


def global_order(n: int, world: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                 drop_last: bool = False) -> list[int]:
    """The padded permutation of ``range(n)`` that ``DistributedSampler(..., num_replicas=world,
    rank=r)`` deals to ranks ``r = 0..world-1`` (rank ``r`` takes ``out[r::world]``)."""
    from torch.utils.data.distributed import DistributedSampler

    class _Sized:
        def __len__(self):
            return n

    s = DistributedSampler(_Sized(), num_replicas=world, rank=0, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    # torch's own shuffle and padding to world ranks, once: as one replica that takes every
    # position (rather than one sampler and one permutation per rank)
    s.num_replicas, s.num_samples = 1, s.total_size
    return list(s)


class ResplitLoader:
    """Rank ``rank``'s micro-batches of every step, under the current split.

    ``dataset``: map-style (``dataset[i]``, ``len``); ``collate_fn`` merges a list of samples
    (torch's ``default_collate`` when None). ``shuffle`` / ``seed`` / ``drop_last``: the
    ``DistributedSampler``'s (stock DeepSpeed: True, 0, its ``dataloader_drop_last``).
    Iterating yields ``steps_per_epoch * split.micro_batches`` micro-batches; like stock's, the
    epoch stays the one :meth:`set_epoch` last set (0 unless called).
    """

    def __init__(self, dataset, split: Split, rank: int, collate_fn: Callable | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if not 0 <= rank < split.world:
            raise ValueError(f"rank {rank} is not in a split of {split.world} ranks")
        if collate_fn is None:
            from torch.utils.data import default_collate as collate_fn
        self.dataset, self.rank, self.collate_fn = dataset, rank, collate_fn
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._split = split
        self.step_split: Split | None = None    # the split of the step being served
        self.last_ids: tuple[int, ...] = ()     # the sample ids of the last micro-batch yielded
        self._served = 0                        # micro-batches of the current step yielded
        self.tput_timer = None                  # DeepSpeed's throughput timer, started per batch
        self._start = 0                         # the step the next iteration starts at
        self._order: list[int] | None = None
        if self.steps_per_epoch() < 1:
            raise ValueError(f"the dataset's {len(dataset)} samples over {split.world} ranks "
                             f"give no full global batch of {split.global_batch}")

    @property
    def split(self) -> Split:
        return self._split

    def set_split(self, split: Split) -> None:
        """The split from the next step on (a step already started keeps its own). Same world
        and global batch as the current one."""
        cur = self._split
        if (split.world, split.global_batch, split.micro_batches) != \
                (cur.world, cur.global_batch, cur.micro_batches):
            raise ValueError(f"a new split must keep the world, global batch and micro-batches: "
                             f"{split.json()} against {cur.json()}")
        self._split = split

    def resume_at(self, step: int) -> None:
        """The next iteration starts at step ``step`` of the epoch (after a checkpoint's load:
        the steps before it are not yielded, nor read)."""
        if not 0 <= step < self.steps_per_epoch():
            raise ValueError(f"step {step} is not in an epoch of {self.steps_per_epoch()} "
                             f"steps")
        self._start = step

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``: the next iteration's permutation."""
        self.epoch = epoch
        self._order = None

    def order(self) -> list[int]:
        if self._order is None:
            self._order = global_order(len(self.dataset), self._split.world, self.shuffle,
                                       self.seed, self.epoch, self.drop_last)
        return self._order

    def steps_per_epoch(self) -> int:
        world = self._split.world
        n = len(self.dataset)
        padded = (n // world if self.drop_last else -(-n // world)) * world
        return padded // self._split.global_batch

    def __len__(self) -> int:
        return self.steps_per_epoch() * self._split.micro_batches

    def step_ids(self, step: int) -> tuple[tuple[int, ...], ...]:
        """This rank's micro-batches (sample ids) of step ``step`` of the epoch under the
        current split."""
        b = self._split.global_batch
        return self._split.rank_ids(self.order()[step * b:(step + 1) * b], self.rank)

    def __iter__(self):
        order, start, self._start = self.order(), self._start, 0
        for step in range(start, self.steps_per_epoch()):
            split = self.step_split = self._split
            b = split.global_batch
            for k, ids in enumerate(split.rank_ids(order[step * b:(step + 1) * b], self.rank)):
                self.last_ids, self._served = ids, k + 1
                if self.tput_timer is not None:
                    self.tput_timer.start()
                yield self.collate_fn([self.dataset[i] for i in ids])
        self.step_split, self._served = None, 0

    def mid_step(self) -> bool:
        """Whether the loader has yielded some but not all micro-batches of a step."""
        return self.step_split is not None and 0 < self._served < self.step_split.micro_batches
