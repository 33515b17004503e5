#!/usr/bin/env bash
# The whole test suite: lint, types, the wheel, tests. This is what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks stress
.venv/bin/ruff format --check src benchmarks stress
# Bytecode is written during the run: the suite starts ~700 child interpreters, and with PYTHONDONTWRITEBYTECODE set
# (as on the CI image) each compiled packcache from source, and each pytest process rewrote every test module's asserts
# again. One collection in the background while mypy (one core) runs writes pytest's rewritten test modules, so the
# pytest processes below find them (a collection: 13 s of CPU without them, 8 s with them). Finished before the wheel
# is built, so no bytecode is being written into src/ while it is packed.
unset PYTHONDONTWRITEBYTECODE
PACKCACHE_TEST_PHASE=parallel .venv/bin/python -m pytest --collect-only -q "$@" >.venv/collect.log 2>&1 &
collecting=$!
trap 'kill "$collecting" 2>/dev/null || true' EXIT  # a failed check below ends the script, and this with it
.venv/bin/mypy
wait "$collecting" || true  # its errors, if any, are the first pytest phase's to report
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
# What that collection did not import (the harness's child scripts, modules only a test imports) is compiled here.
.venv/bin/python -m compileall -q -j 0 src tests >/dev/null
# pytest in two phases, every collected test in one of them (PACKCACHE_TEST_PHASE, read by tests/conftest.py). First
# all but the tests marked serial, in parallel processes (pytest-xdist). Three workers on the 2-core CI machine: the
# suite waits on children, servers and timeouts as well as it computes, so one more worker than cores pays, and a
# fourth only adds contention (quiet machine, parallel phase: 2 workers 593 s, 3 548 s, 4 591 s; with the OpenMP
# setting below, 3 512 s, 4 639 s). --dist loadgroup hands out one test at a time (the slow ones do not queue behind
# each other) and keeps the tests of one xdist_group on one worker. Then the tests marked serial, alone: they assert
# wall-clock bounds. (`-m serial` too: a run that names only src/packcache does not read tests/conftest.py.)
# PACKCACHE_TEST_WORKERS overrides the number of workers.
# Exit code 5 is pytest's "no test selected": a phase that a narrowed run (`-k`, a file) leaves empty.
# OMP_WAIT_POLICY=PASSIVE in the parallel phase only: three workers on two cores means OpenMP's threads (torch's and
# the compiled kernels') would spin on a core another worker needs each time they wait for work; sleeping instead took
# a torch-heavy quarter of the suite from 178-182 s to 144-155 s, and the whole phase from 556 s to 512 s (1,072 s of
# CPU to 966 s). The serial phase keeps the default a user runs with.
# The parallel phase lists the serial tests it deselected (PACKCACHE_TEST_SERIAL_LIST); a whole run (no arguments)
# then collects only those, a narrowed one what it names. No list (the first phase failed before collecting): all.
workers=${PACKCACHE_TEST_WORKERS:-3}
listed=.venv/serial-tests.txt
rm -f "$listed"
status=0
OMP_WAIT_POLICY=PASSIVE PACKCACHE_TEST_PHASE=parallel PACKCACHE_TEST_SERIAL_LIST="$PWD/$listed" \
    .venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@" || status=$?
serial=0
targets=("$@")
if [ "$#" -eq 0 ] && [ -f "$listed" ]; then
    mapfile -t targets <"$listed"
    [ "${#targets[@]}" -gt 0 ] || serial=5  # no serial test in the whole run: nothing to collect
fi
if [ "$serial" -eq 0 ]; then
    PACKCACHE_TEST_PHASE=serial .venv/bin/python -m pytest -m serial "${targets[@]}" || serial=$?
fi
if [ "$status" -eq 5 ] && [ "$serial" -ne 5 ]; then
    status=0
fi
if [ "$serial" -ne 0 ] && [ "$serial" -ne 5 ]; then
    status=$serial
fi
exit "$status"
