"""One campaign run: a real multi-rank ``engine=malleus`` job under a seed's faults, judged.

The job is the app's own launcher (``launch/train.py nproc_per_node=N max_restarts=R``,
torchrun underneath) with the adaptive loop on, ``checkpoint.every=2``, ``checkpoint.keep=2``,
``checkpoint.resume=auto`` and a short hang timeout; its checkpoint folder is on a tmpfs of its
own when this machine can mount one (a ``disk_full`` fault fills it, a ``disk_ro`` one makes it
read-only). The runner watches
metrics.jsonl and does each live fault once the job has reported its step; a SIGTERM stops the
job, and the same command runs again. A schedule with a ``node_loss`` runs the job as two
torchrun agents instead (:class:`TwoNodes`): the fault kills the second with its ranks, and
starts it again at its end step once the survivors train on the smaller world. Then
:func:`~malleus_ds.chaos.verdict.judge`.
"""
from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..report.metrics import read_live
from ..resilience.procs import descendants
from .inject import Injection, inject
from .nodes import agent_command, free_port, kill_tree, start_agent, wait_hosting
from .schedule import Fault, Schedule
from .verdict import Verdict, judge

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "train.py"
#: the job: a small decoder (``model.max_seq_len``: :attr:`Options.seq_len`), 8 samples a step
#: in micro-batches of 1 (:func:`batch_of`)
JOB = ("model=tiny", "progress=false", "engine=malleus")


@dataclass(frozen=True)
class Options:
    """The campaign's job settings (the same for every seed)."""

    hang_timeout_s: float = 12.0
    max_restarts: int = 4
    budget_s: float = 420.0         # a run still going after this is killed and judged as is
    disk_mb: int = 32               # the checkpoint tmpfs
    global_batch_size: int | None = None    # None: :func:`batch_of` the schedule
    #: tokens a sample; with a bigger batch, steps long enough that the pace against stock
    #: measures the stragglers, not each engine's fixed cost a step (``--seq-len``)
    seq_len: int = 16
    #: each step's loss against the one-process run's (``--rtol``). Bigger jobs need more: on
    #: 64 samples of 64 tokens, stock DeepSpeed itself reads 4e-5 off it at one step
    rtol: float = 1e-5


def batch_of(sched: Schedule) -> int:
    """Samples a step: 8 (steps of ~0.1 s on 4 CPU ranks), 32 when a node is lost: its agent
    takes 10-15 steps to start again and join, and the job must still be running then."""
    return 32 if sched.two_nodes else 8


@functools.lru_cache(maxsize=4)
def _reference(steps: int, batch: int, seq_len: int = 16) -> tuple[float, ...]:
    from ..app.reference import reference_run
    from ..models import model_config

    ref, _ = reference_run(model_config("tiny", max_seq_len=seq_len), seed=0, steps=steps,
                           global_batch_size=batch, micro_batch_size=1)
    return tuple(float(x) for x in ref)


def reference(sched: Schedule, opts: "Options | None" = None) -> list[float]:
    """The fault-free one-process losses of ``sched``'s job, steps 0..steps-1."""
    opts = opts or Options()
    return list(_reference(sched.steps, opts.global_batch_size or batch_of(sched), opts.seq_len))


def _literal(entries: list[dict]) -> str:
    return "[" + ",".join("{" + ",".join(f"{k}:{json.dumps(v)}" for k, v in e.items()) + "}"
                          for e in entries) + "]"


def script(sched: Schedule, run: Path, ck: Path, opts: Options,
           engine: str = "malleus") -> list[str]:
    """What every rank runs for ``sched`` (its at-launch faults included): launch/train.py and
    its overrides, without the launcher's (``nproc_per_node``, ``max_restarts``)."""
    strag = [{"rank": f.rank, "rate": f.rate, "start_step": f.step, "end_step": f.until}
             for f in sched.at_launch() if f.kind == "straggler"]
    links = [dict(_link_ends(sched, f.rank, f.peer), rate=f.rate, start_step=f.step,
                  end_step=f.until) for f in sched.at_launch() if f.kind == "slow_link"]
    job = [a for a in JOB if not a.startswith("engine=")] + [f"engine={engine}"]
    batch = opts.global_batch_size or batch_of(sched)
    return [str(TRAIN), *job, f"model.max_seq_len={opts.seq_len}", f"train.steps={sched.steps}",
            f"train.global_batch_size={batch}",
            f"checkpoint.dir={ck}", "checkpoint.every=2", "checkpoint.keep=2",
            "checkpoint.resume=auto", f"hang_timeout_s={opts.hang_timeout_s:g}",
            f"hydra.run.dir={run}", f"straggler.schedule={_literal(strag)}",
            f"straggler.link_schedule={_literal(links)}"]


