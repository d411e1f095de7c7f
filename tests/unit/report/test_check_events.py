"""malleus_ds/report/check_events.py: plan checks read back from metrics.jsonl events, their lines."""
from __future__ import annotations

from malleus_ds.report.check_events import (
    Check,
    checks_line,
    checks_of,
    format_check,
    replan_outcome)
from malleus_ds.report.metrics import format_event


def check(step, outcome, ratio=2.093, expected=0.43, plan="plan-b"):
    return {"event": "check", "step": step, "plan": plan, "outcome": outcome,
            "expected_s": expected, "measured_s": round(expected * ratio, 4), "ratio": ratio,
            "margin": 0.3, "expected_from": "healthy pace"}


def missed_replan(step, adopted=True, back=False, frm="plan-b", to="plan-c"):
    ev = {"event": "replan", "step": step, "trigger": "missed", "from": frm,
          "to": to if adopted else frm, "adopted": adopted, "reason": "gain 1.00 s > migration"}
    if back:
        ev.update(rates_for=[1.0, 1.0], reason=f"missed its promise and the planner found "
                                                f"nothing better (x); back to {to}, measured "
                                                f"0.400 s/step against 0.900 s now")
    return ev


def test_each_miss_gets_the_outcome_of_the_re_plan_after_it():
    evs = [{"event": "replan", "step": 9, "trigger": "onset", "from": "plan-a", "to": "plan-b"},
           check(12, "kept", 1.02),
           {"event": "replan", "step": 13, "trigger": "change", "from": "plan-b", "to": "plan-x"},
           check(14, "missed"),
           {"event": "migrate", "step": 15, "from": "plan-b", "to": "plan-a"},
           missed_replan(15, back=True, to="plan-a"),
           check(30, "missed", 1.5, 0.5, plan="plan-a"), missed_replan(31, adopted=False,
                                                                       frm="plan-a"),
           check(50, "missed", 1.4, 0.5, plan="plan-c"), missed_replan(51, to="plan-d"),
           check(70, "missed", 1.6, 0.5, plan="plan-d"),          # the run ended first
           {"event": "check", "step": 80, "outcome": "unknown"}]  # not a verdict: skipped
    cs = checks_of(evs)
    assert [(c.step, c.outcome, c.then) for c in cs] == [
        (12, "kept", None), (14, "missed", "back to plan-a"), (30, "missed", "kept plan-a"),
        (50, "missed", "adopted plan-d"), (70, "missed", None)]
    assert cs[1] == Check(14, "missed", "plan-b", 0.43, 0.9, 2.093, "back to plan-a")
    assert checks_line(cs) == (
        "plan checks: 1 kept, 4 missed (step 14: 2.09x its promise of 0.430 s -> re-planned: "
        "back to plan-a; step 30: 1.50x its promise of 0.500 s -> re-planned: kept plan-a; "
        "step 50: 1.40x its promise of 0.500 s -> re-planned: adopted plan-d; 1 more)")
    assert checks_line(cs[:1]) == "plan checks: 1 kept, 0 missed"
    assert checks_line(()) is None


def test_a_re_plan_before_the_miss_is_not_its_outcome():
    cs = checks_of([missed_replan(10), check(14, "missed")])
    assert cs[0].then is None
    assert checks_line(cs).endswith("(step 14: 2.09x its promise of 0.430 s -> not re-planned)")
    # an error re-plan (no plan ids) keeps the running plan
    assert replan_outcome({"event": "replan", "trigger": "missed", "adopted": False,
                           "reason": "planning failed: x"}) == "kept the running plan"


def test_a_miss_on_the_first_plan_re_plans_under_the_detectors_trigger():
    """The user's first plan has nothing to go back to: the miss re-plans with trigger
    onset/change/recovery, its reason naming the miss; a detector's re-plan is no outcome."""
    why = ("step 0.900 s, 2.09x the promised 0.430 s for 2 step(s): re-planned at once; gain "
           "3.00 s over 100 steps > migration 0.20 s")
    evs = [check(6, "missed", plan="plan-a"),
           {"event": "replan", "step": 6, "trigger": "change", "from": "plan-a", "to": "plan-x",
            "adopted": True, "reason": "gain 1.00 s over 100 steps > migration 0.20 s"},
           {"event": "replan", "step": 7, "trigger": "onset", "from": "plan-a", "to": "plan-b",
            "adopted": True, "reason": why}]
    assert checks_of(evs)[0].then == "adopted plan-b"
    assert checks_of(evs[:2])[0].then is None
    assert format_event(evs[2], short=True) == "replan (onset)\nafter a missed check"
    assert format_event(evs[1], short=True) == "replan (change)"


def test_the_lines_of_a_check_event():
    assert format_event(check(14, "missed")) == (
        "check at step 14: plan-b missed its promise: 0.900 s/step measured, 0.430 s promised "
        "(2.09x, margin 30%, promise from healthy pace)")
    assert format_event(check(20, "kept", 0.95, 0.4)) == (
        "check at step 20: plan-b kept its promise: 0.380 s/step measured, 0.400 s promised "
        "(0.95x, margin 30%, promise from healthy pace)")
    assert format_event(check(14, "missed"), short=True) == "missed ×2.09"
    assert format_check({"event": "check", "step": 3, "outcome": "kept"}) == (
        "check at step 3: the plan kept its promise")
    # a step back after a miss says so on the plot
    assert format_event(dict(missed_replan(15, back=True, to="plan-a"), planning_s=0.5),
                        short=True) == "replan (missed)\nback to previous plan\n0.5 s plan"
    # the steps a miss was measured over, when the event says
    assert "(2.09x, median of 3 steps, margin 30%" in format_event(dict(check(14, "missed"),
                                                                        steps=3))
