"""Rank 0's planner session: the requests the loop sends its planner and the decisions it makes
of the answers (DESIGN.md §6).

A request carries the running job as a planning problem (``replan.job_problem``, built once)
with the rates to plan for and, where links are slow, their measured costs; the planner runs in
its own process (``planner/client.py``; a replay passes one on its simulated clock) while
training continues. An answer becomes a :class:`~malleus_ds.steploop.ReplanDecision` by the cost
rule (``replan.decide``), with the switch's bytes (``migrate/transfer.py``) and predicted
seconds (:meth:`PlannerSession.migrate_s_for`).

**The first response costs nothing.** When a straggler comes, changes or goes, the running
layout with its micro-batches re-split for the new rates (the planner's ``rebalance``
candidate, ``planner.baselines.resplit``) is decided at once, without waiting for the planner:
no rank changes what it holds, so the switch moves no state and creates no group
(:meth:`PlannerSession.first_response`). The planner's answer, which arrives later, is then
judged against that re-split: a layout change is adopted only if its extra gain over the
straggler's expected remaining duration (``stragglers.StragglerWatch.remaining``: the job's
own stragglers' durations over a prior, ``duration.py``), capped by ``horizon_steps``, pays for
its move. A re-split's switch keeps the request in flight (:meth:`PlannerSession.switched`).

An answer to rates that no longer hold is asked again (:meth:`PlannerSession.overtaken`); one
planned against an older plan is dropped. Forced re-plans (``malleus.replan_at``, rates carried
across a restart) are answered at once. Every rank holds one (the scheduled re-plans and the
ready flag are the same everywhere); only rank 0's has a planner.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ..plan import Plan, PlanError, same_stages
from ..problem import Problem
from ..steploop import ReplanDecision
from .detect import trigger_kind
from .link_watch import Links
from .rates import as_list
from .stragglers import Remaining
from .replan import decide, fit_running_plan, fit_switch_seconds, job_memory, job_problem
from .view import LoopView


@dataclass(frozen=True)
class Switched:
    """One switch as the cost rule learns from it: bytes moved, seconds paused, and whether it
    ``kept`` every pipeline's stages (a re-split)."""

    bytes: int
    seconds: float
    kept: bool = False


#: the triggers answered first by a re-split of the running layout (module doc)
FIRST_RESPONSE = ("onset", "change", "recovery", "missed")


