"""Rank 0's promise and back-out: the running plan held to the step time it was chosen for
(DESIGN.md §6).

A plan the loop switched to promises its cost-model step time under the rates it was made for,
in seconds by the job's healthy pace (measured on the user's first plan with every rank and link
healthy), else by the last re-plan's calibration; the user's own layout promises only the
healthy pace, under the severe rule. The pace check (``pace_check.PaceCheck``) judges the
measured steps against it; a missed promise re-measures and re-plans at once
(:meth:`Promise.act_on_miss`), and when the planner finds nothing better the job goes back to the
plan that ran before when that one was measured clearly faster (:meth:`Promise.back_out`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..plan import Plan, PlanError
from ..steploop import ReplanDecision
from .pace_check import HealthyPace, PaceCheck
from .view import LoopView


class Promise:
    """The running plan's promise, its check, and the plan to go back to (module doc)."""

    def __init__(self, loop: LoopView) -> None:
        self.loop = loop
        self.check = PaceCheck(loop.s.check) if loop.rank == 0 else None
        self.pace = HealthyPace()         # seconds per model unit, from the healthy first plan
        self.previous: tuple | None = None   # (plan, its measured step s, its planned rates)
        self.judge_skip = 1               # steps after a switch the check leaves out
        self.since_switch = 0             # steps measured under the running plan
        self.missed: dict | None = None   # a missed promise the loop has yet to act on
        self.events: list[dict] = []      # rank 0: check events for metrics.jsonl

    def step_done(self, seconds: float) -> None:
        """The step's wall time, judged against the promise; a missed promise is acted on at
        once when nothing is in flight (no step lost waiting)."""
        lp = self.loop
        if self.check is None or not lp.s.enabled or lp.session.client is None:
            return
        first = self.judge_skip > 0          # the first step of a plan: allocation, first
        if first:                            # touch; it counts for the severe rule only
            self.judge_skip -= 1
        else:
            self.track_pace(seconds)
        ev = self.check.observe(lp.last_step, seconds, first=first)
        if ev is not None:
            self.events.append(ev)
            if ev["outcome"] == "missed":
                self.missed = ev
                if lp.session.idle and not lp.ready:
                    self.act_on_miss(lp.last_step)

    def switched(self, step_times: Sequence[float], planned: Sequence[float]) -> None:
        """Before a switch: the plan running now and its measured pace (to go back to), when a
        step was measured; the new plan's judging starts afresh."""
        lp = self.loop
        if lp.det is not None and step_times:
            self.previous = (lp.plan, float(np.median(step_times)),
                             [round(float(x), 3) for x in planned])
        self.judge_skip, self.since_switch, self.missed = 1, 0, None

    def take_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def model_s(self, plan: Plan, rates: Sequence[float | None]) -> float | None:
        """The cost model's step time of ``plan`` under ``rates`` (model units), or None."""
        from ..cost import step_time

        lp = self.loop
        pr = lp.session.job_problem()
        if pr is None:
            return None
        r = {d: float(x) for d, x in enumerate(rates) if x is not None and x > 1.0}
        if lp.links is not None:
            pr = lp.links.problem(pr, lp.links.planned(), lp.links.comm)
        try:
            return step_time(pr.with_rates(r, current_plan=plan), plan)
        except (PlanError, ValueError):
            return None

    def promise(self) -> None:
        """The running plan's expected step seconds under the rates it was planned for (its
        promise), in seconds by the job's healthy pace, else by the last re-plan's calibration.
        Only a plan the loop switched to is checked (the user's first plan promised nothing)."""
        if self.check is None:
            return
        lp = self.loop
        if lp.plan is lp.first_plan and self.previous is None:
            # the user's layout promised nothing; held to the job's healthy pace, severe rule
            healthy = bool(np.all(lp.det.planned == 1.0))
            self.check.expect(lp.plan.id, self.pace.seconds if healthy else None,
                              "healthy pace", severe_only=True)
            return
        scale, why = self.pace.scale, "healthy pace"
        if scale is None:
            scale, why = lp.session.scale, "re-plan calibration"
        T = self.model_s(lp.plan, lp.det.planned) if scale else None
        self.check.expect(lp.plan.id, T * scale if T else None, why)

    def track_pace(self, seconds: float) -> None:
        """A step of the first plan with every rank and link healthy: the job's healthy pace."""
        lp = self.loop
        if lp.plan.id != lp.first_plan.id or not np.all(
                lp.det.normalise(lp.measured) == 1.0) or np.isnan(lp.measured).any():
            return
        if lp.links.planned() or lp.links.normalised():
            return                   # a slow link: not the job's healthy pace
        if self.pace.model_s is None:
            T = self.model_s(lp.first_plan, [1.0] * lp.world)
            if T is None:
                return
            self.pace.model_s = T
        self.pace.add(seconds, self.pace.model_s)
        if self.previous is None:
            self.promise()           # the first plan: its promise is the pace measured so far

    def act_on_miss(self, step: int) -> None:
        """The running plan broke its promise: re-measure (the slow steps only, at most those
        since the switch), then re-plan at once, past the detector's hysteresis (the session
        decides; nothing better found: back to the previous plan if it ran faster,
        :meth:`back_out`). On the user's first plan (nothing to go back to) only when the fresh
        rates moved from the planned ones by the detector's ``change``: a host slow for
        everyone is no reason to plan, and a healthy run then never re-plans."""
        lp = self.loop
        ev, self.missed = self.missed, None
        last = max(2, min(ev.get("steps", 2), max(self.since_switch, 2)))
        fresh = lp.est.rates(floor=lp.work.floor, last=last)
        if not np.isnan(fresh).all():
            lp.measured = fresh
        r, p = lp.det.normalise(lp.measured), lp.det.planned
        why = (f"step {ev['measured_s']:.3f} s, {ev['ratio']:.2f}x the promised "
               f"{ev['expected_s']:.3f} s for {ev.get('steps', 1)} step(s)")
        moved = bool(np.any(np.abs(r - p) >= lp.s.detect.change * p))
        if not moved and not self.can_go_back(r, ev["measured_s"]):
            self.check.acted(changed=False)     # nothing to plan for, nothing to go back to
            return
        if self.previous is None:
            kind = ("recovery" if np.all(r == 1.0) else
                    "onset" if np.all(p == 1.0) else "change")
        else:
            kind = "missed"
        lp.session.request(kind, lp.normalised(), step + 1, why=why, check_step=ev["step"])

    def can_go_back(self, rates: Sequence[float | None], step_s: float | None) -> bool:
        """Is the plan that ran before this one worth going back to: measured clearly faster
        (by the check's margin) than this one runs now, and under ``rates`` (re-measured) not
        predicted slower than this one by more than that margin? (A host that got slower for
        everyone, or a straggler that has since left, makes the old measurement no reason to
        return to a plan made for it.)"""
        if self.previous is None or step_s is None:
            return False
        lp = self.loop
        prev, prev_s, _ = self.previous
        m = lp.s.check.margin
        if prev.id == lp.plan.id or not prev_s * (1 + m) < step_s:
            return False
        t_prev, t_cur = self.model_s(prev, rates), self.model_s(lp.plan, rates)
        return t_prev is not None and t_cur is not None and t_prev <= t_cur * (1 + m)

    def back_out(self, res: ReplanDecision, cur: Plan,
                 step_s: float | None) -> ReplanDecision:
        """After a missed promise: the planner's better plan if it found one, else the plan that
        ran before this one when it is worth going back to (:meth:`can_go_back`)."""
        if res.plan is not None or not self.can_go_back(res.measured, step_s):
            return res
        prev, prev_s, prev_rates = self.previous
        return replace(res, to_plan=prev.id, adopted=True, rates_for=tuple(prev_rates),
                       predicted_step_s=(round(step_s, 4), round(prev_s, 4)),
                       reason=f"missed its promise and the planner found nothing better "
                              f"({res.reason}); back to {prev.id}, measured "
                              f"{prev_s:.3f} s/step against {step_s:.3f} s now",
                       plan=prev.to_json())
