#!/usr/bin/env python
"""How fast a job ends when something stops it, under CPU load, per launcher.

Two scenarios on 2 local CPU ranks (``engine=malleus``, tiny model), each with ``--load`` busy
processes competing for the cores:

* ``frozen``: SIGSTOP rank 1 once three steps are logged (``hang_timeout_s=--hang``); prints the
  seconds from the freeze to the hang event, to the live rank's exit and to the launcher's exit.
  Bound (docs/operations.md): every live rank and the whole job within ``hang_timeout_s + 30 s``.
* ``runner``: SIGTERM to the launcher process alone (``kill -TERM <pid of deepspeed>``); prints
  the seconds until no process of the job is left (target < 10 s).

    python bench/bench_stop.py --launcher torchrun deepspeed --hang 20 --load 2
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from malleus_ds.resilience.procs import descendants, is_running as _running, rank_pid  # noqa: E402

TRAIN = str(REPO / "launch" / "train.py")


def _lines(f: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _wait(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout} s")


def _rank_pid(root: int, rank: int) -> int:
    pid = rank_pid(root, rank)
    if pid is None:
        raise SystemExit(f"no rank {rank} under {root}")
    return pid


def _cmd(launcher: str, out: Path, hang: int) -> list[str]:
    if launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        head = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
                "--master_port", str(port)]
    return [*head, TRAIN, "model=tiny", "model.max_seq_len=16", "progress=false",
            "engine=malleus", "malleus.adaptive=false", "train.steps=100000",
            f"hang_timeout_s={hang}", f"hydra.run.dir={out}"]


def run(launcher: str, scenario: str, hang: int, load: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench_stop_{launcher}_{scenario}_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    p = subprocess.Popen(_cmd(launcher, out, hang), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(lambda: len(_lines(out / "metrics.jsonl")) >= 3, 300)
        if scenario == "frozen":
            victim, live = _rank_pid(p.pid, 1), _rank_pid(p.pid, 0)
            os.kill(victim, signal.SIGSTOP)
            t0 = time.monotonic()
            ev = _wait(lambda: any(e.get("event") == "hang"
                                   for e in _lines(out / "metrics.jsonl")), 600)
            live_s = ev + _wait(lambda: not _running(live), 600)
            p.wait(timeout=600)
            return {"hang_event_s": round(ev, 1), "live_rank_exit_s": round(live_s, 1),
                    "job_exit_s": round(time.monotonic() - t0, 1),
                    "bound_s": hang + 30}
        procs = descendants(p.pid)
        os.kill(p.pid, signal.SIGTERM)
        gone = _wait(lambda: not any(_running(q) for q in procs), 600)
        return {"all_gone_s": round(gone, 1), "target_s": 10}
    finally:
        for h in hogs:
            h.kill()
        for pid in descendants(p.pid) + [p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launcher", nargs="+", default=["torchrun", "deepspeed"],
                    choices=["torchrun", "deepspeed"])
    ap.add_argument("--scenario", nargs="+", default=["frozen", "runner"],
                    choices=["frozen", "runner"])
    ap.add_argument("--hang", type=int, default=20, help="hang_timeout_s (default 20)")
    ap.add_argument("--load", type=int, default=2, help="busy processes (default 2)")
    a = ap.parse_args()
    for launcher in a.launcher:
        for sc in a.scenario:
            print(f"{launcher:9s} {sc:7s} load={a.load}: "
                  f"{json.dumps(run(launcher, sc, a.hang, a.load))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
