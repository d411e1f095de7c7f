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

a job torchrun restarted (``--max-restarts``; ``checkpoint.resume=auto``) says so where the
restarted run's lines begin, after the lines of the steps before ``from_step`` (the lines of the
steps the failure lost are dropped, so each step appears once; ``MetricsWriter``)::

    {"event": "restart", "attempt": 1, "from_step": 4, "world": 4, "lost_steps": 2}

and a checkpoint save is an event line too (``{"event": "checkpoint", "step", "path",
"seconds"}``), as is the TP slowdown measured at start-up when a plan has TP groups
(``engine/tp_cost.py``; ``{"event": "tp_slowdown", "step", "tp", "table": {"1": 1.0, "2": 1.6},
"ideal": {"1": 1.0, "2": 2.0}}``), as is each check of a plan against its promised step time
(``pace_check.py``; ``{"event": "check", "step", "plan", "outcome": "kept"|"missed", ...}``,
read back by ``check_events.py``). engine=malleus step lines carry ``"plan"``, the id of the
plan that ran the step, and ``"measured_rates"``, each rank's smoothed measured rate
(``adaptive/rates.py``; null until measured); on more than one node with the loop on also
``"link_rates"``, each measured node link's smoothed rate (``{"0-1": 1.0}``,
``adaptive/link_watch.py``), and where the links between a node's GPUs are read
(``detect.gpu_links``) ``"gpu_link_rates"`` (``{"2-3": 1.0}``); a step that read a probe
carries ``"probe_rates"``, per rank the probe's rate against its step's reference probe (idle
and held ranks; null for the others), what a replay of the run reads back
(``replay/run_trace.py``). A ``straggler.link_schedule``
run's lines carry
``"link_emulated_s"``, per rank the seconds the slow-link emulation waited.

:func:`format_event` turns a replan, migrate, restart or check line into text: one line for the
run summary and the progress bar, a short label for ``malleus-plot``.

``compute_s[d]`` is rank ``d``'s forward+backward seconds in that step *including* its emulated
slowdown (what a real slow GPU would show); ``emulated_s[d]`` is the part of it that was the
emulation's sleep. ``wait_s[d]`` (CPU hosts; 0 on CUDA) is the time rank ``d``'s compute spans
waited, runnable, for a core another process held: left out of ``compute_s`` (it is not the
device's), it is the host's contention, which a step's wall time holds (``replay/from_run.py``
models it). ``emulated_rates`` holds the emulation's schedule active in that step (slowed
ranks only): what the experiment configured, never seen by the planner. (Files written before
this rename call it ``rates``; readers accept both.)

