"""One straggler schedule under several engines, side by side (``compare=[deepspeed,malleus]``).

``launch/train.py`` runs the same config once per engine, each in ``RUN_DIR/<engine>/``; this
module reads their metrics.jsonl files and says what the straggler cost each engine:

* the schedule is cut into **segments**: runs of consecutive steps with the same emulated rates
  (``healthy``, ``rank 1 at rate 3``, ``rank 1 at rate 6``, ``healthy`` again);
* per segment and engine: samples/s over *every* step of the segment (detection steps included)
  plus the seconds of the migrations before those steps, and its ratio to that engine's own first
  healthy segment (warm-up steps left out);
* the **capacity bound** per segment, ``f = mean over ranks of 1/rate`` (``cost.capacity_of_rates``):
  no re-layout of the same work can keep more than ``f`` times the healthy throughput;
* one closing line: the seconds the straggler cost the first engine (its time over the straggler
  segments minus the same steps at its healthy pace), and how many of them each other engine won
  back, next to what a perfect re-layout (the bound) would win back;
* per engine, its what-if line (``whatif.py``): the share of its run the stragglers would have
  cost a static job, what they cost it, and the bound.

Segments follow the emulated schedule (the same for every engine, exact onsets), never the
measured rates, so measurement noise cannot make one; a run without a schedule is split by its
measured rates only in the what-if lines, by ``phases.py``'s rule (the loop's smoothed reading).
The split, a segment's throughput and the ranks the bound spreads over (``run_model.world_of``)
are ``run_model.py``'s, as in every report.

Everything here is pure (records in, numbers and text out) except :func:`report`, which reads the
folders and draws the ``malleus-plot`` PNG.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..cost import capacity_of_rates
from .metrics import MetricsError, read_run
from .run_model import emulated_condition, events_in, step_lines, stretches, throughput, world_of

#: engines ``compare`` accepts (each runs the whole config once)
COMPARABLE = ("deepspeed", "malleus", "torch")


@dataclass(frozen=True)
class Segment:
    """Steps ``first..last`` (inclusive) that ran with the same emulated ``rates``."""

    first: int
    last: int
    rates: tuple[tuple[int, float], ...]      # ((rank, rate), ...); () = healthy

    @property
    def label(self) -> str:
        return ", ".join(f"rank {r} at rate {x:g}" for r, x in self.rates) or "healthy"

    @property
    def healthy(self) -> bool:
        return not self.rates


@dataclass(frozen=True)
class SegmentStats:
    """One engine over one segment (after warm-up)."""

    steps: int
    samples: float
    seconds: float            # step times + migrations before these steps
    switches: int             # re-plans adopted (plan switches)
    migrate_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Comparison:
    names: tuple[str, ...]                          # engines, in run order (the first = baseline)
    world: int
    segments: tuple[Segment, ...]
    stats: tuple[tuple[SegmentStats, ...], ...]     # [engine][segment]
    bound: tuple[float, ...]                        # f per segment
    warmup: int


def segments(records: Sequence[Mapping]) -> list[Segment]:
    """Consecutive step lines with equal emulated rates, in order (event lines are skipped):
    the stretches of ``run_model.emulated_condition`` (every rate the line names)."""
    steps = step_lines(records)
    return [Segment(int(steps[st.lo]["step"]), int(steps[st.hi - 1]["step"]), st.key)
            for st in stretches(emulated_condition(r) for r in steps)]


def segment_stats(records: Sequence[Mapping], events: Sequence[Mapping], lo: int, hi: int
                  ) -> SegmentStats:
    """Throughput of steps ``lo..hi`` (inclusive; ``run_model.throughput``): every step line,
    plus the migrations whose ``step`` (the step they ran before) lies in the range; and the
    adopted re-plans there."""
    tp = throughput([r for r in step_lines(records) if lo <= r["step"] <= hi], events, lo, hi)
    return SegmentStats(steps=tp.steps, samples=tp.samples, seconds=tp.seconds,
                        switches=sum(1 for e in events_in(events, lo, hi, "replan")
                                     if e.get("adopted")),
                        migrate_s=tp.migrate_s)


class CompareError(ValueError):
    """The runs cannot be compared (different schedules, a run without steps, a bad
    metrics.jsonl)."""


def compare(runs: Sequence[tuple[str, Sequence[Mapping], Sequence[Mapping]]], warmup: int
            ) -> Comparison:
    """``runs``: (name, step lines, event lines) per engine, all of the same schedule."""
    if len(runs) < 1:
        raise CompareError("nothing to compare")
    segs = None
    for name, recs, _ in runs:
        s = segments(recs)
        if not s:
            raise CompareError(f"run {name} has no step lines")
        if segs is None:
            segs = s
        elif [(g.first, g.last, g.rates) for g in s] != [(g.first, g.last, g.rates) for g in segs]:
            raise CompareError(f"run {name} ran another straggler schedule than {runs[0][0]}: "
                               f"{[g.label for g in s]} vs {[g.label for g in segs]}")
    world = max(world_of(r) for _, r, _ in runs)     # run_model.world_of: every rank named
    # warm-up steps count in no segment; a segment made only of warm-up steps is dropped
    segs = [Segment(max(g.first, warmup), g.last, g.rates) for g in segs if g.last >= warmup]
    stats = tuple(tuple(segment_stats(recs, evs, g.first, g.last) for g in segs)
                  for _, recs, evs in runs)
    bound = tuple(capacity_of_rates(dict(g.rates), world) for g in segs)
    return Comparison(tuple(n for n, _, _ in runs), world, tuple(segs), stats, bound, warmup)


def healthy_pace(c: Comparison, i: int) -> float | None:
    """Engine ``i``'s samples/s over the first healthy segment (None: the run had none)."""
    for g, st in zip(c.segments, c.stats[i]):
        if g.healthy and st.seconds > 0:
            return st.samples_per_s
    return None


