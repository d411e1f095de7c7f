"""``malleus-sim replay --from-run RUN_DIR``: the replay checked against a run it can predict.

From a recorded engine=malleus run (its ``.hydra/config.yaml`` and ``metrics.jsonl``) this builds
what a replay needs, each from the run's own files:

* **the job**: the model (our Llama presets, with the run's overrides), the batch, the layout
  the run started under (``plan=static``: ``parallel.*``), the world (the ranks the step lines
  name) and the memory the loop would estimate (``replan.job_memory``), as the loop builds its
  planning problem in training; the loop's settings (``malleus.*``);
* **the step time**: the mean healthy step of its first plan (steps after
  ``train.warmup_steps`` before the first straggler), and the share of it that is compute (the
  busiest rank's ``compute_s`` over those steps, as the what-if account reads it,
  ``report/whatif.py``): only that share slows with the rates;
* **the trace**: its emulated schedule on the run's own clock (a straggler starts at the moment
  its first step started, counting step times and migration seconds from the first step after
  warm-up), at the slowdown each rank really ran at: per stretch of a phase on one plan, the
  loop's own measured rate (``measured_rates``; an emulated CPU straggler runs slower than
  scheduled, more so on a light share);
* **the host**: where the step lines carry ``wait_s``, the ranks' shared CPU cores
  (``host.SharedHost.calibrate``): each step's seconds under fluid sharing of the cores by
  the ranks' compute, their sustained probes and the planner's search; in older runs, how much
  longer the steps ran while the planner searched (``run_malleus(planner_stall=)``);
* **the switch costs**: a fixed part and a bandwidth fitted to its ``migrate`` events, the
  first step after a switch against the steps that follow (warm-up), and the planner's seconds
  its ``replan`` events took.

:func:`compare` then replays the ``malleus`` policy and, per phase of the schedule, sets its
samples/s against the run's (``run_model.throughput``: step times plus migrations).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from ..plan import Plan
from ..problem import Problem
from .costs import MigrationCost
from .host import SharedHost
from .trace import Event, Trace, make_trace


class FromRunError(ValueError):
    """A run folder the replay cannot be built from; the message names the file and field."""


@dataclass
class RunReplay:
    problem: Problem
    plan: Plan
    spec: object                   # the loop's JobSpec, built from the model
    settings: object               # AdaptiveSettings of the run
    trace: Trace
    step_s: float
    compute_share: float
    costs: MigrationCost
    planner_stall: float           # how much longer a step ran while the planner searched
    host: object                   # SharedHost: the ranks' shared cores (None: no wait_s)
    planning_s: dict               # median seconds of the run's re-plans: "healthy" (every rank
                                   # healthy: no search) and "search" (the others)
    phases: list[dict]             # per phase of the schedule: its window and measured samples/s
    pieces: list                   # per phase and plan of the run: its steps, window and rates
    where: str = ""                # the trace's name in errors
    switch_steps: tuple = ()       # the run's steps that followed a switch


def _config(run: Path) -> dict:
    import yaml

    p = run / ".hydra" / "config.yaml"
    if not p.is_file():
        raise FromRunError(f"{run}: no .hydra/config.yaml (a run folder of launch/train.py "
                           f"holds one)")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise FromRunError(f"{p}: not YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise FromRunError(f"{p}: not a mapping")
    if cfg.get("engine") != "malleus":
        raise FromRunError(f"{p}: engine={cfg.get('engine')!r}; --from-run replays an "
                           f"engine=malleus run (its adaptive loop is what is predicted)")
    return cfg


def build(run_dir: str | Path) -> RunReplay:
    from ..adaptive.job import JobSpec
    from ..adaptive.replan import job_memory, job_problem
    from ..adaptive.settings import AdaptiveSettings
    from ..job_layout import JobLayout
    from ..models.base import head_layer_units, param_table
    from ..models.llama import model_config
    from ..plan import static_plan
    from ..problem import ideal_slowdown
    from ..report.metrics import MetricsError, read_run
    from ..report.run_model import emulated_condition, stretches, throughput

    run = Path(run_dir)
    cfg = _config(run)
    try:
        steps, events = read_run(run)
    except MetricsError as e:
        raise FromRunError(str(e)) from None
    if not steps:
        raise FromRunError(f"{run}/metrics.jsonl: no step lines")
    world = max(len(s.get("compute_s") or ()) for s in steps)
    if world < 2:
        raise FromRunError(f"{run}/metrics.jsonl: compute_s names {world} rank(s); a replay "
                           f"needs a run of at least 2")
    m, tr, par = cfg.get("model") or {}, cfg.get("train") or {}, cfg.get("parallel") or {}
    try:
        mc = model_config(m.get("name", "tiny"), **{k: m.get(k) for k in (
            "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "max_seq_len",
            "vocab_size")})
    except (ValueError, TypeError) as e:
        raise FromRunError(f"{run}: model: {e}") from None
    if cfg.get("plan", "static") != "static":
        raise FromRunError(f"{run}: plan={cfg.get('plan')!r}: --from-run replays runs that "
                           f"start on plan=static")
    tp, pp = int(par.get("tp") or 1), int(par.get("pp") or 1)
    if world % (tp * pp):
        raise FromRunError(f"{run}: parallel.tp={tp} x pp={pp} does not divide {world} ranks")
    G, B = int(tr["global_batch_size"]), int(tr["micro_batch_size"])
    plan = static_plan(mc.num_layers, G, B, tp, pp, world // (tp * pp))
    nodes = int((cfg.get("cluster") or {}).get("nodes") or 1)
    job = JobLayout(world, world // nodes, tp)
    seq = int((cfg.get("data") or {}).get("seq_len") or mc.max_seq_len)
    table = param_table(mc)
    head = head_layer_units(table, seq, mc.hidden_size)
    mem = job_memory(table, mc, B, seq, False, None, "cpu", world // nodes,
                     float((cfg.get("malleus") or {}).get("migrate_bucket_mb", 256)))
    problem = job_problem(plan, job, ideal_slowdown(tp), mem, head)
    spec = JobSpec.of_model(mc, plan, world=world, job=job, seq_len=seq)
    settings = AdaptiveSettings.from_config(cfg.get("malleus") or {}, where="malleus")

    warm = int(tr.get("warmup_steps", 0) or 0)
    steps = [s for s in steps if int(s["step"]) >= warm]
    mig = {}
    for e in events:
        if e.get("event") == "migrate":
            mig[int(e["step"])] = mig.get(int(e["step"]), 0.0) + float(e.get("seconds", 0.0))
    # the run's clock: each step starts after the previous ones and the migrations before it
    t, starts = 0.0, []
    for s in steps:
        t += mig.get(int(s["step"]), 0.0)
        starts.append(t)
        t += float(s["step_time_s"])
    horizon = t
    conds = [emulated_condition(s) for s in steps]
    phases: list[dict] = []
    pieces: list[Piece] = []
    for k, ph in enumerate(stretches(conds)):
        end = starts[ph.hi] if ph.hi < len(steps) else horizon
        # the phase on each plan the run ran it on: a rank's real slowdown depends on its share
        for st in stretches([s.get("plan") for s in steps[ph.lo:ph.hi]]):
            a, b = ph.lo + st.lo, ph.lo + st.hi
            got = _realized(steps[a:b], settings.detect.window)
            pieces.append(Piece(k, st.key, tuple(steps[a:b]), starts[a],
                                starts[b] if b < len(steps) else horizon,
                                {g: got.get(g, r) for g, r in ph.key}))
        first, last = int(steps[ph.lo]["step"]), int(steps[ph.hi - 1]["step"])
        # a migration before the phase's first step ran before its window began
        tput = throughput(steps[ph.lo:ph.hi], events, lo=first + 1, hi=last)
        phases.append({"steps": [first, last], "condition": {str(g): r for g, r in ph.key},
                       "start_s": starts[ph.lo], "end_s": end,
                       "measured_samples_per_s": tput.samples_per_s})
    plan0 = steps[0].get("plan")
    first_slow = next((i for i, c in enumerate(conds) if c), len(steps))
    healthy = [s for s in steps[:first_slow] if s.get("plan") == plan0] or \
        [s for s, c in zip(steps, conds) if not c and s.get("plan") == plan0]
    if len(healthy) < 2:
        raise FromRunError(f"{run}/metrics.jsonl: fewer than 2 healthy steps on the first plan "
                           f"after warm-up (train.warmup_steps={warm}): no healthy step time")
    step_s = statistics.mean(float(s["step_time_s"]) for s in healthy)   # as throughput counts
    busiest = statistics.mean(max(s["compute_s"]) for s in healthy)
    share = min(1.0, busiest / step_s)
    costs = _switch_costs(steps, events)
    plans: dict[str, list[float]] = {"healthy": [], "search": []}
    for e in events:
        if e.get("event") == "replan" and e.get("planning_s") is not None:
            plans["healthy" if _healthy(e) else "search"].append(float(e["planning_s"]))
    rr = RunReplay(problem, plan, spec, settings, None, step_s, share, costs,
                   _planner_stall(steps, events),
                   SharedHost.calibrate(healthy, world // nodes, step_s, busiest),
                   {k: statistics.median(v) for k, v in plans.items() if v}, phases, pieces,
                   f"{run} schedule", tuple(sorted(mig)))
    rr.trace = _trace(rr)
    return rr


@dataclass
class Piece:
    """A phase of the schedule on one plan of the run: its step lines, its window on the run's
    clock, and each slowed rank's rate there (the schedule's, refined from the run)."""

    phase: int
    plan: str | None
    steps: tuple
    start_s: float
    end_s: float
    rates: dict


def _trace(rr: "RunReplay") -> Trace:
    """The trace of the pieces' rates (one event per rank while its rate stays)."""
    rows: list[Event] = []
    for pc in rr.pieces:
        a, b = round(pc.start_s, 6), round(pc.end_s, 6)
        for g, r in pc.rates.items():
            if rows and (rows[-1].gpu, rows[-1].rate, rows[-1].end_s) == (g, r, a):
                rows[-1] = Event(rows[-1].start_s, b, g, r)
            else:
                rows.append(Event(a, b, g, r))
    end = max((pc.end_s for pc in rr.pieces), default=0.0)
    return make_trace(rows, rr.problem.num_gpus, hours=end / 3600.0 + 1e-9, where=rr.where)


