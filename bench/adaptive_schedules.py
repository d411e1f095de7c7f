"""Named straggler schedules and the criteria of ``bench_adaptive.py --repeat`` (issue 31, part 4).

Pure: no processes, no torch, nothing from ``malleus_ds``. A run is judged from its metrics rows
(step lines of metrics.jsonl: ``step``, ``samples``, ``step_time_s``) and its events (event lines:
``{"event": "replan", "step", "adopted", ...}``, ``{"event": "migrate", "step", "seconds"}``), as
``malleus_ds.report.metrics.read_metrics(d)`` / ``read_metrics(d, events=True)`` give them, so the unit
tests feed synthetic rows in (``tests/unit/bench/test_adaptive_schedules.py``).

The criteria, per run (:func:`judge_adaptive`, :func:`judge_healthy`):

* ``onset``: each onset of the schedule (a step where some rank's rate rises: a new straggler, a
  returning one, a worse rate) is followed by an *adopted* re-plan within :data:`ONSET_STEPS`
  steps: the first adopted replan event with ``onset < step <= next onset`` (a replan "before
  step s" is decided before step s runs, so one at the onset step cannot have seen it, and one
  at the next onset step was decided on the steps before it);
* ``vs_deepspeed``: samples/s over the straggling steps (every step with a slowed rank,
  migrations at those steps included, as ``bench_adaptive.phase_tput``) over stock DeepSpeed's
  over the same steps >= :data:`VS_DEEPSPEED`;
* ``after``: samples/s over ``[recovery + RECOVERY_STEPS, next onset or end)`` over the run's own
  healthy samples/s before the first onset (steps ``[2, first onset)``) >= :data:`AFTER`, for each
  recovery (every rank healthy again) whose window holds at least :data:`MIN_WINDOW` steps;
* ``healthy``: a run of the adaptive engine with no straggler has 0 replan events (any trigger,
  adopted or not).
"""
from __future__ import annotations

import statistics

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

ONSET_STEPS = 8          # an adopted re-plan at most this many steps after each onset
VS_DEEPSPEED = 2.5       # adaptive / deepspeed samples/s over the straggling steps
RECOVERY_STEPS = 15      # the after-window starts this many steps after the recovery
AFTER = 0.9              # adaptive after-window / its own healthy samples/s
MIN_WINDOW = 5           # an after-window with fewer steps is not judged (too noisy)
HEALTHY_FROM = 2         # the healthy reference starts here (steps 0, 1: warm-up)
#: with ``--real`` an onset whose measured slowdown is below this is not judged: a quota of
#: rate 2 on 4 ranks sharing 2 cores barely slows a rank (its healthy share was half a core)
MIN_STRAGGLER = 1.5


@dataclass(frozen=True)
class Entry:
    """Rank ``rank`` at ``rate`` during steps ``[start, end)`` (``straggler.schedule``)."""
    rank: int
    rate: float
    start: int
    end: int


