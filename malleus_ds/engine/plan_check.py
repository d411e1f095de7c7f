"""The checks a plan must pass to run this job, in one place.

MalleusEngine runs them on every rank before any collective (``MalleusEngine.build_plan``: the
starting plan, scripted switches, every ``switch_plan``), and the app runs the same ones at
start-up (``app/runners/malleus_runner.py``), so a bad plan file gives the same words either way.
"""
from __future__ import annotations

from ..job_layout import JobLayout
from ..plan import Plan, PlanError, validate_plan
from .groups import check_world


def check_job_plan(plan: Plan, model, job: JobLayout, where: str = "") -> None:
    """Raise :class:`~malleus_ds.plan.PlanError` unless ``plan`` fits this job: it names only
    launched ranks (``job.world``), is valid for the nominal TP size and the node shape
    (``validate_plan``: layers, batches, TP groups inside a node, ...), and every stage's TP
    size splits ``model`` (its own rule: heads, KV heads, FFN width). ``where`` prefixes the
    stage named in a TP error (e.g. ``"plan "``)."""
    from ..models.base import TPError

    check_world(plan, job.world)
    validate_plan(plan, job, num_layers=model.num_layers)
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            try:
                model.check_tp(st.tp, f"{where}pipelines[{i}].stages[{j}]")
            except TPError as e:
                raise PlanError(str(e)) from None
