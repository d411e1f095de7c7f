"""What MalleusEngine does with each key of a DeepSpeed ds_config: the same as DeepSpeed, its
own way (a one-line note says how), or a refusal that says what to do instead.

One table (:data:`TOP`, :data:`ZERO`) covers every top-level key DeepSpeed 0.19 reads
(``deepspeed/runtime/config.py``, ``DeepSpeedConfig._initialize_params``) and the
``zero_optimization`` keys. :func:`review` reads a ds_config against it; it is pure, so every
rank gets the same notes and the same error before any process group exists. The app calls it
when it builds a run config (``app/config.py``) and ``malleus_ds.initialize`` before it builds
the engine; the table in docs/coming-from-deepspeed.md is :func:`markdown` (a test holds the two equal).

Kinds:

* ``same``: MalleusEngine does what stock DeepSpeed does (the text names where).
* ``own``: it tunes or reports something MalleusEngine does its own way; ignored, with a note
  naming what happens instead.
* ``if on``: refused when the section turns its feature on (``enabled: true``, or any value
  for a key that has no ``enabled``), and nothing otherwise: a config error naming the key, its
  value and what to do instead.
* ``removed``: DeepSpeed itself refuses it (a feature it removed); refused with its reason.

Keys DeepSpeed does not know are ignored by DeepSpeed; MalleusEngine ignores them too, and says
so in one line. The sections with their own parsers keep their own checks: ``optimizer``
(``sections.optimizer_settings``), ``fp16`` / ``bf16`` / ``data_types`` (``precision.py``),
``activation_checkpointing`` and ``pipeline.activation_checkpoint_interval``
(``sections.activation_checkpointing_source``), ``tensor_parallel``
(``sections.check_unsupported``), ``zero_optimization.stage`` (``sections.check_zero_stage``).
"""
from __future__ import annotations

from typing import Any, Mapping

SAME, OWN, IF_ON, REMOVED = "same", "own", "if on", "removed"

_MEAN = ("MalleusEngine scales each micro-batch's loss by its share of the global batch and "
         "sums gradients in fp32, so the step's gradient is the global-batch mean under any "
         "layout; there is nothing to pre-divide")

