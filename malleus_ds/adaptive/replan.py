"""The running job as a planning problem, and the cost rule that decides a re-plan (pure).

Used by the adaptive loop (``control.py``) on rank 0: :func:`job_problem` turns a running job
(plan, world, node shape, nominal TP, TP slowdown table, memory model) into the planner's
:class:`~malleus_ds.problem.Problem`; :func:`memory_model` estimates the memory terms from the
model's real sizes; :func:`fit_running_plan` makes sure the plan that is running counts as valid;
:func:`decide` compares the running plan with the planner's answer and returns the decision
(``steploop.ReplanDecision``: its ``replan`` line, DESIGN.md §6, and the plan to move to, if
any). No torch.distributed, no process groups.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ..job_layout import JobLayout
from ..plan import Plan, PlanError
from ..problem import Memory, Problem
from ..steploop import ReplanDecision
from .stragglers import Remaining


def nominal_shape(plan: Plan, world: int, tp: int) -> tuple[int, int]:
    """(pp, dp) of the job's uniform layout: the starting plan's when it is uniform, else the
    fewest stages that tile the world (the planner's static baseline)."""
    dp0, pp0 = len(plan.pipelines), len(plan.pipelines[0].stages)
    if tp * pp0 * dp0 == world:
        return pp0, dp0
    for pp in range(1, plan.num_layers + 1):
        if world % (tp * pp) == 0:
            return pp, world // (tp * pp)
    raise PlanError(f"no uniform layout of {world} ranks with tp={tp} and at most "
                    f"{plan.num_layers} stages")


def memory_model(table, cfg, micro_batch_size: int, seq_len: int, mixed: bool,
                 device_mb: float, switch_buffer_mb: float = 0.0) -> Memory:
    """The planner's memory terms from the model's real sizes (DESIGN.md §3). Per layer, what
    MalleusEngine holds per parameter (not divided by ZeRO: conservative): the parameter, its
    gradient of one micro-batch before it is added into the buckets, the fp32 gradient buckets
    (the only accumulator: engine/grad_sync.py), the fp32 master (a separate copy in fp32 too)
    and Adam's two moments: ``2+2+4+4+8`` bytes with bf16/fp16, ``4+4+4+4+8`` in fp32; of those,
    the gradient buffers (4 B in the buckets + the parameter-dtype gradient) are freed before a
    plan switch allocates (``layer_grad_mb``). Activations: Megatron's estimate
    ``s·b·h·(34 + 5·a·s/h)`` bytes at 16 bits (×2 in fp32); with activation checkpointing a
    layer keeps only its input, ``2·s·b·h`` bytes at 16 bits (×2 in fp32: ``layer_input_mb``,
    used when the problem says ``activation_checkpointing``). ``switch_buffer_mb``: the
    migration's staging buffers."""
    pb = 2 if mixed else 4
    per_param = pb + pb + 4 + 4 + 8
    grads = pb + 4
    layer = sum(s.numel for s in table if s.owner == 0)
    ends = [sum(s.numel for s in table if s.owner == o) for o in {s.owner for s in table} if o < 0]
    emb = max(ends, default=0)          # the larger of embedding and head, charged to each end
    h, a = cfg.hidden_size, cfg.num_heads
    act = seq_len * micro_batch_size * h * (34 + 5 * a * seq_len / h) * (1 if mixed else 2)
    kept = seq_len * micro_batch_size * h * pb          # the layer input, in the activation dtype
    mb = 2.0 ** 20
    return Memory(device_mb=device_mb, reserved_mb=0.1 * device_mb,
                  layer_static_mb=layer * per_param / mb, layer_activation_mb=act / mb,
                  embedding_mb=emb * per_param / mb, extra_mb=0.0,
                  layer_grad_mb=layer * grads / mb, switch_buffer_mb=switch_buffer_mb,
                  layer_input_mb=kept / mb)


#: staging buffers of a switch, in units of ``malleus.migrate_bucket_mb``: a round's bytes in
#: flight (sent + received, migrate/rounds.py) and the local copies that overlap the first round
SWITCH_BUFFERS = 2


def job_memory(table, cfg, micro_batch_size: int, seq_len: int, mixed: bool,
               device_mb: float | None, device, ranks_on_host: int,
               migrate_bucket_mb: float) -> Memory:
    """:func:`memory_model` of a job: ``device_mb`` (``malleus.device_mb``, else the device's
    memory as the app measured it) or, when None, on CPU the host's RAM shared by its ranks
    (:func:`host_memory_mb`); and the migration's staging buffers. The one construction the
    adaptive loop (``control.py``) and the start-up check (``app/runners/fit.py``) share."""
    if not device_mb and device is not None and str(device).startswith("cuda"):
        raise ValueError(f"device_mb: the memory of device {device} was not given (the app "
                         f"measures it: app/loop.device_memory_mb)")
    dev = device_mb or host_memory_mb(ranks_on_host)
    return memory_model(table, cfg, micro_batch_size, seq_len, mixed, dev,
                        switch_buffer_mb=SWITCH_BUFFERS * migrate_bucket_mb)


def host_memory_mb(ranks_on_host: int) -> float:
    """Memory one rank may use on CPU: this host's RAM shared by its ranks."""
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / 2 ** 20 / max(1, ranks_on_host)


def fit_running_plan(problem: Problem, plan: Plan) -> Problem:
    """The memory model is an estimate; the running plan demonstrably fits. If the model says it
    does not, raise the device budget to the running plan's peak stage, so plans that need no
    more memory than today's stay allowed."""
    from ..cost import stage_memory_mb

    m = problem.memory
    if m is None:
        return problem
    peak = max(stage_memory_mb(problem, s.num_layers, j, len(p.stages), p.micro_batches, len(s.ranks))
               for p in plan.pipelines for j, s in enumerate(p.stages))
    if peak <= m.budget_mb:
        return problem
    return replace(problem, memory=replace(m, device_mb=peak + m.reserved_mb))


def job_problem(plan: Plan, job: JobLayout, tp_slowdown: Mapping[int, float],
                memory: Memory | None, head_layers: float = 0.0,
                activation_checkpointing: bool = False) -> Problem:
    """The planning problem of a running job of shape ``job`` (rates are filled in per re-plan);
    ``head_layers``: the output head's compute in layer units (``models.base.head_layer_units``);
    ``activation_checkpointing``: the job recomputes its layers (memory and compute terms of
    ``cost.py``)."""
    pp, dp = nominal_shape(plan, job.world, job.tp)
    return Problem(name="running-job", nodes=job.nodes, gpus_per_node=job.gpus_per_node,
                   num_layers=plan.num_layers, global_batch_size=plan.global_batch_size,
                   micro_batch_size=plan.micro_batch_size, tp=job.tp, pp=pp, dp=dp,
                   tp_slowdown=dict(tp_slowdown), memory=memory, rates={},
                   extra={"head_layers": head_layers} if head_layers else {},
                   activation_checkpointing=activation_checkpointing)


def fit_switch_seconds(switches) -> tuple[float, float] | None:
    """``(fixed seconds, seconds per byte)`` of ``seconds = fixed + bytes x per_byte``, least
    squares over ``switches`` (``(bytes, seconds)`` pairs), the fixed part at least 0; None
    until two different byte counts were measured, or when more bytes did not take longer.
    The adaptive loop predicts its next switch with it (``control.py``); a replay fits a
    recorded run's switches (``replay/from_run.py``)."""
    import numpy as np

    pts = [(float(b), float(t)) for b, t in switches]
    if len({b for b, _ in pts}) < 2:
        return None
    b = np.array([x[0] for x in pts])
    t = np.array([x[1] for x in pts])
    slope = float(np.mean((b - b.mean()) * (t - t.mean())) / np.var(b))
    if not slope > 0:
        return None
    return max(0.0, float(t.mean() - slope * b.mean())), slope


def horizon(horizon_steps: int, step_s: float | None,
            remaining: Remaining | None = None) -> tuple[float, str]:
    """The steps a switch's gain is counted over, and how the reason words them: the fixed
    ``horizon_steps``, capped by the slowdown's expected remaining duration where one is known
    (``remaining``: a ``stragglers.Remaining``; ``step_s``: the running plan's step seconds) --
    a layout made for a straggler gains only until it ends, and the loop re-plans then."""
    if remaining is None or not step_s:
        return float(horizon_steps), f"{horizon_steps} steps"
    left = remaining.seconds / step_s
    if left >= horizon_steps:
        return float(horizon_steps), f"{horizon_steps} steps ({remaining.text})"
    return left, f"{left:.1f} steps: {remaining.text}"


def decide(problem: Problem, current: Plan, new: Plan, trigger: str, rates: list[float],
           step: int, planning_s: float, step_s: float | None, nbytes: int, migrate_s: float,
           horizon_steps: int, remaining: Remaining | None = None) -> ReplanDecision:
    """The cost rule (pure): adopt ``new`` iff it differs and its predicted gain over the
    horizon (:func:`horizon`: ``horizon_steps``, capped by the straggler's expected
    ``remaining`` duration where given) exceeds the predicted migration seconds (forced:
    always). Step times are the cost model's (``problem`` carries the measured rates), in
    seconds calibrated so that the running plan's prediction equals its measured ``step_s``.
    ``carried`` (rates a checkpoint carried across a restart, before any step is timed):
    adopted when the planner found a plan, which it does only ``min_improvement`` better than
    the running one."""
    from ..cost import step_time

    old_T, new_T = step_time(problem, current), step_time(problem, new)
    scale = step_s / old_T if step_s and old_T > 0 else None
    pred = [round(old_T * scale, 4), round(new_T * scale, 4)] if scale else \
        [round(old_T, 4), round(new_T, 4)]
    steps, over = horizon(horizon_steps, step_s, remaining)
    gain_s = (pred[0] - pred[1]) * steps if scale else None
    if new.id == current.id:
        adopt, why = False, "the running plan is still the best"
    elif trigger == "forced":
        adopt, why = True, "forced"
    elif trigger == "carried":      # the planner found it min_improvement better for them
        adopt, why = True, "rates carried from before the restart; no step timed yet"
    elif gain_s is None:
        adopt, why = False, "no measured step time yet"
    else:
        adopt = gain_s > migrate_s
        why = (f"gain {gain_s:.2f} s over {over} {'>' if adopt else '<='} migration "
               f"{migrate_s:.2f} s")
    return ReplanDecision(
        step=step, trigger=trigger, adopted=adopt, reason=why,
        plan=new.to_json() if adopt else None,
        trigger_rates=tuple(round(float(r), 3) for r in rates), from_plan=current.id,
        to_plan=new.id if adopt else current.id, planned=new.id,
        planning_s=round(planning_s, 4), predicted_step_s=tuple(pred),
        predicted_migration_s=round(migrate_s, 4), bytes=int(nbytes))
