"""The one model of a run that every report reads a metrics.jsonl through (``metrics.py``'s
phases, ``compare.py``, ``whatif.py``, ``plot_data.py``): how many ranks it had, where its
emulated straggler condition changes, and its throughput over a set of steps. Pure: step and
event lines in (as ``metrics.read_run`` gives them), numbers out; no numpy, no torch.

**Ranks.** :func:`world_of`: the widest ``compute_s`` or ``measured_rates`` of any step line,
or the highest rank ``emulated_rates`` names + 1, whichever is larger. Every runner writes
``compute_s`` for every rank (gathered each step) and ``measured_rates`` for every rank, and the
emulation may slow only a rank that exists (``StragglerSchedule.parse`` checks), so on a file a
runner wrote the three agree; the rule takes the largest so that a file missing one of them
(hand-written, or from before ``compute_s``) still counts every rank it names.

**Conditions.** A step's emulated condition (:func:`emulated_condition`) is its
``emulated_rates`` as ``((rank, rate), ...)`` sorted by rank, ``()`` when healthy; it is what
the experiment configured, so its onsets are exact and measurement noise cannot move them.
:func:`stretches` cuts any sequence of keys into maximal runs of equal consecutive keys: the
compare report's segments (key: the condition), the run summary's phases (the condition and the
plan), the what-if account's emulated phases (the condition at or above ``HEALTHY``) and the
plot's shaded regions (any straggler active) are all such runs. (A run split by its *measured*
rates is ``phases.rate_phases``'s, which smooths and confirms before it cuts.)

**Throughput.** :func:`throughput`: the samples of a set of steps over their step times plus
the seconds of the ``migrate`` events whose ``step`` (the step a migration ran before) lies
between the first and the last of them: what the job did over those steps, switches included.
Called without events it is samples over step time alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

__all__ = ["Stretch", "Throughput", "emulated_condition", "emulated_rates", "events_in",
           "step_lines", "stretches", "throughput", "world_of"]


def step_lines(records: Iterable[Mapping]) -> list[Mapping]:
    """The step lines among ``records`` (event lines, those with an ``"event"`` key, left out),
    in order."""
    return [r for r in records if "event" not in r]


def emulated_rates(rec: Mapping) -> Mapping[str, float]:
    """A step line's emulated rates (``rates`` in files from before the rename; ``metrics.py``)."""
    return rec.get("emulated_rates", rec.get("rates")) or {}


def emulated_condition(rec: Mapping, healthy: float | None = None) -> tuple[tuple[int, float], ...]:
    """A step line's emulated straggler condition: ``((rank, rate), ...)`` sorted by rank, ``()``
    when healthy. ``healthy``: leave out the rates below it (the what-if account counts a rate
    below ``HEALTHY`` as healthy); None keeps every rate the line names."""
    return tuple(sorted((int(k), float(v)) for k, v in emulated_rates(rec).items()
                        if healthy is None or float(v) >= healthy))


@dataclass(frozen=True)
class Stretch:
    """Items ``lo <= i < hi`` of the input, all with the same ``key``."""

    key: Hashable
    lo: int
    hi: int


def stretches(keys: Iterable[Hashable]) -> list[Stretch]:
    """Maximal runs of equal consecutive ``keys``, in order: consecutive, covering every item;
    ``[]`` for no keys. Key item ``i`` of a sequence (its step line's condition, say), then slice
    the sequence with each stretch's ``lo:hi``."""
    out: list[Stretch] = []
    for i, k in enumerate(keys):
        if out and out[-1].key == k:
            out[-1] = Stretch(k, out[-1].lo, i + 1)
        else:
            out.append(Stretch(k, i, i + 1))
    return out


def events_in(events: Iterable[Mapping], lo: float, hi: float, *kinds: str) -> list[Mapping]:
    """The event lines of these ``kinds`` whose numeric ``step`` lies in ``lo..hi`` (inclusive),
    in order."""
    return [e for e in events if e.get("event") in kinds
            and isinstance(e.get("step"), (int, float)) and lo <= e["step"] <= hi]


@dataclass(frozen=True)
class Throughput:
    """What a job did over a set of steps: samples, step seconds and migration seconds."""

    steps: int
    samples: float
    step_s: float             # the steps' step_time_s, added up
    migrate_s: float          # the seconds of the migrations before these steps

    @property
    def seconds(self) -> float:
        return self.step_s + self.migrate_s

    @property
    def samples_per_s(self) -> float:
        """Samples over seconds, migrations included (0.0 when no time passed)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def throughput(steps: Sequence[Mapping], events: Iterable[Mapping] = (),
               lo: float | None = None, hi: float | None = None) -> Throughput:
    """The throughput of step lines ``steps`` (module docstring): their samples and step times,
    and the seconds of the ``migrate`` events among ``events`` whose ``step`` lies in
    ``lo..hi``: by default the first and the last of ``steps`` (in file order, so ascending),
    a segment's bounds where the caller has them. A migrate line without ``seconds`` counts 0."""
    if steps and lo is None:
        lo = steps[0]["step"]
    if steps and hi is None:
        hi = steps[-1]["step"]
    mig = [] if lo is None or hi is None else events_in(events, lo, hi, "migrate")
    return Throughput(len(steps), float(sum(float(r["samples"]) for r in steps)),
                      float(sum(float(r["step_time_s"]) for r in steps)),
                      sum(float(e.get("seconds") or 0.0) for e in mig))


def world_of(steps: Iterable[Mapping], least: int = 1) -> int:
    """Ranks in the run (module docstring): the widest ``compute_s`` / ``measured_rates`` of a
    step line, or the highest rank its ``emulated_rates`` name + 1; event lines are skipped.
    ``least``: the answer for lines that name no rank at all (the oldest files: step, samples
    and step time only): 1 where ranks are counted (a job ran on one at least; the compare
    bound and the what-if account divide by it), 0 for ``malleus-plot``'s data, which has no
    per-rank series to draw then."""
    steps = step_lines(steps)
    return max([len(r.get(k) or ()) for r in steps for k in ("compute_s", "measured_rates")]
               + [int(k) + 1 for r in steps for k in emulated_rates(r)] + [least])
