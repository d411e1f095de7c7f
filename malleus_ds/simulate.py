"""Per-rank timeline of one training step of a plan (1F1B), its summary and a Gantt PNG.

Each stage runs the engine's own instruction stream (``schedule.one_f_one_b``: ``min(S-j-1, m)``
warm-up forwards, then one-forward-one-backward, then the remaining backwards) in the one event
simulator, ``schedule.run_streams``. A forward of micro-batch ``k`` on stage ``j`` waits for the
forward of ``k`` on ``j-1``; a backward waits for the backward on ``j+1`` (plus the
point-to-point time ``cost.boundary_times`` when the problem has a ``comm`` section: here it
delays the message, where the cost model charges it to the sending stage's time). A stage's
time per micro-batch ``t = y*l`` (the head added on the last stage: ``cost.stage_time``) splits
into forward ``t/3`` and backward ``2t/3``; with activation checkpointing the forward stays what it
was without and the backward takes the rest (it runs each layer's forward again first: 3/4 of a
layer's ``4/3``); a stage's TP collectives beyond a healthy group's (``cost.tp_times``) add to
its forward and backward. Pipelines run independently; the step ends when the last one does,
plus the data-parallel reduction that follows (``cost.reduce_time``: with ``comm.grad_mb``, each layer's
ring over the links its stages' nodes span).

The reference cost model (``sum t + (m-1) max t``) is the planner's objective; the simulated
step time is an event-level check of it: without a ``comm`` section equal when ``m = 1`` or each
pipeline's last stage is one of its slowest (uniform stages included), below it otherwise
(``cost.pipeline_time_from_stage_times``); with one, at most it (messages are delayed here,
not charged to the sender).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .cost import (boundary_times, capacity_fraction, eta, evaluate, healthy_step_time,
                   reduce_time, stage_time, tp_times)
from .plan import Plan
from .problem import Problem
from .schedule import Backward, Forward, Instr, SendAct, one_f_one_b, run_streams

FWD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class Op:
    """One compute op on one stage: ``"2F0"`` = stage 2, forward, micro-batch 0."""

    pipeline: int
    stage: int
    kind: str          # "F" or "B"
    micro_batch: int
    start: float
    end: float

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class Timeline:
    ops: tuple[Op, ...]
    pipeline_times: tuple[float, ...]
    step_time: float
    busy: tuple[tuple[float, ...], ...]      # per pipeline, per stage: compute time
    ranks: tuple[tuple[tuple[int, ...], ...], ...]

    def rank_ops(self, rank: int) -> tuple[Op, ...]:
        """The per-rank timeline: ops of the stage holding ``rank`` (all its TP group runs them
        together); empty for a suspended rank."""
        for i, rs in enumerate(self.ranks):
            for j, r in enumerate(rs):
                if rank in r:
                    return tuple(o for o in self.ops if o.pipeline == i and o.stage == j)
        return ()


def build_timeline(problem: Problem, plan: Plan) -> Timeline:
    """Run every pipeline's 1F1B streams (``schedule.one_f_one_b``, what the engine runs) through
    the event simulator ``schedule.run_streams``: a forward lasts ``t/3``, a backward ``2t/3``
    (with activation checkpointing: the forward of the same stage without it, the backward the
    rest), sends and receives take no stage time, and a message arrives the boundary's point-to-point
    time after it is sent."""
    ops: list[Op] = []
    ptimes, busy, ranks = [], [], []
    plain = replace(problem, activation_checkpointing=False)    # the forward is not recomputed
    for i, p in enumerate(plan.pipelines):
        S, m = len(p.stages), p.micro_batches
        tp = [tp_times(problem, s) for s in p.stages]     # TP collectives beyond healthy
        t = [stage_time(problem, s, last=j == S - 1) + sum(tp[j]) for j, s in enumerate(p.stages)]
        fwd = [stage_time(plain, s, last=j == S - 1) * FWD_SHARE + tp[j][0]
               for j, s in enumerate(p.stages)]
        link = boundary_times(problem, p.stages)

        def duration(ins: Instr, t=t, fwd=fwd) -> float:
            if isinstance(ins, Forward):
                return fwd[ins.stage]
            if isinstance(ins, Backward):
                return t[ins.stage] - fwd[ins.stage]
            return 0.0

        def latency(ins: Instr, link=link) -> float:      # sends only: j -> j+1 or j -> j-1
            return link[ins.stage] if isinstance(ins, SendAct) else link[ins.stage - 1]

        events = run_streams([one_f_one_b(j, S, m) for j in range(S)], duration, latency)
        ops.extend(Op(i, e.instr.stage, e.instr.code, e.instr.micro_batch, e.start, e.end)
                   for e in events if isinstance(e.instr, (Forward, Backward)))
        ptimes.append(max(e.end for e in events))
        busy.append(tuple(tj * m for tj in t))
        ranks.append(tuple(s.ranks for s in p.stages))
    return Timeline(tuple(ops), tuple(ptimes), max(ptimes) + reduce_time(problem, plan),
                    tuple(busy), tuple(ranks))


@dataclass(frozen=True)
class Summary:
    model_step_time: float
    simulated_step_time: float
    efficiency: float
    bubble_share: float
    pipeline_times: tuple[float, ...]
    micro_batches: tuple[int, ...]
    suspended: int

    def text(self) -> str:
        lines = [f"step time (cost model): {self.model_step_time:.2f}   "
                 f"simulated 1F1B: {self.simulated_step_time:.2f}",
                 f"eta: {self.efficiency:.3f}   bubble share: {self.bubble_share:.1%}   "
                 f"suspended ranks: {self.suspended}"]
        for i, (pt, m) in enumerate(zip(self.pipeline_times, self.micro_batches)):
            lines.append(f"  pipeline {i}: {pt:.2f} ({m} micro-batches)")
        return "\n".join(lines)


def summarize(problem: Problem, plan: Plan, timeline: Timeline | None = None) -> Summary:
    tl = timeline or build_timeline(problem, plan)
    cost = evaluate(problem, plan)
    n_active = sum(len(s) for r in tl.ranks for s in r)
    busy = sum(b * len(s) for bs, rs in zip(tl.busy, tl.ranks) for b, s in zip(bs, rs))
    bubble = 1.0 - busy / (n_active * tl.step_time) if n_active else 0.0
    e = eta(healthy_step_time(problem), cost.step_time, capacity_fraction(problem))
    return Summary(cost.step_time, tl.step_time, e, bubble, cost.pipeline_times,
                   tuple(p.micro_batches for p in plan.pipelines), len(plan.suspended))


def gantt(problem: Problem, plan: Plan, path: str, timeline: Timeline | None = None,
          max_rows: int = 64) -> None:
    """Write a PNG Gantt chart: one row per stage (TP group), forward light, backward dark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = timeline or build_timeline(problem, plan)
    rows: dict[tuple[int, int], int] = {}
    labels = []
    for i, rs in enumerate(tl.ranks):
        for j, r in enumerate(rs):
            if len(rows) < max_rows:
                rows[(i, j)] = len(rows)
                labels.append(f"p{i}s{j} r{r[0]}" + (f"-{r[-1]}" if len(r) > 1 else ""))
    fig, ax = plt.subplots(figsize=(12, 0.3 * len(rows) + 1.5))
    colors = plt.get_cmap("tab20").colors
    for op in tl.ops:
        row = rows.get((op.pipeline, op.stage))
        if row is None:
            continue
        c = colors[(2 * op.micro_batch + (op.kind == "B")) % len(colors)]
        ax.barh(row, op.end - op.start, left=op.start, color=c,
                edgecolor="black" if op.kind == "B" else "none", linewidth=0.3)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (layer x micro-batch units)")
    s = summarize(problem, plan, tl)
    ax.set_title(f"{problem.name}: step {s.model_step_time:.1f} (sim {s.simulated_step_time:.1f}), "
                 f"eta {s.efficiency:.3f}, bubble {s.bubble_share:.0%}"
                 + (f" (first {max_rows} stages)" if len(rows) == max_rows else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
