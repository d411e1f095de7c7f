"""The transfer plan: who sends which slice of which tensor to whom when the plan changes (pure).

Every rank computes the same plan from (old plan, new plan, parameter table, ZeRO stages,
precision) with no communication, after Megatron-Core's resharding planner: holdings under
both plans come from the slice map (``malleus_ds.layout.plan_holdings``), and

* each rank needs, per (kind, tensor), its new holdings minus its old ones — nothing it already
  holds moves (what it holds in another buffer is a local copy, :func:`kept_slices`);
* under bf16/fp16 the low-precision ``param`` is re-cast from the fp32 ``master`` wherever the
  rank receives the master anyway, so those elements are not sent twice;
* every needed element arrives exactly once, from one old holder chosen by Hetu's NEW_GREEDY
  rule: a holder on the receiver's node first, then the holder with the fewest bytes assigned so
  far, ties broken by the lower rank. Consecutive elements from one sender form one transfer;
  each end maps it onto its own buffers (``apply.StateView.views`` splits at buffer boundaries).

The lower bound on network bytes is Σ over ranks of the elements newly held × bytes per element;
this plan meets it exactly (``TransferPlan.bytes == lower_bound``), which the tests check against
an independent element-by-element count.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, TypeVar

from ..job_layout import JobLayout
from ..layout import Interval, ParamTable, intersect, kinds, merge, plan_holdings, subtract
from ..plan import Plan

#: fp32 optimizer kinds; ``param`` is the parameter dtype's size (``param_bytes``).
STATE_BYTES = 4


@dataclass(frozen=True, order=True)
class Transfer:
    """``src`` sends elements ``[lo, hi)`` (canonical order, ``malleus_ds.layout``) of ``kind``
    of parameter ``name`` to ``dst``."""

    src: int
    dst: int
    kind: str
    name: str
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Layout:
    """What decides holdings besides the precision (``mixed``, passed on its own): the plan and
    its ZeRO stage."""

    plan: Plan
    zero_stage: int = 0


@dataclass
class TransferPlan:
    transfers: list[Transfer] = field(default_factory=list)
    param_bytes: int = 4
    lower_bound: int = 0           # Σ elements newly held × bytes, counted independently

    def bytes_of(self, t: Transfer) -> int:
        return t.numel * (self.param_bytes if t.kind == "param" else STATE_BYTES)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_of(t) for t in self.transfers)


def _by_rank(entries) -> dict[int, list[Interval]]:
    out: dict[int, list[Interval]] = {}
    for lo, hi, r in entries:
        out.setdefault(r, []).append((lo, hi))
    for v in out.values():
        v.sort()
    return out


class HolderIndex:
    """Old holders of one (kind, tensor), cut into elementary segments: for any interval, which
    ranks hold each part."""

    def __init__(self, entries: list[tuple[int, int, int]]) -> None:
        cuts = sorted({x for lo, hi, _ in entries for x in (lo, hi)})
        self.cuts = cuts
        # holders of segment [cuts[i], cuts[i+1])
        self.holders: list[list[int]] = [[] for _ in range(max(0, len(cuts) - 1))]
        index = {c: i for i, c in enumerate(cuts)}
        for lo, hi, r in entries:
            for i in range(index[lo], index[hi]):
                self.holders[i].append(r)
        for h in self.holders:
            h.sort()

    def split(self, lo: int, hi: int):
        """``(a, b, holders)`` covering ``[lo, hi)``; raises if some part has no holder."""
        i = bisect_right(self.cuts, lo) - 1
        a = lo
        while a < hi:
            if i < 0 or i >= len(self.holders) or not self.holders[i]:
                raise ValueError(f"no old holder for elements [{a}, {hi})")
            b = min(hi, self.cuts[i + 1])
            yield a, b, self.holders[i]
            a, i = b, i + 1


def transfer_plan(old: Layout, new: Layout, table: ParamTable, *, mixed: bool = False,
                  param_bytes: int = 4, job: JobLayout | None = None) -> TransferPlan:
    """The network transfers that take every rank from its holdings under ``old`` to those under
    ``new`` (module docstring). Deterministic: the same on every rank. ``job`` gives the node
    shape (a holder on the receiver's node is preferred); None: one node."""
    oh = plan_holdings(old.plan, table, old.zero_stage, mixed)
    nh = plan_holdings(new.plan, table, new.zero_stage, mixed)
    same_node = job.same_node if job is not None else (lambda a, b: True)
    load: dict[int, int] = {}
    out = TransferPlan(param_bytes=param_bytes)
    for kind in kinds(mixed):
        size = param_bytes if kind == "param" else STATE_BYTES
        for spec in table:
            key = (kind, spec.name)
            new_e = nh.get(key)
            if not new_e:
                continue
            old_e = oh.get(key, [])
            if new_e == old_e:      # same holders, same slices (most tensors in a re-plan)
                continue
            old_r = _by_rank(old_e)
            masters = _by_rank(nh.get(("master", spec.name), ())) if mixed and kind == "param" \
                else {}
            src = None
            for lo, hi, r in sorted(new_e, key=lambda e: (e[2], e[0])):
                need = subtract([(lo, hi)], old_r.get(r, ()))
                if mixed and kind == "param" and need:
                    # re-cast locally from the master the rank receives or keeps
                    need = subtract(need, masters.get(r, ()))
                if not need:
                    continue
                if src is None:
                    src = HolderIndex(old_e)
                for a, b in need:
                    out.lower_bound += (b - a) * size
                    cur = None
                    for x, y, holders in src.split(a, b):
                        near = [h for h in holders if same_node(h, r)] or holders
                        s = min(near, key=lambda h: (load.get(h, 0), h))
                        load[s] = load.get(s, 0) + (y - x) * size
                        if cur is not None and cur[0] == s and cur[2] == x:
                            cur[2] = y
                        else:
                            if cur is not None:
                                out.transfers.append(Transfer(cur[0], r, kind, spec.name, cur[1], cur[2]))
                            cur = [s, x, y]
                    out.transfers.append(Transfer(cur[0], r, kind, spec.name, cur[1], cur[2]))
    return out


S = TypeVar("S")


def chunked(slices: Iterable[S], cap: int) -> Iterator[list[S]]:
    """Groups of slices (anything with ``lo`` / ``hi``, e.g. :class:`Transfer`) of at most ``cap``
    elements in all, a long slice split across groups: bounded staging buffers."""
    group: list = []
    room = cap
    for t in slices:
        lo = t.lo
        while lo < t.hi:
            n = min(room, t.hi - lo)
            group.append(replace(t, lo=lo, hi=lo + n))
            lo, room = lo + n, room - n
            if room == 0:
                yield group
                group, room = [], cap
    if group:
        yield group


def kept_slices(old: Iterable, new: Iterable) -> list[tuple[str, str, int, int]]:
    """``(kind, name, lo, hi)`` a rank holds both in ``old`` and in ``new`` (its holdings under
    two plans, anything with ``kind`` / ``name`` / ``lo`` / ``hi`` such as ``layout.Hold``): copied
    from its old buffers into its new ones, never sent. Per rank, no other rank's holdings."""
    by_old: dict[tuple[str, str], list[Interval]] = {}
    for h in old:
        by_old.setdefault((h.kind, h.name), []).append((h.lo, h.hi))
    by_new: dict[tuple[str, str], list[Interval]] = {}
    for h in new:
        by_new.setdefault((h.kind, h.name), []).append((h.lo, h.hi))
    out = []
    for key, iv in by_new.items():
        if key in by_old:
            out += [(key[0], key[1], a, b) for a, b in intersect(merge(iv), merge(by_old[key]))]
    return out
