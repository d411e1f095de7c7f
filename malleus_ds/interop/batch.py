"""The batch of a run from ``train.*`` and the ds_config's batch keys, as a DeepSpeed user expects.

DeepSpeed reads three keys and derives the one left out from the other two and the data-parallel
degree ``dp`` (``deepspeed/runtime/config.py``, ``_set_batch_related_parameters``)::

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp

A user who brings a ds_config that names its batch should not have to repeat it as ``train.*``;
a user who names both must not get one of them silently. So :func:`resolve_batch`:

* takes ``train.global_batch_size`` / ``train.micro_batch_size`` where they were given, and the
  ds_config's batch where they were not (``"auto"`` or absent counts as not given there);
* refuses, naming both, a ds_config batch that the given ``train.*`` contradicts, and a
  ds_config whose three keys contradict each other (as DeepSpeed does);
* falls back to :data:`DEFAULT_BATCH` (8 and 1, the app's ``TrainConfig`` defaults) where
  neither says; where only ``gradient_accumulation_steps`` says (accelerate's configs leave
  the batch sizes ``"auto"`` beside an accumulation of 1), the micro-batch is the default and
  the batch is ``micro x accumulation x dp``.

Pure: the same answer and the same error on every rank, before any process group exists.
"""
from __future__ import annotations

from typing import Any, Mapping

#: the batch where neither ``train.*`` nor the ds_config says (TrainConfig's defaults)
DEFAULT_BATCH = (8, 1)
#: DeepSpeed's batch keys, in the order its messages name them
KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _given(cfg: Mapping[str, Any], error) -> dict[str, int]:
    """The ds_config's batch keys with a value (not absent, null or ``"auto"``), each checked to
    be an integer >= 1."""
    out = {}
    for k in KEYS:
        v = cfg.get(k)
        if v is None or v == "auto":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 1:
            raise error(f"ds_config {k}={v!r} must be an integer >= 1 (or \"auto\")")
        out[k] = int(v)
    return out


def ds_batch(keys: Mapping[str, int], dp: int, error,
             names: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(global batch, micro-batch) that DeepSpeed derives from the batch ``keys`` given (at
    least one of :data:`KEYS`, each an int) at ``dp`` replicas. Keys that contradict each other
    or do not divide raise ``error`` naming them (``names``: how to name a key that came from
    elsewhere, e.g. ``train.global_batch_size``)."""
    tbs, mbs, gas = (keys.get(k) for k in KEYS)
    names = names or {}
    named = ", ".join(f"{names.get(k, 'ds_config ' + k)}={keys[k]}" for k in KEYS if k in keys)
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise error(f"{named}: {mbs} x {gas} x dp={dp} = {mbs * gas * dp}, not {tbs} "
                        f"(DeepSpeed refuses this too); fix one, or drop one and let it be "
                        f"derived")
        return tbs, mbs
    if tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise error(f"{named}: {tbs} is not a multiple of {mbs} x dp={dp}; DeepSpeed "
                        f"needs a whole number of accumulation steps")
        return tbs, mbs
    if tbs is not None:
        gas = gas or 1                           # DeepSpeed: no accumulation unless told
        if tbs % (gas * dp):
            raise error(f"{named}: {tbs} is not a multiple of {gas} x dp={dp}; DeepSpeed "
                        f"needs a whole micro-batch size")
        return tbs, tbs // (gas * dp)
    if mbs is not None:
        return mbs * (gas or 1) * dp, mbs
    raise error(f"{named} alone does not give a batch: add train_batch_size or "
                f"train_micro_batch_size_per_gpu (as DeepSpeed needs), or set "
                f"train.global_batch_size and train.micro_batch_size")


#: the ``train.*`` field that stands for each of DeepSpeed's keys
TRAIN = {"train_batch_size": "global_batch_size",
         "train_micro_batch_size_per_gpu": "micro_batch_size"}


def resolve_batch(cfg: Mapping[str, Any], train: Mapping[str, Any], dp: int, error,
                  defaults: tuple[int, int] = DEFAULT_BATCH) -> tuple[int, int, list[str]]:
    """(global batch, micro-batch, notes) of the run (module doc). ``train``: the
    ``global_batch_size`` / ``micro_batch_size`` given (None or absent: not given)."""
    got = _given(cfg, error)
    mine = {k: int(train[f]) for k, f in TRAIN.items() if train.get(f) is not None}
    if not got:                                  # the ds_config does not say: train.* rules
        return (mine.get("train_batch_size", defaults[0]),
                mine.get("train_micro_batch_size_per_gpu", defaults[1]), [])
    for k, v in mine.items():
        if k in got and got[k] != v:
            raise error(f"ds_config {k}={got[k]} contradicts train.{TRAIN[k]}={v}; drop one "
                        f"of the two, or set the ds_config's to \"auto\"")
    if len(mine) == 2:                           # both given: the ds_config's must agree
        G, B = mine["train_batch_size"], mine["train_micro_batch_size_per_gpu"]
        gas = got.get("gradient_accumulation_steps")
        if gas is not None and G != B * gas * dp:
            raise error(f"ds_config gradient_accumulation_steps={gas} contradicts "
                        f"train.global_batch_size={G}, train.micro_batch_size={B} at dp={dp} "
                        f"({B} x {gas} x {dp} = {B * gas * dp}); drop it, or set it to "
                        f"\"auto\"")
        return G, B, []
    keys = dict(got, **mine)
    names = {k: f"train.{TRAIN[k]}" for k in mine}
    if set(keys) == {"gradient_accumulation_steps"}:
        # only the accumulation says (accelerate's configs: the batch sizes "auto", the
        # accumulation 1): the micro-batch is train.*'s default, the batch follows from it
        keys["train_micro_batch_size_per_gpu"] = defaults[1]
        names["train_micro_batch_size_per_gpu"] = "train.micro_batch_size (default)"
    G, B = ds_batch(keys, dp, error, names)
    notes = [f"train.{f}={v} from the ds_config's {', '.join(sorted(got))} at dp={dp}"
             for f, v in (("global_batch_size", G), ("micro_batch_size", B))
             if train.get(f) is None]
    return G, B, notes
