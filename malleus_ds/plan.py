"""The contract: plans (DESIGN.md §3), as frozen dataclasses with JSON I/O. The planning
problem a plan answers is ``problem.py``.

Pure Python: no torch, no torch.distributed, no deepspeed, no omegaconf.

A ``Plan`` says, for one training step, which ranks form each stage (a TP group), which
contiguous layer range each stage holds, how many micro-batches each pipeline runs, and which
ranks are suspended. ``validate_plan`` checks everything DESIGN.md §3 calls "valid" and raises
``PlanError`` naming the pipeline, stage, field and numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .job_layout import JobLayout

VERSION = 1


#: Bounds on what a plan or problem file may claim, checked while parsing: a damaged or hostile
#: file (a 10^12-layer plan) gets a PlanError instead of exhausting memory or time later.
MAX_RANKS = 2**20          # GPUs in a job
MAX_LAYERS = 100_000       # layers of a model
MAX_BATCH = 2**30          # samples or micro-batches in a global batch


class PlanError(ValueError):
    """A plan or problem (``problem.py``) is invalid. The message names the field and the
    numbers."""


class JsonFile:
    """``dumps`` / ``save`` / ``loads`` / ``load`` around a class's ``to_json`` / ``from_json``
    (one JSON object per file; errors name ``_WHAT``): shared by Plan and ``problem.Problem``."""

    _WHAT = "?"

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps() + "\n")

    @classmethod
    def loads(cls, text: str):
        return cls.from_json(_parse_json(text, cls._WHAT))

    @classmethod
    def load(cls, path: str | Path):
        return cls.loads(_read_text(path, cls._WHAT))


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One TP group holding the contiguous layer range ``[start, end)``."""

    ranks: tuple[int, ...]
    layers: tuple[int, int]

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def end(self) -> int:
        return self.layers[1]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def tp(self) -> int:
        return len(self.ranks)

    def to_json(self) -> dict:
        return {"ranks": list(self.ranks), "layers": [self.start, self.end]}


@dataclass(frozen=True)
class Pipeline:
    """An ordered list of stages covering all layers once, plus its micro-batch count."""

    micro_batches: int
    stages: tuple[Stage, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)

    def to_json(self) -> dict:
        return {"micro_batches": self.micro_batches, "stages": [s.to_json() for s in self.stages]}


@dataclass(frozen=True)
class Plan(JsonFile):
    _WHAT = "plan"

    num_layers: int
    global_batch_size: int
    micro_batch_size: int
    pipelines: tuple[Pipeline, ...]
    suspended: tuple[int, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def active_ranks(self) -> tuple[int, ...]:
        return tuple(r for p in self.pipelines for r in p.ranks)

    @property
    def all_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.active_ranks + self.suspended))

    def locate(self, rank: int) -> tuple[int, int] | None:
        """(pipeline index, stage index) holding ``rank``, or None if suspended/absent."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                if rank in s.ranks:
                    return i, j
        return None

    @property
    def id(self) -> str:
        """A short name for logs and events: the plan's ``name`` field if it has one, else
        ``plan-`` + 8 hex digits of a hash of its layout (equal layouts, equal ids)."""
        name = self.extra.get("name")
        if isinstance(name, str) and name:
            return name
        import hashlib

        core = {k: v for k, v in self.to_json().items() if k in (
            "num_layers", "global_batch_size", "micro_batch_size", "pipelines", "suspended")}
        return "plan-" + hashlib.sha1(json.dumps(core, sort_keys=True).encode()).hexdigest()[:8]

    def describe(self) -> str:
        """One line, e.g. ``2 pipelines: [TP2 0-4] x5 | [TP1 0-2, TP1 2-4] x3; suspended [5]``."""
        pipes = " | ".join(
            "[" + ", ".join(f"TP{s.tp} {s.start}-{s.end}" for s in p.stages) + f"] x{p.micro_batches}"
            for p in self.pipelines)
        tail = f"; suspended {list(self.suspended)}" if self.suspended else ""
        return f"{len(self.pipelines)} pipelines: {pipes}{tail}"

    def to_json(self) -> dict:
        out = dict(self.extra)
        out.update(
            {
                "version": VERSION,
                "num_layers": self.num_layers,
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "pipelines": [p.to_json() for p in self.pipelines],
                "suspended": list(self.suspended),
            }
        )
        return out

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanError(f"plan: expected a JSON object, got {type(d).__name__}")
        _check_version("plan", d)
        known = {"version", "num_layers", "global_batch_size", "micro_batch_size", "pipelines", "suspended"}
        for k in ("num_layers", "global_batch_size", "micro_batch_size", "pipelines"):
            if k not in d:
                raise PlanError(f"plan: missing field '{k}'")
        pipes = []
        if not isinstance(d["pipelines"], Sequence) or isinstance(d["pipelines"], (str, bytes)):
            raise PlanError("plan.pipelines: expected a list")
        for i, p in enumerate(d["pipelines"]):
            where = f"plan.pipelines[{i}]"
            if not isinstance(p, Mapping) or "stages" not in p or "micro_batches" not in p:
                raise PlanError(f"{where}: expected an object with 'micro_batches' and 'stages'")
            stages = []
            if not isinstance(p["stages"], Sequence) or isinstance(p["stages"], (str, bytes)):
                raise PlanError(f"{where}.stages: expected a list, got {p['stages']!r}")
            for j, s in enumerate(p["stages"]):
                sw = f"{where}.stages[{j}]"
                if not isinstance(s, Mapping) or "ranks" not in s or "layers" not in s:
                    raise PlanError(f"{sw}: expected an object with 'ranks' and 'layers'")
                if not isinstance(s["ranks"], Sequence) or isinstance(s["ranks"], (str, bytes)):
                    raise PlanError(f"{sw}.ranks: expected a list of ranks, got {s['ranks']!r}")
                layers = s["layers"]
                if not isinstance(layers, Sequence) or len(layers) != 2:
                    raise PlanError(f"{sw}.layers: expected [start, end], got {layers!r}")
                stages.append(
                    Stage(ranks=tuple(_int(r, f"{sw}.ranks", MAX_RANKS) for r in s["ranks"]),
                          layers=(_int(layers[0], f"{sw}.layers", MAX_LAYERS),
                                  _int(layers[1], f"{sw}.layers", MAX_LAYERS))))
            pipes.append(Pipeline(micro_batches=_int(p["micro_batches"], f"{where}.micro_batches",
                                                     MAX_BATCH),
                                  stages=tuple(stages)))
        return Plan(
            num_layers=_int(d["num_layers"], "plan.num_layers", MAX_LAYERS),
            global_batch_size=_int(d["global_batch_size"], "plan.global_batch_size", MAX_BATCH),
            micro_batch_size=_int(d["micro_batch_size"], "plan.micro_batch_size", MAX_BATCH),
            pipelines=tuple(pipes),
            suspended=tuple(_int(r, "plan.suspended", MAX_RANKS)
                            for r in _list(d.get("suspended", []), "plan.suspended")),
            extra={k: v for k, v in d.items() if k not in known},
        )



def same_stages(old: Plan, new: Plan) -> bool:
    """Do ``old`` and ``new`` have the same pipelines' stages (layers and ranks, pipelines in
    any order), differing at most in micro-batch counts? A switch between them moves no state
    and keeps every rank's buffers: a re-split."""
    def stages(p: Plan):
        return sorted(tuple((s.layers, s.ranks) for s in q.stages) for q in p.pipelines)
    return stages(old) == stages(new) and old.suspended == new.suspended


