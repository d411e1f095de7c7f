"""Reference cost model (DESIGN.md §3): stage time, 1F1B pipeline time, memory, capacity bound, η.

Units: time is "one layer x one micro-batch on a healthy full TP group"; memory is MB.
Pure Python. An optional top-level ``head_layers`` (the output head's compute in layer units,
charged to each pipeline's last stage) is read by :func:`head_layers`.

Optional communication terms. With only the DESIGN.md §3 fields a problem is costed exactly by
the reference model. A problem may add a ``comm`` section (kept in ``Problem.extra``)::

    "comm": {"layer_ms": 12.0,          # ms of one layer x one micro-batch (fwd+bwd) on a
                                        #   healthy full TP group: converts ms to model units
             "activation_mb": 32.0,     # MB sent between adjacent stages per micro-batch, one
                                        #   direction (activations forward, gradients backward)
             "intra_node_gbps": 300.0,  # GB/s between GPUs of one node
             "inter_node_gbps": 25.0}   # GB/s between nodes

Then each stage boundary costs ``c = activation_mb / gbps / layer_ms`` model units per
micro-batch and direction (MB / (GB/s) = ms), charged to the sender: stage ``j`` pays ``c`` for
the activation it sends to ``j+1`` and ``c`` for the gradient it sends to ``j-1``. The stage
time becomes ``t_j = y_j l_j + c_(j,j+1) + c_(j-1,j)`` and the 1F1B formula is unchanged. The
boundary uses the intra-node bandwidth when both stages' first ranks share a node
(:func:`boundary_times`; ``_boundary_times`` is the one place that decides it).

Slow links (``Problem.link_rates``, node pair -> slowdown): a boundary between nodes ``a`` and
``b`` costs ``link_rate(a, b)`` times its healthy term. With ``comm.grad_mb`` (MB of one
decoder layer's gradients) the step also pays the data-parallel reduction after the pipelines
drain (:func:`reduce_time`): per layer, a ring all-reduce among the stages that hold it (one per
pipeline), ``2 (k-1)/k`` of its gradients per rank over the slowest link the ring crosses
(intra-node bandwidth within a node, the inter-node one over ``link_rate`` across nodes), the
layers one after another. Without ``grad_mb`` the reduction is left out, as before.

Slow GPU links (``Problem.gpu_link_rates``, rank pair of one node -> slowdown): a hop between
the two ranks costs ``rate`` times its healthy intra-node time, wherever it is: a boundary, a
reduction's ring, a TP group's ring (:func:`hop_gbps`).

TP collectives (:func:`tp_times`): a TP group of ``g`` ranks all-reduces one micro-batch's
activations (``activation_mb``) twice per layer forward and twice backward (twice more in the
recomputed forward with activation checkpointing), each member moving ``2 (g-1)/g`` of it over
the slowest hop of the group's ring (its ranks in order, back to the first). ``layer_ms`` is a
layer on a healthy full TP group, whose collectives stay inside one node: it holds their
healthy time. A stage pays what its group's ring costs beyond that, per layer and micro-batch:
nothing for a group on healthy links inside one node, the difference over a slow GPU link
(a TP group sits in one node: ``plan.validate_plan``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .plan import Plan, PlanError, Stage, charged_layers
from .problem import Memory, Problem, fmt_mb
from .schedule import in_flight


#: Compute of a recomputed layer relative to a plain one (``Problem.activation_checkpointing``):
#: forward 1 + backward 2 + the forward again before its backward = 4 instead of 3.
RECOMPUTE_FACTOR = 4.0 / 3.0


def layer_cost(problem: Problem) -> float:
    """One layer's compute per micro-batch in model units: :data:`RECOMPUTE_FACTOR` with
    activation checkpointing, else 1.0 (the unit itself)."""
    return RECOMPUTE_FACTOR if problem.activation_checkpointing else 1.0


def group_rate(problem: Problem, ranks: Sequence[int]) -> float:
    """``y = slowdown[tp/g] * max_{d in group} x_d``: a group runs at its slowest member's pace."""
    return problem.slowdown(len(ranks)) * max(problem.rate(r) for r in ranks)


