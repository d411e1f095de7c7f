"""Which gradients the ``gradient_clipping`` norm counts.

MalleusEngine clips by the norm of the whole model's summed gradient, each element counted once
(the head copy of a tied pair left out: ``tied.py``), which is what stock DeepSpeed computes
without a pipeline, with ZeRO-1/2, and with fp16/bf16. One case differs, and there we match stock
DeepSpeed rather than the one-process math:

**fp32, ZeRO stage 0, a pipeline of two or more stages.** DeepSpeed's ``PipelineEngine`` then
clips in ``DeepSpeedEngine.clip_fp32_gradients`` -> ``deepspeed.runtime.utils.clip_grad_norm_``
with ``mpu`` = its ``PipelineParallelGrid``. That function counts a parameter's gradient only
``if mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)`` and then sums over
``mpu.get_model_parallel_group()``: Megatron's rule for *tensor* parallelism (a replicated weight
is counted on TP rank 0 only). But the grid's "model parallel" group is the whole pipeline (all
its stages), and its rank 0 is the first stage, so only the first stage's gradients (the
embedding and the decoder layers it holds) make the norm; the later stages' add nothing, and
every stage's gradients are then scaled by ``max_norm / (that norm + 1e-6)``. (ZeRO-1 and the
fp16/bf16 optimizers use the *tensor* parallel rank, ``bwc_tensor_model_parallel_rank``, and get
the whole norm.)

The parameters counted are those the first stage of the engine's *starting* plan holds, when
every pipeline of it has two or more stages and all their first stages hold the same layers (the
layouts stock DeepSpeed runs); otherwise (a one-stage pipeline in the plan, or pipelines whose
first stages differ: layouts stock DeepSpeed has no answer for) the whole norm. The set is fixed
for the engine's life: a plan switch keeps it, so re-planning never changes the math. A restart
that resumes under a different starting plan recomputes it.
"""
from __future__ import annotations

from ..layout import EMBED, ParamTable
from ..plan import Plan


def first_stage_layers(plan: Plan) -> tuple[int, int] | None:
    """The layer range every pipeline's first stage holds, if the plan is a layout whose fp32
    ZeRO-0 clipping stock DeepSpeed restricts to it (module doc), else None."""
    firsts = {p.stages[0].layers for p in plan.pipelines}
    if not plan.pipelines or len(firsts) != 1 or any(len(p.stages) < 2 for p in plan.pipelines):
        return None
    return next(iter(firsts))


def norm_skip(plan: Plan, table: ParamTable, zero_stage: int, mixed: bool) -> frozenset[str]:
    """The parameters the clipping norm leaves out for this engine (module doc): those outside
    the starting plan's first stage under fp32 ZeRO-0 with a pipeline, else none."""
    if zero_stage != 0 or mixed:
        return frozenset()
    first = first_stage_layers(plan)
    if first is None:
        return frozenset()
    start, end = first
    return frozenset(s.name for s in table
                     if not (s.owner == EMBED or start <= s.owner < end))
