"""``--from-run`` against a set of recorded runs (issue 33, item 3): for each engine=malleus run
folder, the replay built from its own files predicts samples/s per phase of its straggler
schedule (``malleus_ds/replay/from_run.py``), set against what the run measured.

    .venv/bin/python bench/bench_from_run.py RUN_DIR... [--bound 0.15] [--json OUT]

A set as bench/RESULTS.md measures it: 8 demo runs and a ``bench_adaptive.py`` round, recorded
on a quiet machine::

    for i in 1 2 3 4 5 6 7 8; do
      python launch/train.py experiment=demo compare=[] hydra.run.dir=runs/d$i; done
    python bench/bench_adaptive.py --repeat 2 --schedule all --no-healthy --out runs/ba
    python bench/bench_from_run.py runs/d? runs/ba/*/adaptive*

Prints one row per run (each phase's error after the first, healthy one: predicted over
measured, less one), then how many runs are within the bound in every phase, how many phases
are, and the mean and median |error|. Runs the replay cannot read (an engine=deepspeed folder)
are named and skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from malleus_ds.replay.from_run import FromRunError, build, compare  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (engine=malleus)")
    ap.add_argument("--bound", type=float, default=0.15, help="|error| per phase (0.15: 15%%)")
    ap.add_argument("--json", help="write {run: [phase errors]} here")
    a = ap.parse_args(argv)
    rows = {}
    for run in a.runs:
        try:
            res = compare(build(run))
        except FromRunError as e:
            print(f"skipped: {e}", file=sys.stderr)
            continue
        errs = [p["error"] for p in res["phases"][1:] if p["error"] is not None]
        rows[run] = errs
        miss = "  MISS" if any(abs(e) > a.bound for e in errs) else ""
        print(f"{run:<44} switches {res['switches']:2d}  "
              + " ".join(f"{e:+7.1%}" for e in errs) + miss, flush=True)
    if not rows:
        print("no run could be replayed", file=sys.stderr)
        return 2
    errs = [abs(e) for es in rows.values() for e in es]
    ok = sum(all(abs(e) <= a.bound for e in es) for es in rows.values())
    near = sum(e <= a.bound for e in errs)
    print(f"runs within {a.bound:.0%} in every phase: {ok} / {len(rows)}; phases: {near} / "
          f"{len(errs)}; |error| mean {statistics.mean(errs):.1%}, median "
          f"{statistics.median(errs):.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
