"""The train dataloader of MalleusTrainer deals the stock Trainer's order: under an equal split
each rank gets exactly the batches accelerate's ``BatchSamplerShard`` gives it (padding, drop_last,
epochs of the seedable sampler included); an uneven split keeps each micro-batch slot's samples
and only moves them between ranks; ``len``, ``set_epoch`` and accelerate's ``SkipBatchSampler``
(the Trainer's resume) behave."""
from __future__ import annotations

import itertools

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
from torch.utils.data import BatchSampler, SequentialSampler

from malleus_ds.dp.split import Split
from malleus_ds.hf.loader import ResplitDataLoader, TrainerBatches, stock_sampler
from malleus_ds.hf.order import padded_length, stock_positions, trainer_order


def _stock(ids, world, rank, mbs, drop_last, even=True):
    return [list(b) for b in BatchSamplerShard(BatchSampler(ids, mbs, drop_last), world, rank,
                                               even_batches=even)]


@pytest.mark.parametrize("world,mbs,n,drop_last", [
    (w, b, n, d) for w, b, n, d in itertools.product((2, 3), (1, 2, 3), (1, 5, 12, 13, 29),
                                                     (False, True))])
def test_an_equal_split_deals_each_rank_its_stock_batches(world, mbs, n, drop_last):
    ids = list(torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist())
    order = trainer_order(ids, world, mbs, drop_last)
    assert len(order) == padded_length(n, world, mbs, drop_last)
    m = world * mbs
    split = Split.equal(world, m, 1)
    for r in range(world):
        stock = _stock(ids, world, r, mbs, drop_last)
        ours = [list(split.rank_ids(order[k:k + m], r)[0]) for k in range(0, len(order), m)]
        assert ours == stock, (r, ours, stock)


def test_without_even_batches_nothing_is_padded():
    ids = list(range(11))
    assert stock_positions(ids, 2, 2, False, even_batches=False) == ids
    assert padded_length(11, 2, 2, False, even_batches=False) == 11
    order = trainer_order(ids, 2, 2, False, even_batches=False)
    split = Split.equal(2, 4, 1)
    for r in range(2):      # the full rounds are stock's
        stock = _stock(ids, 2, r, 2, False, even=False)[:2]
        assert [list(split.rank_ids(order[k:k + 4], r)[0]) for k in (0, 4)] == stock


def _batches(split, rank, sampler, drop_last=False):
    return TrainerBatches(sampler, split, rank, drop_last=drop_last)


def test_batches_follow_the_seedable_sampler_epoch_by_epoch():
    data = list(range(20))
    world, mbs, gas = 2, 2, 2
    split = Split.equal(world, mbs * gas * world, gas)
    for r in range(world):
        ours = _batches(split, r, stock_sampler(torch.utils.data.RandomSampler(data),
                                                data_seed=5))
        assert len(ours) == 20 // 8 * gas                 # full global batches only
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            stock_sampler_ = SeedableRandomSampler(data_source=data, data_seed=5)
            stock_sampler_.set_epoch(epoch)
            stock = _stock(list(stock_sampler_), world, r, mbs, False)
            assert list(ours) == stock[:len(ours)]
    ours.set_epoch(0)
    first = list(ours)
    ours.set_epoch(1)
    assert list(ours) != first


def test_an_uneven_split_keeps_each_slots_samples():
    data = list(range(24))
    sampler = SequentialSampler(data)
    equal, uneven = Split.equal(2, 8, 2), Split((3, 1), 2)
    eq = [list(_batches(equal, r, sampler)) for r in range(2)]
    un = [list(_batches(uneven, r, sampler)) for r in range(2)]
    assert [len(b) for b in un[0]] == [3] * 6 and [len(b) for b in un[1]] == [1] * 6
    for k in range(6):
        assert sorted(un[0][k] + un[1][k]) == sorted(eq[0][k] + eq[1][k])


def test_a_new_split_takes_effect_at_the_next_step():
    b = _batches(Split((3, 1), 2), 1, SequentialSampler(range(24)))
    it = iter(b)
    sizes = [len(next(it)), len(next(it))]
    b.set_split(Split((1, 3), 2))
    sizes += [len(x) for x in it]
    assert sizes == [1, 1, 3, 3, 3, 3]


def test_the_trainers_resume_skips_indices_then_collates():
    """accelerate's skip_first_batches wraps the batch sampler in a SkipBatchSampler and builds a
    plain DataLoader over it: the micro-batches after the skip are the same."""
    data = [{"x": torch.tensor([float(i)])} for i in range(16)]
    full = _batches(Split((3, 1), 2), 0, SequentialSampler(data))
    want = [b["x"].flatten().tolist() for b in ResplitDataLoader(data, batch_sampler=full)]
    again = _batches(Split((3, 1), 2), 0, SequentialSampler(data))
    skipped = torch.utils.data.DataLoader(data, batch_sampler=SkipBatchSampler(again, 2))
    assert [b["x"].flatten().tolist() for b in skipped] == want[2:]
    loader = ResplitDataLoader(data, batch_sampler=again)
    loader.set_epoch(3)
    assert again.epoch == 3 and len(loader) == 4


def test_a_dataset_without_a_full_global_batch_is_refused():
    with pytest.raises(ValueError, match="give no full global batch of 8"):
        _batches(Split.equal(2, 8, 2), 0, SequentialSampler(range(5)), drop_last=True)
