#!/usr/bin/env python
"""Plan a layout with Hydra, e.g. to sweep straggler rates (config: conf/plan_sweep.yaml).

    python launch/plan.py --multirun rates=1.3,2,4,8,12 planner=fast

Hydra stays here: the DictConfig becomes a plain dict, then a frozen :class:`Problem` and
:class:`PlannerConfig`; the planner never sees OmegaConf. Returns η (for Hydra sweepers).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from malleus_ds.plan import PlanError  # noqa: E402
from malleus_ds.problem import Problem  # noqa: E402
from malleus_ds.planner import PlannerConfig, plan  # noqa: E402


@dataclass(frozen=True)
class SweepJob:
    problem: Problem
    planner: PlannerConfig
    output: str
    plot: bool


def build_problem(c: Mapping[str, Any]) -> Problem:
    """The job's problem: a file or the inline fields, plus ``stragglers`` x ``rates``."""
    if c.get("problem"):
        pr = Problem.load(c["problem"])
    else:
        pr = Problem.from_json({
            "version": 1, "name": c.get("name", "plan_sweep"), "cluster": c["cluster"],
            "model": c["model"], "training": c["training"],
            "cost": {"tp_slowdown": c["tp_slowdown"]}, "memory": c.get("memory"), "rates": {}})
    ranks = list(c.get("stragglers") or [])
    rates = c.get("rates")
    if rates is None or not ranks:
        return pr
    vals = list(rates) if isinstance(rates, (list, tuple)) else [rates] * len(ranks)
    if len(vals) != len(ranks):
        raise PlanError(f"rates: {len(vals)} values for {len(ranks)} stragglers {ranks}")
    new = dict(pr.rates)
    new.update({str(r): float(v) for r, v in zip(ranks, vals)})
    d = pr.to_json()
    d["rates"] = new
    d["name"] = f"{pr.name}-r{'_'.join(f'{v:g}' for v in vals[:3])}"
    return Problem.from_json(d)


def to_job(cfg: DictConfig) -> SweepJob:
    c = OmegaConf.to_container(cfg, resolve=True)
    return SweepJob(problem=build_problem(c), planner=PlannerConfig(**c["planner"]),
                    output=str(c.get("output") or "plan.json"), plot=bool(c.get("plot")))


@hydra.main(config_path="../conf", config_name="plan_sweep", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        job = to_job(cfg)
    except PlanError as e:
        print(f"launch/plan.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    from hydra.core.hydra_config import HydraConfig

    outdir = Path(HydraConfig.get().runtime.output_dir)
    res = plan(job.problem, config=job.planner)
    out = outdir / job.output
    res.plan.save(out)
    if job.plot:
        from malleus_ds.simulate import gantt
        gantt(job.problem, res.plan, str(outdir / "gantt.png"))
    print(f"{job.problem.name}: {res.summary()} -> {out}")
    return res.efficiency


if __name__ == "__main__":
    main()
