"""The planning problem (DESIGN.md §3): the cluster, the model's layer count, the training
shape, the TP slowdown table, the memory model and the measured straggling rates, as frozen
dataclasses with JSON I/O (version 1, like ``plan.py``). The planner (``planner/``) turns a
:class:`Problem` into a :class:`~malleus_ds.plan.Plan`; ``cost.py`` prices a plan under it.

Pure Python: no torch, no torch.distributed, no deepspeed, no omegaconf.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from .job_layout import JobLayout
from .plan import (MAX_BATCH, MAX_LAYERS, MAX_RANKS, VERSION, JsonFile, Plan, PlanError,
                   _check_version, _int, static_plan)


#: memory keys a problem file may leave out (0 when absent; ``layer_input_mb`` is required with
#: ``training.activation_checkpointing``)
_MEMORY_OPTIONAL = ("layer_grad_mb", "switch_buffer_mb", "layer_input_mb")


def ideal_slowdown(tp: int) -> dict[int, float]:
    """A TP-size slowdown table with perfect scaling: ``{tp/g: tp/g}`` for every divisor."""
    return {k: float(k) for k in range(1, tp + 1) if tp % k == 0}


def given_slowdown(tp_slowdown, tp: int) -> dict[int, float] | None:
    """The user's ``malleus.tp_slowdown`` map for ``tp`` (entries it lacks: ideal), or None
    when it is not a map (``"measure"`` / ``"ideal"``: the caller's own table)."""
    if not isinstance(tp_slowdown, Mapping):
        return None
    return {k: float(tp_slowdown.get(k, v)) for k, v in ideal_slowdown(tp).items()}



def fmt_mb(x: float) -> str:
    """Megabytes for a message: whole MB from 100 up (``35904``), else 3 significant digits
    (``1.15``, ``0.422``), so the numbers of a small model still tell the story."""
    return f"{x:.0f}" if abs(x) >= 100 or x == int(x) else f"{x:.3g}"

@dataclass(frozen=True)
class Memory:
    device_mb: float
    reserved_mb: float
    layer_static_mb: float
    layer_activation_mb: float
    embedding_mb: float
    extra_mb: float
    # Optional (plan switches, cost.switch_peak_mb): the part of ``layer_static_mb`` that is
    # gradient buffers (scratch between steps: freed before a switch allocates), and the
    # migration's staging buffers.
    layer_grad_mb: float = 0.0
    switch_buffer_mb: float = 0.0
    # With activation checkpointing (``Problem.activation_checkpointing``): what a layer keeps
    # per micro-batch in flight, its input alone (Megatron's full recompute: ``2·s·b·h`` bytes at
    # 16 bits), in place of ``layer_activation_mb``; see ``cost.stage_memory_terms``.
    layer_input_mb: float = 0.0

    @property
    def budget_mb(self) -> float:
        return self.device_mb - self.reserved_mb


@dataclass(frozen=True)
class Problem(JsonFile):
    _WHAT = "problem"

    name: str
    nodes: int
    gpus_per_node: int
    num_layers: int
    global_batch_size: int
    micro_batch_size: int
    tp: int
    pp: int
    dp: int
    tp_slowdown: Mapping[int, float]      # keyed by tp/g
    memory: Memory | None
    rates: Mapping[int, float]            # missing ranks are healthy (1.0)
    current_plan: Plan | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # ``training.activation_checkpointing``: every decoder layer is recomputed in backward, so a
    # layer keeps only its input (``Memory.layer_input_mb``) and costs ``cost.RECOMPUTE_FACTOR``
    activation_checkpointing: bool = False
    # measured slowdown of the link between two nodes (``(a, b)``, a < b; missing: healthy 1.0):
    # a message across it takes ``rate`` times its healthy time (``cost.py``'s comm terms)
    link_rates: Mapping[tuple[int, int], float] = field(default_factory=dict)
    # measured slowdown of the link between two GPUs of one node (``(r, s)``, r < s, ranks;
    # missing: healthy 1.0): a collective or message between them takes ``rate`` times its
    # healthy intra-node time (``cost.hop_gbps``)
    gpu_link_rates: Mapping[tuple[int, int], float] = field(default_factory=dict)

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @cached_property
    def job(self) -> JobLayout:
        """The job's shape (world, node shape, nominal TP degree) that plans are checked against."""
        return JobLayout(self.num_gpus, self.gpus_per_node, self.tp)

    def rate(self, rank: int) -> float:
        return float(self.rates.get(rank, 1.0))

    def rate_list(self) -> list[float]:
        return [self.rate(r) for r in range(self.num_gpus)]

    def link_rate(self, a: int, b: int) -> float:
        """The slowdown of the link between nodes ``a`` and ``b`` (1.0 within one node)."""
        if a == b:
            return 1.0
        return float(self.link_rates.get((min(a, b), max(a, b)), 1.0))

    def gpu_link_rate(self, r: int, s: int) -> float:
        """The slowdown of the link between GPUs (ranks) ``r`` and ``s`` of one node."""
        if r == s:
            return 1.0
        return float(self.gpu_link_rates.get((min(r, s), max(r, s)), 1.0))

    def with_link_rates(self, link_rates: Mapping, gpu_link_rates: Mapping | None = None
                        ) -> "Problem":
        """A copy with new ``link_rates`` (``{(a, b) or "a-b": rate}``; checked as in JSON) and,
        where given, new ``gpu_link_rates`` (the same form, two ranks of one node)."""
        from dataclasses import replace

        out = replace(self, link_rates=parse_link_rates(link_rates, self.nodes))
        if gpu_link_rates is not None:
            out = replace(out, gpu_link_rates=parse_gpu_link_rates(gpu_link_rates, self.job))
        return out

    def slowdown(self, group_size: int) -> float:
        """Slowdown of a TP group of ``group_size`` GPUs relative to a full group of ``tp``."""
        return float(self.tp_slowdown[self.tp // group_size])

    def static_plan(self) -> Plan:
        return static_plan(self.num_layers, self.global_batch_size, self.micro_batch_size,
                           self.tp, self.pp, self.dp)

    def with_rates(self, rates: Mapping[int, float], current_plan: Plan | None = None) -> "Problem":
        """A copy with new ``rates`` (rank -> rate; keys may be ints or digit strings, as in
        JSON) and ``current_plan``. Measured rates below 1.0 (a GPU a little faster than the
        healthy reference) are clamped to 1.0. Raises ``PlanError`` for a rank outside the
        cluster or a rate that is not a finite number > 0."""
        from dataclasses import replace

        norm: dict[int, float] = {}
        for k, v in rates.items():
            r = _int(k, "rates key")
            if not 0 <= r < self.num_gpus:
                raise PlanError(f"rates: rank {r} is outside 0..{self.num_gpus - 1}")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 < v < float("inf"):
                raise PlanError(f"rates['{k}']={v!r} must be a finite number > 0 (1.0 = healthy)")
            norm[r] = max(1.0, float(v))
        return replace(self, rates=norm, current_plan=current_plan)

    def to_json(self) -> dict:
        out = dict(self.extra)
        m = self.memory
        out.update({
            "version": VERSION,
            "name": self.name,
            "cluster": {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node},
            "model": {"num_layers": self.num_layers},
            "training": {"global_batch_size": self.global_batch_size,
                         "micro_batch_size": self.micro_batch_size,
                         "tp": self.tp, "pp": self.pp, "dp": self.dp,
                         **({"activation_checkpointing": True}
                            if self.activation_checkpointing else {})},
            "cost": {"tp_slowdown": {str(k): v for k, v in sorted(self.tp_slowdown.items())}},
            "rates": {str(k): v for k, v in sorted(self.rates.items())},
            "current_plan": self.current_plan.to_json() if self.current_plan else None,
        })
        if self.link_rates:
            out["link_rates"] = {f"{a}-{b}": v for (a, b), v in sorted(self.link_rates.items())}
        if self.gpu_link_rates:
            out["gpu_link_rates"] = {f"{a}-{b}": v
                                     for (a, b), v in sorted(self.gpu_link_rates.items())}
        if m is not None:
            out["memory"] = {"device_mb": m.device_mb, "reserved_mb": m.reserved_mb,
                             "layer_static_mb": m.layer_static_mb,
                             "layer_activation_mb": m.layer_activation_mb,
                             "embedding_mb": m.embedding_mb, "extra_mb": m.extra_mb}
            for k in _MEMORY_OPTIONAL:
                if getattr(m, k):
                    out["memory"][k] = getattr(m, k)
        return out

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Problem":
        """The problem of a JSON object, every field checked; a PlanError names the first bad
        one."""
        if not isinstance(d, Mapping):
            raise PlanError(f"problem: expected a JSON object, got {type(d).__name__}")
        _check_version("problem", d)
        known = {"version", "name", "cluster", "model", "training", "cost", "memory", "rates",
                 "current_plan", "link_rates", "gpu_link_rates"}
        co = d.get("cost") or {}
        sh = _read_shape(_section(d, "cluster"), _section(d, "model"), _section(d, "training"))
        ac = _section(d, "training").get("activation_checkpointing", False)
        if not isinstance(ac, bool):
            raise PlanError(f"training.activation_checkpointing={ac!r} must be true or false")
        if not isinstance(co, Mapping):
            raise PlanError(f"problem.cost: expected an object, got {co!r}")
        sd = _read_tp_slowdown(co, sh.tp)
        mem = _read_memory(_section(d, "memory"), ac) if d.get("memory") is not None else None
        rates = _read_rates(d.get("rates") or {}, sh.nodes * sh.gpn)
        cur = d.get("current_plan")
        current = Plan.from_json(cur) if cur else None
        return Problem(
            name=str(d.get("name", "problem")), nodes=sh.nodes, gpus_per_node=sh.gpn,
            num_layers=sh.layers, global_batch_size=sh.gbs, micro_batch_size=sh.mbs, tp=sh.tp,
            pp=sh.pp, dp=sh.dp, tp_slowdown=sd, memory=mem, rates=rates, current_plan=current,
            extra={k: v for k, v in d.items() if k not in known}, activation_checkpointing=ac,
            link_rates=parse_link_rates(d.get("link_rates") or {}, sh.nodes),
            gpu_link_rates=parse_gpu_link_rates(d.get("gpu_link_rates") or {},
                                                JobLayout(sh.nodes * sh.gpn, sh.gpn)),
        )


@dataclass(frozen=True)
class _Shape:
    """The cluster and training shape of a problem file, checked against each other."""

    nodes: int
    gpn: int
    layers: int
    gbs: int
    mbs: int
    tp: int
    pp: int
    dp: int


def _read_shape(cl: Mapping[str, Any], mo: Mapping[str, Any], tr: Mapping[str, Any]) -> _Shape:
    """``cluster``, ``model.num_layers`` and ``training``'s sizes: each in range, tp*pp*dp the
    cluster's GPUs, tp within a node, whole micro-batches, enough of them for dp pipelines and
    enough layers for pp stages."""
    nodes = _pos_int(cl, "cluster", "nodes", MAX_RANKS)
    gpn = _pos_int(cl, "cluster", "gpus_per_node", MAX_RANKS)
    if nodes * gpn >= MAX_RANKS:
        raise PlanError(f"cluster: {nodes} nodes x {gpn} GPUs per node = {nodes * gpn} "
                        f"GPUs is out of range (at most {MAX_RANKS - 1})")
    L = _pos_int(mo, "model", "num_layers", MAX_LAYERS)
    gbs = _pos_int(tr, "training", "global_batch_size", MAX_BATCH)
    mbs = _pos_int(tr, "training", "micro_batch_size", MAX_BATCH)
    tp = _pos_int(tr, "training", "tp", MAX_RANKS)
    pp = _pos_int(tr, "training", "pp", MAX_RANKS)
    dp = _pos_int(tr, "training", "dp", MAX_RANKS)
    if gpn % tp:
        raise PlanError(f"training.tp={tp} does not divide cluster.gpus_per_node={gpn}")
    if tp * pp * dp != nodes * gpn:
        raise PlanError(f"training: tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} != "
                        f"cluster GPUs {nodes}*{gpn} = {nodes * gpn}")
    if gbs % mbs:
        raise PlanError(f"training.global_batch_size={gbs} is not a multiple of "
                        f"micro_batch_size={mbs}")
    if gbs // mbs < dp:
        raise PlanError(f"training: {gbs // mbs} micro-batches cannot feed dp={dp} pipelines")
    if pp > L:
        raise PlanError(f"training.pp={pp} exceeds model.num_layers={L}")
    return _Shape(nodes, gpn, L, gbs, mbs, tp, pp, dp)


def _read_tp_slowdown(co: Mapping[str, Any], tp: int) -> dict[int, float]:
    """``cost.tp_slowdown`` (default: ideal): a number > 0 for every divisor of ``tp``, 1.0 at
    1."""
    raw_sd = co.get("tp_slowdown") or {str(k): v for k, v in ideal_slowdown(tp).items()}
    if not isinstance(raw_sd, Mapping):
        raise PlanError(f"cost.tp_slowdown: expected an object {{tp/g: slowdown}}, got {raw_sd!r}")
    sd: dict[int, float] = {}
    for k, v in raw_sd.items():
        kk = _int(k, "cost.tp_slowdown key")
        if kk < 1 or tp % kk:
            raise PlanError(f"cost.tp_slowdown: key {k} (tp/g) must divide tp={tp}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise PlanError(f"cost.tp_slowdown['{k}']={v!r} must be a number > 0")
        sd[kk] = float(v)
    for f in range(1, tp + 1):
        if tp % f == 0 and f not in sd:
            raise PlanError(f"cost.tp_slowdown: missing entry for tp/g={f} (tp={tp})")
    if sd.get(1, 1.0) != 1.0:
        raise PlanError(f"cost.tp_slowdown['1'] must be 1.0, got {sd[1]}")
    return sd


def _mb(k: str, v: Any) -> float:
    """``memory.<k>`` as a finite number of MB >= 0."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
        raise PlanError(f"memory.{k}={v!r} must be a finite number >= 0")
    return float(v)


def _read_memory(m: Mapping[str, Any], ac: bool) -> Memory:
    """The ``memory`` section: the required sizes, the optional ones (0 when absent), and the
    parts that cannot exceed their whole."""
    vals = {}
    for k in ("device_mb", "reserved_mb", "layer_static_mb", "layer_activation_mb",
              "embedding_mb", "extra_mb"):
        if k not in m:
            raise PlanError(f"memory.{k} is missing")
        vals[k] = _mb(k, m[k])
    for k in _MEMORY_OPTIONAL:
        vals[k] = _mb(k, m.get(k, 0.0))
    if vals["layer_grad_mb"] > vals["layer_static_mb"]:
        raise PlanError(f"memory.layer_grad_mb={vals['layer_grad_mb']:g} is part of "
                        f"memory.layer_static_mb={vals['layer_static_mb']:g} and cannot "
                        f"exceed it")
    if ac and "layer_input_mb" not in m:
        raise PlanError("memory.layer_input_mb is missing: with "
                        "training.activation_checkpointing=true a layer keeps only its "
                        "input per micro-batch in flight (Megatron: 2*s*b*h bytes at 16 "
                        "bits); give it in MB")
    if vals["layer_input_mb"] > vals["layer_activation_mb"]:
        raise PlanError(f"memory.layer_input_mb={vals['layer_input_mb']:g} is part of "
                        f"memory.layer_activation_mb={vals['layer_activation_mb']:g} "
                        f"and cannot exceed it")
    return Memory(**vals)


def _read_rates(raw_rates: Any, world: int) -> dict[int, float]:
    """``rates``: ``{rank: rate}``, each rank in the job and each rate finite and >= 1.0."""
    if not isinstance(raw_rates, Mapping):
        raise PlanError(f"problem.rates: expected an object {{rank: rate}}, got {raw_rates!r}")
    rates: dict[int, float] = {}
    for k, v in raw_rates.items():
        r = _int(k, "rates key")
        if not 0 <= r < world:
            raise PlanError(f"rates: rank {r} is outside 0..{world - 1}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 1.0 <= v < float("inf"):
            raise PlanError(f"rates['{k}']={v!r} must be a finite number >= 1.0 (1.0 = healthy)")
        rates[r] = float(v)
    return rates



def parse_link_rates(raw, nodes: int, field: str = "link_rates", what: str = "node"
                     ) -> dict[tuple[int, int], float]:
    """``{"a-b": rate}`` (or ``{(a, b): rate}``) -> ``{(min, max): rate}``; a PlanError names
    the entry for a ``what`` outside ``0..nodes-1``, a link from one to itself, or a rate that
    is not a finite number >= 1.0 (1.0 = healthy)."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"problem.{field}: expected an object {{\"a-b\": rate}}, got {raw!r}")
    out: dict[tuple[int, int], float] = {}
    for k, v in raw.items():
        if isinstance(k, tuple) and len(k) == 2:
            a, b = (_int(x, f"{field} key") for x in k)
        else:
            parts = str(k).split("-")
            if len(parts) != 2:
                raise PlanError(f"{field} key {k!r} must name two {what}s as \"a-b\"")
            a, b = (_int(x.strip(), f"{field} key {k!r}") for x in parts)
        for n in (a, b):
            if not 0 <= n < nodes:
                raise PlanError(f"{field}['{k}']: {what} {n} is outside 0..{nodes - 1}")
        if a == b:
            raise PlanError(f"{field}['{k}']: a link joins two {what}s; {what} {a} to itself "
                            f"is not one")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 1.0 <= v < float("inf"):
            raise PlanError(f"{field}['{k}']={v!r} must be a finite number >= 1.0 "
                            f"(1.0 = healthy)")
        out[(min(a, b), max(a, b))] = float(v)
    return out


def parse_gpu_link_rates(raw, job: JobLayout) -> dict[tuple[int, int], float]:
    """``{"r-s": rate}`` for two ranks of one node (as :func:`parse_link_rates`; a pair on two
    nodes is refused by name: that link is ``link_rates``')."""
    out = parse_link_rates(raw, job.world, "gpu_link_rates", "rank")
    for r, s in out:
        if not job.same_node(r, s):
            raise PlanError(f"gpu_link_rates['{r}-{s}']: ranks {r} and {s} are on nodes "
                            f"{job.node_of(r)} and {job.node_of(s)}; a link between nodes "
                            f"goes in link_rates")
    return out


def _section(d: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    s = d.get(name)
    if not isinstance(s, Mapping):
        raise PlanError(f"problem.{name}: missing or not an object")
    return s


def _pos_int(s: Mapping[str, Any], sec: str, key: str, limit: int | None = None) -> int:
    if key not in s:
        raise PlanError(f"{sec}.{key} is missing")
    v = _int(s[key], f"{sec}.{key}", limit)
    if v < 1:
        raise PlanError(f"{sec}.{key}={v} must be >= 1")
    return v
