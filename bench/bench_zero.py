#!/usr/bin/env python
"""Stock DeepSpeed ZeRO and Malleus's re-split, side by side, with one rank under a real CPU quota.

One process group of ``--world`` gloo ranks (default 4) trains a plain ``deepspeed.initialize``
loop (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``) of the same model on the same
data twice per round: with stock ``deepspeed.initialize`` and with ``malleus_ds.initialize``
(MalleusDPEngine, the re-split loop on, its default detection). In each run, rank
``--slow-rank`` is healthy for ``--healthy`` steps, then capped to ``1/--rate`` of a core by a
cgroup (``emulation/cpu_quota.py``: a real slowdown from the OS, every thread of the process,
its communication too) for ``--throttled`` steps, then released for ``--released`` steps. The
same mechanism slows both engines at the same steps; ``--rounds`` alternate which engine goes
first.

Printed, per engine: samples/s in each phase (the mean over the phase's steps, every step of it:
detection and re-split included), and the ratios the issue sets targets for:

* throttled: malleus / stock samples/s (target >= 1.5);
* released: the steps malleus needs after the release to run at >= 0.85 of its healthy pace
  (target <= 10);
* healthy: malleus / stock samples/s (target >= 0.97);
* the largest relative difference of a step's global-batch loss between the two (target <=
  1e-4).

    python bench/bench_zero.py                       # 4 ranks, ZeRO-3, ~3 min on 2 cores
    python bench/bench_zero.py --stage 2 --rounds 2

Needs root and the cgroup cpu controller (``python -m malleus_ds.emulation.cpu_quota
--calibrate`` says whether this machine has them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _config(a) -> dict:
    return {"train_batch_size": a.global_batch, "gradient_accumulation_steps": a.gas,
            "train_micro_batch_size_per_gpu": a.global_batch // (a.gas * a.world),
            "zero_optimization": {"stage": a.stage}, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}


class _Data:
    """A fixed synthetic regression: ``n`` samples of ``dim`` inputs, the same in every rank."""

    def __init__(self, n: int, dim: int):
        import torch

        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.tanh(self.x[:, :8] * 1.5)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _model(dim: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(dim, 8))


def _run(engine_name: str, a, quota, rank: int) -> dict:
    """One run of the plain loop under ``engine_name``; each step's wall seconds and loss."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import malleus_ds

    total = a.healthy + a.throttled + a.released
    data = _Data(a.global_batch * total, a.dim)
    m = _model(a.dim, a.layers)
    if engine_name == "stock":
        eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                 training_data=data, config=_config(a))
        loader.num_local_io_workers = 0

        def global_loss(losses):
            t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t) / dist.get_world_size()
    else:
        eng, _, loader, _ = malleus_ds.initialize(model=m, model_parameters=m.parameters(),
                                                  training_data=data, config=_config(a))
        global_loss = eng.global_loss
    it = iter(loader)
    times, losses, shares = [], [], []
    dist.barrier()
    for step in range(total):
        slow = a.healthy <= step < a.healthy + a.throttled
        if quota is not None:
            quota.set_rate(a.rate if slow else 1.0)
        t0 = time.perf_counter()
        mine = []
        for _ in range(a.gas):
            b = next(it)
            loss = F.mse_loss(eng(b["x"]), b["y"])
            eng.backward(loss)
            eng.step()
            mine.append(loss.item())
        losses.append(global_loss(mine))
        times.append(time.perf_counter() - t0)
        shares.append(list(eng.split.shares) if engine_name == "malleus" else None)
    if quota is not None:
        quota.set_rate(1.0)
    return {"times": times, "losses": losses, "shares": shares,
            "events": list(getattr(eng, "split_events", []))}


def _ranks(rank, world, a):
    from malleus_ds.emulation.cpu_quota import CpuQuota

    quota = CpuQuota() if rank == a.slow_rank else None
    try:
        out = []
        for r in range(a.rounds):
            order = ("stock", "malleus") if r % 2 == 0 else ("malleus", "stock")
            out.append({e: _run(e, a, quota, rank) for e in order})
        return out
    finally:
        if quota is not None:
            quota.close()


def _phase_rates(times, a) -> dict:
    """Samples/s over each phase's steps (total samples / total seconds)."""
    h, t = a.healthy, a.throttled
    parts = {"healthy": times[1:h], "throttled": times[h:h + t], "released": times[h + t:]}
    return {k: a.global_batch * len(v) / sum(v) for k, v in parts.items()}


def _recovery_steps(times, a, healthy_sps) -> int | None:
    """Steps after the release until a step runs at >= 0.85 of the healthy pace (the first
    step that does: 1 = the first released step)."""
    for i, s in enumerate(times[a.healthy + a.throttled:]):
        if a.global_batch / s >= 0.85 * healthy_sps:
            return i + 1
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--rate", type=float, default=10.0, help="the quota: 1/RATE of a core")
    ap.add_argument("--healthy", type=int, default=10)
    ap.add_argument("--throttled", type=int, default=20)
    ap.add_argument("--released", type=int, default=15)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write every step's times, losses and shares here")
    a = ap.parse_args()
    from malleus_ds.emulation.cpu_quota import unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"bench_zero: no real CPU quota on this machine: {why}", file=sys.stderr)
        return 2
    from tests.integration.harness import run_distributed

    t0 = time.time()
    res = run_distributed(_ranks, a.world, a, timeout=3600)[0]
    print(f"bench_zero: {a.world} ranks, ZeRO-{a.stage}, global batch {a.global_batch} "
          f"(gas {a.gas}), MLP {a.layers}x{a.dim}; rank {a.slow_rank} at 1/{a.rate:g} of a core "
          f"for steps {a.healthy}-{a.healthy + a.throttled - 1}; {a.rounds} round(s), "
          f"{time.time() - t0:.0f} s")
    rows = []
    for r, rnd in enumerate(res):
        st, ml = _phase_rates(rnd["stock"]["times"], a), _phase_rates(rnd["malleus"]["times"], a)
        diff = max(abs(x - y) / abs(y) for x, y in zip(rnd["malleus"]["losses"],
                                                        rnd["stock"]["losses"]))
        rec = _recovery_steps(rnd["malleus"]["times"], a, ml["healthy"])
        rows.append((st, ml, diff, rec))
        first = "stock" if r % 2 == 0 else "malleus"
        print(f"\nround {r + 1} ({first} first)   samples/s: healthy / throttled / released")
        for name, v in (("stock", st), ("malleus", ml)):
            print(f"  {name:8s} {v['healthy']:8.1f} {v['throttled']:10.1f} {v['released']:9.1f}")
        ev = rnd["malleus"]["events"]
        print(f"  re-splits: " + "; ".join(f"step {e['step']}: {e['from']} -> {e['to']}"
                                          for e in ev) if ev else "  re-splits: none")
    st_t = statistics.median(x[1]["throttled"] / x[0]["throttled"] for x in rows)
    st_h = statistics.median(x[1]["healthy"] / x[0]["healthy"] for x in rows)
    recs = [x[3] for x in rows]
    diff = max(x[2] for x in rows)
    print(f"\nmalleus / stock while throttled: {st_t:.2f}x (target >= 1.5)")
    print(f"malleus / stock healthy:         {st_h:.3f} (target >= 0.97)")
    print(f"steps after the release to >= 0.85 of healthy: {recs} (target <= 10)")
    print(f"largest relative loss difference per step: {diff:.2e} (target <= 1e-4)")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rounds": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
