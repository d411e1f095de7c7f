"""The run's plan and the job facts read from the run config (``plan``, ``parallel.*``,
``cluster.*``, ``malleus.switch``): below the runners and the checkpoint writer, which both ask."""
from __future__ import annotations

from ..run_config import ConfigError, RunConfig
from ...job_layout import JobLayout, nominal_tp
from ...plan import Plan, PlanError, static_plan


def load_plan(cfg: RunConfig) -> Plan:
    t, p = cfg.train, cfg.parallel
    try:
        if cfg.plan == "static":
            return static_plan(cfg.model.num_layers, t.global_batch_size, t.micro_batch_size,
                               p.tp, p.pp, p.dp)
        return Plan.load(cfg.plan)
    except PlanError as e:
        raise ConfigError(f"plan={cfg.plan}: {e}") from None


def job_layout(cfg: RunConfig, plan: Plan) -> JobLayout:
    """The job's shape (``job_layout.py``). Nodes: ``cluster.*`` when ``cluster.nodes *
    cluster.gpus_per_node`` is the world size, else every rank on one node (local CPU processes).
    Nominal TP degree: ``parallel.tp`` raised so every TP group of ``plan`` and of the scripted
    switch plans (``malleus.switch``) divides it."""
    c = cfg.cluster
    gpn = c.gpus_per_node if c.nodes * c.gpus_per_node == cfg.world_size else cfg.world_size
    plans = [plan, *(sw.plan for sw in cfg.malleus.switch)]
    return JobLayout(cfg.world_size, gpn, nominal_tp(*plans, at_least=cfg.parallel.tp))
