"""The step's one all-reduce (malleus_ds/engine/step_reduce.py): every rank's vector, summed as
the all-reduce would, reads back as each rank's own values; the loss and the non-finite count
land in their slots; every rank's clock numbers come back per rank and the stop signal as the
largest any rank raised; a vector of the wrong size is refused."""
from __future__ import annotations

import math

import pytest
import torch

from malleus_ds.engine.step_reduce import StepReduction


def test_summed_vectors_read_back_every_ranks_values():
    world = 3
    reds = [StepReduction(world, r) for r in range(world)]
    vecs = [red.vector(ready=(r == 0), compute_s=0.1 * (r + 1), probe_per_unit=0.5 if r == 2
                       else 0.0, device="cpu") for r, red in enumerate(reds)]
    reds[1].set_loss(vecs[1], torch.tensor(6.5, dtype=torch.float64))
    reds[2].add_nonfinite(vecs[2], [(torch.tensor([1.0, float("inf"), float("nan")]), None)])
    sums = reds[0].read(sum(vecs))
    assert sums.loss == 6.5 and sums.overflow and sums.ready
    assert sums.compute_s.tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert math.isnan(sums.probe_s[0]) and math.isnan(sums.probe_s[1])
    assert sums.probe_s[2] == 0.5
    quiet = reds[1].read(sum(r.vector(ready=False, compute_s=0.0, probe_per_unit=0.0,
                                      device="cpu") for r in reds))
    assert not quiet.overflow and not quiet.ready and quiet.loss == 0.0


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rank 3 outside a world of 3"):
        StepReduction(3, 3)
    with pytest.raises(ValueError, match="4 values, expected 21"):
        StepReduction(3, 0).read(torch.zeros(4, dtype=torch.float64))


def test_every_ranks_clock_and_the_largest_stop_signal_read_back():
    world = 3
    reds = [StepReduction(world, r) for r in range(world)]
    stops = [0, 15, 1]                      # SIGTERM on rank 1, the launcher gone on rank 2
    vecs = [red.vector(ready=False, compute_s=1.0 + r, probe_per_unit=0.0, device="cpu",
                       emulated_s=0.5 * r, wait_s=0.01 * (r + 1), link_s=0.2 if r == 2 else 0.0,
                       stop=stops[r]) for r, red in enumerate(reds)]
    for red in reds:                        # every rank reads the same
        sums = red.read(sum(vecs))
        assert sums.compute_s.tolist() == [1.0, 2.0, 3.0]
        assert sums.emulated_s.tolist() == [0.0, 0.5, 1.0]
        assert sums.wait_s.tolist() == pytest.approx([0.01, 0.02, 0.03])
        assert sums.link_s.tolist() == [0.0, 0.0, 0.2]
        assert sums.stop == 15 and not sums.late
    calm = reds[0].read(sum(r.vector(ready=False, compute_s=0.1, probe_per_unit=0.0,
                                     device="cpu") for r in reds))
    assert calm.stop == 0 and calm.emulated_s.tolist() == [0.0] * world


def test_the_layout_gives_each_rank_its_own_slot_of_each_quantity():
    """One index per (quantity, rank), none shared, none past the end; the comm slots last."""
    world = 4
    red = StepReduction(world, 0, comm=True)
    per_rank = [red.COMPUTE, red.PROBE, red.EMULATED, red.WAIT, red.LINK, red.STOP]
    slots = [red.LOSS, red.NONFINITE, red.READY] + [q + d for q in per_rank
                                                     for d in range(world)]
    assert sorted(slots) == list(range(red.COMM)) and red.size > red.COMM
    one = StepReduction(world, 2).vector(ready=False, compute_s=1.0, probe_per_unit=2.0,
                                        device="cpu", emulated_s=3.0, wait_s=4.0, link_s=5.0,
                                        stop=6)
    assert {i: v for i, v in enumerate(one.tolist()) if v} == {
        q + 2: float(k) for k, q in enumerate(per_rank, start=1)}
