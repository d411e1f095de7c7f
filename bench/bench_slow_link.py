#!/usr/bin/env python
"""A real slow link, side by side: stock DeepSpeed and MalleusEngine on two emulated nodes whose
link is throttled for real (issue 35).

``scripts/two_nodes.sh`` makes two network namespaces joined by a veth pair, one torchrun agent
in each (2 ranks per node, 4 in all, gloo over the veth between the nodes). Each run trains the
same model, data and nominal layout (data parallel over all 4 ranks, ZeRO-1): healthy until step
``--at``, then the link is throttled with ``tc ... tbf rate --rate`` for ``--for`` steps, then
free again until ``--steps``. A watcher throttles and frees the link when rank 0's metrics.jsonl
reaches those steps, so both runs are throttled over the same steps whatever their pace.

* ``deepspeed``  stock DeepSpeed ZeRO-1, dp=4: every step's gradient all-reduce crosses the link;
* ``malleus``    MalleusEngine with the adaptive loop: it must read the link as slow, move to a
                 layout whose reductions stay inside the nodes, and come back once it is free.

Printed, per run: samples/s over the throttled steps (the first throttled step, where the tc
change lands mid-step, left out; migrations' seconds added) and the ratio malleus/deepspeed
(target >= 1.3); the healthy pace (median step before the throttle); how many steps after the
link is freed the run is back within 10% of it (a 3-step median; target <= 15); and the largest
relative difference between the two runs' losses (the same math).

    python bench/bench_slow_link.py                  # ~3 min on 2 CPU cores; needs root
    python bench/bench_slow_link.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TWO_NODES = REPO / "scripts" / "two_nodes.sh"
MODEL = ["model=tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.max_seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=2"]
GBS = 16


def _steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue                       # a line being written
        if "step_time_s" in d:
            out.append(d)
    return out


def _watch(metrics: Path, link_id: int, a, marks: dict, stop: threading.Event) -> None:
    """Throttle the link once ``a.at`` steps are done, free it ``a.for_`` steps later."""
    while not stop.is_set():
        n = len(_steps(metrics))
        if "on" not in marks and n >= a.at:
            subprocess.run([str(TWO_NODES), "throttle", "--id", str(link_id), a.rate], check=True)
            marks["on"] = len(_steps(metrics))
        if "on" in marks and "off" not in marks and n >= a.at + a.for_:
            subprocess.run([str(TWO_NODES), "unthrottle", "--id", str(link_id)], check=True)
            marks["off"] = len(_steps(metrics))
            return
        time.sleep(0.05)


def launch(name: str, d: Path, a, link_id: int) -> dict:
    """One run on the two namespaces; returns its numbers."""
    over = [*MODEL, f"train.steps={a.steps}", "train.warmup_steps=2", "progress=false",
            "cluster.nodes=2", "cluster.gpus_per_node=2", "deepspeed=zero1",
            f"hydra.run.dir={d}", f"engine={name}"]
    torchrun = (f"OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu {sys.executable} -m torch.distributed.run "
                "--nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 "
                "--master-addr $MASTER_ADDR --master-port $MASTER_PORT "
                f"{REPO / 'launch' / 'train.py'} " + " ".join(over + a.overrides))
    marks: dict = {}
    stop = threading.Event()
    w = threading.Thread(target=_watch, args=(d / "metrics.jsonl", link_id, a, marks, stop),
                         daemon=True)
    w.start()
    p = subprocess.run([str(TWO_NODES), "run", "--id", str(link_id), "--", torchrun],
                       capture_output=True, text=True, cwd=REPO)
    stop.set()
    w.join(5)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:], sep="\n")
        raise SystemExit(f"run {name} failed (exit {p.returncode})")
    if "off" not in marks:
        raise SystemExit(f"run {name}: the link was not throttled and freed ({marks}); "
                         f"use --steps > --at + --for")
    return summarise(d, marks)


def summarise(d: Path, marks: dict) -> dict:
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    steps = {x["step"]: x for x in lines if "step_time_s" in x}
    t = {k: v["step_time_s"] for k, v in steps.items()}
    migr = {x["step"]: x.get("seconds", 0.0) for x in lines if x.get("event") == "migrate"}
    on, off = marks["on"], marks["off"]          # step indices: throttled over [on, off)
    slow = range(on + 1, off)
    slow_s = sum(t[k] for k in slow) + sum(s for k, s in migr.items() if k in slow)
    healthy = statistics.median(t[k] for k in range(2, on))
    back = None
    for k in range(off, max(t) - 1):
        if statistics.median(t[j] for j in range(k, k + 3)) <= 1.1 * healthy:
            back = k - off
            break
    switches = [x for x in lines if x.get("event") == "replan" and x.get("adopted")]
    first = next((x["detected"] for x in switches if x["detected"] >= on), None)
    again = next((x["detected"] for x in switches if x["detected"] >= off), None)
    return {"samples_per_s_throttled": len(slow) * GBS / slow_s, "healthy_step_s": healthy,
            "throttled_step_s": statistics.median(t[k] for k in slow),
            "switch_after_throttle": None if first is None else first - on,
            "switch_after_free": None if again is None else again - off,
            "throttled_steps": [on, off], "back_within_10pct_after": back,
            "losses": [steps[k]["loss"] for k in sorted(steps)],
            "replans": [{k: x.get(k) for k in ("step", "detected", "trigger", "adopted",
                                               "link_rates", "to")}
                        for x in lines if x.get("event") == "replan"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--at", type=int, default=20, help="steps done when the link is throttled")
    ap.add_argument("--for", dest="for_", type=int, default=25, help="steps it stays throttled")
    ap.add_argument("--rate", default="200mbit", help="tc tbf rate while throttled")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    a = ap.parse_args()
    if subprocess.run([str(TWO_NODES), "check"]).returncode != 0:
        raise SystemExit("bench_slow_link: network namespaces cannot be made here (see above)")
    out = a.out or Path(tempfile.mkdtemp(prefix="bench_slow_link_"))
    res = {}
    for i, name in enumerate(("deepspeed", "malleus")):
        t0 = time.perf_counter()
        res[name] = launch(name, out / name, a, 100 + os.getpid() % 100 * 2 + i)
        r = res[name]
        print(f"{name:10s} {r['samples_per_s_throttled']:7.1f} samples/s throttled "
              f"(steps {r['throttled_steps']}, median step {r['throttled_step_s']:.3f} s), "
              f"healthy step {r['healthy_step_s']:.3f} s, back within 10% "
              f"{r['back_within_10pct_after']} steps after the link is freed; adopted switches "
              f"detected {r['switch_after_throttle']} steps after the throttle and "
              f"{r['switch_after_free']} after the free ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    ds, ml = res["deepspeed"], res["malleus"]
    ratio = ml["samples_per_s_throttled"] / ds["samples_per_s_throttled"]
    n = min(len(ds["losses"]), len(ml["losses"]))
    loss_diff = max(abs(x - y) / abs(y) for x, y in zip(ml["losses"][:n], ds["losses"][:n]))
    back = ml["back_within_10pct_after"]
    print(f"throttled: malleus / deepspeed = {ratio:.2f}x (target >= 1.3) "
          f"{'PASS' if ratio >= 1.3 else 'FAIL'}")
    print(f"after the link is freed: malleus back within 10% of its healthy pace in {back} steps "
          f"(target <= 15) {'PASS' if back is not None and back <= 15 else 'FAIL'}")
    print(f"losses: largest relative difference malleus vs deepspeed {loss_diff:.1e}")
    for e in ml["replans"]:
        print("  malleus replan:", e)
    summary = {"args": {k: str(v) for k, v in vars(a).items()}, "ratio_throttled": ratio,
               "loss_max_rel_diff": loss_diff, "runs": res}
    (a.json or out / "bench_slow_link.json").write_text(json.dumps(summary, indent=1))
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