@dataclass(frozen=True)
class Schedule:
    name: str
    steps: int
    entries: tuple[Entry, ...]
    about: str = ""

    def rates(self, step: int) -> dict[int, float]:
        """The slowed ranks at ``step``: {rank: rate} (overlapping entries combine by max)."""
        out: dict[int, float] = {}
        for e in self.entries:
            if e.start <= step < e.end:
                out[e.rank] = max(out.get(e.rank, 1.0), e.rate)
        return out

    def hydra(self) -> str:
        """The ``straggler.schedule=`` override value."""
        return "[" + ",".join(f"{{rank:{e.rank},rate:{float(e.rate)},start_step:{e.start},"
                              f"end_step:{e.end}}}" for e in self.entries) + "]"

    def distinct_rates(self) -> tuple[float, ...]:
        return tuple(sorted({float(e.rate) for e in self.entries}))

    def scaled(self, k: float) -> "Schedule":
        """The same schedule with every rate times ``k`` (``--real`` on shared cores: a quota
        of ``r * k`` of one core slows a rank ``r``-fold against peers that get ``1/k`` of a
        core each)."""
        if not k >= 1.0:
            raise ValueError(f"scale k={k!r} must be >= 1")
        return Schedule(self.name, self.steps,
                        tuple(Entry(e.rank, e.rate * k, e.start, e.end) for e in self.entries),
                        self.about)

    def text(self) -> str:
        return "; ".join(f"rank {e.rank} at rate {e.rate:g} in [{e.start}, {e.end})"
                         for e in self.entries) + f"; {self.steps} steps"


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("recover", 60, (Entry(1, 10.0, 8, 30),),
             "a rate-10 straggler that recovers (the case of issue 31, 22 steps at rate 10, "
             "from step 8 so the run's own healthy reference has 6 steps, not 2; 15 steps "
             "after the recovery window)"),
    # 18 steps each: onset to adopted re-plan takes 3 steps at best (two slow steps for the
    # severe rule, one to plan), and over 10-step windows that alone held adaptive / deepspeed
    # at 2.1-2.6 (bench/RESULTS.md, 2026-12-05)
    Schedule("returns", 90, (Entry(1, 10.0, 6, 24), Entry(1, 10.0, 46, 64)),
             "a rate-10 straggler that recovers and comes back"),
    # rates where 2.5x DeepSpeed is within the capacity bound: DeepSpeed runs at 1/max rate,
    # a perfect re-layout at the mean of 1/rate (rate 3 alone allows 2.5x at best, rate 2 1.75x)
    Schedule("two", 64, (Entry(1, 6.0, 6, 26), Entry(3, 10.0, 16, 34)),
             "two stragglers on different pipelines, overlapping"),
    Schedule("worsens", 60, (Entry(2, 4.0, 6, 14), Entry(2, 8.0, 14, 22), Entry(2, 16.0, 22, 30)),
             "one rank worsening 4 -> 8 -> 16, then recovering"),
)}


@dataclass(frozen=True)
class Onset:
    step: int
    rates: dict = field(default_factory=dict)  # {rank: rate} of the ranks whose rate rose
    judged: bool = True                         # False: below MIN_STRAGGLER (measured, --real)
    true_rates: dict | None = None              # {rank: measured slowdown} (--real)


def onsets(s: Schedule, true_rate: Mapping[float, float] | None = None) -> list[Onset]:
    """Steps where some rank's rate rises. ``true_rate``: the measured slowdown per scheduled
    rate (``--real``); an onset whose risen ranks all measure below :data:`MIN_STRAGGLER` is
    kept but not judged."""
    out, prev = [], {}
    for k in range(s.steps):
        cur = s.rates(k)
        rose = {d: x for d, x in cur.items() if x > prev.get(d, 1.0)}
        if rose:
            tr = None if true_rate is None else {d: float(true_rate.get(x, x))
                                                  for d, x in rose.items()}
            judged = tr is None or max(tr.values()) >= MIN_STRAGGLER
            out.append(Onset(k, rose, judged, tr))
        prev = cur
    return out


def measured_slowdown(ds_rows: Iterable[Mapping], s: Schedule) -> dict[float, float]:
    """The slowdown a job really had, per scheduled rate, from the stock DeepSpeed run of ``s``
    (``--real``): the median step time over the steps whose largest rate is ``r``, over the
    median healthy step time (steps ``[HEALTHY_FROM, first onset)``). Stock DeepSpeed runs at
    the pace of its slowest rank, so this is that rank's slowdown against its peers on this
    machine, whatever a quota of ``r`` means against one full core. Rates with no step or no
    healthy step are left out."""
    rows = list(ds_rows)
    lo, hi = healthy_window(s)
    healthy = [r["step_time_s"] for r in rows if lo <= r["step"] < hi]
    if not healthy:
        return {}
    base = statistics.median(healthy)
    by: dict[float, list[float]] = {}
    for r in rows:
        cur = s.rates(r["step"])
        if cur:
            by.setdefault(float(max(cur.values())), []).append(r["step_time_s"])
    return {x: statistics.median(t) / base for x, t in sorted(by.items()) if base > 0}


def recoveries(s: Schedule) -> list[int]:
    """Steps where every rank is healthy again after a slowed step."""
    return [k for k in range(1, s.steps) if not s.rates(k) and s.rates(k - 1)]


def straggling_steps(s: Schedule) -> list[int]:
    return [k for k in range(s.steps) if s.rates(k)]


def after_windows(s: Schedule) -> list[tuple[int, int]]:
    """``[recovery + RECOVERY_STEPS, next onset or end)`` per recovery, when it holds at least
    :data:`MIN_WINDOW` steps."""
    starts = [o.step for o in onsets(s)]
    out = []
    for r in recoveries(s):
        lo = r + RECOVERY_STEPS
        hi = min([o for o in starts if o > r] + [s.steps])
        if hi - lo >= MIN_WINDOW:
            out.append((lo, hi))
    return out


