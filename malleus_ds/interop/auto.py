"""``"auto"`` in a user's ds_config, resolved as the Hugging Face Trainer and accelerate resolve it.

transformers' and accelerate's DeepSpeed configs leave values to ``"auto"``, which the Trainer
(``integrations/deepspeed.py``: ``trainer_config_process`` and ``trainer_config_finalize``) and
accelerate (``Accelerator._prepare_deepspeed``) fill from their own arguments before DeepSpeed
sees the config; stock DeepSpeed resolves none of them (a string learning rate reaches
``torch.optim.AdamW``: ``TypeError``). Here they are filled from the run's ``train.*`` and model,
by the same rules (:func:`_rules`), for either engine, before any process group exists:

=============================================  ============================================
path                                           value
=============================================  ============================================
``train_micro_batch_size_per_gpu``             ``train.micro_batch_size``
``gradient_accumulation_steps``                micro-batches per data-parallel replica
``train_batch_size``                           ``train.global_batch_size``
``gradient_clipping``                          1.0 (the Trainer's ``max_grad_norm``; the run
                                               has no clipping field)
``optimizer.params.lr`` / ``betas`` / ``eps``  ``train.lr`` / ``train.betas`` / ``train.eps``
``optimizer.params.weight_decay``              ``train.weight_decay``
``scheduler.params.warmup_min_lr``             0
``scheduler.params.warmup_max_lr``             ``train.lr``
``scheduler.params.warmup_num_steps``          1 (the Trainer's default, no warm-up, at
                                               DeepSpeed's minimum)
``scheduler.params.total_num_steps``           ``train.steps``
``fp16.enabled`` / ``bf16.enabled``            false (the Trainer without ``--fp16``/``--bf16``)
``zero_optimization.reduce_bucket_size``       hidden size squared
``zero_optimization.stage3_prefetch_bucket_    0.9 x hidden size squared
size``
``zero_optimization.stage3_param_persistence_  10 x hidden size
threshold``
``zero_optimization.stage3_gather_16bit_       false
weights_on_model_save``
=============================================  ============================================

``"auto"`` anywhere else is a :class:`ConfigError` naming its path (``pipeline.stages``, whose
DeepSpeed default is ``"auto"``, excepted). Each value filled is listed in one line.

No torch, no DeepSpeed.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

AUTO = "auto"

#: ``"auto"`` that DeepSpeed itself takes as a value
KEPT = frozenset({("pipeline", "stages")})


def _rules(train, hidden: int, dp: int) -> dict[tuple[str, ...], tuple[Any, str]]:
    """path -> (value, where it comes from)."""
    n = train.global_batch_size // train.micro_batch_size
    h2 = hidden * hidden
    return {
        ("train_micro_batch_size_per_gpu",): (train.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps",): (max(1, n // dp), f"{n} micro-batches / dp={dp}"),
        ("train_batch_size",): (train.global_batch_size, "train.global_batch_size"),
        ("gradient_clipping",): (1.0, "the Trainer's default max_grad_norm"),
        ("optimizer", "params", "lr"): (train.lr, "train.lr"),
        ("optimizer", "params", "betas"): (list(train.betas), "train.betas"),
        ("optimizer", "params", "eps"): (train.eps, "train.eps"),
        ("optimizer", "params", "weight_decay"): (train.weight_decay, "train.weight_decay"),
        ("scheduler", "params", "warmup_min_lr"): (0.0, "the Trainer's rule"),
        ("scheduler", "params", "warmup_max_lr"): (train.lr, "train.lr"),
        ("scheduler", "params", "warmup_num_steps"): (
            1, "the Trainer's default: no warm-up, at DeepSpeed's minimum of 1"),
        ("scheduler", "params", "total_num_steps"): (train.steps, "train.steps"),
        ("fp16", "enabled"): (False, "the Trainer's default without --fp16"),
        ("bf16", "enabled"): (False, "the Trainer's default without --bf16"),
        ("bfloat16", "enabled"): (False, "the Trainer's default without --bf16"),
        ("zero_optimization", "reduce_bucket_size"): (h2, f"hidden size {hidden} squared"),
        ("zero_optimization", "stage3_prefetch_bucket_size"): (
            int(0.9 * h2), f"0.9 x hidden size {hidden} squared"),
        ("zero_optimization", "stage3_param_persistence_threshold"): (
            10 * hidden, f"10 x hidden size {hidden}"),
        ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): (
            False, "accelerate's rule"),
    }


def resolve_auto(cfg: Mapping[str, Any], train, hidden: int, dp: int,
                 error: Callable[[str], Exception] = ValueError) -> tuple[dict, list[str]]:
    """A copy of ``cfg`` with every ``"auto"`` filled by :func:`_rules` (``train``: the run's
    ``TrainConfig``; ``hidden``: the model's hidden size; ``dp``: its data-parallel replicas),
    and one line per value filled. ``"auto"`` that no rule fills raises ``error(message)``."""
    rules = _rules(train, hidden, dp)
    found = _autos(cfg)
    left = [_dotted(p) for p in found if _named(p) not in rules]
    if left:
        raise error(f"ds_config {', '.join(left)}=\"auto\": no rule fills "
                    f"{'it' if len(left) == 1 else 'them'} (the Hugging Face Trainer's and "
                    f"accelerate's \"auto\" keys are filled from train.*: "
                    f"{sorted('.'.join(p) for p in rules)}); set a value")
    out = copy.deepcopy(dict(cfg))
    notes = []
    for path in found:
        value, why = rules[_named(path)]
        node = out
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        notes.append(f"ds_config {_dotted(path)}=\"auto\" -> {value!r} ({why})")
    return out, notes


def auto_paths(cfg: Mapping[str, Any]) -> list[str]:
    """Every path in ``cfg`` that holds ``"auto"`` (``pipeline.stages`` excepted)."""
    return [_dotted(p) for p in _autos(cfg)]


def _autos(node: Any, path: tuple = ()) -> list[tuple]:
    """The paths (key tuples; a list's items by their index) that hold ``"auto"``, in order,
    :data:`KEPT` left out."""
    if isinstance(node, Mapping):
        return [p for k, v in node.items() for p in _autos(v, path + (k,))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _autos(v, path + (i,))]
    auto = isinstance(node, str) and node == AUTO and _named(path) not in KEPT
    return [path] if auto else []


def _named(path: tuple) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def _dotted(path: tuple) -> str:
    return ".".join(_named(path))
