"""The data side of ``malleus-plot`` (``plot.py``): a run folder's metrics as per-step arrays,
its straggler regions, events and labels. Pure (numpy, no matplotlib), so it is tested without
looking at pixels.

The shaded regions are the emulated schedule's (what the experiment configured); the what-if
marks come from ``whatif.py``, which splits a run without a schedule by its measured rates as
the adaptive loop reads them (``phases.rate_phases``), so one noisy step draws no phase. The
regions' split and the rank count are ``run_model.py``'s, as in every report.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from . import metrics, whatif
from .metrics import METRICS_FILE, MetricsError, format_event, metrics_path
from .run_folder import find_runs, read_overrides
from .run_model import emulated_rates, stretches, world_of


EVENT_KINDS = ("replan", "migrate", "check")     # the events drawn (others are ignored)
CHECK_OUTCOMES = ("kept", "missed")                # a check's verdicts (pace_check.py)


class PlotError(Exception):
    """Bad input: reported as one ``malleus-plot: error: ...`` line, exit code 2."""



@dataclass(frozen=True)
class Event:
    """A ``replan``, ``migrate`` or ``check`` line of metrics.jsonl, with the text drawn next to
    its line (``metrics.format_event(..., short=True)``: ``missed ×2.09`` for a check)."""

    kind: str              # "replan" | "migrate" | "check"
    step: int
    label: str
    adopted: bool = True   # replan only: False = the planner's plan was not worth moving to
    trigger: str | None = None
    outcome: str | None = None   # check only: "kept" | "missed" (pace_check.py)

    @property
    def missed(self) -> bool:
        """A plan check that found the plan slower than its promise."""
        return self.kind == "check" and self.outcome == "missed"


@dataclass(frozen=True)
class Region:
    """Recorded steps ``start <= step < end`` during which some emulated straggler was active."""

    start: int
    end: int               # exclusive: the first recorded step after the region (or last + 1)
    label: str             # e.g. "rank 3 at rate 5"


@dataclass
class RunData:
    """One run folder's metrics as per-step arrays (index i = the i-th step line of the file)."""

    path: Path
    name: str                                   # label in plots (job overrides for a multirun)
    steps: np.ndarray                           # int
    samples: np.ndarray                         # float
    step_time_s: np.ndarray                     # float
    compute_s: np.ndarray                       # (steps, ranks), NaN where missing
    emulated_rates: list[dict[int, float]]      # per step: {rank: rate} of slowed ranks
    measured_rates: np.ndarray | None           # (steps, ranks), NaN = not measured; None = absent
    events: list[Event] = field(default_factory=list)
    overrides: list[str] | None = None          # <run>/.hydra/overrides.yaml, when present
    whatif: "whatif.Account | None" = None      # what-if account (None: the records hold none)
    world_size: int = 0                         # ranks (run_model.world_of; 0: the file names none)
    #: per step: its slow links (``whatif.link_state``: measured "a-b" names, or "emulated")
    link_states: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def throughput(self) -> np.ndarray:
        """samples / step_time_s per step (NaN where the step time is not positive)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.step_time_s > 0, self.samples / self.step_time_s, np.nan)

    @property
    def mean_throughput(self) -> float:
        """All samples over all step time (samples/s)."""
        t = float(np.sum(self.step_time_s))
        return float(np.sum(self.samples)) / t if t > 0 else float("nan")


def _num(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what} is {v!r}, not a number")
    return float(v)


def _num_list(v, what: str) -> list[float]:
    """A list of numbers or nulls (NaN)."""
    if not isinstance(v, list):
        raise ValueError(f"{what} is {v!r}, not a list")
    return [float("nan") if x is None else _num(x, what) for x in v]


def _rates_dict(v, what: str) -> dict[int, float]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"{what} is {v!r}, not an object")
    try:
        return {int(k): _num(x, what) for k, x in v.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None


def parse_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(step lines, event lines) of a metrics.jsonl, checked (``metrics.read_run``: blank lines
    skipped; a line that is not a JSON object, a step line without numeric
    ``step``/``samples``/``step_time_s``, ...). A bad line or a file without step lines raises
    PlotError naming the file (and line: ``<file>:<line>: corrupt line: ...``)."""
    try:
        steps, events = metrics.read_run(path)   # (load_run_data below builds a RunData)
    except MetricsError as e:
        raise PlotError(f"{e.path}:{e.line}: corrupt line: {e.what}" if e.line is not None
                        else str(e)) from None
    if not steps:
        raise PlotError(f"{metrics_path(path)}: no step lines")
    return steps, events


