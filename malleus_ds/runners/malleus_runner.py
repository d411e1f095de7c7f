"""``engine=malleus``: MalleusEngine running a plan (DESIGN.md §5).

``plan=static`` runs the uniform layout of ``parallel.*`` (:func:`malleus_ds.plan.static_plan`);
``plan=PATH.json`` runs exactly that plan: its ``global_batch_size`` / ``micro_batch_size`` win
over ``train.*``; a plan whose ``num_layers`` differs from ``model.num_layers``, that names ranks
the job does not have, or whose TP sizes do not divide the model's heads is a ConfigError on every
rank before any process group exists. On local CPU processes all ranks count as one node unless
``cluster.nodes * cluster.gpus_per_node`` equals the world size.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from math import lcm

from ..config import ConfigError, RunConfig
from ..plan import Plan, PlanError, static_plan, validate_plan
from .base import DistEnv, RunSummary
from .common import ComputeClock, StepReporter, monitors_to_run_dir


def load_plan(cfg: RunConfig) -> Plan:
    t, p = cfg.train, cfg.parallel
    try:
        if cfg.plan == "static":
            return static_plan(cfg.model.num_layers, t.global_batch_size, t.micro_batch_size,
                               p.tp, p.pp, p.dp)
        return Plan.load(cfg.plan)
    except PlanError as e:
        raise ConfigError(f"plan={cfg.plan}: {e}") from None


def gpus_per_node(cfg: RunConfig) -> int:
    c = cfg.cluster
    return c.gpus_per_node if c.nodes * c.gpus_per_node == cfg.world_size else cfg.world_size


def nominal_tp(cfg: RunConfig, plan: Plan) -> int:
    return lcm(cfg.parallel.tp, *(s.tp for q in plan.pipelines for s in q.stages))


def validate(cfg: RunConfig) -> None:
    from ..engine.tensor_parallel import TPError, check_tp_size

    from ..engine.groups import check_world

    plan = load_plan(cfg)
    try:
        check_world(plan, cfg.world_size)
        validate_plan(plan, tp=nominal_tp(cfg, plan), gpus_per_node=gpus_per_node(cfg),
                      world_size=cfg.world_size, num_layers=cfg.model.num_layers)
        for i, q in enumerate(plan.pipelines):
            for j, s in enumerate(q.stages):
                check_tp_size(cfg.model, s.tp, f"plan pipelines[{i}].stages[{j}]")
    except (PlanError, TPError) as e:
        raise ConfigError(f"engine=malleus plan={cfg.plan}: {e}") from None
    zero = cfg.deepspeed.zero_stage
    if zero not in (0, 1, 2):
        raise ConfigError(f"engine=malleus: ds_config zero_optimization.stage={zero} is not "
                          f"supported; use stage 0, 1 or 2 (e.g. deepspeed=zero1)")
    from ..engine.engine import MalleusEngine

    try:    # the malleus section and fp16/bf16/data_types, as the engine will read them
        MalleusEngine.build_settings(build_ds_config(cfg, plan))
    except ValueError as e:
        raise ConfigError(f"engine=malleus: {e}") from None


def build_ds_config(cfg: RunConfig, plan: Plan) -> dict:
    c = copy.deepcopy(dict(cfg.deepspeed.config))
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        c.pop(k, None)                                  # the plan's batch sizes win
    c.setdefault("steps_per_print", 10**9)
    c.setdefault("gradient_clipping", 0.0)              # same math as engine=torch
    t = cfg.train
    c.setdefault("optimizer", {"type": "AdamW", "params": {
        "lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay}})
    c.pop("zero_allow_untested_optimizer", None)
    c["malleus"] = dict(c.get("malleus") or {}, seed=t.seed, tp=nominal_tp(cfg, plan),
                        gpus_per_node=gpus_per_node(cfg))
    monitors_to_run_dir(c, cfg.run_dir)
    return c


def run(cfg: RunConfig, env: DistEnv) -> RunSummary:
    from ..data import ByteCorpus
    from ..engine.engine import MalleusEngine

    plan = load_plan(cfg)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size))
    data = ByteCorpus(cfg.model.max_seq_len, seed=cfg.train.corpus_seed)
    engine = MalleusEngine(cfg.model, build_ds_config(cfg, plan), plan, data=data)
    clock, reporter = ComputeClock(cfg, env), StepReporter(cfg, env)
    engine.set_compute_clock(clock)                     # timing + straggler emulation
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        clock.start_step(step)
        loss = engine.train_batch(step=step)
        reporter.step_done(step, loss, time.perf_counter() - t0, clock)
    return reporter.finish(plan=plan.to_json())
