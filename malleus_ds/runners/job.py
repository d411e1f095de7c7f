"""The run's plan and the job facts read from the run config (``plan``, ``parallel.*``,
``cluster.*``, ``malleus.switch``): below the runners and the checkpoint writer, which both ask."""
from __future__ import annotations

from ..config import ConfigError, RunConfig
from ..plan import Plan, PlanError, static_plan
from ..plan import nominal_tp as plans_tp


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
    """The job's TP degree: every TP group of the plan and of the scripted switch plans
    (``malleus.switch``) divides it."""
    plans = [plan]
    for e in cfg.malleus.get("switch") or ():
        try:    # unreadable entries are reported by the settings parser, naming the entry
            plans.append(Plan.load(e["plan"]))
        except (PlanError, TypeError, KeyError):
            pass
    return plans_tp(*plans, at_least=cfg.parallel.tp)