def _matrix(rows: Sequence[list[float] | None], width: int) -> np.ndarray:
    m = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        if r:
            m[i, :len(r)] = r
    return m


def extract_events(lines: Iterable[Mapping]) -> list[Event]:
    """replan / migrate / check events (others, and a check with an unknown outcome, are
    ignored), in step order (at one step: replan, migrate, check)."""
    out = []
    for ev in lines:
        kind = ev.get("event")
        if kind not in EVENT_KINDS or (kind == "check"
                                       and ev.get("outcome") not in CHECK_OUTCOMES):
            continue
        out.append(Event(kind, int(ev["step"]), format_event(ev, short=True),
                         adopted=ev.get("adopted", True) is not False if kind == "replan" else True,
                         trigger=ev.get("trigger") if kind == "replan" else None,
                         outcome=ev.get("outcome") if kind == "check" else None))
    return sorted(out, key=lambda e: (e.step, EVENT_KINDS.index(e.kind)))


def load_run_data(run_dir: str | Path, name: str | None = None) -> RunData:
    """One run folder's metrics.jsonl (and overrides) as a RunData (its lines read by
    ``metrics.read_run``, through :func:`parse_metrics`)."""
    run_dir = Path(run_dir)
    lines, evs = parse_metrics(run_dir / METRICS_FILE)
    comp = [_num_list(r["compute_s"], "compute_s") if r.get("compute_s") is not None else None
            for r in lines]
    meas_present = any(isinstance(r.get("measured_rates"), list) for r in lines)
    meas = [_num_list(r["measured_rates"], "measured_rates")
            if r.get("measured_rates") is not None else None for r in lines]
    width_c = max((len(c) for c in comp if c), default=0)
    width_m = max((len(m) for m in meas if m), default=0)
    emu = [_rates_dict(emulated_rates(r), "emulated_rates") for r in lines]
    return RunData(
        path=run_dir,
        name=name if name is not None else run_dir.resolve().name,
        steps=np.array([int(r["step"]) for r in lines], dtype=int),
        samples=np.array([float(r["samples"]) for r in lines]),
        step_time_s=np.array([float(r["step_time_s"]) for r in lines]),
        compute_s=_matrix(comp, width_c),
        emulated_rates=emu,
        measured_rates=_matrix(meas, width_m) if meas_present else None,
        events=extract_events(evs),
        overrides=read_overrides(run_dir),
        whatif=_account(run_dir, lines, evs),
        world_size=world_of(lines, least=0),
        link_states=[whatif.link_state(r) for r in lines],
    )


def _account(run_dir: Path, lines: list[dict], evs: list[dict]):
    """The run's what-if account (``whatif.account_of_run``: layout and warm-up from
    .hydra/config.yaml), or None when the records hold none."""
    try:
        return whatif.account_of_run(run_dir, lines=(lines, evs))
    except (whatif.WhatIfError, ValueError, TypeError, KeyError):
        return None


def job_labels(runs: Sequence[RunData], root: Path | None = None) -> list[str]:
    """One label per job: its overrides that differ between jobs (``key=value, ...``); the
    folder (relative to ``root``) where a job has no overrides.yaml or nothing differs."""
    def folder(r: RunData) -> str:
        if root is not None:
            try:
                rel = r.path.resolve().relative_to(Path(root).resolve()).as_posix()
                if rel != ".":
                    return rel
            except ValueError:
                pass
        return r.path.name

    if len(runs) < 2 or any(r.overrides is None for r in runs):
        return [folder(r) for r in runs]
    # key -> the override as written ("engine=malleus"; "~key" has no "=")
    parsed = [{o.split("=", 1)[0]: o for o in r.overrides} for r in runs]
    keys: list[str] = []
    for d in parsed:
        keys += [k for k in d if k not in keys]
    differ = [k for k in keys if len({d.get(k) for d in parsed}) > 1]
    return [", ".join(d[k] for k in differ if k in d) or folder(r) for r, d in zip(runs, parsed)]


