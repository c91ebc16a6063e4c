#!/usr/bin/env bash
# The kiln demo: the seed models, eager vs kiln, correctness and speed in one table, also drawn as a chart
# (build/demo/seed_models.png, its rows in build/demo/seed_models.jsonl; needs matplotlib, else one line says so).
#   bash scripts/demo.sh [--device cpu|cuda] [--models mlp,convrelu,...] [--chart PATH]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
exec "$PY" benchmarks/demo.py "$@"
