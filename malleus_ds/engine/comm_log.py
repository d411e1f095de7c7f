"""This rank's timed communication of one step, summed up for the step's all-reduce.

The clock (``clock.py``, :meth:`ComputeClock.comm`) times every pipeline receive and every
gradient-bucket reduction, each as the wait on its work handle (CPU: the host waits; the
emulated slow link's extra wait included), and hands it here. At the end of the step the rank
puts :data:`SLOTS` numbers into its slots of the step's one all-reduce
(``step_reduce.py``):

* per pipeline peer it received from (at most two: the activation's source and the
  gradient's), ``[peer + 1, MB per message, least seconds per MB over the step's messages]``.
  The least: a receive also waits for the peer to get there (the pipeline's bubbles, a slow
  stage upstream); the message that waited least is the one closest to the wire's own time;
* the bucket reduction it reports, ``[key, members, MB, seconds]``: of the buckets whose
  members sit on more than one node the largest, else the largest inside the node (the
  intra-node bandwidth). ``key`` names the bucket's rank set (the same number on every
  member), so rank 0 can gather its members' readings; the least of them is the member that
  arrived last, whose wait is the reduction alone (``adaptive/link_rates.py``);
* its TP group's collectives (``engine/tensor_parallel.py``: two all-reduces per layer and
  micro-batch forward, two backward, all of one size), as ``[key, members, MB, seconds]`` of
  the one that took least per MB: the many small waits of a step are mostly a peer's
  lateness (on shared cores their sum read even a badly slowed link as healthy), and the
  quickest is the closest to the wire's own time, as for a pipeline receive;
* a link probe it timed (``link_probe.py``: round trips to a rank across a link the running
  plan holds as slow, right after the last step's all-reduce), ``[peer + 1, MB, seconds]`` of
  the quickest round trip:
  carried from the step it was timed after into the next step's slots, as a GPU probe is.

numpy-free; nothing here synchronises.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

#: numbers one rank adds to the step's all-reduce: two pipeline peers x 3, one bucket x 4, its
#: TP group's collectives x 4, one link probe x 3
P2P_PEERS = 2
BUCKET = 3 * P2P_PEERS
TP = BUCKET + 4
PROBE = TP + 4
SLOTS = PROBE + 3


def tensor_mb(t) -> float:
    """Megabytes a tensor holds (what a message or a bucket moves)."""
    return t.numel() * t.element_size() / 1e6


def bucket_key(ranks: Sequence[int]) -> float:
    """A number naming a rank set, the same on every rank (exact in float64), never 0."""
    return float(zlib.crc32(",".join(map(str, ranks)).encode()) % (1 << 31) + 1)


class CommLog:
    """One rank's timed communication, one step at a time (module doc). ``node_of``: rank ->
    node (``JobLayout.node_of``)."""

    def __init__(self, node_of: Callable[[int], int]) -> None:
        self.node_of = node_of
        self._probe: list[float] | None = None     # carried to the next values()
        self.start_step()

    def start_step(self) -> None:
        self._p2p: dict[int, tuple[float, float]] = {}        # peer -> (MB, least s per MB)
        self._coll: dict[tuple[int, ...], list[float]] = {}    # ranks -> [MB, seconds]
        self._tp: dict[tuple[int, ...], tuple[float, float]] = {}  # ranks -> least (MB, s)

    def add(self, kind: str, ranks: Sequence[int], mb: float, seconds: float) -> None:
        """A timed communication: ``kind`` "p2p" (``ranks`` = (this rank, the peer it received
        from)), "dp" (a bucket's reduction over ``ranks``), "tp" (a TP collective over its
        group ``ranks``) or "probe" (a link probe's round trip to ``ranks[-1]``), ``mb`` moved,
        ``seconds``."""
        if mb <= 0 or seconds < 0:
            return
        if kind == "probe":                    # several round trips: the least
            if self._probe is None or seconds < self._probe[2]:
                self._probe = [int(ranks[-1]) + 1.0, float(mb), float(seconds)]
        elif kind == "p2p":
            peer = int(ranks[-1])
            spm = seconds / mb
            old = self._p2p.get(peer)
            if old is None or spm < old[1]:
                self._p2p[peer] = (mb, spm)
        elif kind == "tp":
            key = tuple(int(r) for r in ranks)
            old = self._tp.get(key)
            if old is None or seconds / mb < old[1] / old[0]:
                self._tp[key] = (float(mb), float(seconds))
        else:
            acc = self._coll.setdefault(tuple(int(r) for r in ranks), [0.0, 0.0])
            acc[0] += mb
            acc[1] += seconds

    def values(self) -> list[float]:
        """The :data:`SLOTS` numbers of this step (module doc); zeros where nothing was timed."""
        out = [0.0] * SLOTS
        for i, (peer, (mb, spm)) in enumerate(sorted(self._p2p.items())[:P2P_PEERS]):
            out[3 * i:3 * i + 3] = [peer + 1.0, mb, spm]
        if self._coll:
            def rank_of(item):
                ranks, (mb, _) = item
                crosses = len({self.node_of(r) for r in ranks}) > 1
                return (crosses, mb, ranks)
            ranks, (mb, s) = max(self._coll.items(), key=rank_of)
            out[BUCKET:TP] = [bucket_key(ranks), float(len(ranks)), mb, s]
        if self._tp:      # one TP group per rank (the largest, should a plan hold two)
            ranks, (mb, s) = max(self._tp.items(), key=lambda it: (it[1][0], it[0]))
            out[TP:PROBE] = [bucket_key(ranks), float(len(ranks)), mb, s]
        if self._probe is not None:
            out[PROBE:], self._probe = self._probe, None
        return out


def decode(comm) -> list[tuple[str, tuple[int, ...], float, float]]:
    """Every rank's slots of one step (``comm[d]``: rank ``d``'s :data:`SLOTS` numbers) as
    timed operations ``(kind, ranks, MB, seconds)``: a pipeline receive per rank and peer
    (``("p2p", (rank, peer), ...)``, at its least seconds per MB), a link probe per rank that
    timed one (``("probe", (rank, peer), ...)``), and a bucket reduction (``"dp"``) and a TP
    group's collectives (``"tp"``) per key, over the members that reported it, at the least of
    their seconds (the member that arrived last: the collective's own time), with the MB one
    member moves in a ring, ``2 (k-1)/k`` of what it reduced."""
    ops, groups = [], {}
    for d, row in enumerate(comm):
        for i in range(P2P_PEERS):
            peer, mb, spm = (float(x) for x in row[3 * i:3 * i + 3])
            if peer > 0 and mb > 0 and spm > 0:
                ops.append(("p2p", (d, int(peer) - 1), mb, spm * mb))
        for kind, at in (("dp", BUCKET), ("tp", TP)):
            key, k, mb, s = (float(x) for x in row[at:at + 4])
            if key > 0 and k >= 2 and mb > 0 and s > 0:
                groups.setdefault((kind, key, k, mb), []).append((d, s))
        peer, mb, s = (float(x) for x in row[PROBE:SLOTS])
        if peer > 0 and mb > 0 and s > 0:
            ops.append(("probe", (d, int(peer) - 1), mb, s))
    for (kind, _, k, mb), members in sorted(groups.items()):
        ranks = tuple(sorted(d for d, _ in members))
        ops.append((kind, ranks, 2.0 * (k - 1) / k * mb, min(s for _, s in members)))
    return ops


class CommOps(Sequence):
    """One step's every-rank slots as timed operations, decoded (:func:`decode`) when first
    read: every rank gets the step's sums, only the loop's link watch (rank 0) reads them."""

    def __init__(self, slots) -> None:
        self._slots, self._ops = slots, None

    def _decoded(self) -> list:
        if self._ops is None:
            self._ops = decode(self._slots)
        return self._ops

    def __getitem__(self, i):
        return self._decoded()[i]

    def __len__(self) -> int:
        return len(self._decoded())