def load_runs(root: str | Path) -> list[RunData]:
    """All runs at or below ``root`` (``run_folder.find_runs``); a multirun's jobs are labelled
    by :func:`job_labels`."""
    root = Path(root)
    if not root.is_dir():
        raise PlotError(f"{root}: no such folder" if not root.exists() else f"{root}: not a folder")
    dirs = find_runs(root)
    if not dirs:
        raise PlotError(f"{root}: no {METRICS_FILE} found in it or below it")
    runs = [load_run_data(d) for d in dirs]
    if len(runs) > 1:
        for r, lab in zip(runs, job_labels(runs, root)):
            r.name = lab
    return runs


def rates_label(rates: Mapping[int, float]) -> str:
    """``{3: 5.0}`` -> ``rank 3 at rate 5``; ranks sharing a rate are listed together."""
    by_rate: dict[float, list[int]] = {}
    for r, x in sorted(rates.items()):
        by_rate.setdefault(float(x), []).append(int(r))
    parts = []
    for x, ranks in by_rate.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} at rate {x:g}")
    return ", ".join(parts)


def _regions(runs: Sequence[RunData], labels_of) -> list[Region]:
    """Contiguous stretches of recorded steps, over the union of ``runs``, where
    ``labels_of(run, i)`` (the labels of ``run``'s ``i``-th step line) names something: the
    stretches (``run_model.stretches``) of "something named" over the recorded steps in order,
    each labelled with the distinct labels seen in it, in order (``" / "`` between them)."""
    active: dict[int, list[str]] = {}
    all_steps: set[int] = set()
    for run in runs:
        for i, s in enumerate(run.steps.tolist()):
            all_steps.add(s)
            for lab in labels_of(run, i):
                if lab not in active.setdefault(s, []):
                    active[s].append(lab)
    steps = sorted(all_steps)
    out: list[Region] = []
    for st in stretches(bool(active.get(s)) for s in steps):
        if not st.key:
            continue
        labels: list[str] = []
        for s in steps[st.lo:st.hi]:
            labels += [x for x in active[s] if x not in labels]
        end = steps[st.hi] if st.hi < len(steps) else steps[-1] + 1
        out.append(Region(steps[st.lo], end, " / ".join(labels)))
    return out


def straggler_regions(runs: Sequence[RunData]) -> list[Region]:
    """Contiguous stretches of recorded steps in which some emulated straggler was active, taken
    over the union of ``runs`` (one run: its own), labelled with the distinct schedules seen."""
    return _regions(runs, lambda run, i: [rates_label(run.emulated_rates[i])]
                    if run.emulated_rates[i] else [])


def link_regions(runs: Sequence[RunData]) -> list[Region]:
    """Contiguous stretches of recorded steps with a slow link (measured, or the emulation
    waiting), over the union of ``runs``, labelled ``link 0-1`` (``link (emulated)``)."""
    def labels(run, i):
        ls = run.link_states[i] if i < len(run.link_states) else ()
        return ["link (emulated)" if n == "emulated" else f"link {n}" for n in ls]
    return _regions(runs, labels)


def emulated_rate_series(run: RunData) -> dict[int, np.ndarray]:
    """Per slowed rank (slowed in any step): its emulated rate each step (1 when not slowed)."""
    ranks = sorted({r for er in run.emulated_rates for r in er})
    return {r: np.array([er.get(r, 1.0) for er in run.emulated_rates]) for r in ranks}


def rolling_median(y: np.ndarray, window: int = 5) -> np.ndarray:
    """Centred rolling median (NaNs ignored; the window shrinks at the ends)."""
    y = np.asarray(y, dtype=float)
    if window <= 1 or y.size == 0:
        return y.copy()
    left = (window - 1) // 2
    right = window - 1 - left
    padded = np.concatenate([np.full(left, np.nan), y, np.full(right, np.nan)])
    win = np.lib.stride_tricks.sliding_window_view(padded, window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # an all-NaN window -> NaN
        return np.nanmedian(win, axis=1)
