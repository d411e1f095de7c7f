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
  plan of the switch, with communicators only for rank sets the job does not hold (the
  engine's group cache and its lifetime rule, mirrored by ``migrate/group_sets.GroupMirror``); the
  loop is told the bytes and seconds, as the engine tells it.
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

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

from ..adaptive.control import Controller
from ..adaptive.probe import BUDGET, FIRST_BUDGET_S, HELD_LOAD
from ..adaptive.probe import budget as probe_budget
from ..adaptive.probing import probing_ranks
from ..adaptive.settings import AdaptiveSettings
from ..plan import Plan
from ..migrate.group_sets import GroupMirror
from ..steploop import REF_RUNS, ReplanDecision, StepSums
from .costs import MigrationCost
from .sim_planner import SimClock, SimPlanner
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
    first: bool = False                  # a re-split decided at once (not the planner's)


@dataclass
class LoopResult(PolicyResult):
    decisions: list[Switch] = field(default_factory=list)
    steps: int = 0
    stepped: int = 0             # steps run through the loop (the rest fast-forwarded)
    planning_s: float = 0.0      # planner seconds charged to the clock
    plans: dict = field(default_factory=dict)     # every plan it ran, by id
    units: dict = field(default_factory=dict)     # ...and its cost units per rank (the loop's)
    refs: dict = field(default_factory=dict)      # ...and the rank that calibrates its probes
    step_ends: list = field(default_factory=list)  # each step's end on the clock (s)


def _sums(ready: bool, comp: np.ndarray, probes: np.ndarray) -> StepSums:
    return StepSums(loss=0.0, overflow=False, ready=ready, compute_s=comp, probe_s=probes)


@dataclass(frozen=True)
class LoopOptions:
    """How :func:`run_malleus` replays the loop (its parameters, as one value)."""

    settings: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    costs: MigrationCost = field(default_factory=MigrationCost)
    zero_stage: int = 1
    #: (planner wall seconds, the request) -> seconds on the clock (None: as measured)
    charge: Callable[[float, dict], float] | None = None
    fast_forward: bool = True         # skip steady stretches (not on a shared host)
    progress: Callable[[int], None] | None = None
    spec: Any = None                 # the loop's job (None: from the problem, ``job.py``)
    plan: Plan | None = None         # the first plan (None: the problem's static plan)
    planner_stall: float = 0.0       # how much longer a step takes while the planner searches
    host: SharedHost | None = None   # the ranks share a host's CPU cores
    on_steps: bool = False           # the segments' bounds are step indices
    record: Any = None               # what a recorded run's loop read (``run_trace.RunRecord``)

    def __post_init__(self) -> None:
        if not self.planner_stall >= 0.0:
            raise ValueError(f"planner_stall={self.planner_stall!r} must be >= 0")


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
    recorded its probes (``record.probes(step, plan_id)``), the held ranks that probed after
    that step are the ones that probed in the run, and each idle or held rank that probes
    reads what the run's probe read, against the reference probe, instead of its rate in the
    trace: a probe's reading is not its rank's compute rate. There too its pace check reads
    the run's step seconds (``record.step_s``; the replay's clock keeps its own), and an
    answer to a re-plan the run asked at the same step is taken before the step the run took
    it at (``record.answered``; elsewhere the clock decides)."""
    opts = LoopOptions(settings or AdaptiveSettings(), costs or MigrationCost(), zero_stage,
                       charge, fast_forward and host is None, progress, spec, plan,
                       planner_stall, host, on_steps, record)
    return LoopReplay(rp, segs, opts).run()


class LoopReplay:
    """One replay of the loop over a trace (:func:`run_malleus`): the loop, its simulated
    planner and clock, and the replay's bookkeeping, stepped by :meth:`run`."""

    def __init__(self, rp: Replay, segs: Sequence[Segment], opts: LoopOptions) -> None:
        self.rp, self.segs, self.o = rp, segs, opts
        pr, self.n = rp.problem, rp.problem.num_gpus
        self.plan = opts.plan or rp.static
        self.clock = SimClock()
        self.planner = SimPlanner(self.clock, opts.charge)
        self.spec = opts.spec or problem_job(pr, self.plan, opts.zero_stage)
        self.ctl = Controller(self.spec, opts.settings, self.plan, prober=None,
                              tp_measured=dict(pr.tp_slowdown), planner=self.planner)
        self.out = LoopResult("malleus")
        self.groups = GroupMirror(self.plan, self.n)   # the process groups the job holds
        self.horizon = segs[-1].end_s if segs else 0.0    # seconds, or steps on the step clock
        self.every = opts.settings.detect.probe_every
        self.period = self.ctl.period()
        self.si, self.rate, self.rate_seg = 0, np.ones(self.n), -1   # the segment, its rates
        self.steps_cache: dict[tuple, float] = {}
        self.key_at: tuple[int, tuple | None] | None = None
        self.since_change = 0
        self.stretch_t0, self.stretch_samples = 0.0, 0.0
        self.step = 0
        self.timed = np.full(self.n, np.nan)     # the probes timed after the last step's reduce
        self.own: deque = deque(maxlen=self.ctl.compute_times.maxlen)   # each rank's compute
        self.sustained = np.zeros(self.n, dtype=bool)   # ...of them, the sustained probes
        self.calib = -1                          # ...and the calibrating rank's (-1: none)
        self.searching, self.probe_wall = False, 0.0
        self._ran_plan()
        if opts.record is not None:             # the run's answers arrived when they did
            self.planner.anchor = lambda k: opts.record.answered(k, self.plan.id)

    def run(self) -> LoopResult:
        """Step the loop to the trace's end; the result."""
        o, out = self.o, self.out
        try:
            while (self.step if o.on_steps else self.clock.now) < self.horizon:
                self.planner.step = self.step
                self._boundary()
                if (self.step if o.on_steps else self.clock.now) >= self.horizon:
                    break
                self._rates_now()
                step_s = self._seconds(self.segs[self.si])
                if o.fast_forward and o.host is None and self._fast_forward(step_s):
                    continue
                self._one_step(step_s)
        finally:
            self.ctl.close()
        end = self.clock.now if o.on_steps else min(self.clock.now, self.horizon)
        self._close_stretch(end)
        out.seconds = end if o.on_steps else self.horizon
        out.planning_s = sum(self.planner.charged)
        return out

    def _ran_plan(self) -> None:
        """The running plan's units and calibrating rank, kept in the result."""
        out = self.out
        out.plans[self.plan.id] = self.plan
        out.units[self.plan.id] = self.units = self.ctl.units
        out.refs[self.plan.id] = self.ctl.probe_ref
        self.graph = plan_graph(self.plan, self.n)   # each rank's compute spans (a shared host's)

    def _close_stretch(self, t1: float) -> None:
        _close_stretch(self.out, self.stretch_t0, t1, self.stretch_samples)
        self.stretch_t0, self.stretch_samples = t1, 0.0

    def _boundary(self) -> None:
        """At the step boundary: the decisions ready now (the engine's before_step)."""
        pl = self.planner
        for dec in self.ctl.before_step(self.step):
            d = Switch(self.clock.now, self.step, dec.trigger, dec.plan is not None,
                       dec.from_plan or self.plan.id, dec.to_plan or self.plan.id,
                       pl.charged[-1] if pl.charged and not dec.first else 0.0, 0.0,
                       dec.bytes, reason=dec.reason,
                       requested_t=pl.requested[-1] if pl.requested else None,
                       first=dec.first)
            if dec.plan is not None:
                self._switch(dec, d)
            else:
                self.ctl.considered(dec.measured)
            self.out.decisions.append(d)

    def _switch(self, dec: ReplanDecision, d: Switch) -> None:
        """Switch to ``dec``'s plan: the job waits for the migration's seconds."""
        new = Plan.from_json(dec.plan)
        first = self.rp.step_seconds(new, self.segs[self.si].rate_map())
        mig = self.o.costs.of_switch(self.spec, self.plan, new, first, held=self.groups.live)
        self.groups.switch(new)
        d.migration_s, d.bytes, d.terms = mig.seconds, mig.bytes, mig.terms
        d.to_plan = new.id
        self._close_stretch(self.clock.now)
        self.clock.now += mig.seconds                               # the job waits
        if not self.o.on_steps:
            self.clock.now = min(self.horizon, self.clock.now)
        self.out.timeline.append((d.t, self.clock.now, 0.0))
        self.stretch_t0 = self.clock.now
        self.out.switches += 1
        self.out.migration_s += mig.seconds
        self.ctl.switched(new, dec.made_for,
                          migration=SimpleNamespace(bytes=mig.bytes, seconds=mig.seconds))
        self.plan = new
        self.own.clear()
        self._ran_plan()
        self.since_change = 0

    def _rates_now(self) -> None:
        """The true rates now (the segment the clock is in), whether the planner searches, and
        on a shared host a probe's share of its cores."""
        here = self.step if self.o.on_steps else self.clock.now
        while self.si + 1 < len(self.segs) and here >= self.segs[self.si].end_s:
            self.si += 1
        if self.si != self.rate_seg:
            if self.rate_seg >= 0:
                self._close_stretch(self.clock.now)
            self.rate = rate_vector(self.segs[self.si], self.n)
            self.rate_seg, self.since_change = self.si, 0
            if self.o.progress is not None:
                self.o.progress(1)
        self.searching = self.planner.searching()
        host, st = self.o.host, self.ctl.step_times
        if host is not None:
            self.probe_wall = (round(min(PROBE_WALL_S, BUDGET * float(np.median(st)))
                                     if st else PROBE_WALL_S, 4)
                               if host.probes_sustain else PROBE_RUNS * self.rp.scale)

    def _seconds(self, seg: Segment) -> float:
        """This step of the running plan, had it run wholly in ``seg``."""
        host, cache = self.o.host, self.steps_cache
        if host is None:
            key = (self.plan.id, seg.start_s)
            if key not in cache:
                cache[key] = self.rp.step_seconds(self.plan, seg.rate_map())
            return cache[key]
        key = (self.plan.id, seg.start_s, self.searching, self.sustained.tobytes(),
               self.probe_wall, self.calib)
        if key not in cache:
            lead = np.zeros(self.n)
            if self.calib >= 0:           # it probes before its compute: a run a unit
                lead[self.calib] = REF_RUNS * self.rp.scale
            cache[key] = host.step_seconds(
                self.units * self.rp.scale, rate_vector(seg, self.n), self.sustained,
                self.probe_wall, self.searching, graph=self.graph, lead=lead)
        return cache[key]

    def _fast_forward(self, step_s: float) -> bool:
        """Skip whole periods of a steady stretch (``Controller.steady_key``); True if it did."""
        step, period = self.step, self.period
        if not (self.since_change >= SETTLE and step % period == 0):
            return False
        key = self.ctl.steady_key()
        if key is not None and self.key_at is not None and self.key_at == (step - period, key):
            end = self.segs[self.si].end_s
            room = (int(end) - step if self.o.on_steps else
                    int((end - self.clock.now) / step_s)) - 1
            due = self.ctl.steady_for_s()      # the loop's own clock changes something then
            if due is not None:
                room = min(room, int(due / step_s) - 1)
            n = (room // period) * period
            if n > 0:
                self.ctl.skip(n)
                self.out.step_ends += [self.clock.now + (i + 1) * step_s for i in range(n)]
                self.clock.now += n * step_s
                self.stretch_samples += n * self.rp.samples_per_step
                self.out.steps += n
                self.step += n
                self.since_change += n
                self.key_at = (self.step, key)
                return True
        self.key_at = (step, key) if key is not None else None
        return False

    def _one_step(self, step_s: float) -> None:
        """One step through the loop's hooks."""
        o, segs, si, ctl = self.o, self.segs, self.si, self.ctl
        eff, before, at_end = self.rate, 1.0, self.rate
        if not o.on_steps and self.clock.now + step_s > segs[si].end_s and si + 1 < len(segs):
            step_s, eff, before, at_end = _crossing(self._seconds, segs, si, self.clock.now,
                                                    self.n)
        if o.planner_stall and self.searching and o.host is None:
            step_s *= 1.0 + o.planner_stall
        comp, reads = self._compute(eff)
        # a probe is timed right after a step's all-reduce and its reading rides in the
        # next step's (Controller.after_reduce): the rate at that moment, read a step later
        probes, self.timed = self.timed, np.full(self.n, np.nan)
        self.own.append(comp)
        self._probe(reads, at_end)
        self._advance(step_s, before)
        ready, _ = ctl.contribute(float(comp[0]), 0.0)
        ctl.observe(self.step, _sums(ready, comp, probes))
        read_s = o.record.step_s(self.step, self.plan.id) if o.record is not None else None
        ctl.step_done(step_s if read_s is None else read_s)
        self.out.steps += 1
        self.out.stepped += 1
        self.step += 1
        self.since_change += 1

    def _compute(self, eff: np.ndarray) -> tuple[np.ndarray, dict | None]:
        """Each rank's compute seconds the loop reads this step, and a recorded run's probe
        readings after it (None: not recorded, or not a probe step)."""
        rec, step, pid = self.o.record, self.step, self.plan.id
        comp = self.units * eff * self.rp.scale
        reads = rec.probes(step, pid) if rec is not None and step % self.every == 0 else None
        ran = rec.compute_s(step, pid) if rec is not None else None
        if ran is not None:              # what the run's loop read here: its compute_s, less
            comp = _less_probes(         # the probes timed after the step (theirs ride in it)
                np.array(ran, dtype=np.float64), reads, self.ctl.probe_ref,
                self.rp.scale * self.rate, self.ctl.step_times, self.own)
        return comp, reads

    def _probe(self, reads: dict | None, at_end: np.ndarray) -> None:
        """The probes timed after this step (``probing.probing_ranks``): each at its rank's
        rate at the step's end, or what the recorded run's probe read."""
        ctl, n, step = self.ctl, self.n, self.step
        who = probing_ranks(step, self.every, self.units, ctl.held, ctl.probe_ref,
                            _light(ctl, self.own, reads, n) if step % self.every == 0 else
                            np.zeros(n, dtype=bool))
        self.calib = calib = ctl.probe_ref if who.any() and ctl.probe_ref is not None else -1
        self.sustained = who.copy()             # the calibrating rank's probe is short
        if calib >= 0:
            self.sustained[calib] = False
        self.timed[who] = PROBE_S * at_end[who]
        for g, r in (reads or {}).items():
            if who[g] and calib >= 0 and g != calib:
                self.timed[g] = PROBE_S * r * at_end[calib]

    def _advance(self, step_s: float, before: float) -> None:
        """The clock past the step, and its samples on each side of a change it crossed."""
        gbs, o = self.rp.samples_per_step, self.o
        frac = 1.0 if o.on_steps else min(1.0, (self.horizon - self.clock.now) / step_s)
        self.clock.now += step_s              # the all-reduce ends the step: hooks run then
        self.out.step_ends.append(self.clock.now)
        if before < 1.0:                 # its work before the change counts before it
            self.stretch_samples += gbs * before
            self._close_stretch(self.segs[self.si].end_s)
            self.stretch_samples = gbs * max(0.0, frac - before)
        else:
            self.stretch_samples += gbs * frac


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