def _refine(rr: "RunReplay", units: dict, unit_s: float) -> bool:
    """Each piece whose plan the replay ran (``units``: that plan's cost units per rank, by
    plan id) gets each slowed rank's rate from the run's own compute: per step, its
    ``compute_s`` per unit over that of the step's healthy working ranks (else ``unit_s``, the
    healthy steps' per-unit seconds, ``Replay.scale``), the median over the piece's steps that held no probe (a probe's
    seconds ride in its step's ``compute_s``) and did not follow a switch. True if a rate
    changed."""
    import numpy as np

    every = rr.settings.detect.probe_every
    switched = {int(e) for e in rr.switch_steps}
    changed = False
    for pc in rr.pieces:
        u = units.get(pc.plan)
        if u is None:
            continue
        u = np.asarray(u, dtype=np.float64)
        slow = np.zeros(u.size, dtype=bool)
        slow[list(pc.rates)] = True
        reads: dict[int, list[float]] = {g: [] for g in pc.rates}
        for s in pc.steps:
            k = int(s["step"])
            if k % every == 0 or k in switched:
                continue
            c = np.asarray(s.get("compute_s") or (), dtype=np.float64)
            if c.shape != u.shape:
                continue
            ok = (u > 0) & ~slow & (c > 0)
            ref = float(np.median(c[ok] / u[ok])) if ok.any() else unit_s
            for g in pc.rates:
                if u[g] > 0 and c[g] > 0 and ref > 0:
                    reads[g].append(c[g] / u[g] / ref)
        for g, xs in reads.items():
            if xs:
                r = round(max(1.0, statistics.median(xs)), 3)
                changed |= r != pc.rates[g]
                pc.rates[g] = r
    return changed


