"""Many ``packcache`` command lines in one child interpreter, each bounded: what the CLI tests of hostile
model files and cache paths share.

The child runs ``packcache.cli.main(argv)`` for each case in turn, its stdout and stderr captured, under
``SIGALRM`` (a case stuck in Python code ends as ``hung``) and a 3 GiB address-space limit (an unbounded
allocation ends as ``MemoryError`` in the child, never as a swapping machine). A case stuck where no signal
reaches (a blocking ``open`` in a native library) stops the child: the parent's timeout ends it, and every
case without an outcome is reported ``never finished``. One interpreter for all cases: torch is imported once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import packcache

SRC = str(Path(packcache.__file__).resolve().parents[1])

_CHILD = r"""
import contextlib, io, json, resource, signal, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from packcache.cli import main

class Hung(Exception):
    pass

def alarm(*_):
    raise Hung()

signal.signal(signal.SIGALRM, alarm)
for name, argv, seconds in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(seconds)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            result = {"rc": main(argv)}
    except Hung:
        result = {"hung": True}
    except BaseException as exc:
        result = {"raised": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        signal.alarm(0)
    print(json.dumps({"case": name, "stdout": out.getvalue(), "stderr": err.getvalue(), **result}), flush=True)
"""


def run_cli_cases(cases: list[tuple[str, list[str]]], *, seconds: int = 40, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``main(argv)`` for each ``(name, argv)`` in one child; return name -> outcome.

    An outcome holds ``stdout`` and ``stderr`` and one of ``rc`` (what ``main`` returned), ``hung`` (still running
    after ``seconds``), ``raised`` (an exception escaped ``main``: a traceback the CLI would have printed), or
    ``never finished`` (the child stopped or timed out first; the child's stderr).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *filter(None, [os.environ.get("PYTHONPATH")])])}
    env["PYTHONWARNINGS"] = "ignore"
    argv = [sys.executable, "-c", _CHILD, json.dumps([(name, args, seconds) for name, args in cases])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = f"the child was still running after {timeout} s"
    results: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            outcome = json.loads(line)
            results[outcome.pop("case")] = outcome
    for name, _ in cases:
        results.setdefault(name, {"never finished": err[-2000:], "stdout": "", "stderr": ""})
    return results
