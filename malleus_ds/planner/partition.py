"""Exact, memory-aware layer split of one pipeline (DESIGN.md §4c) and its time function.

A pipeline is an ordered list of TP groups (stages) with rates ``y_j`` and sizes ``g_j``. For
``m`` micro-batches we choose integer layer counts ``l_j >= 1`` with ``sum l_j = L`` and
``l_j <= cap_j(m)`` (memory) minimising the 1F1B time

    T(m) = sum_j y_j l_j + (m - 1) * max_j y_j l_j .

Exactness: fix a cap ``C`` on the max stage time. Then ``sum y_j l_j`` subject to
``1 <= l_j <= min(cap_j, floor(C / y_j))`` is minimised by filling the fastest stages first
(unit items, linear cost). The optimum's max stage time is some ``y_j * k``, so trying every
``C in {y_j * k}`` and keeping the best finds the exact optimum. Every (sigma, cmax) pair that
is not dominated is kept, so ``T(m) = min_k sigma_k + (m - 1) cmax_k`` is exact for all ``m``
at once (for ``m >= S``, where the memory caps stop depending on ``m``; smaller ``m`` are
solved separately with their looser caps).

Stage order only matters for memory (stage ``j`` keeps ``min(S - j, m)`` activations in
flight; first and last stages hold an embedding). We try a few orders and keep the best per m.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..cost import RECOMPUTE_FACTOR, stage_memory_terms
from ..problem import Memory

_EPS = 1e-9


def layer_cap(memory: Memory | None, tp: int, g: int, j: int, S: int, m: int, L: int,
              recompute: bool = False) -> int:
    """Most layers stage ``j`` of ``S`` (group size ``g``) can hold under the memory model
    (``recompute``: with activation checkpointing)."""
    if memory is None:
        return L
    per_layer, fixed = stage_memory_terms(memory, tp, g, j, S, m, recompute)
    room = memory.budget_mb - fixed
    if per_layer <= 0:
        return L if room >= -_EPS else 0
    cap = int(math.floor(room / per_layer + 1e-12)) if room >= 0 else 0
    cap = max(0, min(cap, L))
    # guard against rounding: cost.check_memory accepts cap * per_layer + fixed <= budget + 1e-9
    while cap > 0 and cap * per_layer + fixed > memory.budget_mb + _EPS:
        cap -= 1
    return cap


def frontier(y: Sequence[float], caps: Sequence[int], L: int,
             const: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-dominated (sigma, cmax, layers) of splits of ``L`` layers over stages ``y``/``caps``.

    Stage ``j`` takes ``y_j * l_j + const_j`` (``const``: e.g. point-to-point time, default 0).
    Returns arrays ``sigma (K,)``, ``cmax (K,)`` sorted by cmax ascending (sigma descending)
    and ``layers (K, S)`` in the given stage order. ``K == 0`` means no split fits.
    """
    y = np.asarray(y, dtype=float)
    S = len(y)
    cst = np.zeros(S) if const is None else np.asarray(const, dtype=float)
    caps = np.minimum(np.asarray(caps, dtype=np.int64), L - (S - 1))
    if S == 0 or S > L or (caps < 1).any() or caps.sum() < L:
        return np.zeros(0), np.zeros(0), np.zeros((0, S), dtype=np.int64)
    order = np.argsort(y, kind="stable")           # fastest first: greedy fill order
    ys, cs, cc = y[order], caps[order], cst[order]
    cand = np.unique(np.concatenate([ys[j] * np.arange(1, cs[j] + 1) + cc[j] for j in range(S)]))
    # (K, S) per-stage bounds for each candidate cap C
    b = np.minimum(cs[None, :],
                   np.floor((cand[:, None] - cc[None, :]) / ys[None, :] + _EPS).astype(np.int64))
    ok = (b >= 1).all(axis=1) & (b.sum(axis=1) >= L)
    b = b[ok]
    if len(b) == 0:
        return np.zeros(0), np.zeros(0), np.zeros((0, S), dtype=np.int64)
    extra = b - 1
    cum_before = np.cumsum(extra, axis=1) - extra
    lay = 1 + np.clip((L - S) - cum_before, 0, extra)     # (K, S) greedy fill
    t = lay * ys[None, :] + cc[None, :]
    sigma = t.sum(axis=1)
    cmax = t.max(axis=1)
    keep = _pareto(sigma, cmax)
    out = np.empty((len(keep), S), dtype=np.int64)
    out[:, order] = lay[keep]
    return sigma[keep], cmax[keep], out