A *phase* is a run of steps with the same ``emulated_rates`` (and plan); the summary reports
throughput per phase, so one run that turns a straggler on half-way, or switches plans, shows
the regimes side by side. The split, the throughput and the rank count are ``run_model.py``'s,
the one model of a run that compare, the what-if account and the plots read too. (A run's
straggler phases by its *measured* rates, for a run without a schedule, are ``phases.py``'s:
the adaptive loop's smoothed reading, never a single step.)

**Reading.** :func:`read_metrics_file` is the one checked reader: it reads a metrics.jsonl (or
the run folder holding one) once and returns its step lines and its event lines (every kind, the
unknown ones included) apart, as a :class:`MetricsFile`; :func:`read_run` gives the two as lists
(``malleus-plot``, ``launch/summarize.py``, ``compare.py`` and ``whatif.py`` all use it). A line
it cannot use raises :class:`MetricsError`, whose message names the file, the line and what is
wrong; each tool turns that into its own error. Blank lines are skipped; a cut-short last line
(a run killed mid-write) is not valid JSON and raises like any other. Keys added over time
(``plan``, ``measured_rates``, ``emulated_rates``; ``rates`` before that) are optional, so older
run folders read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .check_events import caused_by_miss, format_check
from .run_model import emulated_condition, step_lines, stretches, throughput
from .run_model import emulated_rates  # noqa: F401 - read here by older callers (bench/)

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
    wait_s: tuple[float, ...] = ()       # per rank, its compute's waits for a core (CPU hosts)
    #: per rank, the seconds the slow-link emulation waited (``straggler.link_schedule`` runs)
    link_emulated_s: tuple[float, ...] = ()
    #: engine=malleus on more than one node: each measured node link's smoothed rate
    #: (``{"0-1": 1.0}``; rank 0's link watch, ``adaptive/link_watch.py``)
    link_rates: Mapping[str, float] = field(default_factory=dict)
    #: engine=malleus where GPU links are read: each measured pair of a node's GPUs
    #: (``{"2-3": 1.0}``)
    gpu_link_rates: Mapping[str, float] = field(default_factory=dict)
    #: engine=malleus: the probes read in this step, per rank (idle and held ranks, each
    #: against its step's reference probe; None: none); written when one was read
    probe_rates: tuple | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["compute_s"] = list(self.compute_s)
        d["emulated_s"] = list(self.emulated_s)
        d["emulated_rates"] = dict(self.emulated_rates)
        for k in ("plan", "measured_rates"):
            if d[k] is None:
                d.pop(k)
        if self.probe_rates is not None and any(x is not None for x in self.probe_rates):
            d["probe_rates"] = list(self.probe_rates)
        else:
            d.pop("probe_rates")
        if self.wait_s:
            d["wait_s"] = list(self.wait_s)
        else:
            d.pop("wait_s")
        if self.link_emulated_s:
            d["link_emulated_s"] = list(self.link_emulated_s)
        else:
            d.pop("link_emulated_s")
        if self.measured_rates is not None:
            d["measured_rates"] = list(self.measured_rates)
        for k in ("link_rates", "gpu_link_rates"):
            if getattr(self, k):
                d[k] = dict(getattr(self, k))
            else:
                d.pop(k)
        return d


class MetricsBusy(RuntimeError):
    """Another live process holds the metrics.jsonl this run would write."""


class MetricsWriter:
    """Appends one line per step to ``<run_dir>/metrics.jsonl`` (flushed each line).

    ``run_dir=None`` writes nothing (non-zero ranks, tests). The file is locked while open
    (``flock``, released when the process ends, however it ends): a second live run pointed at
    the same folder gets :class:`MetricsBusy` instead of corrupting this one's lines.

    ``keep_before=None`` starts the file empty. A run that continues one in the same folder (a
    resume from step ``s``, or torchrun's restart of a job) passes ``keep_before=s``: the lines
    of steps before ``s`` stay, and every line of step ``s`` or later (steps and events that
    the continuing run redoes) is dropped, so each step appears once (:meth:`keep`).
    ``dropped_steps`` counts the step lines dropped (work the failure lost)."""

    def __init__(self, run_dir: str | Path | None, keep_before: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE if run_dir else None
        self._f = None
        self.dropped_steps = 0
        self.kept_lines = 0         # lines of the earlier run(s) kept (keep_before)
        self.restarts_before = 0    # restart events among them
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
            kept: list[str] = []
            if keep_before is not None and self.path.stat().st_size:
                with open(self.path) as old:
                    kept, self.dropped_steps = self.keep(old.read().splitlines(), keep_before)
                self.kept_lines = len(kept)
                self.restarts_before = sum('"event": "restart"' in line for line in kept)
            f.truncate(0)
            if kept:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
            self._f = f

    @staticmethod
    def keep(lines: Sequence[str], before: int) -> tuple[list[str], int]:
        """The lines a run continuing at step ``before`` keeps (those of earlier steps and those
        without a step), and how many step lines it drops. A line that is not a JSON object (a
        write cut short by the failure) is dropped."""
        kept, dropped = [], 0
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            step = obj.get("step")
            # a checkpoint event's step counts steps done: the one resumed from stays
            last = before + 1 if obj.get("event") == "checkpoint" else before
            if isinstance(step, int) and step >= last:
                dropped += "event" not in obj
                continue
            kept.append(line)
        return kept, dropped

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


def read_live(path: str | Path) -> list[dict]:
    """The lines of a metrics.jsonl (or its run folder) that a live run is writing: every
    complete JSON object so far, in order; a half-written last line and a missing file give
    nothing for it. Unchecked (watching a run: tests, benches); :func:`read_metrics_file`
    is the checked reader of a finished one."""
    f = metrics_path(path)
    out = []
    try:
        text = f.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


#: keys every step line has (in the order a message lists the missing ones)
STEP_KEYS = ("step", "step_time_s", "samples")
#: event kinds anchored to a step: their line must carry a numeric ``"step"``
STEP_EVENTS = ("replan", "migrate", "check")


class MetricsError(ValueError):
    """A metrics.jsonl that cannot be read or holds a line that is not a step or event line.

    ``str()`` is ``"<file>: line <n> is <what>"`` (``"<file>: <what>"`` when no line is to blame,
    e.g. ``cannot read: ...``); ``path``, ``line`` (None: the file) and ``what`` let a tool word
    it its own way."""

    def __init__(self, path: str | Path, line: int | None, what: str) -> None:
        self.path, self.line, self.what = Path(path), line, what
        super().__init__(f"{path}: line {line} is {what}" if line is not None
                         else f"{path}: {what}")


@dataclass(frozen=True)
class MetricsFile:
    """One metrics.jsonl, read and checked: its step lines and its event lines, each in file
    order (every event kind is kept; a caller picks the kinds it knows)."""

    path: Path                        # the file (not its run folder)
    steps: tuple[dict, ...]
    events: tuple[dict, ...]

    def events_of(self, *kinds: str) -> list[dict]:
        """The event lines of these kinds, in file order."""
        return [e for e in self.events if e["event"] in kinds]


def metrics_path(path: str | Path) -> Path:
    """``path`` itself, or ``path/metrics.jsonl`` when ``path`` is a folder."""
    p = Path(path)
    return p / METRICS_FILE if p.is_dir() else p


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _step_line_problem(r: Mapping) -> str | None:
    """What is wrong with step line ``r`` (None: nothing)."""
    missing = [k for k in STEP_KEYS if k not in r]
    if missing:
        return f"a step line without {missing}"
    bad = [k for k in STEP_KEYS if not _is_num(r[k])]
    if bad:
        return (f"a step line without numeric {bad} ("
                + ", ".join(f"{k}={_short(r[k])}" for k in bad) + ")")
    for k in ("compute_s", "measured_rates"):      # per rank; null: not measured
        v = r.get(k)
        if v is not None and not (isinstance(v, list)
                                  and all(x is None or _is_num(x) for x in v)):
            return f"a step line whose {k} is {_short(v)}, not a list of numbers"
    for k in ("emulated_rates", "rates"):           # {"rank": rate}; "rates" before the rename
        v = r.get(k)
        if v is None:
            continue
        ok = isinstance(v, dict) and all(_is_num(x) for x in v.values())
        if ok:
            try:
                [int(x) for x in v]
            except (TypeError, ValueError):
                ok = False
        if not ok:
            return f"a step line whose {k} is {_short(v)}, not an object of rank: rate numbers"
    v = r.get("plan")
    if v is not None and not isinstance(v, str):
        return f"a step line whose plan is {_short(v)}, not a plan id"
    return None


def _event_line_problem(r: Mapping) -> str | None:
    kind = r["event"]
    if not isinstance(kind, str):
        return f"an event line whose \"event\" is {_short(kind)}, not a name"
    if kind in STEP_EVENTS and "step" not in r:
        return f"a {kind} event without \"step\""
    if "step" in r and not _is_num(r["step"]):
        return f"a {kind} event whose step is {_short(r['step'])}, not a number"
    return None


def read_metrics_file(path: str | Path) -> MetricsFile:
    """Read and check a metrics.jsonl (or the run folder holding one): every line once, blank
    lines skipped. Raises :class:`MetricsError` naming the file and line for a line that is not
    valid JSON (a cut-short last line included), not a JSON object, a step line without numeric
    ``step``/``step_time_s``/``samples`` or with a badly typed ``compute_s`` /
    ``measured_rates`` / ``emulated_rates`` / ``plan``, or an event line without a numeric
    ``step`` where its kind needs one; and for a file it cannot read. A file without step lines
    is no error here (each tool says what that means for it)."""
    p = metrics_path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MetricsError(p, None, f"cannot read: {e}") from None
    steps, events = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsError(p, n, f"not valid JSON ({e.msg} at column {e.colno}); the file "
                                     f"is corrupt or was cut short") from None
        if not isinstance(r, dict):
            raise MetricsError(p, n, f"not a JSON object: {line.strip()[:60]}")
        is_event = "event" in r
        bad = _event_line_problem(r) if is_event else _step_line_problem(r)
        if bad:
            raise MetricsError(p, n, bad)
        (events if is_event else steps).append(r)
    return MetricsFile(p, tuple(steps), tuple(events))


def read_run(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(step lines, event lines) of a run folder's metrics.jsonl (or of the file itself), each
    in file order, checked (:func:`read_metrics_file`): a bad line raises :class:`MetricsError`.
    No step lines is no error here: each tool says what that means for it."""
    f = read_metrics_file(path)
    return list(f.steps), list(f.events)


def read_metrics(path: str | Path, events: bool = False) -> list[dict]:
    """Step lines of a metrics.jsonl (or its run folder); ``events=True``: event lines instead.
    Checked (:func:`read_metrics_file`): a bad line raises :class:`MetricsError`."""
    f = read_metrics_file(path)
    return list(f.events if events else f.steps)


def format_event(ev: Mapping, short: bool = False) -> str:
    """Text for a ``replan``, ``migrate``, ``restart`` or ``check`` event line (any other: the line
    as it is; a ``check``: ``check_events.format_check``).

    One line (the run summary, the progress bar): what the loop measured, planned and chose, or
    what the switch moved. ``short``: the few words ``malleus-plot`` writes next to the event's
    vertical line, one fact a line: the trigger (``after a missed check`` when a miss on the
    first plan caused it), ``not adopted`` or ``back to previous plan``, the planning seconds;
    or the size moved and the seconds it took. A replan line without ``adopted`` counts as
    adopted."""
    kind = ev.get("event")
    if kind == "check":
        return format_check(ev, short)
    if kind == "replan":
        adopted = ev.get("adopted", True) is not False
        if short:
            ps = ev.get("planning_s")
            back = adopted and "rates_for" in ev     # a missed promise: the previous plan
            miss = ev.get("trigger") != "missed" and caused_by_miss(ev)   # on the first plan
            return (f"replan ({ev.get('trigger') or '?'})"
                    + ("\nafter a missed check" if miss else "")
                    + ("" if adopted else "\nnot adopted")
                    + ("\nback to previous plan" if back else "")
                    + (f"\n{ps:.1f} s plan" if _is_num(ps) else ""))
        rates = ", ".join(f"rank {d} {x:g}" for d, x in enumerate(ev.get("measured_rates") or ())
                          if x is not None and x > 1.0) or "all healthy"
        head = f"replan before step {ev['step']} ({ev.get('trigger')}; measured {rates})"
        if ev.get("trigger") == "error":
            return f"{head}: {ev.get('reason')}"
        pred = ev.get("predicted_step_s") or [None, None]
        verdict = f"-> {ev.get('to')}" if adopted else f"kept {ev.get('from')}"
        return (f"{head}: planned in {ev.get('planning_s', 0):.2f} s, step "
                f"{pred[0]} s -> {pred[1]} s predicted, {verdict} ({ev.get('reason')})")
    if kind == "migrate":
        if short:
            b, t = ev.get("bytes"), ev.get("seconds")
            parts = ([f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"]
                     if _is_num(b) else []) + ([f"{t:.2f} s"] if _is_num(t) else [])
            return "migrate" + (" " + ", ".join(parts) if parts else "")
        return (f"migrate before step {ev['step']}: {ev['from']} -> {ev['to']}, "
                f"{ev['bytes'] / 2**20:.2f} MiB sent in {ev['seconds']:.3f} s, "
                f"{ev['peak_extra_bytes'] / 2**20:.2f} MiB extra at peak")
    if kind == "restart":
        if short:
            return f"restart {ev.get('attempt')}"
        return (f"restart {ev.get('attempt')}: continuing from step {ev.get('from_step')} on "
                f"{ev.get('world')} rank(s); {ev.get('lost_steps')} step(s) done since that "
                f"checkpoint are run again")
    return str(ev)


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


def phases(records: Iterable[Mapping], warmup_steps: int = 0) -> list[Phase]:
    """Group steps by active rates and plan (in order of first appearance): the stretches of
    equal condition and plan (``run_model.stretches``), one phase per distinct pair, so the
    healthy steps before and after a straggler are one phase. Skip the first ``warmup_steps``
    steps of the run and the first step after each change (it mixes the two regimes); a
    phase's samples/s is over its step times (``run_model.throughput``, no events: the
    migrations are the switch's, not the regime's)."""
    steps = step_lines(records)
    keys = [(emulated_condition(r), r.get("plan")) for r in steps]
    groups: dict[tuple, list[Mapping]] = {}
    for k, st in enumerate(stretches(keys)):
        for r in steps[st.lo + (k > 0):st.hi]:
            if r["step"] >= warmup_steps:
                groups.setdefault(st.key, []).append(r)
    out = []
    for key, rs in groups.items():
        tp = throughput(rs)
        out.append(Phase(key[0], tp.steps, rs[0]["step"], tp.step_s / tp.steps,
                         tp.samples_per_s, key[1]))
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
