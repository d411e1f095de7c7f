#!/usr/bin/env bash
# Set up .venv (as scripts/run.sh), then run the whole test suite; it must stay under 20 minutes
# on 2 cores. Two passes:
#   1. tests/unit and the tests that start processes but check values only (losses, files,
#      messages), over one pytest-xdist worker more than there are cores: a launch spends
#      seconds in one process (Hydra, imports) and a rank waits on its peers, and the unit tests
#      fill those gaps. Each file's tests stay on one worker (--dist loadfile): most share one
#      cached multi-rank run or a module fixture, which a second worker would run again; the
#      longest file goes first (tests/conftest.py FIRST_FILES);
#   2. the tests that read timings (marked `alone`, tests/conftest.py) and those that wait on
#      deaths, deadlines and restarts (`patient`), one at a time, with the cores to themselves.
#      (Session 33 ran the patient ones beside pass 1: the alone pass fell by 230 s, pass 1 rose
#      by 250 s, and a pass-1 test that reads a start-up grace failed under the extra load; so
#      they run here.) When MALLEUS_TEST_BESIDE names a file, this pass first waits for it to
#      exist: CI (.ci/run) runs other checks beside pass 1 and says so that way.
# The slowest tests of each pass are listed at its end. Extra arguments: one plain pytest run
# with them instead (e.g. `bash scripts/test.sh tests/unit/planner -x`).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# the cores this process may use (not `nproc`: it honours OMP_NUM_THREADS, which setup.sh sets to 1)
workers="${MALLEUS_TEST_WORKERS:-$(python -c 'import os; print(len(os.sched_getaffinity(0)) + 1)')}"
status=()
python -m pytest -q -n "$workers" --dist loadfile --durations=20 -m "not alone and not patient" \
  && status+=(0) || status+=($?)
if [ -n "${MALLEUS_TEST_BESIDE:-}" ]; then
  echo "[test] waiting for the checks beside pass 1 ($MALLEUS_TEST_BESIDE), at most 10 minutes"
  for _ in $(seq 300); do [ -e "$MALLEUS_TEST_BESIDE" ] && break; sleep 2; done
fi
python -m pytest -q --durations=15 -m "alone or patient" --ignore=tests/unit \
  && status+=(0) || status+=($?)
echo "[test] exit status of the two passes (unit and shared, alone and patient): ${status[*]}"
[ "${status[*]}" = "0 0" ]
