"""``malleus-chaos``: a fault campaign against a real multi-rank job (``malleus_ds/chaos/``).

    malleus-chaos --seeds 0-4                      # five seeds, every fault kind, 4 ranks
    malleus-chaos --seeds 7 --kinds kill,freeze    # one seed, two kinds
    malleus-chaos --seeds 0-49 --json chaos.json   # a long campaign, its table as JSON too
    malleus-chaos --seeds 0-9 --against-stock      # and stock DeepSpeed's pace beside each

Each seed's schedule is printed before its run; at the end, one table row per seed (faults by
kind, restarts, plan switches, failed checkpoint saves, seconds, verdict), one row per fault
kind (done, not done, the runs it was in, how many of those failed), and for each failing seed
what broke and the command that runs it again. With ``--against-stock`` each seed that slows a
rank also runs under stock DeepSpeed (``engine=deepspeed``) with the same slowdowns, and its
pace must be at least ``--min-pace`` x stock's (not a seed with a slow link or a lost node,
``Schedule.comparable``). Exit status 1 when a seed failed.
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
    stock = any(r.get("vs_stock") is not None for r in rows)
    head = f"{'seed':>5}  " + "  ".join(f"{k[:9]:>9}" for k in kinds) + \
        "  restarts  switches  failed saves  seconds" + ("  vs stock" if stock else "") + \
        "  verdict"
    lines = [head]
    for r in rows:
        vs = r.get("vs_stock")
        lines.append(f"{r['seed']:>5}  " + "  ".join(f"{r['faults'].get(k, 0):>9}" for k in kinds)
                     + f"  {r['restarts']:>8}  {r['switches']:>8}  {r['failed_saves']:>12}"
                     f"  {r['seconds']:>7.0f}"
                     + ((f"  {vs:>7.2f}x" if vs is not None else f"  {'-':>8}") if stock else "")
                     + f"  {'ok' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


def kinds_table(rows: list[dict]) -> str:
    """One row per fault kind: how many were done and not done (and why not, the first
    reason), in how many runs, and how many of those runs failed."""
    lines = [f"{'kind':<13}{'done':>6}{'not done':>10}{'runs':>6}{'failed':>8}  why not"]
    for k in KINDS:
        runs = [r for r in rows if r["faults"].get(k)]
        if not runs:
            continue
        missed = [n for r in runs for n in r["not_done"] if n.startswith(k + ":")]
        done = sum(r["faults"][k] for r in runs) - len(missed)
        why = missed[0].split(": ", 1)[1] if missed else ""
        lines.append(f"{k:<13}{done:>6}{len(missed):>10}{len(runs):>6}"
                     f"{sum(not r['ok'] for r in runs):>8}  {why}")
    return "\n".join(lines)


def given(a: argparse.Namespace, name: str) -> str | None:
    """An option's value where it is not the default (for the replay line)."""
    return None if getattr(a, name) == DEFAULTS[name] else getattr(a, name)


def job_options(a: argparse.Namespace) -> str:
    """The job-size options given where they are not the job's defaults (for the replay
    line)."""
    from .run import Options

    job = Options()
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v, d in
                    (("batch", a.batch, None), ("seq_len", a.seq_len, job.seq_len),
                     ("rtol", a.rtol, job.rtol)) if v != d)


