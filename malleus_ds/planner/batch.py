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
    K = max(len(md.sig) for md in models)
    SIG = np.full((n, K), _BIG)          # padding never wins a min / max
    CM = np.ones((n, K))
    for i, md in enumerate(models):
        SIG[i, : len(md.sig)] = md.sig
        CM[i, : len(md.cm)] = md.cm
    S = np.array([md.S for md in models], dtype=np.int64)
    TS = np.array([md.time(int(s)) for md, s in zip(models, S)])

    def hull_time(c: np.ndarray) -> np.ndarray:
        return np.min(SIG + (c - 1)[:, None] * CM, axis=1)

    def counts(T: float) -> np.ndarray:
        c = np.max(np.floor((T - SIG) / CM), axis=1) + 1
        c = np.clip(c, 0, M).astype(np.int64)
        big = T >= TS
        c = np.where(big, np.maximum(c, S), c)
        down = big & (c > S) & (hull_time(c) > T)
        c = np.where(down, c - 1, c)
        up = big & (c < M) & (hull_time(c + 1) <= T)
        c = np.where(up, c + 1, c)
        if not big.all():
            for i in np.nonzero(~big)[0]:
                c[i] = models[i].count(T, M)
        return np.minimum(c, M)

    def times(c: np.ndarray) -> np.ndarray:
        out = hull_time(np.maximum(c, 1))
        for i in np.nonzero(c < S)[0]:
            out[i] = models[i].time(int(c[i]))
        return out

    def total(c: np.ndarray) -> int:
        """Micro-batches placed by ``c`` (-1 if a pipeline would get none)."""
        return int((mult_a * c).sum()) if (c >= 1).all() else -1

    lo = float(t1.max())
    c = counts(lo)
    n_lo = total(c)
    if n_lo >= M:
        hi = lo
    else:
        c0 = np.full(n, -(-M // P), dtype=np.int64)
        hi = float(times(c0).max())
        n_hi = total(counts(hi))
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
            c = counts(mid)
            n_mid = total(c)
            if n_mid >= M:
                hi = float(times(c).max())
                n_hi = n_mid
            else:
                lo = mid
                n_lo = max(n_mid, P)
        c = counts(hi)
    # remove the surplus from the copies that finish last
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
    T = max(models[i].time(mm) for i in range(n) for mm in set(ms[i]))
    return float(T), ms
