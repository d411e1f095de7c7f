#!/usr/bin/env bash
# Shared setup for scripts/run.sh and scripts/test.sh (source it): a .venv in the repo with
# malleus_ds installed editable, its dev extras, and the CPU torch wheel (constraints-cpu.txt).
# Re-runs pip only when setup.py or the constraints changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
STAMP=.venv/.malleus_install_stamp
WANT="$(cat setup.py constraints-cpu.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] pip install -e '.[dev]' -c constraints-cpu.txt"
  # (the grep drops pip's notes about local index folders this machine may not have)
  python -m pip install -q --upgrade pip setuptools wheel 2>&1 | { grep -v "is ignored: it is neither" || true; }
  python -m pip install -q -e '.[dev]' -c constraints-cpu.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
  echo "$WANT" > "$STAMP"
fi
# DeepSpeed's CPU communicator JIT-compiles a C++ op at every process group's start (its
# shared-memory all-reduce, used only for inference); torch caches the build per folder and
# rebuilds it whenever another venv's compile line was the last one there, 50-100 CPU s each
# time. A folder per venv: it builds once.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
# CPU runs: one thread per rank, DeepSpeed's CPU accelerator unless a GPU says otherwise
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
