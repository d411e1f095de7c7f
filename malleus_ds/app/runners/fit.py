"""Does this job hold the model? engine=malleus's start-up memory check.

A job that restarts after losing a node has fewer ranks than the layout it was planned for, and
a layout of fewer ranks holds more of the model on each. Before the engine allocates anything,
every rank asks the planner's memory model (``replan.memory_model``: the model's real sizes, the
micro-batch's activations, or only each layer's input under activation checkpointing, the
migration's staging buffers) whether the starting plan fits the
memory of one device (``malleus.device_mb``, else detected: ``app/loop.device_memory_mb``):

- it fits: the run starts under it, unchanged;
- it does not, but another layout of these ranks does: rank 0 plans one (the planner, every rate
  1.0; the adaptive loop re-plans for measured rates later) and every rank starts under it, so a
  shrunken job keeps training with the same math;
- no layout fits: a :class:`ConfigError` on every rank naming the numbers (the planner's own
  "no layout can fit: ... MB per GPU > budget ... MB"), which ends the job without a restart
  loop (``launch/train.py``: a config error is the same on every attempt).

The check needs the process group only to hand rank 0's plan to the others (one broadcast,
reached by every rank in the same order); everything else is pure and the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import Plan, PlanError
from ..run_config import ConfigError, RunConfig
from .base import DistEnv


@dataclass(frozen=True)
class Fit:
    """The outcome: the plan to start under, and what rank 0 says when it is not the user's."""

    plan: Plan
    note: str | None = None          # why the starting plan was replaced (None: it was not)


def start_problem(cfg: RunConfig, plan: Plan, ds_config: dict, device: str | None):
    """The planning problem of this job at start-up (rates all 1.0), with its memory model."""
    from ...engine.precision import Precision
    from ...models.base import head_layer_units, param_table
    from ...adaptive.replan import job_memory, job_problem
    from ..loop import device_memory_mb
    from ...problem import given_slowdown, ideal_slowdown
    from .job import job_layout

    try:
        mixed = Precision.name_of(ds_config) != "fp32"
    except ValueError as e:
        raise ConfigError(str(e)) from None
    loop, recompute = cfg.malleus.loop, cfg.train.activation_checkpointing
    job = job_layout(cfg, plan)
    table = param_table(cfg.model)
    seq_len = cfg.data.resolved_seq_len(cfg.model)
    device_mb = loop.device_mb or device_memory_mb(device, job.gpus_per_node)
    mem = job_memory(table, cfg.model, plan.micro_batch_size, seq_len, mixed,
                     device_mb, device, job.gpus_per_node, cfg.malleus.migrate_bucket_mb)
    head = head_layer_units(table, seq_len, cfg.model.hidden_size)
    slowdown = given_slowdown(loop.tp_slowdown, job.tp) or ideal_slowdown(job.tp)
    pr = job_problem(plan, job, slowdown, mem, head, activation_checkpointing=recompute)
    return pr.with_rates({r: 1.0 for r in range(job.world)}), loop.planner_time_limit_s


def check_fits(cfg: RunConfig, plan: Plan, ds_config: dict, env: DistEnv) -> Fit:
    """:class:`Fit` for ``plan`` on this job (module docstring); ConfigError on every rank when
    no layout of these ranks holds the model."""
    from ...cost import check_memory

    try:
        problem, limit = start_problem(cfg, plan, ds_config, env.device)
    except PlanError as e:
        raise ConfigError(f"the job's layout cannot be planned for: {e}") from None
    try:
        check_memory(problem, plan)
        return Fit(plan)
    except PlanError as e:
        why = str(e)
    answer: list = [None]
    if env.is_rank0:
        answer[0] = _replan(problem, limit, why, env.world_size)
    if env.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(answer, src=0)
    kind, text = answer[0]
    if kind == "error":
        raise ConfigError(text)
    new = Plan.from_json(text)
    return Fit(new, f"the starting layout does not fit in memory ({why}); starting under "
                    f"plan {new.id} instead, which does: {new.describe()}")


def _replan(problem, limit: float | None, why: str, world: int) -> tuple[str, str]:
    """Rank 0: ("plan", its JSON) of a layout that fits, or ("error", the message)."""
    from ...planner import plan as plan_layout

    try:
        res = plan_layout(problem, seed=0, time_limit=limit)
    except PlanError as e:
        return ("error", f"the {world} ranks of this job cannot hold the model: {e}. A job that "
                         f"lost a node needs it back (or more devices) to continue; if the "
                         f"memory model is too cautious for your devices, raise "
                         f"malleus.device_mb (MB per device)")
    return ("plan", res.plan.to_json())
