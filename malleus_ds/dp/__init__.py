"""Straggler-resilient pure data parallel inside DeepSpeed's own engine (ZeRO-1/2/3): each
step's global batch is re-split across ranks in proportion to their speed.

* ``split.py``: a step's split (samples per micro-batch per rank) and which samples each rank
  takes; pure.
* ``sampler.py``: the global sample order stock DeepSpeed uses, and a per-rank loader that
  yields each rank's micro-batches of the current split.
* ``engine.py``: ``MalleusDPEngine``, a ``DeepSpeedEngine`` that weights each rank's loss by
  its share, and ``initialize``, which builds it as ``deepspeed.initialize`` builds its engine.

Only ``split`` is imported here: the others import torch and DeepSpeed.
"""
from malleus_ds.dp.split import LOSS_KINDS, Split, split_for

__all__ = ["LOSS_KINDS", "Split", "split_for"]