def head_layers(problem: Problem) -> float:
    """The problem's optional ``head_layers`` (>= 0, default 0): the output head's compute per
    micro-batch in layer units, which each pipeline's LAST stage pays on top of its layers (on a
    real vocabulary the head costs ~0.5-2.5 decoder layers; ``models.base.head_layers``)."""
    v = problem.extra.get("head_layers", 0.0) if problem.extra else 0.0
    if v is None:
        return 0.0
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
        raise PlanError(f"problem.head_layers={v!r} must be a number >= 0 (the output head's "
                        f"compute in layer units; 0 = not modelled)")
    return float(v)


def stage_time(problem: Problem, stage: Stage, last: bool = False) -> float:
    """Compute time of ``stage`` (no communication): ``y * (c*l + head)``, the head on the last
    stage of a pipeline only; ``c`` = :func:`layer_cost` (4/3 when layers are recomputed)."""
    head = head_layers(problem) if last else 0.0
    return group_rate(problem, stage.ranks) * charged_layers(stage, last, head,
                                                            layer_cost(problem))


@dataclass(frozen=True)
class CommSpec:
    """Optional point-to-point cost between pipeline stages (see module docstring)."""

    layer_ms: float
    activation_mb: float
    intra_node_gbps: float
    inter_node_gbps: float
    grad_mb: float = 0.0          # one decoder layer's gradients (0: no reduction term)

    def boundary(self, same_node: bool, link_rate: float = 1.0) -> float:
        """Model units one stage spends sending one micro-batch across one boundary (across
        nodes: over a link ``link_rate`` times slower than healthy)."""
        bw = self.intra_node_gbps if same_node else self.inter_node_gbps / link_rate
        return self.activation_mb / bw / self.layer_ms


def comm_spec(problem: Problem) -> CommSpec | None:
    """The problem's ``comm`` section as a :class:`CommSpec`, or None if absent."""
    c = problem.extra.get("comm") if problem.extra else None
    if not c:
        return None
    if not isinstance(c, dict):
        raise PlanError(f"problem.comm: expected an object, got {type(c).__name__}")
    vals = {}
    for k in ("layer_ms", "activation_mb", "intra_node_gbps", "inter_node_gbps"):
        v = c.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise PlanError(f"comm.{k}={v!r} must be a number > 0 "
                            f"(fields: layer_ms, activation_mb, intra_node_gbps, inter_node_gbps)")
        vals[k] = float(v)
    g = c.get("grad_mb", 0.0)
    if not isinstance(g, (int, float)) or isinstance(g, bool) or not 0 <= g < float("inf"):
        raise PlanError(f"comm.grad_mb={g!r} must be a finite number >= 0 (MB of one decoder "
                        f"layer's gradients; 0 leaves the data-parallel reduction out)")
    return CommSpec(**vals, grad_mb=float(g))


def hop_gbps(cs: CommSpec, problem: Problem, r: int, s: int) -> float:
    """GB/s between ranks ``r`` and ``s``: inside one node the intra-node bandwidth over their
    GPU link's rate (``Problem.gpu_link_rates``), across nodes the inter-node one over their
    node link's (``Problem.link_rates``). The one place that decides which link a hop crosses."""
    job = problem.job
    a, b = job.node_of(r), job.node_of(s)
    if a == b:
        return cs.intra_node_gbps / problem.gpu_link_rate(r, s)
    return cs.inter_node_gbps / problem.link_rate(a, b)


def ring_gbps(cs: CommSpec, problem: Problem, ranks: Sequence[int]) -> float:
    """GB/s of a ring over ``ranks`` (in order, back to the first): its slowest hop's."""
    return min(hop_gbps(cs, problem, x, y) for x, y in zip(ranks, list(ranks[1:]) + [ranks[0]]))


def boundary_times(problem: Problem, stages: Sequence[Stage]) -> tuple[float, ...]:
    """Per boundary ``j -> j+1`` of a pipeline (``len(stages) - 1`` of them), the model units
    one micro-batch's message takes across it in one direction (:meth:`CommSpec.boundary`); all
    0.0 without a ``comm`` section."""
    cs = comm_spec(problem)
    if cs is None:
        return (0.0,) * (len(stages) - 1)
    return tuple(_boundary_times(cs, problem, stages))


