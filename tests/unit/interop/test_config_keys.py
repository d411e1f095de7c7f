"""What MalleusEngine does with each ds_config key (``interop/config_keys.py``): the table in
docs/coming-from-deepspeed.md is the module's, every key DeepSpeed reads is in it, and each kind
does what the table
says."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from malleus_ds.interop.config_keys import TOP, ZERO, markdown, review

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "coming-from-deepspeed.md"


def test_readme_table_is_the_modules():
    text = GUIDE.read_text()
    a = text.index("<!-- ds_keys table")
    a = text.index("\n", a) + 1
    b = text.index("<!-- end of the ds_keys table -->")
    assert text[a:b].strip() == markdown()


def test_every_key_deepspeed_reads_is_in_the_table():
    """The keys DeepSpeed's config parser reads (its ``get_*`` helpers' constants and the
    sections it builds), taken from the installed DeepSpeed's own constants."""
    from deepspeed.runtime import config as dsc
    from deepspeed.runtime import constants as c

    read = {getattr(c, n) for n in (
        "TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS",
        "OPTIMIZER", "SCHEDULER", "ZERO_ALLOW_UNTESTED_OPTIMIZER", "ZERO_FORCE_DS_CPU_OPTIMIZER",
        "STEPS_PER_PRINT", "PRESCALE_GRADIENTS", "GRADIENT_PREDIVIDE_FACTOR",
        "COMMUNICATION_DATA_TYPE", "DISABLE_ALLGATHER", "CHECKPOINT", "DATA_TYPES",
        "DATALOADER_DROP_LAST", "TORCH_AUTOCAST") if hasattr(c, n)}
    read |= {"fp16", "bf16", "bfloat16", "zero_optimization", "activation_checkpointing",
             "pipeline", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
             "flops_profiler", "autotuning", "gradient_clipping", "wall_clock_breakdown",
             "memory_breakdown", "dump_state", "hybrid_engine", "tensor_parallel", "compile",
             "aio", "data_efficiency", "timers"}
    removed = set(getattr(dsc, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    assert read - set(TOP) - removed == set()
    src = Path(dsc.__file__).read_text()
    # every get_<key>(param_dict) helper DeepSpeed's config calls names a key the table has
    for name in re.findall(r"self\.[a-z_0-9]+ = get_([a-z_0-9]+)\(param_dict", src):
        key = {"zero_config": "zero_optimization", "monitor_config": "tensorboard",
               "aio_config": "aio", "checkpoint_config": "checkpoint",
               "hybrid_engine_config": "hybrid_engine", "pipeline_config": "pipeline",
               "data_efficiency_enabled": "data_efficiency",
               "data_efficiency_config": "data_efficiency",
               "optimizer_name": "optimizer", "optimizer_params": "optimizer",
               "optimizer_legacy_fusion": "optimizer", "scheduler_name": "scheduler",
               "scheduler_params": "scheduler", "torch_autocast_enabled": "torch_autocast",
               "torch_autocast_dtype": "torch_autocast",
               "lower_precision_safe_modules": "torch_autocast",
               "timers_config": "timers", "tensor_parallel_config": "tensor_parallel",
               "expert_parallel_config": "expert_parallel",
               "expert_data_topo_config": "use_data_before_expert_parallelism",
               "checkpoint_params": "checkpoint", "data_types_params": "data_types",
               "float16_config": "fp16", "bfloat16_config": "bf16"}.get(name, name)
        assert key in TOP, f"DeepSpeed reads {name!r} ({key}); the table does not say"


def test_ignored_keys_get_one_line_each():
    notes = review({"steps_per_print": 10, "wall_clock_breakdown": True,
                    "prescale_gradients": True, "communication_data_type": "bf16",
                    "flops_profiler": {"enabled": True}, "my_own_key": 1,
                    "zero_optimization": {"stage": 2, "overlap_comm": True,
                                          "reduce_bucket_size": 5e8, "bogus": 1},
                    "activation_checkpointing": {"partition_activations": True},
                    "gradient_clipping": 1.0, "optimizer": {"type": "AdamW"}})
    assert notes == [
        "ds_config.steps_per_print is ignored: " + TOP["steps_per_print"][1],
        "ds_config.wall_clock_breakdown is ignored: " + TOP["wall_clock_breakdown"][1],
        "ds_config.prescale_gradients is ignored: " + TOP["prescale_gradients"][1],
        "ds_config.communication_data_type is ignored: fp32 reductions".replace(
            "fp32 reductions", TOP["communication_data_type"][1]),
        "ds_config.flops_profiler is ignored: " + TOP["flops_profiler"][1],
        "ds_config.my_own_key is not a DeepSpeed key: DeepSpeed ignores it, and so does "
        "MalleusEngine",
        "ds_config.zero_optimization.bogus is not a DeepSpeed key: DeepSpeed ignores it, and "
        "so does MalleusEngine",
        "ds_config.zero_optimization.{overlap_comm, reduce_bucket_size} ignored: "
        "MalleusEngine's ZeRO-1/2 reduces per layer with its own buckets",
        "ds_config.activation_checkpointing.partition_activations=true is ignored: each "
        "decoder layer's input is kept whole on its rank, not split across the TP group (the "
        "planner's memory model counts that)"]
    # off, empty or the same as DeepSpeed: no line
    assert review({"wall_clock_breakdown": False, "checkpoint": {}, "fp16": {"enabled": False},
                   "torch_autocast": {"enabled": False}, "hybrid_engine": {"enabled": False},
                   "data_efficiency": {"enabled": False}, "gradient_allreduce_op": "mean",
                   "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}},
                   "malleus": {"seed": 1}}) == []


@pytest.mark.parametrize("cfg,pattern", [
    ({"torch_autocast": {"enabled": True}}, r"ds_config.torch_autocast=.* is not supported by "
                                            r"MalleusEngine: use the bf16 or fp16 section"),
    ({"hybrid_engine": {"enabled": True}}, r"hybrid_engine=.*engine=deepspeed"),
    ({"data_efficiency": {"enabled": True}}, r"data_efficiency=.*curriculum learning"),
    ({"weight_quantization": {"post_init_quant": {}}}, r"weight_quantization=.*changes the "
                                                      r"weights"),
    ({"gradient_allreduce_op": "sum"}, r"gradient_allreduce_op='sum': MalleusEngine's gradient "
                                       r"is the global-batch mean"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     r"offload_optimizer.device='nvme': MalleusEngine keeps optimizer states on the device.*"
     r"engine=deepspeed"),
    ({"elasticity": {"enabled": True}}, r"ds_config.elasticity: .*DeepSpeed refuses it too"),
    ({"amp": {"enabled": True}}, r"ds_config.amp: .*Apex AMP.*DeepSpeed refuses it too"),
])
def test_refused_keys_say_what_to_do(cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        review(cfg)


def test_cpu_offload_is_a_note():
    """The configs transformers ships offload the optimizer to CPU: MalleusEngine keeps the
    states on the device and says so."""
    notes = review({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": True}}})
    assert notes == ["ds_config.zero_optimization.offload_optimizer is ignored: "
                     + ZERO["offload_optimizer"][1]]


def test_the_app_notes_and_refuses_before_any_rank_starts():
    from malleus_ds.app.config import ConfigError, build_run_config

    def build(ds, engine="malleus"):
        return build_run_config({"engine": engine, "model": {"name": "tiny"},
                                 "train": {"global_batch_size": 8, "micro_batch_size": 1},
                                 "deepspeed": {"config": ds}}, world_size=2)

    c = build({"zero_optimization": {"stage": 1}, "comms_logger": {"enabled": True}})
    assert c.deepspeed.notes == ("ds_config.comms_logger is ignored: "
                                 + TOP["comms_logger"][1],)
    with pytest.raises(ConfigError, match=r"ds_config.torch_autocast="):
        build({"torch_autocast": {"enabled": True}})
    # stock DeepSpeed reads its own config: no MalleusEngine notes there
    assert build({"comms_logger": {"enabled": True}}, engine="deepspeed").deepspeed.notes == ()


def test_initialize_refuses_before_the_engine(monkeypatch):
    """``malleus_ds.initialize`` reviews the ds_config for MalleusEngine (a model config) before
    it builds anything (no process group is needed to get the error)."""
    import malleus_ds
    from tests.cases import CFG

    with pytest.raises(ValueError, match=r"gradient_allreduce_op='sum'"):
        malleus_ds.initialize(model=CFG, config={"gradient_allreduce_op": "sum"})
