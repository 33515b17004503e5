#!/usr/bin/env bash
# The benchmarks of docs/BENCHMARKS.md: sets up the bench extras, then runs benchmarks/run.py.
# `bash scripts/bench.sh --quick` takes about 10 minutes; without it, about 36 (measured on the shared 2-core machine;
# benchmarks/hf.py is 2.6 and 6.2 of them), plus benchmarks/serve.py's 1.3 and 5 minutes (measured alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The bench extra brings sentence-transformers, which declares an unpinned torch: the constraint keeps
# pip on the torch==2.13.0 CPU build (any other resolution downloads a multi-GB CUDA build).
.venv/bin/python -m pip install --quiet -c <(echo torch==2.13.0) -e '.[test,models,bench,serve]'
# torchao declares no torch requirement; --no-deps keeps pip from resolving another torch.
.venv/bin/python -m pip install --quiet --no-deps torchao==0.18.0
exec .venv/bin/python benchmarks/run.py "$@"
