"""What a pipeline rank puts on the wire, and NCCL's rules for it (pure: no processes).

NCCL matches a pair's point-to-point messages by order, not by tag, and (without ``device_id``
at init) single ``isend``/``recv`` travel on another communicator than ``batch_isend_irecv``.
Gloo matches by tag and forgives both, so the rules are checked here, for any plan:

* :func:`pipeline_peers`: whom a rank receives activations/gradients from and sends them to
  (receiver ``k`` of the next stage gets activations from sender ``k % g``; gradients likewise);
* :func:`wire_calls`: how the engine issues a rank's 1F1B stream (``schedule.one_f_one_b``): EVERY
  message goes through ``batch_isend_irecv`` (one API, so one communicator), and a send directly
  followed by a receive is ONE call (Megatron's ``send_forward_recv_backward``);
* :func:`nccl_problems`: for every ordered pair (src, dst), the k-th message src sends must be the
  k-th one dst receives (same kind, micro-batch and API), and the calls, run the way NCCL runs
  them (each rank's calls in order on one stream; a call ends when each of its messages met its
  partner in the peer's *current* call), must all finish: no deadlock.

``p2p.PipelineP2P`` executes exactly :func:`wire_calls`; tests/unit/engine/test_wire.py checks
:func:`nccl_problems` over random plans and tests/integration/test_p2p_order.py logs real calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..plan import Plan
from ..schedule import Instr, RecvAct, RecvGrad, SendAct, SendGrad, one_f_one_b

#: the one p2p API the engine uses
API = "batch_isend_irecv"


@dataclass(frozen=True)
class Peers:
    """A pipeline rank's neighbours (None / [] at the pipeline's ends)."""

    act_src: int | None
    act_dsts: tuple[int, ...]
    grad_src: int | None
    grad_dsts: tuple[int, ...]


def pipeline_peers(plan: Plan, rank: int) -> Peers | None:
    """``rank``'s neighbours under ``plan`` (None: suspended or not in the plan)."""
    loc = plan.locate(rank)
    if loc is None:
        return None
    i, j = loc
    stages = plan.pipelines[i].stages
    me = stages[j]
    prev = stages[j - 1] if j > 0 else None
    nxt = stages[j + 1] if j + 1 < len(stages) else None
    tp_rank = me.ranks.index(rank)
    return Peers(
        act_src=prev.ranks[tp_rank % prev.tp] if prev else None,
        act_dsts=tuple(r for k, r in enumerate(nxt.ranks) if k % me.tp == tp_rank) if nxt else (),
        grad_src=nxt.ranks[tp_rank % nxt.tp] if nxt else None,
        grad_dsts=tuple(r for t, r in enumerate(prev.ranks) if t % me.tp == tp_rank)
        if prev else ())


def wire_calls(stream: Sequence[Instr]) -> list[tuple[Instr, ...]]:
    """The instruction stream cut into what the engine runs one at a time: a send directly
    followed by a receive is one ``(send, recv)`` call; every other instruction is on its own."""
    out: list[tuple[Instr, ...]] = []
    i = 0
    while i < len(stream):
        ins = stream[i]
        nxt = stream[i + 1] if i + 1 < len(stream) else None
        if isinstance(ins, (SendAct, SendGrad)) and isinstance(nxt, (RecvAct, RecvGrad)):
            out.append((ins, nxt))
            i += 2
        else:
            out.append((ins,))
            i += 1
    return out


@dataclass(frozen=True)
class Op:
    """One message end: ``rank`` sends to / receives from ``peer``."""

    rank: int
    send: bool
    peer: int
    kind: str            # "act" | "grad"
    micro_batch: int
    api: str = API

    @property
    def pair(self) -> tuple[int, int]:
        return (self.rank, self.peer) if self.send else (self.peer, self.rank)


