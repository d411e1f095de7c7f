"""Moving packed buffers: each round's sends and receives in one ``batch_isend_irecv``.

The order comes from ``rounds.py`` (bounded bytes in flight, deadlock-free by construction and
checked without processes). Every wait has a deadline (``malleus.migrate_timeout_s``): a peer
that fails or stops mid-migration makes every rank waiting on it raise :class:`MigrationError`
naming the step and the peers, instead of hanging.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .apply import StateView, pack_parts, unpack_parts
from .rounds import Message, rank_rounds


class MigrationError(RuntimeError):
    """A plan switch failed; the engine must not train on (possibly half-moved) state."""


#: Test hook: called as ``before_round(rank, round_index)`` on every rank before it posts a
#: round (fault-injection tests replace it to make one rank fail mid-migration).
before_round: Callable[[int, int], None] = lambda rank, t: None


@dataclass
class TransportStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_buffer_bytes: int = 0
    rounds: int = 0
    pack_s: float = 0.0
    wait_s: float = 0.0
    unpack_s: float = 0.0
    direct: int = 0             # messages sent from / received into their place (no staging)


def direct_window(sv: StateView, parts, dtype: torch.dtype) -> torch.Tensor | None:
    """The message's elements as ONE flat view of this rank's buffer when they lie back to back
    in one tensor of the wire dtype (``apply.StateView.views``, natural order), else None. Either
    end decides for itself: the bytes on the wire are the packed bytes either way."""
    first = prev = None
    n = 0
    for t in parts:
        for base, v in sv.views(t.kind, t.name, t.lo, t.hi, natural=True):
            if v.dtype != dtype or not v.is_contiguous():
                return None
            if first is None:
                first = v
            elif (v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                  or v.storage_offset() != prev.storage_offset() + prev.numel()):
                return None
            prev = v
            n += v.numel()
    if first is None:
        return None
    return first.as_strided((n,), (1,), first.storage_offset())


def run_rounds(rank: int, rds: list[list[Message]], old: StateView, new: StateView,
               wire_dtype: dict[str, torch.dtype], device, *, timeout_s: float, step: int,
               overlap: Callable[[], None] | None = None) -> TransportStats:
    """Execute ``rank``'s part of the rounds: pack from ``old``, send, receive, unpack into
    ``new``. ``overlap``: local work (the switch's local copies) run once while the first
    round's messages are on the wire."""
    stats = TransportStats()
    for t, ops in enumerate(rank_rounds(rds, rank)):
        before_round(rank, t)
        if not ops:
            continue
        stats.rounds += 1
        p2p, bufs, live = [], [], 0
        tp = time.perf_counter()
        for kind, m in ops:
            sv = old if kind == "send" else new
            buf = direct_window(sv, m.parts, wire_dtype[m.wire])
            direct = buf is not None
            if not direct:
                buf = torch.empty(m.numel, dtype=wire_dtype[m.wire], device=device)
                live += buf.numel() * buf.element_size()
                if kind == "send":
                    pack_parts(old, m.parts, buf, natural=True)
            else:
                stats.direct += 1
            if kind == "send":
                p2p.append(dist.P2POp(dist.isend, buf, m.dst, tag=m.id))
                stats.bytes_sent += m.nbytes
            else:
                p2p.append(dist.P2POp(dist.irecv, buf, m.src, tag=m.id))
                stats.bytes_received += m.nbytes
            bufs.append(None if direct else buf)    # nothing to unpack: it landed in place
        stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, live)
        t0 = time.perf_counter()
        stats.pack_s += t0 - tp
        reqs = dist.batch_isend_irecv(p2p)
        if overlap is not None:
            overlap()
            overlap = None
        pending = [m.dst if k == "send" else m.src for k, m in ops]
        for req, (kind, m) in zip(reqs, ops):
            left = max(0.1, timeout_s - (time.perf_counter() - t0))
            try:
                req.wait(timeout=datetime.timedelta(seconds=left))
            except Exception as e:   # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
                raise MigrationError(
                    f"migration before step {step}: round {t}: {kind} of message {m.id} "
                    f"({m.nbytes} bytes) {'to' if kind == 'send' else 'from'} rank "
                    f"{m.dst if kind == 'send' else m.src} did not complete within "
                    f"malleus.migrate_timeout_s={timeout_s:g} (peers this round: "
                    f"{sorted(set(pending))}): {str(e).splitlines()[0][:200]}") from None
        tu = time.perf_counter()
        stats.wait_s += tu - t0
        for (kind, m), buf in zip(ops, bufs):
            if kind == "recv" and buf is not None:
                unpack_parts(new, m.parts, buf, natural=True)
        stats.unpack_s += time.perf_counter() - tu
    if overlap is not None:         # this rank had nothing on the wire
        overlap()
    return stats