def _boundary_times(cs: CommSpec, problem: Problem, stages: Sequence[Stage]) -> list[float]:
    """:func:`boundary_times` under ``cs``: a boundary is the hop between the two stages'
    first ranks (:func:`hop_gbps`)."""
    return [cs.activation_mb / hop_gbps(cs, problem, stages[j].ranks[0],
                                        stages[j + 1].ranks[0]) / cs.layer_ms
            for j in range(len(stages) - 1)]


def reduce_time(problem: Problem, plan: Plan) -> float:
    """Model units of the step's data-parallel gradient reduction (module doc); 0.0 without
    ``comm.grad_mb``."""
    cs = comm_spec(problem)
    if cs is None or not cs.grad_mb:
        return 0.0
    total = 0.0
    for layer in range(problem.num_layers):
        holders = [st for p in plan.pipelines for st in p.stages
                   if st.layers[0] <= layer < st.layers[1]]
        k = len(holders)
        if k < 2:
            continue
        bw = ring_gbps(cs, problem, [st.ranks[0] for st in holders])
        per_rank = cs.grad_mb / min(len(st.ranks) for st in holders)   # a TP rank's share
        total += 2.0 * (k - 1) / k * per_rank / bw / cs.layer_ms
    return total


def tp_times(problem: Problem, stage: Stage) -> tuple[float, float]:
    """(forward, backward) model units one micro-batch's TP collectives cost ``stage`` beyond
    a healthy group inside one node (module doc); (0, 0) without a ``comm`` section, for a
    single rank or a group whose ring stays inside one node on healthy links."""
    cs = comm_spec(problem)
    return (0.0, 0.0) if cs is None else _tp_times(cs, problem, stage)


def _tp_times(cs: CommSpec, problem: Problem, stage: Stage) -> tuple[float, float]:
    """:func:`tp_times` under ``cs``."""
    g = len(stage.ranks)
    if g < 2:
        return 0.0, 0.0
    bw = ring_gbps(cs, problem, stage.ranks)
    extra = 2.0 * (g - 1) / g * cs.activation_mb * (1.0 / bw - 1.0 / cs.intra_node_gbps)
    if extra <= 0:
        return 0.0, 0.0
    one = extra / cs.layer_ms * (stage.layers[1] - stage.layers[0])   # one collective a layer
    return 2.0 * one, (4.0 if problem.activation_checkpointing else 2.0) * one


def pipeline_stage_times(problem: Problem, stages: Sequence[Stage]) -> tuple[float, ...]:
    """Per-stage time of one micro-batch, with communication when the problem gives it: each
    boundary's :func:`boundary_times` term is charged to both of its stages (the sender pays),
    and each stage its TP collectives' (:func:`tp_times`)."""
    ts = [stage_time(problem, s, last=j == len(stages) - 1) for j, s in enumerate(stages)]
    cs = comm_spec(problem)
    if cs is not None:        # (without one every term is 0: the planner's hot path skips them)
        for j, c in enumerate(_boundary_times(cs, problem, stages)):
            ts[j] += c        # activation j -> j+1
            ts[j + 1] += c    # gradient j+1 -> j
        for j, s in enumerate(stages):
            ts[j] += sum(_tp_times(cs, problem, s))
    return tuple(ts)


def pipeline_time_from_stage_times(stage_times: Sequence[float], micro_batches: int) -> float:
    """1F1B: ``T = sum_j t_j + (m - 1) * max_j t_j``.

    Against the event simulator (``schedule.run_streams`` on the engine's 1F1B streams, forward
    ``t/3``, backward ``2t/3``, each send's comm term on its sender; tests/unit/test_cost.py):
    exact when ``m = 1``, one stage, or the last stage is one of the slowest (uniform stages
    included); otherwise an upper bound, as the last stage then waits less than it assumes.
    The planner keeps this closed form: the simulator costs orders of magnitude more per plan."""
    return sum(stage_times) + (micro_batches - 1) * max(stage_times)


@dataclass(frozen=True)
class PlanCost:
    step_time: float
    pipeline_times: tuple[float, ...]
    stage_times: tuple[tuple[float, ...], ...]
    reduce_time: float = 0.0        # the data-parallel reduction after the pipelines


