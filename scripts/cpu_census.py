"""A pytest plugin that measures what each test costs in CPU seconds, its processes included.

The suite is bound by CPU: its shared pass keeps both cores busy, so its wall time is its CPU
seconds over the cores, and a test's wall time under load says little about what it costs.
This plugin puts each pytest process (each xdist worker) in a cgroup of its own (cgroup v1
``cpuacct``, so root), which every process it starts inherits: torchrun agents, ranks, fork
servers, planner workers. Around each test it reads the cgroup's ``cpuacct.usage`` and
appends one JSON line to ``$CPU_CENSUS_OUT`` (default ``cpu_census.jsonl``):

    {"id": test id, "worker": xdist worker, "cpu": CPU seconds, "wall": seconds,
     "others": {pid: [CPU seconds during the test, command]}}   # processes alive at its end

A module fixture's cost lands on the first test that uses it. Run it as the suite runs:

    PYTHONPATH=scripts python -m pytest -p cpu_census -n 3 --dist loadfile -m "not alone and not patient"
    python scripts/cpu_census.py cpu_census.jsonl            # CPU seconds per file, largest first
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

ROOT = "/sys/fs/cgroup/cpuacct/cpu_census"
_TCK = os.sysconf("SC_CLK_TCK")
_dir: str | None = None


def _usage() -> float:
    with open(os.path.join(_dir, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def _procs() -> dict[str, tuple[float, str]]:
    """CPU seconds and command of each process in this cgroup."""
    out = {}
    with open(os.path.join(_dir, "cgroup.procs")) as f:
        pids = f.read().split()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                st = f.read()
            with open(f"/proc/{p}/cmdline") as f:
                cmd = f.read().replace("\0", " ")[:120]
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[p] = ((int(fields[11]) + int(fields[12])) / _TCK, cmd)
    return out


def pytest_configure(config):
    global _dir
    if not os.path.isdir(os.path.dirname(ROOT)):
        raise RuntimeError(f"cpu_census needs the cgroup-v1 cpuacct controller at "
                           f"{os.path.dirname(ROOT)} (and root)")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _dir = os.path.join(ROOT, f"{worker}-{os.getpid()}")
    os.makedirs(_dir, exist_ok=True)
    with open(os.path.join(_dir, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def _wrap():
    import pytest

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(item, nextitem):
        before = _procs()
        c0, w0 = _usage(), time.time()
        yield
        c1, w1 = _usage(), time.time()
        me = str(os.getpid())
        others = {p: [round(s - before.get(p, (0.0,))[0], 2), cmd]
                  for p, (s, cmd) in _procs().items() if p != me}
        row = {"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
               "cpu": round(c1 - c0, 2), "wall": round(w1 - w0, 2), "others": others}
        with open(os.environ.get("CPU_CENSUS_OUT", "cpu_census.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    return pytest_runtest_protocol


if "pytest" in sys.modules:
    pytest_runtest_protocol = _wrap()


def per_file(path: str) -> list[tuple[str, float, float, int]]:
    """(file, CPU seconds, wall seconds, tests) from a census file, largest CPU first."""
    acc: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            a = acc[row["id"].split("::")[0]]
            a[0] += row["cpu"]
            a[1] += row["wall"]
            a[2] += 1
    return sorted(((k, *v) for k, v in acc.items()), key=lambda r: -r[1])


if __name__ == "__main__":
    rows = per_file(sys.argv[1] if len(sys.argv) > 1 else "cpu_census.jsonl")
    print(f"{'CPU s':>8} {'wall s':>8} {'tests':>5}  file   (total {sum(r[1] for r in rows):.0f} CPU s)")
    for name, cpu, wall, n in rows:
        print(f"{cpu:8.1f} {wall:8.1f} {n:5d}  {name}")
