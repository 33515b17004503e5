#!/usr/bin/env bash
# The whole test suite: lint, types, the wheel, tests. This is what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks stress
.venv/bin/ruff format --check src benchmarks stress
.venv/bin/mypy
# The wheel `python -m build` makes (through an sdist, so both are proven), built once per run; tests/test_wheel.py
# installs it alone (--no-deps) into a scratch directory and runs it. --no-isolation: the build backend is the
# setuptools the test extra pins in .venv; an isolated build would fetch setuptools from the index on every run.
rm -rf dist
if ! .venv/bin/python -m build --no-isolation --outdir dist . >.venv/build.log 2>&1; then
    cat .venv/build.log >&2
    echo "scripts/test.sh: python -m build failed (log above)" >&2
    exit 1
fi
wheels=(dist/packcache-*.whl)
export PACKCACHE_TEST_WHEEL="$PWD/${wheels[0]}"
exec .venv/bin/python -m pytest "$@"
