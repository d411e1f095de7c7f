"""``MalleusTrainer``: the Hugging Face ``Trainer`` under DeepSpeed, each step's batch re-split
across the ranks by their measured speed.

A drop-in subclass of ``transformers.Trainer``: the same constructor and ``TrainingArguments``
(``deepspeed=`` a ds_config dict or path, ``"auto"`` values included), the same loop, logging,
callbacks, evaluation and checkpoints. Three things change, each in one override:

* ``train``: while it runs, accelerate's ``deepspeed.initialize`` call builds
  :class:`~malleus_ds.dp.engine.MalleusDPEngine` instead of ``DeepSpeedEngine``
  (``hf/hook.py``), through ``malleus_ds.initialize``'s own data-parallel path
  (``app/api.py``'s ``dp_engine``: the ds_config's ``malleus`` section read, the re-split loop
  attached unless ``malleus.adaptive`` is false, ``metrics.jsonl`` with ``malleus.metrics_dir``).
  accelerate still fills the ``"auto"`` values and wraps the engine, optimizer and scheduler.
* ``get_train_dataloader``: each rank's micro-batches of the current split, in the stock
  Trainer's global sample order (``hf/loader.py``, ``hf/order.py``); accelerate does not
  re-shard it. With an equal split these are exactly the stock Trainer's batches.
* ``training_step``: the engine weights the rank's loss by its share of the step (``"mean"``),
  or by nothing when the Trainer has already normalised it over the global batch
  (``average_tokens_across_devices``, ``"global"``: ``hf/loss.py``), and the loss handed back
  for logging carries the same weight, so the logged loss is the global batch's, as stock's.

Checkpoints are DeepSpeed's own and the Trainer's files: one written here resumes in the stock
Trainer and the reverse. The split in force and the re-split loop's state ride in DeepSpeed's
model-states file (``MalleusDPEngine.save_checkpoint``): a resumed run goes on with the split it
had, and a checkpoint of another world size resumes from the first split, saying so. A new split
takes effect at a step boundary: the loop's decisions do, and so does
``trainer.model_wrapped.set_split(split)`` from a callback's ``on_step_end``; a split changed
after the Trainer fetched a step's batches (``on_step_begin``) is refused at that step.
Evaluation runs as in the stock Trainer.

Refused before training, each with a ValueError naming the field (``hf/checks.py``): DeepSpeed
off, pipeline / tensor / sequence parallelism, an IterableDataset, a sampler whose order is not
the same on every rank (``group_by_length``, ``batch_rebalance``, accelerate's
``use_seedable_sampler=False``, ``split_batches``, ``dispatch_batches``), a dataset smaller than
one global batch, and ``per_device_train_batch_size=1`` with the re-split on (nothing to move).
"""
from __future__ import annotations

import logging

from transformers import Trainer

from malleus_ds.dp.split import Split
from malleus_ds.hf.checks import check_setup
from malleus_ds.hf.hook import deepspeed_initialize_replaced
from malleus_ds.hf.loss import loss_kind

logger = logging.getLogger(__name__)


