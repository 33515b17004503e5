#!/usr/bin/env bash
# The benchmarks of docs/BENCHMARKS.md: sets up the bench extras, then runs benchmarks/run.py.
# `bash scripts/bench.sh --quick` finishes in about two minutes; without it, about 12 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install --quiet -e '.[test,models,bench]'
# torchao declares no torch requirement; --no-deps keeps pip from resolving another torch.
.venv/bin/python -m pip install --quiet --no-deps torchao==0.18.0
exec .venv/bin/python benchmarks/run.py "$@"