#: every top-level key of DeepSpeed 0.19's ds_config: (kind, what MalleusEngine does)
TOP: dict[str, tuple[str, str]] = {
    # -- the batch
    "train_batch_size": (SAME, "the global batch: train.global_batch_size where given, else "
                               "this (DeepSpeed's derivation; interop/batch.py); a plan may "
                               "then give its pipelines unequal micro-batch counts"),
    "train_micro_batch_size_per_gpu": (SAME, "the micro-batch size (as train_batch_size)"),
    "gradient_accumulation_steps": (SAME, "derives the batch as DeepSpeed does; the plan sets "
                                          "each pipeline's micro-batch count"),
    "managed_gradient_accumulation": (OWN, "train_batch runs every micro-batch of the step "
                                           "and its accumulation itself"),
    # -- the optimizer
    "optimizer": (SAME, "Adam/AdamW (torch's, ZeRO-sharded across each layer's replicas); "
                        "other types are refused"),
    "scheduler": (SAME, "DeepSpeed's own scheduler classes, stepped once per optimizer step"),
    "zero_allow_untested_optimizer": (OWN, "MalleusEngine's ZeRO shards torch's Adam/AdamW "
                                           "itself"),
    "zero_force_ds_cpu_optimizer": (OWN, "MalleusEngine runs torch's Adam/AdamW"),
    # -- precision
    "fp16": (SAME, "fp16 compute, fp32 masters, DeepSpeed's loss scaler (precision.py)"),
    "bf16": (SAME, "bf16 compute, fp32 masters and fp32 gradients (precision.py)"),
    "bfloat16": (SAME, "the old name of bf16"),
    "data_types": (SAME, "grad_accum_dtype fp32 and param_dtype (precision.py); others are "
                         "refused"),
    "torch_autocast": (IF_ON, "use the bf16 or fp16 section: MalleusEngine casts each stage "
                              "and keeps fp32 masters; it does not autocast"),
    # -- gradients
    "gradient_clipping": (SAME, "clips the global gradient norm, as DeepSpeed; in fp32 with "
                                "ZeRO stage 0 and a pipeline, the norm of the first stage's "
                                "gradients, as DeepSpeed's PipelineEngine (engine/clip_norm.py)"),
    "prescale_gradients": (OWN, _MEAN),
    "gradient_predivide_factor": (OWN, _MEAN),
    "gradient_allreduce_op": (SAME, "\"mean\" is what MalleusEngine computes; \"sum\" is "
                                    "refused: the sum would scale with the replica count, "
                                    "which changes with every plan"),
    "communication_data_type": (OWN, "gradients are reduced in fp32 (exact, but twice the "
                                     "bytes of a bf16 reduction)"),
    "seq_parallel_communication_data_type": (OWN, "MalleusEngine runs no sequence "
                                                  "parallelism"),
    "disable_allgather": (OWN, "ZeRO shards are gathered by MalleusEngine's own collective"),
    # -- memory and layout
    "zero_optimization": (SAME, "stage 0, 1 and 2 across each layer's replicas; stage 3 is "
                                "refused here (pipelines and TP), and trains as DeepSpeed's "
                                "own ZeRO-3 when `malleus_ds.initialize` gets a plain "
                                "`torch.nn.Module` (MalleusDPEngine); the other keys below"),
    "activation_checkpointing": (SAME, "recomputes each decoder layer from its input "
                                       "(settings.activation_checkpointing_source)"),
    "pipeline": (OWN, "the plan sets the stages, their layers and the micro-batches "
                      "(activation_checkpoint_interval=1 turns on recompute)"),
    "tensor_parallel": (OWN, "the plan sets each stage's TP group (autotp_size > 1 is "
                             "refused)"),
    "expert_parallel": (OWN, "MalleusEngine's models have no expert (MoE) layers"),
    "use_data_before_expert_parallelism": (OWN, "MalleusEngine's models have no expert (MoE) "
                                                "layers"),
    "hybrid_engine": (IF_ON, "DeepSpeed's hybrid (RLHF generation) engine runs with "
                             "engine=deepspeed"),
    "weight_quantization": (IF_ON, "it changes the weights' storage and math; train without it "
                                   "(or with engine=deepspeed)"),
    "compile": (OWN, "MalleusEngine runs its stage modules eagerly"),
    # -- what is reported
    "tensorboard": (SAME, "DeepSpeed's monitor (the app writes it in the run folder)"),
    "wandb": (SAME, "DeepSpeed's monitor"),
    "csv_monitor": (SAME, "DeepSpeed's monitor (the app writes it in the run folder)"),
    "comet": (SAME, "DeepSpeed's monitor"),
    "log_level": (SAME, "DeepSpeed's logger"),
    "steps_per_print": (OWN, "the app prints every log_every steps; metrics.jsonl holds every "
                             "step"),
    "wall_clock_breakdown": (OWN, "metrics.jsonl's step lines hold each rank's compute and "
                                  "wait seconds"),
    "memory_breakdown": (OWN, "the planner's memory model checks each plan's memory "
                              "(malleus.device_mb)"),
    "dump_state": (OWN, "the run folder's config and metrics.jsonl record the run"),
    "timers": (OWN, "metrics.jsonl's step lines time every step"),
    "comms_logger": (OWN, "metrics.jsonl's step lines hold each rank's compute and wait "
                          "seconds; collectives are not logged one by one"),
    "flops_profiler": (OWN, "the profiler is not run; the planner's cost model counts each "
                            "layer's work"),
    "autotuning": (OWN, "the autotuner belongs to DeepSpeed's launcher; the planner chooses "
                        "the layout"),
    # -- checkpoints and data
    "checkpoint": (OWN, "MalleusEngine writes per-rank slices by global parameter name and "
                        "loads them under any plan (load_universal is not needed); tag "
                        "validation and node-local storage are not used"),
    "datastates_ckpt": (OWN, "checkpoints are written by MalleusEngine's background writer"),
    "aio": (OWN, "used only by NVMe offload, which MalleusEngine does not run"),
    "data_efficiency": (IF_ON, "curriculum learning and random-LTD change what each step "
                               "trains on; MalleusEngine's data is the deterministic "
                               "sampler's"),
    "dataloader_drop_last": (OWN, "the data comes from train_batch's data_iter or the app's "
                                  "sampler"),
    "disable_python_gc": (OWN, "MalleusEngine leaves Python's garbage collector as it is"),
}

