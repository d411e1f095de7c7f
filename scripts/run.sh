#!/usr/bin/env bash
# The main job on its embedded default: set up .venv, then train a small LLaMA-style model with
# stock DeepSpeed ZeRO-1 on 2 local CPU processes, healthy for 8 steps and then with rank 1
# emulated 4x slower. The printed summary shows throughput healthy vs with the straggler.
# Extra arguments are Hydra overrides, e.g. `bash scripts/run.sh train.steps=30`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python launch/train.py experiment=demo "$@"
