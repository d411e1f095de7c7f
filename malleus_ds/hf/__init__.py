"""The Hugging Face Trainer, straggler-resilient: ``malleus_ds.hf.MalleusTrainer`` is
``transformers.Trainer`` with DeepSpeed's engine replaced by ``MalleusDPEngine`` (``dp/``) and
each step's batch re-split across the ranks by their measured speed. Change ``Trainer`` to
``MalleusTrainer``; nothing else.

* ``trainer.py``: ``MalleusTrainer`` (its three overrides: ``train``, ``get_train_dataloader``,
  ``training_step``);
* ``hook.py``: the engine accelerate builds, by replacing ``deepspeed.initialize`` while the
  Trainer trains;
* ``order.py``: the stock Trainer's global sample order under accelerate (pure);
* ``loader.py``: the train dataloader: each rank's micro-batches of the current split;
* ``loss.py``: how the Trainer normalises its loss, as the engine's loss kind;
* ``checks.py``: what is refused before training, and why.

Needs ``accelerate`` (``pip install malleus_ds[hf]``). ``MalleusTrainer`` is imported on first
use, so the pure modules here load without transformers' Trainer.
"""
__all__ = ["MalleusTrainer"]


def __getattr__(name):
    if name == "MalleusTrainer":
        from malleus_ds.hf.trainer import MalleusTrainer

        return MalleusTrainer
    raise AttributeError(f"module 'malleus_ds.hf' has no attribute {name!r}")
