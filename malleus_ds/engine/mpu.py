"""The ``mpu`` object MalleusEngine hands to ``DeepSpeedEngine.__init__`` (Megatron's interface:
``get_data_parallel_group`` & co.). Why its data-parallel group is one rank: engine.py's
docstring. DeepSpeed keeps this object (``engine.mpu`` and the module-level
``deepspeed.utils.groups.mpu``), so after a plan switch it must name the running plan's groups,
not the old plan's, which ``groups.GroupCache.release_unused`` may destroy: ``follow``."""
from __future__ import annotations


class PlanMPU:
    """The ``mpu`` the base engine sees. Its data-parallel group is this rank alone, so the base
    engine never broadcasts or reduces across ranks that hold different layers; model parallel =
    this stage's TP group."""

    def __init__(self, rank: int, self_group, tp_group, tp_rank: int, tp_size: int,
                 stage_id: int, num_stages: int) -> None:
        self.rank, self.self_group = rank, self_group
        self.tp_group = tp_group if tp_size > 1 else self_group
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.stage_id, self.num_stages = stage_id, num_stages

    def follow(self, spec, num_stages: int) -> None:
        """After a plan switch: the new plan's TP group, TP rank and stage (``spec``: the new
        runtime's ``runtime.StageSpec``; a rank outside the plan is stage 0 of 1, TP 1). The
        1-rank data-parallel group never changes."""
        self.tp_size = spec.tp_size
        self.tp_group = spec.tp_group if spec.tp_size > 1 else self.self_group
        self.tp_rank = spec.tp_rank
        self.stage_id = spec.located[1] if spec.located is not None else 0
        self.num_stages = num_stages if spec.located is not None else 1

    def get_data_parallel_group(self):
        return self.self_group

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group_ranks(self):
        return [self.rank]

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_model_parallel_rank(self):
        return self.tp_rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self):
        return self.num_stages

    def get_pipeline_model_parallel_rank(self):
        return self.stage_id
