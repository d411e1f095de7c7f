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
   raises a flag in a step's all-reduce, every rank then joins one ``broadcast_object_list``
   before the next step; the engine switches.

This module holds the loop's state (its settings: ``settings.py``; when a rank probes:
``probe.py``). It reads no engine: it is built from a :class:`~malleus_ds.adaptive.job.JobSpec`
(plain values), the plan the job starts under, and a probe block to time (the engine's,
``engine/probe_block.py``, or none), and is driven through its step hooks (``steploop.py``),
which the engine calls at fixed points of ``train_batch`` once the app has attached it
(``app/loop.py``). A test or a simulator drives the same hooks with synthetic timings.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import numpy as np

from ..cost import RECOMPUTE_FACTOR, head_layers
from ..models.base import head_layer_units
from .pace_check import HealthyPace, PaceCheck
from ..plan import Plan, PlanError
from . import probe as probing
from .job import JobSpec
from .settings import AdaptiveSettings
from ..problem import Problem
from .replan import decide, fit_running_plan, fit_switch_seconds, job_memory, job_problem
from .held import HOLD, held_ranks, probe_reference
from .detect import Detector, trigger_kind
from .link_watch import Links, LinkWatch, watches_gpu_links
from .rates import RateEstimator, as_list
from .work import cost_shape, cost_units
from ..problem import given_slowdown, ideal_slowdown
from ..steploop import ReplanDecision

#: link probes (``engine/link_probe.py``): links are probed every step for this many steps at
#: the job's start (the probes' healthy reference needs ``link_rates.MIN_HISTORY`` readings)
#: and after a link is first held (a false alarm is undone soon)
LINK_WARMUP = 12
#: ...and while no link is held, one link every this many times ``detect.probe_every`` steps
LINK_IDLE_EVERY = 5
#: every node pair is probed up to this many nodes; above, the pairs of adjacent nodes
MAX_PROBED_NODES = 8
#: a link held at least this slow is probed with one round trip past its first steps held
#: (``Controller._link_to_probe``)
ONE_TRIP_RATE = 100.0

# ------------------------------------------------------------------------------ the controller


