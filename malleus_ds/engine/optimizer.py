"""ZeRO-1 over per-layer replica sets: torch AdamW on this rank's share of every sync bucket.

Stock ``DeepSpeedZeroOptimizer`` partitions one flat buffer per param group across one process
group per group (MoE uses that for expert-data-parallel groups), but our replica sets are per
*finest TP chunk*: the two halves of one ``wq`` held whole by a TP=1 pipeline sync with two
different TP=2 ranks, which no per-parameter group can express; it also averages gradients over
the group instead of summing them (DESIGN.md §5). So the bucket (grad_sync.Bucket) is the unit:

* ZeRO stage 0: every member keeps fp32 Adam state for the whole bucket;
* ZeRO stage 1: member ``k`` of the bucket's sorted ranks keeps state for the ``k``-th even
  slice only, updates it, and the slices are all-gathered back into everyone's parameters;
* ZeRO stage 2: as stage 1, and the gradients arrive by reduce-scatter (``GradSync``), so the
  summed gradient exists only as each member's slice. (Stock DeepSpeed refuses ZeRO-2 with its
  PipelineEngine because it reduces in backward hooks per micro-batch; here the reduction happens
  once per step after the pipeline drains, so it composes with any schedule. The per-rank
  accumulation buffer ``param.grad`` stays whole across the micro-batches of a step.)

AdamW is element-wise, so updating a flat slice gives the same numbers as updating whole
tensors (torch's multi-tensor AdamW has the single-tensor loop's per-element math, bit for bit).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..migrate.alias import range_aliases
from ..layout import Bucket
from ..views import flatten_range, unflatten, zero_padding


class ShardedOptimizer:
    """Owns fp32 masters of this rank's bucket ranges and a torch optimizer over them."""

    def __init__(self, buckets: list[Bucket], groups, params: dict[str, nn.Parameter], rank: int,
                 zero_stage: int, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 device=None, prev: "ShardedOptimizer | None" = None, from_params: bool = True):
        """``prev``: the previous plan's optimizer (a plan switch). A range that holds the same
        elements in the same order inside memory ``prev`` already has keeps it — the same
        tensors for an identical bucket, views for a bucket that split or merged
        (:func:`malleus_ds.migrate.alias.range_aliases`); nothing moves there (indices in
        :attr:`reused`). ``from_params=False``: other masters start uninitialised (a switch
        fills them)."""
        from ..interop.sections import check_zero_stage

        self.buckets, self.params, self.device = buckets, params, device
        self.zero_stage = check_zero_stage(zero_stage)
        self.groups = [groups.get(b.ranks) if len(b.ranks) > 1 else None for b in buckets]
        self.owned = [b.partition(rank) for b in buckets]            # grad-norm ownership
        self.ranges = [o if zero_stage >= 1 else (0, b.flat_size)
                       for o, b in zip(self.owned, buckets)]
        data = {n: p.data for n, p in params.items()}
        self.masters: list[nn.Parameter | None] = []
        self.reused: set[int] = set()
        carried = _carried(prev, buckets, self.ranges) if prev is not None else {}
        kept: dict[int, dict] = {}
        for i, (b, (lo, hi)) in enumerate(zip(buckets, self.ranges)):
            if i in carried:
                m, kept[i] = carried[i]
                self.masters.append(m)
                self.reused.add(i)
            elif hi <= lo:
                self.masters.append(None)
            elif from_params:
                self.masters.append(nn.Parameter(flatten_range(
                    b, data, lo, hi, torch.empty(hi - lo, dtype=torch.float32, device=device))))
            else:
                # a migration writes every element of the master and both moments (received,
                # copied or derived), never padding: no zero fill, no extra first touch
                self.masters.append(nn.Parameter(_empty_padded(b, lo, hi, device)))
                kept[i] = {k: _empty_padded(b, lo, hi, device) for k in self._KEYS}
        live = [m for m in self.masters if m is not None]
        # a rank with nothing to update (suspended) still gets an optimizer for schedulers
        self.optimizer = make_optimizer(live if live else [nn.Parameter(torch.zeros(0, device=device))])
        for i, st in kept.items():
            self.optimizer.state[self.masters[i]] = st
        # ZeRO-1/2 all-gather the updated slices in the PARAMETER dtype (bf16/fp16 under mixed
        # precision, as BF16_Optimizer.update_lp_params: cast, then gather half the bytes)
        self.param_dtype = next(iter(params.values())).dtype if params else torch.float32
        # (scratch: allocated by the first step that needs it, dropped by free_scratch, so a
        # plan switch never holds two plans' worth of them)
        self._sharded = [zero_stage >= 1 and len(b.ranks) > 1 for b in buckets]
        self._gather: list[torch.Tensor | None] = [None] * len(buckets)

    def _gather_buf(self, i: int) -> torch.Tensor:
        if self._gather[i] is None:
            b = self.buckets[i]
            self._gather[i] = torch.empty(b.padded_part * len(b.ranks), dtype=self.param_dtype,
                                          device=self.device)
        return self._gather[i]

    def free_scratch(self) -> None:
        """Drop the all-gather buffers (a plan switch, before the next plan's state exists)."""
        self._gather = [None] * len(self.buckets)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def owned_sq_norm(self, flats: list[tuple[torch.Tensor, int]],
                      skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """Sum of squares of the gradient elements this rank owns (each element has one owner),
        leaving out the pieces of parameters named in ``skip`` (the second copy of a tied pair),
        as a 0-d float64 tensor on the gradients' device: no host read here (one ``_foreach_norm``
        over the owned windows, computed in fp64 so that the clipping coefficient, and with it
        a low-precision cast of the masters, does not depend on how the elements are split)."""
        views = [f[x - off:y - off] for (f, off), ws in zip(flats, self._norm_windows(skip))
                 for x, y in ws]
        dev = flats[0][0].device if flats else self.device
        if not views:
            return torch.zeros((), dtype=torch.float64, device=dev)
        return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64)).pow(2).sum()

    def _norm_windows(self, skip: frozenset[str]) -> list[list[tuple[int, int]]]:
        """Per bucket, the flat windows of this rank's owned range without ``skip``'s pieces
        (computed once per skip set: the layout does not change within a plan)."""
        cache = self.__dict__.setdefault("_windows", {})
        if skip not in cache:
            out = []
            for b, (lo, hi) in zip(self.buckets, self.owned):
                cuts = sorted((max(f, lo), min(f + e - a, hi)) for pc, a, e, f in b.entries()
                              if pc.name in skip and max(f, lo) < min(f + e - a, hi))
                ws, cur = [], lo
                for x, y in cuts:
                    if x > cur:
                        ws.append((cur, x))
                    cur = max(cur, y)
                if hi > cur:
                    ws.append((cur, hi))
                out.append(ws)
            cache[skip] = out
        return cache[skip]

    @torch.no_grad()
    def step(self, flats: list[tuple[torch.Tensor, int]], clip_coef: float = 1.0) -> None:
        """``flats``: per bucket, summed gradients of elements ``[offset, offset + len)``; they
        are scratch (the next step overwrites them), so clipping scales them in place."""
        grads = []
        for m, (f, off), (lo, hi) in zip(self.masters, flats, self.ranges):
            if m is not None:
                m.grad = f[lo - off:hi - off]
                grads.append(m.grad)
        if clip_coef != 1.0 and grads:
            torch._foreach_mul_(grads, clip_coef)
        self.optimizer.step()
        for i, b in enumerate(self.buckets):
            m, (lo, hi) = self.masters[i], self.ranges[i]
            buf = self._gather_buf(i) if self._sharded[i] else None
            if buf is None:            # stage 0 (or a 1-rank set): we own the whole bucket
                if m is not None:
                    unflatten(b, m.data, self.params_data())   # the whole flat buffer here
                continue
            per = b.padded_part
            mine = torch.zeros(per, dtype=buf.dtype, device=buf.device)
            if m is not None:
                mine[:hi - lo] = m.data            # fp32 master -> parameter dtype
            _all_gather(buf, mine, self.groups[i])
            unflatten(b, buf, self.params_data())
        for m in self.masters:
            if m is not None:
                m.grad = None

    def params_data(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.params.items()}

    # -------------------------------------------------------------- state by parameter name
    # For re-planning / migration: Adam states leave and enter as tensors shaped like this
    # rank's local parameter shards, named by global parameter name (never by bucket offsets).

    _KEYS = ("exp_avg", "exp_avg_sq")

    def step_count(self) -> int:
        for m in self.masters:
            if m is not None and "step" in self.optimizer.state[m]:
                return int(self.optimizer.state[m]["step"])
        return 0

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """fp32 training: masters := this rank's ranges of the parameters (after a migration
        wrote the parameters; in fp32 the master IS the parameter). Reused buckets are current."""
        data = self.params_data()
        for i, b in enumerate(self.buckets):
            m, (lo, hi) = self.masters[i], self.ranges[i]
            if m is not None and i not in self.reused:
                flatten_range(b, data, lo, hi, m.data)

    def moments(self, m: nn.Parameter) -> dict:
        """Master ``m``'s Adam state with both moments present: before the first step Adam has
        none yet, which is zeros."""
        st = self.optimizer.state[m]
        for k in self._KEYS:
            if k not in st:
                st[k] = torch.zeros_like(m.data)
        return st

    def set_step(self, step: int) -> None:
        """Adam's step counter on every master (moments default to zeros where absent)."""
        for m in self.masters:
            if m is not None:
                self.moments(m)["step"] = torch.tensor(float(step))

    @torch.no_grad()
    def gather_state(self, masters: bool = False, moments: bool = True
                     ) -> dict[str, dict[str, torch.Tensor]]:
        """``{"exp_avg": {name: local-shard tensor}, "exp_avg_sq": {...}}`` (fp32) for every
        local parameter, and ``"master"``: the fp32 master weights when ``masters``. Collective
        over each bucket's ranks (ZeRO partitions are all-gathered), so every rank of the plan
        must call it, in the same step."""
        keys = (self._KEYS if moments else ()) + (("master",) if masters else ())
        out = {k: {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                   for n, p in self.params.items()} for k in keys}
        for i, b in enumerate(self.buckets):
            m, (lo, hi) = self.masters[i], self.ranges[i]
            st = self.optimizer.state[m] if m is not None else {}
            dev = self.device
            for k in keys:
                if k == "master":
                    part = m.data if m is not None else torch.zeros(0, device=dev)
                else:
                    part = st.get(k, torch.zeros(hi - lo, device=dev))
                if not self._sharded[i]:
                    unflatten(b, part, out[k])                 # we hold the whole bucket
                    continue
                mine = torch.zeros(b.padded_part, dtype=torch.float32, device=dev)
                mine[:part.numel()] = part
                full = torch.empty(b.padded_part * len(b.ranks), dtype=torch.float32, device=dev)
                _all_gather(full, mine, self.groups[i])
                unflatten(b, full, out[k])
        return out

    @torch.no_grad()
    def load_state(self, states: dict[str, dict[str, torch.Tensor]], step: int,
                   params: dict[str, torch.Tensor] | None = None) -> None:
        """Set masters from ``params`` (fp32 master values by name; default: the current
        parameters) and Adam states from ``states`` (as returned by :meth:`gather_state`, for
        this rank's local parameters); no communication."""
        data = self.params_data() if params is None else params
        for i, b in enumerate(self.buckets):
            m, (lo, hi) = self.masters[i], self.ranges[i]
            if m is None:
                continue
            flatten_range(b, data, lo, hi, m.data)
            st = {k: flatten_range(b, states[k], lo, hi, torch.empty_like(m.data))
                  for k in self._KEYS}
            st["step"] = torch.tensor(float(step))
            self.optimizer.state[m] = st


