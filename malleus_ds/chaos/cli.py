"""``malleus-chaos``: a fault campaign against a real multi-rank job (``malleus_ds/chaos/``).

    malleus-chaos --seeds 0-4                      # five seeds, every fault kind, 4 ranks
    malleus-chaos --seeds 7 --kinds kill,freeze    # one seed, two kinds
    malleus-chaos --seeds 0-49 --json chaos.json   # a long campaign, its table as JSON too

Each seed's schedule is printed before its run; at the end, one table row per seed (faults by
kind, restarts, plan switches, failed checkpoint saves, seconds, verdict), the faults done in
all, and for each failing seed what broke and the command that runs it again. Exit status 1 when
a seed failed.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from .schedule import KINDS, draw


def seeds_of(text: str) -> list[int]:
    """``"3"``, ``"0-4"`` or ``"1,5,9"`` (ranges allowed in the list)."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise SystemExit(f"malleus-chaos: --seeds {text!r}: numbers and ranges like 0-4 "
                             f"or 1,5,9") from None
        out += range(lo, hi + 1)
    return out


def table(rows: list[dict]) -> str:
    kinds = [k for k in KINDS if any(r["faults"].get(k) for r in rows)]
    head = f"{'seed':>5}  " + "  ".join(f"{k[:9]:>9}" for k in kinds) + \
        "  restarts  switches  failed saves  seconds  verdict"
    lines = [head]
    for r in rows:
        lines.append(f"{r['seed']:>5}  " + "  ".join(f"{r['faults'].get(k, 0):>9}" for k in kinds)
                     + f"  {r['restarts']:>8}  {r['switches']:>8}  {r['failed_saves']:>12}"
                     f"  {r['seconds']:>7.0f}  {'ok' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="malleus-chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-4", help="seeds: 3, 0-4 or 1,5,9 (default 0-4)")
    ap.add_argument("--world", type=int, default=4, help="ranks of the job (default 4)")
    ap.add_argument("--steps", type=int, default=36, help="steps of the job (default 36)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"fault kinds to draw from (default all: {','.join(KINDS)})")
    ap.add_argument("--faults", default="2-4", help="faults per run, a range (default 2-4)")
    ap.add_argument("--out", default="chaos", help="folder for the runs (default ./chaos)")
    ap.add_argument("--json", help="also write the table and every schedule as JSON here")
    a = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    lo, _, hi = a.faults.partition("-")
    from ..app.reference import reference_run
    from ..models import model_config
    from .run import Options, replay_line, run_one

    try:
        scheds = [draw(s, a.steps, a.world, kinds, (int(lo), int(hi or lo))) for s in
                  seeds_of(a.seeds)]
    except ValueError as e:
        print(f"malleus-chaos: {e}", file=sys.stderr)
        return 2
    ref, _ = reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=a.steps,
                           global_batch_size=8, micro_batch_size=1)
    rows, done = [], Counter()
    for sched in scheds:
        print("\n".join(sched.lines()), flush=True)
        v, injections = run_one(sched, Path(a.out) / f"seed{sched.seed}", list(ref), Options(),
                                say=lambda m: print(m, flush=True))
        done.update(i.fault.kind for i in injections if i.done)
        done.update(f.kind for f in sched.at_launch())
        rows.append({"seed": sched.seed, "faults": dict(Counter(f.kind for f in sched.faults)),
                     "restarts": v.restarts, "switches": v.switches,
                     "failed_saves": v.failed_saves, "seconds": round(v.seconds, 1),
                     "ok": v.ok, "broken": v.broken, "schedule": sched.json(),
                     "not_done": [f"{i.fault.kind}: {i.note}" for i in injections
                                  if not i.done]})
        print(f"  seed {sched.seed}: {'ok' if v.ok else 'FAILED'} in {v.seconds:.0f} s",
              flush=True)
    print("\n" + table(rows))
    print("faults done: " + ", ".join(f"{k} {done[k]}" for k in KINDS if done[k]))
    failed = [r for r in rows if not r["ok"]]
    for r, sched in [(r, s) for r, s in zip(rows, scheds) if not r["ok"]]:
        print(f"seed {r['seed']} FAILED: " + "; ".join(r["broken"]))
        print(f"  again: {replay_line(sched, a.world, a.steps)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": rows, "faults_done": dict(done)},
                                           indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
