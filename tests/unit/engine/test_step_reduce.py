"""The step's one all-reduce (malleus_ds/engine/step_reduce.py): every rank's vector, summed as
the all-reduce would, reads back as each rank's own values; the loss and the non-finite count
land in their slots; a vector of the wrong size is refused."""
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
    with pytest.raises(ValueError, match="4 values, expected 9"):
        StepReduction(3, 0).read(torch.zeros(4, dtype=torch.float64))
