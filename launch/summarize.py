#!/usr/bin/env python
"""Summarise training runs side by side: one row per run folder (a ``--multirun`` sweep folder
expands to its jobs), with its overrides, median step time, throughput and ratio to the first.

    python launch/train.py --multirun experiment=straggler_sweep hydra.sweep.dir=multirun/s \\
        'straggler.schedule=[],[{rank:1,rate:2.0}],[{rank:1,rate:4.0}]'
    python launch/summarize.py multirun/s
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from malleus_ds.metrics import METRICS_FILE, read_metrics  # noqa: E402


def run_dirs(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if (p / METRICS_FILE).is_file():
            out.append(p)
        else:  # a sweep folder: jobs are numbered sub-folders
            jobs = [d for d in p.iterdir() if (d / METRICS_FILE).is_file()]
            out += sorted(jobs, key=lambda d: (len(d.name), d.name))
    return out


def overrides(d: Path) -> str:
    f = d / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return ""
    lines = [ln[2:].strip() for ln in f.read_text().splitlines() if ln.startswith("- ")]
    return " ".join(x for x in lines if not x.startswith(("hydra.", "nproc_per_node=")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="run folders or sweep folders")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out")
    a = ap.parse_args(argv)
    rows = []
    for d in run_dirs(a.paths):
        recs = [r for r in read_metrics(d) if r["step"] >= a.skip]
        if not recs:
            continue
        med = statistics.median(r["step_time_s"] for r in recs)
        rows.append((d, overrides(d), len(recs), med, recs[0]["samples"] / med))
    if not rows:
        print("no metrics.jsonl found", file=sys.stderr)
        return 1
    base = rows[0][4]
    print(f"{'run':28s} {'steps':>5s} {'median step':>11s} {'samples/s':>10s} {'vs first':>8s}  overrides")
    for d, ov, n, med, tput in rows:
        print(f"{str(d)[-28:]:28s} {n:5d} {med:10.3f}s {tput:10.1f} {tput / base:7.2f}x  {ov}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
