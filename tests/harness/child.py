"""Child processes: the one prelude every child interpreter runs, and the log records tests look at.

A child imports the same ``harness`` (from ``TESTS_DIR``, or a copy for another
user) and so packs exactly the bytes its parent expects. The prelude records
every ``packcache`` log record, and ``report(**result)`` prints the result and
the records as one JSON line, the last line the parent reads.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TESTS_DIR = str(Path(__file__).resolve().parents[1])

# What every child runs first: the test modules' imports, and a handler recording packcache's log records.
# ``TESTS_DIR`` stands alone on its line, so a child run as another user can be pointed at a copy.
CHILD_PRELUDE = f"""
import json, logging, os, resource, signal, sys, time
sys.path.insert(0, {TESTS_DIR!r})
import numpy as np
import packcache
from harness.packs import packed, request_all, same_pack

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []
    def emit(self, record):
        self.records.append([record.levelname, record.getMessage()])

RECORDS = _Records()
logging.getLogger("packcache").addHandler(RECORDS)
logging.getLogger("packcache").setLevel(logging.DEBUG)

def stats_dict(cache):
    s = cache.stats()
    return {{k: getattr(s, k) for k in (
        "state", "errno", "error", "mapped_bytes", "heap_bytes", "heap_bytes_by_reason", "heap_reason",
        "written_bytes", "file_bytes", "hits", "stored", "heap_packs")}}

def report(**result):
    result["records"] = RECORDS.records
    print(json.dumps(result))
"""


def prelude(tests_dir: str = TESTS_DIR) -> str:
    """``CHILD_PRELUDE`` importing the harness from ``tests_dir`` (a copy another user can read)."""
    return CHILD_PRELUDE.replace(repr(TESTS_DIR), repr(tests_dir))


def child_argv(code: str, *args: str) -> list[str]:
    """The argv that runs ``CHILD_PRELUDE + code`` in a new interpreter (for ``subprocess.Popen``)."""
    return [sys.executable, "-c", CHILD_PRELUDE + code, *args]


def last_json(stdout: str) -> Any:
    """The JSON a child printed last (``report()``'s line)."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(code: str, *args: str, timeout: float = 240) -> dict[str, Any]:
    """Run ``CHILD_PRELUDE + code`` in a new interpreter; return the JSON it printed last.

    ``timeout`` only stops a hung child: it is no bound on packcache. A child that imports torch and transformers
    shares the 2 cores with the other pytest-xdist workers' tests, and took over 60 s so on a loaded machine."""
    done = subprocess.run(child_argv(code, *args), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"child failed with {done.returncode}:\n{done.stderr}"
    result: dict[str, Any] = last_json(done.stdout)
    return result


def error_records(records: list[logging.LogRecord]) -> list[str]:
    """Messages of the ERROR (or worse) records of the ``packcache`` logger."""
    return [r.getMessage() for r in records if r.name.startswith("packcache") and r.levelno >= logging.ERROR]


# One of two processes appending to one cache file, each through its own spelling of the path.
# It stores a pack, reports STORED, holds its session until the file ``go`` exists, stores
# another, commits, and reports whether both arrays it was served still hold their packs.
APPENDER = """
path, name, seed, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cache = packcache.WeightCache(path, lock_timeout=30)
with cache.session() as s:
    first = s.get_or_pack(name + "-1", lambda: packed(seed, 64 * 1024), {"v": 1})
    print("STORED", flush=True)
    while not os.path.exists(go):   # hold the session (and its locks) until the parent says go
        time.sleep(0.01)
    second = s.get_or_pack(name + "-2", lambda: packed(seed + 1, 64 * 1024), {"v": 1})
same = [same_pack(a, k, 64 * 1024) for a, k in ((first, seed), (second, seed + 1))]
report(same=same, stats=stats_dict(cache))
"""


def two_appenders(path_a: Path, path_b: Path, work: Path, *, delete_lock: bool = False) -> list[dict[str, Any]]:
    """Run two APPENDER processes on one file through ``path_a`` and ``path_b``; return both reports.

    B starts while A holds its session (``delete_lock``: after a cleaner deleted A's lock
    file). Unfixed, B appends at once; fixed, B waits for A's lock. Either way A is let go
    first, then B, and each reports whether what it was served stayed bit-identical.
    """
    go_a, go_b = work / "go-a", work / "go-b"
    procs: list[subprocess.Popen[str]] = []
    try:
        a = subprocess.Popen(child_argv(APPENDER, str(path_a), "a", "10", str(go_a)), stdout=subprocess.PIPE, text=True)
        procs.append(a)
        assert a.stdout is not None and a.stdout.readline() == "STORED\n", "the first appender did not store"
        if delete_lock:
            os.unlink(os.path.realpath(path_a) + ".lock")
        b = subprocess.Popen(child_argv(APPENDER, str(path_b), "b", "20", str(go_b)), stdout=subprocess.PIPE, text=True)
        procs.append(b)
        time.sleep(1.0)
        go_a.touch()
        out_a, _ = a.communicate(timeout=60)
        go_b.touch()
        out_b, _ = b.communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [last_json(out or "") for out in (out_a, out_b)]
