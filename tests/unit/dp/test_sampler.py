"""dp/sampler.py: the global order is torch's DistributedSampler's, an equal split yields exactly
stock DeepSpeed's per-rank micro-batches, an uneven one covers each step once, and a new split
takes effect at the next step."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from malleus_ds.dp.sampler import ResplitLoader, global_order
from malleus_ds.dp.split import Split, split_for


class _Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": torch.tensor(i), "x": torch.full((2,), float(i))}


@pytest.mark.parametrize("n,world,drop", [(20, 2, False), (21, 4, False), (21, 4, True),
                                          (1001, 8, False), (1001, 8, True),
                                          (3, 4, False)])
def test_global_order_is_what_each_ranks_sampler_takes(n, world, drop):
    for epoch in (0, 3):
        order = global_order(n, world, seed=5, epoch=epoch, drop_last=drop)
        for r in range(world):
            s = DistributedSampler(range(n), num_replicas=world, rank=r, seed=5, drop_last=drop)
            s.set_epoch(epoch)
            assert order[r::world] == list(s)


def test_an_equal_split_yields_stock_deepspeeds_batches():
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    data, world, mbs, gas = _Data(48), 2, 3, 2
    split = Split.equal(world, world * mbs * gas, gas)
    for r in range(world):
        stock = DeepSpeedDataLoader(data, batch_size=mbs, pin_memory=False, local_rank=r,
                                    tput_timer=None, num_local_io_workers=0,
                                    data_parallel_world_size=world, data_parallel_rank=r)
        ours = ResplitLoader(data, split, r)
        want = [b["id"].tolist() for b in stock]
        got = [b["id"].tolist() for b in ours]
        assert got == want and len(ours) == len(want) == 8


def test_an_uneven_split_covers_every_step_once_and_changes_at_a_step_boundary():
    data, gas = _Data(40), 2
    even, uneven = Split.equal(2, 8, gas), split_for([1.0, 100.0], 8, gas)
    assert uneven.shares == (3, 1)
    loaders = [ResplitLoader(data, even, r) for r in range(2)]
    its = [iter(x) for x in loaders]
    order = global_order(40, 2)
    for step in range(5):
        got = {0: [], 1: []}
        for k in range(gas):
            for r in range(2):
                got[r].append(next(its[r])["id"].tolist())
            if step == 1 and k == 0:
                assert loaders[0].mid_step()
                for x in loaders:
                    x.set_split(uneven)           # mid-step: waits for step 2
        assert not loaders[0].mid_step()
        shares = (2, 2) if step < 2 else (3, 1)
        for r in range(2):
            assert [len(b) for b in got[r]] == [shares[r]] * gas, (step, r)
        flat = sorted(i for r in range(2) for b in got[r] for i in b)
        assert flat == sorted(order[step * 8:(step + 1) * 8])
        assert loaders[1].last_ids == tuple(got[1][-1])
    assert len(loaders[0]) == 10


def test_resume_at_a_step_yields_the_rest_of_the_epoch_once():
    data, split = _Data(40), split_for([1.0, 2.0], 8, 2)
    full = [b["id"].tolist() for b in ResplitLoader(data, split, 1)]
    x = ResplitLoader(data, split, 1)
    x.resume_at(3)
    assert [b["id"].tolist() for b in x] == full[3 * 2:]
    assert [b["id"].tolist() for b in x] == full             # the next epoch from its start
    with pytest.raises(ValueError, match="step 5 is not in an epoch of 5 steps"):
        x.resume_at(5)


def test_bad_input():
    with pytest.raises(ValueError, match="rank 2 is not in a split of 2 ranks"):
        ResplitLoader(_Data(8), Split.equal(2, 4, 1), 2)
    with pytest.raises(ValueError, match="3 samples over 2 ranks give no full global batch of 8"):
        ResplitLoader(_Data(3), Split.equal(2, 8, 2), 0)
    x = ResplitLoader(_Data(8), Split.equal(2, 4, 1), 0)
    with pytest.raises(ValueError, match="must keep the world, global batch"):
        x.set_split(Split.equal(2, 8, 1))
