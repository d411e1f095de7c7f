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
tensors (``foreach=False`` keeps the per-element math identical to the reference).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .grad_sync import Bucket, flatten_range, unflatten, zero_padding


class ShardedOptimizer:
    """Owns fp32 masters of this rank's bucket ranges and a torch optimizer over them."""

    def __init__(self, buckets: list[Bucket], groups, params: dict[str, nn.Parameter], rank: int,
                 zero_stage: int, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 device=None, reuse: Mapping[tuple, tuple[nn.Parameter, dict]] | None = None,
                 from_params: bool = True):
        """``reuse``: masters and Adam state of a previous plan by :func:`bucket_key` — a bucket
        laid out identically keeps its tensors (a plan switch moves nothing there; indices in
        :attr:`reused`). ``from_params=False``: other masters start uninitialised (a switch
        fills them)."""
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_optimization.stage={zero_stage}: MalleusEngine supports "
                             f"stages 0, 1 and 2 (sharding across each layer's replicas)")
        self.buckets, self.params, self.zero_stage = buckets, params, zero_stage
        self.groups = [groups.get(b.ranks) if len(b.ranks) > 1 else None for b in buckets]
        self.owned = [b.partition(rank) for b in buckets]            # grad-norm ownership
        self.ranges = [o if zero_stage >= 1 else (0, b.flat_size)
                       for o, b in zip(self.owned, buckets)]
        data = {n: p.data for n, p in params.items()}
        self.masters: list[nn.Parameter | None] = []
        self.reused: set[int] = set()
        kept: dict[int, dict] = {}
        for i, (b, (lo, hi)) in enumerate(zip(buckets, self.ranges)):
            old = (reuse or {}).get(bucket_key(b, (lo, hi)))
            if old is not None:
                self.masters.append(old[0])
                self.reused.add(i)
                kept[i] = old[1]
            elif hi <= lo:
                self.masters.append(None)
            elif from_params:
                self.masters.append(nn.Parameter(flatten_range(
                    b, data, lo, hi, torch.empty(hi - lo, dtype=torch.float32, device=device))))
            else:
                m = torch.empty(hi - lo, device=device)
                zero_padding(m, b, lo)      # a migration writes every element, never padding
                self.masters.append(nn.Parameter(m))
        live = [m for m in self.masters if m is not None]
        # a rank with nothing to update (suspended) still gets an optimizer for schedulers
        self.optimizer = make_optimizer(live if live else [nn.Parameter(torch.zeros(0, device=device))])
        for i, st in kept.items():
            self.optimizer.state[self.masters[i]] = st
        # ZeRO-1/2 all-gather the updated slices in the PARAMETER dtype (bf16/fp16 under mixed
        # precision, as BF16_Optimizer.update_lp_params: cast, then gather half the bytes)
        self.param_dtype = next(iter(params.values())).dtype if params else torch.float32
        self._gather = [torch.empty(b.padded_part * len(b.ranks), dtype=self.param_dtype,
                                    device=device) if zero_stage >= 1
                        and len(b.ranks) > 1 else None for b in buckets]

    def reusable(self) -> dict[tuple, tuple[nn.Parameter, dict]]:
        """``bucket_key -> (master, Adam state)`` for a next plan's optimizer to keep."""
        return {bucket_key(b, r): (m, self.optimizer.state[m])
                for b, r, m in zip(self.buckets, self.ranges, self.masters) if m is not None}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def owned_sq_norm(self, flats: list[tuple[torch.Tensor, int]],
                      skip: frozenset[str] = frozenset()) -> float:
        """Sum of squares of the gradient elements this rank owns (each element has one owner),
        leaving out the pieces of parameters named in ``skip`` (the second copy of a tied pair)."""
        s = 0.0
        for b, (f, off), (lo, hi) in zip(self.buckets, flats, self.owned):
            if hi > lo:
                s += float(f[lo - off:hi - off].double().pow(2).sum())
                if skip:
                    for pc, a, z, o in b.entries():
                        x, y = max(o, lo), min(o + z - a, hi)
                        if pc.name in skip and y > x:
                            s -= float(f[x - off:y - off].double().pow(2).sum())
        return s

    @torch.no_grad()
    def step(self, flats: list[tuple[torch.Tensor, int]], clip_coef: float = 1.0) -> None:
        """``flats``: per bucket, summed gradients of elements ``[offset, offset + len)``."""
        for m, (f, off), (lo, hi) in zip(self.masters, flats, self.ranges):
            if m is not None:
                g = f[lo - off:hi - off]
                m.grad = g * clip_coef if clip_coef != 1.0 else g
        self.optimizer.step()
        for i, b in enumerate(self.buckets):
            m, (lo, hi), buf = self.masters[i], self.ranges[i], self._gather[i]
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

    def set_step(self, step: int) -> None:
        """Adam's step counter on every master (moments default to zeros where absent)."""
        for m in self.masters:
            if m is not None:
                st = self.optimizer.state[m]
                for k in self._KEYS:
                    if k not in st:
                        st[k] = torch.zeros_like(m.data)
                st["step"] = torch.tensor(float(step))

    @torch.no_grad()
    def gather_state(self, masters: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """``{"exp_avg": {name: local-shard tensor}, "exp_avg_sq": {...}}`` (fp32) for every
        local parameter, and ``"master"``: the fp32 master weights when ``masters``. Collective
        over each bucket's ranks (ZeRO partitions are all-gathered), so every rank of the plan
        must call it, in the same step."""
        keys = self._KEYS + (("master",) if masters else ())
        out = {k: {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                   for n, p in self.params.items()} for k in keys}
        for i, b in enumerate(self.buckets):
            m, (lo, hi), buf = self.masters[i], self.ranges[i], self._gather[i]
            st = self.optimizer.state[m] if m is not None else {}
            dev = buf.device if buf is not None else None
            for k in keys:
                if k == "master":
                    part = m.data if m is not None else torch.zeros(0, device=dev)
                else:
                    part = st.get(k, torch.zeros(hi - lo, device=dev))
                if buf is None:
                    unflatten(b, part, out[k])                 # we hold the whole bucket
                    continue
                mine = torch.zeros(b.padded_part, dtype=torch.float32, device=buf.device)
                mine[:part.numel()] = part
                full = torch.empty(buf.shape, dtype=torch.float32, device=buf.device)
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


def bucket_key(b: Bucket, rng: tuple[int, int]) -> tuple:
    """Identity of a bucket's optimizer range: same rank set, same pieces, same range."""
    return b.ranks, tuple(b.pieces), tuple(rng)


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    try:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=group)
    except (RuntimeError, NotImplementedError):
        n = out.numel() // mine.numel()
        dist.all_gather(list(out.view(n, -1).unbind(0)), mine, group=group)
