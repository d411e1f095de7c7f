"""Which optimizer ranges of the next plan can stay where the running plan keeps them (pure).

An optimizer range (a bucket's fp32 masters, ``exp_avg``, ``exp_avg_sq`` on one rank) is one flat
tensor. A switch that changes which pieces share a bucket — rank 1's bucket of layers 8-16 with
holders {1, 3} splitting into {1, 2} for 8-12 and {1, 3} for 12-16 — gives a rank new ranges
that hold the same elements as before, in the same order, inside memory it already has
(``Bucket``'s member-major layout keeps a member's part of every piece in piece order). Such a
range becomes a *view* of that memory: no allocation, no copy. Merging back is a view too when
the parts still sit side by side in one allocation.

:func:`range_aliases` decides it from segment lists only (no torch), so it is tested against a
brute-force element map. A new range ``i`` aliases ``(storage, p)`` when

* every segment of ``i`` lies inside one old segment, at the same relative position
  (``p + off == old position``), the same ``p`` for all of them;
* the window ``[p, p + size)`` holds no other old element (its padding falls on old padding), so
  two new ranges never share an element;
* the windows on one storage are disjoint and, together, hold *every* old element on that storage
  — otherwise none of them alias it (the storage is released and its ranges get fresh memory): a
  storage is never kept alive for a part of it, so memory does not grow over many switches.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Hashable, Mapping, Sequence

#: ``(name, lo, hi, off)``: canonical elements ``[lo, hi)`` of parameter ``name`` sit at element
#: ``off`` of the range (``malleus_ds.layout.Bucket.segments`` relative to the range start).
Seg = tuple[str, int, int, int]


def range_aliases(old: Mapping[int, tuple[Hashable, int, Sequence[Seg]]],
                  new: Mapping[int, tuple[int, Sequence[Seg]]],
                  storage_size: Mapping[Hashable, int]) -> dict[int, tuple[Hashable, int]]:
    """``old[j] = (storage, offset, segs)``: the running plan's range ``j`` starts at element
    ``offset`` of ``storage``; ``new[i] = (size, segs)``: the next plan's range ``i``;
    ``storage_size``: elements per storage. Returns ``i -> (storage, p)`` for the new ranges that
    are a view ``[p, p + size)`` of an old storage (see the module docstring)."""
    by_name: dict[str, list[tuple[int, int, Hashable, int]]] = {}
    real: dict[Hashable, list[tuple[int, int]]] = {}        # storage -> old element positions
    for st, offset, segs in old.values():
        for name, lo, hi, off in segs:
            by_name.setdefault(name, []).append((lo, hi, st, offset + off))
            real.setdefault(st, []).append((offset + off, offset + off + hi - lo))
    for v in by_name.values():
        v.sort(key=lambda x: x[0])
    starts = {n: [x[0] for x in v] for n, v in by_name.items()}
    for v in real.values():
        v.sort()

    found: dict[int, tuple[Hashable, int, int, int]] = {}   # i -> (storage, p, size, elements)
    for i, (size, segs) in new.items():
        if size <= 0 or not segs:
            continue
        at = None
        n = 0
        for name, lo, hi, off in segs:
            olds = by_name.get(name)
            k = bisect_right(starts.get(name, []), lo) - 1
            if not olds or k < 0 or olds[k][1] < hi:
                at = None
                break
            olo, _, st, pos = olds[k]
            here = (st, pos + lo - olo - off)
            if at is None:
                at = here
            elif here != at:
                at = None
                break
            n += hi - lo
        if at is None:
            continue
        st, p = at
        if p < 0 or p + size > storage_size.get(st, -1):
            continue
        if _elements_in(real[st], p, p + size) != n:
            continue        # the window would take in old elements that are not this range's
        found[i] = (st, p, size, n)

    on: dict[Hashable, list[tuple[int, int, int, int]]] = {}
    for i, (st, p, size, n) in found.items():
        on.setdefault(st, []).append((p, p + size, n, i))
    out: dict[int, tuple[Hashable, int]] = {}
    for st, ws in on.items():
        ws.sort()
        disjoint = all(a[1] <= b[0] for a, b in zip(ws, ws[1:]))
        whole = sum(w[2] for w in ws) == sum(b - a for a, b in real[st])
        if disjoint and whole:
            out.update((w[3], (st, w[0])) for w in ws)
    return out


def _elements_in(spans: list[tuple[int, int]], a: int, b: int) -> int:
    """Elements of the sorted, disjoint ``spans`` inside ``[a, b)``."""
    k = max(0, bisect_right(spans, (a, a)) - 1)
    n = 0
    while k < len(spans) and spans[k][0] < b:
        x, y = max(spans[k][0], a), min(spans[k][1], b)
        n += max(0, y - x)
        k += 1
    return n