def _pareto(sigma: np.ndarray, cmax: np.ndarray) -> np.ndarray:
    """Indices of the (cmax, sigma) pairs no other pair beats in both, by cmax ascending."""
    idx = np.lexsort((sigma, cmax))                        # cmax asc, then sigma asc
    s = sigma[idx]
    prev = np.concatenate(([np.inf], np.minimum.accumulate(s)[:-1]))
    return idx[s < prev - 1e-12]


def _hull_count(sig: np.ndarray, cm: np.ndarray, T: float, cap: int) -> int:
    """Largest ``m <= cap`` with ``min_k sig_k + (m - 1) cm_k <= T`` (0 if none)."""
    if len(sig) == 0 or cap < 1:
        return 0

    def t(m: int) -> float:
        return float(np.min(sig + (m - 1) * cm))

    m = int(np.max(np.floor((T - sig) / cm))) + 1
    m = max(0, min(m, cap))
    while m > 0 and t(m) > T:
        m -= 1
    while m < cap and t(m + 1) <= T:
        m += 1
    return m


def split_layers(y: Sequence[float], caps: Sequence[int], L: int, m: int) -> tuple[float, list[int]] | None:
    """Exact min of ``sum y l + (m-1) max y l`` over splits; ``None`` if memory forbids any."""
    sig, cm, lay = frontier(y, caps, L)
    if len(sig) == 0:
        return None
    v = sig + (m - 1) * cm
    k = int(np.argmin(v))
    return float(v[k]), [int(a) for a in lay[k]]


# --------------------------------------------------------------------------------------------
# A pipeline's time function T(m)
# --------------------------------------------------------------------------------------------


def stage_orders(y: Sequence[float], g: Sequence[int]) -> list[tuple[int, ...]]:
    """Candidate stage orders: slowest first; fastest first; fast at both ends, slow inside."""
    n = len(y)
    desc = tuple(sorted(range(n), key=lambda i: (-y[i], g[i], i)))
    asc = tuple(sorted(range(n), key=lambda i: (y[i], -g[i], i)))
    out = [desc]
    if asc != desc:
        out.append(asc)
    if n >= 3:
        mid = (asc[0],) + asc[2:] + (asc[1],)
        if mid not in out:
            out.append(mid)
    return out


