"""The link probe: how a link the running plan holds as slow stays measured.

A plan made for a slow link moves the gradient reductions off it, and then nothing the job
does tells whether the link recovered (a pipeline receive's wait is its peer's lateness more
than its wire's time: ``adaptive/link_watch.py``). So, like a suspended GPU's probe, the two
ends of such a link exchange a small buffer right after a step's all-reduce, when every rank
leaves it at once: the first rank of one node sends it to the first rank of the other, which
sends it back, a few times. The first rank times each round trip with the compute clock's
``comm`` (on CUDA by a pair of events, waited for: the probe runs apart from the step), where the slow-link emulation applies and the comm log keeps the quickest for the
next step's all-reduce (``comm_log.py``). The adaptive loop decides when and which link
(``Controller.after_reduce``); the app hands it this object (``app/loop.py``). Every message
goes through ``batch_isend_irecv`` (NCCL's rules, ``wire.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from .comm_log import tensor_mb


class LinkProbe:
    """Round trips between two ranks over the world group, timed on the first."""

    #: round trips per probe; the quickest is the reading: the other ranks go back to work as
    #: the two exchange, and on shared cores a round trip also waits for a core (single round
    #: trips over a healthy link vary several-fold)
    ROUND_TRIPS = 3

    def __init__(self, engine) -> None:
        self.engine = engine
        self._buf: torch.Tensor | None = None

    def exchange(self, a: int, b: int, mb: float, trips: int | None = None) -> None:
        """Rank ``a`` sends ``mb`` MB to rank ``b`` and gets them back ``trips`` times (default
        :attr:`ROUND_TRIPS`; both ends must be given the same), timed on ``a``; every other rank
        returns at once (every rank may call it: only the two ends take part)."""
        e = self.engine
        me = e.global_rank
        if me not in (a, b) or a == b or e.clock.comm_log is None:
            return       # not measuring links
        n = max(1, int(mb * 1e6) // 4)
        if self._buf is None or self._buf.numel() != n:
            self._buf = torch.zeros(n, dtype=torch.float32, device=e.device)
        buf = self._buf
        for _ in range(self.ROUND_TRIPS if trips is None else trips):
            if me == a:
                with e.clock.comm((a, b), 2 * tensor_mb(buf), "probe"):
                    _wait(tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, buf, b)]))
                    _wait(tdist.batch_isend_irecv([tdist.P2POp(tdist.irecv, buf, b)]))
            else:
                _wait(tdist.batch_isend_irecv([tdist.P2POp(tdist.irecv, buf, a)]))
                _wait(tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, buf, a)]))


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()
