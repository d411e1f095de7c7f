"""Issue 52, items 2 and 3, at replay scale (64 GPUs: TP 8, 4 stages, 2 pipelines; the real
loop on the simulated clock, ``replay/loop.py``): a straggler is answered at once by a re-split
that moves nothing, before the planner's answer; a GPU that flaps every few minutes does not
make the loop thrash."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import malleus_ds.adaptive.stragglers as stragglers
from malleus_ds.problem import Problem
from malleus_ds.replay.regimes import generate
from malleus_ds.replay.summary import replay
from malleus_ds.replay.trace import Event, make_trace

ROOT = Path(__file__).resolve().parents[3]
POLICIES = ["static", "rebalance-data", "oracle", "malleus"]


def _problem() -> Problem:
    return Problem.from_json(json.loads((ROOT / "examples/problem_64gpu_one_slow.json")
                                        .read_text()))


def test_a_straggler_is_answered_by_a_free_resplit_before_the_planner():
    """Node 1 (GPUs 8-15) at rate 1.5 from 600 s to 1800 s of an hour; the planner charged
    30 s a request. The first switch is the running layout re-split (no byte, no group, every
    buffer kept, no pause), one detection after the onset; the planner's answer comes 30 s
    after the request and is judged against it."""
    tr = make_trace([Event(600.0, 1800.0, g, 1.5) for g in range(8, 16)], 64, hours=1.0)
    res = replay(_problem(), tr, 12.0, POLICIES, charge=lambda wall, req: 30.0)
    ev = [e for e in res["events"] if e["policy"] == "malleus"]
    first, planned = ev[0], ev[1]
    assert first["trigger"] == "onset" and first["adopted"] and first["planning_s"] == 0.0
    assert first["bytes"] == 0 and first["buffers_kept"] and first["new_groups"] == 0
    assert first["migration_s"] == 0.0 and first["won_s"] > 0
    assert planned["trigger"] == "onset" and planned["planning_s"] == 30.0
    asked = first["change_s"] + first["detection_s"]          # the loop asked the planner
    assert first["t_s"] < asked + 30.0 <= planned["t_s"]
    pol = res["policies"]
    assert pol["malleus"]["vs_static"] > 1.0 and pol["malleus"]["of_oracle_gain"] > 0.5


@pytest.mark.parametrize("hold", [True, False])
def test_a_flapping_gpu_does_not_make_the_loop_thrash(monkeypatch, hold):
    """One GPU flapping (2-4 minutes slow at 1.6-1.9x, 2-4 minutes healthy) for an hour. The
    loop holds it slow once it has flapped (``stragglers.FLAP_ENDS``): a handful of switches,
    at least 0.995 x static and most of the oracle's gain. Without the hold (the control) it
    follows every flip a detection late: several times the switches, and less than half of
    the oracle's gain."""
    if not hold:
        monkeypatch.setattr(stragglers, "FLAP_ENDS", 10 ** 9)
    tr = make_trace(generate("flapping", 64, 1.0, seed=0), 64, hours=1.0)
    assert len({e.gpu for e in tr.events}) == 1 and len(tr.events) >= 8
    res = replay(_problem(), tr, 12.0, POLICIES, charge=lambda wall, req: 0.25)
    m = res["policies"]["malleus"]
    if hold:
        assert m["switches"] <= 10 and m["vs_static"] >= 0.995      # measured: 8
        assert m["of_oracle_gain"] > 0.6
    else:
        assert m["switches"] >= 15 and m["of_oracle_gain"] < 0.5
