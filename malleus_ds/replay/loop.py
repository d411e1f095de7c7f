"""The ``malleus`` policy of a replay: the real adaptive loop, stepped on a simulated clock.

Nothing of the loop is re-implemented here. One rank-0 :class:`~malleus_ds.adaptive.control.
Controller` is built from the problem alone (``replay/job.py``) with the loop's settings, and
driven through the hooks an engine calls each step (``steploop.py``), as the engine-less
tests drive it (``tests/unit/adaptive/test_loop_synthetic.py``):

* **Timings.** Each step, every rank's compute seconds are its cost units under the running
  plan (``adaptive/work.cost_units``) x its true rate at that moment x the replay's seconds per
  unit (``Replay.scale``); the step takes the plan's step time under the true rates
  (``Replay.step_seconds``). A rank without work, the calibrating rank and a held rank whose
  compute leaves it slack (``probe.light``) probe every ``detect.probe_every`` steps, right
  after the step's all-reduce, reading :data:`PROBE_S` x their true rate at that moment, in
  the next step's reduce (as ``Controller.after_reduce``): suspended GPUs follow the trace too.
  On a CPU run's shared host (``from_run.py``, ``host.py``) a step's seconds are the host's:
  its cores shared by the ranks' compute (span by span, on the plan's 1F1B schedule), the
  probes (the calibrating rank's before its compute) and the planner's search (runs without
  ``wait_s``: steps stretch by ``planner_stall`` while it searches). A recorded run's replay
  (``record``) reads what the run's loop read where it runs the run's plan: its
  ``compute_s``, less the probes that ride in it (a probe timed after a step is in its step
  line, not in what the loop read).
* **Planning.** The loop's planner is :class:`SimPlanner`: the real planner (the worker's own
  ``answer``, with its cache), run in this process when the loop asks; its answer reaches the
  loop once the simulated clock has passed the request's moment plus the planner's wall seconds
  on this machine (a slow plan arrives late, while the job trains on under the old plan).
* **Deciding** is the loop's own cost-aware rule, with the loop's own migration prediction.
* **Switching** pauses the job for the seconds ``costs.MigrationCost`` gives the real transfer
  plan of the switch; the loop is told the bytes and seconds, as the engine tells it.
* **A trace on the step clock.** A recorded run's straggler schedule is by step
  (``straggler.schedule``'s ``start_step``), and its phases are measured over steps; its replay
  (``from_run.py``) gives bounds as step indices (``on_steps``): the rates change at those
  steps' starts whatever the clock says then, and each step's end is kept
  (``LoopResult.step_ends``) to set the replay's samples/s over the same steps as the run's.
* **Fast-forward.** Once the loop has nothing in flight (``Controller.steady_key``) and a full
  period of identical steps changed nothing, whole periods up to the next change of the trace
  are skipped (``Controller.skip``): the same result as stepping them
  (``tests/unit/replay/test_loop.py``).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

from ..adaptive.control import Controller
from ..adaptive.probe import BUDGET, FIRST_BUDGET_S, HELD_LOAD
from ..adaptive.probe import budget as probe_budget
from ..adaptive.probing import probing_ranks
from ..adaptive.settings import AdaptiveSettings
from ..plan import Plan
from ..steploop import REF_RUNS, StepSums
from .costs import MigrationCost
from .host import SharedHost, plan_graph
from .job import problem_job
from .run import PolicyResult, Replay, rate_vector
from .trace import Segment

#: seconds of one run of the probe block on a healthy GPU (any value: probes read as ratios)
PROBE_S = 0.02
#: the wall of a sustained probe (``ProbeBlock.SUSTAIN_S + TIMED_S``; the first budget holds
#: two), within ``probe.BUDGET`` of a step: what it takes of a shared host's cores
PROBE_WALL_S = FIRST_BUDGET_S / 2
#: a probe that does not sustain (``ProbeBlock._can_be_capped``: not under the sleep emulation)
#: runs the block this many times (``ProbeBlock``: one untimed, ``REF_RUNS`` timed), each one
#: layer on one micro-batch: one cost unit of CPU, ``Replay.scale`` seconds
PROBE_RUNS = 1 + REF_RUNS
#: steps after a change of the plan or of the true rates before a fast-forward may start: the
#: work model's history (``RateEstimator.FIT_STEPS``) must hold only steps like the next ones
SETTLE = 48


@dataclass
class SimClock:
    """The replay's clock: seconds since the job started."""

    now: float = 0.0


