#!/usr/bin/env bash
# Set up .venv (as scripts/run.sh), then run the whole test suite; it must stay under 20 minutes
# on 2 cores. Three passes (pytest-xdist spreads the first two over the cores):
#   1. tests/unit: one process per test, no ranks;
#   2. the tests that start processes and check values only (losses, files, messages), two at a
#      time: a rank waiting on its peers leaves a core to the other test. Each file's tests stay
#      on one worker (--dist loadfile): most share one cached multi-rank run or a module
#      fixture, which a second worker would run again (the longest file goes first:
#      tests/conftest.py FIRST_FILES);
#   3. the tests that read timings (marked `alone`, tests/conftest.py), one at a time, with the
#      cores to themselves.
# The slowest tests of each pass are listed at its end. Extra arguments: one plain pytest run
# with them instead (e.g. `bash scripts/test.sh tests/unit/planner -x`).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# the cores this process may use (not `nproc`: it honours OMP_NUM_THREADS, which setup.sh sets to 1)
workers="${MALLEUS_TEST_WORKERS:-$(python -c 'import os; print(len(os.sched_getaffinity(0)))')}"
status=()
python -m pytest -q -n "$workers" --durations=10 tests/unit && status+=(0) || status+=($?)
python -m pytest -q -n "$workers" --dist loadfile --durations=15 -m "not alone" --ignore=tests/unit \
  && status+=(0) || status+=($?)
python -m pytest -q --durations=15 -m alone --ignore=tests/unit && status+=(0) || status+=($?)
echo "[test] exit status of the three passes (unit, shared, alone): ${status[*]}"
[ "${status[*]}" = "0 0 0" ]
