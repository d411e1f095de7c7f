"""The step loop's contract (``malleus_ds/steploop.py``): the re-plan decision renders the
metrics.jsonl ``replan`` line with the keys and order the run files have always had, and both
the engine's no-loop hooks and the adaptive loop implement the hook protocol."""
from __future__ import annotations

from malleus_ds.steploop import NoLoop, ReplanDecision, StepLoop

PLANNED_KEYS = ["event", "step", "trigger", "measured_rates", "from", "to", "planned",
                "planning_s", "predicted_step_s", "predicted_migration_s", "bytes", "adopted",
                "reason"]


def _planned(**kw) -> ReplanDecision:
    base = dict(step=9, trigger="onset", adopted=True, reason="gain", plan={"id": "b"},
                trigger_rates=(1.0, 5.02), from_plan="a", to_plan="b", planned="b",
                planning_s=0.5, predicted_step_s=(1.0, 0.6), predicted_migration_s=0.1,
                bytes=12)
    return ReplanDecision(**{**base, **kw})


def test_a_planned_decision_renders_its_line_in_the_runs_key_order():
    d = _planned()
    line = d.line()
    assert list(line) == PLANNED_KEYS
    assert line["measured_rates"] == [1.0, 5.02] and line["predicted_step_s"] == [1.0, 0.6]
    assert d.measured == d.made_for == (1.0, 5.02)
    back = _planned(rates_for=(1.0, 10.0), check_step=7, link_rates={"0-1": 3.0},
                    measured_link_rates={"0-1": 2.9}, comm={"a": 1.0}).at(11)
    assert list(back.line()) == PLANNED_KEYS + ["rates_for", "check_step", "link_rates",
                                                "measured_link_rates", "comm", "detected"]
    assert (back.step, back.detected, back.made_for) == (11, 9, (1.0, 10.0))
    assert back.line()["rates_for"] == [1.0, 10.0]


def test_a_failed_decision_reports_the_raw_estimate():
    d = ReplanDecision.failed("forced", 4, "no planner (a single rank)", [1.0, None])
    assert list(d.line()) == ["event", "step", "trigger", "adopted", "reason", "measured_rates"]
    assert d.line()["measured_rates"] == [1.0, None] and d.measured == (1.0, None)
    assert d.plan is None and d.from_plan is None and d.trigger_rates is None


def test_a_stale_decision_keeps_the_running_plan():
    s = _planned().stale("c")
    assert s.plan is None and not s.adopted and s.to_plan == "c"
    assert s.reason == "stale: planned against a, running c"
    assert list(s.line()) == PLANNED_KEYS


def test_the_no_loop_and_the_adaptive_loop_implement_the_hooks():
    from malleus_ds.adaptive.control import Controller

    assert isinstance(NoLoop(2), StepLoop) and NoLoop(2).measures_links is False
    hooks = [m for m in vars(StepLoop) if not m.startswith("_")]
    assert "measures_links" in hooks and "before_step" in hooks and len(hooks) == 12
    assert [m for m in hooks if not hasattr(Controller, m)] == []


def test_the_replays_loop_imports_nothing_from_the_engine():
    """The replay drives the loop through the contract (``StepSums``, ``ReplanDecision``,
    ``REF_RUNS``), not the engine's modules."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "malleus_ds" / "replay"
    for name in ("loop.py", "sim_planner.py"):
        tree = ast.parse((root / name).read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in mods if m.split(".")[-1] == "engine" or ".engine" in f".{m}"
                    or m.startswith("engine")], (name, mods)
