#!/usr/bin/env bash
# Runs every kiln test: set-up (scripts/setup.sh), the include layering check, the C++ tests, pytest on
# tests/python and tests/core with Python 3.11 + torch, and tests/core (torch-free) on 3.12 and 3.13.
# On the GPU machine: the include layering check, then pytest on everything with its python3, CUDA tests included.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k seed    # extra arguments go to the main pytest run
# Exits non-zero when any suite fails; ends with one summary line per suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start_seconds=$SECONDS
# shellcheck source=scripts/setup.sh
source scripts/setup.sh

# One module that fails to import must not hide the results of all the others.
pytest_flags=(-ra --continue-on-collection-errors)
# CI runs on a fresh clone: leave no .pytest_cache behind.
if [ "${CI:-}" = true ]; then pytest_flags+=(-p no:cacheprovider); fi

summary=()
failed=0
# Runs one suite, records its outcome; never stops the script so every suite reports.
run_suite() {
  local name="$1" rc=0; shift
  echo "[test] === $name: $*"
  "$@" || rc=$?
  case "$rc" in
    0) summary+=("ok      $name") ;;
    5) summary+=("empty   $name (pytest collected no tests)") ;;  # e.g. a -k that matches nothing
    *) summary+=("FAILED  $name (exit $rc)"); failed=1 ;;
  esac
}

test_dirs=()
for d in tests/python tests/core; do [ -d "$d" ] && test_dirs+=("$d"); done

# Both machines: it needs only python3, and a climbing include is a design error wherever it is found.
run_suite "include layering" python3 scripts/check_layering.py

if [ "$KILN_MACHINE" = gpu ]; then
  run_suite "pytest (GPU machine, $("$PY" -c 'import sys; print(sys.version.split()[0])'))" \
    "$PY" -m pytest "${pytest_flags[@]}" "${test_dirs[@]}" "$@"
else
  if [ -x build/dev/kiln_cpp_tests ]; then
    run_suite "C++ tests (Catch2)" build/dev/kiln_cpp_tests
  fi
  run_suite "pytest 3.11 + torch" "$PY" -m pytest "${pytest_flags[@]}" "${test_dirs[@]}" "$@"
  for minor in 3.12 3.13; do
    if [ -x ".venv-$minor/bin/python" ] && [ -d tests/core ]; then
      run_suite "pytest $minor torch-free (tests/core)" ".venv-$minor/bin/python" -m pytest "${pytest_flags[@]}" tests/core
    fi
  done
fi

echo "[test] ==== summary ($((SECONDS - start_seconds)) s)"
for line in "${summary[@]}"; do echo "[test] $line"; done
exit "$failed"
