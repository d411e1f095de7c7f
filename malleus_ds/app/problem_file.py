"""Read a problem JSON as the commands do: the file, its optional ``comm`` section and its
``current_plan`` checked, errors as ``PlanError`` naming what is wrong."""
from __future__ import annotations

from ..plan import PlanError
from ..problem import Problem


def load_problem(path: str) -> Problem:
    from ..cost import comm_spec

    pr = Problem.load(path)
    comm_spec(pr)  # validates the optional comm section
    if pr.current_plan is not None:
        from ..cost import validate_for_problem

        try:
            validate_for_problem(pr, pr.current_plan)
        except PlanError as e:
            raise PlanError(f"problem.current_plan is invalid: {e}") from None
    return pr