#: the ``zero_optimization`` keys: (kind, what MalleusEngine does)
_ZERO_OWN = "MalleusEngine's ZeRO-1/2 reduces per layer with its own buckets"
ZERO: dict[str, tuple[str, str]] = {
    "stage": (SAME, "0, 1 or 2; 3 is refused (a plain torch.nn.Module through "
                    "malleus_ds.initialize trains under DeepSpeed's own ZeRO-3)"),
    "offload_optimizer": (OWN, "device cpu: optimizer states stay on the device, sharded "
                               "across each layer's replicas (the planner's memory check, "
                               "malleus.device_mb, says whether a plan fits); device nvme is "
                               "refused"),
    "offload_param": (OWN, "parameters stay on the device (offload_param acts only under "
                           "ZeRO-3)"),
    "cpu_offload": (OWN, "the old name of offload_optimizer.device=cpu (as offload_optimizer)"),
    **{k: (OWN, _ZERO_OWN) for k in (
        "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
        "reduce_bucket_size", "contiguous_gradients", "round_robin_gradients",
        "use_multi_rank_bucket_allreduce", "load_from_fp32_weights", "elastic_checkpoint",
        "ignore_unused_parameters", "legacy_stage1", "sub_group_size", "zero_hpz_partition_size",
        "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "log_trace_cache_warnings", "memory_efficient_linear",
        "pipeline_loading_checkpoint", "override_module_apply", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "stage3_use_all_reduce_for_fetch_params", "stage3_module_granularity_threshold",
        "module_granularity_threshold", "gather_16bit_weights_on_model_save",
        "cpu_offload_param", "cpu_offload_use_pin_memory", "prefetch_bucket_size",
        "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "leaf_module", "mics_shard_size", "mics_hierarchical_params_gather",
        "zeropp_loco_param", "offload_optimizer_device", "offload_param_device")},
}

#: DeepSpeed 0.19.8's removed features (``_REMOVED_TOP_LEVEL_CONFIG_KEYS``): it refuses them
_REMOVED = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
            "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
            "curriculum_learning", "progressive_layer_drop")


