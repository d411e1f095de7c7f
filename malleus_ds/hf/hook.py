"""Which engine accelerate builds: ``deepspeed.initialize`` replaced for a span of code.

accelerate's ``Accelerator._prepare_deepspeed`` (what the Hugging Face Trainer's
``accelerator.prepare`` runs under DeepSpeed) fills the ds_config's ``"auto"`` values, builds the
optimizer and scheduler arguments, then reads ``deepspeed.initialize`` from the ``deepspeed``
module and calls it with keywords (``model``, ``config_params``, ``optimizer`` or
``model_parameters``, ``lr_scheduler``, ``mpu``). Replacing that module attribute while the
Trainer prepares keeps all of accelerate's and the Trainer's work and changes only the engine.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def deepspeed_initialize_replaced(build: Callable) -> Iterator[None]:
    """``deepspeed.initialize`` is ``build`` inside the block, and what it was after it (also
    when the block raises). Not reentrant across threads: one training loop per process."""
    import deepspeed

    saved = deepspeed.initialize
    deepspeed.initialize = build
    try:
        yield
    finally:
        deepspeed.initialize = saved
