"""What MalleusTrainer refuses before training (``hf/checks.py``), each with the field and its
numbers; and the loss kind the Trainer's normalisation calls for (``hf/loss.py``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from malleus_ds.dp.split import Split
from malleus_ds.hf.checks import check_setup
from malleus_ds.hf.loss import loss_kind

CFG = {"train_batch_size": "auto", "zero_optimization": {"stage": 3}}


def _args(**kw):
    base = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                train_sampling_strategy="random", dataloader_drop_last=False,
                parallelism_config=None)
    return SimpleNamespace(**{**base, **kw})


def _loader(**kw):
    base = dict(split_batches=False, dispatch_batches=None, use_seedable_sampler=True,
                even_batches=True)
    return SimpleNamespace(**{**base, **kw})


class _Iterable(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def _check(cfg=CFG, args=None, loader=None, **kw):
    return check_setup(ds_config=cfg, args=args or _args(), world=2,
                       dataloader_config=loader or _loader(), **kw)


def test_a_good_setup_returns_the_malleus_section():
    got = _check({**CFG, "malleus": {"adaptive": False, "metrics_dir": "m"}},
                 train_dataset=list(range(8)), split=Split((3, 1), 2))
    assert got.adaptive is False and got.metrics_dir == "m"
    assert _check(args=_args(per_device_train_batch_size=1),
                  cfg={**CFG, "malleus": {"adaptive": False}}).adaptive is False


@pytest.mark.parametrize("kw,match", [
    ({"cfg": None}, r"DeepSpeed is not on: set TrainingArguments\(deepspeed=...\)"),
    ({"cfg": {**CFG, "malleus": {"plan": "p.json"}}},
     "ds_config.malleus: plan not read by the data-parallel engine"),
    ({"cfg": {**CFG, "sequence_parallel_size": 2}}, "sequence_parallel_size=2: MalleusTrainer "
                                                    "trains pure data parallel"),
    ({"cfg": {**CFG, "tensor_parallel": {"autotp_size": 2}}}, "autotp_size=2"),
    ({"args": _args(parallelism_config=SimpleNamespace(tp_size=1, cp_size=2, sp_size=1))},
     "parallelism_config cp_size=2"),
    ({"args": _args(train_sampling_strategy="group_by_length")},
     "train_sampling_strategy='group_by_length'"),
    ({"loader": _loader(split_batches=True)}, "split_batches=True"),
    ({"loader": _loader(dispatch_batches=True)}, "dispatch_batches=True"),
    ({"loader": _loader(use_seedable_sampler=False)}, "use_seedable_sampler=False"),
    ({"train_dataset": _Iterable()}, "train_dataset is a _Iterable, not a map-style dataset"),
    ({"train_dataset": list(range(7)), "args": _args(dataloader_drop_last=True)},
     r"7 samples: less than one global batch of 8 \(per_device_train_batch_size=2 x "
     r"gradient_accumulation_steps=2 x 2 ranks\)"),
    ({"args": _args(per_device_train_batch_size=1)},
     r"per_device_train_batch_size=1 is too small to split: .* \(global batch 4 = 1 x "
     r"gradient_accumulation_steps=2 x 2 ranks"),
    ({"split": Split((2, 1), 2)}, r"covers 2 ranks, a batch of 6 in 2 micro-batches; this "
                                  r"Trainer has 2 ranks, .* a global batch of 8"),
])
def test_refused_with_the_field_and_its_numbers(kw, match):
    with pytest.raises(ValueError, match=match):
        _check(**kw)


def test_a_pipeline_module_is_refused():
    from deepspeed.pipe import PipelineModule

    pipe = PipelineModule.__new__(PipelineModule)
    with pytest.raises(ValueError, match="PipelineModule .*MalleusTrainer trains pure data"):
        _check(model=pipe)


@pytest.mark.parametrize("avg,takes,items,kind", [
    (True, True, 12, "global"), (True, True, None, "mean"), (True, False, 12, "mean"),
    (False, True, 12, "mean"), (False, False, None, "mean")])
def test_the_loss_kind_follows_the_trainers_normalisation(avg, takes, items, kind):
    assert loss_kind(avg, takes, items) == kind
