#!/usr/bin/env python
"""A slow link between two GPUs of a node, side by side: the same layout kept (what DeepSpeed or
Megatron would run on) and MalleusEngine's adaptive loop (issue 35).

One node of 4 ranks, TP=2 groups (0, 1) and (2, 3), data parallel between them. From step
``--at`` for ``--for`` steps the link between GPUs 0 and 1 is ``--rate`` times slow
(``straggler.link_schedule=[{ranks: [0, 1], ...}]``: every TP collective of group (0, 1) waits
``(rate - 1) x`` its wire's time; the emulation is CPU-only, as the runs are). Both runs train
the same model, data and layout:

* ``static``    engine=malleus with the loop off (``malleus.adaptive=false``): the layout stays;
* ``adaptive``  the loop on: it must read the GPU link (not GPUs 0 or 1) from the TP collectives,
                re-form the TP groups off it, and see it recover through its probes.

Printed, per run: samples/s over the slow steps (the first left out; migrations' seconds added)
and the ratio adaptive/static; the healthy pace (median step before); when the adaptive run
switched (steps after the onset) and planned for the recovery (steps after it ended); and the
largest relative difference between the two runs' losses (the same math).

    python bench/bench_gpu_link.py                # ~2 min on 2 CPU cores
    python bench/bench_gpu_link.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model=tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.max_seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=2"]
GBS = 16


def launch(name: str, d: Path, a) -> dict:
    sched = (f"straggler.link_schedule=[{{ranks:[0,1],rate:{a.rate},start_step:{a.at},"
             f"end_step:{a.at + a.for_}}}]")
    over = [*MODEL, f"train.steps={a.steps}", "train.warmup_steps=2", "progress=false",
            "engine=malleus", "parallel.tp=2", sched, f"hydra.run.dir={d}",
            f"malleus.adaptive={'true' if name == 'adaptive' else 'false'}", *a.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        str(REPO / "launch" / "train.py"), *over], capture_output=True,
                       text=True, cwd=REPO, env=env)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:], sep="\n")
        raise SystemExit(f"run {name} failed (exit {p.returncode})")
    final = next((ln.split("final plan:", 1)[1].strip() for ln in p.stdout.splitlines()
                  if "final plan:" in ln), "the first plan")
    return dict(summarise(d, a), final_plan=final)


def summarise(d: Path, a) -> dict:
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    steps = {x["step"]: x for x in lines if "step_time_s" in x}
    t = {k: v["step_time_s"] for k, v in steps.items()}
    migr = {x["step"]: x.get("seconds", 0.0) for x in lines if x.get("event") == "migrate"}
    on, off = a.at, a.at + a.for_
    slow = range(on + 1, off)
    slow_s = sum(t[k] for k in slow) + sum(s for k, s in migr.items() if k in slow)
    switches = [x for x in lines if x.get("event") == "replan" and x.get("adopted")]
    first = next((x for x in switches if x["detected"] >= on), None)
    back = next((x["detected"] for x in lines if x.get("event") == "replan"
                 and x["detected"] >= off and "0-1" not in (x.get("gpu_link_rates") or {})),
                None)
    return {"samples_per_s_slow": len(slow) * GBS / slow_s,
            "healthy_step_s": statistics.median(t[k] for k in range(2, on)),
            "slow_step_s": statistics.median(t[k] for k in slow),
            "switch_after_onset": None if first is None else first["detected"] - on,
            "read_at": None if first is None else (first.get("gpu_link_rates") or {}).get("0-1"),
            "planned_for_recovery_after": None if back is None else back - off,
            "losses": [steps[k]["loss"] for k in sorted(steps)],
            "replans": [{k: x.get(k) for k in ("step", "detected", "trigger", "adopted",
                                               "gpu_link_rates", "to")}
                        for x in lines if x.get("event") == "replan"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--at", type=int, default=15, help="the first step the link is slow")
    ap.add_argument("--for", dest="for_", type=int, default=35, help="steps it stays slow")
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    a = ap.parse_args()
    if a.steps <= a.at + a.for_ + 5:
        ap.error(f"--steps={a.steps} must exceed --at + --for + 5 = {a.at + a.for_ + 5}")
    with tempfile.TemporaryDirectory() as tmp:
        res = {n: launch(n, Path(tmp) / n, a) for n in ("static", "adaptive")}
    s, m = res["static"], res["adaptive"]
    ratio = m["samples_per_s_slow"] / s["samples_per_s_slow"]
    dl = max(abs(x - y) / abs(y) for x, y in zip(m["losses"], s["losses"]))
    print(f"GPU link 0-1 x{a.rate:g} over steps {a.at}-{a.at + a.for_ - 1} (4 ranks, TP=2)")
    for n, r in res.items():
        print(f"  {n:9s} {r['samples_per_s_slow']:7.2f} samples/s while slow "
              f"(median step {r['slow_step_s']:.3f} s; healthy {r['healthy_step_s']:.3f} s)")
    print(f"  adaptive / static: {ratio:.2f}x; switched {m['switch_after_onset']} steps after "
          f"the onset (read at {m['read_at']}), final plan {m['final_plan']}; planned for the "
          f"recovery {m['planned_for_recovery_after']} steps after it; losses differ by "
          f"{dl:.1e} at most")
    if a.json:
        a.json.write_text(json.dumps({"ratio": ratio, "loss_diff": dl, **res}, indent=1))


if __name__ == "__main__":
    main()
