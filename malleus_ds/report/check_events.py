"""A run's plan checks, read back from its ``check`` events (pure: event lines in, text out).

The adaptive loop holds every plan it switched to to the cost model's promise
(``pace_check.py``; DESIGN.md §6, "The loop checks its own predictions") and writes each verdict
to metrics.jsonl::

    {"event": "check", "step": 14, "plan": "plan-f02193b9", "outcome": "missed",
     "expected_s": 0.43, "measured_s": 0.9, "ratio": 2.093, "margin": 0.3,
     "expected_from": "healthy pace"}

A ``missed`` check is usually followed by the re-plan it caused (the loop re-plans at once,
``control.py``): trigger ``missed`` on a plan the loop switched to, else (the user's first plan)
``onset``/``change``/``recovery``, its reason then naming the miss ("... re-planned at once;
..."). It adopted the planner's better plan, went back to the previous plan (``rates_for`` set;
its reason says "back to ..."), or kept the running one. A miss where no rank's rate moved and
no previous plan is worth going back to is not re-planned at all. :func:`checks_of` pairs each
missed check with the first such re-plan after it; :func:`checks_line` is the what-if account's
line (``whatif.py``); :func:`format_check` the run summary's and progress bar's line and the
label ``malleus-plot`` draws (``metrics.format_event``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

MAX_LISTED = 3     # missed checks spelled out in the account's line; the rest are counted
ACTED_ON_MISS = "re-planned at once"    # in the reason of a re-plan a miss caused (control.py)


@dataclass(frozen=True)
class Check:
    """One ``check`` event, and for a miss what the re-plan after it did."""

    step: int
    outcome: str                   # "kept" | "missed"
    plan: str | None = None
    expected_s: float | None = None
    measured_s: float | None = None
    ratio: float | None = None
    then: str | None = None        # missed: :func:`replan_outcome`; None: not re-planned


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def replan_outcome(ev: Mapping) -> str:
    """What a re-plan did: ``adopted plan-x``, ``back to plan-x`` (the previous plan: the
    switch carries ``rates_for``) or ``kept plan-x`` (not adopted: the running plan stays)."""
    to = ev.get("to")
    if ev.get("adopted", True) is not False and to:
        back = "rates_for" in ev or f"back to {to}" in str(ev.get("reason") or "")
        return f"{'back to' if back else 'adopted'} {to}"
    return f"kept {ev.get('from') or 'the running plan'}"


def caused_by_miss(ev: Mapping) -> bool:
    """A ``replan`` event the loop made because a check missed (module doc)."""
    return ev.get("event") == "replan" and (ev.get("check_step") is not None
                                            or ev.get("trigger") == "missed"
                                            or ACTED_ON_MISS in str(ev.get("reason") or ""))


def checks_of(events: Iterable[Mapping]) -> tuple[Check, ...]:
    """The ``check`` events among ``events`` (file order), each missed one with the outcome of
    the first re-plan a miss caused (:func:`caused_by_miss`) after it, at its step or later."""
    out: list[Check] = []
    waiting: list[int] = []          # indices into out: misses without their re-plan yet
    for ev in events:
        kind = ev.get("event")
        step = _num(ev.get("step"))
        if step is None:
            continue
        if kind == "check" and ev.get("outcome") in ("kept", "missed"):
            out.append(Check(int(step), ev["outcome"], ev.get("plan"), _num(ev.get("expected_s")),
                             _num(ev.get("measured_s")), _num(ev.get("ratio"))))
            if ev["outcome"] == "missed":
                waiting.append(len(out) - 1)
        elif caused_by_miss(ev):
            at = _num(ev.get("check_step"))        # the check it acted on, where recorded
            i = next((i for i in waiting if (out[i].step == at if at is not None
                                             else out[i].step <= step)), None)
            if i is not None:
                waiting.remove(i)
                c = out[i]
                out[i] = Check(c.step, c.outcome, c.plan, c.expected_s, c.measured_s, c.ratio,
                               replan_outcome(ev))
    return tuple(out)


def _miss(c: Check) -> str:
    ratio = f"{c.ratio:.2f}x" if c.ratio is not None else "slower than"
    promise = f" of {c.expected_s:.3f} s" if c.expected_s is not None else ""
    then = f"re-planned: {c.then}" if c.then else "not re-planned"
    return f"step {c.step}: {ratio} its promise{promise} -> {then}"


def checks_line(checks: Iterable[Check]) -> str | None:
    """``plan checks: 4 kept, 1 missed (step 14: 2.09x its promise of 0.430 s -> re-planned:
    back to plan-x)``; None without checks."""
    checks = list(checks)
    if not checks:
        return None
    missed = [c for c in checks if c.outcome == "missed"]
    kept = len(checks) - len(missed)
    line = f"plan checks: {kept} kept, {len(missed)} missed"
    if missed:
        listed = "; ".join(_miss(c) for c in missed[:MAX_LISTED])
        more = len(missed) - MAX_LISTED
        line += f" ({listed}" + (f"; {more} more" if more > 0 else "") + ")"
    return line


def format_check(ev: Mapping, short: bool = False) -> str:
    """A ``check`` event as one line (the run summary, the progress bar), or ``short``: the
    label ``malleus-plot`` draws (``missed ×2.09``)."""
    outcome, ratio = ev.get("outcome"), _num(ev.get("ratio"))
    if short:
        return f"{outcome}" + (f" ×{ratio:.2f}" if ratio is not None else "")
    exp, meas, margin = (_num(ev.get(k)) for k in ("expected_s", "measured_s", "margin"))
    verb = "missed" if outcome == "missed" else "kept" if outcome == "kept" else str(outcome)
    nums = (f": {meas:.3f} s/step measured, {exp:.3f} s promised"
            if exp is not None and meas is not None else "")
    n = _num(ev.get("steps"))
    facts = [f"{ratio:.2f}x" if ratio is not None else None,
             f"median of {n:.0f} steps" if n is not None and n > 1 else None,
             f"margin {100 * margin:.0f}%" if margin is not None else None,
             f"promise from {ev['expected_from']}" if ev.get("expected_from") else None]
    facts = [f for f in facts if f]
    return (f"check at step {ev.get('step')}: {ev.get('plan') or 'the plan'} {verb} its promise"
            + nums + (f" ({', '.join(facts)})" if facts else ""))
