#!/usr/bin/env bash
# The one prepared GPU check: builds the environment, runs scripts/gpu_check.py, and tees its
# markdown report to $OUT/gpu_report.md when $OUT is set. Needs no editing on the day.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # BEFORE, on a machine whose pip reaches PyPI:
#                                              # wheels for an offline GPU machine into .whl/
#   bash scripts/gpu_check.sh                  # on the GPU machine (one GPU: ~3-5 min)
#   bash scripts/gpu_check.sh --cpu-dry-run    # anywhere: every part that can run on CPU
#
# Environment. Without a GPU this sources scripts/setup.sh unchanged (the CPU torch wheel of
# constraints-cpu.txt). With one (nvidia-smi answers; MALLEUS_GPU_SETUP=1/0 forces either way)
# the CPU wheel is wrong and a GPU image's python already holds a CUDA torch: .venv is built
# from that python (MALLEUS_BASE_PYTHON, default python3) with a .pth that puts its
# site-packages behind the venv's, then `pip install -e .` WITHOUT constraints-cpu.txt, from
# the wheels in .whl/ (MALLEUS_WHEELS) with --no-index when that folder exists, else from the
# package index. setup.sh's install stamp is then written, so sourcing it only activates.
# The stamp formula is setup.sh's (tests/integration/test_gpu_check.py keeps the two in step).
#
# Time: scripts/gpu_check.py gives each part its own timeout and the whole run a budget
# (--budget-s, default 480 s), so one hang cannot eat the device time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${MALLEUS_WHEELS:-$ROOT/.whl}"
# what `pip install -e .` needs beyond a GPU image that has torch, triton, transformers,
# numpy, matplotlib, tensorboard and the common tools (pinned to this machine's .venv versions)
GPU_EXTRA=(deepspeed hjson pydantic pydantic-core annotated-types typing-inspection
           hydra-core omegaconf antlr4-python3-runtime pymoo moocore cffi pycparser platformdirs
           alive-progress about-time graphemeu autograd cma deprecated)

say() { echo "[gpu_check] $*" >&2; }
die() { echo "[gpu_check] ERROR: $*" >&2; exit 1; }

fetch_wheels() {
  # shellcheck disable=SC1091
  source scripts/setup.sh
  local py="${GPU_PYTHON_VERSION:-3.12}" name ver
  mkdir -p "$WHEELS"
  for name in "${GPU_EXTRA[@]}"; do
    ver="$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")" \
      || die "$name is not installed in .venv: cannot pin its version"
    if ! python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
         --platform manylinux2014_x86_64 -d "$WHEELS" "$name==$ver" 2>/dev/null; then
      # sdist only (deepspeed, antlr4-python3-runtime): a pure-python wheel built here
      python -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$name==$ver" \
        || die "no wheel for $name==$ver"
    fi
  done
  if ! git check-ignore -q "$WHEELS/x" 2>/dev/null; then
    echo "/$(realpath --relative-to="$ROOT" "$WHEELS")/" >> .git/info/exclude
  fi
  say "$(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS; carry it to the GPU machine"
}

want_gpu_setup() {
  case "${MALLEUS_GPU_SETUP:-auto}" in
    1) return 0 ;;
    0) return 1 ;;
    *) command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ;;
  esac
}

gpu_setup() {
  local base="${MALLEUS_BASE_PYTHON:-python3}" sp idx=()
  if [ -x .venv/bin/python ]; then
    .venv/bin/python -c "import torch, malleus_ds" 2>/dev/null \
      || die ".venv exists but cannot import torch and malleus_ds: remove it and rerun"
    return 0
  fi
  "$base" -c "import torch" 2>/dev/null \
    || die "$base has no torch: set MALLEUS_BASE_PYTHON to the python that holds CUDA torch"
  "$base" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || say "WARNING: $base's torch $("$base" -c 'import torch; print(torch.__version__)') sees no GPU"
  say "building .venv on $base ($("$base" -c 'import torch; print("torch", torch.__version__)'))"
  "$base" -m venv --without-pip .venv
  sp="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$base" -c 'import site; print("\n".join(site.getsitepackages()))' > "$sp/_gpu_base.pth"
  if [ -d "$WHEELS" ]; then
    idx=(--no-index --find-links "$WHEELS")
    say "installing offline from $WHEELS ($(ls "$WHEELS" | wc -l) wheels)"
  else
    say "no $WHEELS: installing from the package index (bash scripts/gpu_check.sh --fetch-wheels makes it)"
  fi
  .venv/bin/python -m pip install -q --no-build-isolation "${idx[@]}" -e . \
    || die "pip install -e . failed (missing wheels? run --fetch-wheels where pip reaches PyPI)"
  # scripts/setup.sh's stamp: it finds the install done and only activates
  cat setup.py constraints-cpu.txt | sha256sum | cut -d' ' -f1 > .venv/.malleus_install_stamp
}

if [ "${1:-}" = "--fetch-wheels" ]; then
  fetch_wheels
  exit 0
fi
if want_gpu_setup && [ "${1:-}" != "--cpu-dry-run" ]; then
  t0=$SECONDS
  gpu_setup
  say "environment ready in $((SECONDS - t0)) s"
fi
# shellcheck disable=SC1091
source scripts/setup.sh
export PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  python scripts/gpu_check.py "$@" | tee "$OUT/gpu_report.md"
else
  python scripts/gpu_check.py "$@"
fi