def healthy_window(s: Schedule) -> tuple[int, int]:
    return HEALTHY_FROM, onsets(s)[0].step


def tput(rows: Iterable[Mapping], events: Iterable[Mapping], steps: Iterable[int]) -> float | None:
    """Samples/s over ``steps``, the seconds of migrations at those steps included (as
    ``bench_adaptive.phase_tput``); None when no row falls in ``steps``."""
    want = steps if isinstance(steps, range) else set(steps)   # a range tests in O(1)
    rs = [r for r in rows if r["step"] in want]
    if not rs:
        return None
    mig = sum(e.get("seconds") or 0.0 for e in events
              if e.get("event") == "migrate" and e.get("step") in want)
    t = sum(r["step_time_s"] for r in rs) + mig
    return sum(r["samples"] for r in rs) / t if t > 0 else None


def healthy_tput(rows: Iterable[Mapping], steps: range) -> float | None:
    """Samples/s of a run's own healthy window, robust to one odd step: the median over its
    steps of samples / step seconds. (Summed over 4 steps, one lucky 0.27 s step among
    0.35-0.37 s ones raised the reference by 12%, and a run whose after-recovery pace equalled
    every other run's read 0.89: bench/RESULTS.md, 2026-12-05.) None when no row falls in
    ``steps``."""
    per = [r["samples"] / r["step_time_s"] for r in rows
           if r["step"] in steps and r["step_time_s"] > 0]
    return float(statistics.median(per)) if per else None


def replans(events: Iterable[Mapping]) -> list[Mapping]:
    return [e for e in events if e.get("event") == "replan"]


def adopted(e: Mapping) -> bool:
    """As ``metrics.format_event``: a replan line without ``adopted`` counts as adopted."""
    return e.get("adopted", True) is not False


def onset_latencies(events: Iterable[Mapping], s: Schedule,
                    true_rate: Mapping[float, float] | None = None) -> list[dict]:
    """Per onset: ``{"step", "rates", "judged", "latency"}``; latency = steps from the onset to
    the first adopted replan in ``(onset, next onset]`` (None: none there), 0 when the plan
    running at the onset already leaves every rank that slowed without work."""
    os_ = onsets(s, true_rate)
    events = list(events)
    rp = sorted((e for e in replans(events) if adopted(e)), key=lambda e: e["step"])
    migrations = sorted((e for e in events if e.get("event") == "migrate"),
                        key=lambda e: e["step"])
    out = []
    for i, o in enumerate(os_):
        hi = os_[i + 1].step if i + 1 < len(os_) else s.steps
        first = next((e for e in rp if o.step < e["step"] <= hi), None)
        # a rank the running plan already leaves out (a straggler that worsens while
        # suspended) needs no re-plan: latency 0 (the migrate event's ``idle`` ranks)
        last = next((m for m in reversed(migrations) if m["step"] <= o.step), None)
        out_already = last is not None and set(o.rates) <= {int(d) for d in last.get("idle", ())}
        out.append({"step": o.step, "rates": {str(d): x for d, x in o.rates.items()},
                    "true_rates": None if o.true_rates is None else
                    {str(d): round(x, 2) for d, x in o.true_rates.items()},
                    "judged": o.judged,
                    "latency": 0 if out_already else
                    None if first is None else first["step"] - o.step})
    return out


