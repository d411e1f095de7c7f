"""Probing: which ranks time the probe block after a step's all-reduce, and which link is probed
then (DESIGN.md §6, "Probes measure the device").

* **Compute probes.** :func:`probing_ranks` is the rule over every rank: every
  ``detect.probe_every`` steps a rank without work probes (so it can come back), a held rank
  probes while its own compute leaves it slack (``probe.light``: so a light load that fits
  inside a throughput cap does not read as a recovery), and the calibrating rank
  (``held.probe_reference``) probes beside them. A rank's :class:`Probing` applies it to its own
  rank; a replay (``replay/loop.py``) applies it to all of them.
* **Link probes.** Two ranks exchange a few round trips across one link after a probe step
  (:meth:`Probing.link_to_probe`): the slow links the running plan was made for while there are
  such (``held_links``), else the job's links in turn, often at the job's start (the probes'
  healthy reference) and rarely after.

The probe block and the link prober are the engine's (``engine/probe_block.py``,
``engine/link_probe.py``), handed in by the app; none: the rank reads nothing.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

from . import probe as budgets
from ..steploop import Prober
from .link_watch import Links, watches_gpu_links
from .view import LoopView

#: link probes: links are probed every step for this many steps at the job's start (the probes'
#: healthy reference needs ``link_rates.MIN_HISTORY`` readings) and after a link is first held
#: (a false alarm is undone soon)
LINK_WARMUP = 12
#: ...and while no link is held, one link every this many times ``detect.probe_every`` steps
LINK_IDLE_EVERY = 5
#: every node pair is probed up to this many nodes; above, the pairs of adjacent nodes
MAX_PROBED_NODES = 8
#: a link held at least this slow is probed with one round trip past its first steps held
#: (:meth:`Probing.link_to_probe`)
ONE_TRIP_RATE = 100.0


def probing_ranks(step: int, every: int, units: Sequence[float], held: Sequence[bool],
                  probe_ref: int | None, light: Sequence[bool]) -> np.ndarray:
    """Which ranks time a probe right after step ``step``'s all-reduce (module doc): every
    ``every`` steps, the ranks without work (``units`` 0), the ``held`` ones whose compute
    leaves them slack (``light``) and the calibrating rank ``probe_ref``; else none."""
    u = np.asarray(units, dtype=float)
    if step % every:
        return np.zeros(u.size, dtype=bool)
    who = (u <= 0) | (np.asarray(held, dtype=bool) & np.asarray(light, dtype=bool))
    if probe_ref is not None:
        who[probe_ref] = True
    return who


class Probing:
    """One rank's probes: when it times the probe block and with what budget, and the link
    probes it joins (module doc). Reads the loop's running work and step times."""

    def __init__(self, loop: LoopView, block: Prober | None, link_prober: Any) -> None:
        """``block``: the probe block (``measure(sustain, budget_s)`` -> seconds per run,
        ``release()``; None: this rank reads nothing); ``link_prober``: what times round trips
        across a link (``exchange(a, b, mb, trips)``; None: a link held slow is not probed)."""
        self.loop = loop
        self.block = block
        self.link_prober = link_prober
        self.probe_s = 0.0               # timed after the last all-reduce, reported in the next
        #: every rank: the slow links the running plan was made for (from the decisions, the
        #: same everywhere): probed every ``detect.probe_every`` steps
        self.held_links = Links()
        self.event_links: deque = deque()   # each decision's links, for switched/considered
        self.held_since = -LINK_WARMUP      # the first step a link in held_links was held

    def due(self, step: int) -> bool:
        """Does this rank time a probe after step ``step``'s all-reduce (:func:`probing_ranks`)?"""
        lp = self.loop
        if step % lp.s.detect.probe_every or self.block is None:
            return False
        light = np.zeros(lp.world, dtype=bool)
        if lp.held[lp.rank]:
            light[lp.rank] = budgets.light(lp.step_times, lp.compute_times)
        return bool(probing_ranks(step, lp.s.detect.probe_every, lp.units, lp.held,
                                  lp.probe_ref, light)[lp.rank])

    def after_reduce(self, step: int) -> None:
        """Time a compute probe if one is due (its reading rides in the next all-reduce) and
        join the link probe due now, if any."""
        self.probe_s = self.measure(step) if self.due(step) else 0.0
        got = self.link_to_probe(step)
        if got is not None:
            ends, trips = got
            self.link_prober.exchange(*ends, self.loop.s.detect.link_probe_mb, trips=trips)

    def may_time(self, step: int) -> bool:
        """May any rank time something after step ``step``'s all-reduce (:meth:`after_reduce`):
        a compute probe (a probe step of a plan with ranks without work or held ones; the
        calibrating rank probes beside them) or a link probe? Read from what every rank
        shares, never from one rank's own timings, so the same on every rank: true where no
        rank ends up timing anything can happen (a held rank without slack), false where one
        does cannot."""
        lp = self.loop
        if step % lp.s.detect.probe_every == 0 and ((lp.units <= 0).any() or lp.held.any()):
            return True
        return self.link_to_probe(step) is not None

    def take(self) -> float:
        """The probe timed after the last all-reduce (seconds per run; 0.0: none), once."""
        out, self.probe_s = self.probe_s, 0.0
        return out

    def measure(self, step: int) -> float:
        """Seconds per run of the probe block (``probe.py``): sustained on a rank without work
        (within half a step) or a held one (within half its slack), one run on the calibrating
        rank."""
        lp = self.loop
        if not lp.working:
            return self.block.measure(True, budgets.budget(lp.step_times))
        if lp.held[lp.rank]:
            return self.block.measure(True, budgets.budget(lp.step_times, lp.compute_times))
        return self.block.measure(False, 0.0)

    def switched(self) -> None:
        """After a switch: a probe timed under the old plan is dropped, and a rank back at full
        work frees the probe's block."""
        lp = self.loop
        self.probe_s = 0.0
        if (self.block is not None and lp.working and lp.rank != lp.probe_ref
                and not lp.held[lp.rank]):
            self.block.release()

    # -- link probes ---------------------------------------------------------------------------

    def _ends(self, kind: str, link: tuple[int, int]) -> tuple[int, int]:
        """The two ranks that probe a link: a node link's nodes' first ranks, a GPU link's own."""
        if kind == "node":
            return self.loop.job.node_ranks(link[0])[0], self.loop.job.node_ranks(link[1])[0]
        return link

    def link_to_probe(self, step: int) -> tuple[tuple[int, int], int | None] | None:
        """The two ranks that exchange a link probe after step ``step`` and how many round
        trips (None: ``LinkProbe.ROUND_TRIPS``), or None (the same on every rank). One link per
        probe step, in turn: while links are held slow, those, every ``detect.probe_every``
        steps (every step for :data:`LINK_WARMUP` steps after one is first held: a false alarm
        is undone soon); else the links of :meth:`_probe_pools`, each kind in turn, every step
        for the job's first :data:`LINK_WARMUP` measured steps per kind (the probes' healthy
        reference, one per kind: ``link_rates.MIN_HISTORY`` probes each) and every
        ``LINK_IDLE_EVERY x probe_every`` steps after. A link held at :data:`ONE_TRIP_RATE` or
        more, past its first :data:`LINK_WARMUP` steps held, gets one round trip: each costs
        its slowness, and its recovery bar (half its held level) is far above a single trip's
        scatter."""
        lp = self.loop
        if (self.link_prober is None or not lp.measures_links
                or lp.s.detect.link_probe_mb <= 0):
            return None
        p = lp.s.detect.probe_every
        if self.held_links:
            warm = step - self.held_since < LINK_WARMUP
            every = 1 if warm else p
            pools = [[(self._ends(k, ln), None if warm or r < ONE_TRIP_RATE else 1)
                      for k, ln, r in self.held_links.items()]]
        else:
            pools = [[(ends, None) for ends in pool] for pool in self._probe_pools()]
            every = 1 if lp.seen < LINK_WARMUP * len(pools) else LINK_IDLE_EVERY * p
        if step % every or not pools:
            return None
        i = step // every
        pool = pools[i % len(pools)]
        return pool[(i // len(pools)) % len(pool)]

    def _probe_pools(self) -> list[list[tuple[int, int]]]:
        """The rank pairs probed while no link is held, per kind of link: every node pair up to
        :data:`MAX_PROBED_NODES` nodes, else the pairs of adjacent nodes (each by its nodes'
        first ranks); and where GPU links are read, the adjacent GPUs of node 0 (the probes'
        healthy reference inside a node)."""
        lp = self.loop
        n = lp.job.nodes
        nodes = ([(a, b) for a in range(n) for b in range(a + 1, n)] if n <= MAX_PROBED_NODES
                 else [(a, a + 1) for a in range(n - 1)])
        out = [[self._ends("node", ln) for ln in nodes]] if nodes else []
        if watches_gpu_links(lp.s.detect, lp.spec.job):
            first = lp.job.node_ranks(0)
            out.append(list(zip(first, first[1:])))
        return out

    def links_planned(self) -> None:
        """After a decision (adopted or not): the slow links it was made for (the same on every
        rank) are held (probed) and, on rank 0, the link detection's reference; a switch no
        decision made (scripted) keeps the held links, and rank 0's detection takes today's
        reading."""
        links = self.event_links.popleft() if self.event_links else None
        if links is not None:
            if links.keys() - self.held_links.keys():
                self.held_since = self.loop.last_step + 1
            self.held_links = links
        if self.loop.links is not None:
            self.loop.links.planned_for(links)