def _healthy(replan: dict) -> bool:
    """Was this re-plan asked with every rank healthy (the planner answers without a search)?"""
    return all(r is not None and r <= 1.0 for r in replan.get("measured_rates") or [None])


def _realized(steps, window: int) -> dict[int, float]:
    """Per rank, the slowdown it really ran at over ``steps`` (a phase of the schedule on one
    plan): the median of the loop's measured rates once its window holds only these steps (in
    fewer steps than the window: the last one's). On CPU an emulated straggler runs slower than
    its schedule says (its compute, between its sleeps, finds its caches cold: rank 1 scheduled
    at 3 measured 3.2-3.7 in the demo, more on a light share), and the trace is what the job ran
    through. Ranks never read: absent (their scheduled rate holds)."""
    out: dict[int, float] = {}
    rows = [s.get("measured_rates") for s in steps[min(window, len(steps) - 1):]]
    for g in range(max((len(r) for r in rows if r), default=0)):
        xs = [float(r[g]) for r in rows if r and g < len(r) and r[g] is not None]
        if xs:
            out[g] = max(1.0, statistics.median(xs))
    return out


def _planner_stall(steps, events) -> float:
    """How much longer a step ran while the planner searched on the ranks' host (a CPU run:
    the search takes a core): the median, over the steps from each searching re-plan's
    detection to its answer, of the step time over the median of the steps of the same plan
    and straggler condition that ran with no search in flight (nor first after a switch),
    less one; 0 when no such pair exists."""
    from ..report.run_model import emulated_condition

    busy: set[int] = set()
    for e in events:
        if e.get("event") == "replan" and e.get("detected") is not None and not _healthy(e):
            busy.update(range(int(e["detected"]), int(e["step"])))
    first = {int(e["step"]) for e in events if e.get("event") == "migrate"}

    def key(s):
        return s.get("plan"), emulated_condition(s)

    calm: dict = {}
    for s in steps:
        k = int(s["step"])
        if k not in busy and k not in first:
            calm.setdefault(key(s), []).append(float(s["step_time_s"]))
    ratios = [float(s["step_time_s"]) / statistics.median(calm[key(s)]) for s in steps
              if int(s["step"]) in busy and int(s["step"]) not in first
              and len(calm.get(key(s), ())) >= 2]
    return max(0.0, statistics.median(ratios) - 1.0) if ratios else 0.0


