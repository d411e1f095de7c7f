#!/usr/bin/env python
"""What a live switch costs the engine, by kind of switch (issue 52, item 1), on 4 CPU ranks (gloo).

    .venv/bin/python bench/bench_switch_cost.py [--model small] [--rounds 5]

One run of 4 ranks trains plan A (two 2-stage pipelines: ranks 0|1 and 2|3), re-splits there
and back untimed (a process's first switch pays one-off imports), and each round makes four
switches, each followed by five timed steps:

1. ``A -> A2``, a re-split: the same stages, micro-batches moved between the pipelines
   (``replay/costs.keeps_buffers``); no byte moves, no group is needed;
2. ``A2 -> A``, the re-split back;
3. ``A -> B``, a layout switch: other stage cuts, state moves; B needs a rank set A does not
   have, so the first round creates groups and later rounds find them cached
   (``migrate/group_sets.py``: the last 3 layouts' groups are kept);
4. ``B -> A``, back to the earlier layout.

After the rounds it switches through three more layouts (pipelines 0|2 and 1|3: none holds A's
sets) and back to A, which must then create A's groups afresh (A is no longer among the last 3).
It prints, per kind: the switch's pause (``MigrationReport.seconds``, max over ranks; median
over rounds), bytes moved, groups created (``GroupCache.created`` and torch's own
``_world.group_count``, which must agree), and the first step after the switch over the median
of the next three (the warm-up) beside the same ratio one step later (the noise), medians over
the switches of a kind; and each kind's pause by phase.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _pj(pipes, L: int, G: int) -> dict:
    return {"version": 1, "num_layers": L, "global_batch_size": G, "micro_batch_size": 1,
            "suspended": [],
            "pipelines": [{"micro_batches": m, "stages": [{"ranks": r, "layers": lh}
                                                           for r, lh in st]} for m, st in pipes]}


def plans(L: int, G: int) -> dict[str, dict]:
    h, q = L // 2, L // 4
    def two(m0, c0, c1, a=(0, 1), b=(2, 3)):       # pipelines a[0]|a[1] and b[0]|b[1]
        return _pj([(m0, [([a[0]], [0, c0]), ([a[1]], [c0, L])]),
                    (G - m0, [([b[0]], [0, c1]), ([b[1]], [c1, L])])], L, G)
    alt = {"a": (0, 2), "b": (1, 3)}        # every set of these differs from A's (0,2), (1,3)
    return {"A": two(G // 2, h, h), "A2": two(G // 2 + G // 4, h, h), "B": two(G // 2, q, h + q),
            "C": two(G // 2, h, h, **alt), "D": two(G // 2, q, h, **alt),
            "E": two(G // 2, h + q, h, **alt)}


def _worker(rank, world, model, seq, G, rounds, steps):
    import time

    import torch
    from torch.distributed import distributed_c10d as c10d

    import malleus_ds
    from malleus_ds.engine.groups import GROUPS
    from malleus_ds.models.llama import model_config
    from malleus_ds.plan import Plan

    cfg = model_config(model, max_seq_len=seq)
    P = {k: Plan.from_json(v) for k, v in plans(cfg.num_layers, G).items()}
    ds = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    eng, *_ = malleus_ds.initialize(model=cfg, config=ds, plan=P["A"])

    def step():
        t0 = time.perf_counter()
        eng.train_batch()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    for _ in range(3):
        step()
    for to in ("A2", "A"):      # the process's first switch imports and builds for the first
        eng.switch_plan(P[to])  # time (0.3 s more here): a re-split there and back, untimed
        step()
    out = []

    def switch(kind, to):
        g0, c0 = c10d._world.group_count, GROUPS.created
        rep = eng.switch_plan(P[to])
        made = (GROUPS.created - c0, c10d._world.group_count - g0)
        ts = [step() for _ in range(steps)]
        out.append({"kind": kind, "to": to, "pause_s": rep.seconds, "bytes": rep.bytes,
                    "phases": dict(rep.timing),
                    "groups": made, "first_s": ts[0], "next_s": statistics.median(ts[1:4]),
                    "second_s": ts[1], "later_s": statistics.median(ts[2:5])})

    for r in range(rounds):
        switch("re-split", "A2")
        switch("re-split", "A")
        switch("layout, first time" if r == 0 else "layout", "B")
        switch("layout, back", "A")
    for to in ("C", "D", "E"):
        switch("layout, first time", to)
    switch("back after 3 others", "A")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after each switch (>= 5)")
    a = ap.parse_args(argv)
    from tests.integration.harness import run_distributed

    res = run_distributed(_worker, 4, a.model, a.seq, a.global_batch, a.rounds, max(5, a.steps),
                          timeout=1800)
    rows = res[0]         # the report and the counts are the same on every rank
    print(f"model={a.model} seq={a.seq} G={a.global_batch}, 4 CPU ranks (gloo), ZeRO-1, "
          f"{a.rounds} rounds; pause: MigrationReport.seconds (max over ranks)")
    print(f"{'switch':22} {'n':>3} {'pause s (median, min-max)':>27} {'bytes':>10} "
          f"{'groups made':>12} {'first step / next':>18} {'control':>9}")
    kinds = []
    for r in rows:
        if r["kind"] not in kinds:
            kinds.append(r["kind"])
    for k in kinds:
        rs = [r for r in rows if r["kind"] == k]
        p = [r["pause_s"] for r in rs]
        made = sorted({r["groups"] for r in rs})
        warm = statistics.median(r["first_s"] / r["next_s"] for r in rs)
        ctrl = statistics.median(r["second_s"] / r["later_s"] for r in rs)
        print(f"{k:22} {len(rs):3d} {statistics.median(p):11.4f} ({min(p):.4f}-{max(p):.4f}) "
              f"{statistics.median(r['bytes'] for r in rs):10.0f} "
              f"{' '.join(f'{c}/{t}' for c, t in made):>12} {warm:18.3f} {ctrl:9.3f}")
    print("\nthe pause by phase (median over the switches of a kind, seconds; max over ranks):")
    for k in kinds:
        rs = [r for r in rows if r["kind"] == k]
        ph = {n: statistics.median(r["phases"][n] for r in rs) for n in rs[0]["phases"]}
        print(f"{k:22} " + ", ".join(f"{n} {v:.3f}" for n, v in ph.items() if v >= 0.0005))
    print("groups made: GroupCache.created / torch's _world.group_count, per switch; "
          "first step / next: the first step after the switch over the median of the next "
          "3 (the warm-up); control: the second step over the median of the 3 after it (no "
          "switch: the noise); medians over the switches of a kind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
