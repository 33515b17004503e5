#!/usr/bin/env bash
# The whole test suite: lint, types, tests. This is what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks stress
.venv/bin/ruff format --check src benchmarks stress
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
