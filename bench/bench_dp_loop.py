#!/usr/bin/env python
"""The DP re-split loop's cost on healthy steps, in one 4-rank gloo process group, the order
rotated each round (round r runs the engines shifted by r). The engines (``--engines``):

* ``stock``: stock DeepSpeed;
* ``async``: malleus as shipped (the loop's all-reduce non-blocking, read a step later);
* ``blocking``: malleus with that all-reduce forced blocking (the loop before session 33);
* ``stock+ar``: stock with one extra non-blocking all-reduce of the loop's size a step and
  nothing else: what the collective alone costs;
* ``wall``: malleus with the compute clock's CPU correction off (no ``schedstat`` read around
  each compute span and each collective inside it: what a CUDA job runs, whose clock is CUDA
  events): what that CPU-only correction costs.

``bench_zero.py``'s plain loop (ZeRO-3, its MLP, healthy steps only); "blocking" wraps
``deepspeed.comm.all_reduce`` for calls from ``malleus_ds/dp/loop.py`` only, so the rest of the
code is the same. Printed per round: each engine's median step seconds (the first two steps of
each run left out); at the end, the pooled medians and the per-round geometric means of stock's
step over each engine's (1.0: stock's pace). The machine's other load moves single rounds by
+-30%: compare many rounds.

    python bench/bench_dp_loop.py --rounds 12 --steps 16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ENGINES = ("stock", "async", "blocking", "stock+ar", "wall")


class _Done:
    """A finished collective's handle."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def _ranks(rank, world, a):
    import bench_zero
    import deepspeed.comm as dcomm

    real = dcomm.all_reduce

    def blocking(t, *args, async_op=False, **kw):
        if async_op and sys._getframe(1).f_code.co_filename.endswith("malleus_ds/dp/loop.py"):
            real(t, *args, async_op=False, **kw)
            return _Done()
        return real(t, *args, async_op=async_op, **kw)

    import malleus_ds.engine.clock as clock

    reads = clock.thread_times
    out = []
    for r in range(a.rounds):
        res = {}
        for name in a.engines[r % len(a.engines):] + a.engines[:r % len(a.engines)]:
            dcomm.all_reduce = blocking if name == "blocking" else real
            clock.thread_times = (lambda *x, **k: None) if name == "wall" else reads
            a.extra_allreduce = name == "stock+ar"
            try:
                res[name] = bench_zero._run("stock" if name.startswith("stock") else "malleus",
                                            a, None, rank)["times"]
            finally:
                dcomm.all_reduce, clock.thread_times = real, reads
        out.append(res)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--json", help="write every step's seconds here")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"which to run, stock first (default {','.join(ENGINES)})")
    x = ap.parse_args()
    engines = [e.strip() for e in x.engines.split(",") if e.strip()]
    if x.steps < 4 or x.rounds < 1:
        ap.error(f"--steps={x.steps} must be >= 4 and --rounds={x.rounds} >= 1")
    if not engines or engines[0] != "stock" or set(engines) - set(ENGINES) \
            or len(set(engines)) != len(engines):
        ap.error(f"--engines={x.engines}: stock first, then any of {', '.join(ENGINES[1:])}, "
                 f"each once")
    a = argparse.Namespace(world=4, stage=3, slow_rank=1, rate=1.0, slowdown="sleep",
                           healthy=x.steps, throttled=0, released=0, gas=1, layers=4,
                           global_batch=x.global_batch, dim=x.dim, no_loop=False,
                           rounds=x.rounds, engines=engines)
    from tests.integration.harness import run_distributed

    t0 = time.time()
    res = run_distributed(_ranks, a.world, a, timeout=3600)[0]
    med = statistics.median
    for i, rnd in enumerate(res):
        m = {k: med(v[2:]) for k, v in rnd.items()}
        print(f"round {i + 1}: median step s " + ", ".join(f"{k} {v:.3f}" for k, v in m.items())
              + "; " + ", ".join(f"stock/{k} {m['stock'] / m[k]:.3f}" for k in engines[1:]))
    pooled = {k: med([s for rnd in res for s in rnd[k][2:]]) for k in engines}

    def geo(num, den):
        return statistics.geometric_mean([med(r[num][2:]) / med(r[den][2:]) for r in res])

    print(f"{len(res)} rounds, {time.time() - t0:.0f} s; stock's step over each engine's (1.0: "
          f"stock's pace):")
    for k in engines[1:]:
        print(f"  stock/{k}: pooled medians {pooled['stock'] / pooled[k]:.3f}, per-round "
              f"geometric mean {geo('stock', k):.3f}")
    if x.json:
        Path(x.json).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
