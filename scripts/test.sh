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
# Bytecode is written during the run, and the package and the tests are compiled once up front: the suite starts
# ~700 child interpreters, and with PYTHONDONTWRITEBYTECODE set (as on the CI image) each compiled packcache from
# source, and each pytest process rewrote every test module's asserts again (~8 s of CPU per collection).
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m compileall -q -j 0 src tests >/dev/null
# pytest in two phases, every collected test in one of them (PACKCACHE_TEST_PHASE, read by tests/conftest.py). First
# all but the tests marked serial, in parallel processes (pytest-xdist). Three workers on the 2-core CI machine: the
# suite waits on children, servers and timeouts as well as it computes, so one more worker than cores pays, and a
# fourth only adds contention (quiet machine, parallel phase: 2 workers 593 s, 3 548 s, 4 591 s). --dist loadgroup hands out
# one test at a time (the slow ones do not queue behind each other) and keeps the tests of one xdist_group on one
# worker. Then the tests marked serial, alone: they assert wall-clock bounds. (`-m serial` too: a run that names only
# src/packcache does not read tests/conftest.py.) PACKCACHE_TEST_WORKERS overrides the number of workers.
# Exit code 5 is pytest's "no test selected": a phase that a narrowed run (`-k`, a file) leaves empty.
workers=${PACKCACHE_TEST_WORKERS:-3}
status=0
PACKCACHE_TEST_PHASE=parallel .venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@" || status=$?
serial=0
PACKCACHE_TEST_PHASE=serial .venv/bin/python -m pytest -m serial "$@" || serial=$?
if [ "$status" -eq 5 ] && [ "$serial" -ne 5 ]; then
    status=0
fi
if [ "$serial" -ne 0 ] && [ "$serial" -ne 5 ]; then
    status=$serial
fi
exit "$status"