class MalleusTrainer(Trainer):
    """``transformers.Trainer`` training with ``MalleusDPEngine`` (module doc). Takes the
    Trainer's arguments, plus ``split``: the first split (a :class:`~malleus_ds.dp.split.Split`
    of the global batch; None: equal, stock's). The ds_config's ``malleus`` section
    (``straggler``, ``adaptive``, ``detect``, ``metrics_dir``) is read as
    ``malleus_ds.initialize`` reads it."""

    def __init__(self, *args, split: Split | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        self.malleus_settings = check_setup(
            ds_config=plugin.deepspeed_config if plugin is not None else None, args=self.args,
            world=self.args.world_size, dataloader_config=self.accelerator.dataloader_config,
            train_dataset=self.train_dataset, model=self.model, split=split)
        self._first_split = split
        self._batches = None                # the train dataloader's TrainerBatches

    # --- the engine -------------------------------------------------------------------------

    def train(self, *args, **kwargs):
        """``Trainer.train``, with accelerate building ``MalleusDPEngine``."""
        with deepspeed_initialize_replaced(self._build_engine):
            out = super().train(*args, **kwargs)
        loop = getattr(self.model_wrapped, "loop", None)
        if loop is not None:
            loop.flush()                    # the last step's all-reduce: its metrics line
        return out

    def _build_engine(self, **kwargs):
        """What accelerate's ``deepspeed.initialize(**kwargs)`` call runs: ``malleus_ds``'s
        data-parallel engine with the re-split loop, its split and loader joined to the train
        dataloader."""
        from malleus_ds.app.api import dp_engine

        cfg = kwargs.pop("config_params", None)
        cfg = kwargs.pop("config", None) if cfg is None else cfg
        model = kwargs.pop("model", None)
        out = dp_engine(model, dict(cfg), "the Hugging Face Trainer's model", **kwargs)
        self._join(out[0])
        return out

    def _join(self, engine) -> None:
        """The engine's split and the train dataloader's, one: set_split reaches the loader."""
        batches = self._batches
        if batches is None:
            return
        engine.training_dataloader = batches
        batches.tput_timer = engine.tput_timer
        first, self._first_split = self._first_split, None
        engine.set_split(first or engine.split)

    # --- the data ---------------------------------------------------------------------------

    def get_train_dataloader(self):
        """Each rank's micro-batches of the current split, in the stock Trainer's global order
        (``hf/loader.py``), with the Trainer's collator (unused columns removed, as stock)."""
        from transformers.utils import is_datasets_available

        from malleus_ds.hf.checks import check_dataset
        from malleus_ds.hf.loader import ResplitDataLoader, TrainerBatches, stock_sampler

        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args, cfg = self.args, self.accelerator.dataloader_config
        dataset, collator = self.train_dataset, self.data_collator
        if is_datasets_available() and _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        world, mbs, gas = args.world_size, self._train_batch_size, args.gradient_accumulation_steps
        check_dataset(dataset, args, cfg, world, mbs, mbs * gas * world)
        sampler = stock_sampler(self._get_train_sampler(dataset), cfg.use_seedable_sampler,
                                cfg.data_seed)
        batches = TrainerBatches(sampler, Split.equal(world, mbs * gas * world, gas),
                                 args.process_index, drop_last=args.dataloader_drop_last,
                                 even_batches=cfg.even_batches)
        if args.dataloader_num_workers:
            logger.warning("MalleusTrainer collates the training batches in the training "
                           "process (dataloader_num_workers=%d is not used for them): a step's "
                           "split is decided at the end of the step before, after a worker "
                           "would have read ahead", args.dataloader_num_workers)
        self._batches = batches
        from malleus_ds.dp.engine import MalleusDPEngine

        if isinstance(self.model_wrapped, MalleusDPEngine):     # a second train(): same engine
            self._join(self.model_wrapped)
        return ResplitDataLoader(dataset, batch_sampler=batches, collate_fn=collator,
                                 pin_memory=args.dataloader_pin_memory)

    # --- the loss ---------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step`` with the engine's loss kind set for the step; returns the
        loss weighted as the engine weighted it, so the Trainer's logged mean over the ranks is
        the global batch's loss."""
        from malleus_ds.dp.engine import MalleusDPEngine

        if not isinstance(model, MalleusDPEngine):
            raise RuntimeError(f"MalleusTrainer's model is a {type(model).__name__}, not the "
                               f"MalleusDPEngine its train() builds: train through "
                               f"MalleusTrainer.train()")
        served = self._batches.step_split if self._batches is not None else None
        if served is not None and served != model.split:
            raise RuntimeError(f"the split changed from {list(served.shares)} to "
                               f"{list(model.split.shares)} after the Trainer fetched the step's "
                               f"batches: set a new split at a step's end (a callback's "
                               f"on_step_end), before the next step's batches are read")
        model.loss_kind = loss_kind(self.args.average_tokens_across_devices,
                                    self.model_accepts_loss_kwargs
                                    or self.compute_loss_func is not None, num_items_in_batch)
        w = model.loss_weight()
        loss = super().training_step(model, inputs, num_items_in_batch)
        return loss if w == 1.0 else loss * w


def _is_hf_dataset(dataset) -> bool:
    import datasets

    return isinstance(dataset, datasets.Dataset)
