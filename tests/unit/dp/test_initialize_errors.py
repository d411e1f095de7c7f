"""dp.initialize refuses, before any process group, what is not pure data parallel, naming what
to use instead."""
from __future__ import annotations

import pytest
import torch

from malleus_ds.dp.engine import initialize

CFG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}


class _Iterable(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


@pytest.mark.parametrize("kw,match", [
    ({"model": None}, "requires a model"),
    ({"loss": "tokens"}, "loss='tokens': must be one of mean, sum, global"),
    ({"mpu": object()}, "pure data parallel: use deepspeed.initialize"),
    ({"mesh_param": (1, 2)}, "pure data parallel"),
    ({"config": None}, "needs a ds_config"),
    ({"config": {**CFG, "sequence_parallel_size": 2}}, "sequence_parallel_size=2"),
    ({"config": {**CFG, "tensor_parallel": {"autotp_size": 2}}}, "AutoTP"),
    ({"training_data": _Iterable()}, "map-style dataset"),
])
def test_refused_before_any_process_group(kw, match):
    args = {"model": torch.nn.Linear(2, 2), "config": CFG, **kw}
    with pytest.raises(ValueError, match=match):
        initialize(**args)
