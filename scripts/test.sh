#!/usr/bin/env bash
# Set up .venv (as scripts/run.sh), then run the whole test suite; it must stay under 20 minutes
# on 2 cores. Three passes:
#   1. tests/unit and the tests that start processes but check values only (losses, files,
#      messages), over one pytest-xdist worker more than there are cores: a launch spends
#      seconds in one process (Hydra, imports) and a rank waits on its peers, and the unit tests
#      fill those gaps. Each file's tests stay on one worker (--dist loadfile): most share one
#      cached multi-rank run or a module fixture, which a second worker would run again; the
#      longest file goes first (tests/conftest.py FIRST_FILES);
#   2. the tests that wait on deaths, deadlines and restarts (`patient`, tests/conftest.py),
#      two files at a time: their bounds hold under load, and they wait more than they compute
#      (beside pass 1 they only moved CPU into it: session 33);
#   3. the tests that read timings (`alone`), one at a time, with the cores to themselves.
#      When MALLEUS_TEST_BESIDE names a file, pass 2 first waits for it to exist: CI (.ci/run)
#      runs other checks beside pass 1 and says so that way.
# The slowest tests of each pass are listed at its end. Extra arguments: one plain pytest run
# with them instead (e.g. `bash scripts/test.sh tests/unit/planner -x`).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# bytecode for the repository's own modules, written once: every rank, launcher and agent imports
# them, and with PYTHONDONTWRITEBYTECODE set (as on these machines) each would compile them
# again (about 0.2 CPU s a process, some 400 processes)
python -m compileall -q -j 0 malleus_ds launch kernels tests > /dev/null || true
# the cores this process may use (not `nproc`: it honours OMP_NUM_THREADS, which setup.sh sets to 1)
workers="${MALLEUS_TEST_WORKERS:-$(python -c 'import os; print(len(os.sched_getaffinity(0)) + 1)')}"
status=()
python -m pytest -q -n "$workers" --dist loadfile --durations=20 -m "not alone and not patient" \
  && status+=(0) || status+=($?)
if [ -n "${MALLEUS_TEST_BESIDE:-}" ]; then
  echo "[test] waiting for the checks beside pass 1 ($MALLEUS_TEST_BESIDE), at most 10 minutes"
  for _ in $(seq 300); do [ -e "$MALLEUS_TEST_BESIDE" ] && break; sleep 2; done
fi
python -m pytest -q -n 2 --dist loadfile --durations=10 -m patient --ignore=tests/unit \
  && status+=(0) || status+=($?)
python -m pytest -q --durations=15 -m alone --ignore=tests/unit \
  && status+=(0) || status+=($?)
echo "[test] exit status of the passes (unit and shared, patient, alone): ${status[*]}"
[ "${status[*]}" = "0 0 0" ]
