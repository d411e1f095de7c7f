"""What a campaign run must show after its faults: the invariants, each checked on the run's
files and processes, each failure one line saying what and where.

1. the job finished every step (exit 0, after the rerun a SIGTERM asks for);
2. every step's loss equals the fault-free one-process run's, re-done steps included;
3. ``latest`` names a complete checkpoint of the last step; no folder left half-written as it;
4. no process of the job is left running;
5. no step took longer than the hang timeout + 30 s;
6. only a death (``schedule.DEATHS``) costs a restart: none without one, at most one per death
   (two for a lost node: it shrinks the job, and its return grows it back);
7. metrics.jsonl has every step once per attempt, in order, and the reports read it;
8. with ``--against-stock``: its pace (:func:`pace`) is at least ``min_pace`` x that of stock
   DeepSpeed (``engine=deepspeed``) run under the same slowdowns (``schedule.SLOWDOWNS``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..resilience.procs import is_running
from .schedule import Schedule


@dataclass
class Verdict:
    """One run's outcome: the broken invariants (empty: it held) and its counts."""

    seed: int
    broken: list[str] = field(default_factory=list)
    restarts: int = 0
    switches: int = 0
    failed_saves: int = 0
    seconds: float = 0.0
    pace: float | None = None           # seconds a step (:func:`pace`)
    stock_pace: float | None = None     # the same, stock DeepSpeed under the same slowdowns

    @property
    def ok(self) -> bool:
        return not self.broken


def attempts(rows: Sequence[dict]) -> list[list[int]]:
    """The step numbers of each attempt: a new attempt starts at a ``restart`` event, or where
    a step does not follow the one before (a rerun continuing from a checkpoint)."""
    out: list[list[int]] = [[]]
    for r in rows:
        if r.get("event") == "restart" and out[-1]:
            out.append([])
        elif "event" not in r:
            if out[-1] and r["step"] != out[-1][-1] + 1:
                out.append([])
            out[-1].append(r["step"])
    return [a for a in out if a]


#: the events whose ``seconds`` the ranks spent between steps: a plan switch, and a checkpoint
#: save's blocking part (a rank frozen while the others save shows there, not in a step)
BETWEEN_STEPS = ("migrate", "checkpoint", "checkpoint_failed")


def pace(rows: Sequence[dict]) -> float | None:
    """Seconds a step of training: each step's last record (a step re-done after a restart
    counts once, as it ran last) plus the seconds spent between steps (:data:`BETWEEN_STEPS`),
    over the steps counted. The first step of each attempt is left out (start-up: a restarted
    run has more of them than a run without deaths). None without a step to count."""
    starts = {a[0] for a in attempts(rows)}
    last: dict[int, float] = {}
    for r in rows:
        if "event" not in r:
            if r["step"] in starts:
                last.pop(r["step"], None)
            else:
                last[r["step"]] = float(r["step_time_s"])
    paused = sum(float(r.get("seconds") or 0.0) for r in rows
                 if r.get("event") in BETWEEN_STEPS)
    return (sum(last.values()) + paused) / len(last) if last else None


def judge_pace(v: Verdict, stock_rows: Sequence[dict], rows: Sequence[dict],
               min_pace: float) -> None:
    """Invariant 8 on ``v``: this run's pace against stock DeepSpeed's under the same slowdowns
    (``min_pace``: the noise two runs of the same job show on this machine)."""
    v.pace, v.stock_pace = pace(rows), pace(stock_rows)
    if v.pace is None or v.stock_pace is None:
        v.broken.append("no steps to compare with stock DeepSpeed's pace")
    elif v.stock_pace / v.pace < min_pace:
        v.broken.append(f"{v.stock_pace / v.pace:.2f}x stock DeepSpeed's throughput under the "
                        f"same slowdowns ({v.pace:.3f} s a step against {v.stock_pace:.3f}), "
                        f"under {min_pace:g}x")


def judge(sched: Schedule, run: Path, ck: Path, codes: Sequence[int], reference: Sequence[float],
          pids: set[int], hang_timeout_s: float, rtol: float = 1e-5) -> Verdict:
    """Check the invariants (module doc) on a finished run: ``codes``, the launcher's exit code
    of each launch (a SIGTERM's first, then its rerun's); ``pids``, every process of the job
    seen while it ran; ``reference``, the one-process losses of steps 0..steps-1."""
    v = Verdict(sched.seed)
    bad = v.broken.append
    f = run / "metrics.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []
    steps = [r for r in rows if "event" not in r]
    # torchrun's restarts (a rerun of the command after a stop starts at count 0)
    v.restarts = sum(r.get("event") == "restart" and r.get("torchrun_restarts", 1) > 0
                     for r in rows)
    v.switches = sum(r.get("event") == "migrate" for r in rows)
    v.failed_saves = sum(r.get("event") == "checkpoint_failed" for r in rows)
    if not codes or codes[-1] != 0:
        bad(f"the job did not finish: exit code(s) {list(codes)}")
    done = sorted({r["step"] for r in steps})
    if done != list(range(sched.steps)):
        missing = sorted(set(range(sched.steps)) - set(done))
        bad(f"steps missing from metrics.jsonl: {missing[:10]}")
    for r in steps:
        s = r["step"]
        if 0 <= s < len(reference) and not np.isclose(r["loss"], reference[s], rtol=rtol,
                                                       atol=0.0):
            bad(f"step {s}: loss {r['loss']!r} against the fault-free {reference[s]!r}")
            break
    try:
        tag = (ck / "latest").read_text().strip()
    except OSError:
        tag = None
    if tag != f"global_step{sched.steps}":
        bad(f"latest names {tag!r}, not global_step{sched.steps}")
    elif not (ck / tag / "run.json").is_file():
        bad(f"latest names {tag}, which has no run.json (half-written)")
    alive = sorted(p for p in pids if is_running(p))
    if alive:
        bad(f"processes of the job still running: {alive}")
    slow = [r["step"] for r in steps if r.get("step_time_s", 0) > hang_timeout_s + 30]
    if slow:
        bad(f"steps longer than the hang timeout + 30 s: {slow}")
    if v.restarts > sched.restarts_allowed:
        bad(f"{v.restarts} restart(s) for {sched.deaths} death(s) (at most "
            f"{sched.restarts_allowed}): a fault that kills no process cost a restart")
    for a in attempts(rows):
        if a != list(range(a[0], a[0] + len(a))):
            bad(f"metrics.jsonl: steps out of order within an attempt: {a}")
    _reports_read(run, bad)
    return v


def _reports_read(run: Path, bad) -> None:
    """The checked reader, the summary table and the what-if account take the run."""
    from ..report.metrics import read_metrics_file
    from ..report.whatif import WhatIfError, account_of_run, format_account

    try:
        read_metrics_file(run / "metrics.jsonl")
        try:
            format_account(account_of_run(run))
        except WhatIfError:
            pass                # a run the what-if has no account of (said, not an error)
    except Exception as e:  # noqa: BLE001 - any failure to read is the finding
        bad(f"the reports cannot read metrics.jsonl: {type(e).__name__}: {e}")
