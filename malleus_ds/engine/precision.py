"""Mixed precision for MalleusEngine from the stock ``"bf16"`` / ``"fp16"`` ds_config sections.

What runs in which dtype (DeepSpeed's ``BF16_Optimizer`` / ``FP16_Optimizer`` split, re-cut for
per-layer replica sets):

* the stage module's parameters, activations and the pipeline's p2p buffers (activations and
  their gradients) and the TP all-reduces inside a stage: the low-precision dtype;
* the loss: ``lm_loss`` upcasts the logits and computes the cross-entropy in fp32;
* gradient accumulation over micro-batches: fp32. After each micro-batch's backward the
  low-precision ``param.grad`` is added into an fp32 buffer and dropped. That is
  ``BF16_Optimizer`` with ``data_types.grad_accum_dtype="fp32"`` (``update_hp_grads`` after each
  backward, or per parameter as soon as its gradient is ready with
  ``bf16.immediate_grad_update``; both give the same numbers because every parameter receives
  one gradient per backward). We deliberately do NOT follow DeepSpeed 0.19's default
  (``grad_accum_dtype`` unset -> the model dtype, i.e. bf16 accumulation, which DeepSpeed itself
  warns "is not safe numerically with large number of accumulation steps" under pipelining);
  a low-precision ``grad_accum_dtype`` is rejected with an error rather than silently changed;
* gradient sync (all-reduce / reduce-scatter across a layer's replicas): fp32 buckets;
* master weights and AdamW states: fp32 (``ShardedOptimizer``), initialised like DeepSpeed's
  from the already-cast low-precision parameters; after each step the masters are cast back into
  the low-precision parameters.

fp16 adds loss scaling with DeepSpeed's own scalers (``deepspeed.runtime.fp16.loss_scaler``):
``LossScaler`` for a static ``loss_scale`` > 0, ``DynamicLossScaler`` for ``loss_scale=0``
(``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``,
``min_loss_scale``). The engine multiplies the fp32 loss by the scale, divides the summed fp32
gradients by it, and decides overflow ONCE for the world (one all-reduce of a non-finite count,
fused with the loss all-reduce), so every rank skips the same step; a skipped step leaves
masters, Adam states and the LR scheduler untouched and counts in ``skipped_steps`` (as
``DeepSpeedEngine._take_model_step``). An overflow at ``min_loss_scale`` raises DeepSpeed's
"Current loss scale already at minimum" on every rank at once (same flag, same scaler state).
bf16 skips non-finite steps the same way unless ``bf16.check_grad_overflow`` is false.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..files.ckpt_format import scaler_state  # noqa: F401  (the engine's name for it)

_FP32_NAMES = {"fp32", "float32", "float", "torch.float32", "torch.float"}


@dataclass(frozen=True)
class Precision:
    """How a MalleusEngine trains: ``dtype`` of parameters/activations, and the fp16 scaler."""

    dtype: torch.dtype = torch.float32
    check_overflow: bool = False          # all-reduce a non-finite flag and skip such steps
    immediate_grad_update: bool = False   # accumulate into fp32 from a post-accumulate-grad hook
    static_loss_scale: float = 1.0        # fp16 with loss_scale > 0
    dynamic_loss_args: dict | None = None # fp16 with loss_scale == 0: DynamicLossScaler kwargs

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def make_loss_scaler(self):
        """DeepSpeed's scaler for fp16 (``CreateLossScaler``'s choice), None otherwise."""
        if self.dtype != torch.float16:
            return None
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        if self.dynamic_loss_args is not None:
            return DynamicLossScaler(dtype=torch.float16, **self.dynamic_loss_args)
        return LossScaler(scale=self.static_loss_scale)

    @staticmethod
    def name_of(user_cfg: Mapping[str, Any]) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``: the mode a ds_config's ``fp16`` / ``bf16``
        (alias ``bfloat16``) sections enable, read by DeepSpeed's own parsers (the one reading:
        the engine's precision and the app's checkpoint record both ask it). ValueError naming
        the section for a malformed one or for both enabled."""
        from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

        try:
            fp16 = get_float16_config(user_cfg)
            bf16 = get_bfloat16_config(user_cfg)
        except Exception as e:  # pydantic ValidationError: keep DeepSpeed's field message
            raise ValueError(f"ds_config fp16/bf16 section: {e}") from None
        if fp16.enabled and bf16.enabled:
            raise ValueError("ds_config: fp16.enabled and bf16.enabled are both true; enable at most "
                             "one mixed-precision mode (DeepSpeed refuses this combination too)")
        return "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"

    @staticmethod
    def from_config(user_cfg: Mapping[str, Any]) -> "Precision":
        """Parse and validate ``fp16`` / ``bf16`` / ``data_types`` with DeepSpeed's own config
        models. Pure (no processes), so every rank raises the same error before any collective."""
        from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

        mode = Precision.name_of(user_cfg)           # raises for a malformed or double section
        fp16, bf16 = get_float16_config(user_cfg), get_bfloat16_config(user_cfg)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[mode]
        name = None if mode == "fp32" else mode
        _check_data_types(user_cfg.get("data_types") or {}, dtype, name)
        if fp16.enabled and fp16.fp16_master_weights_and_grads:
            raise ValueError("ds_config.fp16.fp16_master_weights_and_grads: MalleusEngine keeps fp32 "
                             "master weights; this option is not supported")
        if bf16.enabled and (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
            raise ValueError("ds_config.bf16.bf16_master_weights_and_grads / bf16_optimizer_states: "
                             "MalleusEngine keeps fp32 master weights and Adam states; not supported")
        if fp16.enabled:
            dynamic = fp16.loss_scale == 0
            return Precision(dtype, check_overflow=True,
                             static_loss_scale=float(fp16.loss_scale) if not dynamic else 1.0,
                             dynamic_loss_args=fp16.dynamic_loss_scale_args() if dynamic else None)
        if bf16.enabled:
            return Precision(dtype, check_overflow=bool(bf16.check_grad_overflow),
                             immediate_grad_update=bool(bf16.immediate_grad_update))
        return Precision()


def _check_data_types(dt: Mapping[str, Any], dtype: torch.dtype, name: str | None) -> None:
    unknown = sorted(set(dt) - {"grad_accum_dtype", "param_dtype"})
    if unknown:
        raise ValueError(f"ds_config.data_types: MalleusEngine does not support {unknown} "
                         f"(only grad_accum_dtype=fp32 and a param_dtype matching fp16/bf16)")
    acc = dt.get("grad_accum_dtype")
    if acc is not None and str(acc).lower() not in _FP32_NAMES:
        raise ValueError(f"ds_config.data_types.grad_accum_dtype={acc!r}: MalleusEngine accumulates "
                         f"and reduces gradients in fp32 (BF16_Optimizer's grad_accum_dtype=fp32); "
                         f"drop it or set it to \"fp32\"")
    pd = dt.get("param_dtype")
    if pd is not None:
        from deepspeed.runtime.config import DtypeEnum

        try:
            want = DtypeEnum(pd).value
        except ValueError:
            raise ValueError(f"ds_config.data_types.param_dtype={pd!r} is not a dtype") from None
        if want != dtype:
            raise ValueError(f"ds_config.data_types.param_dtype={pd!r} conflicts with "
                             f"{name or 'fp32'} training (parameters in {dtype}); set the matching "
                             f"fp16/bf16 'enabled' flag or drop param_dtype")


def load_scaler_state(scaler, state: Mapping | None) -> None:
    if scaler is None or not state:
        return
    for k, v in state.items():
        if hasattr(scaler, k):
            setattr(scaler, k, v)
