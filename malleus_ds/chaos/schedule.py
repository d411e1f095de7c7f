"""A fault schedule drawn from a seed: which faults hit a job, where, and for how long.

Every kind of fault the job handles, on one machine:

==============  =====================================================  ======================
kind            what happens                                           what it may cost
==============  =====================================================  ======================
straggler       a rank emulated ``rate`` x slower for some steps       nothing (re-planned)
                (``straggler.schedule``, given at launch)
slow_link       a pair of ranks' messages emulated ``rate`` x slower   nothing
                (``straggler.link_schedule``, given at launch)
quota           a rank's process capped to 1/``rate`` of a core by a   nothing
                cgroup, from one step to a later one
freeze          a rank stopped (SIGSTOP) for ``seconds``, shorter      nothing
                than the hang timeout, then continued
hang            a rank stopped for good: longer than the hang timeout  one restart
kill            a rank killed (SIGKILL)                                one restart
node_loss       the second of two nodes (its torchrun agent and        two restarts (shrink,
                ranks) killed; started again some steps later          then grow back)
sigterm         the launcher gets SIGTERM; the same command again      a stop and a rerun
planner_kill    rank 0's planner process killed                        nothing
disk_full       the checkpoint disk filled to the last byte for        nothing
                some steps
disk_ro         the checkpoint disk read-only for some steps           nothing
==============  =====================================================  ======================

None of these is fatal to the job as the campaign runs it (``max_restarts`` 4, at most two
deaths a run, every model fits the survivors). What is fatal, and how the job says so (one line,
exit code 1): more deaths than ``max_restarts`` (torchrun gives up: "the job failed after N
restart(s)"); survivors of a lost node that cannot hold the model ("cannot hold the model",
tests/integration/test_elastic_nodes.py); the save at the run's end failing 3 tries in a row
(``CheckpointSaveError``, naming the latest checkpoint on disk; a periodic save that fails costs
a warning and a retry, and a stop whose save fails stops all the same, naming the checkpoint
the next run continues from).

A ``node_loss`` needs an even world of 4 or more: the job then runs as two torchrun agents
(``chaos/nodes.py``) and no ``sigterm`` is drawn with it (there is no one launcher to signal).

A schedule is pure data: the same seed gives the same faults (:func:`draw`), printed before the
run (:meth:`Schedule.lines`). Steps are the job's optimizer steps; a fault fires once the job
has reported that step (event-driven: the runner reads metrics.jsonl).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

#: every fault kind, in the order the table lists them
KINDS = ("straggler", "slow_link", "quota", "freeze", "hang", "kill", "node_loss", "sigterm",
         "planner_kill", "disk_full", "disk_ro")
#: the kinds that end a rank's process: each may cost one restart of the job
DEATHS = ("hang", "kill", "node_loss")
#: the restarts each death may cost: a lost node's return restarts the survivors once more
RESTARTS = {"hang": 1, "kill": 1, "node_loss": 2}
#: the kinds that slow the job without ending a process: what stock DeepSpeed is run under to
#: compare throughput (``malleus-chaos --against-stock``). Not a slow link: the emulation slows
#: engine=malleus's own messages, and engine=deepspeed sends its own (a seed with one is not
#: compared)
SLOWDOWNS = ("straggler", "quota", "freeze")
#: the kinds set on the command line rather than done to a running job
AT_LAUNCH = ("straggler", "slow_link")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` at step ``step`` (until ``until``, where it lasts), on ``rank``."""

    kind: str
    step: int
    rank: int = 0                   # (node_loss: the node, 1: the second agent's ranks)
    until: int | None = None        # the step it ends at (straggler, slow_link, quota, disk_*,
                                    # node_loss: the node returns)
    rate: float | None = None       # how much slower (straggler, slow_link, quota)
    seconds: float | None = None    # how long (freeze)
    peer: int | None = None         # the other end of a slow link

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: one of {', '.join(KINDS)}")

    def text(self) -> str:
        at = f"step {self.step}" + (f"-{self.until}" if self.until is not None else "")
        what = {"straggler": lambda: f"rank {self.rank} at rate {self.rate:g}",
                "slow_link": lambda: f"link {self.rank}-{self.peer} at rate {self.rate:g}",
                "quota": lambda: f"rank {self.rank} capped to 1/{self.rate:g} of a core",
                "freeze": lambda: f"rank {self.rank} stopped for {self.seconds:g} s",
                "hang": lambda: f"rank {self.rank} stopped for good",
                "kill": lambda: f"rank {self.rank} killed",
                "node_loss": lambda: f"node {self.rank} lost (agent and ranks killed), back "
                                     f"at step {self.until}",
                "sigterm": lambda: "SIGTERM to the launcher, then the same command again",
                "planner_kill": lambda: "rank 0's planner process killed",
                "disk_full": lambda: "the checkpoint disk full",
                "disk_ro": lambda: "the checkpoint disk read-only"}[self.kind]()
        return f"{at:>12}  {self.kind:<12} {what}"


