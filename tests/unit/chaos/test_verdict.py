"""The campaign's invariants, checked on written run folders (``chaos/verdict.py``)."""
from __future__ import annotations

import json
import os

from malleus_ds.chaos.schedule import Fault, Schedule
from malleus_ds.chaos.verdict import attempts, judge

REF = [5.0 - 0.1 * s for s in range(12)]


def _step(s, loss=None):
    return {"step": s, "loss": REF[s] if loss is None else loss, "samples": 8,
            "step_time_s": 0.1, "compute_s": [0.05, 0.05]}


def _write(tmp_path, rows, latest="global_step12", committed=True):
    run, ck = tmp_path / "run", tmp_path / "ck"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ck.mkdir()
    if latest:
        (ck / "latest").write_text(latest)
        (ck / latest).mkdir()
        if committed:
            (ck / latest / "run.json").write_text("{}")
    return run, ck


def _sched(*faults):
    return Schedule(0, 12, 2, tuple(faults))


def test_a_clean_run_keeps_every_invariant(tmp_path):
    run, ck = _write(tmp_path, [_step(s) for s in range(12)])
    v = judge(_sched(), run, ck, [0], REF, set(), 12.0)
    assert v.ok, v.broken


def test_a_kill_costs_one_restart_and_redone_steps_must_keep_the_losses(tmp_path):
    rows = [_step(s) for s in range(6)] + [
        {"event": "restart", "attempt": 1, "from_step": 4, "world": 2, "lost_steps": 2,
         "torchrun_restarts": 1}] + [_step(s) for s in range(4, 12)]
    run, ck = _write(tmp_path, rows)
    assert judge(_sched(Fault("kill", 5, 1)), run, ck, [0], REF, set(), 12.0).ok
    v = judge(_sched(Fault("freeze", 5, 1, seconds=1.0)), run, ck, [0], REF, set(), 12.0)
    assert v.broken == ["1 restart(s) for 0 death(s) (at most 0): a fault that kills no "
                        "process cost a restart"]


def test_a_lost_node_may_cost_two_restarts_its_loss_and_its_return(tmp_path):
    rows = [_step(s) for s in range(6)] + [
        {"event": "restart", "attempt": 1, "from_step": 4, "world": 1, "lost_steps": 2,
         "torchrun_restarts": 1}] + [_step(s) for s in range(4, 8)] + [
        {"event": "restart", "attempt": 2, "from_step": 8, "world": 2, "lost_steps": 0,
         "torchrun_restarts": 1}] + [_step(s) for s in range(8, 12)]
    run, ck = _write(tmp_path, rows)
    v = judge(_sched(Fault("node_loss", 5, 1, until=7)), run, ck, [0], REF, set(), 12.0)
    assert v.ok and v.restarts == 2, v.broken
    v = judge(_sched(Fault("kill", 5, 1)), run, ck, [0], REF, set(), 12.0)
    assert v.broken == ["2 restart(s) for 1 death(s) (at most 1): a fault that kills no "
                        "process cost a restart"]


def test_the_pace_counts_each_step_once_as_it_last_ran_and_every_switch_pause():
    from malleus_ds.chaos.verdict import pace

    def step(s, t):
        return dict(_step(s), step_time_s=t)

    # step 0 starts the run (left out); steps 4-5 ran twice: the second time counts; the
    # restart's first step (4) is left out too
    # a save's blocking part counts (a rank frozen while the others save shows there)
    rows = [step(0, 9.0), step(1, 1.0), step(2, 1.0),
            {"event": "checkpoint", "step": 2, "seconds": 3.0},
            {"event": "migrate", "step": 3, "seconds": 2.0}, step(3, 1.0), step(4, 5.0),
            step(5, 5.0), {"event": "restart", "attempt": 1, "from_step": 4,
                           "torchrun_restarts": 1}, step(4, 7.0), step(5, 2.0)]
    assert pace(rows) == (1.0 + 1.0 + 1.0 + 2.0 + 3.0 + 2.0) / 4
    assert pace([step(0, 1.0)]) is None


def test_against_stock_the_pace_must_keep_up(tmp_path):
    from malleus_ds.chaos.verdict import Verdict, judge_pace

    ours = [dict(_step(s), step_time_s=0.1) for s in range(12)]
    stock = [dict(_step(s), step_time_s=0.2) for s in range(12)]
    v = Verdict(0)
    judge_pace(v, stock, ours, 0.95)
    assert v.ok and v.stock_pace / v.pace == 2.0
    v = Verdict(0)
    judge_pace(v, ours, stock, 0.95)
    assert v.broken == ["0.50x stock DeepSpeed's throughput under the same slowdowns "
                        "(0.200 s a step against 0.100), under 0.95x"]
    v = Verdict(0)
    judge_pace(v, [], ours, 0.95)
    assert v.broken == ["no steps to compare with stock DeepSpeed's pace"]


def test_a_rerun_after_a_stop_is_no_restart(tmp_path):
    rows = [_step(s) for s in range(6)] + [
        {"event": "restart", "attempt": 1, "from_step": 6, "world": 2, "lost_steps": 0,
         "torchrun_restarts": 0}] + [_step(s) for s in range(6, 12)]
    run, ck = _write(tmp_path, rows)
    v = judge(_sched(Fault("sigterm", 5)), run, ck, [143, 0], REF, set(), 12.0)
    assert v.ok and v.restarts == 0, v.broken


def test_each_broken_invariant_is_named(tmp_path):
    rows = [_step(0), _step(1, loss=9.0), _step(3), _step(2)] + [_step(s) for s in range(4, 11)]
    rows[-1]["step_time_s"] = 99.0
    run, ck = _write(tmp_path, rows, latest="global_step10", committed=False)
    alive = {os.getpid()}
    v = judge(_sched(), run, ck, [1], REF, alive, 12.0)
    text = "\n".join(v.broken)
    assert "the job did not finish: exit code(s) [1]" in text
    assert "steps missing from metrics.jsonl: [11]" in text
    assert "step 1: loss 9.0 against the fault-free" in text
    assert "latest names 'global_step10', not global_step12" in text
    assert f"processes of the job still running: [{os.getpid()}]" in text
    assert "steps longer than the hang timeout + 30 s: [10]" in text


def test_attempts_split_at_restarts_and_at_a_jump_back():
    rows = [_step(0), _step(1), {"event": "restart"}, _step(0), _step(1), _step(2), _step(1)]
    assert attempts(rows) == [[0, 1], [0, 1, 2], [1]]
