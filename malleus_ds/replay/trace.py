"""A straggler trace: which GPU computes how many times slower, from when to when.

The file is a CSV with the header ``start_s,end_s,gpu,rate``. Each row says that GPU ``gpu``
(0 .. N-1) computes ``rate`` times slower from ``start_s`` to ``end_s``, in seconds since the
job started. Where rows overlap on one GPU, the largest rate holds. A user can write one from
their own monitoring; ``malleus-sim trace`` writes one from published statistics
(``regimes.py``).

:func:`read_csv` checks every row and names the first bad one (its line, the field and the
value); :meth:`Trace.segments` turns the rows into the piecewise-constant rate vectors a replay
steps through (a sweep over the rows' boundaries: 100,000 rows in well under a second).

Stdlib only.
"""
from __future__ import annotations

import csv
import heapq
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

HEADER = ("start_s", "end_s", "gpu", "rate")


class TraceError(ValueError):
    """A trace row or file that cannot be replayed; the message names the line and field."""


@dataclass(frozen=True)
class Event:
    """GPU ``gpu`` computes ``rate`` times slower in ``[start_s, end_s)``."""

    start_s: float
    end_s: float
    gpu: int
    rate: float


@dataclass(frozen=True)
class Segment:
    """A stretch of time with one rate per GPU (only GPUs slower than 1.0 are listed)."""

    start_s: float
    end_s: float
    rates: tuple[tuple[int, float], ...]      # (gpu, rate > 1), sorted by gpu

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    def rate_map(self) -> dict[int, float]:
        return dict(self.rates)


@dataclass(frozen=True)
class Trace:
    """The rows of one trace for a job of ``num_gpus`` GPUs over ``horizon_s`` seconds."""

    events: tuple[Event, ...]
    num_gpus: int
    horizon_s: float

    def segments(self) -> list[Segment]:
        """The horizon cut at every row boundary: each piece with the rates that hold in it
        (the largest where rows overlap on a GPU). Adjacent pieces with the same rates are
        merged, so a segment boundary is a change of some GPU's rate."""
        starts = sorted(self.events, key=lambda e: e.start_s)
        ends: list[tuple[float, int, float]] = []          # heap of (end_s, gpu, rate)
        active: dict[int, Counter] = {}
        cur: dict[int, float] = {}
        out: list[Segment] = []
        t, i = 0.0, 0

        def close(upto: float) -> None:
            if upto <= t:
                return
            rates = tuple(sorted((g, r) for g, r in cur.items() if r > 1.0))
            if out and out[-1].rates == rates and out[-1].end_s == t:
                out[-1] = Segment(out[-1].start_s, upto, rates)
            else:
                out.append(Segment(t, upto, rates))

        def refresh(g: int) -> None:
            c = active.get(g)
            if c:
                cur[g] = max(c)
            else:
                cur.pop(g, None)
                active.pop(g, None)

        while True:
            nxt = min(starts[i].start_s if i < len(starts) else self.horizon_s,
                      ends[0][0] if ends else self.horizon_s, self.horizon_s)
            close(nxt)
            t = nxt
            if t >= self.horizon_s:
                break
            while ends and ends[0][0] <= t:
                _, g, r = heapq.heappop(ends)
                active[g][r] -= 1
                if active[g][r] == 0:
                    del active[g][r]
                refresh(g)
            while i < len(starts) and starts[i].start_s <= t:
                e = starts[i]
                i += 1
                active.setdefault(e.gpu, Counter())[e.rate] += 1
                heapq.heappush(ends, (e.end_s, e.gpu, e.rate))
                refresh(e.gpu)
        return out


def read_csv(path: str | Path, num_gpus: int, hours: float | None = None) -> Trace:
    """Read and check a trace for a job of ``num_gpus`` GPUs. ``hours``: the replay's length
    (a row ending after it is an error); None: the last row's end."""
    p = Path(path)
    try:
        f = p.open(newline="")
    except OSError as e:
        raise TraceError(f"{p}: cannot read the trace: {e.strerror or e}") from None
    with f:
        rows = csv.reader(f)
        head = next(rows, None)
        if head is None or tuple(h.strip() for h in head) != HEADER:
            raise TraceError(f"{p}:1: the header must be {','.join(HEADER)}, got "
                             f"{','.join(head) if head else 'an empty file'}")
        events = list(parse_rows(rows, num_gpus, where=str(p), first_line=2))
    return make_trace(events, num_gpus, hours, where=str(p))


def parse_rows(rows: Iterable[list[str]], num_gpus: int, where: str = "trace",
               first_line: int = 1) -> Iterator[Event]:
    """Events from CSV rows (no header), each checked; errors name ``where:line``."""
    for n, row in enumerate(rows, start=first_line):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 4:
            raise TraceError(f"{where}:{n}: {len(row)} fields, need 4 ({','.join(HEADER)})")
        vals = {}
        for name, raw in zip(HEADER, row):
            try:
                vals[name] = float(raw)
            except ValueError:
                raise TraceError(f"{where}:{n}: {name}={raw.strip()!r} is not a number") from None
            if not math.isfinite(vals[name]):
                raise TraceError(f"{where}:{n}: {name}={raw.strip()} must be finite")
        g = vals["gpu"]
        if g != int(g) or not 0 <= g < num_gpus:
            raise TraceError(f"{where}:{n}: gpu={row[2].strip()} is out of range: the job has "
                             f"{num_gpus} GPUs (0..{num_gpus - 1})")
        if vals["start_s"] < 0:
            raise TraceError(f"{where}:{n}: start_s={vals['start_s']:g} must be >= 0")
        if not vals["end_s"] > vals["start_s"]:
            raise TraceError(f"{where}:{n}: end_s={vals['end_s']:g} must be after "
                             f"start_s={vals['start_s']:g}")
        if not vals["rate"] >= 1.0:
            raise TraceError(f"{where}:{n}: rate={vals['rate']:g} must be >= 1 (1 = healthy, "
                             f"2 = twice as slow)")
        yield Event(vals["start_s"], vals["end_s"], int(g), vals["rate"])


def make_trace(events: list[Event], num_gpus: int, hours: float | None = None,
               where: str = "trace") -> Trace:
    """A :class:`Trace` over ``hours`` (None: up to the last row's end)."""
    last = max((e.end_s for e in events), default=0.0)
    if hours is None:
        if last <= 0:
            raise TraceError(f"{where}: no rows, and no --hours to replay a healthy job for")
        return Trace(tuple(events), num_gpus, last)
    if not hours > 0:
        raise TraceError(f"--hours={hours:g} must be > 0")
    horizon = hours * 3600.0
    if last > horizon + 1e-9:
        late = max(events, key=lambda e: e.end_s)
        raise TraceError(f"{where}: a row ends at {late.end_s:g} s (gpu {late.gpu}), after "
                         f"--hours={hours:g} ({horizon:g} s): the trace is longer than the replay")
    return Trace(tuple(events), num_gpus, horizon)


def write_csv(events: Iterable[Event], path: str | Path) -> int:
    """Write ``events`` as a trace CSV; returns the number of rows."""
    n = 0
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for e in events:
            w.writerow([f"{e.start_s:.3f}", f"{e.end_s:.3f}", e.gpu, f"{e.rate:.4g}"])
            n += 1
    return n