@dataclass(frozen=True)
class Schedule:
    """The faults of one run, by step."""

    seed: int
    steps: int
    world: int
    faults: tuple[Fault, ...] = field(default=())

    def count(self, kind: str) -> int:
        return sum(f.kind == kind for f in self.faults)

    @property
    def deaths(self) -> int:
        return sum(f.kind in DEATHS for f in self.faults)

    @property
    def restarts_allowed(self) -> int:
        """The most restarts the faults may cost (:data:`RESTARTS`)."""
        return sum(RESTARTS.get(f.kind, 0) for f in self.faults)

    @property
    def two_nodes(self) -> bool:
        """The job runs as two torchrun agents (a node is lost)."""
        return any(f.kind == "node_loss" for f in self.faults)

    @property
    def comparable(self) -> bool:
        """Whether stock DeepSpeed can run this schedule's slowdowns as they hit the job: it
        slows a rank, has no slow link (engine=deepspeed has no slow-link emulation) and loses
        no node (the job then runs a while on half the ranks, another job's pace on a shared
        CPU)."""
        return bool(self.slowdowns().faults) and not self.count("slow_link") \
            and not self.two_nodes

    def slowdowns(self) -> "Schedule":
        """The same schedule with only its :data:`SLOWDOWNS` (what the stock run meets)."""
        return Schedule(self.seed, self.steps, self.world,
                        tuple(f for f in self.faults if f.kind in SLOWDOWNS))

    def at_launch(self) -> list[Fault]:
        return [f for f in self.faults if f.kind in AT_LAUNCH]

    def live(self) -> list[Fault]:
        """The faults done to the running job, in step order."""
        return sorted((f for f in self.faults if f.kind not in AT_LAUNCH),
                      key=lambda f: (f.step, KINDS.index(f.kind)))

    def lines(self) -> list[str]:
        head = f"seed {self.seed}: {len(self.faults)} fault(s), {self.steps} steps, " \
               f"{self.world} ranks"
        return [head] + ["  " + f.text() for f in sorted(self.faults, key=lambda f: f.step)]

    def json(self) -> dict:
        return {"seed": self.seed, "steps": self.steps, "world": self.world,
                "faults": [{k: v for k, v in asdict(f).items() if v is not None}
                           for f in self.faults]}


def draw(seed: int, steps: int, world: int, kinds: tuple[str, ...] = KINDS,
         faults: tuple[int, int] = (2, 4), max_deaths: int = 2) -> Schedule:
    """A schedule of ``faults[0]..faults[1]`` faults of ``kinds`` for a job of ``world`` ranks
    and ``steps`` steps, from ``seed`` alone. Live faults land in the middle of the run (after
    the first checkpoint, before the last steps); at most ``max_deaths`` of them end a process;
    one ``sigterm`` at most (its rerun is the run's second half); one ``node_loss`` at most, only
    on an even world of 4 or more, and never with a ``sigterm``."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"fault kinds {bad}: not among {', '.join(KINDS)}")
    if world < 2 or steps < 12:
        raise ValueError(f"a campaign job needs 2 or more ranks and 12 or more steps, got "
                         f"world={world}, steps={steps}")
    rng = random.Random(seed)
    lo, hi = 3, steps - 4
    out: list[Fault] = []
    deaths = sigterms = nodes = 0
    for _ in range(rng.randint(*faults)):
        kind = rng.choice(kinds)
        if (kind in DEATHS and deaths >= max_deaths) or (kind == "sigterm" and (sigterms or nodes)) \
                or (kind == "node_loss" and (nodes or sigterms or world < 4 or world % 2)):
            kind = "straggler"
        deaths += kind in DEATHS
        sigterms += kind == "sigterm"
        nodes += kind == "node_loss"
        step = rng.randint(lo, hi)
        rank = rng.randrange(world)
        span = rng.randint(3, 8)
        if kind == "straggler":
            out.append(Fault(kind, step, rank, until=min(steps, step + span),
                             rate=rng.choice((2.0, 3.0, 5.0))))
        elif kind == "slow_link":
            peer = rng.choice([r for r in range(world) if r != rank])
            out.append(Fault(kind, step, rank, until=min(steps, step + span),
                             rate=rng.choice((5.0, 20.0)), peer=peer))
        elif kind == "quota":
            out.append(Fault(kind, step, rank, until=min(steps, step + span),
                             rate=rng.choice((3.0, 10.0))))
        elif kind == "freeze":
            out.append(Fault(kind, step, rank, seconds=rng.choice((1.0, 3.0))))
        elif kind in ("disk_full", "disk_ro"):
            out.append(Fault(kind, step, until=min(steps - 1, step + span)))
        elif kind == "node_loss":
            # in the first half, back 4-8 steps later: a returning agent takes 10-15 steps to
            # start and join (two_nodes jobs run 4x the samples a step for that, run.batch_of)
            step = min(step, max(lo, steps // 2 - 4))
            out.append(Fault(kind, step, 1, until=min(steps - 2, step + max(span, 4))))
        elif kind in ("sigterm", "planner_kill"):
            out.append(Fault(kind, step))
        else:                       # hang, kill
            out.append(Fault(kind, step, rank))
    return Schedule(seed, steps, world, tuple(sorted(out, key=lambda f: (f.step, f.kind))))
