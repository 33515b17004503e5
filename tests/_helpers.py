"""Helpers shared by the fault and crash tests: deterministic packs, real mounts, child processes.

Not a conftest: plain functions the tests import (``from _helpers import ...``),
and that child processes import too, so a child packs exactly the bytes the
parent expects.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

TESTS_DIR = str(Path(__file__).resolve().parent)
ROOT_ONLY = "this test needs root (CI runs as root)"
KIB = 1024
MIB = 1024 * KIB


def require_root() -> None:
    """Fail (never skip) when not root: mounts, chown and rlimits-as-root are the point of these tests."""
    assert os.geteuid() == 0, ROOT_ONLY


def packed(seed: int, nbytes: int = 4 * KIB) -> np.ndarray[Any, Any]:
    """A deterministic float32 pack of ``nbytes`` bytes: same seed, same bits, in any process."""
    rng = np.random.default_rng(seed)
    count = nbytes // 4
    cols = 16 if count % 16 == 0 else 1
    return rng.standard_normal(count, dtype=np.float32).reshape(count // cols, cols)


class Packer:
    """Pack functions that count their calls, so a test can tell a hit (not called) from a pack."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, name: str, seed: int, nbytes: int = 4 * KIB) -> Callable[[], np.ndarray[Any, Any]]:
        def pack() -> np.ndarray[Any, Any]:
            self.calls[name] = self.calls.get(name, 0) + 1
            return packed(seed, nbytes)

        return pack


def assert_same(served: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> None:
    """Bit-identical: dtype, shape and every byte."""
    assert served.dtype == expected.dtype
    assert served.shape == expected.shape
    assert served.tobytes() == expected.tobytes()


def error_records(records: list[logging.LogRecord]) -> list[str]:
    """Messages of the ERROR (or worse) records of the ``packcache`` logger."""
    return [r.getMessage() for r in records if r.name.startswith("packcache") and r.levelno >= logging.ERROR]


def file_state(path: Path) -> tuple[int, int, int, bytes]:
    """(inode, size, mtime_ns, bytes) of a file: what "nothing was written" compares."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, path.read_bytes()


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _umount(directory: Path) -> None:
    gc.collect()  # arrays handed out keep their mappings (and so the mount) busy until collected
    done = subprocess.run(["umount", str(directory)], capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, text=True)
        raise AssertionError(f"umount {directory} failed (lazily unmounted instead): {done.stderr.strip()}")


@contextlib.contextmanager
def tmpfs(directory: Path, size: str = "1m") -> Iterator[Path]:
    """Mount a fresh tmpfs of ``size`` on ``directory`` (created), unmounted on exit."""
    require_root()
    directory.mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)])
    try:
        yield directory
    finally:
        _umount(directory)


@contextlib.contextmanager
def read_only_bind(source: Path, target: Path) -> Iterator[Path]:
    """Bind-mount ``source`` on ``target`` (created) read-only, unmounted on exit."""
    require_root()
    target.mkdir(parents=True, exist_ok=True)
    _run(["mount", "--bind", str(source), str(target)])
    try:
        _run(["mount", "-o", "remount,bind,ro", str(target)])
        yield target
    finally:
        _umount(target)


def fill(directory: Path, leave_free: int) -> None:
    """Fill the file system of ``directory`` until at most ``leave_free`` bytes remain."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    filler = max(0, free - leave_free)
    with open(directory / "filler", "wb") as f:
        f.write(b"\xaa" * filler)


# A child process prelude: imports what the test modules import, and records packcache's log records.
CHILD_PRELUDE = f"""
import json, logging, os, resource, signal, sys, time
sys.path.insert(0, {TESTS_DIR!r})
import numpy as np
import packcache
from _helpers import packed

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


def child_argv(code: str, *args: str) -> list[str]:
    """The argv that runs ``CHILD_PRELUDE + code`` in a new interpreter (for ``subprocess.Popen``)."""
    return [sys.executable, "-c", CHILD_PRELUDE + code, *args]


def run_child(code: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    """Run ``CHILD_PRELUDE + code`` in a new interpreter; return the JSON it printed last."""
    done = subprocess.run(child_argv(code, *args), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"child failed with {done.returncode}:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


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
same = [a.tobytes() == packed(k, 64 * 1024).tobytes() for a, k in ((first, seed), (second, seed + 1))]
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
    return [json.loads((out or "").strip().splitlines()[-1]) for out in (out_a, out_b)]


def save_safetensors(model: Any, path: Path) -> Path:
    """Write a torch module's parameters as a safetensors file (little-endian float32); return ``path``."""
    import struct

    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, param in model.named_parameters():
        data = param.detach().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(param.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path
