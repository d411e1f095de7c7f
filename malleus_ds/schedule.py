"""1F1B pipeline schedules for heterogeneous pipelines, as lists of instruction objects, and the
one event simulator that runs them.

After DeepSpeed's ``runtime/pipe/schedule.py``: a schedule is plain data (frozen dataclasses with
a short printable form), the engine dispatches each instruction through a table, and the schedule
is tested with no processes at all (``run_streams``, the event simulator).

Each pipeline of a plan gets its own schedule (its own stage count ``S`` and micro-batch count
``m``); pipelines never exchange activations, so they need no common clock. Stage ``j`` of ``S``
runs the classic non-interleaved 1F1B:

    warmup    = min(S - j - 1, m) forwards
    steady    = (m - warmup) x (forward, backward)
    cooldown  = warmup backwards

so at most ``S - j`` micro-batches of activations are alive on stage ``j`` (the memory model of
DESIGN.md §3). Sends are asynchronous (``isend``) and receives block. ``run_streams`` executes
streams under exactly this rule, with a duration per instruction: with zero durations it is the
deadlock check (``replay_streams``: every rank's stream completes and every send is matched by
one receive of the same shape of message); with real ones it gives the timeline
(``simulate.build_timeline``, ``malleus-sim``).

Printable forms: ``"2F0"`` stage 2 forward micro-batch 0, ``"2B0"`` backward, ``"1RA3"`` /
``"1SA3"`` receive / send activation of micro-batch 3, ``"1RG3"`` / ``"1SG3"`` gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence

from .plan import Plan


@dataclass(frozen=True)
class Instr:
    stage: int
    micro_batch: int
    code = "?"

    def __str__(self) -> str:
        return f"{self.stage}{self.code}{self.micro_batch}"

    __repr__ = __str__


@dataclass(frozen=True, repr=False)
class Forward(Instr):
    code = "F"


@dataclass(frozen=True, repr=False)
class Backward(Instr):
    code = "B"


@dataclass(frozen=True, repr=False)
class RecvAct(Instr):
    """Receive the input activation of ``micro_batch`` from stage ``stage - 1``."""
    code = "RA"


@dataclass(frozen=True, repr=False)
class SendAct(Instr):
    """Send the output activation of ``micro_batch`` to stage ``stage + 1`` (asynchronous)."""
    code = "SA"


@dataclass(frozen=True, repr=False)
class RecvGrad(Instr):
    """Receive the gradient of this stage's output for ``micro_batch`` from ``stage + 1``."""
    code = "RG"


@dataclass(frozen=True, repr=False)
class SendGrad(Instr):
    """Send the gradient of this stage's input for ``micro_batch`` to ``stage - 1`` (async)."""
    code = "SG"


_CODES = {c.code: c for c in (Forward, Backward, RecvAct, SendAct, RecvGrad, SendGrad)}


def parse(text: str) -> Instr:
    """Inverse of ``str(instr)``: ``parse("2F0") == Forward(2, 0)``."""
    i = 0
    while i < len(text) and text[i].isdigit():
        i += 1
    k = i
    while k < len(text) and not text[k].isdigit():
        k += 1
    return _CODES[text[i:k]](int(text[:i]), int(text[k:]))


