"""Messages and rounds: the transfer plan cut into bounded packed buffers, in an order that cannot
deadlock (pure; checked by :func:`replay_rounds` without processes, as the pipeline schedule is).

A *message* is one buffer from one rank to one peer: transfers of that pair of one kind and wire
dtype (a large parameter slice alone), in bucket layout order, cut so no message exceeds ``cap``
bytes (a transfer larger than that is split into element ranges). It is packed at an end where its
elements are scattered, and sent from / received into place where they lie back to back
(``transport.direct_window``): a block of layers' optimizer state, a whole parameter. Messages
are dealt into *rounds*, first fit in a fixed order, so that in every round each rank's bytes in
flight (sent + received) stay within ``cap`` — what ``malleus.migrate_bucket_mb`` bounds: a 70B
model's state does not fit twice in GPU memory.

Execution (``transport.py``): in round ``t`` every rank posts all its sends and receives of that
round in one ``batch_isend_irecv`` (ordered by message id on both sides, so NCCL pairs them in
order), waits for them, unpacks, and moves to round ``t + 1``. Both ends of every message sit in
the same round, and nothing blocks before all of a round's operations are posted, so no cycle
of waits can form; :func:`replay_rounds` replays that rule for every rank and fails on any stuck state.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import EMBED, HEAD, ParamTable
from .transfer import Transfer, TransferPlan, chunked


@dataclass(frozen=True)
class Message:
    """Packed buffer ``id`` from ``src`` to ``dst``: ``parts`` back to back, ``nbytes`` in all."""

    id: int
    src: int
    dst: int
    wire: str                    # "fp32" or "param" (the low-precision parameter dtype)
    parts: tuple[Transfer, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.parts)


#: a parameter slice of at least this many bytes gets messages of its own (no packing)
ALONE_BYTES = 256 * 1024


def wire_of(t: Transfer, mixed: bool) -> str:
    return "param" if mixed and t.kind == "param" else "fp32"


def messages(tp: TransferPlan, cap_bytes: int, mixed: bool = False,
             table: ParamTable | None = None) -> list[Message]:
    """Cut ``tp`` into messages of at most ``cap_bytes``, grouped by (src, dst, wire, kind, and
    the tensor for a parameter slice of ``ALONE_BYTES`` or more), in a fixed order (the same on
    every rank).

    ``table``: order each message's parts as optimizer buckets lay pieces out (layer, name,
    element), so a run of optimizer state moving between the same two ranks — a block of layers
    whose ZeRO part stays the same — is one contiguous window at both ends and travels without
    packing (``transport.py`` checks that per end)."""
    if cap_bytes <= 0:
        raise ValueError(f"migrate bucket size must be > 0 bytes, got {cap_bytes}")
    groups: dict[tuple[int, int, str, str, str], list[Transfer]] = {}
    for t in tp.transfers:
        # a parameter tensor is its own allocation: a large one travels alone (and then from /
        # into its place), small ones share a packed message
        alone = t.kind == "param" and tp.bytes_of(t) >= ALONE_BYTES
        groups.setdefault((t.src, t.dst, wire_of(t, mixed), t.kind, t.name if alone else ""),
                          []).append(t)
    if table is not None:
        def key(t: Transfer):
            o = table[t.name].owner
            return (-1 if o == EMBED else 1 << 30 if o == HEAD else o), t.name, t.lo

        for ts in groups.values():
            ts.sort(key=key)
    out: list[Message] = []
    for (src, dst, wire, _kind, _name), ts in sorted(groups.items()):
        per = tp.param_bytes if wire == "param" else 4
        for parts in chunked(ts, max(1, cap_bytes // per)):     # elements per message
            out.append(Message(len(out), src, dst, wire, tuple(parts),
                               sum(t.numel for t in parts) * per))
    return out


def rounds(msgs: list[Message], cap_bytes: int) -> list[list[Message]]:
    """First fit: each message goes to the first round where both ends have room."""
    out: list[list[Message]] = []
    used: list[dict[int, int]] = []
    # start the search where the pair's previous message went: keeps a pair's data in order and
    # makes the search linear in practice
    start: dict[tuple[int, int], int] = {}
    for m in msgs:
        t = start.get((m.src, m.dst), 0)
        while True:
            if t == len(out):
                out.append([])
                used.append({})
            u = used[t]
            if (u.get(m.src, 0) + m.nbytes <= cap_bytes and u.get(m.dst, 0) + m.nbytes <= cap_bytes) \
                    or (not u.get(m.src) and not u.get(m.dst)):
                break
            t += 1
        out[t].append(m)
        used[t][m.src] = used[t].get(m.src, 0) + m.nbytes
        used[t][m.dst] = used[t].get(m.dst, 0) + m.nbytes
        start[(m.src, m.dst)] = t
    return out


def rank_rounds(rds: list[list[Message]], rank: int) -> list[list[tuple[str, Message]]]:
    """``rank``'s operations per round, ``("send" | "recv", message)``, by message id."""
    return [[("send" if m.src == rank else "recv", m) for m in sorted(rd, key=lambda m: m.id)
             if rank in (m.src, m.dst)] for rd in rds]


def replay_rounds(rds: list[list[Message]], world: int, cap_bytes: int | None = None) -> int:
    """Replay the execution rule for every rank from its own view (:func:`rank_rounds`): a rank
    finishes round ``t`` once every message of its round ``t`` has been posted by both ends.
    Raises on a stuck state, a message a peer never posts, or a round over ``cap_bytes`` on some
    rank; returns the number of rounds."""
    return replay_views([rank_rounds(rds, r) for r in range(world)], cap_bytes)


def replay_views(views: list[list[list[tuple[str, Message]]]], cap_bytes: int | None = None
                   ) -> int:
    """:func:`replay_rounds` on explicit per-rank views (each rank's ops per round)."""
    world = len(views)
    # message id -> round index in which each end posts it
    posted: dict[tuple[int, str], int] = {}
    for r, view in enumerate(views):
        for t, ops in enumerate(view):
            if cap_bytes is not None:
                b = sum(m.nbytes for _, m in ops)
                if b > cap_bytes and len(ops) > 1:
                    raise AssertionError(f"rank {r} round {t}: {b} bytes in flight > {cap_bytes}")
            for kind, m in ops:
                if (m.id, kind) in posted:
                    raise AssertionError(f"message {m.id} {kind} posted twice")
                posted[(m.id, kind)] = t
    pos = [0] * world
    n = max((len(v) for v in views), default=0)
    views = [v + [[]] * (n - len(v)) for v in views]
    while any(p < n for p in pos):
        done = []       # decided on the same snapshot: both ends of a message finish together
        for r in range(world):
            if pos[r] >= n:
                continue
            ok = True
            for kind, m in views[r][pos[r]]:
                peer = m.dst if kind == "send" else m.src
                other = "recv" if kind == "send" else "send"
                if (m.id, other) not in posted:
                    raise AssertionError(f"message {m.id}: {peer} never posts its {other}")
                if pos[peer] != posted[(m.id, other)]:
                    ok = False        # peer not in that round (yet): wait
                    break
            if ok:
                done.append(r)
        if not done:
            raise AssertionError(f"deadlock: ranks stuck at rounds {pos}")
        for r in done:
            pos[r] += 1
    return n
