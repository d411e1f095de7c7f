"""What the planning commands share (``cli.py``, ``replay_cli.py``): reading a problem JSON (the
file, its optional ``comm`` section and its ``current_plan`` checked, errors as ``PlanError``
naming what is wrong), and failing on bad input with one line and exit code 2."""
from __future__ import annotations

import sys

from ..plan import PlanError
from ..problem import Problem

EXIT_BAD_INPUT = 2


def fail(prog: str, msg: str) -> int:
    """``<prog>: error: <msg>`` on stderr, like argparse's own usage errors; the exit code."""
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


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
