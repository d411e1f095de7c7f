"""The slice map: which slice of which tensor every rank holds under a plan (pure, no torch).

One answer shared by gradient sync (buckets), the optimizer (ZeRO partitions), checkpoints and the
migrator. It reads a :class:`ParamTable` (global name, full shape, TP split dim, owner layer), never
a model's parameter names, so another model family plugs in by providing its own table.

Coordinates. Every parameter is addressed in its **canonical flat order**: the full tensor with
its TP split dim moved to the front, flattened row-major (``full.movedim(d, 0).reshape(-1)``; a
replicated tensor is simply flattened). In that order every slice the engine ever holds is ONE
interval ``[lo, hi)``:

* TP slice ``k`` of ``g`` (``narrow(d, k*n/g, n/g)``) = ``[k*N/g, (k+1)*N/g)`` (``N`` = numel);
* a finest gradient-sync chunk ``c`` of ``G`` = ``[c*N/G, (c+1)*N/G)``;
* a ZeRO partition of a bucket (a range of the concatenated, canonical-ordered pieces) = one
  interval per piece it overlaps.

So holdings are interval lists, the transfer plan is interval arithmetic, and a row-parallel
weight's column block (strided in memory) is still one interval here; the executor turns it back
into a 2-D strided window (``malleus_ds_kernels.pack``).

Buckets (DESIGN.md §5): each piece of a local parameter (a finest chunk of a TP-sharded weight,
or the whole of a weight TP replicates) has a holder set; pieces with the same holder set form a
bucket, ordered by (layer, name, chunk) so every member lays it out identically; member ``k`` of
the sorted rank set owns the ``k``-th even slice under ZeRO-1/2.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Iterable, Iterator, Mapping, Sequence

from .job_layout import finest_tp
from .plan import Plan, Stage

#: Owner ids beyond layers 0..L-1: the embedding and the final norm + head (every model uses these).
EMBED = -1
HEAD = -2

RankSet = tuple[int, ...]
Interval = tuple[int, int]


# ----------------------------------------------------------------------------------- table


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the whole model. ``split_dim``: the dim TP splits (None: replicated in a
    TP group). ``owner``: the layer index, ``EMBED`` or ``HEAD``."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None
    owner: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.split_dim is None or tp_size == 1:
            return self.shape
        s = list(self.shape)
        s[self.split_dim] //= tp_size
        return tuple(s)

    def tp_interval(self, tp_rank: int, tp_size: int) -> Interval:
        """Canonical interval of TP slice ``tp_rank`` of ``tp_size`` (the whole for replicated)."""
        if self.split_dim is None:
            return 0, self.numel
        w = self.numel // tp_size
        return tp_rank * w, (tp_rank + 1) * w


@dataclass(frozen=True)
class ParamTable:
    """The model's parameters in a fixed order. Validated: unique names, split dims in range."""

    specs: tuple[ParamSpec, ...]
    by_name: Mapping[str, ParamSpec] = field(init=False, compare=False, repr=False)
    by_owner: Mapping[int, tuple[ParamSpec, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        names: dict[str, ParamSpec] = {}
        owners: dict[int, list[ParamSpec]] = {}
        for s in self.specs:
            if s.name in names:
                raise ValueError(f"parameter table: duplicate name {s.name!r}")
            if s.split_dim is not None and not 0 <= s.split_dim < len(s.shape):
                raise ValueError(f"parameter table: {s.name} split_dim={s.split_dim} outside its "
                                 f"{len(s.shape)} dims")
            names[s.name] = s
            owners.setdefault(s.owner, []).append(s)
        object.__setattr__(self, "by_name", names)
        object.__setattr__(self, "by_owner", {k: tuple(v) for k, v in owners.items()})

    def __getitem__(self, name: str) -> ParamSpec:
        return self.by_name[name]

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.specs)

    def owned(self, owner: int) -> tuple[ParamSpec, ...]:
        return self.by_owner.get(owner, ())

    def check_tp(self, tp_size: int, where: str = "") -> None:
        """ValueError unless ``tp_size`` divides every split dim."""
        for s in self.specs:
            if s.split_dim is not None and s.shape[s.split_dim] % tp_size:
                pre = f"{where}: " if where else ""
                raise ValueError(f"{pre}TP size {tp_size} does not divide {s.name} dim "
                                 f"{s.split_dim} of size {s.shape[s.split_dim]}")


# ----------------------------------------------------------------------------------- plan


def stage_owners(plan: Plan, i: int, j: int) -> list[int]:
    """Owner ids held by stage ``j`` of pipeline ``i``: embedding on first, head on last stages."""
    p = plan.pipelines[i]
    st = p.stages[j]
    return (([EMBED] if j == 0 else []) + list(range(st.start, st.end))
            + ([HEAD] if j == len(p.stages) - 1 else []))


def owner_holders(plan: Plan, owner: int) -> list[Stage]:
    """The stage holding ``owner`` in each pipeline, in pipeline order."""
    out = []
    for p in plan.pipelines:
        if owner == EMBED:
            out.append(p.stages[0])
        elif owner == HEAD:
            out.append(p.stages[-1])
        else:
            out.append(next(s for s in p.stages if s.start <= owner < s.end))
    return out


def chunk_holders(holders: Sequence[Stage], chunk: int, degree: int) -> RankSet:
    """Ranks holding finest chunk ``chunk`` (of ``degree``) of a TP-sharded weight: one per pipeline."""
    return tuple(sorted(s.ranks[chunk // (degree // s.tp)] for s in holders))


def replicated_holders(holders: Sequence[Stage]) -> RankSet:
    """Ranks holding a weight TP replicates (norms, embedding, head): every TP rank."""
    return tuple(sorted(r for s in holders for r in s.ranks))


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one parameter: TP slice ``tp_rank`` of ``tp_size`` (canonical
    interval ``[lo, hi)``; ``tp_size`` is 1 for a replicated weight)."""

    spec: ParamSpec
    tp_rank: int
    tp_size: int

    @property
    def interval(self) -> Interval:
        return self.spec.tp_interval(self.tp_rank, self.tp_size)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.local_shape(self.tp_size)

    @property
    def dim(self) -> int | None:
        return self.spec.split_dim


def local_shards(plan: Plan, table: ParamTable, rank: int) -> dict[str, Shard]:
    """Name -> :class:`Shard` for every parameter ``rank`` holds under ``plan`` (empty if
    suspended), in table order."""
    loc = plan.locate(rank)
    if loc is None:
        return {}
    st = plan.pipelines[loc[0]].stages[loc[1]]
    k = st.ranks.index(rank)
    owners = set(stage_owners(plan, *loc))
    return {s.name: Shard(s, k if s.split_dim is not None else 0,
                          st.tp if s.split_dim is not None else 1)
            for s in table if s.owner in owners}


# ----------------------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class Piece:
    """One piece of a bucket, as seen by one member: the local view is
    ``local.narrow(dim, start, length).movedim(dim, 0)`` flattened (dim None: the whole tensor
    flattened); it is the canonical interval ``[glo, glo + numel)`` of the global parameter."""

    name: str
    dim: int | None
    start: int
    length: int
    contribute: bool        # False: add zeros to the sum (a non-zero TP rank of a replicated weight)
    numel: int
    glo: int = 0


def piece_parts(n: int, k: int) -> list[Interval]:
    """ZeRO split of one piece of ``n`` elements over ``k`` members: member ``j`` owns
    ``[j*c, min(n, (j+1)*c))`` with ``c = ceil(n / k)``."""
    c = -(-n // k)
    return [(min(n, j * c), min(n, (j + 1) * c)) for j in range(k)]


@dataclass
class Bucket:
    """Pieces with one holder set, laid out in one flat buffer **member-major**: member ``j``'s
    slot is ``[j*P, (j+1)*P)`` and holds its part of every piece in order (each piece split
    :func:`piece_parts`, padded to ``ceil(n/k)``), ``P`` = :attr:`padded_part`. So a member's
    ZeRO-1/2 range is contiguous (one master, one reduce-scatter slice) while each piece is
    partitioned on its own: a layer whose holders do not change keeps its partition when other
    layers join or leave the bucket, and a plan switch moves none of its optimizer state."""

    ranks: RankSet
    pieces: list[Piece] = field(default_factory=list)
    numel: int = 0                  # real elements (padding not counted)

    def partition(self, rank: int) -> Interval:
        """ZeRO-1/2 range ``[lo, hi)`` of the flat buffer owned by ``rank``."""
        per = self.padded_part
        k = self.ranks.index(rank)
        return k * per, (k + 1) * per

    @property
    def padded_part(self) -> int:
        k = len(self.ranks)
        return sum(-(-pc.numel // k) for pc in self.pieces)

    @property
    def flat_size(self) -> int:
        """Length of the flat buffer, padding included."""
        return self.padded_part * len(self.ranks)

    def entries(self) -> list[tuple[Piece, int, int, int]]:
        """``(piece, a, b, flat_offset)``: piece-local elements ``[a, b)`` sit at ``flat_offset``,
        in flat order; padding is what no entry covers. Computed once (a bucket is complete
        when ``build_buckets`` returns it; gradient sync walks this every step)."""
        key = (len(self.pieces), self.numel)
        cached = self.__dict__.get("_entries")
        if cached is not None and cached[0] == key:
            return cached[1]
        k, out = len(self.ranks), []
        per = self.padded_part
        parts = [piece_parts(pc.numel, k) for pc in self.pieces]
        for j in range(k):
            o = j * per
            for pc, pp in zip(self.pieces, parts):
                a, b = pp[j]
                if a < b:
                    out.append((pc, a, b, o))
                o += -(-pc.numel // k)
        self.__dict__["_entries"] = (key, out)
        return out

    def padding(self, lo: int = 0, hi: int | None = None) -> list[Interval]:
        """Flat positions in ``[lo, hi)`` that hold no element (to be kept at zero)."""
        hi = self.flat_size if hi is None else hi
        out, cur = [], lo
        for _, a, b, f in self.entries():
            if f + b - a <= cur:
                continue
            if f >= hi:
                break
            if f > cur:
                out.append((cur, min(f, hi)))
            cur = f + b - a
        if cur < hi:
            out.append((cur, hi))
        return out

    def segments(self, lo: int, hi: int) -> Iterator[tuple[Piece, int, int, int]]:
        """``(piece, a, b, flat_pos)``: the canonical interval ``[a, b)`` of each piece part
        overlapping flat range ``[lo, hi)``, and where it starts in the flat buffer."""
        for pc, a, b, f in self.entries():
            x, y = max(f, lo), min(f + b - a, hi)
            if x < y:
                yield pc, pc.glo + a + x - f, pc.glo + a + y - f, x


def _order(owner: int, L: int) -> int:
    return -1 if owner == EMBED else (L if owner == HEAD else owner)


def build_buckets(plan: Plan, table: ParamTable, rank: int) -> list[Bucket]:
    """Buckets of ``rank`` under ``plan``, sorted by rank set (the all-reduce order). Pure."""
    loc = plan.locate(rank)
    if loc is None:
        return []
    me = plan.pipelines[loc[0]].stages[loc[1]]
    tp_rank, g = me.ranks.index(rank), me.tp
    L = plan.num_layers
    keyed: dict[RankSet, list[tuple[tuple, Piece]]] = {}
    for owner in stage_owners(plan, *loc):
        holders = owner_holders(plan, owner)
        G = None
        for spec in table.owned(owner):
            d = spec.split_dim
            if d is None:
                rs = replicated_holders(holders)
                keyed.setdefault(rs, []).append(((_order(owner, L), spec.name, 0), Piece(
                    spec.name, None, 0, spec.numel, tp_rank == 0, spec.numel, 0)))
                continue
            if G is None:
                G = finest_tp(holders)       # the layer's finest TP degree
            per_rank = G // g                           # finest chunks inside my shard
            w = spec.shape[d] // G
            n = spec.numel // G
            for c_local in range(per_rank):
                c = tp_rank * per_rank + c_local
                rs = chunk_holders(holders, c, G)
                keyed.setdefault(rs, []).append(((_order(owner, L), spec.name, c), Piece(
                    spec.name, d, c_local * w, w, True, n, c * n)))
    out = []
    for rs in sorted(keyed, key=lambda s: (len(s), s)):
        b = Bucket(rs)
        for _, pc in sorted(keyed[rs], key=lambda kv: kv[0]):
            b.pieces.append(pc)
            b.numel += pc.numel
        out.append(b)
    return out


def sync_rank_sets(plan: Plan, table: ParamTable | None = None) -> set[RankSet]:
    """Every rank set a gradient all-reduce of ``plan`` uses (size >= 2 only). Without a table,
    assumes every layer has both replicated and TP-split weights (true of decoder layers)."""
    out: set[RankSet] = set()
    for owner in (EMBED, *range(plan.num_layers), HEAD):
        h = owner_holders(plan, owner)
        specs = table.owned(owner) if table is not None else None
        if specs is None or any(s.split_dim is None for s in specs):
            out.add(replicated_holders(h))
        if (specs is None and owner >= 0) or (specs and any(s.split_dim is not None for s in specs)):
            G = finest_tp(h)
            out.update(chunk_holders(h, c, G) for c in range(G))
    return {s for s in out if len(s) > 1}


# ----------------------------------------------------------------------------------- holdings

#: Kinds of state a rank holds, and bytes per element. ``param`` is the live parameter (its dtype:
#: 4 bytes in fp32, 2 under bf16/fp16); ``master`` exists only under mixed precision (in fp32 the
#: master IS the parameter); Adam moments are fp32.
STATE_KINDS = ("exp_avg", "exp_avg_sq")


def kinds(mixed: bool) -> tuple[str, ...]:
    return ("param", "master", *STATE_KINDS) if mixed else ("param", *STATE_KINDS)


@dataclass(frozen=True)
class Hold:
    """``rank`` holds elements ``[lo, hi)`` (canonical) of ``kind`` of ``name`` in buffer ``buf``
    (a parameter name for ``param``, a bucket index for optimizer kinds) at element ``off``."""

    kind: str
    name: str
    lo: int
    hi: int
    buf: str | int
    off: int


def holdings(plan: Plan, table: ParamTable, rank: int, zero_stage: int, mixed: bool,
             buckets: list[Bucket] | None = None) -> list[Hold]:
    """Everything ``rank`` holds under ``plan``: its parameter shards (``param``) and, per bucket,
    the optimizer range it owns (all of it under ZeRO-0, its partition under ZeRO-1/2) for each
    optimizer kind. Offsets are into the local shard's canonical flat order (``param``) or into
    the bucket's optimizer range (others) — exactly how ``ShardedOptimizer`` lays them out."""
    out = []
    for name, sh in local_shards(plan, table, rank).items():
        lo, hi = sh.interval
        out.append(Hold("param", name, lo, hi, name, 0))
    bks = build_buckets(plan, table, rank) if buckets is None else buckets
    opt_kinds = kinds(mixed)[1:]
    for i, b in enumerate(bks):
        lo, hi = b.partition(rank) if zero_stage >= 1 else (0, b.flat_size)
        for pc, a, e, f in b.segments(lo, hi):
            for kd in opt_kinds:
                out.append(Hold(kd, pc.name, a, e, i, f - lo))
    return out


def plan_holdings(plan: Plan, table: ParamTable, zero_stage: int, mixed: bool
                  ) -> dict[tuple[str, str], list[tuple[int, int, int]]]:
    """Every rank's :func:`holdings` at once, without buffer locations:
    ``(kind, name) -> [(lo, hi, rank), ...]``, with the same interval decomposition (one entry per
    parameter shard, one per bucket piece overlapping a rank's optimizer range). Buckets are built
    once per rank set, not once per member, so this scales to thousands of ranks."""
    out: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    L = plan.num_layers
    keyed: dict[RankSet, list[tuple[tuple, str, int, int]]] = {}
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            for owner in stage_owners(plan, i, j):
                for spec in table.owned(owner):
                    key = ("param", spec.name)
                    if spec.split_dim is None:
                        out.setdefault(key, []).extend((0, spec.numel, r) for r in st.ranks)
                    else:
                        w = spec.numel // st.tp
                        out.setdefault(key, []).extend(
                            (k * w, (k + 1) * w, r) for k, r in enumerate(st.ranks))
    for owner in (EMBED, *range(L), HEAD):
        specs = table.owned(owner)
        if not specs:
            continue
        holders = owner_holders(plan, owner)
        G = finest_tp(holders)
        for spec in specs:
            if spec.split_dim is None:
                keyed.setdefault(replicated_holders(holders), []).append(
                    ((_order(owner, L), spec.name, 0), spec.name, 0, spec.numel))
                continue
            n = spec.numel // G
            for c in range(G):
                keyed.setdefault(chunk_holders(holders, c, G), []).append(
                    ((_order(owner, L), spec.name, c), spec.name, c * n, n))
    opt_kinds = kinds(mixed)[1:]
    for rs, entries in keyed.items():
        entries.sort(key=lambda e: e[0])
        K = len(rs)
        for _, name, glo, n in entries:
            c = -(-n // K)          # piece_parts(n, K), inlined: this loop is the hot one
            parts = [(glo + j * c, glo + min(n, (j + 1) * c)) for j in range(K) if j * c < n]
            if zero_stage >= 1:     # member k owns part k
                items = [(a, b, r) for (a, b), r in zip(parts, rs)]
            else:                   # every member holds every part
                items = [(a, b, r) for r in rs for a, b in parts]
            for kd in opt_kinds:
                out.setdefault((kd, name), []).extend(items)
    return out


# ----------------------------------------------------------------------------------- intervals


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` minus ``b`` (both sorted, disjoint lists of intervals)."""
    out, j = [], 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` ∩ ``b`` (both sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def merge(xs: Iterable[Interval]) -> list[Interval]:
    """Sorted union of intervals."""
    out: list[list[int]] = []
    for lo, hi in sorted(xs):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]