def straggler_segments(c: Comparison) -> list[int]:
    return [k for k, g in enumerate(c.segments) if not g.healthy]


def no_straggler_note(rates_at, warmup: int, steps: int, world: int) -> str | None:
    """A note when ``rates_at(step, world)`` (the schedule's emulated rates) slows no rank in
    steps ``warmup..steps-1``: such a comparison can only show healthy throughput."""
    if any(rates_at(s, world) for s in range(warmup, steps)):
        return None
    return (f"straggler.schedule makes no straggler in steps {warmup}-{steps - 1} (after "
            f"train.warmup_steps={warmup}): the comparison will show healthy throughput only")


def format_table(c: Comparison) -> str:
    """Per segment: the bound and, per engine, samples/s and the ratio to its healthy pace
    (plus, for engine=malleus, the plans it switched to and the migration seconds)."""
    lab_w = max([16] + [len(g.label) for g in c.segments])
    cols = [(n, 23 + (20 if n == "malleus" else 0)) for n in c.names]
    top = f"  {'':{lab_w}s} {'':>7s} {'bound':>7s}" + "".join(
        f" | {n:{w}s}" for n, w in cols)
    head = f"  {'phase':{lab_w}s} {'steps':>7s} {'f':>7s}" + "".join(
        f" | {'samples/s':>10s} {'vs healthy':>12s}" + (f" {'switches':>9s} {'migrate s':>10s}"
                                                         if n == "malleus" else "")
        for n, _ in cols)
    lines = [top.rstrip(), head]
    pace = [healthy_pace(c, i) for i in range(len(c.names))]
    for k, g in enumerate(c.segments):
        row = f"  {g.label:{lab_w}s} {f'{g.first}-{g.last}':>7s} {c.bound[k]:6.2f}x"
        for i, n in enumerate(c.names):
            st = c.stats[i][k]
            rel = f"{st.samples_per_s / pace[i]:11.2f}x" if pace[i] else f"{'-':>12s}"
            row += f" | {st.samples_per_s:10.1f} {rel}"
            if n == "malleus":
                row += f" {st.switches:9d} {st.migrate_s:10.3f}"
        lines.append(row)
    return "\n".join(lines)


