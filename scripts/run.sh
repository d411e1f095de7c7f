#!/usr/bin/env bash
# The main job on its embedded default: set up .venv, then run one straggler schedule on 2 local
# CPU ranks twice -- stock DeepSpeed ZeRO-1, then MalleusEngine's adaptive loop -- and print them
# side by side per phase with the capacity bound, plus a plot (conf/experiment/demo.yaml;
# about 100 s on 2 cores). Extra arguments are Hydra overrides, e.g. `bash scripts/run.sh train.steps=60`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python launch/train.py experiment=demo "$@"
