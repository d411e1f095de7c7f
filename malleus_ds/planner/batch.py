"""Exact micro-batch split across pipelines (DESIGN.md §4d).

Minimise ``max_i T_i(m_i)`` subject to ``sum_i m_i = M`` and ``m_i >= 1``, where each
``T_i`` is non-decreasing in ``m`` (a :class:`~malleus_ds.planner.partition.PipelineModel`
or a :class:`FixedPipeline`). The optimum ``T*`` is the smallest value ``T`` with
``sum_i count_i(T) >= M`` (``count_i(T)`` = most micro-batches pipeline ``i`` finishes by
``T``). We bisect on ``T``, snapping the upper end to an achieved ``T_i(m)`` value each time,
so the answer is one of the candidate values ``T_i(m)`` and exact up to float rounding.

Identical pipelines are given once with a multiplicity, so a 1024-GPU layout with 100 equal
pipelines costs the same as one with a handful of types.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

_BIG = 1e300


class TimeModel(Protocol):
    S: int
    sig: np.ndarray
    cm: np.ndarray

    def time(self, m: int) -> float: ...

    def count(self, T: float, cap: int) -> int: ...


@dataclass
class FixedPipeline:
    """A pipeline whose stage times are fixed: ``T(m) = sum t + (m - 1) max t``."""

    stage_times: tuple[float, ...]

    def __post_init__(self) -> None:
        self.S = 1  # the formula holds for every m >= 1
        self.sig = np.array([float(sum(self.stage_times))])
        self.cm = np.array([float(max(self.stage_times))])

    @property
    def feasible(self) -> bool:
        return True

    def time(self, m: int) -> float:
        return float(self.sig[0] + (m - 1) * self.cm[0])

    def count(self, T: float, cap: int) -> int:
        if T < self.sig[0]:
            return 0
        m = min(cap, int(math.floor((T - self.sig[0]) / self.cm[0])) + 1)
        while m > 0 and self.time(m) > T:
            m -= 1
        while m < cap and self.time(m + 1) <= T:
            m += 1
        return m


class _Hulls:
    """The models' ``T(m)`` as arrays, one row per model: ``sig + (m - 1) cm`` minimised over
    each model's pieces for ``m >= S`` (its lower hull), the model itself below ``S``."""

    def __init__(self, models: Sequence[TimeModel], mult_a: np.ndarray, M: int) -> None:
        n = len(models)
        K = max(len(md.sig) for md in models)
        self.SIG = np.full((n, K), _BIG)          # padding never wins a min / max
        self.CM = np.ones((n, K))
        for i, md in enumerate(models):
            self.SIG[i, : len(md.sig)] = md.sig
            self.CM[i, : len(md.cm)] = md.cm
        self.S = np.array([md.S for md in models], dtype=np.int64)
        self.TS = np.array([md.time(int(s)) for md, s in zip(models, self.S)])
        self.models, self.mult_a, self.M = models, mult_a, M

    def hull_time(self, c: np.ndarray) -> np.ndarray:
        return np.min(self.SIG + (c - 1)[:, None] * self.CM, axis=1)

    def counts(self, T: float) -> np.ndarray:
        """Per model the most micro-batches it finishes by ``T`` (at most ``M``)."""
        M, S = self.M, self.S
        c = np.max(np.floor((T - self.SIG) / self.CM), axis=1) + 1
        c = np.clip(c, 0, M).astype(np.int64)
        big = T >= self.TS
        c = np.where(big, np.maximum(c, S), c)
        down = big & (c > S) & (self.hull_time(c) > T)
        c = np.where(down, c - 1, c)
        up = big & (c < M) & (self.hull_time(c + 1) <= T)
        c = np.where(up, c + 1, c)
        if not big.all():
            for i in np.nonzero(~big)[0]:
                c[i] = self.models[i].count(T, M)
        return np.minimum(c, M)

    def times(self, c: np.ndarray) -> np.ndarray:
        out = self.hull_time(np.maximum(c, 1))
        for i in np.nonzero(c < self.S)[0]:
            out[i] = self.models[i].time(int(c[i]))
        return out

    def total(self, c: np.ndarray) -> int:
        """Micro-batches placed by ``c`` (-1 if a pipeline would get none)."""
        return int((self.mult_a * c).sum()) if (c >= 1).all() else -1


def _counts_at_optimum(h: _Hulls, lo: float, P: int) -> np.ndarray:
    """The counts at ``T*``: from ``lo`` (the slowest one-micro-batch time), bisect on ``T``
    alternating with interpolation, snapping the upper end to an achieved time."""
    M, n = h.M, len(h.models)
    c = h.counts(lo)
    n_lo = h.total(c)
    if n_lo >= M:
        return c
    c0 = np.full(n, -(-M // P), dtype=np.int64)
    hi = float(h.times(c0).max())
    n_hi = h.total(h.counts(hi))
    n_lo = max(n_lo, P)
    interp = True
    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
        # alternate interpolation (the count grows ~linearly in T) with bisection steps
        if interp and n_hi > n_lo:
            frac = (M - n_lo) / (n_hi - n_lo)
            mid = lo + (hi - lo) * min(max(frac, 0.02), 0.98)
        else:
            mid = 0.5 * (lo + hi)
        interp = not interp
        c = h.counts(mid)
        n_mid = h.total(c)
        if n_mid >= M:
            hi = float(h.times(c).max())
            n_hi = n_mid
        else:
            lo = mid
            n_lo = max(n_mid, P)
    return h.counts(hi)


def _drop_surplus(models: Sequence[TimeModel], mult_a: np.ndarray, c: np.ndarray, M: int
                  ) -> list[list[int]]:
    """Per copy of each model its micro-batches, the surplus over ``M`` removed from the copies
    that finish last."""
    n = len(models)
    surplus = int((mult_a * c).sum()) - M
    ms = [[int(c[i])] * int(mult_a[i]) for i in range(n)]
    if surplus > 0:
        heap = [(-models[i].time(int(c[i])), i, k) for i in range(n) for k in range(int(mult_a[i]))
                if c[i] > 1]
        heapq.heapify(heap)
        while surplus > 0 and heap:
            _, i, k = heapq.heappop(heap)
            ms[i][k] -= 1
            surplus -= 1
            if ms[i][k] > 1:
                heapq.heappush(heap, (-models[i].time(ms[i][k]), i, k))
    return ms


def split_batches(models: Sequence[TimeModel], mult: Sequence[int], M: int
                  ) -> tuple[float, list[list[int]]] | None:
    """Exact min-max split of ``M`` micro-batches; ``mult[i]`` identical copies of model ``i``.

    Returns ``(T, ms)`` with ``ms[i]`` the micro-batch counts of the copies of model ``i``
    (all ``>= 1``, total ``M``), or ``None`` if no split exists (too few micro-batches or a
    pipeline that cannot hold the model).
    """
    n = len(models)
    mult_a = np.asarray(mult, dtype=np.int64)
    P = int(mult_a.sum())
    if n == 0 or P > M or (mult_a < 1).any():
        return None
    if any(not getattr(md, "feasible", True) for md in models):
        return None
    t1 = np.array([md.time(1) for md in models])
    if not np.isfinite(t1).all():
        return None
    c = _counts_at_optimum(_Hulls(models, mult_a, M), float(t1.max()), P)
    ms = _drop_surplus(models, mult_a, c, M)
    T = max(models[i].time(mm) for i in range(n) for mm in set(ms[i]))
    return float(T), ms