def judge_adaptive(rows: Sequence[Mapping], events: Sequence[Mapping], s: Schedule,
                   ds_rows: Sequence[Mapping], ds_events: Sequence[Mapping] = (),
                   true_rate: Mapping[float, float] | None = None) -> dict:
    """One adaptive run of ``s`` against the DeepSpeed reference run of the same schedule:
    a dict with each criterion's value (``onset``: the worst judged latency, None = an onset
    without an adopted re-plan; ``vs_deepspeed``; ``after``: the worst window's ratio) and
    ``pass`` per criterion, plus the details behind them."""
    lat = onset_latencies(events, s, true_rate)
    judged = [o["latency"] for o in lat if o["judged"]]
    # nothing to judge (every onset below MIN_STRAGGLER, --real): passes, value None
    worst = None if not judged or any(x is None for x in judged) else max(judged)
    onset_ok = not judged or (worst is not None and worst <= ONSET_STEPS)
    st = straggling_steps(s)
    t_ad, t_ds = tput(rows, events, st), tput(ds_rows, ds_events, st)
    vs = t_ad / t_ds if t_ad and t_ds else None
    # per straggling phase (a run of steps with the same rates): where the ratio is won or lost
    phases, cur = [], None
    for k in st:
        key = tuple(sorted(s.rates(k).items()))
        if cur and cur["key"] == key and cur["hi"] == k:
            cur["hi"] = k + 1
        else:
            cur = {"key": key, "lo": k, "hi": k + 1}
            phases.append(cur)
    per_phase = []
    for p in phases:
        a, d = tput(rows, events, range(p["lo"], p["hi"])), \
            tput(ds_rows, ds_events, range(p["lo"], p["hi"]))
        per_phase.append({"steps": [p["lo"], p["hi"]],
                          "rates": {str(r): x for r, x in p["key"]},
                          "adaptive": a, "deepspeed": d,
                          "ratio": a / d if a and d else None})
    base = healthy_tput(rows, range(*healthy_window(s)))
    wins = []
    for lo, hi in after_windows(s):
        t = tput(rows, events, range(lo, hi))
        wins.append({"steps": [lo, hi], "tput": t,
                     "ratio": t / base if t and base else None})
    ratios = [w["ratio"] for w in wins]
    after = None if not wins or any(x is None for x in ratios) else min(ratios)
    rp = replans(events)
    return {
        "onset": worst, "vs_deepspeed": vs, "after": after,
        "pass": {"onset": onset_ok,
                 "vs_deepspeed": vs is not None and vs >= VS_DEEPSPEED,
                 "after": after is not None and after >= AFTER},
        "onsets": lat, "straggling_tput": t_ad, "deepspeed_tput": t_ds, "phases": per_phase,
        "healthy_tput": base, "healthy_steps": list(healthy_window(s)), "after_windows": wins,
        "replans": len(rp), "adopted": sum(adopted(e) for e in rp),
        "replan_steps": [[e["step"], e.get("trigger"), adopted(e)] for e in rp],
        "migrate_s": [round(e.get("seconds") or 0.0, 3) for e in events
                      if e.get("event") == "migrate"],
        "steps_run": max((r["step"] for r in rows), default=-1) + 1,
    }


def judge_healthy(rows: Sequence[Mapping], events: Sequence[Mapping]) -> dict:
    """A run with no straggler: it passes with 0 replan events (any trigger)."""
    rp = replans(events)
    return {"replans": len(rp), "pass": {"healthy": not rp},
            "replan_steps": [[e["step"], e.get("trigger"), adopted(e)] for e in rp],
            "tput": tput(rows, events, range(HEALTHY_FROM, 1 << 62)),
            "steps_run": max((r["step"] for r in rows), default=-1) + 1}


#: criterion -> (what the line says, True when higher is better)
CRITERIA = {
    "onset": (f"onset re-plan within {ONSET_STEPS} steps (worst onset per run; steps)", False),
    "vs_deepspeed": (f"adaptive / deepspeed while straggling >= {VS_DEEPSPEED}", True),
    "after": (f"after recovery+{RECOVERY_STEPS}: adaptive / its own healthy >= {AFTER}", True),
    "healthy": ("re-plans in a healthy run (target 0)", False),
}


def spread(values: Sequence[float | None], higher_better: bool) -> tuple:
    """(worst, median, best) of the runs' values; None (no value: the criterion could not be
    met, e.g. no re-plan) counts as the worst. The median of an even count is the worse of the
    two middle runs, so each of the three is a real run."""
    bad = float("-inf") if higher_better else float("inf")
    key = [bad if v is None else v for v in values]
    order = sorted(range(len(values)), key=lambda i: key[i], reverse=not higher_better)
    # order: worst first
    if not order:
        return None, None, None
    return (values[order[0]], values[order[(len(order) - 1) // 2]], values[order[-1]])


def verdict(results: Sequence[Mapping], criterion: str) -> bool:
    """A criterion passes only when every run passes it (and there is at least one run)."""
    return bool(results) and all(r["pass"][criterion] for r in results)


def fmt(v, criterion: str) -> str:
    if v is None:
        return "none" if criterion == "onset" else "n/a"
    if criterion in ("onset", "healthy"):
        return f"{v:g}"
    return f"{v:.2f}"