def rank_calls(stream: Sequence[Instr], peers: Peers, rank: int) -> list[tuple[Op, ...]]:
    """The p2p calls ``rank`` issues, in order (compute instructions dropped)."""
    out = []
    for call in wire_calls(stream):
        ops: list[Op] = []
        for ins in call:
            if isinstance(ins, SendAct):
                ops += [Op(rank, True, d, "act", ins.micro_batch) for d in peers.act_dsts]
            elif isinstance(ins, SendGrad):
                ops += [Op(rank, True, d, "grad", ins.micro_batch) for d in peers.grad_dsts]
            elif isinstance(ins, RecvAct):
                ops.append(Op(rank, False, peers.act_src, "act", ins.micro_batch))
            elif isinstance(ins, RecvGrad):
                ops.append(Op(rank, False, peers.grad_src, "grad", ins.micro_batch))
        if ops:
            out.append(tuple(ops))
    return out


def plan_calls(plan: Plan) -> dict[int, list[tuple[Op, ...]]]:
    """Every active rank's p2p calls for one step of ``plan``."""
    out = {}
    for p in plan.pipelines:
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            stream = one_f_one_b(j, S, p.micro_batches)
            for r in s.ranks:
                out[r] = rank_calls(stream, pipeline_peers(plan, r), r)
    return out


def order_problems(calls: dict[int, list[tuple[Op, ...]]]) -> list[str]:
    """Per ordered pair: the k-th message sent must be the k-th received (kind, micro-batch,
    API). Returns one line per mismatch (empty: NCCL's matching by order pairs them right)."""
    sent: dict[tuple[int, int], list[Op]] = {}
    got: dict[tuple[int, int], list[Op]] = {}
    for r, cs in calls.items():
        for c in cs:
            for op in c:
                (sent if op.send else got).setdefault(op.pair, []).append(op)
    out = []
    for pair in sorted(set(sent) | set(got)):
        s, g = sent.get(pair, []), got.get(pair, [])
        if len(s) != len(g):
            out.append(f"{pair[0]}->{pair[1]}: {len(s)} sent, {len(g)} received")
        for k, (a, b) in enumerate(zip(s, g)):
            if (a.kind, a.micro_batch, a.api) != (b.kind, b.micro_batch, b.api):
                out.append(f"{pair[0]}->{pair[1]} message {k}: sent {a.kind} {a.micro_batch} via "
                           f"{a.api}, received as {b.kind} {b.micro_batch} via {b.api}")
    return out


def deadlock_problems(calls: dict[int, list[tuple[Op, ...]]]) -> list[str]:
    """Run the calls as NCCL does (module doc); the ranks stuck and on what, or []."""
    pos = {r: 0 for r in calls}
    done: dict[int, set[int]] = {r: set() for r in calls}        # finished op indices of the call

    def current(r: int) -> tuple[Op, ...]:
        return calls[r][pos[r]] if r in calls and pos[r] < len(calls[r]) else ()

    progress = True
    while progress:
        progress = False
        for r in calls:
            c = current(r)
            for k, op in enumerate(c):
                if k in done[r]:
                    continue
                other = current(op.peer)
                for m, o in enumerate(other):
                    if (m not in done[op.peer] and o.peer == r and o.send != op.send
                            and (o.kind, o.micro_batch) == (op.kind, op.micro_batch)):
                        done[r].add(k)
                        done[op.peer].add(m)
                        progress = True
                        break
            for q in list(calls):      # advance every rank whose current call is complete
                while pos[q] < len(calls[q]) and len(done[q]) == len(current(q)):
                    pos[q] += 1
                    done[q] = set()
                    progress = True
    stuck = [r for r in calls if pos[r] < len(calls[r])]
    return [f"rank {r} stuck in call {pos[r]}: " + ", ".join(
        f"{'send' if o.send else 'recv'} {o.kind} {o.micro_batch} "
        f"{'to' if o.send else 'from'} {o.peer}" for o in current(r)) for r in stuck]


def nccl_problems(plan: Plan) -> list[str]:
    """Everything :func:`order_problems` and :func:`deadlock_problems` find for ``plan``."""
    calls = plan_calls(plan)
    return order_problems(calls) + deadlock_problems(calls)