def closing_line(c: Comparison) -> str:
    """What the straggler cost the first engine, and how much of it each other engine won back."""
    strag = straggler_segments(c)
    base = c.names[0]
    pace0 = healthy_pace(c, 0)
    if not strag:
        return ("no straggler ran: straggler.schedule has no entry active within train.steps "
                "(after the warm-up), so there was nothing to win back; the table shows healthy "
                "throughput only")
    if not pace0:
        return (f"no healthy steps after the warm-up in the {base} run: start the straggler "
                f"later than train.warmup_steps to measure what it costs")
    spans: list[list[int]] = []          # consecutive straggler segments as one span
    for k in strag:
        g = c.segments[k]
        if spans and spans[-1][1] + 1 == g.first:
            spans[-1][1] = g.last
        else:
            spans.append([g.first, g.last])
    span = ", ".join(f"{a}-{b}" for a, b in spans)
    samples = sum(c.stats[0][k].samples for k in strag)
    t_base = sum(c.stats[0][k].seconds for k in strag)
    t_healthy = samples / pace0
    lost = t_base - t_healthy
    t_bound = sum(c.stats[0][k].samples / (pace0 * c.bound[k]) for k in strag)
    out = (f"the straggler (steps {span}) cost {base} {lost:.1f} s ({t_base:.1f} s instead of "
           f"{t_healthy:.1f} s at its healthy pace)")
    if lost <= 0:
        return out + "; nothing to win back"
    for i in range(1, len(c.names)):
        t = sum(c.stats[i][k].seconds for k in strag)
        won = t_base - t
        out += f"; {c.names[i]} won back {won:.1f} s of it ({100 * won / lost:.0f}%)"
    out += (f"; a perfect re-layout (the capacity bound) would win back "
            f"{t_base - t_bound:.1f} s ({100 * (t_base - t_bound) / lost:.0f}%)")
    return out


def format_comparison(c: Comparison) -> str:
    warm = f"; warm-up steps 0-{c.warmup - 1} left out" if c.warmup else ""
    return "\n".join([
        f"== compare: one straggler schedule under {' and '.join(c.names)}, {c.world} rank(s)",
        format_table(c),
        f"  samples/s: every step of the phase, migrations included{warm}; vs healthy: to the "
        f"engine's own first healthy phase",
        "  bound f = mean over ranks of 1/rate: the share of healthy throughput a perfect "
        "re-layout could keep",
        f"  {closing_line(c)}"])


def whatif_lines(root: Path, names: Sequence[str], warmup: int) -> str:
    """Each engine's what-if line (``whatif.py``): measured against its own healthy pace."""
    from .whatif import WhatIfError, account_of_run, closing_line as whatif_line

    out = []
    for n in names:
        try:
            line = whatif_line(account_of_run(root / n, warmup))
        except WhatIfError as e:
            line = str(e)
        out.append(f"  what-if, {n}: {line}")
    return "\n".join(out)


def report(run_dir: str | Path, names: Sequence[str], warmup: int) -> tuple[str, Path | None]:
    """Compare the runs in ``run_dir/<name>/`` and draw them into ``run_dir/throughput.png``.
    Returns the text and the PNG's path (None when drawing failed; the text says why). A bad
    metrics.jsonl (``metrics.read_run``) is a CompareError naming the file and line."""
    from . import plot, plot_data

    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)   # no font-cache chatter
    root = Path(run_dir)
    try:    # no step lines is no error here: compare() says which run has none
        runs = [(n, *read_run(root / n)) for n in names]
    except MetricsError as e:
        raise CompareError(str(e)) from None
    text = format_comparison(compare(runs, warmup)) + "\n" + whatif_lines(root, names, warmup)
    try:
        data = [plot_data.load_run_data(root / n, name=f"engine={n}") for n in names]
        png = plot.draw(data, root / plot.DEFAULT_OUTPUT,
                        f"{root.name}: {' vs '.join(names)}, one straggler schedule")
    except Exception as e:  # noqa: BLE001 - the numbers stand without the picture
        return text + f"\n  (no plot: {e})", None
    return text, png
