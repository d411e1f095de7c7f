"""One campaign run: a real multi-rank ``engine=malleus`` job under a seed's faults, judged.

The job is the app's own launcher (``launch/train.py nproc_per_node=N max_restarts=R``,
torchrun underneath) with the adaptive loop on, ``checkpoint.every=2``, ``checkpoint.keep=2``,
``checkpoint.resume=auto`` and a short hang timeout; its checkpoint folder is on a tmpfs of its
own when this machine can mount one (a ``disk_full`` fault fills it, a ``disk_ro`` one makes it
read-only). The runner watches
metrics.jsonl and does each live fault once the job has reported its step; a SIGTERM stops the
job, and the same command runs again. Then :func:`~malleus_ds.chaos.verdict.judge`.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..report.metrics import read_live
from ..resilience.procs import descendants
from .inject import Injection, inject
from .schedule import Schedule
from .verdict import Verdict, judge

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "train.py"
#: the job: a small decoder, 8 samples a step in micro-batches of 1
JOB = ("model=tiny", "model.max_seq_len=16", "progress=false", "engine=malleus")


@dataclass(frozen=True)
class Options:
    """The campaign's job settings (the same for every seed)."""

    hang_timeout_s: float = 12.0
    max_restarts: int = 4
    budget_s: float = 420.0         # a run still going after this is killed and judged as is
    disk_mb: int = 32               # the checkpoint tmpfs


def _literal(entries: list[dict]) -> str:
    return "[" + ",".join("{" + ",".join(f"{k}:{json.dumps(v)}" for k, v in e.items()) + "}"
                          for e in entries) + "]"


def command(sched: Schedule, run: Path, ck: Path, opts: Options) -> list[str]:
    """The job's command line for ``sched`` (its at-launch faults included)."""
    strag = [{"rank": f.rank, "rate": f.rate, "start_step": f.step, "end_step": f.until}
             for f in sched.at_launch() if f.kind == "straggler"]
    links = [{"ranks": [f.rank, f.peer], "rate": f.rate, "start_step": f.step,
              "end_step": f.until} for f in sched.at_launch() if f.kind == "slow_link"]
    return [sys.executable, str(TRAIN), *JOB, f"nproc_per_node={sched.world}",
            f"max_restarts={opts.max_restarts}", f"train.steps={sched.steps}",
            f"checkpoint.dir={ck}", "checkpoint.every=2", "checkpoint.keep=2",
            "checkpoint.resume=auto", f"hang_timeout_s={opts.hang_timeout_s:g}",
            f"hydra.run.dir={run}", f"straggler.schedule={_literal(strag)}",
            f"straggler.link_schedule={_literal(links)}"]


def replay_line(sched: Schedule, world: int, steps: int) -> str:
    """The command that runs this seed again."""
    return f"malleus-chaos --seeds {sched.seed} --world {world} --steps {steps}"


def _mount(disk: Path, mb: int) -> bool:
    disk.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(disk)],
                          capture_output=True).returncode == 0


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _last_step(run: Path) -> int:
    return max((r["step"] for r in read_live(run) if "event" not in r), default=-1)


def run_one(sched: Schedule, out: Path, reference: list[float], opts: Options = Options(),
            say=print) -> tuple[Verdict, list[Injection]]:
    """Run ``sched`` in ``out`` (a fresh folder) and judge it."""
    out.mkdir(parents=True, exist_ok=True)
    run, disk = out / "run", out / "disk"
    mounted = _mount(disk, opts.disk_mb)
    ck = disk / "ck"
    cmd = command(sched, run, ck, opts)
    (out / "command.txt").write_text(shlex.join(cmd) + "\n")
    t0 = time.monotonic()
    pending, active, done = list(sched.live()), [], []
    pids: set[int] = set()
    codes: list[int] = []
    log = open(out / "job.log", "w")
    try:
        while True:
            p = subprocess.Popen(cmd, cwd=out, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            stopped = False
            while p.poll() is None:
                pids.update(descendants(p.pid))
                step = _last_step(run)
                # faults that are over end first: a disk made writable before the next fault
                # fills it, a filler removed before the disk turns read-only
                for inj in [i for i in active if i.fault.until is not None
                            and i.fault.until <= step]:
                    if inj.end():
                        active.remove(inj)
                for f in [f for f in pending if f.step <= step]:
                    pending.remove(f)
                    inj = inject(f, p.pid, disk if mounted else None)
                    done.append(inj)
                    active.append(inj)
                    stopped |= f.kind == "sigterm" and inj.done
                    say(f"  seed {sched.seed}: step {step}: {f.kind}"
                        + ("" if inj.done else f" not done ({inj.note})"))
                if time.monotonic() - t0 > opts.budget_s:
                    for pid in descendants(p.pid) + [p.pid]:
                        os.kill(pid, signal.SIGKILL)
                    say(f"  seed {sched.seed}: over the budget of {opts.budget_s:g} s: killed")
                    break
                time.sleep(0.05)
            codes.append(p.wait())
            if not (stopped and codes[-1] != 0 and time.monotonic() - t0 < opts.budget_s):
                break
            say(f"  seed {sched.seed}: the job stopped (exit {codes[-1]}): the same command "
                f"again")
    finally:
        for inj in active + active:     # twice: one undo may free what another needs
            inj.end()
        log.close()
    time.sleep(0.5)                 # a process the job left behind has had time to show itself
    v = judge(sched, run, ck, codes, reference, pids, opts.hang_timeout_s)
    v.seconds = time.monotonic() - t0
    if mounted:
        _keep_ck_facts(ck, out)
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    return v, done


def _keep_ck_facts(ck: Path, out: Path) -> None:
    """What the checkpoint tmpfs held, written beside the run (the tmpfs goes away)."""
    try:
        latest = (ck / "latest").read_text().strip()
    except OSError:
        latest = None
    tags = sorted(d.name for d in ck.iterdir() if d.is_dir()) if ck.is_dir() else []
    (out / "checkpoints.json").write_text(json.dumps({"latest": latest, "tags": tags}) + "\n")
