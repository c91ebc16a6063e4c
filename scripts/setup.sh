#!/usr/bin/env bash
# Brings a checkout of kiln to the point where tests and the demo can run: system packages,
# Python environments, and the extension builds. Idempotent and quick when already done.
#
#   source scripts/setup.sh    # (what scripts/test.sh and scripts/demo.sh do) exports PY
#   bash scripts/setup.sh      # just set up
#
# Two kinds of machine:
#   development machine / CI (Debian, pyenv Python 3.11, 2 cores): installs what is missing,
#       builds build/dev (Python 3.11 + torch: kiln._core, kiln._C, kiln_cpp_tests) and the
#       torch-free kiln._core for 3.12 and 3.13 (build/core-312, build/core-313).
#   GPU machine (/opt/torch/.venv, torch with CUDA, no package registry): installs nothing,
#       builds build/gpu with the Python that is there.
# PY names the interpreter that runs kiln with torch. Every step prints one line; any failure stops.
set -euo pipefail

KILN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$KILN_ROOT"
# ccache keys on paths below this directory relative to it, so a fresh clone (CI) reuses the
# objects compiled in another checkout.
export CCACHE_BASEDIR="$KILN_ROOT"
KILN_JOBS="$(nproc)"

step() { echo "[setup] $*"; }

run_as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "[setup] need root for: $*" >&2; return 1; fi
}

# Configures a build directory once (when it has no build.ninja), then builds the given targets.
build_dir() {
  local dir="$1" targets="$2"; shift 2
  if [ ! -f "$dir/build.ninja" ]; then
    step "configure $dir"
    cmake -S . -B "$dir" -G Ninja "$@" >"$dir.configure.log" 2>&1 \
      || { cat "$dir.configure.log" >&2; echo "[setup] configure of $dir failed" >&2; return 1; }
  fi
  step "build $dir ${targets:-(all)} with $KILN_JOBS jobs"
  # The full log stays in $dir.build.log; on failure the compiler's errors are shown.
  # shellcheck disable=SC2086  # targets is a word list
  if ! ninja -C "$dir" -j "$KILN_JOBS" $targets >"$dir.build.log" 2>&1; then
    grep -E -A12 '^FAILED|error:' "$dir.build.log" | head -n 150 >&2 || true
    tail -n 5 "$dir.build.log" >&2
    echo "[setup] build of $dir failed (full log: $dir.build.log)" >&2
    return 1
  fi
}

is_gpu_machine() {
  [ -x /opt/torch/.venv/bin/python3 ] && return 0
  python3 -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1
}

# The newest pyenv build of a minor version, e.g. 3.12 -> ~/.pyenv/versions/3.12.1/bin/python.
pyenv_python() {
  local found
  found="$(ls -d "$HOME"/.pyenv/versions/"$1".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)"
  echo "$found"
}

setup_gpu_machine() {
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY="$(command -v python3)"; fi
  step "GPU machine: using $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
  mkdir -p build
  # Build with the compiler whose libstdc++ the process loads (/lib/.../libstdc++.so.6). A newer GCC
  # elsewhere on the machine (/opt/gcc) emits its own copies of libstdc++'s locale facets into the
  # extension, and the first `ostream << long` then crashes on the facets the runtime never registered.
  local compilers=()
  if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then
    compilers=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc)
  fi
  build_dir build/gpu "" -DPython_EXECUTABLE="$PY" -DKILN_BUILD_TESTS=OFF -DKILN_DEV_OUTPUT=ON "${compilers[@]}"
}

setup_apt_packages() {
  local missing=() pkg
  for pkg in catch2 nlohmann-json3-dev ccache ninja-build cmake; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} = 0 ]; then step "system packages present"; return; fi
  step "installing system packages: ${missing[*]}"
  run_as_root apt-get update -qq
  run_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

setup_main_venv() {
  if [ ! -x .venv/bin/python ]; then
    local base
    base="$(pyenv_python 3.11)"
    if [ -z "$base" ]; then base="$(command -v python3.11 || command -v python3)"; fi
    "$base" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
      || { echo "[setup] need Python 3.11 for .venv (found $base)" >&2; return 1; }
    step "creating .venv from $base"
    "$base" -m venv .venv
  fi
  # transformers: the real-model tests (test_hf_models.py, test_hf_architectures.py) build small random-weight models
  # from it; matplotlib: the benchmarks' and the demo's charts.
  if .venv/bin/python -c "import torch, pybind11, pytest, expecttest, transformers, matplotlib" >/dev/null 2>&1; then
    step ".venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
  else
    step "installing torch==2.13.0, transformers, matplotlib and the build/test tools into .venv"
    .venv/bin/python -m pip install -q torch==2.13.0 pybind11 scikit-build-core ninja pytest expecttest numpy transformers \
      matplotlib
  fi
}

# NVRTC for CI's CUDA tests without a GPU: generated CUDA C compiles to PTX (and cubin) on the CPU.
# The wheel is pinned to CUDA 13.0, the GPU machine's toolkit: PTX from a newer NVRTC may use a PTX ISA
# its 580 driver cannot JIT. Skipped when an NVRTC is already there (the wheel, or a CUDA toolkit).
setup_nvrtc_wheel() {
  if .venv/bin/python - <<'PY' >/dev/null 2>&1
import glob, importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
dirs = ["/usr/local/cuda/lib64"] + [os.path.join(d, sub) for d in (spec.submodule_search_locations if spec else [])
                                    for sub in ("cu13/lib", "cuda_nvrtc/lib")]
sys.exit(0 if any(glob.glob(os.path.join(d, "libnvrtc.so*")) for d in dirs) else 1)
PY
  then step "NVRTC present"; return; fi
  step "installing the NVRTC wheel (nvidia-cuda-nvrtc 13.0) into .venv"
  .venv/bin/python -m pip install -q "nvidia-cuda-nvrtc==13.0.*"
}

# The torch-free environments: only kiln._core and tests/core run there.
setup_core_venv() {
  local minor="$1" venv=".venv-$1" base
  if [ ! -x "$venv/bin/python" ]; then
    base="$(pyenv_python "$minor")"
    if [ -z "$base" ]; then step "no Python $minor found: skipping $venv"; return; fi
    step "creating $venv from $base"
    "$base" -m venv "$venv"
  fi
  if "$venv/bin/python" -c "import pybind11, pytest" >/dev/null 2>&1; then
    step "$venv ready"
  else
    step "installing pybind11 pytest into $venv"
    "$venv/bin/python" -m pip install -q pybind11 pytest
  fi
}

setup_development_machine() {
  setup_apt_packages
  setup_main_venv
  setup_nvrtc_wheel
  setup_core_venv 3.12
  setup_core_venv 3.13
  mkdir -p build
  build_dir build/dev "" -DPython_EXECUTABLE="$KILN_ROOT/.venv/bin/python" -DKILN_BUILD_TESTS=ON -DKILN_DEV_OUTPUT=ON
  local minor
  for minor in 3.12 3.13; do
    [ -x ".venv-$minor/bin/python" ] || continue
    build_dir "build/core-${minor/./}" _core -DPython_EXECUTABLE="$KILN_ROOT/.venv-$minor/bin/python" \
      -DKILN_CORE_ONLY=ON -DKILN_DEV_OUTPUT=ON
  done
  PY="$KILN_ROOT/.venv/bin/python"
}

if is_gpu_machine; then
  KILN_MACHINE=gpu
  setup_gpu_machine
else
  KILN_MACHINE=dev
  setup_development_machine
fi
export PY KILN_MACHINE
step "done: PY=$PY"