def _removed() -> dict[str, str]:
    """DeepSpeed's own messages for the features it removed (this install's, where it has
    them), else ours."""
    try:
        from deepspeed.runtime import config as dsc
        got = dict(getattr(dsc, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    except Exception:                                   # noqa: BLE001 -- any import trouble
        got = {}
    return got or {k: "DeepSpeed 0.19 removed this feature" for k in _REMOVED}


def _on(k: str, v: Any) -> bool:
    """Does section ``k`` turn its feature on? A mapping: its ``enabled`` (DeepSpeed's default
    is off; ``weight_quantization`` has no ``enabled``: any non-empty section is on); a bool:
    itself; None: no."""
    if v is None or v is False:
        return False
    if isinstance(v, Mapping):
        return bool(v) if k == "weight_quantization" else bool(v.get("enabled", False))
    return True


def review(cfg: Mapping[str, Any], where: str = "ds_config") -> list[str]:
    """One note per key MalleusEngine ignores (its own way, or not a DeepSpeed key); ValueError
    naming the key and its value for a key it refuses (module doc)."""
    notes: list[str] = []
    removed = _removed()
    for k, v in cfg.items():
        if k == "malleus":
            continue
        if k in removed:
            raise ValueError(f"{where}.{k}: {removed[k]} (DeepSpeed refuses it too); drop it")
        if k not in TOP:
            notes.append(_unknown(f"{where}.{k}"))
            continue
        kind, text = TOP[k]
        if kind == IF_ON and _on(k, v):
            raise ValueError(f"{where}.{k}={v!r} is not supported by MalleusEngine: {text}")
        if kind == OWN and v not in (None, False, {}):
            notes.append(f"{where}.{k} is ignored: {text}")
    op = cfg.get("gradient_allreduce_op")
    if op is not None and op != "mean":
        raise ValueError(f"{where}.gradient_allreduce_op={op!r}: MalleusEngine's gradient is the "
                         f"global-batch mean under any layout (a sum would scale with the "
                         f"replica count, which changes with every plan); use \"mean\" or drop it")
    zo = cfg.get("zero_optimization")
    if isinstance(zo, Mapping):
        notes += _review_zero(zo, f"{where}.zero_optimization")
    ac = cfg.get("activation_checkpointing")
    if isinstance(ac, Mapping):
        from .sections import ACT_IGNORED

        notes += [f"{where}.activation_checkpointing.{k}=true is ignored: {why}"
                  for k, why in ACT_IGNORED.items() if ac.get(k) is True]
    return notes


def _unknown(key: str) -> str:
    return f"{key} is not a DeepSpeed key: DeepSpeed ignores it, and so does MalleusEngine"


def _offload_device(v: Any) -> str | None:
    if isinstance(v, Mapping):
        return str(v.get("device", "none")).lower()
    return "cpu" if v is True else None


def _review_zero(zo: Mapping[str, Any], where: str) -> list[str]:
    notes: list[str] = []
    for k in ("offload_optimizer", "offload_param"):
        dev = _offload_device(zo.get(k))
        if dev == "nvme":
            raise ValueError(f"{where}.{k}.device='nvme': MalleusEngine keeps {k[8:]} states on "
                             f"the device (sharded across each layer's replicas by ZeRO-1/2); "
                             f"drop the offload, or run engine=deepspeed for NVMe offload")
    ignored = []
    for k, v in zo.items():
        if k == "stage":
            continue
        if k not in ZERO:
            notes.append(_unknown(f"{where}.{k}"))
            continue
        if k in ("offload_optimizer", "offload_param", "cpu_offload"):
            if _offload_device(v) in (None, "none"):
                continue
            notes.append(f"{where}.{k} is ignored: {ZERO[k][1]}")
            continue
        ignored.append(k)
    if ignored:
        notes.append(f"{where}.{{{', '.join(ignored)}}} ignored: {_ZERO_OWN}")
    return notes


def markdown() -> str:
    """The table of docs/coming-from-deepspeed.md: every top-level key and what MalleusEngine does with it."""
    rows = ["| key | under engine=malleus | what happens |", "|---|---|---|"]
    label = {SAME: "as DeepSpeed", OWN: "ignored, with a note", IF_ON: "refused when on",
             REMOVED: "refused (DeepSpeed too)"}
    for k, (kind, text) in TOP.items():
        rows.append(f"| `{k}` | {label[kind]} | {text} |")
    for k in _REMOVED:
        rows.append(f"| `{k}` | {label[REMOVED]} | a feature DeepSpeed 0.19 removed |")
    rows.append("| `zero_optimization.offload_optimizer` | device cpu: ignored, with a note; "
                "nvme: refused | " + ZERO["offload_optimizer"][1] + " |")
    rows.append(f"| other `zero_optimization` keys | ignored, with a note | {_ZERO_OWN} |")
    rows.append("| a key DeepSpeed does not know | ignored, with a note | as DeepSpeed |")
    return "\n".join(rows)
