"""The adaptive loop (DESIGN.md §6): measure → detect → plan in the background → switch.

Data flows one way:

1. **Timings.** Every step, each rank's compute seconds (communication left out) and, on a
   suspended rank, a probe's seconds ride in the step's existing loss all-reduce: no extra
   collective, and every rank sees every rank's numbers.
2. **Rates** (``rates.RateEstimator``): per-unit compute time relative to the healthy
   reference, median-smoothed; identical on every rank.
3. **Detection** (``detect.Detector``), rank 0 only, every ``detect.every`` steps.
4. **Planning problem** of the running job (``replan.job_problem``) with the measured rates and
   ``current_plan`` = the running plan; the planner runs in its own process on rank 0
   (``planner/client.py`` talks to ``planner/worker.py``) while training continues on the old plan.
5. **Cost-aware decision** (``replan.decide``): adopt the new plan only if its predicted gain over
   ``horizon_steps`` exceeds the predicted migration time (bytes of the transfer plan ÷ the
   bandwidth measured by earlier migrations).
6. **Broadcast and switch** at the first step boundary after rank 0's result is ready: rank 0
   raises a flag in a step's all-reduce, every rank then joins one broadcast before the next
   step; the engine switches.

:class:`Controller` is the facade that implements the step hooks (``steploop.StepLoop``) and
holds what every rank measures; behind it, each in its own module: the running plan's work
(``work.RunningWork``), probing (``probing.py``: compute and link probes), rank 0's planner
session (``session.py``: requests, decisions, switch cost, scheduled re-plans) and the promise
and back-out (``promise.py``). Its settings: ``settings.py``. It reads no engine: it is built
from a :class:`~malleus_ds.adaptive.job.JobSpec` (plain values), the plan the job starts under,
a probe block to time (the engine's, ``engine/probe_block.py``, or none) and a broadcast (the
app passes torch.distributed's), and is driven through its step hooks, which the engine calls at
fixed points of ``train_batch`` once the app has attached it (``app/loop.py``). A test or a
simulator drives the same hooks with synthetic timings.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import numpy as np

from ..plan import Plan, same_stages
from ..problem import ideal_slowdown
from ..steploop import Prober, ReplanDecision, StepSums
from .detect import Detector
from .job import JobSpec
from .link_watch import Links, LinkWatch, watches_gpu_links
from .pace_check import PaceCheck
from .probing import Probing
from .promise import Promise
from .rates import RateEstimator, as_list
from .session import PlannerSession
from .settings import AdaptiveSettings
from .stragglers import StragglerWatch
from .work import RunningWork

#: rank 0's value to every rank, in place (``broadcast_object_list(obj, src=0)``)
Broadcast = Callable[[list], None]


class Controller:
    """One per rank: the step hooks (``steploop.StepLoop``), in step order: :meth:`contribute`
    (values for the step's all-reduce), :meth:`observe` (after it), :meth:`after_reduce` (the
    probe), :meth:`step_done` (wall time), :meth:`before_step` (collective, at the next step
    boundary: ready decisions and forced re-plans → plans to switch to), :meth:`switched` /
    :meth:`considered` (what became of them), :meth:`take_events`, :meth:`measured_rates`."""

    #: seconds a forced re-plan waits for the planner worker
    FORCED_TIMEOUT_S = PlannerSession.FORCED_TIMEOUT_S

    def __init__(self, job: JobSpec, settings: AdaptiveSettings, plan: Plan,
                 prober: Prober | None = None, tp_measured: dict[int, float] | None = None,
                 planner: Any = None, link_prober: Any = None,
                 broadcast: Broadcast | None = None) -> None:
        """``job``: the job, frozen at start; ``plan``: the plan it starts under; ``prober``: the
        block a rank times to stay measured without work (None: such a rank reads nothing);
        ``tp_measured``: the TP slowdown table measured at start-up (``engine/tp_cost.py``), if
        any; ``planner``: rank 0's planner (``request`` / ``poll`` / ``wait`` / ``close``, as
        :class:`~malleus_ds.planner.client.PlannerClient`; None: a planner process of its own,
        started when the loop may plan; a replay passes one on its simulated clock);
        ``link_prober``: what times round trips across a link (``exchange(a, b, mb, trips)``, as
        ``engine/link_probe.py``; None: a link held slow is not probed); ``broadcast``: rank
        0's decision to every rank (None: a single process drives the loop, rank 0's value
        stands)."""
        self.spec, self.s = job, settings
        self.job = job.job                # the job layout now (a switch may change TP sizes)
        self.plan = self.first_plan = plan   # the plan running now; the user's layout
        self.work = RunningWork(plan, job.world, job.job.tp, settings.tp_slowdown, tp_measured,
                                _head(job), job.recompute)
        self.est = RateEstimator(self.world, settings.detect.window)
        self.det = Detector(self.world, settings.detect) if self.rank == 0 else None
        #: rank 0: each straggler's onset and end, and how long the current one will last
        self.stragglers = (StragglerWatch(self.world, confirm=self.s.detect.confirm)
                           if self.rank == 0 else None)
        #: rank 0: the links' rates and their detection (``link_watch.py``)
        self.links = LinkWatch(job, settings.detect) if self.rank == 0 else None
        self.measured = np.full(self.world, np.nan)
        self.step_times: deque[float] = deque(maxlen=max(3, settings.detect.window))
        self.compute_times: deque[float] = deque(maxlen=max(3, settings.detect.window))
        self.ready = False                # every rank: rank 0 flagged a decision in an all-reduce
        self.skip_steps, self.seen = 1, 0  # steps to leave out; steps measured so far
        self.last_step = 0                # the step observe() saw last
        self.probing = Probing(self, prober, link_prober)
        self.session = PlannerSession(self, _planner(job, settings, planner),
                                      settings.replan_at, broadcast)
        self.promise = Promise(self)

    # -- what the components and the hooks read ------------------------------------------------

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world(self) -> int:
        return self.spec.world

    @property
    def units(self) -> np.ndarray:
        """Each rank's cost units under the running plan (0: no work)."""
        return self.work.units

    @property
    def held(self) -> np.ndarray:
        """The ranks working under a plan made for them as slow."""
        return self.work.held

    @property
    def probe_ref(self) -> int | None:
        """The rank that calibrates the probes (None: none needed or none can)."""
        return self.work.probe_ref

    @property
    def tp(self) -> int:
        return self.work.tp

    @property
    def slowdown(self) -> dict[int, float]:
        return self.work.slowdown

    @property
    def head(self) -> float:
        return self.work.head

    @property
    def forced(self) -> list[int]:
        """The steps a re-plan is forced before (``replan_at``, a carried re-plan)."""
        return self.session.forced

    @property
    def check(self) -> PaceCheck | None:
        """Rank 0: the running plan's promise against its measured steps (``pace_check.py``)."""
        return self.promise.check

    @property
    def migrations(self) -> list:
        return self.session.migrations

    @property
    def disabled_reason(self) -> str | None:
        return self.session.disabled_reason

    @property
    def working(self) -> bool:
        """Does this rank have work under the running plan?"""
        return self.plan.locate(self.rank) is not None

    @property
    def measures_links(self) -> bool:
        """Does every rank time its communication for link rates (``engine/comm_log.py``)? A
        job on more than one node, or one whose GPU links are read
        (``link_watch.watches_gpu_links``), with the loop on; the same on every rank."""
        return (self.world > 1 and bool(self.s.enabled)
                and (self.job.nodes > 1 or watches_gpu_links(self.s.detect, self.spec.job)))

    def normalised(self) -> list[float]:
        """Today's rates as the detector reads them (healthy -> 1.0, unmeasured -> planned)."""
        return [round(float(x), 3) for x in self.det.normalise(self.measured)]

    def tp_cost_event(self, step: int) -> dict | None:
        """The ``tp_slowdown`` metrics event (the table measured at start-up), or None."""
        measured = self.work.tp_measured
        if measured is None:
            return None
        return {"event": "tp_slowdown", "step": int(step), "tp": self.tp,
                "table": {str(k): round(v, 4) for k, v in sorted(measured.items())},
                "ideal": {str(k): float(v) for k, v in sorted(ideal_slowdown(self.tp).items())}}

    # -- hooks inside a step ------------------------------------------------------------------

    def probe_due(self, step: int) -> bool:
        """Does this rank time a probe after step ``step`` (``probing.probing_ranks``)?"""
        return self.probing.due(step)

    def after_reduce(self, step: int) -> None:
        """Right after step ``step``'s all-reduce, when every rank leaves it at once: the probes
        due now (``probing.py``); a compute probe's reading rides in the next step's all-reduce
        (:meth:`contribute`). The ranks without work and the calibrating rank thus probe at the
        same moment, under the same contention."""
        self.probing.after_reduce(step)

    def timed_after_reduce(self, step: int) -> bool:
        """May any rank have timed more of step ``step`` in :meth:`after_reduce` (a probe,
        whose seconds count in its rank's clock for the step)? The same on every rank
        (``probing.Probing.may_time``)."""
        return self.probing.may_time(step)

    def contribute(self, compute_s: float, probe_s: float | None = None) -> tuple[bool, float]:
        """This rank's adaptive-loop values for the step's all-reduce
        (``engine/step_reduce.py``): rank 0's "decision ready" flag, and the probe timed after
        the last all-reduce (``probe_s``: seconds given instead, e.g. synthetic) in seconds per
        cost unit (0.0: none). Records this step's compute."""
        if probe_s is None:
            probe_s = self.probing.take()
        ready = False
        if self.rank == 0:
            self.session.collect()
            ready = self.session.result is not None
        if self.working:
            self.compute_times.append(compute_s)
        return ready, (probe_s / self.slowdown[self.tp] if probe_s > 0 else 0.0)

    def observe(self, step: int, sums: StepSums) -> None:
        """After the all-reduce (``sums``): rates (every rank), detection and a re-plan request
        (rank 0)."""
        self.ready = self.ready or sums.ready
        self.last_step = step
        if self.skip_steps:     # the first step of a run or of a plan: allocation, first touch
            self.skip_steps -= 1
            self.est.last_probe_rates = np.full(self.world, np.nan)   # nothing read this step
            return
        self.est.add(sums.compute_s, self.units, sums.probe_s, shape=self.work.shape,
                     held=self.held)
        self.measured = self.est.rates(floor=self.work.floor)
        if self.links is not None:
            self.links.add(sums.comm)
        self.seen += 1
        self.promise.since_switch += 1
        self._track(step)
        ses = self.session
        if (self.promise.missed is not None and ses.client is not None and ses.idle
                and not self.ready):
            self.promise.act_on_miss(step)
            return
        if self.seen < self.s.detect.window:    # a full window before the first detection
            return
        if (self.det is None or not self.s.enabled or ses.client is None or not ses.idle
                or self.ready or (step + 1) % self.s.detect.every):
            return
        trig = self.det.check(self.measured, idle=self.units <= 0)
        moved = self.links.check()          # both detections keep their streaks every time
        if trig is not None:
            ses.request(trig.kind, list(trig.rates), step + 1)
        elif moved is not None:
            ses.request("link", self.normalised(), step + 1, links=moved)

    def _track(self, step: int) -> None:
        """Rank 0, at each detection once a full window is measured: the rates as read (no
        hold) to the straggler watch (onsets, ends and their durations), and its holds of the
        flapping ranks to the detector."""
        if (self.stragglers is not None and self.seen >= self.s.detect.window
                and not (step + 1) % self.s.detect.every):
            self.stragglers.update(self.det.normalise(self.measured, held=False))
            self.det.hold = self.stragglers.holds()

    def step_done(self, seconds: float) -> None:
        if self.stragglers is not None:
            self.stragglers.now_s += seconds
        self.step_times.append(seconds)
        self.promise.step_done(seconds)

    def measured_rates(self) -> list[float | None]:
        """Each rank's smoothed measured rate (None: not measured yet), for logs and checkpoints."""
        return as_list(self.measured)

    def probe_rates(self) -> list[float | None]:
        """The probes read in the last step (idle and held ranks: each against its step's
        reference probe, ``RateEstimator.add``; None: none read), for metrics.jsonl: a replay of
        the run reads what its probes read (``replay/run_trace.py``)."""
        return as_list(self.est.last_probe_rates)

    def measured_link_rates(self) -> dict[str, float]:
        """Rank 0: each measured node link's smoothed rate, ``{"0-1": 1.0}`` (other ranks and
        one-node jobs: empty), for metrics.jsonl."""
        return self.measured_links().get("link_rates", {})

    def measured_links(self) -> dict[str, dict[str, float]]:
        """Rank 0: the measured links of both kinds, ``{"link_rates": {"0-1": 1.0},
        "gpu_link_rates": {"2-3": 1.0}}`` (the second where a GPU link is measured; other
        ranks: empty), for metrics.jsonl."""
        return self.links.measured_map().json() if self.links is not None else {}

    def take_events(self) -> list[dict]:
        """``check`` events since the last call (rank 0; metrics.jsonl)."""
        return self.promise.take_events()

    # -- at a step boundary (collective) ------------------------------------------------------

    def before_step(self, step: int) -> list[ReplanDecision]:
        """Decisions to apply before ``step``, the same on every rank, in order: a background
        result rank 0 flagged in an earlier all-reduce, then a forced re-plan due now. The
        engine skips one planned against a plan that is no longer running (``from_plan``)."""
        out = []
        if self.ready:
            got = self.session.share_result()
            self.ready = False
            if got is not None:
                out.append(got.at(step))     # detected before its step, adopted now
                self.probing.event_links.append(_event_links(got))
        got = self.session.forced_due(step)
        if got is not None:
            out.append(got)
            self.probing.event_links.append(_event_links(got))
        return out

    def wait_planner(self, timeout_s: float = FORCED_TIMEOUT_S) -> None:
        """Rank 0: block until the re-plan in flight, if any, is decided (a simulator or a test
        that counts planning in steps, not seconds; training never waits)."""
        self.session.wait(timeout_s)

    def carry(self, rates, step: int) -> bool:
        """Rates measured before a restart (a checkpoint carried them; None: unknown): the
        measurement to start from, and, when some rank is not healthy and the loop is on, a
        re-plan before ``step`` (the run's first) with trigger ``carried``, so a known
        straggler is planned around at once rather than found again. Every rank calls it with
        the same rates. Returns whether a re-plan was scheduled."""
        r = np.array([np.nan if x is None else float(x) for x in rates], dtype=np.float64)
        if r.shape != (self.world,):
            return False
        self.measured = r
        slow = bool(np.any(np.nan_to_num(r, nan=1.0) >= self.s.detect.healthy))
        if not (self.s.enabled and slow and self.world > 1):
            return False
        self.session.carried_at = step
        self.session.forced = sorted({step, *self.session.forced})
        return True

    def switched(self, plan: Plan, rates: list[float] | None, job=None, migration=None) -> None:
        """After any switch (adaptive, forced or scripted) to ``plan``, made for ``rates``
        (None: today's measurement), with the job layout ``job`` it brought (None: unchanged)
        and its ``migration`` (``.bytes``, ``.seconds``: the bandwidth the next decision
        assumes): cost units of the new plan, the rates it was made for, and results planned
        against the old one become stale; rank 0 keeps the old plan and its measured pace (to
        go back to if the new one breaks its promise) and sets the new plan's promise."""
        if job is not None:
            self.job = job
        kept = same_stages(self.plan, plan)
        self.promise.switched(self.step_times, self.det.planned if self.det is not None else ())
        self.plan = plan
        tp_changed = self.work.for_plan(plan, self.job.tp)
        self.session.switched(migration, tp_changed, kept)
        self.work.hold(rates if rates is not None else as_list(self.measured),
                       self.s.detect.healthy)
        self.step_times.clear()
        self.compute_times.clear()
        self.skip_steps = 1
        self.probing.switched()
        self.probing.links_planned()
        if self.det is not None:
            self.det.planned_for(rates if rates is not None else self.normalised())
            self.promise.promise()

    def considered(self, rates: list[float] | None) -> None:
        """A planning attempt that kept the running plan: its rates are now the reference."""
        if rates:
            self.work.hold(rates, self.s.detect.healthy)
        self.probing.links_planned()
        if self.det is not None:
            self.det.planned_for(rates if rates else self.normalised())
            self.promise.promise()

    # -- a simulator's fast-forward (replay/loop.py) ---------------------------------------------

    def steady_key(self) -> tuple | None:
        """Rank 0, between steps: None while anything is in flight or about to be decided (a
        request, a result, a missed promise, a forced re-plan, the first steps of a plan, a
        detection streak or cooldown, a promise not yet judged kept), else everything a further
        identical step could change, as one value. A simulator that sees the same value one
        period of identical steps apart (:meth:`period`) may :meth:`skip` whole periods: they
        would change nothing but the step counters."""
        c, d, pm = self.check, self.det, self.promise
        links = self.links.state() if self.links is not None else ()
        if (not self.session.idle or self.ready or pm.missed is not None or self.forced
                or self.skip_steps or pm.judge_skip or d is None or d.streak or d.cooldown
                or self.seen < self.s.detect.window or links is None):
            return None
        if c is not None and not c.settled():
            return None
        return (self.plan.id, self.measured.tobytes(), self.est.beta, self.est.gamma,
                self.held.tobytes(), self.probe_ref, d.planned.tobytes(), d.hold.tobytes(),
                self.session.scale,
                pm.pace.seconds, None if c is None else c.state(), links)

    def steady_for_s(self) -> float | None:
        """Rank 0: seconds a steady stretch stays steady on the loop's own clock (a flapping
        rank's hold released, ``stragglers.StragglerWatch.steady_s``); None: no limit. A
        simulator skips no further."""
        return self.stragglers.steady_s() if self.stragglers is not None else None

    def period(self) -> int:
        """Steps after which every periodic part of the loop (detection, probes, the work
        model's refit) is back in phase."""
        d = self.s.detect
        p = d.every                      # the least common multiple of the three
        while p % d.probe_every or p % self.est.FIT_EVERY:
            p += d.every
        return p

    def skip(self, steps: int) -> None:
        """Account ``steps`` (a multiple of :meth:`period`) identical steps that a simulator
        did not run, after :meth:`steady_key` held over a period: only the counters move."""
        if steps % self.period():
            raise ValueError(f"skip({steps}): not a multiple of the loop's period "
                             f"{self.period()}")
        self.seen += steps
        if self.stragglers is not None and self.step_times:
            self.stragglers.now_s += steps * float(np.median(self.step_times))
        self.promise.since_switch += steps
        self.last_step += steps
        if self.check is not None:
            self.check.skip(steps)

    def close(self) -> None:
        self.session.close()


def _head(job: JobSpec) -> float:
    """The last stage's output head, in layers: without it a healthy last stage reads slow."""
    from ..cost import head_layers

    if job.problem is not None:
        return head_layers(job.problem)
    from ..models.base import head_layer_units

    return head_layer_units(job.param_table, job.seq_len, job.model_cfg.hidden_size)


def _planner(job: JobSpec, settings: AdaptiveSettings, planner):
    """Rank 0's planner when the loop may plan (a planner process of its own unless one is
    given: it imports the planner while training warms up); None elsewhere."""
    if job.rank == 0 and job.world > 1 and (settings.enabled or settings.replan_at):
        if planner is None:
            from ..planner.client import PlannerClient
            planner = PlannerClient()
        return planner
    return None


def _event_links(d: ReplanDecision) -> Links | None:
    """The slow links a decision was made for (None: it names none: links are not
    watched)."""
    if d.link_rates is None:
        return None
    return Links.from_json(d.link_rates, d.gpu_link_rates)