def evaluate(problem: Problem, plan: Plan) -> PlanCost:
    stage_times = tuple(pipeline_stage_times(problem, p.stages) for p in plan.pipelines)
    pts = tuple(pipeline_time_from_stage_times(ts, p.micro_batches)
                for ts, p in zip(stage_times, plan.pipelines))
    red = reduce_time(problem, plan)
    return PlanCost(step_time=max(pts) + red, pipeline_times=pts, stage_times=stage_times,
                    reduce_time=red)


def step_time(problem: Problem, plan: Plan) -> float:
    return evaluate(problem, plan).step_time


def stage_memory_terms(memory: Memory, tp: int, group_size: int, stage_index: int,
                       num_stages: int, micro_batches: int,
                       recompute: bool = False) -> tuple[float, float]:
    """The memory model of one stage (DESIGN.md §3) as ``l * per_layer + fixed`` MB for ``l``
    layers: ``(l*(static + act*min(S-j, m)) + emb*[j=0] + emb*[j=S-1]) * tp/g + extra``.

    ``recompute`` (activation checkpointing): a layer keeps only its input per micro-batch in
    flight, ``input = layer_input_mb``, which every rank of a TP group holds whole (it is not
    sharded, so not scaled by ``tp/g``), and the layer whose backward runs holds its recomputed
    activations, one layer of one micro-batch at a time:
    ``l*(static*tp/g + input*min(S-j, m)) + (emb*[j=0] + emb*[j=S-1] + act) * tp/g + extra``.
    The one place the formula lives: :func:`stage_memory_mb` evaluates it, the planner's
    ``partition.layer_cap`` inverts it."""
    mult = tp / group_size
    inflight = in_flight(stage_index, num_stages, micro_batches)
    ends = (stage_index == 0) + (stage_index == num_stages - 1)
    if recompute:
        per_layer = memory.layer_static_mb * mult + memory.layer_input_mb * inflight
        return per_layer, ((memory.embedding_mb * ends + memory.layer_activation_mb) * mult
                           + memory.extra_mb)
    per_layer = (memory.layer_static_mb + memory.layer_activation_mb * inflight) * mult
    return per_layer, memory.embedding_mb * ends * mult + memory.extra_mb


def stage_memory_mb(problem: Problem, num_layers: int, stage_index: int, num_stages: int,
                    micro_batches: int, group_size: int) -> float:
    """MB a stage of ``num_layers`` layers needs (:func:`stage_memory_terms`); 0 without a
    memory model."""
    if problem.memory is None:
        return 0.0
    per_layer, fixed = stage_memory_terms(problem.memory, problem.tp, group_size, stage_index,
                                          num_stages, micro_batches,
                                          problem.activation_checkpointing)
    return num_layers * per_layer + fixed


def check_memory(problem: Problem, plan: Plan) -> None:
    """Raise ``PlanError`` naming the pipeline and stage whose memory exceeds the budget."""
    if problem.memory is None:
        return
    budget = problem.memory.budget_mb
    for i, p in enumerate(plan.pipelines):
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            need = stage_memory_mb(problem, s.num_layers, j, S, p.micro_batches, len(s.ranks))
            if need > budget + 1e-9:
                raise PlanError(
                    f"pipelines[{i}].stages[{j}] (ranks {list(s.ranks)}, layers "
                    f"[{s.start}, {s.end}]) needs {fmt_mb(need)} MB > budget "
                    f"{fmt_mb(budget)} MB (device_mb - reserved_mb)")


def _holding(plan: Plan) -> dict[int, tuple[int, int, int, bool, bool]]:
    """rank -> (first layer, end layer, group size, holds the embedding, holds the head)."""
    out = {}
    for p in plan.pipelines:
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            for r in s.ranks:
                out[r] = (s.start, s.end, len(s.ranks), j == 0, j == S - 1)
    return out


