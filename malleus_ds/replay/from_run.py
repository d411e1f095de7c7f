"""``malleus-sim replay --from-run RUN_DIR``: the replay checked against a run it can predict.

From a recorded engine=malleus run (its ``.hydra/config.yaml`` and ``metrics.jsonl``) this builds
what a replay needs, each from the run's own files:

* **the job**: the model (our Llama presets, with the run's overrides), the batch, the layout
  the run started under (``plan=static``: ``parallel.*``), the world (the ranks the step lines
  name) and the memory the loop would estimate (``replan.job_memory``), as the loop builds its
  planning problem in training; the loop's settings (``malleus.*``);
* **the step time**: the median healthy step of its first plan, over the whole run (before its
  first straggler and after its recovery) less the start-up (``run_costs.steady``), and the
  share of it that is compute (the busiest rank's ``compute_s`` over those steps, as the
  what-if account reads it, ``report/whatif.py``): only that share slows with the rates;
* **the trace**: its emulated schedule on the step clock, as the run ran it (a straggler
  starts with the step ``straggler.schedule`` names, counted from the first step after warm-up,
  however long the replay's steps before it took; the replay steps from the run's first step,
  as its loop did: its window, its work model's fits and its detection cadence count the
  warm-up steps too), at the slowdown each rank really ran at:
  per stretch of a phase on one plan, the loop's own measured rate (``measured_rates``; an
  emulated CPU straggler runs slower than scheduled, more so on a light share), refined from its
  ``compute_s`` (``run_trace.py``);
* **the host**: where the step lines carry ``wait_s``, the ranks' shared CPU cores
  (``host.SharedHost.calibrate``): each step's seconds under fluid sharing of the cores by
  the ranks' compute, their probes (sustained, or a few runs of the block under the sleep
  emulation) and the planner's search, a rank slowed by sleeping wanting a whole core while it
  runs (``SharedHost.sleeps``); in older runs, how much longer the steps ran while the planner
  searched (``run_malleus(planner_stall=)``);
* **what its loop read** (``run_trace.RunRecord``): on the steps the replay runs on the run's
  plan, its loop reads the run's own ``compute_s`` and step seconds, the held ranks that probe
  are the ones that probed in the run, reading what their probes read, and a re-plan asked at
  the step the run asked it is answered before the step the run's answer was taken at (else a
  planner's seconds that end just inside the run's step and just past the replay's would move
  a switch by a step);
* **the switch costs**: a fixed part and a bandwidth fitted to its ``migrate`` events, the
  first step after a switch against the steps that follow (warm-up), and the planner's seconds
  its ``replan`` events took, each in its turn (``run_costs.py``).

:func:`compare` then replays the ``malleus`` policy and, per phase of the schedule, sets its
samples/s over the phase's steps against the run's over the same steps
(``run_model.throughput``: step times plus the migrations between them).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from ..plan import Plan
from ..problem import Problem
from .costs import MigrationCost
from .host import SharedHost
from .run_costs import charge, healthy_replan, planner_stall, steady, switch_costs
from .run_trace import Piece, RunRecord, probed, realized, refine, trace_of
from .trace import Trace


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
    planning_seq: dict             # seconds of each of the run's re-plans, in order, by kind:
                                   # "healthy" (every rank healthy: no search) and "search"
    phases: list[dict]             # per phase of the schedule: its steps (``lo``-``hi``: indices
                                   # from the run's first step), run-clock window and samples/s
    pieces: list                   # per phase and plan of the run: its steps, window and rates
    where: str = ""                # the trace's name in errors
    switch_steps: tuple = ()       # the run's steps that followed a switch
    record: object = None          # RunRecord: what the run's loop read, step by step

    @property
    def planning_s(self) -> dict:
        """The median seconds of the run's re-plans, by kind (of those it made)."""
        return {k: statistics.median(v) for k, v in self.planning_seq.items() if v}


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


def _method(cfg: dict) -> str:
    """How the run's straggler emulation slowed its ranks (``straggler.method``)."""
    return str((cfg.get("straggler") or {}).get("method") or "sleep")


def _batch(run: Path, cfg: dict, dp: int) -> tuple[int, int]:
    """The run's global and micro batch: ``train.*``, or where the run left them null, what the
    app took from its ds_config (``interop/batch.py``; ``deepspeed.config_file`` as given, or
    among the shipped ``conf/deepspeed`` presets, as launch/train.py looks it up, with
    ``deepspeed.config`` over it)."""
    from ..interop.batch import DEFAULT_BATCH, resolve_batch
    from ..interop.sections import load_config

    tr = cfg.get("train") or {}
    if tr.get("global_batch_size") is not None and tr.get("micro_batch_size") is not None:
        return int(tr["global_batch_size"]), int(tr["micro_batch_size"])
    sec = cfg.get("deepspeed") or {}
    ds: dict = {}
    try:
        f = sec.get("config_file")
        if f:
            conf = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"
            hit = next((c for c in (Path(f), conf / f) if c.is_file()), None)
            if hit is None:
                raise ValueError(f"deepspeed.config_file={f!r} not found (nor in {conf})")
            ds = load_config(hit)
        ds.update(sec.get("config") or {})
        G, B, _ = resolve_batch(ds, tr, dp, ValueError, DEFAULT_BATCH)
    except ValueError as e:
        raise FromRunError(f"{run}: the batch: {e}") from None
    return G, B


