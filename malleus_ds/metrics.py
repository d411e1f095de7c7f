"""Per-step metrics: ``metrics.jsonl`` (rank 0 writes it), throughput phases and the summary.

One JSON object per line and step::

    {"step": 3, "loss": 5.41, "samples": 8, "step_time_s": 0.21,
     "compute_s": [0.09, 0.36], "emulated_s": [0.0, 0.27], "emulated_rates": {"1": 4.0},
     "measured_rates": [1.0, 3.96]}

Lines with an ``"event"`` key are events, not steps (DESIGN.md §6): a re-plan of the adaptive
loop (``control.py``; ``adopted: false`` when the new plan would not repay its migration within
``malleus.horizon_steps``), then the live switch it caused::

    {"event": "replan", "step": 9, "trigger": "onset", "measured_rates": [1.0, 1.0, 1.0, 5.02],
     "from": "plan-1a2b3c4d", "to": "plan-5e6f7a8b", "planning_s": 0.8,
     "predicted_step_s": [0.40, 0.15], "predicted_migration_s": 0.3, "adopted": true, ...}
    {"event": "migrate", "step": 9, "from": "plan-1a2b3c4d", "to": "plan-5e6f7a8b",
     "bytes": 1234567, "seconds": 0.08, "peak_extra_bytes": 2345678, "idle": []}

A job the hung-rank watchdog stops (``watchdog.py``; ``hang_timeout_s``) ends with::

    {"event": "hang", "stuck": [{"rank": 1, "step": 7, "phase": "forward/backward",
     "stalled_s": 21.0}], "waiting": [{"rank": 0, ...}], "reason": "...", "hang_timeout_s": 20}

and a checkpoint save is an event line too (``{"event": "checkpoint", "step", "path",
"seconds"}``), as is the TP slowdown measured at start-up when a plan has TP groups
(``engine/tp_cost.py``; ``{"event": "tp_slowdown", "step", "tp", "table": {"1": 1.0, "2": 1.6},
"ideal": {"1": 1.0, "2": 2.0}}``). engine=malleus step lines carry ``"plan"``, the id of the plan that ran the step, and
``"measured_rates"``, each rank's smoothed measured rate (``straggler.py``; null until measured).

``compute_s[d]`` is rank ``d``'s forward+backward seconds in that step *including* its emulated
slowdown (what a real slow GPU would show); ``emulated_s[d]`` is the part of it that was the
emulation's sleep. ``emulated_rates`` holds the emulation's schedule active in that step (slowed
ranks only): what the experiment configured, never seen by the planner. (Files written before
this rename call it ``rates``; readers accept both.)

A *phase* is a run of steps with the same ``emulated_rates`` (and plan); the summary reports
throughput per phase, so one run that turns a straggler on half-way, or switches plans, shows
the regimes side by side.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float                          # global-batch mean loss
    samples: int                         # samples consumed by this step (the global batch)
    step_time_s: float                   # wall time of the step on rank 0
    compute_s: tuple[float, ...] = ()    # per rank, incl. emulated slowdown
    emulated_s: tuple[float, ...] = ()   # per rank, emulated part only
    emulated_rates: Mapping[str, float] = field(default_factory=dict)  # emulation schedule
    plan: str | None = None              # engine=malleus: id of the plan that ran the step
    measured_rates: tuple | None = None  # engine=malleus: smoothed measured rate per rank

    def to_json(self) -> dict:
        d = asdict(self)
        d["compute_s"] = list(self.compute_s)
        d["emulated_s"] = list(self.emulated_s)
        d["emulated_rates"] = dict(self.emulated_rates)
        for k in ("plan", "measured_rates"):
            if d[k] is None:
                d.pop(k)
        if self.measured_rates is not None:
            d["measured_rates"] = list(self.measured_rates)
        return d


class MetricsBusy(RuntimeError):
    """Another live process holds the metrics.jsonl this run would write."""


class MetricsWriter:
    """Appends one line per step to ``<run_dir>/metrics.jsonl`` (flushed each line).

    ``run_dir=None`` writes nothing (non-zero ranks, tests). The file is locked while open
    (``flock``, released when the process ends, however it ends): a second live run pointed at
    the same folder gets :class:`MetricsBusy` instead of corrupting this one's lines."""

    def __init__(self, run_dir: str | Path | None) -> None:
        self.path = Path(run_dir) / METRICS_FILE if run_dir else None
        self._f = None
        if self.path is not None:
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a")        # not "w": truncating another run's file corrupts it
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                raise MetricsBusy(f"{self.path} is being written by another live run; give "
                                  f"this run its own folder (hydra.run.dir=...)") from None
            f.truncate(0)
            self._f = f

    def write(self, rec: StepRecord) -> None:
        self.write_event(rec.to_json())

    def write_event(self, obj: Mapping) -> None:
        """One JSON object per line (an event such as ``{"event": "migrate", ...}``)."""
        if self._f is not None:
            self._f.write(json.dumps(dict(obj)) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str | Path, events: bool = False) -> list[dict]:
    """Step lines of a metrics.jsonl (or its run folder); ``events=True``: event lines instead."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r for r in rows if ("event" in r) == events]


@dataclass(frozen=True)
class Phase:
    """Steps that ran with the same emulated rates."""

    rates: tuple[tuple[int, float], ...]  # ((rank, rate), ...); () = healthy
    steps: int                            # steps counted (after warm-up)
    first_step: int
    mean_step_time_s: float
    samples_per_s: float
    plan: str | None = None               # engine=malleus: the plan that ran these steps

    @property
    def label(self) -> str:
        lab = ", ".join(f"rank {r} at rate {x:g}" for r, x in self.rates) or "healthy"
        return f"{lab} | {self.plan}" if self.plan else lab


def emulated_rates(rec: Mapping) -> Mapping[str, float]:
    """A step line's emulated rates (``rates`` in files from before the rename)."""
    return rec.get("emulated_rates", rec.get("rates")) or {}


def phases(records: Iterable[Mapping], warmup_steps: int = 0) -> list[Phase]:
    """Group steps by active rates (in order of first appearance); skip the first
    ``warmup_steps`` steps of the run and the first step after each change of rates (it mixes
    the two regimes)."""
    groups: dict[tuple, list[Mapping]] = {}
    prev = None
    for r in records:
        if "event" in r:
            continue
        key = (tuple(sorted((int(k), float(v)) for k, v in emulated_rates(r).items())),
               r.get("plan"))
        changed = prev is not None and key != prev
        prev = key
        if r["step"] < warmup_steps or changed:
            continue
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        t = sum(r["step_time_s"] for r in rs)
        n = sum(r["samples"] for r in rs)
        out.append(Phase(key[0], len(rs), rs[0]["step"], t / len(rs), n / t if t > 0 else 0.0,
                         key[1]))
    return out


def format_phases(ph: Sequence[Phase]) -> str:
    """Throughput per phase, with its ratio to the healthy phase when there is one."""
    base = next((p for p in ph if not p.rates), None)
    w = max([34] + [len(p.label) for p in ph])
    lines = [f"  {'phase':{w}s} {'steps':>5s} {'step time':>10s} {'samples/s':>10s} "
             f"{'vs healthy':>10s}"]
    for p in ph:
        rel = f"{p.samples_per_s / base.samples_per_s:9.2f}x" if base and base.samples_per_s \
            else "         -"
        lines.append(f"  {p.label:{w}s} {p.steps:5d} {p.mean_step_time_s:9.3f}s "
                     f"{p.samples_per_s:10.1f} {rel}")
    return "\n".join(lines)
