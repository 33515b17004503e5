#!/usr/bin/env bash
# Behaviour before/after a change: the stress harnesses, warm.py and core.py --quick of one tree, results into a
# directory (one log per run, and summary.txt: each command, its start time and load, its wall time, its last lines).
# Run it on the tree before the change (a git worktree, its kernels built) and on the tree after, one after the
# other on a quiet machine; docs/BENCHMARKS.md compares the two summaries.
# Usage: bash benchmarks/beforeafter.sh TREE OUTDIR   (TREE's src on PYTHONPATH, TREE's scripts; python: $PYTHON,
# else this repository's .venv)
set -u
if [ $# -ne 2 ]; then
    echo "usage: bash benchmarks/beforeafter.sh TREE OUTDIR" >&2
    exit 2
fi
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
TREE=$(cd "$1" && pwd)
mkdir -p "$2"
OUT=$(cd "$2" && pwd)
cd "$TREE"
export PYTHONPATH="$TREE/src"
run() {
    local name=$1
    shift
    echo "== $name: $* ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg))" >>"$OUT/summary.txt"
    /usr/bin/time -f "%e s" -a -o "$OUT/summary.txt" "$PY" "$@" >"$OUT/$name.log" 2>&1
    echo "rc=$?" >>"$OUT/summary.txt"
    tail -4 "$OUT/$name.log" >>"$OUT/summary.txt"
}
run faults stress/faults.py
run crash stress/crash.py --trials 150 --seed 1
run stampede stress/stampede.py
run interrupts stress/interrupts.py --trials 5000 --seed 1
run stability stress/stability.py
run fuzz stress/fuzz.py --quick --seed 1
run warm benchmarks/warm.py --repeat 5 --src "$TREE/src" --json "$OUT/warm.json"
run core benchmarks/core.py --quick --json "$OUT/core.json"