class PlannerSession:
    """Rank 0's requests and decisions (module doc); the scheduled re-plans on every rank."""

    #: seconds a forced re-plan waits for the planner worker
    FORCED_TIMEOUT_S = 120.0

    def __init__(self, loop: LoopView, planner: Any, forced: list[int],
                 broadcast: Callable[[list], None] | None = None) -> None:
        """``planner``: rank 0's planner (``request`` / ``poll`` / ``wait`` / ``close``, as
        :class:`~malleus_ds.planner.client.PlannerClient`; None: no planner); ``broadcast``:
        rank 0's ``obj[0]`` to every rank, in place (None: a single process, rank 0's value
        stands)."""
        self.loop = loop
        self.client = planner
        self.broadcast = broadcast
        self.forced = list(forced)        # steps a re-plan is forced before
        self.carried_at: int | None = None   # the step a carried-rates re-plan is due (carry)
        self.pending: dict | None = None  # rank 0: the request the planner is planning
        self.result: ReplanDecision | None = None   # rank 0: a decision not yet flagged
        self.generation = 0               # bumped by every switch: older requests are stale
        self.problem: Problem | None = None
        self.disabled_reason: str | None = None
        self.migrations: list[Switched] = []        # every switch's migration
        self.scale: float | None = None   # seconds per model unit, by the last re-plan

    @property
    def idle(self) -> bool:
        """Nothing asked and nothing decided that is not yet flagged."""
        return self.pending is None and self.result is None

    def switched(self, migration: Any, tp_changed: bool, kept: bool = False) -> None:
        """After a switch: requests and results planned against the old plan are stale, but
        for a request in flight across a switch that ``kept`` every pipeline's stages (a
        re-split: the planner's answer is as good against it, and is judged against it)."""
        if migration is not None:
            self.migrations.append(Switched(migration.bytes, migration.seconds, kept))
        if tp_changed:
            self.problem = None
        if not kept:
            self.generation += 1
        self.result = None                  # planned against the old plan, never flagged

    def job_problem(self) -> Problem | None:
        """The running job as a planning problem (built once; None: it cannot be planned for,
        :attr:`disabled_reason` says why)."""
        if self.problem is None and self.disabled_reason is None:
            lp, j = self.loop, self.loop.spec
            try:
                if j.problem is not None:        # a problem-only job (a replay)
                    self.problem = fit_running_plan(
                        replace(j.problem, rates={}, current_plan=None), lp.plan)
                    return self.problem
                mem = job_memory(j.param_table, j.model_cfg, j.micro_batch_size, j.seq_len,
                                 j.mixed, lp.s.device_mb or j.device_mb, j.device,
                                 lp.job.gpus_per_node, j.migrate_bucket_mb)
                pr = job_problem(self.first_plan, lp.job, lp.work.slowdown, mem, lp.work.head,
                                 activation_checkpointing=lp.work.recompute)
                self.problem = fit_running_plan(pr, lp.plan)
            except (PlanError, ValueError) as err:
                self.disabled_reason = f"the running job cannot be planned for: {err}"
        return self.problem

    @property
    def first_plan(self) -> Plan:
        """The user's layout: the problem's static baseline."""
        return self.loop.first_plan

    def request(self, trigger: str, rates: list[float], step: int, why: str | None = None,
                check_step: int | None = None, note: str | None = None,
                links: Links | None = None) -> None:
        """Ask the planner for ``rates`` and the slow ``links`` (None: today's reading)."""
        lp = self.loop
        pr = self.job_problem()
        if pr is None:
            self.result = self.error(trigger, step, self.disabled_reason)
            return
        pr = pr.with_rates({d: r for d, r in enumerate(rates) if r > 1.0},
                           current_plan=lp.plan)
        links = lp.links.normalised() if links is None else links
        comm = None
        if links:
            comm = lp.links.comm_section(self.seconds_per_unit(pr))
            if comm is None:
                note = "; ".join(x for x in (note, f"slow links {links.text()} left "
                                 f"out: their costs are not measured yet") if x)
                links = Links()
            pr = lp.links.problem(pr, links, comm)
        self.pending = {"trigger": trigger, "rates": rates, "step": step, "problem": pr,
                        "gen": self.generation, "t0": time.perf_counter(), "check": why,
                        "check_step": check_step, "note": note, "links": links,
                        "comm": comm}
        # every rank healthy: no margin, so the plan made for a straggler that has left goes
        # when the user's layout is any faster (the cost rule still weighs the migration; the
        # margin guards against noisy straggler rates, and there are none)
        margin = 0.0 if all(r <= 1.0 for r in rates) and not links else lp.s.min_improvement
        self.client.request({"problem": pr.to_json(), "seed": step, "forced": trigger == "forced",
                             "time_limit": lp.s.planner_time_limit_s,
                             "min_improvement": margin})
        if trigger in FIRST_RESPONSE and not links:
            self.result = self.first_response(pr, trigger, rates, step)
            if self.result is not None and why:        # a missed promise, acted on at once
                self.result = replace(self.result, check_step=check_step,
                                      reason=f"{why}: {self.result.reason}")

    def first_response(self, pr: Problem, trigger: str, rates: list[float],
                       step: int) -> ReplanDecision | None:
        """The running layout re-split for ``pr``'s rates, decided now by the cost rule
        against a re-split's predicted pause (module doc); None: no other split, none valid
        or one not worth it. The planner's answer to the same request follows."""
        from ..cost import check_switch_memory, step_time, validate_for_problem
        from ..planner.baselines import resplit

        cur = self.loop.plan
        new = resplit(pr, cur)
        if new is None or new.id == cur.id:
            return None
        try:
            validate_for_problem(pr, new)
            check_switch_memory(pr, cur, new)
        except PlanError:
            return None
        step_s = self.step_s(pr, cur)
        if self.loop.step_times:         # the calibration the planner's answer is judged by,
            self.scale = step_s / step_time(pr, cur)     # after the re-split cleared them
        res = decide(pr, cur, new, trigger, rates, step, 0.0, step_s, 0,
                     self.migrate_s_for(0, kept=True), self.loop.s.horizon_steps,
                     self.remaining(trigger, rates))
        if not res.adopted:
            return None
        return replace(res, first=True,
                       reason=f"re-split at once, no state moved: {res.reason}")

    def step_s(self, pr: Problem, cur: Plan) -> float | None:
        """The running plan's step seconds: the median of its measured steps; right after a
        switch (none measured yet), the cost model's under ``pr``'s rates, in seconds by
        :meth:`seconds_per_unit`; None: neither known."""
        from ..cost import step_time

        lp = self.loop
        if lp.step_times:
            return float(np.median(lp.step_times))
        unit = self.seconds_per_unit(pr)
        return unit * step_time(pr, cur) if unit else None

    def remaining(self, trigger: str, rates: list[float]) -> Remaining | None:
        """The expected remaining duration of the youngest slowdown among the ranks slow in
        ``rates`` (``stragglers.Remaining``), for a straggler's onset or change, or a missed
        promise; None otherwise (a recovery, a link: the fixed horizon). A flapping rank held
        slow (``Detector.hold``) stays planned slow while it flaps, as a persistent straggler:
        its slowdowns' ends are not the plan's."""
        watch, det = getattr(self.loop, "stragglers", None), self.loop.det
        if trigger not in ("onset", "change", "missed") or watch is None:
            return None
        return watch.remaining([d for d, r in enumerate(rates)
                                if r > 1.0 and not (det is not None and det.hold[d] > 1.0)])

    def collect(self, answer: dict | None = None) -> None:
        """Turn the planner's answer (if any) into a decision (stale ones are dropped)."""
        p = self.pending
        if p is None:
            return
        if self.result is not None:     # a first response not yet shared: the answer waits
            if answer is not None:
                p["answer"] = answer
            return
        ans = answer if answer is not None else p.pop("answer", None) or self.client.poll()
        if ans is None:
            return
        self.pending = None
        if p["gen"] != self.generation or self.overtaken(p):
            return
        if "error" in ans:
            self.result = self.error(p["trigger"], p["step"], f"planning failed: {ans['error']}")
            return
        self.result = self._decided(p, Plan.from_json(ans["plan"]))

    def _decided(self, p: dict, new: Plan) -> ReplanDecision:
        """The cost rule's decision on the planner's ``new`` plan for request ``p``, with a
        missed promise's back-out, its notes and the links it was made for."""
        from ..cost import step_time

        lp = self.loop
        cur = lp.plan
        nbytes, busiest = self.bytes_for(new) if new.id != cur.id else (0, 0)
        step_s = self.step_s(p["problem"], cur)
        if lp.step_times:
            self.scale = step_s / step_time(p["problem"], cur)
        kept = new.id != cur.id and same_stages(cur, new)
        res = decide(p["problem"], cur, new, p["trigger"], p["rates"], p["step"],
                     time.perf_counter() - p["t0"], step_s, nbytes,
                     self.migrate_s_for(nbytes, kept, busiest), lp.s.horizon_steps,
                     self.remaining(p["trigger"], p["rates"]))
        if p.get("check"):           # acting on a missed promise (``Promise.act_on_miss``)
            if p["trigger"] == "missed":
                res = lp.promise.back_out(res, cur, step_s)
            res = replace(res, reason=f"{p['check']}: re-planned at once; {res.reason}",
                          check_step=p["check_step"])      # the check event that missed
            lp.promise.check.acted(changed=res.plan is not None)
        if p.get("note"):
            res = replace(res, reason=f"{p['note']}; {res.reason}")
        if lp.links.active:
            res = replace(res, **_fields(p["links"].json()),
                          **_fields(lp.links.measured_map().json(), "measured_"))
        if p["links"]:
            lp.links.comm = p["comm"]
            res = replace(res, comm={k: round(v, 6) for k, v in p["comm"].items()})
        return res

    def overtaken(self, p: dict) -> bool:
        """Did the rates move while the planner worked (a straggler gone, or a new one)? Then
        its answer is for rates that no longer hold: ask again, at once, for the rates of the
        steps since it asked (once: the answer to that is taken as it comes; fewer than two
        steps since: too few to say). Moved: by the detector's ``change``, or a rank planned
        as slow that now reads healthy; a rise of a rank without work changes nothing (it is
        out already); a rank without two fresh probes or timings has not moved
        (``RateEstimator.read``). Without it a missed promise on a loaded host could send the
        job back to a plan that suspended a rank which had recovered while it was decided
        (DESIGN.md §6)."""
        lp = self.loop
        seen = lp.last_step - p["step"] + 1       # steps measured since it was asked
        if (p["trigger"] in ("forced", "carried") or p.get("note") or lp.det is None
                or seen < 2):
            return False
        was = np.asarray(p["rates"], dtype=np.float64)
        now = lp.det.normalise(lp.est.rates(floor=lp.work.floor, last=seen))
        now = np.where(lp.est.read(seen), now, was)   # no fresh reading: no evidence
        moved = (np.abs(now - was) >= lp.s.detect.change * was) | ((was > 1.0) & (now == 1.0))
        moved &= (lp.units > 0) | (now < was)
        if not moved.any():
            return False
        kind = "missed" if p["trigger"] == "missed" else trigger_kind(now, lp.det.planned)
        note = (f"rates moved from {as_list(was)} to {as_list(now)} while it planned "
                f"(detected before step {p['step']})")
        self.request(kind, [round(float(x), 3) for x in now], lp.last_step + 1,
                     why=p["check"], check_step=p["check_step"], note=note)
        return True

    def share_result(self) -> ReplanDecision | None:
        """Collective: rank 0's decision not yet shared (flagged in an all-reduce), on every
        rank."""
        obj = [None]
        if self.loop.rank == 0:
            obj[0], self.result = self.result, None
        self._broadcast(obj)
        return obj[0]

    def forced_due(self, step: int) -> ReplanDecision | None:
        """Collective: the forced re-plan due before ``step`` (``carried`` where rates carried
        across a restart scheduled it), decided on rank 0, on every rank; None: none due."""
        while self.forced and self.forced[0] < step:
            self.forced.pop(0)                       # resumed past it
        if not (self.forced and self.forced[0] == step):
            return None
        self.forced.pop(0)
        trigger = "carried" if step == self.carried_at else "forced"
        obj = [None]
        if self.loop.rank == 0:
            obj[0] = self.forced_decision(step, trigger)
        self._broadcast(obj)
        return obj[0]

    def _broadcast(self, obj: list) -> None:
        if self.loop.world > 1 and self.broadcast is not None:
            self.broadcast(obj)

    def forced_decision(self, step: int, trigger: str = "forced") -> ReplanDecision:
        """A forced re-plan, answered at once (what is in flight is finished and dropped)."""
        if self.client is None:
            return self.error(trigger, step, "no planner (a single rank)")
        if self.pending is not None:
            self.result = None                       # a first response not shared: dropped
            self.collect(self._answer(self.FORCED_TIMEOUT_S))
            self.result = None
        self.request(trigger, self.loop.normalised(), step)
        if self.pending is not None:
            self.collect(self.client.wait(self.FORCED_TIMEOUT_S))
        res, self.result = self.result, None
        return res

    def wait(self, timeout_s: float = FORCED_TIMEOUT_S) -> None:
        """Block until the re-plan in flight, if any, is decided (with a first response not
        yet shared, the answer waits for it: :meth:`collect`)."""
        if self.pending is not None and self.client is not None and self.result is None:
            self.collect(self._answer(timeout_s))

    def _answer(self, timeout_s: float) -> dict:
        """The answer to the request in flight: one taken while a first response waited to be
        shared, else the planner's, waited for."""
        return self.pending.pop("answer", None) or self.client.wait(timeout_s)

    def error(self, trigger: str, step: int, why: str) -> ReplanDecision:
        return ReplanDecision.failed(trigger, step, why, as_list(self.loop.measured))

    def seconds_per_unit(self, pr: Problem) -> float | None:
        """Seconds of one cost-model unit: the healthy pace, else the last re-plan's
        calibration, else the running plan's median step over its model time now."""
        from ..cost import step_time

        lp = self.loop
        got = lp.promise.pace.scale or self.scale
        if got:
            return got
        if not lp.step_times:
            return None
        try:
            return float(np.median(lp.step_times)) / step_time(pr, lp.plan)
        except (PlanError, ValueError):
            return None

    def bytes_for(self, new: Plan) -> tuple[int, int]:
        """Bytes the switch from the running plan to ``new`` moves (its transfer plan): in
        all, and the most any one rank receives (each rank receives its part over its own
        links, at once)."""
        from ..migrate.transfer import Layout, transfer_plan

        lp, j = self.loop, self.loop.spec
        tp = transfer_plan(Layout(lp.plan, j.zero_stage), Layout(new, j.zero_stage),
                           j.param_table, mixed=j.mixed, param_bytes=j.param_bytes, job=lp.job)
        got: dict[int, int] = {}
        for t in tp.transfers:
            got[t.dst] = got.get(t.dst, 0) + tp.bytes_of(t)
        return tp.bytes, max(got.values(), default=0)

    def migrate_s_for(self, nbytes: int, kept: bool = False,
                      busiest: int | None = None) -> float:
        """Predicted switch seconds. A re-split (``kept``: every pipeline keeps its stages):
        the median pause of the re-splits so far (0.05 s until one was measured). A layout
        change: ``fixed + nbytes / bandwidth`` over the layout changes so far (a re-split's
        pause says nothing of their communicators and warm-up), fitted (least squares) once
        they moved at least two different byte counts; before that, the fixed part is the
        seconds of one that moved nothing (0.05 s until one was measured) and the bandwidth
        that of those that moved bytes; until one was measured, ``migrate_gbps`` per rank for
        the ``busiest`` rank's bytes where given (the ranks receive at once; ``nbytes`` in
        all otherwise). The fixed part is kept apart from the bandwidth: folded in, it would
        overestimate a large switch several times."""
        if kept:
            ms = [m.seconds for m in self.migrations if m.kept]
            return float(np.median(ms)) if ms else 0.05
        ms = [m for m in self.migrations if not m.kept]
        fit = fit_switch_seconds((m.bytes, m.seconds) for m in ms if m.seconds > 0)
        if fit is not None:
            return fit[0] + fit[1] * nbytes
        done = [m for m in ms if m.bytes > 0 and m.seconds > 0]
        fixed = min((m.seconds for m in ms if m.bytes == 0), default=0.05)
        if done:
            return fixed + nbytes * sum(m.seconds for m in done) / sum(m.bytes for m in done)
        moved = nbytes if busiest is None else busiest
        return fixed + moved / (self.loop.s.migrate_gbps * 1e9)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def _fields(links: dict, prefix: str = "") -> dict:
    """``Links.json()``'s ``link_rates`` / ``gpu_link_rates`` as decision fields."""
    return {f"{prefix}{k}": v for k, v in links.items()}