#: the defaults of the options that change which schedule a seed draws
DEFAULTS = {"kinds": ",".join(KINDS), "faults": "2-4"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="malleus-chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-4", help="seeds: 3, 0-4 or 1,5,9 (default 0-4)")
    ap.add_argument("--world", type=int, default=4, help="ranks of the job (default 4)")
    ap.add_argument("--steps", type=int, default=36, help="steps of the job (default 36)")
    ap.add_argument("--kinds", default=DEFAULTS["kinds"],
                    help=f"fault kinds to draw from (default all: {','.join(KINDS)})")
    ap.add_argument("--faults", default=DEFAULTS["faults"],
                    help="faults per run, a range (default 2-4)")
    ap.add_argument("--out", default="chaos", help="folder for the runs (default ./chaos)")
    ap.add_argument("--json", help="also write the table and every schedule as JSON here")
    ap.add_argument("--against-stock", action="store_true",
                    help="also run each seed that slows a rank under stock DeepSpeed with the "
                         "same slowdowns, and compare the pace")
    ap.add_argument("--batch", type=int, default=None,
                    help="samples a step (default 8; 32 when a node is lost)")
    from .run import Options

    job = Options()
    ap.add_argument("--seq-len", type=int, default=job.seq_len,
                    help=f"tokens a sample (default {job.seq_len}). With --against-stock, a bigger job "
                         "(e.g. --batch 64 --seq-len 64) makes steps long enough that the pace "
                         "measures the stragglers rather than each engine's fixed cost a step")
    ap.add_argument("--rtol", type=float, default=job.rtol,
                    help="each step's loss against the fault-free one-process run's (default "
                         f"{job.rtol:g}; 1e-4 for --batch 64 --seq-len 64, where stock DeepSpeed itself "
                         "reads 4e-5 off at one step)")
    ap.add_argument("--min-pace", type=float, default=0.95,
                    help="the least throughput against stock's that passes (default 0.95; on "
                         "this 2-core machine's 50-100 ms steps, two engines' healthy paces "
                         "differ by up to 2x from run to run: bench/RESULTS.md)")
    a = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    lo, _, hi = a.faults.partition("-")
    from ..report.metrics import read_live
    from .run import Options, batch_of, reference, replay_line, run_one
    from .verdict import judge_pace

    try:
        scheds = [draw(s, a.steps, a.world, kinds, (int(lo), int(hi or lo))) for s in
                  seeds_of(a.seeds)]
    except ValueError as e:
        print(f"malleus-chaos: {e}", file=sys.stderr)
        return 2
    rows, done = [], Counter()
    for sched in scheds:
        print("\n".join(sched.lines()), flush=True)
        say = lambda m: print(m, flush=True)        # noqa: E731
        out = Path(a.out) / f"seed{sched.seed}"
        opts = Options(global_batch_size=a.batch or batch_of(sched), seq_len=a.seq_len,
                       rtol=a.rtol)
        v, injections = run_one(sched, out, reference(sched, opts), opts, say=say)
        if a.against_stock and sched.comparable:
            say(f"  seed {sched.seed}: stock DeepSpeed under the same slowdowns")
            run_one(sched.slowdowns(), Path(a.out) / f"seed{sched.seed}-stock",
                    reference(sched, opts), opts, say=say, engine="deepspeed")
            judge_pace(v, read_live(Path(a.out) / f"seed{sched.seed}-stock" / "run"),
                       read_live(out / "run"), a.min_pace)
        done.update(i.fault.kind for i in injections if i.done)
        done.update(f.kind for f in sched.at_launch())
        rows.append({"seed": sched.seed, "faults": dict(Counter(f.kind for f in sched.faults)),
                     "restarts": v.restarts, "switches": v.switches,
                     "failed_saves": v.failed_saves, "seconds": round(v.seconds, 1),
                     "ok": v.ok, "broken": v.broken, "schedule": sched.json(),
                     "vs_stock": (round(v.stock_pace / v.pace, 3)
                                  if v.pace and v.stock_pace else None),
                     "not_done": [f"{i.fault.kind}: {i.note}" for i in injections
                                  if not i.done]})
        print(f"  seed {sched.seed}: {'ok' if v.ok else 'FAILED'} in {v.seconds:.0f} s",
              flush=True)
    print("\n" + table(rows))
    print("\n" + kinds_table(rows))
    print("faults done: " + ", ".join(f"{k} {done[k]}" for k in KINDS if done[k]))
    failed = [r for r in rows if not r["ok"]]
    for r, sched in [(r, s) for r, s in zip(rows, scheds) if not r["ok"]]:
        print(f"seed {r['seed']} FAILED: " + "; ".join(r["broken"]))
        again = replay_line(sched, a.world, a.steps, given(a, "kinds"), given(a, "faults"),
                            job_options(a))
        print(f"  again: {again}"
              + (" --against-stock" if a.against_stock else ""))
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": rows, "faults_done": dict(done)},
                                           indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
