"""The planner worker in its own process: a round trip through PlannerClient, and the worker found
from a checkout (adaptive/control.py starts it on rank 0)."""
from pathlib import Path

from malleus_ds.planner.client import PlannerClient
from malleus_ds.plan import Plan
from tests.unit.adaptive.test_control import _problem


def test_planner_client_round_trip_in_its_own_process():
    pr, cur = _problem({2: 4.0})
    c = PlannerClient()
    try:
        c.request({"problem": pr.to_json(), "seed": 1})
        c.request("not json at all")
        a, b = c.wait(60), c.wait(60)
        assert Plan.from_json(a["plan"]).id != cur.id and a["planning_s"] > 0
        assert "error" in b
    finally:
        c.close()
    assert c.proc.poll() is not None                    # closed: the worker exited


def test_the_planner_worker_is_found_from_the_checkout():
    """planner/client.py puts the checkout holding malleus_ds/ on the worker's PYTHONPATH (so a
    checkout that is not pip-installed still starts its planner)."""
    import os

    c = PlannerClient()
    try:
        first = c.env["PYTHONPATH"].split(os.pathsep)[0]
        assert (Path(first) / "malleus_ds" / "planner" / "worker.py").is_file(), first
    finally:
        c.close()