class SimPlanner:
    """The loop's planner on the simulated clock (the interface of ``planner/client.py``).

    ``request`` runs the planner here and now (``planner/worker.answer``, through the worker's
    answer cache, as the training job's worker would) and holds the answer until the clock has
    passed the request's moment plus ``charge(wall seconds, request)``; ``charge`` defaults to
    the wall seconds themselves. The seconds charged per request are kept in :attr:`charged`."""

    def __init__(self, clock: SimClock, charge: Callable[[float, dict], float] | None = None,
                 cache=None) -> None:
        from ..planner.worker import AnswerCache

        self.clock = clock
        self.charge = charge or (lambda wall, req: wall)
        self.cache = cache if cache is not None else AnswerCache()
        # (ready at, answer, a search?, ready before this step: None, by the clock)
        self._held: list[tuple[float, dict, bool, int | None]] = []
        self.charged: list[float] = []          # seconds charged per request
        self.requested: list[float] = []        # the clock at each request
        self.step = 0                           # the step the loop is at (set by the loop)
        #: the step before which a request asked after ``step`` is answered, where a recorded
        #: run says so (``RunRecord.answered``); None: by the clock
        self.anchor: Callable[[int], int | None] = lambda step: None

    def request(self, req: dict) -> None:
        t0 = time.perf_counter()
        ans = self.cache.answer(req)
        s = float(self.charge(time.perf_counter() - t0, req))
        self.charged.append(s)
        self.requested.append(self.clock.now)
        self._held.append((self.clock.now + s, ans, is_search(req), self.anchor(self.step)))

    def searching(self) -> bool:
        """Is the planner searching at the clock's moment (a request in flight with a rank
        slower than healthy: a request with every rank healthy is answered without a search)?
        An answer taken before step ``at`` arrived during the step before it."""
        return any(search and (self.clock.now < t if at is None else self.step < at)
                   for t, _, search, at in self._held)

    def poll(self) -> dict | None:
        """The next answer, if it has arrived (polled as a step's all-reduce starts: an answer
        polled at step ``k`` is taken before step ``k + 1``)."""
        if self._held:
            t, ans, _, at = self._held[0]
            if (self.clock.now >= t if at is None else self.step >= at - 1):
                return self._held.pop(0)[1]
        return None

    def wait(self, timeout_s: float) -> dict:
        """A forced re-plan's answer (the loop waits for it; the replay forces none)."""
        if not self._held:
            return {"error": "no request in flight"}
        return self._held.pop(0)[1]

    def close(self) -> None:
        self._held.clear()


def is_search(req: dict) -> bool:
    """Does the planner search for this request (some rank slower than healthy)? One with every
    rank healthy is answered by the user's layout, without a search."""
    rates = (req.get("problem") or {}).get("rates") or {}
    return any(float(v) > 1.0 for v in rates.values())


@dataclass
class Switch:
    """One decision of the loop, for the per-event table."""

    t: float                     # simulated seconds at the switch (or the decision kept)
    step: int
    trigger: str
    adopted: bool
    from_plan: str
    to_plan: str
    planning_s: float
    migration_s: float
    bytes: int
    terms: dict = field(default_factory=dict)
    reason: str = ""
    requested_t: float | None = None     # the clock when the loop asked the planner


@dataclass
class LoopResult(PolicyResult):
    decisions: list[Switch] = field(default_factory=list)
    steps: int = 0
    stepped: int = 0             # steps run through the loop (the rest fast-forwarded)
    planning_s: float = 0.0      # planner seconds charged to the clock
    plans: dict = field(default_factory=dict)     # every plan it ran, by id
    units: dict = field(default_factory=dict)     # ...and its cost units per rank (the loop's)
    refs: dict = field(default_factory=dict)      # ...and the rank that calibrates its probes
    step_ends: list = field(default_factory=list)  # on the step clock: each step's end (s)


def _sums(ready: bool, comp: np.ndarray, probes: np.ndarray) -> StepSums:
    return StepSums(loss=0.0, overflow=False, ready=ready, compute_s=comp, probe_s=probes)


