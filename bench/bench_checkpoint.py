#!/usr/bin/env python
"""What checkpoints cost a run, and how fast a job is training again after a rank dies.

1. Step-time overhead of ``checkpoint.every=1`` against no checkpoints, on ``--ranks`` local CPU
   ranks (``engine=malleus``, ``--model``), background writes (the default) and, for
   comparison, writes on the training thread (``checkpoint.background=false``). The three
   configurations run in turn, ``--rounds`` times (this machine is noisy: side by side in one
   run); each run's training time per step after ``--warmup`` steps (step times plus the time
   each save held the training thread, from metrics.jsonl), then the median over rounds.
   Target (issue 20): background overhead <= 10%. ``checkpoint.every=2`` in the background is
   measured beside it (half the saves: the trade-off a user makes). Every save keeps 2
   checkpoints (``checkpoint.keep=2``), so deleting old ones is in the cost, as in a long run.
2. Recovery: rank 1 is killed with SIGKILL after a few steps; the seconds from the kill to the
   first step line of the continued run, with ``max_restarts=1`` (torchrun restarts it) against
   a manual restart (the job ends, and the same command with ``checkpoint.resume=true`` starts
   at once: the time a person or a scheduler would add is not counted).

    python bench/bench_checkpoint.py --model medium --seq 128 --ranks 2 --steps 30 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from malleus_ds.report.metrics import read_live  # noqa: E402
from malleus_ds.resilience.procs import descendants, rank_pid  # noqa: E402

TRAIN = str(REPO / "launch" / "train.py")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return env


def _cmd(a, run: Path, extra: list[str]) -> list[str]:
    return [sys.executable, TRAIN, f"nproc_per_node={a.ranks}", "engine=malleus",
            f"model={a.model}", f"model.max_seq_len={a.seq}", "progress=false",
            "malleus.adaptive=false", f"hydra.run.dir={run}", *extra]


def step_time(a, tmp: Path, name: str, extra: list[str]) -> float:
    run = tmp / f"{name}-{time.monotonic_ns()}"
    p = subprocess.run(_cmd(a, run, [f"train.steps={a.steps}", *extra]), env=_env(),
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    rows = read_live(run)
    # the training thread's time per step: the step itself plus what each save held it (a
    # save on the step: all of it; in the background: the wait for the previous write and
    # the copy to host memory); the background write's effect shows in the step times
    steps = [r["step_time_s"] for r in rows if "event" not in r and r["step"] >= a.warmup]
    held = [r["seconds"] for r in rows if r.get("event") == "checkpoint"
            and a.warmup < r["step"] <= a.steps - 1]        # the end-of-run save left out
    return (sum(steps) + sum(held)) / len(steps)


def overhead(a, tmp: Path) -> None:
    configs = {"none": [],
               "every=1 background": [f"checkpoint.dir={tmp}/ck-bg", "checkpoint.every=1",
                                      "checkpoint.keep=2"],
               "every=1 on the step": [f"checkpoint.dir={tmp}/ck-sync", "checkpoint.every=1",
                                       "checkpoint.keep=2", "checkpoint.background=false"],
               "every=2 background": [f"checkpoint.dir={tmp}/ck-bg2", "checkpoint.every=2",
                                      "checkpoint.keep=2"]}
    if a.every1_only:
        configs = {k: v for k, v in configs.items() if k in ("none", "every=1 background")}
    got: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(a.rounds):
        for name, extra in configs.items():
            got[name].append(step_time(a, tmp, name.split()[-1], extra))
            print(f"  round {r + 1} {name:<22} median step {got[name][-1]:.4f} s", flush=True)
    base = statistics.median(got["none"])
    print(f"\ntraining time per step, model={a.model}, {a.ranks} ranks, {a.steps} steps (first {a.warmup} "
          f"left out), median of {a.rounds} round(s):")
    for name, xs in got.items():
        m = statistics.median(xs)
        print(f"  {name:<22} {m:.4f} s   x{m / base:.3f} of no checkpoints")
    bg = statistics.median(got["every=1 background"]) / base - 1
    print(f"  background overhead {100 * bg:.1f}% (target <= 10%): "
          f"{'pass' if bg <= 0.10 else 'FAIL'}")
    per_round = [b / n - 1 for b, n in zip(got["every=1 background"], got["none"])]
    print("  every=1 background overhead per round: "
          + ", ".join(f"{100 * x:+.1f}%" for x in per_round))
    if "every=2 background" in got:
        bg2 = statistics.median(got["every=2 background"]) / base - 1
        print(f"  every=2 background overhead {100 * bg2:.1f}% (for the trade-off: half the saves)")


def _first_step_after(run: Path, t_kill: float, restarted: bool, timeout: float = 600) -> float:
    """Seconds from ``t_kill`` until metrics.jsonl has a step line of the continued run: after
    its ``restart`` event (``restarted``), or any (a new run folder)."""
    while time.monotonic() - t_kill < timeout:
        rows = read_live(run)
        marks = [i for i, r in enumerate(rows) if r.get("event") == "restart"]
        after = rows[marks[-1] + 1:] if marks else ([] if restarted else rows)
        if any("event" not in r for r in after):
            return time.monotonic() - t_kill
        time.sleep(0.05)
    raise SystemExit("no step after the kill")


def _kill_after(p: subprocess.Popen, run: Path, steps: int) -> float:
    while True:
        rows = read_live(run)
        if sum("event" not in r for r in rows) >= steps:
            pid = rank_pid(p.pid, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return time.monotonic()
        if p.poll() is not None:
            raise SystemExit(f"the run ended before the kill (exit {p.returncode})")
        time.sleep(0.02)


def recovery(a, tmp: Path) -> None:
    common = [f"train.steps={a.steps}", "checkpoint.every=2", "checkpoint.resume=auto"]
    # torchrun restarts the job
    run, ck = tmp / "auto", tmp / "ck-auto"
    p = subprocess.Popen(_cmd(a, run, [*common, f"checkpoint.dir={ck}", "max_restarts=1"]),
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_kill = _kill_after(p, run, 5)
    auto = _first_step_after(run, t_kill, restarted=True)
    p.wait(1800)
    # a manual restart: the job ends, the same command with resume starts at once
    run, ck = tmp / "manual", tmp / "ck-manual"
    p = subprocess.Popen(_cmd(a, run, [*common, f"checkpoint.dir={ck}"]), env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_kill = _kill_after(p, run, 5)
    p.wait(1800)
    ended = time.monotonic() - t_kill
    run2 = tmp / "manual-2"
    q = subprocess.Popen(_cmd(a, run2, [*common, f"checkpoint.dir={ck}"]), env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manual = _first_step_after(run2, t_kill, restarted=False)
    q.wait(1800)
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"\nrank 1 killed after 5 steps (model={a.model}, {a.ranks} ranks, checkpoint.every=2):")
    print(f"  max_restarts=1 (torchrun restarts)  training again after {auto:6.1f} s")
    print(f"  manual restart (job ended after {ended:.1f} s, relaunched at once) "
          f"training again after {manual:6.1f} s")
    print(f"  automatic / manual: x{auto / manual:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="medium")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128, help="model.max_seq_len")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=["overhead", "recovery"], default=None)
    ap.add_argument("--every1-only", action="store_true",
                    help="overhead: only no checkpoints and every=1 in the background (more "
                         "rounds in the same time)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        if a.only in (None, "overhead"):
            overhead(a, Path(t))
        if a.only in (None, "recovery"):
            recovery(a, Path(t))


if __name__ == "__main__":
    main()