def _empty_padded(b: Bucket, lo: int, hi: int, device) -> torch.Tensor:
    """An fp32 range ``[lo, hi)`` of bucket ``b``: padding zeroed, the rest uninitialised."""
    t = torch.empty(hi - lo, dtype=torch.float32, device=device)
    zero_padding(t, b, lo)
    return t


def _segments(b: Bucket, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
    return [(pc.name, a, e, f - lo) for pc, a, e, f in b.segments(lo, hi)]


def _carried(prev: ShardedOptimizer, buckets: list[Bucket], ranges: list[tuple[int, int]]
             ) -> dict[int, tuple[nn.Parameter, dict]]:
    """New bucket index -> (master, Adam state) in memory ``prev`` already holds them in.

    Masters and both moments of one range share an offset in parallel allocations (each created
    like its master); where that does not hold, nothing is carried (the switch copies)."""
    olds = {}
    for j, (m, b, (lo, hi)) in enumerate(zip(prev.masters, prev.buckets, prev.ranges)):
        if m is None:
            continue
        st = prev.moments(m)
        ts = (m.data, st["exp_avg"], st["exp_avg_sq"])
        if len({(t.storage_offset(), t.untyped_storage().nbytes(), t.dtype) for t in ts}) != 1:
            return {}
        olds[j] = (tuple(t.untyped_storage().data_ptr() for t in ts), ts, m.storage_offset(),
                   _segments(b, lo, hi))
    sizes = {key: ts[0].untyped_storage().nbytes() // ts[0].element_size()
             for key, ts, _, _ in olds.values()}
    new = {i: (hi - lo, _segments(b, lo, hi))
           for i, (b, (lo, hi)) in enumerate(zip(buckets, ranges))}
    ali = range_aliases({j: (key, off, segs) for j, (key, _, off, segs) in olds.items()},
                        new, sizes)
    base = {key: ts for key, ts, _, _ in olds.values()}
    exact = {(key, off, prev.masters[j].numel()): j for j, (key, _, off, _) in olds.items()}
    out = {}
    for i, (key, p) in ali.items():
        n = new[i][0]
        j = exact.get((key, p, n))
        if j is not None:           # the same range: the same tensors and state dict
            m = prev.masters[j]
            out[i] = (m, prev.optimizer.state[m])
            continue
        m_, a_, s_ = (t.as_strided((n,), (1,), p) for t in base[key])
        out[i] = (nn.Parameter(m_), {"exp_avg": a_, "exp_avg_sq": s_})
    return out


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    try:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=group)
    except (RuntimeError, NotImplementedError):
        n = out.numel() // mine.numel()
        dist.all_gather(list(out.view(n, -1).unbind(0)), mine, group=group)