def charged_layers(stage: Stage, last: bool, head: float, layer_cost: float = 1.0) -> float:
    """Layers' worth of compute ``stage`` does per micro-batch: its layers (each ``layer_cost``:
    ``cost.RECOMPUTE_FACTOR`` when activation checkpointing recomputes them), plus the output
    head (``head`` layer units, ``cost.head_layers``; never recomputed) on a pipeline's last
    stage. The cost model and the per-rank cost units both ask; the one place this is decided."""
    return stage.num_layers * layer_cost + (head if last else 0.0)


def static_plan(num_layers: int, global_batch_size: int, micro_batch_size: int,
                tp: int, pp: int, dp: int) -> Plan:
    """The uniform Megatron/DeepSpeed layout: ``rank = tp_rank + tp*(dp_rank + dp*pp_rank)``.

    Layers are split as evenly as possible (earlier stages take the remainder); micro-batches
    are split as evenly as possible across the ``dp`` pipelines.
    """
    if pp > num_layers:
        raise PlanError(f"static plan: pp={pp} stages cannot hold num_layers={num_layers} layers")
    if global_batch_size % micro_batch_size:
        raise PlanError(f"static plan: global_batch_size={global_batch_size} is not a multiple of "
                        f"micro_batch_size={micro_batch_size}")
    total_mb = global_batch_size // micro_batch_size
    if total_mb < dp:
        raise PlanError(f"static plan: {total_mb} micro-batches cannot feed dp={dp} pipelines")
    bounds = even_split(num_layers, pp)
    mbs = even_split(total_mb, dp)
    pipes = []
    for d in range(dp):
        stages = []
        for p in range(pp):
            ranks = tuple(t + tp * (d + dp * p) for t in range(tp))
            stages.append(Stage(ranks=ranks, layers=(bounds[p], bounds[p + 1])))
        pipes.append(Pipeline(micro_batches=mbs[d + 1] - mbs[d], stages=tuple(stages)))
    return Plan(num_layers, global_batch_size, micro_batch_size, tuple(pipes), ())


