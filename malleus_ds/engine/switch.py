"""``engine.switch_plan(new_plan)``: move a running engine to another plan in place (DESIGN.md §6).

Collective, at a step boundary, on the same engine object; no process restarts:

1. validate the new plan with the start-up checks, on every rank, before anything moves;
2. create the process groups it needs (cached by rank set) and agree on Adam's step;
3. build the next :class:`~malleus_ds.engine.runtime.PlanRuntime` (stage module on the meta
   device, TP, buckets, sharded optimizer, schedule): a parameter shard or optimizer bucket that
   is the same under both plans keeps its tensors, an optimizer range whose elements already
   sit in order in memory this rank has (a bucket that split or merged) becomes a view of it
   (``migrate/alias.py``), the rest gets fresh memory;
4. compute the transfer plan (``migrate/transfer.py``, the same on every rank), copy what this
   rank keeps locally, and run the bounded rounds of packed point-to-point messages
   (``migrate/transport.py``): parameters, fp32 masters (mixed precision) and Adam moments at
   ZeRO-partition granularity, never an all-gather of whole buckets;
5. derive what is not sent: fp32 masters from parameters (fp32), low-precision parameters from
   masters (bf16/fp16), Adam's step;
6. adopt the new runtime, carry the LR scheduler and the loss scaler, drop the old runtime.

A failure anywhere in 3-5 marks the engine broken (``train_batch`` refuses to run) and raises
:class:`~malleus_ds.migrate.transport.MigrationError` naming the step and the peers: the job never
trains on half-moved state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as tdist

from ..resilience.agreement import AgreementError, Failure, agree
from ..layout import local_shards
from ..migrate.apply import StateView, pack_parts, params_from_masters, unpack_parts
from ..migrate.rounds import messages, rounds
from ..migrate.transfer import Layout, Transfer, chunked, kept_slices, transfer_plan
from ..migrate.transport import MigrationError, run_rounds
from ..plan import PlanError
from .groups import GROUPS, plan_rank_sets
from .runtime import PlanRuntime, build_stage, locate


@dataclass(frozen=True)
class MigrationReport:
    """What a switch did, the same on every rank. ``bytes``: sent over the network, all ranks
    summed; ``seconds``: wall time, max over ranks; ``peak_extra_bytes``: buffer memory the switch
    allocated (the next runtime's state + staging), max over ranks."""

    step: int
    from_plan: str
    to_plan: str
    bytes: int
    seconds: float
    peak_extra_bytes: int
    lower_bound: int
    transfers: int
    messages: int
    rounds: int
    timing: tuple[tuple[str, float], ...] = ()   # seconds per phase of the switch, max over ranks
    direct_ends: int = 0     # message ends (of 2 x messages) that needed no staging buffer
    # max over ranks of (state held at the switch's peak) / (state held between steps before it,
    # gradient buffers included): tensor bytes, as CUDA's max_memory_allocated counts them
    peak_ratio: float = 0.0
    idle: tuple[int, ...] = ()   # ranks without work under the new plan (suspended or unused)

    def event(self) -> dict:
        """The ``migrate`` line of metrics.jsonl (DESIGN.md §6)."""
        return {"event": "migrate", "step": self.step, "from": self.from_plan, "to": self.to_plan,
                "bytes": self.bytes, "seconds": round(self.seconds, 4),
                "peak_extra_bytes": self.peak_extra_bytes, "idle": list(self.idle)}


def _runtime_bytes(rt: PlanRuntime, old: PlanRuntime) -> int:
    """Bytes of ``rt``'s state tensors in memory ``old`` did not have (what the switch
    allocated): a tensor taken over, or a view of a range that split, costs nothing."""
    shared = {t.untyped_storage().data_ptr() for t in _runtime_tensors(old)}
    return sum(t.numel() * t.element_size() for t in _runtime_tensors(rt)
               if t.untyped_storage().data_ptr() not in shared)


def _nbytes(ts) -> int:
    """Bytes of the distinct storages behind ``ts`` (a view costs nothing extra)."""
    seen = {}
    for t in ts:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _runtime_tensors(rt: PlanRuntime) -> list:
    ts = [p for p in rt.named.values()]
    opt = rt.optimizer
    for m in opt.masters:
        if m is not None:
            ts.append(m)
            ts += [v for v in opt.optimizer.state[m].values() if torch.is_tensor(v) and v.dim()]
    ts += [t for t in rt.grad_sync.flats + rt.grad_sync.parts + opt._gather if t is not None]
    return ts


def _kept(rt: PlanRuntime, old: PlanRuntime, h) -> bool:
    """Is new holding ``h`` in a tensor the new runtime took over from the old one?"""
    if h.kind == "param":
        return rt.named[h.buf] is old.named.get(h.buf)
    return h.buf in rt.optimizer.reused


def _local_parts(old: StateView, new: StateView, rank: int, rt: PlanRuntime,
                 old_rt: PlanRuntime) -> list[Transfer]:
    """What this rank holds under both plans, as (rank -> rank) parts to copy old -> new
    (slices in tensors the new runtime took over are already in place)."""
    moving = [h for h in new.holds() if not _kept(rt, old_rt, h)]
    return [Transfer(rank, rank, *k) for k in kept_slices(old.holds(), moving)]


@torch.no_grad()
def _copy_local(old: StateView, new: StateView, parts: list[Transfer], cap_bytes: int,
                device) -> int:
    """Copy kept slices from the old buffers into the new ones: directly where both sides are
    one window of the same shape (the usual case: a whole shard or range), else through a
    bounded staging buffer per dtype. Returns the staging bytes used."""
    peak = 0
    staged: dict[torch.dtype, list[Transfer]] = {}
    for t in parts:
        src = old.views(t.kind, t.name, t.lo, t.hi, natural=True)
        dst = new.views(t.kind, t.name, t.lo, t.hi, natural=True)
        if len(src) == 1 and len(dst) == 1 and src[0][1].shape == dst[0][1].shape:
            dst[0][1].copy_(src[0][1])
        else:
            staged.setdefault(src[0][0].dtype, []).append(t)
    for dt, ps in staged.items():
        size = torch.empty(0, dtype=dt).element_size()
        for group in chunked(ps, max(1, cap_bytes // size)):
            n = sum(t.numel for t in group)
            buf = torch.empty(n, dtype=dt, device=device)
            peak = max(peak, n * size)
            pack_parts(old, group, buf, natural=True)
            unpack_parts(new, group, buf, natural=True)
    return peak


def _copy_local_into(out: list[int], *args) -> None:
    out.append(_copy_local(*args))


@torch.no_grad()
def _derive_unsent(rt: PlanRuntime, old_rt: PlanRuntime, new: StateView, mixed: bool, adam_step: int,
            rank: int, cap_bytes: int, device) -> None:
    """Fill what was not sent: masters from params (fp32), params from masters (mixed), step."""
    if mixed:
        ranges = [(h.name, h.lo, h.hi) for h in new.holds("master")
                  if not (_kept(rt, old_rt, h) and rt.named[h.name] is old_rt.named.get(h.name))]
        params_from_masters(new, ranges, rt.optimizer.param_dtype, rank, cap_bytes, device)
    else:
        rt.optimizer.refresh_masters()
    rt.optimizer.set_step(adam_step)


@dataclass(frozen=True)
class _Route:
    """How the state moves, the same on every rank: the transfer plan, its packed messages and
    their bounded rounds, the message cap in bytes and the parameters' dtype."""

    tplan: object
    msgs: list
    rds: list
    cap: int
    param_dtype: torch.dtype


def _check_plan(engine, old_rt: PlanRuntime, new_plan):
    """The new plan, validated with the start-up checks; the global batch never changes."""
    from .settings import as_plan

    plan = engine.build_plan(as_plan(new_plan), engine.model_cfg, engine.world_size,
                             engine.settings, engine._user_cfg)
    for f in ("global_batch_size", "micro_batch_size"):
        if getattr(plan, f) != getattr(old_rt.plan, f):
            raise PlanError(f"switch_plan: new plan {f}={getattr(plan, f)} differs from the "
                            f"running plan's {getattr(old_rt.plan, f)}; the global batch never "
                            f"changes within a run")
    return plan


def _agree_groups_and_step(engine, plan, old_rt: PlanRuntime) -> int:
    """Create the plan's process groups (collective, same order everywhere) and agree on Adam's
    step (the max over ranks)."""
    GROUPS.ensure(plan_rank_sets(plan, engine.world_size))
    agree = torch.tensor([float(old_rt.optimizer.step_count())], dtype=torch.float64,
                         device=engine.device)
    tdist.all_reduce(agree, op=tdist.ReduceOp.MAX)
    return int(agree.item())


def _plan_route(engine, old_rt: PlanRuntime, plan) -> _Route:
    """The transfer plan old -> new, packed into messages of at most the migrate bucket."""
    mixed = engine.precision.mixed
    table = engine.param_table
    cap = max(1, int(engine.settings.migrate_bucket_mb * 2**20))
    param_dtype = engine.precision.dtype if mixed else torch.float32
    param_bytes = torch.empty(0, dtype=param_dtype).element_size()
    tplan = transfer_plan(Layout(old_rt.plan, old_rt.zero_stage), Layout(plan, old_rt.zero_stage),
                          table, mixed=mixed, param_bytes=param_bytes,
                          job=engine.job)
    msgs = messages(tplan, cap, mixed, table)
    return _Route(tplan, msgs, rounds(msgs, cap), cap, param_dtype)


def _free_scratch(old_rt: PlanRuntime) -> tuple[int, int]:
    """Free the old plan's gradients and all-gather buffers (scratch between steps: the next
    plan's are made by its first step) before the next plan's state is allocated; (state bytes
    before, state bytes kept)."""
    steady = _nbytes(_runtime_tensors(old_rt))
    old_rt.grad_sync.free()
    old_rt.optimizer.free_scratch()
    return steady, _nbytes(_runtime_tensors(old_rt))


def _build_runtime(engine, plan, old_rt: PlanRuntime) -> PlanRuntime:
    """The next plan's runtime on this rank; a parameter shard that is the same under both
    plans keeps its tensor."""
    rank, table = engine.global_rank, engine.param_table
    spec = locate(plan, rank)
    old_sh, new_sh = local_shards(old_rt.plan, table, rank), local_shards(plan, table, rank)
    keep = {n: old_rt.named[n] for n, sh in new_sh.items()
            if n in old_sh and old_sh[n].interval == sh.interval and n in old_rt.named}
    module = build_stage(plan, spec, engine._make_stage, engine.precision, reuse=keep,
                         device=engine.device)
    return engine.build_plan_runtime(plan, module, spec, old_rt.zero_stage, prev=old_rt)


def _send_and_copy(engine, step: int, rt: PlanRuntime, old_rt: PlanRuntime, old_v: StateView,
                   new_v: StateView, route: _Route):
    """Run the rounds of messages, with this rank's local copies while the first round is on
    the wire; (the rounds' stats, the local copies' staging bytes)."""
    rank = engine.global_rank
    staging: list[int] = []
    local = partial(_copy_local_into, staging, old_v, new_v,
                    _local_parts(old_v, new_v, rank, rt, old_rt), route.cap, engine.device)
    stats = run_rounds(rank, route.rds, old_v, new_v,
                       {"fp32": torch.float32, "param": route.param_dtype},
                       engine.device, timeout_s=engine.settings.migrate_timeout_s,
                       step=step, overlap=local)
    return stats, staging[0]


def _failure_reason(rank: int, failure: BaseException | None, bad: Failure | None,
                    unsure: AgreementError | None, deadline: float) -> str:
    """This rank's own error, then the first failed rank's (the cause), then the silent ones."""
    parts = []
    if failure is not None:
        parts.append(f"{type(failure).__name__}: {str(failure)[:400]}")
    elif unsure is not None:
        parts.append(f"the ranks could not agree on its outcome (a rank died or hangs: "
                     f"{str(unsure).splitlines()[0][:300]})")
    if bad is not None and (bad.rank != rank or failure is None or rank in bad.silent):
        parts.append(bad.message[:400] if bad.rank in bad.silent
                     else f"rank {bad.rank} failed: {bad.message[:400]}")
    if bad is not None and bad.silent and bad.rank not in bad.silent:
        parts.append(f"rank(s) {list(bad.silent)} did not report within {deadline:g} s "
                     f"(died or hang)")
    return "; ".join(parts)


def _raise_if_any_failed(engine, step: int, failure: BaseException | None,
                         rt: PlanRuntime | None, from_id: str, to_id: str) -> None:
    """Agreement: every rank learns whether any rank failed, and the first failed rank's
    message, through the job's store, not the communicator a failed transfer may have broken
    (malleus_ds/resilience/agreement.py); a rank that died or hangs counts as failed at the
    deadline. Only if all succeeded is the new runtime adopted; otherwise every rank raises and
    the engine refuses to train."""
    rank = engine.global_rank
    deadline = 2 * engine.settings.migrate_timeout_s + 10
    try:
        bad, unsure = _agree_failed(step, failure, deadline), None
    except AgreementError as e:     # the store itself is gone (its host died)
        bad, unsure = None, e
    if bad is None and unsure is None:
        return
    why = _failure_reason(rank, failure, bad, unsure, deadline)
    engine._broken = (f"a plan switch before step {step} failed ({why}); this engine's state "
                      f"may be half-moved and it will not train: restart from the last "
                      f"checkpoint")
    if rt is not None:
        rt.close()
    raise MigrationError(f"rank {rank}: migration {from_id} -> {to_id} before step {step} "
                         f"failed: {why}") from failure


def _adopt(engine, rt: PlanRuntime, old_rt: PlanRuntime, plan) -> None:
    """Adopt the new runtime, carry the LR schedule, close the old runtime, name the new TP
    group to DeepSpeed's mpu and release the process groups no plan uses any more."""
    old_sched, old_groups = engine.lr_scheduler, engine.optimizer.param_groups
    engine.adopt(rt)
    _carry_schedule(engine, old_sched, old_groups)
    old_rt.close()
    engine.mpu.follow(rt.spec, rt.num_stages)       # DeepSpeed's mpu names the new TP group
    GROUPS.release_unused(plan_rank_sets(plan, engine.world_size), owner=engine,
                          device=engine.device)


def _report(engine, step: int, plan, from_id: str, route: _Route, stats, marks: list,
            seconds: float, peak: int, ratio: float) -> MigrationReport:
    """The switch's report, the same on every rank: bytes and direct ends summed over ranks,
    seconds, peak memory and the phases' seconds the max over ranks."""
    timing = tuple((name, round(b - a, 6)) for (_, a), (name, b) in zip(marks[:-1], marks[1:]))
    # inside "transfers + local copies": staging copies at both ends (none for a message that
    # travels from / into its place), and waiting on the wire while the local copies run
    timing += (("pack", stats.pack_s), ("wire + local", stats.wait_s), ("unpack", stats.unpack_s))
    tot = torch.tensor([float(stats.bytes_sent), float(stats.direct)], dtype=torch.float64,
                       device=engine.device)
    mx = torch.tensor([seconds, float(peak), ratio, *(v for _, v in timing)], dtype=torch.float64,
                      device=engine.device)
    tdist.all_reduce(tot)
    tdist.all_reduce(mx, op=tdist.ReduceOp.MAX)
    vals = mx.tolist()
    timing = tuple((k, float(v)) for (k, _), v in zip(timing, vals[3:]))
    return MigrationReport(step=step, from_plan=from_id, to_plan=plan.id,
                           bytes=int(tot[0]), seconds=vals[0], peak_extra_bytes=int(vals[1]),
                           lower_bound=route.tplan.lower_bound,
                           transfers=len(route.tplan.transfers), messages=len(route.msgs),
                           rounds=len(route.rds), timing=timing, direct_ends=int(tot[1]),
                           peak_ratio=round(vals[2], 4),
                           idle=tuple(r for r in range(engine.world_size)
                                      if plan.locate(r) is None))


def switch_plan(engine, new_plan) -> MigrationReport:
    """See the module docstring. ``new_plan``: a Plan, a path or plan JSON."""
    if getattr(engine, "_broken", None):
        raise MigrationError(engine._broken)
    t0 = time.perf_counter()
    marks = [("start", t0)]
    step = engine.global_steps
    old_rt: PlanRuntime = engine.runtime
    from_id = old_rt.plan.id
    plan = _check_plan(engine, old_rt, new_plan)
    marks.append(("validate", time.perf_counter()))
    adam_step = _agree_groups_and_step(engine, plan, old_rt)
    marks.append(("groups", time.perf_counter()))
    route = _plan_route(engine, old_rt, plan)
    marks.append(("transfer plan", time.perf_counter()))
    rank, table, mixed = engine.global_rank, engine.param_table, engine.precision.mixed
    rt = None
    try:
        steady, kept_bytes = _free_scratch(old_rt)
        rt = _build_runtime(engine, plan, old_rt)
        old_v = StateView(old_rt, table, rank, mixed)
        new_v = StateView(rt, table, rank, mixed)
        marks.append(("build runtime", time.perf_counter()))
        stats, staging = _send_and_copy(engine, step, rt, old_rt, old_v, new_v, route)
        marks.append(("transfers + local copies", time.perf_counter()))
        _derive_unsent(rt, old_rt, new_v, mixed, adam_step, rank, route.cap, engine.device)
        rt.optimizer.reused = set()     # taken-over buckets are ordinary from now on
        marks.append(("derive", time.perf_counter()))
        # local copies overlap the first round: their staging and the wire buffers coexist
        peak = _runtime_bytes(rt, old_rt) + staging + stats.peak_buffer_bytes
        ratio = (kept_bytes + peak) / steady if steady else 0.0
    except Exception as e:      # noqa: BLE001 - every failure ends in the agreement below
        failure = e
    else:
        failure = None
    _raise_if_any_failed(engine, step, failure, rt, from_id, plan.id)
    _adopt(engine, rt, old_rt, plan)
    # freed by reference counting (no gc.collect(): a full collection is slow with DeepSpeed
    # loaded, and the runtime holds no cycles); a caller still holding the old optimizer
    # returned by initialize() keeps that one alive
    del old_rt, old_v, new_v
    if engine.device is not None and str(engine.device).startswith("cuda"):
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    marks.append(("adopt + free", time.perf_counter()))
    return _report(engine, step, plan, from_id, route, stats, marks, seconds, peak, ratio)


def _carry_schedule(engine, old_sched, old_groups) -> None:
    """The LR schedule continues where it was: a scheduler over the new optimizer with the old
    one's state, then the current hyper-parameters copied group by group (after: building a
    DeepSpeed scheduler resets the optimizer's LR to the schedule's start)."""
    new_opt = engine.optimizer.optimizer
    sched = engine._scheduler_from_config(new_opt) if old_sched is not None else None
    if sched is not None:
        sched.load_state_dict(old_sched.state_dict())
    for g_new, g_old in zip(new_opt.param_groups, old_groups):
        for k, v in g_old.items():
            if k != "params":
                g_new[k] = v
    engine.lr_scheduler = sched


def _agree_failed(step: int, failure: BaseException | None, timeout_s: float
                  ) -> Failure | None:
    """The first failed rank and its message (None if every rank succeeded), the same on
    every rank within ``timeout_s``, agreed through the job's store (malleus_ds/resilience/agreement.py):
    a communicator that the failure broke (NCCL aborts it on a timed-out wait, a dead peer
    breaks it) is not used. Raises AgreementError if the store itself is unreachable."""
    err = None if failure is None else f"{type(failure).__name__}: {failure}"
    # a MigrationError here is the transport's: a peer did not complete (peer-caused)
    return agree(f"migrate@step{step}", err, timeout_s,
                 peer_caused=isinstance(failure, MigrationError))
