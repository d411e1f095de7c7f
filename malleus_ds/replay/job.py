"""A job known only as its planning problem, as the adaptive loop sees it in a replay.

The loop (``adaptive/control.py``) is built from a :class:`~malleus_ds.adaptive.job.JobSpec`:
the plan it starts under, and a parameter table for the bytes a switch moves (the real transfer
plan, ``migrate/transfer.py``). A problem file has no parameter names or shapes, only its
memory terms, so :func:`problem_params` makes a table that holds, per layer and per end, the
state those terms stand for:

* ``memory.layer_static_mb`` is one layer's memory per GPU at the nominal TP degree, with every
  byte MalleusEngine keeps per parameter (``adaptive/replan.memory_model``): under bf16 the
  parameter 2, its micro-batch gradient 2, the fp32 gradient bucket 4, the fp32 master 4 and
  Adam's two moments 8, i.e. :data:`BYTES_PER_PARAM` = 20 bytes. So a layer has
  ``layer_static_mb x tp / 20`` MiB-worth of parameters, split over TP along one dimension;
* ``memory.embedding_mb`` likewise for each end of the model (embedding, head), replicated in a
  TP group as our engine keeps them.

The transfer plan then moves what the engine would move (bf16 parameters re-cast from masters,
fp32 masters and moments, ZeRO shards as they fall), and counts nothing of the gradients.
"""
from __future__ import annotations

from dataclasses import replace

from ..adaptive.job import JobSpec
from ..layout import EMBED, HEAD, ParamSpec, ParamTable
from ..plan import Plan
from ..problem import Problem

#: bytes MalleusEngine keeps per parameter under bf16 (replan.memory_model: 2+2+4+4+8)
BYTES_PER_PARAM = 20
_MB = 2 ** 20


def problem_params(problem: Problem) -> ParamTable:
    """One tensor per layer (split over TP) and one per end (replicated), sized from the
    problem's memory terms (module doc). A problem without a memory section has no state to
    size: ``ValueError``."""
    m = problem.memory
    if m is None:
        raise ValueError(f"problem '{problem.name}' has no memory section: a replay of the "
                         f"adaptive loop sizes each switch's migration from memory.layer_static_mb "
                         f"and memory.embedding_mb; add them")
    tp = problem.tp
    per_layer = max(tp, int(m.layer_static_mb * _MB * tp / BYTES_PER_PARAM))
    cols = -(-per_layer // tp)
    specs = []
    end = int(m.embedding_mb * _MB / BYTES_PER_PARAM)
    if end > 0:
        specs.append(ParamSpec("embed", (end,), None, EMBED))
    specs += [ParamSpec(f"layers.{i}", (tp, cols), 0, i) for i in range(problem.num_layers)]
    if end > 0:
        specs.append(ParamSpec("head", (end,), None, HEAD))
    return ParamTable(tuple(specs))


def problem_job(problem: Problem, plan: Plan, zero_stage: int = 1) -> JobSpec:
    """The loop's view of ``problem``'s job, starting under ``plan`` (rank 0, bf16 with fp32
    masters, ZeRO ``zero_stage``)."""
    return JobSpec(rank=0, world=problem.num_gpus, job=problem.job,
                   param_table=problem_params(problem), model_cfg=None, seq_len=0,
                   micro_batch_size=problem.micro_batch_size, mixed=True, param_bytes=2,
                   zero_stage=zero_stage,
                   problem=replace(problem, rates={}, current_plan=None))
