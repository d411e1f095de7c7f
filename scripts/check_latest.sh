#!/usr/bin/env bash
# What a GPU user gets from `pip install -e '.[dev]'` WITHOUT our constraints file: the newest
# transformers (<6) and its dependencies, Hugging Face's `kernels` among them. Builds
# .venv-latest (torch pinned to the constraints file's CPU wheel only, so this machine does not
# pull a multi-GB CUDA build; everything else resolves freely), prints the versions, and runs the
# Hugging Face tests in it: the import test (HF's `kernels` is not shadowed by our kernels/),
# the model tests, data=text's (tokenizers trained, saved and loaded through AutoTokenizer) and
# MalleusTrainer's pure parts (the sample order against the newest accelerate's own sharding).
# .ci/run builds it (--prepare: the install only, while the suite runs) and runs its tests after
# the suite (--installed: the tests only). Other extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
mode=all
case "${1:-}" in
  --prepare) mode=prepare; shift ;;
  --installed) mode=installed; shift ;;
esac
V=.venv-latest
if [ "$mode" != installed ]; then
  if [ ! -x "$V/bin/python" ]; then
    echo "[latest] creating $V with $PY"
    "$PY" -m venv "$V"
  fi
  quiet() { grep -v "is ignored: it is neither" || true; }
  "$V/bin/python" -m pip install -q --upgrade pip setuptools wheel 2>&1 | quiet
  grep '^torch==' constraints-cpu.txt > "$V/torch-only-constraints.txt"
  "$V/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev]' \
    -c "$V/torch-only-constraints.txt" 2>&1 | quiet
  echo "[latest] resolved without constraints:" \
    "$("$V/bin/python" -m pip list 2>/dev/null | grep -E '^(torch|transformers|kernels|huggingface.hub|tokenizers|safetensors|deepspeed) ' | tr -s ' ' | tr '\n' ';')"
fi
[ "$mode" = prepare ] && exit 0
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
# its own torch extension builds (scripts/setup.sh says why): beside the suite's .venv
export TORCH_EXTENSIONS_DIR="$PWD/$V/torch_extensions"
exec "$V/bin/python" -m pytest -q -p no:cacheprovider tests/integration/test_transformers_import.py \
  tests/unit/models/test_hf.py tests/unit/data/test_text.py tests/unit/hf "$@"
