#!/usr/bin/env python
"""Summarise training runs side by side: one row per run folder (a folder of run folders, e.g. a
``--multirun`` sweep or a compare run, expands to them), with its overrides, median step time,
throughput and ratio to the first; then each run's what-if account (``malleus_ds/report/whatif.py``:
per straggler phase the healthy, static-layout, bound and achieved throughput, the seconds lost
to detection and migrations, and one line: what the stragglers would have cost a static job,
what they cost this run, the bound).

    python launch/train.py --multirun experiment=straggler_sweep hydra.sweep.dir=multirun/s \\
        'straggler.schedule=[],[{rank:1,rate:2.0}],[{rank:1,rate:4.0}]'
    python launch/summarize.py multirun/s

Without an emulated schedule the straggler phases come from the measured rates read as the
adaptive loop reads them (``malleus_ds/report/phases.py``: each rank's median over 5 steps, below 1.2
healthy, at least 7 steps long), so a healthy run's noisy steps are no straggler.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from malleus_ds.report.metrics import METRICS_FILE, MetricsError, read_run  # noqa: E402
from malleus_ds.report.run_folder import find_runs, read_overrides  # noqa: E402
from malleus_ds.report.whatif import WhatIfError, account_of_run, format_account  # noqa: E402


class InputError(Exception):
    """A path this tool cannot use (no such folder, not a folder); the message names it. A bad
    metrics.jsonl is a ``metrics.MetricsError``, whose message names the file and line."""


def run_dirs(paths: list[str]) -> list[Path]:
    """The run folders of ``paths`` (``run_folder.find_runs``: a run folder, or every run folder
    below a folder, e.g. a sweep's jobs), in order; a metrics.jsonl stands for its folder."""
    out = []
    for p in map(Path, paths):
        if p.is_file() and p.name == METRICS_FILE:
            p = p.parent
        if not p.exists():
            raise InputError(f"{p}: no such folder")
        if not p.is_dir():
            raise InputError(f"{p}: not a folder (give a run folder or a --multirun sweep folder)")
        out += find_runs(p)
    return out


def overrides(d: Path) -> str:
    """The run's overrides (``run_folder.read_overrides``) but ``hydra.*`` and
    ``nproc_per_node``, space-separated; "" without any."""
    return " ".join(x for x in read_overrides(d) or ()
                    if not x.startswith(("hydra.", "nproc_per_node=")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run folders or sweep folders")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out")
    a = ap.parse_args(argv)
    try:
        rows = table(a.paths, a.skip)
    # MetricsError: a metrics.jsonl that cannot be read or holds a bad line (named in it);
    # OSError: e.g. a folder we may not list
    except (InputError, MetricsError, OSError) as e:
        print(f"summarize: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"no step lines after the first {a.skip} (--skip) in a metrics.jsonl of "
              f"{a.paths}", file=sys.stderr)
        return 1
    base = rows[0][4]
    print(f"{'run':28s} {'steps':>5s} {'median step':>11s} {'samples/s':>10s} {'vs first':>8s}  overrides")
    for d, ov, n, med, tput, _ in rows:
        print(f"{str(d)[-28:]:28s} {n:5d} {med:10.3f}s {tput:10.1f} {tput / base:7.2f}x  {ov}")
    for d, *_, account in rows:
        print(f"\n{d}:")
        print(account)
    return 0


def whatif(d: Path, skip: int, lines: tuple[list[dict], list[dict]]) -> str:
    """The what-if account of run folder ``d`` from its (step lines, event lines) ``lines``
    (its layout from ``.hydra/config.yaml``)."""
    try:
        return format_account(account_of_run(d, skip, lines=lines))
    except WhatIfError as e:
        return f"  what-if: {e}"


def table(paths: list[str], skip: int) -> list[tuple]:
    """One row per run with step lines after ``skip``: (folder, overrides, steps, median step
    time, samples/s, what-if text); each metrics.jsonl is read once (``metrics.read_run``)."""
    rows = []
    for d in run_dirs(paths):
        steps, events = read_run(d)
        recs = [r for r in steps if r["step"] >= skip]
        if not recs:
            continue
        med = statistics.median(r["step_time_s"] for r in recs)
        rows.append((d, overrides(d), len(recs), med, recs[0]["samples"] / med,
                     whatif(d, skip, (steps, events))))
    return rows


if __name__ == "__main__":
    sys.exit(main())