def switch_peak_mb(problem: Problem, old: Plan, new: Plan) -> dict[int, float]:
    """MB each rank holds at the peak of a live switch ``old`` -> ``new`` (engine/switch.py):
    its state under ``old`` (gradient buffers already freed, no activations: a step boundary),
    plus the state it receives for ``new`` (what it does not hold already; a TP shard keeps
    ``min(1/g_new, 1/g_old)`` of a layer it held, as shards of power-of-two groups nest), plus
    the migration's staging buffers and ``extra_mb``. Empty without a memory model."""
    m = problem.memory
    if m is None:
        return {}
    state = m.layer_static_mb - m.layer_grad_mb          # per layer at the nominal TP degree
    emb_state = m.embedding_mb * (1 - m.layer_grad_mb / m.layer_static_mb) \
        if m.layer_static_mb > 0 else m.embedding_mb
    was, now = _holding(old), _holding(new)
    out = {}
    for r, (a, b, g, first, last) in now.items():
        held = 0.0
        kept = 0.0
        h = was.get(r)
        if h is not None:
            a0, b0, g0, f0, l0 = h
            held = ((b0 - a0) * state + (f0 + l0) * emb_state) * problem.tp / g0
            share = min(1.0 / g, 1.0 / g0) * problem.tp
            kept = (max(0, min(b, b0) - max(a, a0)) * state
                    + ((first and f0) + (last and l0)) * emb_state) * share
        need = ((b - a) * state + (first + last) * emb_state) * problem.tp / g
        out[r] = held + max(0.0, need - kept) + m.switch_buffer_mb + m.extra_mb
    return out


def check_switch_memory(problem: Problem, old: Plan, new: Plan) -> None:
    """Raise ``PlanError`` naming the rank whose memory at the peak of the switch ``old`` ->
    ``new`` exceeds the budget (:func:`switch_peak_mb`): a plan the job cannot migrate to."""
    if problem.memory is None:
        return
    budget = problem.memory.budget_mb
    for r, need in sorted(switch_peak_mb(problem, old, new).items()):
        if need > budget + 1e-9:
            raise PlanError(f"switching {old.id} -> {new.id} needs {fmt_mb(need)} MB on rank {r} at "
                            f"its peak (old state + state moved in + buffers) > budget "
                            f"{fmt_mb(budget)} MB (device_mb - reserved_mb)")


def validate_for_problem(problem: Problem, plan: Plan) -> None:
    """Full validity of ``plan`` for ``problem``: structure, world size, batch, memory."""
    from .plan import validate_plan

    validate_plan(plan, problem.job, num_layers=problem.num_layers,
                  global_batch_size=problem.global_batch_size)
    if plan.micro_batch_size != problem.micro_batch_size:
        raise PlanError(f"plan.micro_batch_size={plan.micro_batch_size} does not match "
                        f"training.micro_batch_size={problem.micro_batch_size}")
    check_memory(problem, plan)


def capacity_fraction(problem: Problem) -> float:
    """``f = sum_d (1/x_d) / N``: the share of the cluster's healthy capacity still there."""
    return capacity_of_rates({r: problem.rate(r) for r in range(problem.num_gpus)},
                             problem.num_gpus)


def capacity_of_rates(rates: Mapping[int, float], num_gpus: int) -> float:
    """``f = sum_d (1/x_d) / N`` for ``rates`` (rank -> rate; a missing rank is healthy): the
    throughput a perfect re-layout could keep, as a fraction of the healthy one."""
    return sum(1.0 / float(rates.get(r, 1.0)) for r in range(num_gpus)) / num_gpus


def healthy_step_time(problem: Problem) -> float:
    """Step time of the static plan with every rate 1.0, every link's too."""
    return step_time(problem.with_rates({}).with_link_rates({}, {}), problem.static_plan())


def eta(healthy_s: float, step_s: float, capacity: float) -> float:
    """Straggler efficiency ``η = (T_healthy / T_plan) / f`` (1.0 = perfect): the step time the
    static plan has without stragglers over a plan's step time, relative to the capacity bound
    ``f`` (:func:`capacity_fraction`). The one definition; callers that score many step times
    of one problem pass ``T_healthy`` and ``f`` computed once."""
    return healthy_s / step_s / capacity


def efficiency(problem: Problem, plan: Plan) -> float:
    """:func:`eta` of ``plan`` under ``problem``."""
    return eta(healthy_step_time(problem), step_time(problem, plan), capacity_fraction(problem))