def run_malleus(rp: Replay, segs: Sequence[Segment], settings: AdaptiveSettings | None = None,
                costs: MigrationCost | None = None, zero_stage: int = 1,
                charge: Callable[[float, dict], float] | None = None, fast_forward: bool = True,
                progress=None, spec=None, plan: Plan | None = None,
                planner_stall: float = 0.0, host: SharedHost | None = None,
                on_steps: bool = False, record=None) -> LoopResult:
    """The loop over ``segs`` (module doc). ``charge``: (planner wall seconds, the request) ->
    seconds on the clock (None: as measured; a test fixes it to compare runs). ``spec``,
    ``plan``: the loop's job and first plan when known from a model (``from_run.py``; default:
    from the problem alone, ``job.py``, and its static plan). ``planner_stall``: how much longer
    a step takes while the planner searches (0.18: 18%), where the planner shares the ranks'
    cores (a CPU run, ``from_run.py``; 0 on a GPU cluster, whose planner uses a host core the
    GPUs do not need). ``host``: the ranks share a host's CPU cores (a CPU run with
    ``wait_s``, ``host.py``): each step's seconds are the shared host's, the sustained probes
    and the planner's search taking cores too (``planner_stall`` is then not used); steps are
    not fast-forwarded (their seconds vary with the probes). ``on_steps``: the segments' bounds
    are step indices (module doc); the replay runs to the last one's end step.
    ``record``: what a recorded run's loop read (``run_trace.RunRecord``, ``from_run.py``):
    at a step the replay runs on the run's plan, its loop reads the run's ``compute_s``
    (``record.compute_s(step, plan_id)``; where the run recorded its probes, the probers' and
    the calibrating rank's less their probe's seconds, which ride in it), and where the run
    recorded its probes
    (``record.probes(step, plan_id)``), the held ranks that probed after that step are the
    ones that probed in the run, and each idle or held rank that probes reads what the run's
    probe read, against the reference probe, instead of its rate in the trace: a probe's
    reading is not its rank's compute rate (a 6x straggler's probe read 4.4 once). There too
    its pace check reads the run's step seconds (``record.step_s``; the replay's clock keeps
    its own), and an answer to a re-plan the run asked at the same step is taken before the
    step the run took it at (``record.answered``; elsewhere the clock decides)."""
    if not planner_stall >= 0.0:
        raise ValueError(f"planner_stall={planner_stall!r} must be >= 0")
    settings = settings or AdaptiveSettings()
    costs = costs or MigrationCost()
    fast_forward = fast_forward and host is None     # a shared host's steps vary with probes
    pr, N = rp.problem, rp.problem.num_gpus
    plan = plan or rp.static
    clock = SimClock()
    planner = SimPlanner(clock, charge)
    spec = spec or problem_job(pr, plan, zero_stage)
    ctl = Controller(spec, settings, plan, prober=None, tp_measured=dict(pr.tp_slowdown),
                     planner=planner)
    out = LoopResult("malleus")
    out.plans[plan.id] = plan
    out.units[plan.id] = units = ctl.units
    out.refs[plan.id] = ctl.probe_ref
    graph = plan_graph(plan, N)              # each rank's compute spans (a shared host's)
    horizon = segs[-1].end_s if segs else 0.0     # seconds, or steps on the step clock
    gbs = rp.samples_per_step
    every = settings.detect.probe_every
    period = ctl.period()
    si = 0                                   # the segment the clock is in
    rate = np.ones(N)
    rate_seg = -1
    steps_cache: dict[tuple, float] = {}
    key_at: tuple[int, tuple | None] | None = None
    since_change = 0
    stretch_t0, stretch_samples = 0.0, 0.0
    step = 0
    timed = np.full(N, np.nan)               # the probes timed after the last step's reduce
    own: deque = deque(maxlen=ctl.compute_times.maxlen)   # each rank's compute_times
    sustained = np.zeros(N, dtype=bool)      # ...of them, the sustained probes (idle, held)
    calib = -1                               # ...and the calibrating rank's (-1: none)
    if record is not None:             # the run's answers arrived when they did
        planner.anchor = lambda k: record.answered(k, plan.id)
    try:
        while (step if on_steps else clock.now) < horizon:
            planner.step = step
            # -- at the step boundary: decisions ready now (the engine's before_step) -----------
            for dec in ctl.before_step(step):
                pj = dec.plan
                d = Switch(clock.now, step, dec.trigger, pj is not None,
                           dec.from_plan or plan.id, dec.to_plan or plan.id,
                           planner.charged[-1] if planner.charged else 0.0, 0.0,
                           dec.bytes, reason=dec.reason,
                           requested_t=planner.requested[-1] if planner.requested else None)
                if pj is not None:
                    new = Plan.from_json(pj)
                    first = rp.step_seconds(new, segs[si].rate_map())
                    mig = costs.of_switch(spec, plan, new, first)
                    d.migration_s, d.bytes, d.terms = mig.seconds, mig.bytes, mig.terms
                    d.to_plan = new.id
                    _close_stretch(out, stretch_t0, clock.now, stretch_samples)
                    clock.now += mig.seconds                               # the job waits
                    if not on_steps:
                        clock.now = min(horizon, clock.now)
                    out.timeline.append((d.t, clock.now, 0.0))
                    stretch_t0, stretch_samples = clock.now, 0.0
                    out.switches += 1
                    out.migration_s += mig.seconds
                    ctl.switched(new, dec.made_for,
                                 migration=SimpleNamespace(bytes=mig.bytes, seconds=mig.seconds))
                    plan = new
                    own.clear()
                    out.plans[plan.id] = plan
                    out.units[plan.id] = units = ctl.units
                    out.refs[plan.id] = ctl.probe_ref
                    graph = plan_graph(plan, N)
                    since_change = 0
                else:
                    ctl.considered(dec.measured)
                out.decisions.append(d)
            here = step if on_steps else clock.now
            if here >= horizon:
                break
            # -- the true rates now -------------------------------------------------------------
            while si + 1 < len(segs) and here >= segs[si].end_s:
                si += 1
            if si != rate_seg:
                if rate_seg >= 0:
                    _close_stretch(out, stretch_t0, clock.now, stretch_samples)
                    stretch_t0, stretch_samples = clock.now, 0.0
                rate = rate_vector(segs[si], N)
                rate_seg, since_change = si, 0
                if progress is not None:
                    progress(1)
            searching = planner.searching()
            if host is not None:             # a probe's share of the shared cores
                probe_wall = (round(min(PROBE_WALL_S, BUDGET * float(np.median(ctl.step_times)))
                                    if ctl.step_times else PROBE_WALL_S, 4)
                              if host.probes_sustain else PROBE_RUNS * rp.scale)

            def seconds(seg: Segment) -> float:
                """This step of the running plan, had it run wholly in ``seg``."""
                if host is None:
                    key = (plan.id, seg.start_s)
                    if key not in steps_cache:
                        steps_cache[key] = rp.step_seconds(plan, seg.rate_map())
                    return steps_cache[key]
                key = (plan.id, seg.start_s, searching, sustained.tobytes(), probe_wall, calib)
                if key not in steps_cache:
                    lead = np.zeros(N)
                    if calib >= 0:           # it probes before its compute: a run a unit
                        lead[calib] = REF_RUNS * rp.scale
                    steps_cache[key] = host.step_seconds(
                        units * rp.scale, rate_vector(seg, N), sustained, probe_wall,
                        searching, graph=graph, lead=lead)
                return steps_cache[key]
            step_s = seconds(segs[si])
            # -- fast-forward a steady stretch -------------------------------------------------
            if fast_forward and since_change >= SETTLE and step % period == 0:
                key = ctl.steady_key()
                if key is not None and key_at is not None and key_at == (step - period, key):
                    room = (int(segs[si].end_s) - step if on_steps else
                            int((segs[si].end_s - clock.now) / step_s)) - 1
                    n = (room // period) * period
                    if n > 0:
                        ctl.skip(n)
                        if on_steps:
                            out.step_ends += [clock.now + (i + 1) * step_s for i in range(n)]
                        clock.now += n * step_s
                        stretch_samples += n * gbs
                        out.steps += n
                        step += n
                        since_change += n
                        key_at = (step, key)
                        continue
                key_at = (step, key) if key is not None else None
            # -- one step through the loop's hooks ----------------------------------------------
            eff, before, at_end = rate, 1.0, rate
            if not on_steps and clock.now + step_s > segs[si].end_s and si + 1 < len(segs):
                step_s, eff, before, at_end = _crossing(seconds, segs, si, clock.now, N)
            if planner_stall and searching and host is None:
                step_s *= 1.0 + planner_stall
            comp = units * eff * rp.scale
            reads = (record.probes(step, plan.id)
                     if record is not None and step % every == 0 else None)
            ran = record.compute_s(step, plan.id) if record is not None else None
            if ran is not None:              # what the run's loop read here: its compute_s,
                ran = _less_probes(             # less the probes timed after the step (theirs
                    np.array(ran, dtype=np.float64), reads, ctl.probe_ref,   # ride in it)
                    rp.scale * rate, ctl.step_times, own)
                comp = ran
            # a probe is timed right after a step's all-reduce and its reading rides in the
            # next step's (Controller.after_reduce): the rate at that moment, read a step later
            probes, timed = timed, np.full(N, np.nan)
            own.append(comp)
            who = probing_ranks(step, every, units, ctl.held, ctl.probe_ref,
                                _light(ctl, own, reads, N) if step % every == 0 else
                                np.zeros(N, dtype=bool))
            calib = ctl.probe_ref if who.any() and ctl.probe_ref is not None else -1
            sustained = who.copy()             # the calibrating rank's probe is short
            if calib >= 0:
                sustained[calib] = False
            timed[who] = PROBE_S * at_end[who]
            for g, r in (reads or {}).items():
                if who[g] and calib >= 0 and g != calib:
                    timed[g] = PROBE_S * r * at_end[calib]
            frac = 1.0 if on_steps else min(1.0, (horizon - clock.now) / step_s)
            clock.now += step_s              # the all-reduce ends the step: hooks run then
            if on_steps:
                out.step_ends.append(clock.now)
            if before < 1.0:                 # its work before the change counts before it
                stretch_samples += gbs * before
                _close_stretch(out, stretch_t0, segs[si].end_s, stretch_samples)
                stretch_t0, stretch_samples = segs[si].end_s, gbs * max(0.0, frac - before)
            else:
                stretch_samples += gbs * frac
            ready, _ = ctl.contribute(float(comp[0]), 0.0)
            ctl.observe(step, _sums(ready, comp, probes))
            read_s = record.step_s(step, plan.id) if record is not None else None
            ctl.step_done(step_s if read_s is None else read_s)
            out.steps += 1
            out.stepped += 1
            step += 1
            since_change += 1
    finally:
        ctl.close()
    end = clock.now if on_steps else min(clock.now, horizon)
    _close_stretch(out, stretch_t0, end, stretch_samples)
    out.seconds = end if on_steps else horizon
    out.planning_s = sum(planner.charged)
    return out


def _light(ctl: Controller, own, reads: dict | None, n: int) -> np.ndarray:
    """Per rank: does its own compute leave it slack for a probe (``probe.light``, from each
    rank's compute this plan, ``own``)? Where a recorded run says which held ranks probed
    (``reads``), those."""
    if reads is not None:
        light = np.zeros(n, dtype=bool)
        light[list(reads)] = True
        return light
    if not ctl.step_times:
        return np.ones(n, dtype=bool)
    return np.median(own, axis=0) < HELD_LOAD * np.median(ctl.step_times)


def _less_probes(ran: np.ndarray, reads: dict | None, ref: int | None, unit_s: np.ndarray,
                 step_times, own) -> np.ndarray:
    """A run's ``compute_s`` of a step (``ran``) as its loop read it: less the seconds of the
    probes timed after the step, which its step line holds (``ComputeClock`` times the probe
    block's runs) and the loop did not (it read the compute before them). ``reads``: the
    ranks that probed and what their probes read (None: the run did not record its probes,
    nothing is known); ``ref``: the rank that calibrated them (its ``ProbeBlock.REF_RUNS``
    runs of the block, a cost unit each, ``unit_s`` per rank: the replay's seconds per unit at
    its rate); a held rank that probed ran the block, ``reading`` times the reference's
    seconds, as often as half its budget holds (``ProbeBlock.measure``: at least once, at most
    ``REF_RUNS``; ``probe.budget`` from the steps and its own compute so far, ``own``)."""
    if reads is None or ref is None:
        return ran
    block = float(unit_s[ref])
    cut = {ref: REF_RUNS * block}
    for g, r in reads.items():
        if g != ref and ran[g] > 0:
            mine = [float(c[g]) for c in own] if own else None
            half = probe_budget(step_times, mine) / 2
            cut[g] = min(REF_RUNS, max(1, int(half // max(r * block, 1e-12)))) * r * block
    for g, c in cut.items():
        ran[g] = max(0.5 * ran[g], ran[g] - c)
    return ran


def _crossing(seconds: Callable[[Segment], float], segs: Sequence[Segment], si: int, t: float,
              n: int) -> tuple[float, np.ndarray, float, np.ndarray]:
    """A step of ``plan`` from ``t`` that runs into the next segments: its seconds (its work
    done at each segment's pace in turn, as the fixed policies count a segment's share), each
    rank's time-weighted rate over it, the share of its work done before the first
    change (its samples there belong to the stretch before it), and the rates at its end."""
    left, k, acc, t0 = 1.0, si, np.zeros(n), t
    before = min(1.0, (segs[si].end_s - t) / seconds(segs[si]))
    while True:
        seg = segs[k]
        st = seconds(seg)
        room = seg.end_s - t
        if left * st <= room or k + 1 == len(segs):
            end = rate_vector(seg, n)
            acc += left * st * end
            t += left * st
            break
        acc += room * rate_vector(seg, n)
        left -= room / st
        t, k = seg.end_s, k + 1
    return t - t0, acc / (t - t0), before, end


def _close_stretch(out: LoopResult, t0: float, t1: float, samples: float) -> None:
    """A stretch of training with one plan under one rate vector: its samples and its place on
    the timeline."""
    out.samples += samples
    if t1 > t0:
        out.timeline.append((t0, t1, samples / (t1 - t0)))
