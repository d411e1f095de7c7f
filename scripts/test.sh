#!/usr/bin/env bash
# Set up .venv (as scripts/run.sh), then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python -m pytest -q "$@"
