"""``malleus-plot``: throughput, straggler phases, re-plan/migrate events and plan checks of a run,
as one PNG.

    malleus-plot RUN_DIR [-o FILE.png] [--window N]

``RUN_DIR`` is a run folder (it holds ``metrics.jsonl``) or a Hydra ``--multirun`` sweep folder
(run folders below it, e.g. ``0/``, ``1/``, ...; found by their ``metrics.jsonl``:
``run_folder.find_runs``).

The data side (reading metrics, per-step arrays, straggler regions, events, job labels) is pure
and lives in ``plot_data.py``, so it can be tested without looking at pixels.

Bad input (missing folder, no metrics.jsonl, a corrupt line, a file without step lines) prints
``malleus-plot: error: ...`` on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from . import whatif
from .plot_data import (
    Event,
    PlotError,
    Region,
    RunData,
    emulated_rate_series,
    link_regions,
    load_runs,
    rolling_median,
    straggler_regions)
from ..adaptive.detect import HEALTHY

PROG = "malleus-plot"
EXIT_BAD_INPUT = 2
DEFAULT_OUTPUT = "throughput.png"
FIGSIZE = (11.0, 7.0)
FIGSIZE_ONE_PANEL = (11.0, 5.0)
DPI = 120


# --------------------------------------------------------------------------------------------
# drawing

def _draw_whatif(ax, run: RunData) -> None:
    """Per straggler phase of ``run``: dotted lines at what a static layout would have kept and
    at the capacity bound (whatif.py)."""
    a = run.whatif
    for k, p in enumerate(p for p in (a.phases if a else ()) if p.slow):
        x = (p.first - 0.5, p.last + 0.5)
        ax.plot(x, [p.static] * 2, color="0.25", ls=":", lw=1.6, zorder=3,
                label="static layout (what-if)" if k == 0 else None)
        ax.plot(x, [p.bound] * 2, color="tab:orange", ls="-.", lw=1.4, zorder=3,
                label="capacity bound" if k == 0 else None)



REPLAN_COLOR = "tab:purple"
MIGRATE_COLOR = "tab:green"
STRAGGLER_COLOR = "tab:red"
LINK_COLOR = "tab:blue"        # a slow link (whatif.link_state)
MISSED_COLOR = "crimson"       # a plan check that missed its promise (pace_check.py)
KEPT_COLOR = "0.45"            # ... that kept it: a small hollow mark, no line, no label
MISSED_LS = (0, (2, 2))


def _event_color(ev: Event, color=None):
    if color:
        return color
    if ev.kind == "check":
        return MISSED_COLOR if ev.missed else KEPT_COLOR
    return REPLAN_COLOR if ev.kind == "replan" else MIGRATE_COLOR


def _rank_colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _place_event_labels(fig, ax, items, max_rows: int = 4, top: float = 0.985) -> float:
    """Write event labels near the top of ``ax``: ``items`` = (x, text, ha, color). A label that
    would overlap one already placed goes one row lower (at most ``max_rows`` rows; labels that
    fit nowhere are dropped, their lines stay). Returns the lowest label edge (axes fraction)."""
    from matplotlib.transforms import blended_transform_factory

    if not items:
        return 1.0
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    renderer = fig.canvas.get_renderer()
    axbb = ax.get_window_extent(renderer)
    texts = []
    for x, s, ha, color in sorted(items, key=lambda t: t[0]):
        t = ax.text(x, top, s, transform=trans, ha=ha, va="top", fontsize=7.5, color=color,
                    zorder=5, bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none",
                                        alpha=0.85))
        bb = t.get_window_extent(renderer)
        if bb.x1 > axbb.x1 - 2 and ha == "left":        # keep inside the axes
            t.set_ha("right")
        elif bb.x0 < axbb.x0 + 2 and ha == "right":
            t.set_ha("left")
        texts.append(t)
    boxes = [t.get_window_extent(renderer) for t in texts]
    row_h = (max(b.height for b in boxes) + 6) / axbb.height
    rows: list[list[tuple[float, float]]] = []
    used = 0
    for t, b in zip(texts, boxes):
        lo, hi = b.x0 - 4, b.x1 + 4
        for r in range(max_rows):
            if r == len(rows):
                rows.append([])
            if all(hi <= a or lo >= z for a, z in rows[r]):
                rows[r].append((lo, hi))
                t.set_y(top - r * row_h)
                used = max(used, r + 1)
                break
        else:
            t.remove()
    return top - used * row_h


def _headroom(ax, data_max: float, lowest_label: float, bottom: float = 0.0) -> None:
    """y limits so that the data stays below the event labels."""
    if not np.isfinite(data_max) or data_max <= bottom:
        return
    frac = max(0.45, lowest_label - 0.03)
    ax.set_ylim(bottom, bottom + (data_max - bottom) / frac)


def _shade(ax, regions: Sequence[Region], labels: bool, color=STRAGGLER_COLOR,
           text_color="darkred", y: float = 0.03) -> None:
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for reg in regions:
        ax.axvspan(reg.start - 0.5, reg.end - 0.5, color=color, alpha=0.10, lw=0, zorder=0)
        if labels and reg.label:
            ax.text(reg.start - 0.3, y, reg.label, transform=trans, ha="left", va="bottom",
                    fontsize=8, color=text_color, zorder=5,
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.7))


def _event_lines(ax, events: Sequence[Event], color=None, marker: bool = True) -> None:
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for ev in events:
        c = _event_color(ev, color)
        if ev.kind == "check":      # missed: a dashed line and an x on top; kept: a small o
            if ev.missed:
                ax.axvline(ev.step, color=c, ls=MISSED_LS, lw=1.1, alpha=0.85, zorder=3)
            if marker:
                ax.plot([ev.step], [1.0], transform=trans, clip_on=False, zorder=6,
                        **(dict(marker="X", ms=7, mec="white", mew=0.6, mfc=c) if ev.missed
                           else dict(marker="o", ms=4.5, mec=c, mfc="white", mew=1.0)))
        elif ev.kind == "replan":
            ax.axvline(ev.step, color=c, ls="--" if ev.adopted else ":", lw=1.2,
                       alpha=1.0 if ev.adopted else 0.7, zorder=3)
            if marker:
                ax.plot([ev.step], [1.0], transform=trans, marker="v", ms=7, clip_on=False,
                        mec=c, mfc=c if ev.adopted else "white", mew=1.3, zorder=6)
        else:
            ax.axvline(ev.step, color=c, ls="-", lw=1.2, zorder=3)


def _legend(ax, handles=None, **kw) -> None:
    kw.setdefault("fontsize", 8)
    if handles is not None:
        kw["handles"] = handles
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              frameon=False, **kw)


def _event_proxies(events: Sequence[Event], color=None) -> list:
    from matplotlib.lines import Line2D

    h = []
    if any(e.kind == "replan" and e.adopted for e in events):
        h.append(Line2D([], [], color=color or REPLAN_COLOR, ls="--", marker="v", ms=6,
                        label="replan"))
    if any(e.kind == "replan" and not e.adopted for e in events):
        h.append(Line2D([], [], color=color or REPLAN_COLOR, ls=":", marker="v", ms=6,
                        mfc="white", label="replan, not adopted"))
    if any(e.kind == "migrate" for e in events):
        h.append(Line2D([], [], color=color or MIGRATE_COLOR, ls="-", label="migrate"))
    missed = sum(e.missed for e in events)
    kept = sum(e.kind == "check" and not e.missed for e in events)
    if missed:
        h.append(Line2D([], [], color=color or MISSED_COLOR, ls=MISSED_LS, marker="X", ms=7,
                        mec="white", mew=0.6, label=f"plan check missed ({missed})"))
    if kept:
        h.append(Line2D([], [], color=color or KEPT_COLOR, ls="none", marker="o", ms=4.5,
                        mfc="white", label=f"plan check kept ({kept})"))
    return h


MAX_RANK_LINES = 12   # more ranks than this: only the slowed ones get a colour and a legend entry


def _highlighted_ranks(run: RunData, values: np.ndarray, threshold: float | None) -> list[int]:
    """Ranks drawn in colour: all of them for a small job, else those the emulation slowed or
    whose value ever crossed ``threshold``."""
    n = values.shape[1]
    if n <= MAX_RANK_LINES:
        return list(range(n))
    hot = {r for er in run.emulated_rates for r in er}
    if threshold is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            hot |= {d for d in range(n) if np.nanmax(values[:, d]) >= threshold}
    return sorted(d for d in hot if d < n)[:20]


def _rank_lines(ax, x, values: np.ndarray, hot: Sequence[int], colors, lw: float) -> None:
    others = [d for d in range(values.shape[1]) if d not in hot]
    for k, d in enumerate(others):
        ax.plot(x, values[:, d], color="0.6", lw=0.7, alpha=0.6, zorder=3,
                label=f"other ranks ({len(others)})" if k == 0 else None)
    for d in hot:
        ax.plot(x, values[:, d], color=colors[d], lw=lw, label=f"rank {d}", zorder=4)


def _bottom_panel(ax, run: RunData, regions: Sequence[Region], title: str | None) -> None:
    n = run.world_size
    _shade(ax, regions, labels=False)
    _event_lines(ax, run.events, color="0.55", marker=False)
    x = run.steps
    if run.measured_rates is not None:
        m = run.measured_rates
        hot = _highlighted_ranks(run, m, HEALTHY)
        if n <= MAX_RANK_LINES:
            colors = _rank_colors(n)
        else:    # colours for the highlighted ranks only, so they stay far apart
            ranks = hot + sorted({r for er in run.emulated_rates for r in er} - set(hot))
            colors = dict(zip(ranks, _rank_colors(len(ranks))))
        _rank_lines(ax, x, m, hot, colors, lw=1.6)
        emu = emulated_rate_series(run)
        for d, ys in emu.items():
            ax.step(x, ys, where="mid", color=colors[d], ls="--", lw=1.0, alpha=0.9, zorder=3)
        ax.axhline(HEALTHY, color="0.3", ls=":", lw=1.2,
                   label=f"healthy threshold ({HEALTHY:g})", zorder=2)
        from matplotlib.lines import Line2D

        handles, _ = ax.get_legend_handles_labels()
        if emu:
            handles.append(Line2D([], [], color="0.3", ls="--", lw=1.0,
                                  label="emulated rate (schedule)"))
        top = np.nanmax(np.concatenate([m.ravel()] + [v for v in emu.values()]
                                       + [np.array([HEALTHY])]))
        ax.set_ylim(0, top * 1.12 if np.isfinite(top) else 2.0)
        ax.set_ylabel("measured rate\n(1 = healthy)")
        _legend(ax, handles=handles, ncol=1 if len(handles) <= 12 else 2)
    else:
        c = run.compute_s
        hot = _highlighted_ranks(run, c, None)
        colors = _rank_colors(n) if n <= MAX_RANK_LINES else \
            dict(zip(hot, _rank_colors(len(hot))))
        _rank_lines(ax, x, c, hot, colors, lw=1.3)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("compute s")
        if c.shape[1]:
            _legend(ax)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    ax.grid(True, alpha=0.35)


def _throughput_lines(ax, runs: Sequence[RunData], window: int) -> tuple[float, list]:
    """Each run's throughput per step and its rolling median (one colour per job of a
    multirun), with its event lines; (the highest throughput, the event labels to place)."""
    single = len(runs) == 1
    data_max = 0.0
    job_colors = _rank_colors(len(runs))
    label_items = []
    for i, run in enumerate(runs):
        thr = run.throughput
        med = rolling_median(thr, window)
        if single:
            raw_c, med_c = "tab:blue", "tab:blue"
        else:
            raw_c = med_c = job_colors[i]
        ax.plot(run.steps, thr, color=raw_c, lw=0.8, alpha=0.4, zorder=2,
                label="per step" if single else None)
        lab = (f"rolling median ({window} steps)" if single else
               textwrap.fill(f"{run.name} ({run.mean_throughput:.1f}/s)", 42))
        ax.plot(run.steps, med, color=med_c, lw=2.2, zorder=4, label=lab)
        if np.isfinite(thr).any():
            data_max = max(data_max, float(np.nanmax(thr)))
        ev_color = None if single else job_colors[i]
        _event_lines(ax, run.events, color=ev_color)
        for ev in run.events:
            if ev.kind == "check" and not ev.missed:
                continue            # a kept promise: its mark and the legend's count only
            c = _event_color(ev, ev_color)
            # replan text to the left of its line, migrate (and a missed check) to the right:
            # the usual replan -> migrate pair one step apart then spreads apart
            label_items.append((ev.step, ev.label, "right" if ev.kind == "replan" else "left", c))
    return data_max, label_items


def _top_handles(ax, runs: Sequence[RunData], stragglers: bool, slow_links: bool) -> list:
    """The top panel's legend entries: its lines, the shaded regions, the event kinds."""
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    if stragglers:
        handles.append(Patch(color=STRAGGLER_COLOR, alpha=0.15, label="emulated straggler"))
    if slow_links:
        handles.append(Patch(color=LINK_COLOR, alpha=0.15, label="slow link"))
    all_events = [e for r in runs for e in r.events]
    handles += _event_proxies(all_events, color=None if len(runs) == 1 else "0.35")
    return handles