class Controller:
    """One per rank. The step hooks (``steploop.py``), in step order: :meth:`contribute`
    (values for the step's all-reduce), :meth:`observe` (after it), :meth:`after_reduce` (the
    probe), :meth:`step_done` (wall time), :meth:`before_step` (collective, at the next step
    boundary: ready decisions and forced re-plans → plans to switch to), :meth:`switched` /
    :meth:`considered` (what became of them), :meth:`take_events`, :meth:`measured_rates`."""

    #: seconds a forced re-plan waits for the planner worker
    FORCED_TIMEOUT_S = 120.0

    def __init__(self, job: JobSpec, settings: AdaptiveSettings, plan: Plan, prober=None,
                 tp_measured: dict[int, float] | None = None, planner=None,
                 link_prober=None) -> None:
        """``job``: the job, frozen at start; ``plan``: the plan it starts under; ``prober``: the
        block a rank times to stay measured without work (``measure(sustain, budget_s)`` ->
        seconds per run, ``release()``; None: such a rank reads nothing); ``tp_measured``: the
        TP slowdown table measured at start-up (``engine/tp_cost.py``), if any; ``planner``:
        rank 0's planner (``request`` / ``poll`` / ``wait`` / ``close``, as
        :class:`~malleus_ds.planner.client.PlannerClient`; None: a planner process of its own,
        started when the loop may plan; a replay passes one on its simulated clock);
        ``link_prober``: what times round trips across a link (``exchange(a, b, mb, trips)``, as
        ``engine/link_probe.py``; None: a link held slow is not probed)."""
        self.spec, self.s = job, settings
        self.rank, self.world = job.rank, job.world
        self.job = job.job                # the job layout now (a switch may change TP sizes)
        self.plan = plan                  # the plan running now
        self.tp = job.job.tp              # the TP degree self.slowdown is keyed by
        self.tp_measured = tp_measured
        self.slowdown = self._slowdown(self.tp)
        self.est = RateEstimator(self.world, settings.detect.window)
        self.det = Detector(self.world, settings.detect) if self.rank == 0 else None
        #: rank 0: the links' rates and their detection (``link_watch.py``; issue 35)
        self.links = LinkWatch(job, settings.detect) if self.rank == 0 else None
        #: every rank: the slow links the running plan was made for (from the decisions'
        #: events, the same everywhere): probed every ``detect.probe_every`` steps
        self.held_links = Links()
        self._event_links: deque = deque()   # each decision's links, for switched/considered
        self._held_since = -LINK_WARMUP      # the first step a link in held_links was held
        self._link_probe = link_prober
        # the last stage's output head, in layers: without it a healthy last stage reads slow
        self.head = (head_layers(job.problem) if job.problem is not None else
                     head_layer_units(job.param_table, job.seq_len, job.model_cfg.hidden_size))
        # a recomputed layer does 4/3 of a plain one's work, the head does not grow
        self.recompute = bool(job.recompute)     # activation checkpointing
        self.layer_cost = RECOMPUTE_FACTOR if self.recompute else 1.0
        self.units = cost_units(plan, self.world, self.tp, self.slowdown, self.head,
                                self.layer_cost)
        self.shape = tuple(cost_shape(plan, self.world).T)     # per-micro-batch terms, fitted
        self.held = held_ranks(self.units, None)     # working under a plan made for them as slow
        self._floor = np.zeros(self.world)           # ...and the rates it was made for
        self.probe_ref = probe_reference(self.units, self.held)
        self.measured = np.full(self.world, np.nan)
        self.step_times: deque[float] = deque(maxlen=max(3, settings.detect.window))
        self.compute_times: deque[float] = deque(maxlen=max(3, settings.detect.window))
        self.forced = list(settings.replan_at)
        self._carried_at: int | None = None     # the step a carried-rates re-plan is due (carry)
        self.ready = False                # every rank: rank 0 flagged a decision in an all-reduce
        self._pending: dict | None = None  # rank 0: the request the worker is planning
        self._result: ReplanDecision | None = None   # rank 0: a decision not yet flagged
        self._generation = 0              # bumped by every switch: older requests are stale
        self._problem: Problem | None = None
        self._first_plan = plan            # the user's layout: the problem's static baseline
        self._probe = prober              # the engine's probe block (None: no probes)
        self.migrations: list = []         # every switch's migration (.bytes, .seconds)
        self._probe_s = 0.0               # timed after the last all-reduce, reported in the next
        self._skip, self._seen = 1, 0     # steps to leave out; steps measured so far
        self.disabled_reason: str | None = None
        # rank 0: the running plan's promise against its measured steps (pace_check.py)
        self.check = PaceCheck(settings.check) if self.rank == 0 else None
        self.pace = HealthyPace()          # seconds per model unit, from the healthy first plan
        self._scale: float | None = None   # ...else from the last re-plan's calibration
        self._previous: tuple | None = None   # (plan, its measured step s, its planned rates)
        self._judge_skip = 1               # steps after a switch the check leaves out
        self._since_switch = 0             # steps measured under the running plan
        self._missed: dict | None = None   # a missed promise the loop has yet to act on
        self._last_step = 0                # the step observe() saw last
        self._events: list[dict] = []      # rank 0: check events for metrics.jsonl
        self._client = None               # rank 0: planner/client.py's PlannerClient
        if self.rank == 0 and self.world > 1 and (settings.enabled or settings.replan_at):
            if planner is None:
                from ..planner.client import PlannerClient
                planner = PlannerClient()    # imports the planner while training warms up
            self._client = planner

    def _slowdown(self, tp: int) -> dict[int, float]:
        """tp/g -> slowdown: the user's ``tp_slowdown`` map where given, else the table measured
        at start-up (``tp_measured``) for this ``tp``, else ideal (tp/g)."""
        given = given_slowdown(self.s.tp_slowdown, tp)
        if given is not None:
            return given
        ideal = ideal_slowdown(tp)
        if self.tp_measured is not None and set(self.tp_measured) == set(ideal) and tp == self.tp:
            return dict(self.tp_measured)
        return ideal

    def tp_cost_event(self, step: int) -> dict | None:
        """The ``tp_slowdown`` metrics event (the table measured at start-up), or None."""
        if self.tp_measured is None:
            return None
        return {"event": "tp_slowdown", "step": int(step), "tp": self.tp,
                "table": {str(k): round(v, 4) for k, v in sorted(self.tp_measured.items())},
                "ideal": {str(k): float(v) for k, v in sorted(ideal_slowdown(self.tp).items())}}

    # -- hooks inside a step ------------------------------------------------------------------

    def probe_due(self, step: int) -> bool:
        """A rank without work times a probe every ``detect.probe_every`` steps (so it can come
        back), and so does a held rank with slack (:attr:`held`: so a light load that fits
        inside a throughput cap does not read as a recovery) and :attr:`probe_ref`, the
        least-loaded rank with work not held, to calibrate them (``RateEstimator.add``)."""
        if step % self.s.detect.probe_every:
            return False
        if self._probe is None:
            return False
        if not self.working or self.rank == self.probe_ref:
            return True
        return bool(self.held[self.rank]) and probing.light(self.step_times, self.compute_times)

    @property
    def measures_links(self) -> bool:
        """Does every rank time its communication for link rates (``engine/comm_log.py``)? A
        job on more than one node, or one whose GPU links are read
        (``link_watch.watches_gpu_links``), with the loop on; the same on every rank."""
        return (self.world > 1 and bool(self.s.enabled)
                and (self.job.nodes > 1 or watches_gpu_links(self.s.detect, self.spec.job)))

    @property
    def working(self) -> bool:
        """Does this rank have work under the running plan?"""
        return self.plan.locate(self.rank) is not None

    def after_reduce(self, step: int) -> None:
        """Right after step ``step``'s all-reduce, when every rank leaves it at once: if a probe
        is due, time it now; its reading rides in the next step's all-reduce (:meth:`contribute`).
        The ranks without work and the calibrating rank thus probe at the same moment, under
        the same contention (probing at the end of each rank's own pipeline work, as before,
        put the idle rank's probe next to busy peers and the reference's next to idle ones: an
        idle rank read 2-4x slow for good after a real slowdown ended)."""
        self._probe_s = self.probe(step) if self.probe_due(step) else 0.0
        got = self._link_to_probe(step)
        if got is not None:
            ends, trips = got
            self._link_probe.exchange(*ends, self.s.detect.link_probe_mb, trips=trips)

    def _ends(self, kind: str, link: tuple[int, int]) -> tuple[int, int]:
        """The two ranks that probe a link: a node link's nodes' first ranks, a GPU link's own."""
        if kind == "node":
            return self.job.node_ranks(link[0])[0], self.job.node_ranks(link[1])[0]
        return link

    def _link_to_probe(self, step: int) -> tuple[tuple[int, int], int | None] | None:
        """The two ranks that exchange a link probe after step ``step`` and how many round
        trips (None: ``LinkProbe.ROUND_TRIPS``), or None (the same on every rank). A link held
        at :data:`ONE_TRIP_RATE` or more, past its first :data:`LINK_WARMUP` steps held, gets
        one round trip: each costs its slowness (an emulated 1000x GPU link: 50 ms a round trip;
        three every other step cost the plan made for it 23% of its step), and its recovery bar
        (half its held level) is far above a single trip's scatter, which on a link held at
        9-20x delayed the recovery 6 steps past the test's bound. One link per probe step, in
        turn: while links are held slow,
        those, every ``detect.probe_every`` steps (every step for :data:`LINK_WARMUP` steps
        after one is first held: a false alarm is undone soon); else the links of
        :meth:`_probe_pools`, each kind in turn, every step for the job's first
        :data:`LINK_WARMUP` measured steps per kind (the probes' healthy reference, one per
        kind: ``link_rates.MIN_HISTORY`` probes each) and every ``LINK_IDLE_EVERY x
        probe_every`` steps after."""
        if (self._link_probe is None or not self.measures_links
                or self.s.detect.link_probe_mb <= 0):
            return None
        p = self.s.detect.probe_every
        if self.held_links:
            warm = step - self._held_since < LINK_WARMUP
            every = 1 if warm else p
            pools = [[(self._ends(k, ln), None if warm or r < ONE_TRIP_RATE else 1)
                      for k, ln, r in self.held_links.items()]]
        else:
            pools = [[(ends, None) for ends in pool] for pool in self._probe_pools()]
            every = 1 if self._seen < LINK_WARMUP * len(pools) else LINK_IDLE_EVERY * p
        if step % every or not pools:
            return None
        i = step // every
        pool = pools[i % len(pools)]
        return pool[(i // len(pools)) % len(pool)]

    def _probe_pools(self) -> list[list[tuple[int, int]]]:
        """The rank pairs probed while no link is held, per kind of link: every node pair up to
        :data:`MAX_PROBED_NODES` nodes, else the pairs of adjacent nodes (each by its nodes'
        first ranks); and where GPU links are read, the adjacent GPUs of node 0 (the probes'
        healthy reference inside a node)."""
        n = self.job.nodes
        nodes = ([(a, b) for a in range(n) for b in range(a + 1, n)] if n <= MAX_PROBED_NODES
                 else [(a, a + 1) for a in range(n - 1)])
        out = [[self._ends("node", ln) for ln in nodes]] if nodes else []
        if watches_gpu_links(self.s.detect, self.spec.job):
            first = self.job.node_ranks(0)
            out.append(list(zip(first, first[1:])))
        return out

    def probe(self, step: int) -> float:
        """Seconds per run of the probe block (``probe.py``): sustained on a rank without work
        (within half a step) or a held one (within half its slack), one run on the calibrating
        rank."""
        if not self.working:
            return self._probe.measure(True, probing.budget(self.step_times))
        if self.held[self.rank]:
            return self._probe.measure(True, probing.budget(self.step_times, self.compute_times))
        return self._probe.measure(False, 0.0)

    def contribute(self, compute_s: float, probe_s: float | None = None) -> tuple[bool, float]:
        """This rank's adaptive-loop values for the step's all-reduce
        (``engine/step_reduce.py``): rank 0's "decision ready" flag, and the probe timed after
        the last all-reduce (``probe_s``: seconds given instead, e.g. synthetic) in seconds per
        cost unit (0.0: none). Records this step's compute."""
        if probe_s is None:
            probe_s, self._probe_s = self._probe_s, 0.0
        ready = False
        if self.rank == 0:
            self._collect()
            ready = self._result is not None
        if self.working:
            self.compute_times.append(compute_s)
        return ready, (probe_s / self.slowdown[self.tp] if probe_s > 0 else 0.0)

    def observe(self, step: int, sums) -> None:
        """After the all-reduce (``sums``: its :class:`~malleus_ds.engine.step_reduce.StepSums`):
        rates (every rank), detection and a re-plan request (rank 0)."""
        self.ready = self.ready or sums.ready
        self._last_step = step
        comp, probe = sums.compute_s, sums.probe_s
        if self._skip:          # the first step of a run or of a plan: allocation, first touch
            self._skip -= 1
            self.est.last_probe_rates = np.full(self.world, np.nan)   # nothing read this step
            return
        self.est.add(comp, self.units, probe, shape=self.shape, held=self.held)
        self.measured = self.est.rates(floor=self._floor)
        if self.links is not None:
            self.links.add(sums.comm)
        self._seen += 1
        self._since_switch += 1
        if (self._missed is not None and self._client is not None and self._pending is None
                and self._result is None and not self.ready):
            self._act_on_miss(step)
            return
        if self._seen < self.s.detect.window:    # a full window before the first detection
            return
        if (self.det is None or not self.s.enabled or self._client is None
                or self._pending is not None or self._result is not None or self.ready
                or (step + 1) % self.s.detect.every):
            return
        trig = self.det.check(self.measured, idle=self.units <= 0)
        moved = self.links.check()          # both detections keep their streaks every time
        if trig is not None:
            self._request(trig.kind, list(trig.rates), step + 1)
        elif moved is not None:
            self._request("link", self._normalised(), step + 1, links=moved)

    def step_done(self, seconds: float) -> None:
        self.step_times.append(seconds)
        if self.check is None or not self.s.enabled or self._client is None:
            return
        first = self._judge_skip > 0         # the first step of a plan: allocation, first
        if first:                            # touch; it counts for the severe rule only
            self._judge_skip -= 1
        else:
            self._track_pace(seconds)
        ev = self.check.observe(self._last_step, seconds, first=first)
        if ev is not None:
            self._events.append(ev)
            if ev["outcome"] == "missed":
                self._missed = ev
                if self._pending is None and self._result is None and not self.ready:
                    self._act_on_miss(self._last_step)      # no step lost waiting

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
        out, self._events = self._events, []
        return out

    # -- at a step boundary (collective) ------------------------------------------------------

    def before_step(self, step: int) -> list[ReplanDecision]:
        """Decisions to apply before ``step``, the same on every rank, in order: a background
        result rank 0 flagged in an earlier all-reduce, then a forced re-plan due now. The
        engine skips one planned against a plan that is no longer running (``from_plan``)."""
        out = []
        if self.ready:
            obj = [None]
            if self.rank == 0:
                obj[0], self._result = self._result, None
            self._broadcast(obj)
            self.ready = False
            if obj[0] is not None:
                out.append(obj[0].at(step))     # detected before its step, adopted now
                self._event_links.append(_event_links(obj[0]))
        while self.forced and self.forced[0] < step:
            self.forced.pop(0)                       # resumed past it
        if self.forced and self.forced[0] == step:
            self.forced.pop(0)
            trigger = "carried" if step == self._carried_at else "forced"
            obj = [None]
            if self.rank == 0:
                obj[0] = self._forced(step, trigger)
            self._broadcast(obj)
            out.append(obj[0])
            self._event_links.append(_event_links(obj[0]))
        return out

    def _broadcast(self, obj: list) -> None:
        """Rank 0's ``obj[0]`` to every rank (in place); with no process group (a single
        process driving the loop: a test, a simulator) rank 0's value stands."""
        import torch.distributed as dist

        if self.world > 1 and dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(obj, src=0)

    def wait_planner(self, timeout_s: float = FORCED_TIMEOUT_S) -> None:
        """Rank 0: block until the re-plan in flight, if any, is decided (a simulator or a test
        that counts planning in steps, not seconds; training never waits)."""
        if self._pending is not None and self._client is not None:
            self._collect(self._client.wait(timeout_s))

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
        self._carried_at = step
        self.forced = sorted({step, *self.forced})
        return True

    def switched(self, plan: Plan, rates: list[float] | None, job=None, migration=None) -> None:
        """After any switch (adaptive, forced or scripted) to ``plan``, made for ``rates``
        (None: today's measurement), with the job layout ``job`` it brought (None: unchanged)
        and its ``migration`` (``.bytes``, ``.seconds``: the bandwidth the next decision
        assumes): cost units of the new plan, the rates it was made for, and results planned
        against the old one become stale; rank 0 keeps the old plan and its measured pace (to
        go back to if the new one breaks its promise) and sets the new plan's promise."""
        if migration is not None:
            self.migrations.append(migration)
        if job is not None:
            self.job = job
        if self.det is not None and self.step_times:
            self._previous = (self.plan, float(np.median(self.step_times)),
                              [round(float(x), 3) for x in self.det.planned])
        self.plan = plan
        self._judge_skip, self._since_switch, self._missed = 1, 0, None
        tp = self.job.tp
        if tp != self.tp:       # engine API without a nominal tp: the plans' TP sizes set it
            self.tp, self._problem = tp, None
            self.slowdown = self._slowdown(tp)
        self.units = cost_units(plan, self.world, self.tp, self.slowdown, self.head,
                                self.layer_cost)
        self.shape = tuple(cost_shape(plan, self.world).T)
        self._hold(rates if rates is not None else as_list(self.measured))
        self.step_times.clear()
        self.compute_times.clear()
        self._skip = 1
        self._probe_s = 0.0                  # timed under the old plan
        self._generation += 1
        self._result = None                  # planned against the old plan, never flagged
        if (self._probe is not None and self.working and self.rank != self.probe_ref
                and not self.held[self.rank]):
            self._probe.release()            # back at full work: free the probe's block
        self._links_planned()
        if self.det is not None:
            self.det.planned_for(rates if rates is not None else self._normalised())
            self._promise()

    def considered(self, rates: list[float] | None) -> None:
        """A planning attempt that kept the running plan: its rates are now the reference."""
        if rates:
            self._hold(rates)
        self._links_planned()
        if self.det is not None:
            self.det.planned_for(rates if rates else self._normalised())
            self._promise()

    def _links_planned(self) -> None:
        """After a decision (adopted or not): the slow links it was made for (its event's
        ``link_rates`` and ``gpu_link_rates``, the same on every rank) are held (probed) and, on
        rank 0, the link detection's reference; a switch no decision made (scripted) keeps the
        held links, and rank 0's detection takes today's reading."""
        links = self._event_links.popleft() if self._event_links else None
        if links is not None:
            if links.keys() - self.held_links.keys():
                self._held_since = self._last_step + 1
            self.held_links = links
        if self.links is not None:
            self.links.planned_for(links)

    def _hold(self, rates: list[float | None]) -> None:
        """The ranks the running plan treats as slow (:func:`~malleus_ds.adaptive.held.held_ranks`,
        the same on every rank: from the broadcast event's rates, or the shared measurement)
        and the rank that calibrates their probes."""
        self.held = held_ranks(self.units, rates, max(HOLD, self.s.detect.healthy))
        self._floor = np.where(self.held, [0.0 if r is None else r for r in rates], 0.0)
        self.probe_ref = probe_reference(self.units, self.held)

    # -- a simulator's fast-forward (replay/loop.py) ---------------------------------------------

    def steady_key(self) -> tuple | None:
        """Rank 0, between steps: None while anything is in flight or about to be decided (a
        request, a result, a missed promise, a forced re-plan, the first steps of a plan, a
        detection streak or cooldown, a promise not yet judged kept), else everything a further
        identical step could change, as one value. A simulator that sees the same value one
        period of identical steps apart (:meth:`period`) may :meth:`skip` whole periods: they
        would change nothing but the step counters."""
        c, d = self.check, self.det
        links = self.links.state() if self.links is not None else ()
        if (self._pending is not None or self._result is not None or self.ready
                or self._missed is not None or self.forced or self._skip or self._judge_skip
                or d is None or d.streak or d.cooldown or self._seen < self.s.detect.window
                or links is None):
            return None
        if c is not None and not c.settled():
            return None
        return (self.plan.id, self.measured.tobytes(), self.est.beta, self.est.gamma,
                self.held.tobytes(), self.probe_ref, d.planned.tobytes(), self._scale,
                self.pace.seconds, None if c is None else c.state(), links)

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
        self._seen += steps
        self._since_switch += steps
        self._last_step += steps
        if self.check is not None:
            self.check.skip(steps)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- rank 0: the plan's promise (pace_check.py) ---------------------------------------------

    def _model_s(self, plan: Plan, rates) -> float | None:
        """The cost model's step time of ``plan`` under ``rates`` (model units), or None."""
        from ..cost import step_time

        pr = self._job_problem()
        if pr is None:
            return None
        r = {d: float(x) for d, x in enumerate(rates) if x is not None and x > 1.0}
        if self.links is not None:
            pr = self.links.problem(pr, self.links.planned(), self.links.comm)
        try:
            return step_time(pr.with_rates(r, current_plan=plan), plan)
        except (PlanError, ValueError):
            return None

    def _promise(self) -> None:
        """The running plan's expected step seconds under the rates it was planned for (its
        promise), in seconds by the job's healthy pace, else by the last re-plan's calibration.
        Only a plan the loop switched to is checked (the user's first plan promised nothing)."""
        if self.check is None:
            return
        if self.plan is self._first_plan and self._previous is None:
            # the user's layout promised nothing; held to the job's healthy pace, severe rule
            healthy = bool(np.all(self.det.planned == 1.0))
            self.check.expect(self.plan.id, self.pace.seconds if healthy else None,
                              "healthy pace", severe_only=True)
            return
        scale, why = self.pace.scale, "healthy pace"
        if scale is None:
            scale, why = self._scale, "re-plan calibration"
        T = self._model_s(self.plan, self.det.planned) if scale else None
        self.check.expect(self.plan.id, T * scale if T else None, why)

    def _track_pace(self, seconds: float) -> None:
        """A step of the first plan with every rank and link healthy: the job's healthy pace."""
        if self.plan.id != self._first_plan.id or not np.all(
                self.det.normalise(self.measured) == 1.0) or np.isnan(self.measured).any():
            return
        if self.links.planned() or self.links.normalised():
            return                   # a slow link: not the job's healthy pace
        if self.pace.model_s is None:
            T = self._model_s(self._first_plan, [1.0] * self.world)
            if T is None:
                return
            self.pace.model_s = T
        self.pace.add(seconds, self.pace.model_s)
        if self._previous is None:
            self._promise()          # the first plan: its promise is the pace measured so far

    def _act_on_miss(self, step: int) -> None:
        """The running plan broke its promise: re-measure (the slow steps only, at most those
        since the switch), then re-plan at once, past the detector's hysteresis (``_collect``
        decides; nothing better found: back to the previous plan if it ran faster,
        ``_back_out``). On the user's first plan (nothing to go back to) only when the fresh
        rates moved from the planned ones by the detector's ``change``: a host slow for
        everyone is no reason to plan, and a healthy run then never re-plans."""
        ev, self._missed = self._missed, None
        last = max(2, min(ev.get("steps", 2), max(self._since_switch, 2)))
        fresh = self.est.rates(floor=self._floor, last=last)
        if not np.isnan(fresh).all():
            self.measured = fresh
        r, p = self.det.normalise(self.measured), self.det.planned
        why = (f"step {ev['measured_s']:.3f} s, {ev['ratio']:.2f}x the promised "
               f"{ev['expected_s']:.3f} s for {ev.get('steps', 1)} step(s)")
        moved = bool(np.any(np.abs(r - p) >= self.s.detect.change * p))
        if not moved and not self._can_go_back(r, ev["measured_s"]):
            self.check.acted(changed=False)     # nothing to plan for, nothing to go back to
            return
        if self._previous is None:
            kind = ("recovery" if np.all(r == 1.0) else
                    "onset" if np.all(p == 1.0) else "change")
        else:
            kind = "missed"
        self._request(kind, self._normalised(), step + 1, why=why, check_step=ev["step"])

    def _can_go_back(self, rates, step_s: float | None) -> bool:
        """Is the plan that ran before this one worth going back to: measured clearly faster
        (by the check's margin) than this one runs now, and under ``rates`` (re-measured) not
        predicted slower than this one by more than that margin? (A host that got slower for
        everyone, or a straggler that has since left, makes the old measurement no reason to
        return to a plan made for it.)"""
        if self._previous is None or step_s is None:
            return False
        prev, prev_s, _ = self._previous
        m = self.s.check.margin
        if prev.id == self.plan.id or not prev_s * (1 + m) < step_s:
            return False
        t_prev, t_cur = self._model_s(prev, rates), self._model_s(self.plan, rates)
        return t_prev is not None and t_cur is not None and t_prev <= t_cur * (1 + m)

    def _back_out(self, res: ReplanDecision, cur: Plan,
                  step_s: float | None) -> ReplanDecision:
        """After a missed promise: the planner's better plan if it found one, else the plan that
        ran before this one when it is worth going back to (:meth:`_can_go_back`)."""
        if res.plan is not None or not self._can_go_back(res.measured, step_s):
            return res
        prev, prev_s, prev_rates = self._previous
        return replace(res, to_plan=prev.id, adopted=True, rates_for=tuple(prev_rates),
                       predicted_step_s=(round(step_s, 4), round(prev_s, 4)),
                       reason=f"missed its promise and the planner found nothing better "
                              f"({res.reason}); back to {prev.id}, measured "
                              f"{prev_s:.3f} s/step against {step_s:.3f} s now",
                       plan=prev.to_json())

    # -- rank 0 internals ---------------------------------------------------------------------

    def _normalised(self) -> list[float]:
        """Today's rates as the detector reads them (healthy -> 1.0, unmeasured -> planned)."""
        return [round(float(x), 3) for x in self.det.normalise(self.measured)]

    def _job_problem(self) -> Problem | None:
        if self._problem is None and self.disabled_reason is None:
            j = self.spec
            try:
                if j.problem is not None:        # a problem-only job (a replay)
                    self._problem = fit_running_plan(
                        replace(j.problem, rates={}, current_plan=None), self.plan)
                    return self._problem
                mem = job_memory(j.param_table, j.model_cfg, j.micro_batch_size, j.seq_len,
                                 j.mixed, self.s.device_mb, j.device, self.job.gpus_per_node,
                                 j.migrate_bucket_mb)
                pr = job_problem(self._first_plan, self.job, self.slowdown, mem, self.head,
                                 activation_checkpointing=self.recompute)
                self._problem = fit_running_plan(pr, self.plan)
            except (PlanError, ValueError) as err:
                self.disabled_reason = f"the running job cannot be planned for: {err}"
        return self._problem

    def _request(self, trigger: str, rates: list[float], step: int, why: str | None = None,
                 check_step: int | None = None, note: str | None = None,
                 links: Links | None = None) -> None:
        """Ask the planner for ``rates`` and the slow ``links`` (None: today's reading)."""
        pr = self._job_problem()
        if pr is None:
            self._result = self._error(trigger, step, self.disabled_reason)
            return
        pr = pr.with_rates({d: r for d, r in enumerate(rates) if r > 1.0},
                           current_plan=self.plan)
        links = self.links.normalised() if links is None else links
        comm = None
        if links:
            comm = self.links.comm_section(self._seconds_per_unit(pr))
            if comm is None:
                note = "; ".join(x for x in (note, f"slow links {links.text()} left "
                                 f"out: their costs are not measured yet") if x)
                links = Links()
            pr = self.links.problem(pr, links, comm)
        self._pending = {"trigger": trigger, "rates": rates, "step": step, "problem": pr,
                         "gen": self._generation, "t0": time.perf_counter(), "check": why,
                         "check_step": check_step, "note": note, "links": links,
                         "comm": comm}
        # every rank healthy: no margin, so the plan made for a straggler that has left goes
        # when the user's layout is any faster (the cost rule still weighs the migration; the
        # margin guards against noisy straggler rates, and there are none). A replay found the
        # margin kept a plan 2.8% slower than the user's layout for the rest of a day.
        margin = 0.0 if all(r <= 1.0 for r in rates) and not links else self.s.min_improvement
        self._client.request({"problem": pr.to_json(), "seed": step, "forced": trigger == "forced",
                              "time_limit": self.s.planner_time_limit_s,
                              "min_improvement": margin})

    def _collect(self, answer: dict | None = None) -> None:
        """Turn the worker's answer (if any) into a decision (stale ones are dropped)."""
        p = self._pending
        if p is None:
            return
        ans = answer if answer is not None else self._client.poll()
        if ans is None:
            return
        self._pending = None
        if p["gen"] != self._generation or self._overtaken(p):
            return
        if "error" in ans:
            self._result = self._error(p["trigger"], p["step"], f"planning failed: {ans['error']}")
            return
        new = Plan.from_json(ans["plan"])
        cur = self.plan
        nbytes = self._bytes_for(new) if new.id != cur.id else 0
        step_s = float(np.median(self.step_times)) if self.step_times else None
        if step_s:
            from ..cost import step_time
            self._scale = step_s / step_time(p["problem"], cur)
        res = decide(p["problem"], cur, new, p["trigger"], p["rates"], p["step"],
                     time.perf_counter() - p["t0"], step_s, nbytes,
                     self._migrate_s_for(nbytes), self.s.horizon_steps)
        if p.get("check"):           # acting on a missed promise (``_act_on_miss``)
            if p["trigger"] == "missed":
                res = self._back_out(res, cur, step_s)
            res = replace(res, reason=f"{p['check']}: re-planned at once; {res.reason}",
                          check_step=p["check_step"])      # the check event that missed
            self.check.acted(changed=res.plan is not None)
        if p.get("note"):
            res = replace(res, reason=f"{p['note']}; {res.reason}")
        if self.links.active:
            res = replace(res, **_links_fields(p["links"].json()),
                          **_links_fields(self.links.measured_map().json(), "measured_"))
        if p["links"]:
            self.links.comm = p["comm"]
            res = replace(res, comm={k: round(v, 6) for k, v in p["comm"].items()})
        self._result = res

    def _overtaken(self, p: dict) -> bool:
        """Did the rates move while the planner worked (a straggler gone, or a new one)? Then
        its answer is for rates that no longer hold: ask again, at once, for the rates of the
        steps since it asked (once: the answer to that is taken as it comes; fewer than two
        steps since: too few to say). Moved: by the detector's ``change``, or a rank planned
        as slow that now reads healthy; a rise of a rank without work changes nothing (it is
        out already); a rank without two fresh probes or timings has not moved
        (``RateEstimator.read``). Issue 31: on a loaded host a missed promise sent the job
        back to a plan that suspended a rank which had recovered while it was decided, and the
        rank's probes then kept it out for 20 steps (DESIGN.md §6)."""
        seen = self._last_step - p["step"] + 1       # steps measured since it was asked
        if (p["trigger"] in ("forced", "carried") or p.get("note") or self.det is None
                or seen < 2):
            return False
        was = np.asarray(p["rates"], dtype=np.float64)
        now = self.det.normalise(self.est.rates(floor=self._floor, last=seen))
        now = np.where(self.est.read(seen), now, was)   # no fresh reading: no evidence
        moved = (np.abs(now - was) >= self.s.detect.change * was) | ((was > 1.0) & (now == 1.0))
        moved &= (self.units > 0) | (now < was)
        if not moved.any():
            return False
        kind = "missed" if p["trigger"] == "missed" else trigger_kind(now, self.det.planned)
        note = (f"rates moved from {as_list(was)} to {as_list(now)} while it planned "
                f"(detected before step {p['step']})")
        self._request(kind, [round(float(x), 3) for x in now], self._last_step + 1,
                      why=p["check"], check_step=p["check_step"], note=note)
        return True

    def _forced(self, step: int, trigger: str = "forced") -> ReplanDecision:
        if self._client is None:
            return self._error(trigger, step, "no planner (a single rank)")
        if self._pending is not None:              # finish (and drop) what is in flight
            self._collect(self._client.wait(self.FORCED_TIMEOUT_S))
            self._result = None
        self._request(trigger, self._normalised(), step)
        if self._pending is not None:
            self._collect(self._client.wait(self.FORCED_TIMEOUT_S))
        res, self._result = self._result, None
        return res

    def _error(self, trigger: str, step: int, why: str) -> ReplanDecision:
        return ReplanDecision.failed(trigger, step, why, as_list(self.measured))

    def _seconds_per_unit(self, pr: Problem) -> float | None:
        """Seconds of one cost-model unit: the healthy pace, else the last re-plan's
        calibration, else the running plan's median step over its model time now."""
        from ..cost import step_time

        got = self.pace.scale or self._scale
        if got:
            return got
        if not self.step_times:
            return None
        try:
            return float(np.median(self.step_times)) / step_time(pr, self.plan)
        except (PlanError, ValueError):
            return None

    def _bytes_for(self, new: Plan) -> int:
        from ..migrate.transfer import Layout, transfer_plan

        j = self.spec
        return transfer_plan(Layout(self.plan, j.zero_stage), Layout(new, j.zero_stage),
                             j.param_table, mixed=j.mixed, param_bytes=j.param_bytes,
                             job=self.job).bytes

    def _migrate_s_for(self, nbytes: int) -> float:
        """Predicted switch seconds, ``fixed + nbytes / bandwidth``: fitted (least squares) to
        the switches so far once they moved at least two different byte counts; before that,
        the fixed part is the seconds of a switch that moved nothing (0.05 s until one was
        measured) and the bandwidth that of the switches that moved bytes (``migrate_gbps``
        until one was measured). Issue 33: folding a switch's fixed part (new communicators,
        the first step's warm-up: ~11 s at 1,024 GPUs) into its bandwidth overestimated a
        1 TB switch 3-6x, and a replay kept a plan 2.6% slower than the user's for hours."""
        fit = fit_switch_seconds((m.bytes, m.seconds) for m in self.migrations if m.seconds > 0)
        if fit is not None:
            return fit[0] + fit[1] * nbytes
        done = [m for m in self.migrations if m.bytes > 0 and m.seconds > 0]
        bw = (sum(m.bytes for m in done) / sum(m.seconds for m in done)) if done \
            else self.s.migrate_gbps * 1e9
        fixed = min((m.seconds for m in self.migrations if m.bytes == 0), default=0.05)
        return fixed + nbytes / bw


def _event_links(d: ReplanDecision) -> Links | None:
    """The slow links a decision was made for (None: it names none: links are not
    watched)."""
    if d.link_rates is None:
        return None
    return Links.from_json(d.link_rates, d.gpu_link_rates)


def _links_fields(links: dict, prefix: str = "") -> dict:
    """``Links.json()``'s ``link_rates`` / ``gpu_link_rates`` as decision fields."""
    return {f"{prefix}{k}": v for k, v in links.items()}
