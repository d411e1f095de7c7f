"""The ``restart`` policy of a replay: on each detected change, save, restart into the new plan
and reload (what a job without live migration does, e.g. DeepSpeed's universal checkpoint or an
elastic restart into a new layout).

Detection is the loop's own rule (``adaptive/detect.Detector``, the same settings) on the
median over ``detect.window`` steps of the true rates, every ``detect.every`` steps, as if every
GPU were measured exactly (a node health monitor; kinder than the loop's own measurement, which
must probe a GPU it took work from). When it triggers, the planner's plan for the true rates
(``Replay.best_plan``, its wall seconds charged while the job trains on) is adopted by a
restart if it differs from the running plan: the job stops for ``RestartCost.seconds`` and
resumes under it. Then the detector plans for those rates, as after any planning attempt.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..adaptive.detect import Detector
from ..adaptive.settings import AdaptiveSettings
from .costs import RestartCost
from .run import PolicyResult, Replay, rate_vector
from .trace import Segment


@dataclass
class RestartResult(PolicyResult):
    restarts: list[dict] = field(default_factory=list)
    plans: dict = field(default_factory=dict)     # every plan it ran, by id


def run_restart(rp: Replay, segs: Sequence[Segment], settings: AdaptiveSettings | None = None,
                cost: RestartCost | None = None, progress=None) -> RestartResult:
    """The ``restart`` policy over ``segs`` (the module docstring)."""
    settings = settings or AdaptiveSettings()
    cost = cost or RestartCost()
    N = rp.problem.num_gpus
    cfg = settings.detect
    det = Detector(N, cfg)
    out = RestartResult("restart")
    plan = rp.static
    t = 0.0
    window: deque[np.ndarray] = deque(maxlen=cfg.window)
    step = 0
    pending: tuple | None = None       # (ready at, plan, rates, detection s, planning s)
    out.plans[plan.id] = plan
    horizon = segs[-1].end_s if segs else 0.0
    # steps after a change (or a restart) by which the detector has triggered or never will
    settle = 3 * cfg.window + cfg.every * (cfg.confirm + cfg.cooldown + 1)
    for si, s in enumerate(segs):
        rates = s.rate_map()
        vec = rate_vector(s, N)
        t = max(t, s.start_s)
        settle_until = step + settle      # step until detection has settled, then jump
        t0, samples = t, 0.0
        while t < s.end_s:
            if pending is not None and t >= pending[0]:
                ready, pending = pending, None
                if ready[1].id != plan.id:
                    t, plan = _restart(out, ready, plan, t, t0, samples, cost, horizon), ready[1]
                    t0, samples = t, 0.0
                    # a restart starts a fresh window: the steps before it ran another plan
                    window.clear()
                    settle_until = step + settle
                    if t >= s.end_s:
                        break
            step_s = rp.step_seconds(plan, rates)
            if step >= settle_until and pending is None:     # nothing can change until the end
                n = int((s.end_s - t) / step_s)
                samples += n * rp.samples_per_step
                t += n * step_s
                step += n
                if t >= s.end_s:
                    break
            window.append(vec)
            if len(window) >= cfg.window and (step + 1) % cfg.every == 0 and pending is None:
                pending = _detect(det, window, rp, t, step_s, s.start_s)
            frac = min(1.0, (s.end_s - t) / step_s) if si == len(segs) - 1 else 1.0
            samples += rp.samples_per_step * frac
            t += step_s
            step += 1
        end = min(t, segs[-1].end_s) if si == len(segs) - 1 else t
        _close(out, t0, end, samples)
        if progress is not None:
            progress(1)
    out.seconds = horizon
    return out


def _restart(out: RestartResult, ready: tuple, plan, t: float, t0: float, samples: float,
             cost: RestartCost, horizon: float) -> float:
    """Restart at ``t`` from ``plan`` into the plan ``ready`` holds (ready at, plan, rates,
    detection s, planning s): close the stretch so far and record the restart and its pause;
    the second the job resumes (it may run on into later segments)."""
    _, new, prates, det_s, plan_s = ready
    _close(out, t0, t, samples)
    stop = t + cost.seconds
    out.restarts.append({"t": round(t, 3), "from": plan.id, "to": new.id,
                         "rates": prates, "seconds": cost.seconds,
                         "detection_s": round(det_s, 3),
                         "planning_s": round(plan_s, 3), **cost.terms()})
    out.plans[new.id] = new
    out.timeline.append((t, min(stop, horizon), 0.0))
    out.switches += 1
    out.migration_s += cost.seconds
    return stop


def _detect(det: Detector, window: deque, rp: Replay, t: float, step_s: float,
            seg_start: float) -> tuple | None:
    """The detector's check on the window's median rates; on a trigger, the planner's plan for
    them, ready after this step and the planner's seconds: (ready at, plan, rates, detection s,
    planning s); None without a trigger."""
    trig = det.check(np.median(np.stack(window), axis=0))
    if trig is None:
        return None
    r = {d: float(x) for d, x in enumerate(trig.rates) if x > 1.0}
    new = rp.best_plan(r)
    planning = rp.plan_seconds.get(tuple(sorted(r.items())), 0.0)
    det.planned_for(list(trig.rates))
    return (t + step_s + planning, new, {str(k): v for k, v in r.items()},
            t + step_s - seg_start, planning)


def _close(out: PolicyResult, t0: float, t1: float, samples: float) -> None:
    out.samples += samples
    if t1 > t0:
        out.timeline.append((t0, t1, samples / (t1 - t0)))
