"""``"auto"`` in a user's ds_config, resolved as the Hugging Face Trainer and accelerate resolve it.

transformers' and accelerate's DeepSpeed configs leave values to ``"auto"``, which the Trainer
(``integrations/deepspeed.py``: ``trainer_config_process`` and ``trainer_config_finalize``) and
accelerate (``Accelerator._prepare_deepspeed``) fill from their own arguments before DeepSpeed
sees the config; stock DeepSpeed resolves none of them (a string learning rate reaches
``torch.optim.AdamW``: ``TypeError``). Here they are filled from the run's ``train.*`` and model,
by the same rules (:data:`RULES`), for either engine, before any process group exists:

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
    """A copy of ``cfg`` with every ``"auto"`` filled by :data:`_rules` (``train``: the run's
    ``TrainConfig``; ``hidden``: the model's hidden size; ``dp``: its data-parallel replicas),
    and one line per value filled. ``"auto"`` that no rule fills raises ``error(message)``."""
    rules = _rules(train, hidden, dp)
    notes: list[str] = []
    left: list[str] = []

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {k: walk(v, path + (str(k),)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path + (str(i),)) for i, v in enumerate(node)]
        if node == AUTO and isinstance(node, str) and path not in KEPT:
            if path in rules:
                value, why = rules[path]
                notes.append(f"ds_config {'.'.join(path)}=\"auto\" -> {value!r} ({why})")
                return value
            left.append(".".join(path))
        return node

    out = walk(cfg, ())
    if left:
        raise error(f"ds_config {', '.join(left)}=\"auto\": no rule fills "
                    f"{'it' if len(left) == 1 else 'them'} (the Hugging Face Trainer's and "
                    f"accelerate's \"auto\" keys are filled from train.*: "
                    f"{sorted('.'.join(p) for p in rules)}); set a value")
    return out, notes


def auto_paths(cfg: Mapping[str, Any]) -> list[str]:
    """Every path in ``cfg`` that holds ``"auto"`` (``pipeline.stages`` excepted)."""
    found: list[str] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, path + (str(k),))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + (str(i),))
        elif isinstance(node, str) and node == AUTO and path not in KEPT:
            found.append(".".join(path))
    walk(cfg, ())
    return found