def _link_ends(sched: Schedule, a: int, b: int) -> dict:
    """A slow link's ends as the job names them: two ranks of one node, or the two nodes of a
    two-agent job (``straggler.link_schedule`` refuses ranks on different nodes)."""
    per_node = sched.world // 2 if sched.two_nodes else sched.world
    if a // per_node == b // per_node:
        return {"ranks": [a, b]}
    return {"nodes": sorted((a // per_node, b // per_node))}


def command(sched: Schedule, run: Path, ck: Path, opts: Options,
            engine: str = "malleus") -> list[str]:
    """The job's command line for ``sched`` under the app's own launcher: :func:`script` with
    the launcher's overrides first (Hydra reads overrides in any order)."""
    train, *args = script(sched, run, ck, opts, engine)
    return [sys.executable, train, f"nproc_per_node={sched.world}",
            f"max_restarts={opts.max_restarts}", *args]


class OneLauncher:
    """The job under the app's launcher (``launch/train.py nproc_per_node=N``, torchrun
    underneath): one process tree, the one a SIGTERM goes to."""

    def __init__(self, cmd: list[str], cwd: Path, log):
        self.cmd, self.cwd, self.log, self.p = cmd, cwd, log, None

    def start(self) -> None:
        self.p = subprocess.Popen(self.cmd, cwd=self.cwd, env=_env(), stdout=self.log,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def roots(self) -> list[int]:
        return [self.p.pid]

    def running(self) -> bool:
        return self.p.poll() is None

    def tick(self, rows: list[dict], say) -> None:
        pass

    def lose_node(self, f: Fault) -> Injection:
        return Injection(f, note="the job runs on one node (a node_loss runs it as two agents)")

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            kill_tree(self.p)

    def wait(self) -> int:
        return self.p.wait()


class TwoNodes:
    """The job as two torchrun agents of ``world / 2`` ranks each (``chaos/nodes.py``): the first
    hosts the rendezvous store and is the job's exit code; the second can be lost
    (:meth:`lose_node`) and returns at the fault's end step once the survivors have trained on
    their own (:meth:`tick`)."""

    #: a returned node still waiting this long after the job ended came back too late to join
    LATE_S = 60.0

    def __init__(self, script: list[str], world: int, max_restarts: int, cwd: Path, out: Path):
        self.port = free_port()
        self.cmd = agent_command(self.port, world // 2, script, max_restarts,
                                 rdzv_id=f"chaos-{self.port}")
        self.world, self.cwd, self.out = world, cwd, out
        self.a = self.b = None
        self.lost: Fault | None = None
        self.returned = False

    def start(self) -> None:
        self.a = start_agent(self.cmd, self.cwd, self.out / "job.log")
        wait_hosting(self.port, self.a)
        self.b = start_agent(self.cmd, self.cwd, self.out / "node1.log")

    def roots(self) -> list[int]:
        return [p.pid for p in (self.a, self.b) if p is not None and p.poll() is None]

    def running(self) -> bool:
        return self.a.poll() is None

    def lose_node(self, f: Fault) -> Injection:
        if self.lost is not None or self.b is None or self.b.poll() is not None:
            return Injection(f, note="the second node is not running")
        kill_tree(self.b)
        self.b, self.lost = None, f
        return Injection(f, done=True)

    def tick(self, rows: list[dict], say) -> None:
        """Start the lost node again once its end step is reported and the survivors have run
        two steps on their own (a node back before they restarted would only join their
        restart's rendezvous, and not be seen to return)."""
        f = self.lost
        if f is None or self.returned:
            return
        steps = [r for r in rows if "event" not in r]
        alone = [r for r in steps if len(r.get("compute_s", ())) == self.world // 2]
        if len(alone) >= 2 and max(r["step"] for r in steps) >= f.until:
            self.b = start_agent(self.cmd, self.cwd, self.out / "node1-back.log")
            self.returned = True
            say(f"  node 1 is back (step {max(r['step'] for r in steps)})")

    def kill(self) -> None:
        for p in (self.a, self.b):
            if p is not None and p.poll() is None:
                kill_tree(p)

    def wait(self) -> int:
        code = self.a.wait()
        if self.b is not None:
            try:
                self.b.wait(self.LATE_S)
            except subprocess.TimeoutExpired:
                kill_tree(self.b)       # back after the job's last rendezvous: nothing to join
        return code


def replay_line(sched: Schedule, world: int, steps: int, kinds: str | None = None,
                faults: str | None = None, job: str = "") -> str:
    """The command that runs this seed again (with the campaign's ``--kinds`` and ``--faults``
    where they were not the defaults: the same seed draws another schedule under others;
    ``job``: the job-size options given, e.g. ``--batch 64 --seq-len 64``)."""
    return f"malleus-chaos --seeds {sched.seed} --world {world} --steps {steps}" \
        + (f" --kinds {kinds}" if kinds else "") + (f" --faults {faults}" if faults else "") \
        + (f" {job}" if job else "")


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


def _last_step(rows: list[dict]) -> int:
    return max((r["step"] for r in rows if "event" not in r), default=-1)


def run_one(sched: Schedule, out: Path, reference: list[float], opts: Options = Options(),
            say=print, engine: str = "malleus") -> tuple[Verdict, list[Injection]]:
    """Run ``sched`` in ``out`` (a fresh folder) on ``engine`` and judge it."""
    out = out.resolve()     # the launchers run in ``out``: a relative path would nest there
    out.mkdir(parents=True, exist_ok=True)
    run, disk = out / "run", out / "disk"
    mounted = _mount(disk, opts.disk_mb)
    ck = disk / "ck"
    t0 = time.monotonic()
    pending, active, done = list(sched.live()), [], []
    pids: set[int] = set()
    codes: list[int] = []
    log = open(out / "job.log", "w")
    if sched.two_nodes:
        job = TwoNodes(script(sched, run, ck, opts, engine), sched.world, opts.max_restarts,
                       out, out)
        (out / "command.txt").write_text(shlex.join(job.cmd) + "   # two agents\n")
    else:
        job = OneLauncher(command(sched, run, ck, opts, engine), out, log)
        (out / "command.txt").write_text(shlex.join(job.cmd) + "\n")
    try:
        while True:
            job.start()
            stopped = False
            while job.running():
                for r in job.roots():
                    pids.update([r, *descendants(r)])
                rows = read_live(run)
                step = _last_step(rows)
                # faults that are over end first: a disk made writable before the next fault
                # fills it, a filler removed before the disk turns read-only
                for inj in [i for i in active if i.fault.until is not None
                            and i.fault.until <= step]:
                    if inj.end():
                        active.remove(inj)
                for f in [f for f in pending if f.step <= step]:
                    pending.remove(f)
                    inj = job.lose_node(f) if f.kind == "node_loss" else \
                        inject(f, job.roots(), disk if mounted else None)
                    done.append(inj)
                    active.append(inj)
                    stopped |= f.kind == "sigterm" and inj.done
                    say(f"  seed {sched.seed}: step {step}: {f.kind}"
                        + ("" if inj.done else f" not done ({inj.note})"))
                job.tick(rows, say)
                if time.monotonic() - t0 > opts.budget_s:
                    job.kill()
                    say(f"  seed {sched.seed}: over the budget of {opts.budget_s:g} s: killed")
                    break
                time.sleep(0.05)
            codes.append(job.wait())
            if not (stopped and codes[-1] != 0 and time.monotonic() - t0 < opts.budget_s):
                break
            say(f"  seed {sched.seed}: the job stopped (exit {codes[-1]}): the same command "
                f"again")
    finally:
        for inj in active + active:     # twice: one undo may free what another needs
            inj.end()
        job.kill()
        log.close()
    time.sleep(0.5)                 # a process the job left behind has had time to show itself
    v = judge(sched, run, ck, codes, reference, pids, opts.hang_timeout_s, opts.rtol)
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
