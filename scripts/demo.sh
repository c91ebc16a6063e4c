#!/usr/bin/env bash
# The kiln demo: the seed models, eager vs kiln, correctness and speed in one table.
#   bash scripts/demo.sh [--device cpu|cuda] [--models mlp,convrelu,...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
exec "$PY" benchmarks/demo.py "$@"
