#!/usr/bin/env bash
# Set up .venv (as scripts/run.sh), then run the whole test suite; it must stay under 20 minutes
# on 2 cores. Two passes:
#   1. tests/unit: one process per test, no ranks, spread over every core (pytest-xdist);
#   2. everything else (tests that start ranks, launchers and the docs' commands), one test at a
#      time: their ranks take the cores, and a test that reads timings must not share them.
# The slowest tests of each pass are listed at its end. Extra arguments: one plain pytest run
# with them instead (e.g. `bash scripts/test.sh tests/unit/planner -x`).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
workers="${MALLEUS_TEST_WORKERS:-$(nproc)}"
unit=0
python -m pytest -q -n "$workers" --durations=10 tests/unit || unit=$?
rest=0
python -m pytest -q --durations=25 --ignore=tests/unit || rest=$?
echo "[test] tests/unit: exit $unit; the rest: exit $rest"
[ "$unit" -eq 0 ] && [ "$rest" -eq 0 ]