@dataclass
class PipelineModel:
    """Exact ``T(m)`` of one pipeline composition (multiset of groups), memory-aware.

    ``groups`` is a sequence of ``(y, g)``. Frontier entries combine all tried stage orders.
    ``recompute`` (activation checkpointing): each layer costs ``RECOMPUTE_FACTOR`` and keeps
    only its input (``cost.stage_memory_terms``); the head and the links are not recomputed.
    """

    groups: tuple[tuple[float, int], ...]
    L: int
    tp: int
    memory: Memory | None
    link: float = 0.0            # per-boundary point-to-point cost (model units), 0 = none
    head: float = 0.0            # the output head, in layers, paid by the last stage
    recompute: bool = False      # activation checkpointing
    sig: np.ndarray = field(init=False)
    cm: np.ndarray = field(init=False)
    _lay: np.ndarray = field(init=False, repr=False)
    _ord: np.ndarray = field(init=False, repr=False)
    _small: dict = field(init=False, repr=False, default_factory=dict)
    _nomem: tuple | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.S = len(self.groups)
        self._orders = stage_orders([a for a, _ in self.groups], [b for _, b in self.groups])
        self.sig, self.cm, self._lay, self._ord = self._build(self.S)

    def _build(self, m: int, memory: bool = True):
        """Frontier valid for ``m`` micro-batches (for any ``m >= S`` when ``m == S``);
        ``memory=False``: without memory caps (a bound)."""
        sigs, cms, lays, ords = [], [], [], []
        # order matters for memory, and for time when the last stage also runs the head
        per = RECOMPUTE_FACTOR if self.recompute else 1.0    # one layer's compute, rate 1
        for o in (self._orders if memory or self.head else self._orders[:1]):
            ys = [self.groups[i][0] * per for i in o]        # time of one layer on each stage
            caps = [layer_cap(self.memory if memory else None, self.tp, self.groups[i][1], j,
                              self.S, m, self.L, self.recompute) for j, i in enumerate(o)]
            const = None
            if (self.link and self.S > 1) or self.head:
                # each boundary charges both of its stages; the last stage runs the head
                const = [self.link * ((j > 0) + (j < self.S - 1)) for j in range(self.S)]
                const[-1] += self.groups[o[-1]][0] * self.head
            s, c, l = frontier(ys, caps, self.L, const)
            if len(s):
                sigs.append(s), cms.append(c), lays.append(l)
                ords.append(np.tile(np.asarray(o), (len(s), 1)))
        if not sigs:
            e = np.zeros(0)
            return e, e, np.zeros((0, self.S), np.int64), np.zeros((0, self.S), np.int64)
        s, c, l, o = (np.concatenate(sigs), np.concatenate(cms), np.concatenate(lays),
                      np.concatenate(ords))
        keep = _pareto(s, c)
        return s[keep], c[keep], l[keep], o[keep]

    @property
    def feasible(self) -> bool:
        return len(self.sig) > 0

    def _frontier_for(self, m: int):
        if m >= self.S or self.memory is None:      # no memory: caps do not depend on m
            return self.sig, self.cm, self._lay, self._ord
        if m not in self._small:
            self._small[m] = self._build(m)
        return self._small[m]

    def time(self, m: int) -> float:
        """Exact optimal pipeline time for ``m`` micro-batches (inf if memory forbids)."""
        s, c, _, _ = self._frontier_for(m)
        if len(s) == 0:
            return math.inf
        return float(np.min(s + (m - 1) * c))

    def count(self, T: float, cap: int) -> int:
        """Largest ``m <= cap`` with ``time(m) <= T`` (0 if none)."""
        if not self.feasible:
            return 0
        tS = self.time(self.S)
        if T >= tS:
            m = int(np.max(np.floor((T - self.sig) / self.cm))) + 1
            m = max(self.S, min(m, cap))
            while m > self.S and self.time(m) > T:
                m -= 1
            while m < cap and self.time(m + 1) <= T:
                m += 1
            return min(m, cap)
        # m < S: exact frontiers are built per m (looser memory caps), so first narrow the range:
        # the m >= S frontier has tighter caps (an upper bound on time(m): a lower bound on the
        # count); the frontier without memory caps is a lower bound on time(m).
        hi = min(self.S - 1, cap)
        lo = min(_hull_count(self.sig, self.cm, T, hi), hi)
        if self.memory is None or lo >= hi:
            return lo
        if self._nomem is None:
            self._nomem = self._build(self.S, memory=False)
        hi = min(hi, _hull_count(self._nomem[0], self._nomem[1], T, hi))
        while lo < hi:                        # time(lo) <= T (or lo = 0); binary search
            mid = (lo + hi + 1) // 2
            if self.time(mid) <= T:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def layout(self, m: int) -> tuple[list[int], list[int]]:
        """(stage order as indices into ``groups``, layers per stage) optimal for ``m``."""
        s, c, l, o = self._frontier_for(m)
        if len(s) == 0:
            raise ValueError("pipeline cannot hold the model under the memory budget")
        k = int(np.argmin(s + (m - 1) * c))
        return [int(a) for a in o[k]], [int(a) for a in l[k]]
