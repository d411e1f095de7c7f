#!/usr/bin/env python
"""The healthy premium, measured honestly: stock DeepSpeed and MalleusEngine, interleaved.

No straggler. Runs alternate ``deepspeed, static, adaptive, deepspeed, static, adaptive, ...``
(``--rounds`` of each, at least 5), the same 4-rank job as ``bench_adaptive.py`` (model, data,
batch), so a machine that slows down or speeds up during the bench moves every engine alike.
Per round the ratios to that round's DeepSpeed run; the report gives their median with the
spread (min-max) over rounds:

* ``adaptive / deepspeed``: what a user pays for Malleus on a healthy job (target >= 0.97);
* ``static / deepspeed``: the engine alone (``malleus.adaptive=false``: no timings gathered for
  the loop, no planner process, no probes);
* ``adaptive / static``: what the adaptive loop costs per step (rates, the detector, the plan
  check and the planner process that waits on rank 0; on a healthy run no rank probes).

Throughput is samples/s over steps ``[--skip, --steps)`` (warm-up left out); a healthy
adaptive run that re-planned is flagged (it must not).

    python bench/bench_premium.py --rounds 5          # ~10 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_adaptive import launch  # noqa: E402

from malleus_ds.report.metrics import read_metrics  # noqa: E402

ENGINES = ("deepspeed", "static", "adaptive")


def tput(d: Path, lo: int) -> float:
    rows = [r for r in read_metrics(d) if r["step"] >= lo]
    return sum(r["samples"] for r in rows) / sum(r["step_time_s"] for r in rows)


def summary(ratios: list[float]) -> str:
    return (f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
            f"max {max(ratios):.3f}, n={len(ratios)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = ap.parse_args()
    if a.rounds < 1 or a.steps <= a.skip + 2:
        raise SystemExit("--rounds must be >= 1 and --steps > --skip + 2")
    a.real = False
    out = Path(a.out or tempfile.mkdtemp(prefix="bench_premium_"))
    runs: list[dict] = []
    for k in range(a.rounds):
        row = {"round": k}
        for name in ENGINES:
            d = out / f"round{k}" / name
            ok, cmd, p = launch("healthy" if name == "adaptive" else name, d, "[]", a.steps, a)
            if not ok:
                print(" ".join(cmd), p.stdout[-3000:], p.stderr[-3000:], sep="\n")
                raise SystemExit(f"run {name} failed")
            row[name] = tput(d, a.skip)
            row[f"{name}_replans"] = sum(e["event"] == "replan"
                                         for e in read_metrics(d, events=True))
        runs.append(row)
        print(f"round {k}: " + ", ".join(f"{n} {row[n]:.1f} samples/s" for n in ENGINES)
              + f"; adaptive/deepspeed {row['adaptive'] / row['deepspeed']:.3f}", flush=True)
    ad_ds = [r["adaptive"] / r["deepspeed"] for r in runs]
    st_ds = [r["static"] / r["deepspeed"] for r in runs]
    ad_st = [r["adaptive"] / r["static"] for r in runs]
    replans = sum(r["adaptive_replans"] for r in runs)
    print(f"\nhealthy 4-rank job, {a.rounds} interleaved round(s) of {', '.join(ENGINES)}, "
          f"steps {a.skip}-{a.steps - 1}")
    print(f"  adaptive / deepspeed: {summary(ad_ds)} (target >= 0.97: "
          f"{'PASS' if statistics.median(ad_ds) >= 0.97 else 'FAIL'})")
    print(f"  static / deepspeed:   {summary(st_ds)}  (the engine)")
    print(f"  adaptive / static:    {summary(ad_st)}  (the adaptive loop)")
    print(f"  re-plans in the healthy adaptive runs: {replans} (target 0)")
    print(f"runs: {out}")
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    return 0 if statistics.median(ad_ds) >= 0.97 and replans == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
