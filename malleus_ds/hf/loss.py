"""How the Hugging Face Trainer's loss is normalised under DeepSpeed, as a ``dp.split`` loss kind.

transformers' ``Trainer.training_step`` hands accelerate, for each micro-batch, the loss that
``compute_loss`` returns, and accelerate calls ``engine.backward(loss, scale_wrt_gas=False)``:
DeepSpeed then averages the ranks' gradients and does *not* divide by the accumulation steps,
the Trainer having done it itself. Two cases (``Trainer.compute_loss`` / ``training_step``):

* ``"global"``: ``average_tokens_across_devices`` on, the model takes loss keywords (or a
  ``compute_loss_func`` is given) and the batches have labels (``num_items_in_batch`` is the
  step's label count summed over every rank and micro-batch): the loss is the micro-batch's
  summed token loss over that global count, times the world size. DeepSpeed's average over
  ranks is then already the global batch's mean: weighted by nothing, whatever the split.
* ``"mean"``: otherwise. The loss is the rank's own mean divided by the accumulation steps
  (``num_items_in_batch`` None, or a model that takes no loss keywords), or its summed token
  loss over the rank's own label count of the step (``average_tokens_across_devices`` off): a
  per-rank mean in both, which the engine weights by the rank's share of the step. Stock
  averages the ranks' means, which is the global mean when every sample carries as many labels;
  the re-split run gives the mean over the global batch's samples.

A ``compute_loss`` override must keep this normalisation, or say which it uses.
"""
from __future__ import annotations


def loss_kind(average_tokens_across_devices: bool, takes_loss_kwargs: bool,
              num_items_in_batch) -> str:
    """The engine's loss kind for a step of the Trainer: ``"global"`` or ``"mean"`` (module
    doc). ``takes_loss_kwargs``: the Trainer's ``model_accepts_loss_kwargs`` or a
    ``compute_loss_func`` given; ``num_items_in_batch``: what ``get_batch_samples`` counted for
    the step (None: no labels counted)."""
    if average_tokens_across_devices and takes_loss_kwargs and num_items_in_batch is not None:
        return "global"
    return "mean"