def _switch_costs(steps, events) -> MigrationCost:
    """A fixed part and a bandwidth fitted to the run's ``migrate`` events (least squares over
    their sizes; a single size: its seconds as the fixed part), and the warm-up: the first step
    after a switch over the median of the next five, less one (median over switches)."""
    from ..adaptive.replan import fit_switch_seconds

    ms = [(float(e.get("bytes", 0)), float(e.get("seconds", 0.0))) for e in events
          if e.get("event") == "migrate"]
    fixed, gbps = 0.0, 1e3
    fit = fit_switch_seconds(ms)
    if fit is not None:
        fixed, gbps = fit[0], 1.0 / fit[1] / 1e9
    elif ms:
        fixed = statistics.median(t for _, t in ms)
    by_step = {int(s["step"]): float(s["step_time_s"]) for s in steps}
    warm = []
    for e in events:
        if e.get("event") == "migrate":
            k = int(e["step"])
            nxt = [by_step[i] for i in range(k + 1, k + 6) if i in by_step]
            if k in by_step and len(nxt) >= 3:
                warm.append(max(0.0, by_step[k] / statistics.median(nxt) - 1.0))
    return MigrationCost(network_gbps=gbps, nvlink_gbps=gbps, communicators_s=fixed,
                         warmup_steps=statistics.median(warm) if warm else 0.0)