def even_split(total: int, parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., total]`` of ``parts`` near-equal pieces (earlier ones larger)."""
    q, r = divmod(total, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def validate_plan(plan: Plan, job: JobLayout, *, num_layers: int | None = None,
                  global_batch_size: int | None = None) -> None:
    """Raise ``PlanError`` unless ``plan`` is structurally valid for the job ``job`` (its world,
    node shape and nominal TP degree; DESIGN.md §3).

    Memory is checked separately by :func:`malleus_ds.cost.check_memory` (it needs a problem).
    """
    if num_layers is not None and plan.num_layers != num_layers:
        raise PlanError(f"plan.num_layers={plan.num_layers} does not match the model's "
                        f"num_layers={num_layers}")
    if global_batch_size is not None and plan.global_batch_size != global_batch_size:
        raise PlanError(f"plan.global_batch_size={plan.global_batch_size} does not match "
                        f"global_batch_size={global_batch_size}")
    if plan.num_layers < 1:
        raise PlanError(f"plan.num_layers={plan.num_layers} must be >= 1")
    if plan.micro_batch_size < 1:
        raise PlanError(f"plan.micro_batch_size={plan.micro_batch_size} must be >= 1")
    if not plan.pipelines:
        raise PlanError("plan.pipelines is empty: at least one pipeline is needed")
    seen: dict[int, str] = {}
    for i, p in enumerate(plan.pipelines):
        _check_pipeline(p, f"pipelines[{i}]", plan.num_layers, job, seen)
    for r in plan.suspended:
        _claim(seen, job, r, "suspended")
    total_mb = sum(p.micro_batches for p in plan.pipelines)
    if total_mb * plan.micro_batch_size != plan.global_batch_size:
        raise PlanError(
            f"plan: sum of micro_batches ({total_mb}) x micro_batch_size ({plan.micro_batch_size}) "
            f"= {total_mb * plan.micro_batch_size} != global_batch_size={plan.global_batch_size}")


def _claim(seen: dict[int, str], job: JobLayout, r: int, where: str) -> None:
    """Rank ``r`` is in the world and in no other place of the plan (``seen``: rank -> where)."""
    if not 0 <= r < job.world:
        raise PlanError(f"{where}: rank {r} is outside the world of {job.world} ranks "
                        f"(valid: 0..{job.world - 1})")
    if r in seen:
        raise PlanError(f"{where}: rank {r} already appears in {seen[r]}")
    seen[r] = where


def _check_pipeline(p: Pipeline, where: str, num_layers: int, job: JobLayout,
                    seen: dict[int, str]) -> None:
    """A pipeline: micro-batches, and stages that cover ``[0, num_layers)`` in order, each a TP
    group of unclaimed ranks that divides the job's TP degree within one node."""
    if p.micro_batches < 1:
        raise PlanError(f"{where}.micro_batches={p.micro_batches} must be >= 1")
    if not p.stages:
        raise PlanError(f"{where}.stages is empty")
    expect = 0
    for j, s in enumerate(p.stages):
        sw = f"{where}.stages[{j}]"
        if s.start != expect:
            raise PlanError(f"{sw}.layers=[{s.start}, {s.end}] does not start where the "
                            f"previous stage ended ({expect}); stages must cover "
                            f"[0, {num_layers}) contiguously in order")
        if s.end <= s.start:
            raise PlanError(f"{sw}.layers=[{s.start}, {s.end}] is empty or reversed")
        expect = s.end
        if not s.ranks:
            raise PlanError(f"{sw}.ranks is empty")
        if job.tp % len(s.ranks):
            raise PlanError(f"{sw}: TP group size {len(s.ranks)} does not divide tp={job.tp}")
        for r in s.ranks:
            _claim(seen, job, r, sw)
        nodes = job.nodes_of(s.ranks)
        if len(nodes) > 1:
            raise PlanError(f"{sw}.ranks={list(s.ranks)} span nodes {nodes} "
                            f"(gpus_per_node={job.gpus_per_node}); a TP group must sit in "
                            f"one node")
    if expect != num_layers:
        raise PlanError(f"{where}: stages cover [0, {expect}) but num_layers={num_layers}")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{what}: not valid JSON ({e})") from None


def _read_text(path: str | Path, what: str) -> str:
    from .files.safe_load import UnsafeFile, read_text

    p = Path(path)
    if not p.is_file():
        raise PlanError(f"{what}: file not found: {p}")
    try:
        return read_text(p, f"{what} file")
    except UnsafeFile as e:
        raise PlanError(str(e)) from None


def _check_version(what: str, d: Mapping[str, Any]) -> None:
    v = d.get("version")
    if v != VERSION:
        raise PlanError(f"{what}.version={v!r} is not supported (expected {VERSION})")


def _int(v: Any, where: str, limit: int | None = None) -> int:
    """An integer field; with ``limit``, one of magnitude below it (:data:`MAX_LAYERS` ...)."""
    if isinstance(v, bool):
        raise PlanError(f"{where}: expected an integer, got {v!r}")
    if isinstance(v, int):
        out = v
    elif isinstance(v, str) and len(v) < 30 and v.strip().lstrip("-").isdigit():
        out = int(v)
    elif isinstance(v, float) and v.is_integer():
        out = int(v)
    else:
        raise PlanError(f"{where}: expected an integer, got {v!r}"[:300])
    if limit is not None and abs(out) >= limit:
        raise PlanError(f"{where}={out} is out of range (at most {limit - 1}): not a plausible "
                        f"job; the file is damaged or not what it claims")
    return out


def _list(v: Any, where: str) -> Sequence[Any]:
    if v is None:
        return []
    if not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        raise PlanError(f"{where}: expected a list, got {v!r}")
    return v
