"""Suite-wide settings and markers. Every test under ``tests/integration/`` (and the README's
own commands, ``tests/test_readme_commands.py``) starts processes and is marked
``integration``; ``tests/unit/`` starts none (the planner worker of the adaptive loop aside:
it is the loop's own process). ``slow``: a single test that takes 20 s or more on 2 cores.

    pytest tests/unit                      # the fast part while working (about 3 min on 2 cores)
    pytest -m "not slow"                   # everything but the slowest tests
    bash scripts/test.sh                   # everything (CI)
"""
import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_HERE = Path(__file__).resolve().parent
_INTEGRATION = (_HERE / "integration", _HERE / "test_readme_commands.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        p = Path(str(item.fspath)).resolve()
        if any(p == q or q in p.parents for q in _INTEGRATION):
            item.add_marker(pytest.mark.integration)