def _read_steps(run: Path) -> tuple[list[dict], list[dict], int]:
    """(step lines, event lines, world: the ranks the step lines' ``compute_s`` name)."""
    from ..report.metrics import MetricsError, read_run

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
    return steps, events, world


@dataclass(frozen=True)
class _Job:
    """The job as the run's loop planned it: its planning problem, the plan it started on, the
    loop's JobSpec and settings, and the GPUs per node."""

    problem: Problem
    plan: Plan
    spec: object
    settings: object
    gpus_per_node: int


def _build_job(run: Path, cfg: dict, world: int) -> _Job:
    """The model (a Llama preset with the run's overrides), the batch, the static layout the
    run started on, and the memory the loop would estimate, as the loop builds its planning
    problem in training."""
    from ..adaptive.job import JobSpec
    from ..adaptive.replan import job_memory, job_problem
    from ..adaptive.settings import AdaptiveSettings
    from ..interop.malleus_section import MIGRATE_BUCKET_MB
    from ..job_layout import JobLayout
    from ..models.base import head_layer_units, param_table
    from ..models.llama import model_config
    from ..plan import static_plan
    from ..problem import ideal_slowdown

    m, par = cfg.get("model") or {}, cfg.get("parallel") or {}
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
    G, B = _batch(run, cfg, world // (tp * pp))
    plan = static_plan(mc.num_layers, G, B, tp, pp, world // (tp * pp))
    nodes = int((cfg.get("cluster") or {}).get("nodes") or 1)
    job = JobLayout(world, world // nodes, tp)
    seq = int((cfg.get("data") or {}).get("seq_len") or mc.max_seq_len)
    table = param_table(mc)
    head = head_layer_units(table, seq, mc.hidden_size)
    mem = job_memory(table, mc, B, seq, False, None, "cpu", world // nodes,
                     float((cfg.get("malleus") or {}).get("migrate_bucket_mb",
                                                          MIGRATE_BUCKET_MB)))
    problem = job_problem(plan, job, ideal_slowdown(tp), mem, head)
    spec = JobSpec.of_model(mc, plan, world=world, job=job, seq_len=seq)
    settings = AdaptiveSettings.from_config(cfg.get("malleus") or {}, where="malleus")
    return _Job(problem, plan, spec, settings, world // nodes)


def _run_clock(steps: list[dict], events: list[dict]
               ) -> tuple[dict[int, float], list[float], float]:
    """The run's clock: (migration seconds by the step they preceded, each step's start, the
    end): each step starts after the previous ones and the migrations before it."""
    mig: dict[int, float] = {}
    for e in events:
        if e.get("event") == "migrate":
            mig[int(e["step"])] = mig.get(int(e["step"]), 0.0) + float(e.get("seconds", 0.0))
    t, starts = 0.0, []
    for s in steps:
        t += mig.get(int(s["step"]), 0.0)
        starts.append(t)
        t += float(s["step_time_s"])
    return mig, starts, t


def _phases_and_pieces(steps: list[dict], events: list[dict], conds: list, w0: int,
                       starts: list[float], horizon: float, window: int, probes: dict
                       ) -> tuple[list[dict], list[Piece]]:
    """Per phase of the emulated schedule after warm-up: its steps, run-clock window and
    samples/s; per phase and plan the run ran it on, its piece of the trace at the rates the
    ranks really ran at (a rank's real slowdown depends on its share)."""
    from ..report.run_model import stretches, throughput

    phases: list[dict] = []
    pieces: list[Piece] = []
    for k, ph in enumerate(stretches(conds[w0:])):
        ph = type(ph)(ph.key, ph.lo + w0, ph.hi + w0)
        end = starts[ph.hi] if ph.hi < len(steps) else horizon
        for st in stretches([s.get("plan") for s in steps[ph.lo:ph.hi]]):
            a, b = ph.lo + st.lo, ph.lo + st.hi
            got = realized(steps[a:b], window)
            pieces.append(Piece(k, st.key, tuple(steps[a:b]), a, b,
                                {g: got.get(g, r) for g, r in ph.key},
                                probes={i: probes[i] for i in range(a, b) if i in probes}))
        first, last = int(steps[ph.lo]["step"]), int(steps[ph.hi - 1]["step"])
        # a migration before the phase's first step ran before its window began
        tput = throughput(steps[ph.lo:ph.hi], events, lo=first + 1, hi=last)
        phases.append({"steps": [first, last], "lo": ph.lo, "hi": ph.hi,
                       "condition": {str(g): r for g, r in ph.key},
                       "start_s": starts[ph.lo], "end_s": end,
                       "measured_samples_per_s": tput.samples_per_s})
    return phases, pieces


def _planning_seq(events: list[dict]) -> dict[str, list[float]]:
    """The seconds of the run's re-plans, in order, by kind ("healthy" or "search")."""
    plans: dict[str, list[float]] = {"healthy": [], "search": []}
    for e in events:
        if e.get("event") == "replan" and e.get("planning_s") is not None:
            plans["healthy" if healthy_replan(e) else "search"].append(float(e["planning_s"]))
    return plans


def build(run_dir: str | Path) -> RunReplay:
    """What a replay of the run needs, each from the run's own files (the module docstring)."""
    from ..report.run_model import emulated_condition

    run = Path(run_dir)
    cfg = _config(run)
    steps, events, world = _read_steps(run)
    job = _build_job(run, cfg, world)
    # the loop saw the warm-up steps too (its first window, its fits, its cadence by step): the
    # replay steps through them from the run's first step; the phases start after them
    warm = int((cfg.get("train") or {}).get("warmup_steps", 0) or 0)
    w0 = next((i for i, s in enumerate(steps) if int(s["step"]) >= warm), len(steps))
    mig, starts, horizon = _run_clock(steps, events)
    conds = [emulated_condition(s) for s in steps]
    probes = probed(steps)
    phases, pieces = _phases_and_pieces(steps, events, conds, w0, starts, horizon,
                                        job.settings.detect.window, probes)
    healthy = steady(steps[w0:], conds[w0:], set(mig))
    if len(healthy) < 2:
        raise FromRunError(f"{run}/metrics.jsonl: fewer than 2 healthy steps on the first plan "
                           f"after warm-up (train.warmup_steps={warm}): no healthy step time")
    step_s = statistics.median(float(s["step_time_s"]) for s in healthy)
    busiest = statistics.median(max(s["compute_s"]) for s in healthy)
    share = min(1.0, busiest / step_s)
    costs = switch_costs(steps, events)
    rr = RunReplay(job.problem, job.plan, job.spec, job.settings, None, step_s, share, costs,
                   planner_stall(steps, events),
                   SharedHost.calibrate(healthy, job.gpus_per_node, step_s, busiest,
                                        sleeps=_method(cfg) == "sleep"),
                   _planning_seq(events), phases, pieces, f"{run} schedule", tuple(sorted(mig)),
                   RunRecord.of(steps, probes, _answers(steps, events)))
    rr.trace = trace_of(rr.pieces, job.problem.num_gpus, rr.where)
    return rr


def _answers(steps, events) -> dict[int, int]:
    """{the step index after which the run's loop asked for a re-plan: the index of the step
    before which it took the answer}, from its ``replan`` events (``detected``: the step after
    the request)."""
    at = {int(s["step"]): i for i, s in enumerate(steps)}
    out = {}
    for e in events:
        if e.get("event") == "replan" and e.get("detected") is not None:
            a, b = at.get(int(e["detected"])), at.get(int(e["step"]))
            if a is not None and b is not None and a >= 1:
                out[a - 1] = b
    return out


def compare(rr: RunReplay) -> dict:
    """Replay the run's own loop over its schedule; per phase, predicted against measured
    samples/s. A first replay learns the plans the loop runs; where the run ran the same plans,
    the trace takes each slowed rank's rate from the run's own compute on them
    (``run_trace.refine``, in place: ``rr.pieces`` and ``rr.trace`` keep the refined rates) and
    the loop is replayed again."""
    from .loop import run_malleus
    from .run import Replay

    rp = Replay(rr.problem, rr.step_s, compute_share=rr.compute_share)

    def replay():
        return run_malleus(rp, rr.trace.segments(), rr.settings, rr.costs,
                           charge=charge(rr.planning_s, rr.planning_seq), spec=rr.spec,
                           plan=rr.plan,
                           planner_stall=rr.planner_stall, host=rr.host, on_steps=True,
                           record=rr.record)
    res = replay()
    if refine(rr.pieces, res.units, rp.scale, rr.settings.detect.probe_every, rr.switch_steps,
              res.refs):
        rr.trace = trace_of(rr.pieces, rr.problem.num_gpus, rr.where)
        res = replay()
    out = []
    for ph in rr.phases:
        # the phase's steps on the replay's clock: from the end of the step before its first
        # (a switch before its first step is not in its window, as in the run's) to its last's
        a = res.step_ends[ph["lo"] - 1] if ph["lo"] > 0 else 0.0
        b = res.step_ends[ph["hi"] - 1]
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
