#!/usr/bin/env bash
# Set up .venv (as scripts/run.sh), then run the whole test suite. Extra arguments go to pytest.
# The 25 slowest tests are listed at the end: the suite must stay under 20 minutes on 2 cores.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python -m pytest -q --durations=25 "$@"
