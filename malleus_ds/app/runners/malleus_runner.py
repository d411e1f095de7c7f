"""``engine=malleus``: MalleusEngine running a plan (DESIGN.md §5).

``plan=static`` runs the uniform layout of ``parallel.*`` (:func:`malleus_ds.plan.static_plan`);
``plan=PATH.json`` runs exactly that plan: its ``global_batch_size`` / ``micro_batch_size`` win
over ``train.*``; a plan whose ``num_layers`` differs from ``model.num_layers``, that names ranks
the job does not have, or whose TP sizes do not divide the model's heads is a ConfigError on every
rank before any process group exists. On local CPU processes all ranks count as one node unless
``cluster.nodes * cluster.gpus_per_node`` equals the world size.

Checkpoints (``checkpoint.dir``): ``MalleusEngine.save_checkpoint`` (per-rank slice files,
``engine/checkpoint.py``), which load under any plan and world size: a resumed run runs the plan
it is given (``plan=...``), not the one that saved; its ``load_checkpoint`` restores weights,
Adam state, LR schedule, loss scaler and ``global_steps``, so ``malleus.switch`` entries before
the resumed step are dropped.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING

from ..run_config import ConfigError, RunConfig
from ...plan import Plan, PlanError
from .base import DistEnv, RunSummary
from .checkpoint import Checkpointer, engine_writer
from .fit import check_fits
from .guard import STOP
from .resume import carried_rates
from .common import ComputeClock, StepReporter, monitors_to_run_dir
from .job import job_layout, load_plan

if TYPE_CHECKING:
    from ...interop.ds_config import DsConfig


def check_plan(cfg: RunConfig, plan: Plan, where: str) -> None:
    """The start-up checks of a plan against this job (world, layers, node shape, TP sizes)."""
    from ...engine.plan_check import check_job_plan

    try:
        check_job_plan(plan, cfg.model, job_layout(cfg, plan), "plan ")
    except PlanError as e:
        raise ConfigError(f"engine=malleus {where}: {e}") from None


def validate(cfg: RunConfig) -> None:
    plan = load_plan(cfg)
    check_plan(cfg, plan, f"plan={cfg.plan}")
    from ...interop.sections import check_zero_stage

    try:    # the ZeRO stage and fp16/bf16, as the engine will read them
        check_zero_stage(cfg.deepspeed.zero_stage)
        engine_settings(cfg, plan, engine_ds_config(cfg))
    except ValueError as e:
        raise ConfigError(f"engine=malleus: {e}") from None
    check_ds_straggler(cfg.deepspeed.config.get("malleus"), cfg.world_size)
    for i, k in enumerate(cfg.malleus.loop.replan_at):
        if k >= cfg.train.steps:
            raise ConfigError(f"malleus.replan_at[{i}]={k} is not before the run's end "
                              f"(train.steps={cfg.train.steps}); it would never happen")
    for sw in cfg.malleus.switch:
        if sw.step >= cfg.train.steps:
            raise ConfigError(f"{sw.where}.step={sw.step} is not before the run's end "
                              f"(train.steps={cfg.train.steps}); it would never happen")
        for f in ("global_batch_size", "micro_batch_size"):
            if getattr(sw.plan, f) != getattr(plan, f):
                raise ConfigError(f"{sw.where}.plan {f}={getattr(sw.plan, f)} differs from the "
                                  f"starting plan's {getattr(plan, f)}; the global batch never "
                                  f"changes within a run")
        check_plan(cfg, sw.plan, f"{sw.where}.plan")


def from_deepspeed(env: DistEnv, engine, saved) -> tuple[str, str]:
    """A checkpoint engine=deepspeed saved (``saved``: resume.Saved), converted by rank 0 into
    MalleusEngine's format beside DeepSpeed's files (``interop/checkpoint_import.py``), which then
    loads under this run's plan; every rank learns rank 0's error. Returns (root, tag)."""
    from ...interop.checkpoint_import import import_deepspeed

    if env.is_rank0:
        print(f"[malleus_ds] continuing engine=deepspeed's checkpoint {saved.path} under this "
              f"run's plan", flush=True)
        if saved.meta.get("foreign"):
            print(f"[malleus_ds] note: {saved.path} has no run.json (your own script saved "
                  f"it): the data continues at step {saved.step} of this run's data and batch, "
                  f"which nothing recorded there can check", flush=True)
    return import_deepspeed(engine, saved.path, client_state={"step": saved.step})


def check_ds_straggler(sec, world_size: int) -> None:
    """The ds_config's own ``malleus.straggler`` (``malleus_ds.initialize``'s emulation; the app
    runs ``straggler.*``): its schedule, and its ``method=quota`` on a machine that cannot
    apply it, refused as they would be there."""
    from ...emulation.straggler import StragglerError, StragglerSchedule
    from ...engine.settings import parse_straggler
    from . import check_straggler_method

    raw = parse_straggler((sec or {}).get("straggler"))    # the section was parsed at config time
    try:
        sched = StragglerSchedule.parse(raw, world_size)
    except StragglerError as e:
        raise ConfigError(f"ds_config.malleus.{e}") from None
    check_straggler_method(sched, "ds_config.malleus.straggler")


def build_ds_config(cfg: RunConfig, plan: Plan | None = None) -> dict:
    """The stock sections MalleusEngine reads from a ds_config (optimizer, ZeRO stage,
    precision, monitors ...), from the user's; the ``malleus`` section is not among them: the
    engine gets :func:`engine_settings`, parsed from the typed run config. The same for every
    plan (``plan`` is not read): the plan sets the batch keys in the engine."""
    c = copy.deepcopy(dict(cfg.deepspeed.config))
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        c.pop(k, None)                                  # the plan's batch sizes win
    c.pop("malleus", None)                              # parsed into cfg.malleus: the settings
    c.setdefault("steps_per_print", 10**9)
    c.setdefault("gradient_clipping", 0.0)              # same math as engine=torch
    t = cfg.train
    c.setdefault("optimizer", {"type": "AdamW", "params": {
        "lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay}})
    c.pop("zero_allow_untested_optimizer", None)
    monitors_to_run_dir(c, cfg.run_dir)
    return c


#: the last run config :func:`engine_ds_config` decoded, and its DsConfig
_DECODED: list = []


def engine_ds_config(cfg: RunConfig) -> DsConfig:
    """The ds_config MalleusEngine gets (:func:`build_ds_config`), decoded once per rank
    (``interop/ds_config.py``): :func:`validate` and :func:`run` take the same ``cfg`` object,
    and the second gets the first's value. The user's ds_config was reviewed when the run
    config was built (``app/config.py``): its notes are the review."""
    from ...interop.ds_config import decode

    if not (_DECODED and _DECODED[0] is cfg):
        _DECODED[:] = [cfg, decode(build_ds_config(cfg), notes=cfg.deepspeed.notes)]
    return _DECODED[1]


def engine_settings(cfg: RunConfig, plan: Plan, ds_config: dict | DsConfig):
    """MalleusEngine's settings for this run, from the typed run config: the job's shape, the
    seed, the scripted switches, the migration limits, activation checkpointing as
    ``config_deepspeed.resolve_activation_checkpointing`` resolved it; the precision from
    ``ds_config`` (``MalleusEngine.build_settings``; a dict is decoded there, which refuses what
    the engine cannot run)."""
    from ...engine.engine import MalleusEngine
    from ...engine.settings import MalleusSettings

    job = job_layout(cfg, plan)
    m = cfg.malleus
    return MalleusEngine.build_settings(ds_config, MalleusSettings(
        tp=job.tp, gpus_per_node=job.gpus_per_node, seed=cfg.train.seed, switch=m.switch,
        migrate_bucket_mb=m.migrate_bucket_mb, migrate_timeout_s=m.migrate_timeout_s,
        recompute=cfg.train.activation_checkpointing))


def device_names(env: DistEnv) -> list[str]:
    """Every rank's ``host/local_rank``, in rank order (an all-gather): what a checkpoint's
    rates are keyed by, so they follow the device when a restart renumbers the ranks."""
    import socket

    import torch.distributed as dist

    me = f"{socket.gethostname()}/{env.local_rank}"
    if env.world_size == 1:
        return [me]
    out: list = [None] * env.world_size
    dist.all_gather_object(out, me)
    return [str(x) for x in out]


def run(cfg: RunConfig, env: DistEnv) -> RunSummary:
    from ...data import build_dataset
    from ...engine.engine import MalleusEngine
    from ..loop import attach_loop

    ds = engine_ds_config(cfg)
    plan = load_plan(cfg)
    par = cfg.parallel
    if par.asked_pp is not None and env.is_rank0:
        print(f"[malleus_ds] parallel.pp={par.asked_pp} does not tile the {cfg.world_size} ranks "
              f"of this elastic start: pp={par.pp} x dp={par.dp} (tp={par.tp}) instead",
              flush=True)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size))
    data = build_dataset(cfg)
    fit = check_fits(cfg, plan, ds.config, env)     # before any allocation: the job holds it?
    if fit.note is not None:
        plan = fit.plan
        if env.is_rank0:
            print(f"[malleus_ds] {fit.note}", flush=True)
    engine = MalleusEngine(cfg.model, ds, plan, data=data,
                           settings=engine_settings(cfg, plan, ds))
    loop = attach_loop(engine, cfg.malleus.loop)    # the adaptive loop (app/loop.py)
    ck = Checkpointer(cfg, env)
    if ck.resumed is not None:
        from ...engine.checkpoint import CheckpointError

        root, tag = str(ck.resumed.root), ck.resumed.tag
        try:    # its checks read shared files only: the same error on every rank
            if ck.resumed.meta.get("engine") == "deepspeed":
                root, tag = from_deepspeed(env, engine, ck.resumed)
            _, client = engine.load_checkpoint(root, tag=tag)
        except CheckpointError as e:
            raise ConfigError(f"checkpoint.resume: {e}") from None
        if (client or {}).get("step") != ck.resumed.step or engine.global_steps != ck.start:
            raise ConfigError(f"checkpoint {ck.resumed.path}: engine files of step "
                              f"{engine.global_steps} (client state {client!r}), run.json of "
                              f"step {ck.resumed.step}; the folder mixes two saves")

    if cfg.checkpoint.dir:
        devices = device_names(env)     # collective: where each rank runs (host/local_rank)
        if ck.resumed is not None:
            rates = carried_rates(ck.resumed.meta, devices)
            if rates is not None and loop.carry(rates, ck.start) and env.is_rank0:
                h = loop.s.detect.healthy
                slow = {d: r for d, r in enumerate(rates) if r is not None and r >= h}
                print(f"[malleus_ds] rates measured before the restart: {slow}; re-planning "
                      f"before step {ck.start}", flush=True)
        if env.is_rank0:
            ck.extra = lambda: {"rates": engine.measured_rates, "devices": devices}
    write = engine_writer(engine)

    clock = ComputeClock(cfg, env)
    reporter = StepReporter(cfg, env, first_step=ck.start, monitor=engine.monitor)
    engine.set_compute_clock(clock)                     # timing + straggler emulation
    engine.set_stop_source(lambda: STOP.signum)         # rides in the step's all-reduce
    tp_cost = loop.tp_cost_event(engine.global_steps)   # the TP slowdown measured at start-up
    if tp_cost is not None and ck.start < cfg.train.steps:
        reporter.note(tp_cost)
    for step in range(ck.start, cfg.train.steps):
        engine.apply_scheduled_switch()     # re-plans and switches, timed apart from the step
        for ev in engine.take_events():
            reporter.event(ev)
        t0 = time.perf_counter()
        clock.start_step(step)
        loss = engine.train_batch(step=step)
        links = loop.measured_links()
        reporter.step_done(step, loss, time.perf_counter() - t0, clock, plan=engine.plan.id,
                           measured_rates=engine.measured_rates,
                           link_rates=links.get("link_rates"),
                           gpu_link_rates=links.get("gpu_link_rates"),
                           probe_rates=loop.probe_rates(), sums=engine.last_sums)
        ck.after_step(step + 1, write, reporter)
    ck.finish(cfg.train.steps, write, reporter)
    loop.close()
    skipped = [sw.step for sw in engine.settings.switch if sw.step < ck.start]  # and ds_config's
    extra = dict(ck.summary(), **({"skipped_switches": skipped} if skipped else {}),
                 **({"tp_slowdown": tp_cost["table"]} if tp_cost else {}))
    return reporter.finish(plan=plan.to_json(), final_plan=engine.plan.to_json(), **extra)