def draw(runs: Sequence[RunData], out: str | Path, title: str, window: int = 5) -> Path:
    """Write the figure for ``runs`` (one run, or a multirun's jobs) to ``out`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    single = len(runs) == 1
    with_rates = [r for r in runs if r.measured_rates is not None]
    bottom_run = runs[0] if single else (with_rates[0] if len(with_rates) == 1 else None)
    fig = Figure(figsize=FIGSIZE if bottom_run is not None else FIGSIZE_ONE_PANEL, dpi=DPI)
    FigureCanvasAgg(fig)
    if bottom_run is not None:
        ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        ax, ax2 = fig.subplots(1, 1), None
    regions = straggler_regions(runs)
    _shade(ax, regions, labels=True)
    lregions = link_regions(runs)
    _shade(ax, lregions, labels=True, color=LINK_COLOR, text_color="navy", y=0.10)
    data_max, label_items = _throughput_lines(ax, runs, window)
    if single:
        _draw_whatif(ax, runs[0])
    handles = _top_handles(ax, runs, bool(regions), bool(lregions))
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(True, alpha=0.35)
    steps_all = np.concatenate([r.steps for r in runs])
    ax.set_xlim(steps_all.min() - 0.5, steps_all.max() + 0.5)
    _legend(ax, handles=handles)
    line = whatif.closing_line(runs[0].whatif) if single and runs[0].whatif else None
    if line:
        title += "\n" + textwrap.fill(line, 110)
    ax.set_title(title, fontsize=11 if not line else 9.5, pad=10)  # room for the replan markers
    if ax2 is not None:
        sub = None if single else f"measured rates: {bottom_run.name}"
        _bottom_panel(ax2, bottom_run, straggler_regions([bottom_run]), sub)
        ax2.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    lowest = _place_event_labels(fig, ax, label_items)
    _headroom(ax, data_max, lowest)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def figure_title(root: Path, runs: Sequence[RunData]) -> str:
    name = root.resolve().name
    if len(runs) == 1:
        r = runs[0]
        return (f"{name}: mean {r.mean_throughput:.1f} samples/s over {len(r.steps)} steps")
    return f"{name}: {len(runs)} jobs"


# --------------------------------------------------------------------------------------------
# command


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Plot a training run's throughput and its straggler / re-plan / migrate history
            from RUN_DIR/metrics.jsonl as one PNG.

            Top panel: throughput per step (samples / step_time_s) as a thin line plus a bold
              rolling median; steps with an emulated straggler active shaded red and labelled
              ("rank 3 at rate 5"); re-plans as dashed vertical lines (a hollow marker: the new
              plan was not adopted), migrations as solid ones, each labelled with its trigger
              and planning time, or bytes moved and seconds taken; a plan check that missed
              the cost model's promise as a red dashed line with an x ("missed ×2.09": measured
              over promised step time), one that kept it as a small hollow circle on top.
            Bottom panel: each rank's measured rate (engine=malleus) with the emulated schedule
              of slowed ranks as thin dashed steps in the same colour and the healthy threshold
              (1.2) dotted; per-rank compute seconds when no rates were measured. Above 12
              ranks only slowed ranks (emulated, or measured >= 1.2) get a colour; the rest
              are grey.

            RUN_DIR may also be a Hydra --multirun sweep folder: one line per job (labelled by
            the overrides that differ between jobs), straggler shading over all jobs; the bottom
            panel only when exactly one job measured rates."""),
        epilog="Exit code 2 on bad input (missing folder, no metrics.jsonl, corrupt line).")
    ap.add_argument("run_dir", metavar="RUN_DIR",
                    help="run folder with metrics.jsonl, or a --multirun sweep folder")
    ap.add_argument("-o", "--output", metavar="FILE.png",
                    help=f"where to write the PNG (default: RUN_DIR/{DEFAULT_OUTPUT})")
    ap.add_argument("--window", type=int, default=5, metavar="N",
                    help="rolling-median window in steps (default 5)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.window < 1:
        print(f"{PROG}: error: --window={args.window} must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    root = Path(args.run_dir)
    try:
        runs = load_runs(root)
        out = Path(args.output) if args.output else root / DEFAULT_OUTPUT
        try:
            written = draw(runs, out, figure_title(root, runs), window=args.window)
        except OSError as e:
            raise PlotError(f"cannot write {out}: {e}") from None
    except PlotError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(written)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