def _charge(planning: dict):
    """Seconds charged per request: the run's own median for its kind (every rank healthy: the
    planner answers without a search), else the planner's wall time here."""
    from .loop import is_search

    def charge(wall: float, req: dict) -> float:
        return planning.get("search" if is_search(req) else "healthy", wall)
    return charge


def compare(rr: RunReplay) -> dict:
    """Replay the run's own loop over its schedule; per phase, predicted against measured
    samples/s. A first replay learns the plans the loop runs; where the run ran the same plans,
    the trace takes each slowed rank's rate from the run's own compute on them
    (:func:`_refine`, in place: ``rr.pieces`` and ``rr.trace`` keep the refined rates) and the
    loop is replayed again."""
    from .loop import run_malleus
    from .run import Replay

    rp = Replay(rr.problem, rr.step_s, compute_share=rr.compute_share)

    def replay():
        return run_malleus(rp, rr.trace.segments(), rr.settings, rr.costs,
                           charge=_charge(rr.planning_s), spec=rr.spec, plan=rr.plan,
                           planner_stall=rr.planner_stall, host=rr.host)
    res = replay()
    if _refine(rr, res.units, rp.scale):
        rr.trace = _trace(rr)
        res = replay()
    out = []
    for ph in rr.phases:
        a, b = ph["start_s"], ph["end_s"]
        samples = sum(sps * (min(e, b) - max(s, a)) for s, e, sps in res.timeline
                      if e > a and s < b)
        pred = samples / (b - a) if b > a else 0.0
        meas = ph["measured_samples_per_s"]
        ph = dict(ph, realized=[{str(g): r for g, r in pc.rates.items()} for pc in rr.pieces
                                 if pc.phase == len(out)])
        out.append(dict(ph, predicted_samples_per_s=round(pred, 4),
                        measured_samples_per_s=round(meas, 4),
                        error=round(pred / meas - 1.0, 4) if meas > 0 else None))
    return {"step_s": round(rr.step_s, 5), "compute_share": round(rr.compute_share, 4),
            "switch_costs": vars(rr.costs), "planning_s": rr.planning_s,
            "planner_stall": round(rr.planner_stall, 4),
            "host": None if rr.host is None else {"cores": round(rr.host.cores, 3),
                                                   "other_s": round(rr.host.other_s, 5),
                                                   "ranks_per_host": rr.host.ranks_per_host},
            "switches": res.switches, "phases": out,
            "worst_error": max((abs(p["error"]) for p in out if p["error"] is not None),
                               default=None)}


def table(res: dict) -> str:
    """Per phase of the run's schedule: measured and predicted samples/s and the error."""
    h = res.get("host")
    where = (f"{h['ranks_per_host']} ranks sharing {h['cores']:.3g} cores (the planner's "
             f"search and the probes take cores too)" if h else
             f"steps {res['planner_stall']:.0%} longer while the planner searched")
    lines = [f"healthy step {res['step_s']:.4g} s, compute {res['compute_share']:.0%} of it; "
             f"{where}; planning charged {res['planning_s']}; switches {res['switches']}",
             f"{'steps':>9}  {'straggler':<18}{'measured':>10}{'predicted':>11}{'error':>8}"]
    for p in res["phases"]:
        cond = ", ".join(f"rank {g} x{r:g}" for g, r in p["condition"].items()) or "healthy"
        err = "" if p["error"] is None else f"{p['error']:+.1%}"
        lines.append(f"{p['steps'][0]:>4}-{p['steps'][1]:<4}  {cond:<18}"
                     f"{p['measured_samples_per_s']:>10.4g}{p['predicted_samples_per_s']:>11.4g}"
                     f"{err:>8}")
    if res["worst_error"] is not None:
        lines.append(f"worst error {res['worst_error']:.1%} (samples/s per phase; the target is "
                     f"15%)")
    return "\n".join(lines)
