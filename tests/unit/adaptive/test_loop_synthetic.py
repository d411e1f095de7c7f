"""The adaptive loop with no engine and no process group (issue 32): one rank-0 loop driven for
hundreds of steps by synthetic per-rank timings under a straggler schedule, through the same
step hooks an engine calls (``steploop.py``), with the real detector, probes' arithmetic,
planner process and cost rule. Checked against the schedule: detection, the re-plan, the slow
rank's work cut (suspended or a light share), never let back while slow, and re-admission to
full work once healthy, twice in one run."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from malleus_ds.adaptive.control import Controller
from malleus_ds.adaptive.detect import DetectConfig
from malleus_ds.adaptive.job import JobSpec
from malleus_ds.adaptive.settings import AdaptiveSettings
from malleus_ds.adaptive.work import cost_units
from malleus_ds.steploop import StepSums
from malleus_ds.models.llama import PRESETS
from malleus_ds.plan import Plan, static_plan

WORLD = 4
BASE = 0.01          # seconds per work unit on a healthy rank
PROBE = 0.02         # seconds per run of the probe block on a healthy rank
#: (rank, rate, start, end): rank 1 at rate 10, then rank 3 at rate 3
SCHEDULE = ((1, 10.0, 20, 110), (3, 3.0, 170, 250))
STEPS = 300


def true_rates(step: int) -> np.ndarray:
    r = np.ones(WORLD)
    for d, rate, a, b in SCHEDULE:
        if a <= step < b:
            r[d] = max(r[d], rate)
    return r


def work(plan: Plan, rank: int) -> int:
    """Micro-batches x layers ``rank`` runs under ``plan`` (0: none)."""
    loc = plan.locate(rank)
    if loc is None:
        return 0
    pipe = plan.pipelines[loc[0]]
    return pipe.micro_batches * pipe.stages[loc[1]].num_layers


def apply_decisions(ctl: Controller, step: int, plan: Plan, events: list) -> Plan:
    """What an engine does at the boundary before ``step``: the loop's decisions, each switched
    to (a 1 MB, 10 ms migration) or considered; their events go to ``events``. Returns the plan
    that runs ``step``."""
    for d in ctl.before_step(step):
        events.append(d.line())
        if d.plan is not None:
            plan = Plan.from_json(d.plan)
            ctl.switched(plan, d.made_for,
                         migration=SimpleNamespace(bytes=1 << 20, seconds=0.01))
        else:
            ctl.considered(d.measured)
    return plan


def drive(ctl: Controller, plan: Plan, rng) -> tuple[list[Plan], list[dict]]:
    """Run :data:`STEPS` steps as an engine would; returns the plan of every step and every
    replan event. Rank 0's loop decides; the other ranks' probes are what theirs would time."""
    plans, events = [], []
    for step in range(STEPS):
        plan = apply_decisions(ctl, step, plan, events)
        plans.append(plan)
        rate = true_rates(step)
        units = cost_units(plan, WORLD, 1, {1: 1.0}, ctl.head)
        comp = units * BASE * rate * rng.uniform(0.95, 1.05, WORLD)
        probes = np.full(WORLD, np.nan)
        for d in range(WORLD):     # who probes after this step's all-reduce (as probe_due says)
            if units[d] <= 0 or d == ctl.probe_ref or ctl.held[d]:
                probes[d] = PROBE * rate[d] * rng.uniform(0.95, 1.05)
        ready, _ = ctl.contribute(float(comp[0]), 0.0)
        ctl.observe(step, StepSums(loss=0.0, overflow=False, ready=ready, compute_s=comp,
                                   probe_s=probes))
        ctl.step_done(float(comp.max()) * 1.05)
        ctl.wait_planner()          # planning counted in steps: the answer is in by the next
    return plans, events


def test_the_loop_follows_a_straggler_schedule_with_no_engine():
    cfg = PRESETS["tiny"]
    plan = static_plan(cfg.num_layers, 16, 1, 1, 1, WORLD)
    spec = JobSpec.of_model(cfg, plan)
    settings = AdaptiveSettings(detect=DetectConfig(every=1, probe_every=1),
                                tp_slowdown="ideal", planner_time_limit_s=0.5)
    ctl = Controller(spec, settings, plan)
    try:
        plans, events = drive(ctl, plan, np.random.default_rng(0))
    finally:
        ctl.close()
    full = work(plan, 1)
    adopted = [e for e in events if e.get("adopted")]
    for d, rate, a, b in SCHEDULE:
        # detected and planned for within 8 steps of the onset
        first = next((e["step"] for e in adopted if a < e["step"]), None)
        assert first is not None and first <= a + 8, (d, first, events)
        # while slow (from the re-plan on), its work is cut to at most a rate-2 share, and it
        # is never let back to full work
        cut = [work(p, d) for p in plans[first:b]]
        assert max(cut) <= full / 2, (d, cut)
        # healthy again: full work within 20 steps, and kept until the next onset
        back = next((k for k in range(b, STEPS) if work(plans[k], d) >= full), None)
        assert back is not None and back <= b + 20, (d, back, [work(p, d) for p in plans[b:]])
    # the rate-10 rank sits out (suspended, probed) for the middle of its slow phase
    assert work(plans[60], 1) == 0, [work(p, 1) for p in plans[20:110]]
    # every step's plan keeps the global batch
    assert all(sum(q.micro_batches for q in p.pipelines) * p.micro_batch_size == 16
               for p in plans)
