"""The planner imports neither torch nor deepspeed nor omegaconf (checked in a fresh interpreter)."""
from __future__ import annotations

from tests.unit.planner.test_search import EXAMPLES


def test_planner_imports_neither_torch_nor_deepspeed_nor_omegaconf():
    import subprocess
    import sys

    code = ("import sys\n"
            "from malleus_ds.problem import Problem\n"
            "from malleus_ds.planner import plan\n"
            "import malleus_ds.cost, malleus_ds.simulate, malleus_ds.app.cli\n"
            f"pr = Problem.from_json({EXAMPLES['problem_32gpu_two_slow']!r})\n"
            "plan(pr, time_limit=0.5)\n"
            "bad = [m for m in ('torch', 'deepspeed', 'omegaconf') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
