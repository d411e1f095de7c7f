"""Per-link straggling rates from per-step communication timings: which links are slow.

A *comm op* is one timed communication of a step (:class:`CommOp`): a pipeline send or receive
between two ranks, one group's data-parallel reduction, one TP collective, with the megabytes it
moved and the seconds it took. It crosses the links between its ranks' nodes: a point-to-point
the pair of its two ranks' nodes; a ring collective the pairs of consecutive members' nodes, in
the order given, and back to the first (``links_crossed``).

Attribution (:class:`LinkEstimator`), one step at a time:

1. **Seconds per MB against a healthy reference.** Ops are compared within their *kind* and
   *scope* (inside one node, or across nodes: another bandwidth). The reference of a kind and
   scope is the median of the seconds per MB its ops took over a long history: the link's
   healthy speed, learned from the ops across links whose windowed rate reads healthy (below
   ``healthy``), so a long slow spell does not become the reference. (A cluster of two nodes has
   one link, which every cross-node op crosses: a comparison within one step cannot tell it is
   slow; and a link slow from the job's first step reads healthy until it recovers.) An op's
   slowdown is its seconds per MB over that reference.
2. **A slow GPU is not a slow link.** An op one of whose ranks reads slow in compute (its
   compute rate at least ``healthy``) is left out: its time holds the wait for that rank (the
   wait on a work handle includes a late peer), which the GPU's compute rate already tells.
   Compute is timed apart from communication (``ComputeClock.excluded``), so a slow link does
   not show in the GPUs' compute rates either.
3. **A link is as slow as the fastest op across it.** A link's rate in a step is the least
   slowdown among the kept ops that cross it, at least 1.0: an op that crosses a slow link and
   a healthy one reads slow, while the op that crosses only the healthy one reads healthy.
   Slowness is explained away (:func:`attribute`): an op that also crosses a link pinned slow
   by ops crossing it alone says nothing about its other links. A link no op speaks for is not
   measured that step.

4. **A probe says recovered or not.** A kind of op that times links on purpose
   (``recovery_kinds``: the link probe) learns its reference from healthy links only (no
   belief), so a link the running plan holds as slow is judged against its healthy speed, and
   a false alarm is undone at once. It says only whether such a link recovered, not by how
   much: its messages are smaller than the reductions the belief was read from, and a
   congested link slows small and large messages differently (under the emulation a
   throttled link's reductions read several times slower than the probe's round trips). So
   its reading of a link held
   slow is at least the belief while it reads slow (its own reading where higher, so a plan
   made for a link read at 2.5 on its way to 7 does not pin it at 2.5 under the rule of the
   fastest op), and 1.0 once two of its last ``window`` readings are quick (a wait only adds
   to a round trip: two quick ones say the link is fast): below ``healthy``, or below its own
   level while held over ``healthy``.

:meth:`LinkEstimator.rates` is the median over the last ``window`` steps per link, NaN where no
step measured it. numpy only.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from .detect import HEALTHY

#: the reference is this quantile of a kind's healthy-scope history (seconds per MB): the
#: median, so a healthy op reads 1.0 typically (a low quantile would make the typical healthy
#: reading of a noisy kind, such as an all-reduce, well over 1)
REF_QUANTILE = 0.5
#: ops of a kind and scope needed in the history before its reference counts (too few, and a
#: loaded host's first steps set a reference that reads a healthy link several times slow)
MIN_HISTORY = 10


@dataclass(frozen=True)
class CommOp:
    """One timed communication: ``kind`` ("p2p", "dp", "tp"), the ranks taking part (a ring's
    order for a collective), megabytes moved and seconds."""

    kind: str
    ranks: tuple[int, ...]
    mb: float
    seconds: float


Link = tuple[int, int]


def links_crossed(ranks: Sequence[int], node_of: Callable[[int], int]) -> frozenset[Link]:
    """The node pairs an op over ``ranks`` crosses (module doc): two ranks, their pair; more, a
    ring in the given order and back."""
    nodes = [node_of(r) for r in ranks]
    hops = list(zip(nodes, nodes[1:] + nodes[:1])) if len(nodes) > 2 else \
        [(nodes[0], nodes[-1])]
    return frozenset((min(a, b), max(a, b)) for a, b in hops if a != b)


def attribute(read: Sequence[tuple[frozenset, float]], healthy: float = HEALTHY
              ) -> dict[Link, float]:
    """One step's link rates from ``(links crossed, slowdown)`` per op (module doc, rule 3),
    with slowness explained away: a link that an op crosses alone is *pinned* at the least
    slowdown of such ops; an op that also crosses a pinned link at least as slow as it reads
    (within ``healthy``'s margin) tells nothing about its other links. A link is then the least
    slowdown among the ops that still speak for it; none: not measured (absent)."""
    pinned: dict[Link, float] = {}
    for links, s in read:
        if len(links) == 1:
            (ln,) = links
            pinned[ln] = min(pinned.get(ln, np.inf), s)
    out: dict[Link, float] = {}
    for links, s in read:
        for ln in links:
            if ln not in pinned and any(pinned.get(o, 0.0) * healthy >= s
                                        for o in links if o != ln):
                continue                  # the pinned slow link explains this op
            out[ln] = min(out.get(ln, np.inf), s)
    return out


class LinkEstimator:
    """Link rates from per-step :class:`CommOp` lists and the ranks' compute rates (module
    doc). ``node_of``: rank -> node; ``window``: steps the median spans; ``history``: ops per
    kind and scope the reference is learned from."""

    def __init__(self, node_of: Callable[[int], int], window: int = 10, history: int = 400,
                 healthy: float = HEALTHY, recovery_kinds: Iterable[str] = ()) -> None:
        self.node_of, self.healthy = node_of, healthy
        #: kinds whose reading of a link believed slow says only whether it recovered (module
        #: doc, 4)
        self.recovery_kinds = frozenset(recovery_kinds)
        #: per held link, its last ``window`` probe readings and their level while held
        #: (``_quick``)
        self._recent: dict[Link, deque] = {}
        self._level: dict[Link, float] = {}
        self._window = window
        self._hist: dict[tuple[str, bool], deque] = {}
        self._history = history
        self._rows: deque[dict[Link, float]] = deque(maxlen=window)

    def _reference(self, key: tuple[str, bool]) -> float | None:
        h = self._hist.get(key)
        if h is None or len(h) < MIN_HISTORY:
            return None
        return float(np.quantile(np.fromiter(h, float), REF_QUANTILE))

    def add(self, ops: Iterable[CommOp], compute_rates: Sequence[float] | None = None,
            believed: Mapping[Link, float] | None = None) -> None:
        """One step's ops; ``compute_rates[r]``: rank ``r``'s compute rate (NaN or missing:
        not known, taken as healthy); ``believed``: the links the running plan was made for as
        slow (link -> rate; missing: 1.0). An op across a link believed slow teaches the
        reference its seconds per MB over that rate, when it reads as the belief says (within
        ``healthy``'s margin either way): a kind of op that first crosses the link after a
        switch made for it (a pipeline boundary moved onto it) learns the link's healthy
        speed, not its slow one, and the link's recovery is then seen."""
        cr = np.asarray(compute_rates if compute_rates is not None else [], dtype=float)
        believed = believed or {}

        def slow(r: int) -> bool:
            return r < cr.size and bool(cr[r] >= self.healthy)
        kept = []
        for op in ops:
            if op.mb <= 0 or op.seconds <= 0 or any(slow(r) for r in op.ranks):
                continue
            links = links_crossed(op.ranks, self.node_of)
            key = (op.kind, bool(links))
            kept.append((key, links, op.seconds / op.mb))
        read: list[tuple[frozenset, float]] = []
        learn = []
        now = self.rates()
        for key, links, spm in kept:
            ref = self._reference(key)
            b = max([float(believed.get(ln, 1.0)) for ln in links] + [1.0])
            s = 1.0 if ref is None else spm / ref
            # the reference learns from every op across links that read as they are believed
            # to be (healthy, or the belief within the margin), whatever the op's own reading:
            # learning only the ops that read healthy would trim the upper tail of a noisy kind
            # and bias its median low (healthy all-reduces on a loaded host would then read slow)
            w = max([now.get(ln, 1.0) for ln in links] + [1.0])
            if key[0] in self.recovery_kinds:
                if b == 1.0 and w < self.healthy:         # healthy probes only (rule 4)
                    learn.append((key, spm))
                if ref is not None and links and b > 1.0:
                    s = 1.0 if self._quick(links, s) else max(b, s)
                elif b == 1.0:
                    for ln in links:
                        self._recent.pop(ln, None)
                        self._level.pop(ln, None)
            elif ref is None or (w < b * self.healthy and w > b / self.healthy):
                learn.append((key, spm / b))
            if ref is not None and links:
                read.append((links, max(1.0, s)))
        for key, spm in learn:            # after reading: a step does not judge itself
            self._hist.setdefault(key, deque(maxlen=self._history)).append(spm)
        self._rows.append(attribute(read, self.healthy))

    def _quick(self, links: frozenset, s: float) -> bool:
        """Does the held link the probe ``s`` (the newest) crosses read recovered: are two of
        its last ``window`` probe readings quick? Waits only add to a round trip, so two quick
        ones say the link is fast (a majority can take many steps on a loaded host, whose
        round trips scatter around twice their healthy median). Quick: below ``healthy``, or
        below the probes' own level while held (the median of its first ``window`` readings
        then) over ``healthy``: on a loaded host a freed link's probes can read well over
        ``healthy`` for many steps, yet far below what they read while it was throttled."""
        ok = []
        for ln in links:
            d = self._recent.setdefault(ln, deque(maxlen=self._window))
            d.append(s)
            if ln not in self._level and len(d) == self._window:
                self._level[ln] = float(np.median(d))
            bar = max(self.healthy, self._level.get(ln, 0.0) / self.healthy)
            ok.append(len(d) >= 2 and sorted(d)[1] < bar)
        return all(ok)

    def seconds_per_mb(self, kind: str, across: bool) -> float | None:
        """The healthy seconds per MB of ``kind``'s ops across nodes (``across``) or inside
        one, or None until learned."""
        return self._reference((kind, across))

    def rates(self, last: int | None = None) -> dict[Link, float]:
        """Per link measured in the window (``last``: its last ``last`` steps only): the
        median of its per-step rates."""
        seen: dict[Link, list[float]] = {}
        rows = list(self._rows)[-last:] if last else self._rows
        for row in rows:
            for ln, v in row.items():
                seen.setdefault(ln, []).append(v)
        return {ln: float(np.median(v)) for ln, v in sorted(seen.items())}
