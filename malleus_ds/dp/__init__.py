"""Straggler-resilient pure data parallel inside DeepSpeed's own engine (ZeRO-1/2/3): each
step's global batch is re-split across ranks in proportion to their speed.

* ``split.py``: a step's split (samples per micro-batch per rank) and which samples each rank
  takes; pure.
* ``sampler.py``: the global sample order stock DeepSpeed uses, and a per-rank loader that
  yields each rank's micro-batches of the current split.
* ``engine.py``: ``MalleusDPEngine``, a ``DeepSpeedEngine`` that weights each rank's loss by
  its share and times its compute, and ``initialize``, which builds it as
  ``deepspeed.initialize`` builds its engine.
* ``timing.py``: DeepSpeed's communication inside forward and backward (ZeRO-1/2's reductions,
  ZeRO-3's parameter all-gathers and reduce-scatters), left out of the compute clock.
* ``loop.py``: the re-split loop: at each optimizer step one small non-blocking all-reduce of
  every rank's seconds per sample, read a step later; every rank's policy decides the same and
  applies it (the decision itself is a policy the app passes in: ``app/dp_loop.py``).
* ``settings.py``: the ds_config ``malleus`` keys this engine reads (``straggler``,
  ``adaptive``, ``detect``).

Only ``split`` is imported here: the others import torch and DeepSpeed.
"""
from malleus_ds.dp.split import LOSS_KINDS, Split, split_for

__all__ = ["LOSS_KINDS", "Split", "split_for"]
