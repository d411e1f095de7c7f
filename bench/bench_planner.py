"""Planner benchmark: η of the three baselines and of the Malleus planner, side by side.

Columns: static / data-only / drop baselines, ``P=dp`` (our planner with the number of pipelines
fixed at dp, as Malleus's planner keeps it; an ablation), ``malleus`` (our planner, searching
the number of pipelines), its ratio to the best baseline, the winning candidate and the
planning seconds of the ``malleus`` column.

    .venv/bin/python bench/bench_planner.py [--only NAME_SUBSTRING] [--seed 0] [--time-limit S]

Scenarios span 8-1024 GPUs, 1-24 stragglers, rates 1.3-12, whole slow nodes and mild
many-straggler cases. Every returned plan is validated (structure + memory) and checked to be
no slower than the best baseline; planning time is wall-clock on this machine.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from malleus_ds.cost import validate_for_problem
from malleus_ds.problem import Problem
from malleus_ds.planner import PlannerConfig, plan

SD8 = {"1": 1.0, "2": 1.9, "4": 3.66, "8": 7.22}
SD4 = {"1": 1.0, "2": 1.9, "4": 3.66}
SD2 = {"1": 1.0, "2": 1.9}
SD1 = {"1": 1.0}
# llama-70B-like per-GPU memory at full TP=8 (DESIGN.md §3 example)
MEM70 = {"device_mb": 81920, "reserved_mb": 4096, "layer_static_mb": 1100,
         "layer_activation_mb": 250, "embedding_mb": 1200, "extra_mb": 3000}
MEM13 = {"device_mb": 81920, "reserved_mb": 4096, "layer_static_mb": 1400,
         "layer_activation_mb": 600, "embedding_mb": 1500, "extra_mb": 3000}
MEM175 = {"device_mb": 81920, "reserved_mb": 4096, "layer_static_mb": 2600,
          "layer_activation_mb": 380, "embedding_mb": 1800, "extra_mb": 3000}


def problem(name, nodes, gpn, L, gbs, tp, pp, dp, rates, sd, mem, mbs=1) -> Problem:
    return Problem.from_json({
        "version": 1, "name": name, "cluster": {"nodes": nodes, "gpus_per_node": gpn},
        "model": {"num_layers": L},
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs, "tp": tp, "pp": pp, "dp": dp},
        "cost": {"tp_slowdown": sd}, "memory": mem,
        "rates": {str(k): v for k, v in rates.items()}, "current_plan": None})


def _spread(rng, n_gpus, k, lo, hi, per_node=None, gpn=8):
    ranks = rng.sample(range(n_gpus), k)
    return {r: round(rng.uniform(lo, hi), 2) for r in ranks}


def scenarios() -> list[Problem]:
    rng = random.Random(2024)
    out = [
        problem("8gpu-tp2-one-x2", 1, 8, 32, 32, 2, 2, 2, {3: 2.0}, SD2, MEM13),
        problem("8gpu-tp1-one-x8", 2, 4, 24, 32, 1, 4, 2, {5: 8.0}, SD1, None),
        problem("16gpu-tp4-one-x3", 2, 8, 40, 32, 4, 2, 2, {6: 3.0}, SD4, MEM13),
        problem("32gpu-two-slow", 4, 8, 48, 32, 4, 4, 2, {2: 2.0, 27: 6.0}, SD4, MEM13),
        problem("32gpu-same-node", 4, 8, 48, 64, 4, 4, 2, {8: 1.5, 9: 5.0}, SD4, MEM13),
        problem("64gpu-one-x1.3", 8, 8, 80, 64, 8, 4, 2, {9: 1.3}, SD8, MEM70),
        problem("64gpu-one-x4", 8, 8, 80, 64, 8, 4, 2, {9: 4.0}, SD8, MEM70),
        problem("64gpu-one-x12", 8, 8, 80, 128, 8, 4, 2, {20: 12.0}, SD8, MEM70),
        problem("64gpu-slow-node-x2", 8, 8, 80, 128, 8, 4, 2, {r: 2.0 for r in range(24, 32)}, SD8, MEM70),
        problem("64gpu-slow-node-x12", 8, 8, 80, 128, 8, 4, 2, {r: 12.0 for r in range(24, 32)}, SD8, MEM70),
        problem("64gpu-8-mild", 8, 8, 80, 128, 8, 4, 2, _spread(rng, 64, 8, 1.3, 1.6), SD8, MEM70),
        problem("64gpu-tp4-3-slow", 8, 8, 64, 128, 4, 4, 4, {1: 2.5, 17: 6.0, 40: 1.8}, SD4, MEM13),
        problem("128gpu-4-slow", 16, 8, 80, 128, 8, 4, 4, _spread(rng, 128, 4, 2.0, 6.0), SD8, MEM70),
        problem("256gpu-12-mixed", 32, 8, 96, 256, 8, 8, 4, _spread(rng, 256, 12, 1.3, 12.0), SD8, MEM175),
        problem("256gpu-slow-node+2", 32, 8, 96, 256, 8, 8, 4,
                {**{r: 3.0 for r in range(64, 72)}, 5: 2.0, 200: 7.0}, SD8, MEM175),
        problem("256gpu-2-slow-nodes-x6", 32, 8, 96, 256, 8, 8, 4,
                {r: 6.0 for r in [*range(24, 32), *range(80, 88)]}, SD8, MEM175),
        problem("512gpu-16-slow", 64, 8, 96, 512, 8, 8, 8, _spread(rng, 512, 16, 1.5, 8.0), SD8, MEM175),
        problem("1024gpu-one-x5", 128, 8, 96, 512, 8, 8, 16, {300: 5.0}, SD8, MEM175),
        problem("1024gpu-24-mixed", 128, 8, 96, 512, 8, 8, 16, _spread(rng, 1024, 24, 1.3, 12.0), SD8, MEM175),
        problem("1024gpu-24-mild", 128, 8, 96, 512, 8, 8, 16, _spread(rng, 1024, 24, 1.3, 1.6), SD8, MEM175),
        problem("1024gpu-slow-node+8", 128, 8, 96, 1024, 8, 8, 16,
                {**{r: 4.0 for r in range(512, 520)}, **_spread(rng, 1024, 8, 1.5, 6.0)}, SD8, MEM175),
    ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run scenarios whose name contains this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="per-scenario planning limit (s); default: the planner's auto budget "
                         "(1.8 s up to 64 GPUs, 50 s at 1024)")
    args = ap.parse_args(argv)
    rows = []
    hdr = (f"{'scenario':<22} {'GPUs':>5} {'strag':>5} {'static':>7} {'data':>7} {'drop':>7} "
           f"{'P=dp':>7} {'malleus':>8} {'vs best':>7} {'method':<9} {'plan s':>7}")
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for pr in scenarios():
        if args.only not in pr.name:
            continue
        n_strag = sum(1 for x in pr.rates.values() if x > 1.0)
        t0 = time.perf_counter()
        res = plan(pr, seed=args.seed, time_limit=args.time_limit)  # None: auto budget
        dt = time.perf_counter() - t0
        validate_for_problem(pr, res.plan)
        # ablation: the same planner with the number of pipelines fixed at dp (as Malleus does)
        fixed = plan(pr, seed=args.seed, time_limit=args.time_limit,
                     config=PlannerConfig(num_pipelines=pr.dp))
        validate_for_problem(pr, fixed.plan)
        bl = res.baselines
        best_bl = max(v for v in bl.values() if v is not None)
        ok &= res.efficiency >= best_bl - 1e-9
        fmt = lambda v: "   n/a" if v is None else f"{v:7.3f}"
        print(f"{pr.name:<22} {pr.num_gpus:>5} {n_strag:>5} {fmt(bl['static'])} {fmt(bl['data-only'])} "
              f"{fmt(bl['drop'])} {fixed.efficiency:7.3f} {res.efficiency:8.3f} "
              f"{res.efficiency / best_bl:6.2f}x "
              f"{res.method:<9} {dt:7.2f}", flush=True)
        rows.append((pr, res, dt, bl, fixed))
    if rows:
        n = len(rows)
        mean = lambda xs: sum(xs) / len(xs)
        print("-" * len(hdr))
        print(f"{'mean':<22} {'':>5} {'':>5} "
              f"{mean([r[3]['static'] or 0 for r in rows]):7.3f} "
              f"{mean([r[3]['data-only'] or 0 for r in rows]):7.3f} "
              f"{mean([r[3]['drop'] or 0 for r in rows]):7.3f} "
              f"{mean([r[4].efficiency for r in rows]):7.3f} "
              f"{mean([r[1].efficiency for r in rows]):8.3f} {'':>7} {'':<9} "
              f"{mean([r[2] for r in rows]):7.2f}")
        print(f"{n} scenarios; malleus >= best baseline on every one: {ok}; "
              f"min eta {min(r[1].efficiency for r in rows):.3f}; "
              f"max planning time {max(r[2] for r in rows):.2f}s "
              f"(64 GPUs or fewer: {max([r[2] for r in rows if r[0].num_gpus <= 64] or [0]):.2f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
