"""What a replayed switch is charged (replay/costs.py): only what the engine pays. A re-split
moves no bytes, creates no group and keeps every buffer; a switch back to a recent layout
creates no group; a layout never held creates groups and is charged their communicators."""
from __future__ import annotations

import pytest

from malleus_ds.problem import Problem
from malleus_ds.migrate.group_sets import GroupMirror
from malleus_ds.replay.costs import MigrationCost, keeps_buffers
from malleus_ds.replay.job import problem_job
from tests.unit.test_group_sets import layouts

from .test_run import MEMORY

C = MigrationCost(communicators_s=5.0, warmup_steps=0.5)


def _spec(plan):
    pr = Problem.from_json({
        "version": 1, "name": "pp2dp2", "cluster": {"nodes": 2, "gpus_per_node": 2},
        "model": {"num_layers": 8},
        "training": {"global_batch_size": 16, "micro_batch_size": 1, "tp": 1, "pp": 2, "dp": 2},
        "cost": {"tp_slowdown": {"1": 1.0}}, "rates": {}, "current_plan": None,
        "memory": MEMORY})
    return problem_job(pr, plan)


def test_a_resplit_costs_nothing():
    A, A2, *_ = layouts()
    g = GroupMirror(A, 4)
    assert keeps_buffers(A, A2) and keeps_buffers(A, A)
    m = C.of_switch(_spec(A), A, A2, new_step_s=2.0, held=g.live)
    assert m.bytes == 0 and m.seconds == 0.0
    assert m.terms == {"transfer_s": 0.0, "communicators_s": 0.0, "warmup_s": 0.0,
                       "fixed_s": 0.0, "new_groups": 0, "buffers_kept": True}
    kept = MigrationCost(warmup_kept_steps=0.1, fixed_s=0.2)      # both overridable
    assert kept.of_switch(_spec(A), A, A2, 2.0).seconds == pytest.approx(0.2 + 0.1 * 2.0)


def test_a_layout_never_held_pays_its_communicators_and_a_recent_one_does_not():
    A, A2, B, Cc, D = layouts()
    spec = _spec(A)
    g = GroupMirror(A, 4)
    new = C.of_switch(spec, A, B, 2.0, held=g.live)
    assert not keeps_buffers(A, B)
    assert new.bytes > 0 and new.terms["new_groups"] > 0
    assert new.seconds == pytest.approx(new.terms["transfer_s"] + 5.0 + 0.5 * 2.0, abs=1e-3)
    assert new.seconds == C.of_switch(spec, A, B, 2.0).seconds     # default: old's sets held
    g.switch(B)
    back = C.of_switch(spec, B, A, 2.0, held=g.live)                # A is a recent layout
    assert back.terms["communicators_s"] == 0.0 and back.terms["new_groups"] == 0
    assert back.bytes > 0 and back.terms["warmup_s"] == 1.0         # state and buffers move
    # C holds a set B does not; from C back to B (still recent): no group
    g.switch(Cc)
    assert C.of_switch(spec, Cc, B, 2.0, held=g.live).terms["communicators_s"] == 0.0
    g.switch(D), g.switch(B)                        # A is not among the last 3 layouts now
    assert C.of_switch(spec, B, A, 2.0, held=g.live).terms["communicators_s"] == 5.0


def test_new_cost_terms_are_checked_by_name():
    assert MigrationCost.parse("fixed_s=0.5,warmup_kept_steps=0.1").fixed_s == 0.5
    with pytest.raises(ValueError, match=r"--switch-costs: fixed_s=-1.0 must be >= 0"):
        MigrationCost.parse("fixed_s=-1")