def one_f_one_b(stage: int, num_stages: int, micro_batches: int) -> list[Instr]:
    """The 1F1B instruction stream of stage ``stage`` of a pipeline of ``num_stages`` stages."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")
    first, last = stage == 0, stage == num_stages - 1
    out: list[Instr] = []

    def fwd(k: int) -> None:
        if not first:
            out.append(RecvAct(stage, k))
        out.append(Forward(stage, k))
        if not last:
            out.append(SendAct(stage, k))

    def bwd(k: int) -> None:
        if not last:
            out.append(RecvGrad(stage, k))
        out.append(Backward(stage, k))
        if not first:
            out.append(SendGrad(stage, k))

    warmup = max(0, in_flight(stage, num_stages, micro_batches) - 1)   # forwards before 1F1B
    for k in range(warmup):
        fwd(k)
    for i in range(micro_batches - warmup):
        fwd(warmup + i)
        bwd(i)
    for k in range(micro_batches - warmup, micro_batches):
        bwd(k)
    return out


def plan_schedules(plan: Plan) -> dict[int, list[Instr]]:
    """Instruction stream of every active rank of ``plan`` (TP ranks of a stage share one)."""
    out: dict[int, list[Instr]] = {}
    for p in plan.pipelines:
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            stream = one_f_one_b(j, S, p.micro_batches)
            for r in s.ranks:
                out[r] = stream
    return out


def in_flight(stage: int, num_stages: int, micro_batches: int) -> int:
    """The 1F1B in-flight rule, its one home: stage ``stage`` of ``num_stages`` holds the
    activations of at most ``min(S - j, m)`` micro-batches at once (its warm-up forwards and the
    one before its first backward). :func:`one_f_one_b` runs it, the memory model charges it
    (``cost.stage_memory_terms``), and a test holds :func:`max_in_flight` of every stream to it."""
    return min(num_stages - stage, micro_batches)


def max_in_flight(stream: Iterable[Instr]) -> int:
    """Most micro-batches whose forward ran but whose backward did not, at any point."""
    live = peak = 0
    for ins in stream:
        if isinstance(ins, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(ins, Backward):
            live -= 1
    return peak


class ScheduleError(RuntimeError):
    """A set of instruction streams would deadlock or leave messages unmatched."""


class Event(NamedTuple):
    """One instruction as the simulator ran it: ``instr`` (whose ``stage`` is the stream it came
    from) from ``start`` to ``end``. (A named tuple: the simulator makes one per instruction.)"""

    instr: Instr
    start: float
    end: float

    def __str__(self) -> str:
        return str(self.instr)


def _zero(ins: Instr) -> float:
    return 0.0


def run_streams(streams: Sequence[Sequence[Instr]],
                duration: Callable[[Instr], float] = _zero,
                latency: Callable[[Instr], float] = _zero) -> list[Event]:
    """THE event simulator: execute the streams of one pipeline (``streams[j]`` = stage ``j``)
    under the engine's rule, timing each instruction.

    Each stage runs its stream in order, one instruction at a time. Sends never block; a receive
    blocks until the matching send was issued. ``duration(ins)`` is how long stage ``ins.stage``
    is busy with ``ins``; ``latency(send)`` how long the message of a send takes to arrive after
    the send ends. An instruction starts when its stage is free and, for a receive, when the
    message has arrived. Zero durations (the defaults) make it the deadlock check
    (:func:`replay_streams`); real ones give the timeline (``simulate.build_timeline``).

    Returns the events in a global execution order (stage 0 runs as far as it can, then stage
    1, ..., round and round); raises ``ScheduleError`` on deadlock, on a receive whose message
    never comes, or on a send nobody receives.
    """
    S = len(streams)
    pc = [0] * S
    free = [0.0] * S                                  # when each stage is next idle
    sent: dict[tuple[str, int, int], float] = {}      # ("A"|"G", from stage, mb) -> arrival
    received: set[tuple[str, int, int]] = set()
    events: list[Event] = []
    left = sum(len(st) for st in streams)
    while left:
        progressed = False
        for j in range(S):
            ran = _run_stage(j, streams, pc, free, sent, received, events, duration, latency)
            left -= ran
            progressed = progressed or ran > 0
        if not progressed:
            stuck = {j: str(streams[j][pc[j]]) for j in range(S) if pc[j] < len(streams[j])}
            raise ScheduleError(f"deadlock: stages blocked at {stuck}")
    unmatched = set(sent) - received
    if unmatched:
        raise ScheduleError(f"sends never received: {sorted(unmatched)}")
    return events


def _run_stage(j: int, streams: Sequence[Sequence[Instr]], pc: list[int], free: list[float],
               sent: dict[tuple[str, int, int], float], received: set[tuple[str, int, int]],
               events: list[Event], duration: Callable[[Instr], float],
               latency: Callable[[Instr], float]) -> int:
    """Run stage ``j``'s stream from ``pc[j]`` as far as it can (to a receive whose message
    was not sent yet, or its end), updating the shared state; the instructions it ran."""
    S = len(streams)
    stream, n = streams[j], len(streams[j])
    ran = 0
    while pc[j] < n:
        ins = stream[pc[j]]
        if ins.stage != j:
            raise ScheduleError(f"stream {j} holds {ins} of another stage")
        start = free[j]
        cls = type(ins)
        if cls is RecvAct or cls is RecvGrad:
            key = ("A", j - 1, ins.micro_batch) if cls is RecvAct else \
                ("G", j + 1, ins.micro_batch)
            arrival = sent.get(key)
            if arrival is None:
                break
            received.add(key)
            if arrival > start:
                start = arrival
        end = start + duration(ins)
        if cls is SendAct:
            if j + 1 >= S:
                raise ScheduleError(f"{ins}: last stage sends an activation")
            sent[("A", j, ins.micro_batch)] = end + latency(ins)
        elif cls is SendGrad:
            if j == 0:
                raise ScheduleError(f"{ins}: first stage sends a gradient")
            sent[("G", j, ins.micro_batch)] = end + latency(ins)
        events.append(Event(ins, start, end))
        free[j] = end
        pc[j] += 1
        ran += 1
    return ran


def replay_streams(streams: Sequence[Sequence[Instr]]) -> list[str]:
    """The deadlock check: :func:`run_streams` with zero durations. Returns the global
    execution order (for printing); raises ``ScheduleError`` as :func:`run_streams` does."""
    return [str(e) for e in run_streams(streams)]
