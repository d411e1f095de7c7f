"""The adaptive loop's planner on a replay's simulated clock (``replay/loop.py``).

:class:`SimPlanner` has the interface of ``planner/client.py``: it runs the real planner (the
worker's own ``answer``, with its cache) in this process when the loop asks, and its answer
reaches the loop once the simulated clock (:class:`SimClock`) has passed the request's moment
plus the planner's wall seconds on this machine (a slow plan arrives late, while the job trains
on under the old plan), or, where a recorded run says so, before the step the run took it at.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class SimClock:
    """The replay's clock: seconds since the job started."""

    now: float = 0.0


class SimPlanner:
    """The loop's planner on the simulated clock (the interface of ``planner/client.py``).

    ``request`` runs the planner here and now (``planner/worker.answer``, through the worker's
    answer cache, as the training job's worker would) and holds the answer until the clock has
    passed the request's moment plus ``charge(wall seconds, request)``; ``charge`` defaults to
    the wall seconds themselves. The seconds charged per request are kept in :attr:`charged`."""

    def __init__(self, clock: SimClock, charge: Callable[[float, dict], float] | None = None,
                 cache=None) -> None:
        from ..planner.worker import AnswerCache

        self.clock = clock
        self.charge = charge or (lambda wall, req: wall)
        self.cache = cache if cache is not None else AnswerCache()
        # (ready at, answer, a search?, ready before this step: None, by the clock)
        self._held: list[tuple[float, dict, bool, int | None]] = []
        self.charged: list[float] = []          # seconds charged per request
        self.requested: list[float] = []        # the clock at each request
        self.step = 0                           # the step the loop is at (set by the loop)
        #: the step before which a request asked after ``step`` is answered, where a recorded
        #: run says so (``RunRecord.answered``); None: by the clock
        self.anchor: Callable[[int], int | None] = lambda step: None

    def request(self, req: dict) -> None:
        t0 = time.perf_counter()
        ans = self.cache.answer(req)
        s = float(self.charge(time.perf_counter() - t0, req))
        self.charged.append(s)
        self.requested.append(self.clock.now)
        self._held.append((self.clock.now + s, ans, is_search(req), self.anchor(self.step)))

    def searching(self) -> bool:
        """Is the planner searching at the clock's moment (a request in flight with a rank
        slower than healthy: a request with every rank healthy is answered without a search)?
        An answer taken before step ``at`` arrived during the step before it."""
        return any(search and (self.clock.now < t if at is None else self.step < at)
                   for t, _, search, at in self._held)

    def poll(self) -> dict | None:
        """The next answer, if it has arrived (polled as a step's all-reduce starts: an answer
        polled at step ``k`` is taken before step ``k + 1``)."""
        if self._held:
            t, ans, _, at = self._held[0]
            if (self.clock.now >= t if at is None else self.step >= at - 1):
                return self._held.pop(0)[1]
        return None

    def wait(self, timeout_s: float) -> dict:
        """A forced re-plan's answer (the loop waits for it; the replay forces none)."""
        if not self._held:
            return {"error": "no request in flight"}
        return self._held.pop(0)[1]

    def close(self) -> None:
        self._held.clear()


def is_search(req: dict) -> bool:
    """Does the planner search for this request (some rank slower than healthy)? One with every
    rank healthy is answered by the user's layout, without a search."""
    rates = (req.get("problem") or {}).get("rates") or {}
    return any(float(v) > 1.0 for v in rates.values())
