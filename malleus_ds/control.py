"""The adaptive loop (DESIGN.md §6): measure → detect → plan in the background → switch.

Data flows one way:

1. **Timings.** Every step, each rank's compute seconds (communication left out) and, on a
   suspended rank, a probe's seconds ride in the step's existing loss all-reduce: no extra
   collective, and every rank sees every rank's numbers.
2. **Rates** (``straggler.RateEstimator``): per-unit compute time relative to the healthy
   reference, median-smoothed; identical on every rank.
3. **Detection** (``straggler.Detector``), rank 0 only, every ``detect.every`` steps.
4. **Planning problem** of the running job (``replan.job_problem``) with the measured rates and
   ``current_plan`` = the running plan; the planner runs in its own process on rank 0
   (:class:`PlannerClient`, ``planner/worker.py``) while training continues on the old plan.
5. **Cost-aware decision** (``replan.decide``): adopt the new plan only if its predicted gain over
   ``horizon_steps`` exceeds the predicted migration time (bytes of the transfer plan ÷ the
   bandwidth measured by earlier migrations).
6. **Broadcast and switch** at the first step boundary after rank 0's result is ready: rank 0
   raises a flag in a step's all-reduce, every rank then joins one ``broadcast_object_list``
   before the next step and calls ``engine.switch_plan``.

This module holds the loop's state and settings; the engine (``engine/engine.py``) only calls
:class:`Controller` hooks at fixed points of a step, so the whole loop is driven by
``train_batch``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .models.base import head_layers
from .plan import Plan, PlanError, nominal_tp
from .problem import Problem
from .replan import (Decision, decide, device_memory_mb, fit_running_plan, job_problem,
                     memory_model)
from .straggler import (DetectConfig, Detector, RateEstimator, as_list, cost_shape, cost_units,
                        ideal_slowdown, probe_reference)

#: staging buffers of a switch, in units of ``malleus.migrate_bucket_mb``: a round's bytes in
#: flight (sent + received, migrate/rounds.py) and the local copies that overlap the first round
SWITCH_BUFFERS = 2

ADAPTIVE_KEYS = ("adaptive", "detect", "horizon_steps", "replan_at", "planner_time_limit_s",
                 "min_improvement", "migrate_gbps", "tp_slowdown", "device_mb")


_INT_DETECT = ("every", "window", "confirm", "cooldown", "probe_every")


def number(sec: Mapping[str, Any], key: str, default, ok, need: str, optional: bool = False):
    """``sec[key]`` (``default`` if absent) as a float that satisfies ``ok``, or None when
    ``optional`` and null; else ValueError ``ds_config.malleus.<key>=<value> must be <need>``."""
    v = sec.get(key, default)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
        raise ValueError(f"ds_config.malleus.{key}={v!r} must be {need}")
    return float(v)


@dataclass(frozen=True)
class AdaptiveSettings:
    """The adaptive keys of the ``malleus`` section (``malleus.*`` in the app)."""

    enabled: bool = True                 # malleus.adaptive: detect, re-plan and migrate by itself
    detect: DetectConfig = field(default_factory=DetectConfig)
    horizon_steps: int = 100             # a switch must pay for its migration within this many steps
    replan_at: tuple[int, ...] = ()      # forced re-plans before these steps (tests, demos)
    planner_time_limit_s: float | None = None   # None: the planner's automatic budget
    min_improvement: float = 0.05        # the planner keeps the running plan unless this much faster
    migrate_gbps: float = 1.0            # bandwidth assumed before the first migration is measured
    tp_slowdown: Mapping[int, float] | str = "measure"   # tp/g -> slowdown, "measure" or "ideal"
    device_mb: float | None = None       # memory per device for the planner; None: detected

    @staticmethod
    def from_config(sec: Mapping[str, Any]) -> "AdaptiveSettings":
        """Parse and check; ValueError naming ``ds_config.malleus.<key>`` and the value."""
        p = "ds_config.malleus"
        en = sec.get("adaptive", True)
        if not isinstance(en, bool):
            raise ValueError(f"{p}.adaptive={en!r} must be true or false")
        det = sec.get("detect") or {}
        if not isinstance(det, Mapping):
            raise ValueError(f"{p}.detect must be a mapping of {list(DetectConfig.__dataclass_fields__)}, "
                             f"got {det!r}")
        known = set(DetectConfig.__dataclass_fields__)
        unknown = sorted(set(det) - known)
        if unknown:
            raise ValueError(f"{p}.detect: unknown keys {unknown}; allowed: {sorted(known)}")
        for k, v in det.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"malleus.detect.{k}={v!r} must be a number")
            if k in _INT_DETECT and int(v) != v:
                raise ValueError(f"malleus.detect.{k}={v!r} must be an integer")
        dc = DetectConfig(**{k: (int(v) if k in _INT_DETECT else float(v)) for k, v in det.items()})
        dc.check()
        hz = sec.get("horizon_steps", 100)
        if isinstance(hz, bool) or not isinstance(hz, int) or hz < 1:
            raise ValueError(f"{p}.horizon_steps={hz!r} must be an integer >= 1 (steps over "
                             f"which a re-plan's gain must repay its migration)")
        ra = sec.get("replan_at") or ()
        if isinstance(ra, (str, bytes)) or not isinstance(ra, (list, tuple)):
            raise ValueError(f"{p}.replan_at must be a list of step numbers, got {ra!r}")
        for i, s in enumerate(ra):
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(f"{p}.replan_at[{i}]={s!r} must be an integer >= 1 (the re-plan "
                                 f"happens before that training step)")
            if i and s <= ra[i - 1]:
                raise ValueError(f"{p}.replan_at[{i}]={s} is not after replan_at[{i - 1}]="
                                 f"{ra[i - 1]}; list steps in increasing order")
        tl = number(sec, "planner_time_limit_s", None, lambda v: v > 0,
                    "a number > 0 (or null: auto)", optional=True)
        mi = number(sec, "min_improvement", 0.05, lambda v: 0 <= v < 1, "a number in [0, 1)")
        bw = number(sec, "migrate_gbps", 1.0, lambda v: v > 0, "a number > 0 (GB/s)")
        sd = sec.get("tp_slowdown", "measure")
        if sd is None:
            sd = "measure"
        if isinstance(sd, str):
            if sd not in ("measure", "ideal"):
                raise ValueError(f"{p}.tp_slowdown={sd!r} must be \"measure\" (time the layer's "
                                 f"TP shards at start-up), \"ideal\" (tp/g) or a map tp/g -> "
                                 f"slowdown")
        else:
            if not isinstance(sd, Mapping):
                raise ValueError(f"{p}.tp_slowdown must map tp/g to a slowdown, got {sd!r}")
            try:
                sd = {int(k): float(v) for k, v in sd.items()}
            except (TypeError, ValueError):
                raise ValueError(f"{p}.tp_slowdown={dict(sd)!r}: keys are integers tp/g, values "
                                 f"numbers") from None
        dm = number(sec, "device_mb", None, lambda v: v > 0, "a number > 0 (or null: detected)",
                    optional=True)
        return AdaptiveSettings(en, dc, hz, tuple(ra), tl, mi, bw, sd, dm)


class PlannerClient:
    """Rank 0's planner process (``planner/worker.py``): :meth:`request` sends a problem,
    :meth:`poll` / :meth:`wait` return the answer; a reader thread only waits on the pipe."""

    def __init__(self) -> None:
        import os
        import queue
        import subprocess
        import sys
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "malleus_ds.planner.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="malleus-planner-reader", daemon=True).start()

    def _read(self) -> None:
        import json

        for line in self.proc.stdout:
            try:
                self.answers.put(json.loads(line))
            except ValueError:
                self.answers.put({"error": f"planner worker wrote {line[:200]!r}"})
        self.answers.put({"error": f"the planner worker exited (code {self.proc.wait()})"})

    def request(self, req: dict) -> None:
        import json

        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.answers.put({"error": f"the planner worker is gone: {e}"})

    def poll(self) -> dict | None:
        import queue
        try:
            return self.answers.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> dict:
        import queue
        try:
            return self.answers.get(timeout=timeout_s)
        except queue.Empty:
            return {"error": f"the planner did not answer within {timeout_s:g} s"}

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:       # noqa: BLE001 - best effort at shutdown
            self.proc.kill()


# ------------------------------------------------------------------------------ the controller


class Controller:
    """One per engine. Hooks, in step order: :meth:`slots` (values for the step's all-reduce),
    :meth:`observe` (after it), :meth:`step_done` (wall time), :meth:`before_step` (collective, at
    the next step boundary: ready decisions and forced re-plans → plans to switch to)."""

    #: seconds a forced re-plan waits for the planner worker
    FORCED_TIMEOUT_S = 120.0

    def __init__(self, engine, settings: AdaptiveSettings) -> None:
        self.engine, self.s = engine, settings
        self.rank, self.world = engine.global_rank, engine.world_size
        plan = engine.plan
        self.tp = engine.settings.tp or nominal_tp(plan)
        self.tp_measured: dict[int, float] | None = None    # tp_cost.measure at start-up
        if settings.tp_slowdown == "measure" and self.tp > 1:
            from .engine.tp_cost import measure     # a collective: every rank builds a Controller
            self.tp_measured = measure(engine.model_cfg, self.tp, plan.micro_batch_size,
                                       engine.seq_len, engine.device, engine.act_dtype)
        self.slowdown = self._slowdown(self.tp)
        self.est = RateEstimator(self.world, settings.detect.window)
        self.det = Detector(self.world, settings.detect) if self.rank == 0 else None
        # the last stage's output head, in layers: without it a healthy last stage reads slow
        self.head = head_layers(engine.param_table, engine.seq_len, engine.model_cfg.hidden_size)
        self.units = cost_units(plan, self.world, self.tp, self.slowdown, self.head)
        self.shape = tuple(cost_shape(plan, self.world).T)     # per-micro-batch terms, fitted
        self.probe_ref = probe_reference(self.units)
        self.measured = np.full(self.world, np.nan)
        self.step_times: deque[float] = deque(maxlen=max(3, settings.detect.window))
        self.forced = list(settings.replan_at)
        self.ready = False                # every rank: rank 0 flagged a decision in an all-reduce
        self._pending: dict | None = None  # rank 0: the request the worker is planning
        self._result: Decision | None = None   # rank 0: a decision not yet flagged
        self._generation = 0              # bumped by every switch: older requests are stale
        self._problem: Problem | None = None
        self._first_plan = plan            # the user's layout: the problem's static baseline
        self._probe_block = None
        self._probe_s = 0.0               # timed after the last all-reduce, reported in the next
        self._skip, self._seen = 1, 0     # steps to leave out; steps measured so far
        self.disabled_reason: str | None = None
        self._client: PlannerClient | None = None
        if self.rank == 0 and self.world > 1 and (settings.enabled or settings.replan_at):
            self._client = PlannerClient()   # imports the planner while the engine warms up

    def _slowdown(self, tp: int) -> dict[int, float]:
        """tp/g -> slowdown: the user's ``tp_slowdown`` map where given, else the table measured
        at start-up (``engine/tp_cost.py``) for this ``tp``, else ideal (tp/g)."""
        ideal = ideal_slowdown(tp)
        sd = self.s.tp_slowdown
        if isinstance(sd, Mapping):
            return {k: float(sd.get(k, v)) for k, v in ideal.items()}
        if self.tp_measured is not None and set(self.tp_measured) == set(ideal) and tp == self.tp:
            return dict(self.tp_measured)
        return ideal

    def tp_cost_event(self) -> dict | None:
        """The ``tp_slowdown`` metrics event (the table measured at start-up), or None."""
        if self.tp_measured is None:
            return None
        return {"event": "tp_slowdown", "step": int(self.engine.global_steps), "tp": self.tp,
                "table": {str(k): round(v, 4) for k, v in sorted(self.tp_measured.items())},
                "ideal": {str(k): float(v) for k, v in sorted(ideal_slowdown(self.tp).items())}}

    # -- hooks inside a step ------------------------------------------------------------------

    def probe_due(self, step: int) -> bool:
        """A rank without work times a probe every ``detect.probe_every`` steps (so it can come
        back), and so does :attr:`probe_ref`, the least-loaded rank with work, to calibrate them
        (``RateEstimator.add``)."""
        if step % self.s.detect.probe_every:
            return False
        return self.engine.located is None or self.rank == self.probe_ref

    def probe_after_reduce(self, step: int) -> None:
        """Right after step ``step``'s all-reduce, when every rank leaves it at once: if a probe
        is due, time it now; its reading rides in the next step's all-reduce (:meth:`slots`).
        The ranks without work and the calibrating rank thus probe at the same moment, under
        the same contention (probing at the end of each rank's own pipeline work, as before,
        put the idle rank's probe next to busy peers and the reference's next to idle ones: an
        idle rank read 2-4x slow for good after a real slowdown ended)."""
        self._probe_s = self.probe(step) if self.probe_due(step) else 0.0

    def take_probe(self) -> float:
        """The probe seconds measured after the previous step's all-reduce (0.0: none)."""
        out, self._probe_s = self._probe_s, 0.0
        return out

    #: a rank without work keeps its probe busy this long before timing (seconds of wall): past
    #: one CPU-quota period (50 ms; a throttled process runs its period's share at full speed,
    #: so a short probe after idling reads healthy) and a GPU's clock ramp-up
    PROBE_SUSTAIN_S = 0.06
    #: ...and then times repeats of the block over this long (spanning throttling periods)
    PROBE_TIMED_S = 0.1
    #: at most this share of a step goes to one probe (it runs while the others compute)
    PROBE_BUDGET = 0.5

    def probe(self, step: int) -> float:
        """Seconds of one decoder block's forward + backward on a dummy micro-batch, timed like
        training compute (straggler emulation applies): how a rank without work stays measured.
        The block is built once (fixed seed, the caller's RNG untouched) and kept. It runs once
        untimed first (allocation, cold caches). A rank without work then keeps the device busy
        for :attr:`PROBE_SUSTAIN_S` and times the mean of repeats over :attr:`PROBE_TIMED_S`:
        a device that idled reads as it works, not as it wakes (a CPU-quota-throttled process
        runs the first milliseconds of each period at full speed; a GPU ramps its clocks), all
        within :attr:`PROBE_BUDGET` of a step, so the probe never delays the next all-reduce.
        The calibrating rank works every step: one timed run."""
        import torch

        e = self.engine
        if self._probe_block is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                blk = e.model_cfg.build_layer(0, 0).to(device=e.device, dtype=e.act_dtype)
                x = torch.randn(e.plan.micro_batch_size, e.seq_len, e.model_cfg.hidden_size,
                                device=e.device, dtype=e.act_dtype)
            self._probe_block, self._probe_x = blk, x
        blk, cfg = self._probe_block, e.model_cfg

        def run():
            x = self._probe_x.detach().requires_grad_()
            cfg.run_block(blk, x, cfg.block_context(x)).float().sum().backward()

        run()                                          # warm-up, untimed
        reps = self._sustain(run) if e.located is None else 1

        def timed():
            for _ in range(reps):
                run()

        before = e.clock.compute_s
        e._timed(timed)
        for p in blk.parameters():
            p.grad = None
        return (e.clock.compute_s - before) / reps

    def _sustain(self, run) -> int:
        """Run ``run`` back to back for the sustain time (bounded by the step budget); return
        how many repeats fill the timed window at the pace of the last one."""
        import torch

        dev = torch.device(self.engine.device)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        budget = self.PROBE_BUDGET * (float(np.median(self.step_times)) if self.step_times
                                      else 2 * (self.PROBE_SUSTAIN_S + self.PROBE_TIMED_S))
        sustain = min(self.PROBE_SUSTAIN_S, budget / 2)
        end, last = time.perf_counter() + sustain, 0.0
        while True:
            t0 = time.perf_counter()
            run()
            sync()
            last = time.perf_counter() - t0
            if time.perf_counter() >= end:
                break
        window = min(self.PROBE_TIMED_S, budget / 2)
        return int(min(64, max(1, round(window / max(last, 1e-6)))))

    def slots(self, compute_s: float, probe_s: float) -> list[float]:
        """``[decision ready (rank 0), compute_s per rank..., probe per-unit s per rank...]``,
        this rank's entries filled in, the rest 0: summed by the step's all-reduce."""
        out = [0.0] * (1 + 2 * self.world)
        if self.rank == 0:
            self._collect()
            out[0] = 1.0 if self._result is not None else 0.0
        out[1 + self.rank] = compute_s
        out[1 + self.world + self.rank] = probe_s / self.slowdown[self.tp] if probe_s > 0 else 0.0
        return out

    def observe(self, step: int, summed: list[float]) -> None:
        """After the all-reduce: rates (every rank), detection and a re-plan request (rank 0)."""
        w = self.world
        self.ready = self.ready or summed[0] > 0.5
        comp = np.asarray(summed[1:1 + w], dtype=float)
        probe = np.asarray(summed[1 + w:1 + 2 * w], dtype=float)
        probe[probe <= 0] = np.nan
        if self._skip:          # the first step of a run or of a plan: allocation, first touch
            self._skip -= 1
            return
        self.est.add(comp, self.units, probe, shape=self.shape)
        self.measured = self.est.rates()
        self._seen += 1
        if self._seen < self.s.detect.window:    # a full window before the first detection
            return
        if (self.det is None or not self.s.enabled or self._client is None
                or self._pending is not None or self._result is not None or self.ready
                or (step + 1) % self.s.detect.every):
            return
        trig = self.det.check(self.measured, idle=self.units <= 0)
        if trig is not None:
            self._request(trig.kind, list(trig.rates), step + 1)

    def step_done(self, seconds: float) -> None:
        self.step_times.append(seconds)

    # -- at a step boundary (collective) ------------------------------------------------------

    def before_step(self, step: int) -> list[tuple[dict, dict | None]]:
        """Decisions to apply before ``step``, the same on every rank, in order: a background
        result rank 0 flagged in an earlier all-reduce, then a forced re-plan due now. Each is
        (replan event, plan JSON or None). The engine skips one planned against a plan that is
        no longer running (``event["from"]``)."""
        import torch.distributed as dist

        out = []
        if self.ready:
            obj = [None]
            if self.rank == 0:
                obj[0], self._result = self._result, None
            dist.broadcast_object_list(obj, src=0)
            self.ready = False
            if obj[0] is not None:
                ev = obj[0].event        # detected before step ev['step'], adopted now
                out.append((dict(ev, step=step, detected=ev["step"]), obj[0].plan))
        while self.forced and self.forced[0] < step:
            self.forced.pop(0)                       # resumed past it
        if self.forced and self.forced[0] == step:
            self.forced.pop(0)
            obj = [None]
            if self.rank == 0:
                obj[0] = self._forced(step)
            dist.broadcast_object_list(obj, src=0)
            out.append((obj[0].event, obj[0].plan))
        return out

    def switched(self, plan: Plan, rates: list[float] | None) -> None:
        """After any switch (adaptive, forced or scripted): cost units of the new plan, the rates
        it was made for, and results planned against the old one become stale."""
        tp = nominal_tp(plan, at_least=self.tp)
        if tp != self.tp:       # engine API without a nominal tp: the plans' TP sizes set it
            self.tp, self._problem = tp, None
            self.slowdown = self._slowdown(tp)
        self.units = cost_units(plan, self.world, self.tp, self.slowdown, self.head)
        self.shape = tuple(cost_shape(plan, self.world).T)
        self.probe_ref = probe_reference(self.units)
        self.step_times.clear()
        self._skip = 1
        self._probe_s = 0.0                  # timed under the old plan
        self._generation += 1
        self._result = None                  # planned against the old plan, never flagged
        if plan.locate(self.rank) is not None and self.rank != self.probe_ref:
            self._probe_block = None         # back at work: free the probe's block
        if self.det is not None:
            self.det.planned_for(rates if rates is not None else self._normalised())

    def considered(self, rates: list[float] | None) -> None:
        """A planning attempt that kept the running plan: its rates are now the reference."""
        if self.det is not None:
            self.det.planned_for(rates if rates else self._normalised())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- rank 0 internals ---------------------------------------------------------------------

    def _normalised(self) -> list[float]:
        """Today's rates as the detector reads them (healthy -> 1.0, unmeasured -> planned)."""
        return [round(float(x), 3) for x in self.det.normalise(self.measured)]

    def _job_problem(self) -> Problem | None:
        if self._problem is None and self.disabled_reason is None:
            e = self.engine
            try:
                gpn = e.settings.gpus_per_node         # resolved by the engine
                dev = self.s.device_mb or device_memory_mb(e.device, min(gpn, self.world))
                mem = memory_model(e.param_table, e.model_cfg, e.plan.micro_batch_size,
                                   e.seq_len, e.precision.mixed, dev,
                                   switch_buffer_mb=SWITCH_BUFFERS * e.settings.migrate_bucket_mb)
                pr = job_problem(self._first_plan, self.world, gpn, self.tp, self.slowdown, mem,
                                 self.head)
                self._problem = fit_running_plan(pr, e.plan)
            except (PlanError, ValueError) as err:
                self.disabled_reason = f"the running job cannot be planned for: {err}"
        return self._problem

    def _request(self, trigger: str, rates: list[float], step: int) -> None:
        pr = self._job_problem()
        if pr is None:
            self._result = self._error(trigger, step, self.disabled_reason)
            return
        pr = pr.with_rates({d: r for d, r in enumerate(rates) if r > 1.0},
                           current_plan=self.engine.plan)
        self._pending = {"trigger": trigger, "rates": rates, "step": step, "problem": pr,
                         "gen": self._generation, "t0": time.perf_counter()}
        self._client.request({"problem": pr.to_json(), "seed": step, "forced": trigger == "forced",
                              "time_limit": self.s.planner_time_limit_s,
                              "min_improvement": self.s.min_improvement})

    def _collect(self, answer: dict | None = None) -> None:
        """Turn the worker's answer (if any) into a decision (stale ones are dropped)."""
        p = self._pending
        if p is None:
            return
        ans = answer if answer is not None else self._client.poll()
        if ans is None:
            return
        self._pending = None
        if p["gen"] != self._generation:
            return
        if "error" in ans:
            self._result = self._error(p["trigger"], p["step"], f"planning failed: {ans['error']}")
            return
        new = Plan.from_json(ans["plan"])
        cur = self.engine.plan
        nbytes = self._bytes_for(new) if new.id != cur.id else 0
        step_s = float(np.median(self.step_times)) if self.step_times else None
        self._result = decide(p["problem"], cur, new, p["trigger"], p["rates"], p["step"],
                              time.perf_counter() - p["t0"], step_s, nbytes,
                              self._migrate_s_for(nbytes), self.s.horizon_steps)

    def _forced(self, step: int) -> Decision:
        if self._client is None:
            return self._error("forced", step, "no planner (a single rank)")
        if self._pending is not None:              # finish (and drop) what is in flight
            self._collect(self._client.wait(self.FORCED_TIMEOUT_S))
            self._result = None
        self._request("forced", self._normalised(), step)
        if self._pending is not None:
            self._collect(self._client.wait(self.FORCED_TIMEOUT_S))
        res, self._result = self._result, None
        return res

    def _error(self, trigger: str, step: int, why: str) -> Decision:
        return Decision({"event": "replan", "step": step, "trigger": trigger, "adopted": False,
                         "reason": why, "measured_rates": as_list(self.measured)}, None)

    def _bytes_for(self, new: Plan) -> int:
        from .migrate.transfer import Layout, transfer_plan

        e = self.engine
        pb = e.precision.dtype.itemsize if e.precision.mixed else 4
        return transfer_plan(Layout(e.plan, e.zero_stage), Layout(new, e.zero_stage),
                             e.param_table, mixed=e.precision.mixed, param_bytes=pb,
                             gpus_per_node=e.settings.gpus_per_node).bytes

    def _migrate_s_for(self, nbytes: int) -> float:
        """Predicted switch seconds: bytes ÷ the effective bandwidth of earlier switches
        (``migrate_gbps`` until one was measured), plus the fixed part of a switch that moved
        nothing (0.05 s until one was measured)."""
        done = [m for m in self.engine.migrations if m.bytes > 0 and m.seconds > 0]
        bw = (sum(m.bytes for m in done) / sum(m.seconds for m in done)) if done \
            else self.s.migrate_gbps * 1e9
        fixed = min((m.seconds for m in self.engine.migrations if m.bytes == 0), default=0.05)
        return fixed + nbytes / bw
