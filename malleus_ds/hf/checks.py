"""What ``MalleusTrainer`` refuses, checked when it is built (before any training), each a
ValueError naming the field, its value and what to do instead.

Pure: the caller passes the Trainer's pieces; nothing here starts a process group.
"""
from __future__ import annotations

from typing import Any, Mapping

from malleus_ds.dp.settings import DPSettings
from malleus_ds.dp.split import Split
from malleus_ds.hf.order import padded_length

#: the Trainer's train_sampling_strategy values whose order MalleusTrainer deals itself
ORDERED_STRATEGIES = ("random", "sequential")

_DP_ONLY = ("MalleusTrainer trains pure data parallel (ZeRO-0/1/2/3, each step's batch split "
            "across the ranks); train this model with the stock Trainer")


def check_setup(*, ds_config: Mapping[str, Any] | None, args: Any, world: int,
                dataloader_config: Any = None, train_dataset: Any = None, model: Any = None,
                split: Split | None = None) -> DPSettings:
    """Check a MalleusTrainer's setup and return its ds_config's ``malleus`` section, parsed.

    ``ds_config``: the DeepSpeed config the Trainer uses (None: DeepSpeed is off); ``args``:
    its ``TrainingArguments`` (read: ``per_device_train_batch_size``,
    ``gradient_accumulation_steps``, ``train_sampling_strategy``, ``dataloader_drop_last``,
    ``parallelism_config``); ``world``: the data-parallel ranks; ``dataloader_config``:
    accelerate's (``split_batches``, ``dispatch_batches``, ``use_seedable_sampler``,
    ``even_batches``); ``split``: the first split asked for, if any."""
    if ds_config is None:
        raise ValueError("MalleusTrainer trains under DeepSpeed and DeepSpeed is not on: set "
                         "TrainingArguments(deepspeed=...) to a ds_config (a dict or the path of "
                         "its JSON file; \"auto\" values are filled from the arguments, as for "
                         "the stock Trainer)")
    settings = DPSettings.from_config(ds_config.get("malleus"), "ds_config.malleus")
    _check_parallelism(ds_config, args, model)
    _check_order(args, dataloader_config)
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    batch = mbs * gas * world
    if train_dataset is not None:
        check_dataset(train_dataset, args, dataloader_config, world, mbs, batch)
    if settings.adaptive and world > 1 and mbs == 1:
        raise ValueError(f"per_device_train_batch_size=1 is too small to split: each "
                         f"micro-batch gives every one of the {world} ranks one sample, the "
                         f"smallest share the collectives allow, so no split can move a sample "
                         f"off a slow rank (global batch {batch} = 1 x "
                         f"gradient_accumulation_steps={gas} x {world} ranks); set "
                         f"per_device_train_batch_size >= 2, or ds_config malleus.adaptive: "
                         f"false to train with stock's split")
    if split is not None:
        want = (world, batch, gas)
        got = (split.world, split.global_batch, split.micro_batches)
        if got != want:
            raise ValueError(f"split={split.json()} covers {got[0]} ranks, a batch of {got[1]} "
                             f"in {got[2]} micro-batches; this Trainer has {world} ranks, "
                             f"per_device_train_batch_size={mbs} and "
                             f"gradient_accumulation_steps={gas}: a global batch of {batch} "
                             f"in {gas} micro-batches")
    return settings


def _check_parallelism(ds_config: Mapping[str, Any], args: Any, model: Any) -> None:
    if model is not None:
        try:
            from deepspeed.pipe import PipelineModule
        except ImportError:                 # pragma: no cover - DeepSpeed is a dependency
            PipelineModule = ()
        if isinstance(model, PipelineModule):
            raise ValueError(f"model is a DeepSpeed PipelineModule (pipeline parallel, which "
                             f"ZeRO-2/3 do not take): {_DP_ONLY}, or as a plain module")
    sp = ds_config.get("sequence_parallel_size", 1)
    if sp not in (1, None):
        raise ValueError(f"ds_config sequence_parallel_size={sp}: {_DP_ONLY}")
    tp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0
    if tp > 1:
        raise ValueError(f"ds_config tensor_parallel.autotp_size={tp}: {_DP_ONLY}")
    pc = getattr(args, "parallelism_config", None)
    if pc is not None:
        sizes = {k: getattr(pc, k, 1) or 1 for k in ("tp_size", "cp_size", "sp_size")}
        big = {k: v for k, v in sizes.items() if v > 1}
        if big:
            raise ValueError(f"TrainingArguments.parallelism_config "
                             f"{', '.join(f'{k}={v}' for k, v in big.items())}: {_DP_ONLY}")


def _check_order(args: Any, dataloader_config: Any) -> None:
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ORDERED_STRATEGIES:
        raise ValueError(f"TrainingArguments.train_sampling_strategy={strategy!r}: "
                         f"MalleusTrainer deals each step's samples across the ranks itself, "
                         f"from the order of a 'random' or 'sequential' sampler; use one of "
                         f"those")
    if dataloader_config is None:
        return
    for key in ("split_batches", "dispatch_batches"):
        if getattr(dataloader_config, key, None):
            raise ValueError(f"accelerator_config {key}=True: MalleusTrainer deals each step's "
                             f"samples across the ranks itself (every rank reads its own); "
                             f"leave {key} off")
    if strategy == "random" and not getattr(dataloader_config, "use_seedable_sampler", True):
        raise ValueError("accelerator_config use_seedable_sampler=False: each rank's random "
                         "sampler is then seeded at random and synchronised by accelerate as it "
                         "iterates; MalleusTrainer computes the epoch's order on every rank and "
                         "needs the seedable sampler (the default, True)")


def check_dataset(dataset: Any, args: Any, dataloader_config: Any, world: int, mbs: int,
                  batch: int) -> None:
    """``dataset`` is map-style and holds a global batch of ``batch`` (``mbs`` per rank and
    micro-batch) once padded as accelerate pads (``dataloader_drop_last``, ``even_batches``)."""
    import torch

    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
            hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(f"train_dataset is a {type(dataset).__name__}, not a map-style "
                         f"dataset: MalleusTrainer deals each step's samples across the ranks "
                         f"by index; pass one with __getitem__ and __len__ (a datasets.Dataset, "
                         f"not an IterableDataset)")
    drop_last = bool(getattr(args, "dataloader_drop_last", False))
    even = bool(getattr(dataloader_config, "even_batches", True))
    n = len(dataset)
    if padded_length(n, world, mbs, drop_last, even) < batch:
        raise ValueError(f"train_dataset has {n} samples: less than one global batch of "
                         f"{batch} (per_device_train_batch_size={mbs} x "
                         f"gradient_accumulation_steps={args.gradient_accumulation_steps} x "
                         f"{world} ranks); an epoch is the dataset's full global batches")
