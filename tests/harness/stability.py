"""The stability harness: a complete cache reloaded many times never changes; caches converge after a packer change.

``stress/stability.py`` is its command line and describes the method; ``run()``
returns the figures and the failures. Every third reload is a fresh child
process whose packer must never be called.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from typing import Any

import numpy as np

import packcache
from harness.child import child_argv, last_json

CHILD = """
path, packs, version = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = packcache.WeightCache(path)
with cache.session() as s:
    for i in range(packs):
        s.get_or_pack(f"w{i}", lambda: sys.exit("a hit was expected"), key={"version": version})
st = cache.stats()
cache.close()
report(hits=st.hits, stored=st.stored, written=st.written_bytes, state=st.state)
"""


def pack(i: int, version: int) -> np.ndarray[Any, Any]:
    """Pack ``w{i}`` as packer ``version`` would: another version, other bytes."""
    return np.random.default_rng([i, version]).standard_normal(4096 + 17 * i).astype(np.float32)


def load(path: str, packs: int, version: int) -> tuple[packcache.CacheStats, dict[str, np.ndarray[Any, Any]]]:
    with packcache.WeightCache(path) as cache:
        with cache.session() as s:
            served = {
                f"w{i}": s.get_or_pack(f"w{i}", functools.partial(pack, i, version), key={"version": version})
                for i in range(packs)
            }
        return cache.stats(), served


def file_identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def run(directory: str, cycles: int, packs: int) -> dict[str, Any]:
    """Build, reload ``cycles`` times, change the packer version, compact; the figures and the failures."""
    path = os.path.join(directory, "model.pcache")
    failures: list[str] = []
    stats, _ = load(path, packs, version=1)
    if stats.stored != packs:
        failures.append(f"first build stored {stats.stored} of {packs}")
    before = file_identity(path)
    time.sleep(0.01)  # a rewrite within the same mtime tick would go unseen
    for cycle in range(cycles):
        if cycle % 3 == 2:
            out = subprocess.run(child_argv(CHILD, path, str(packs), "1"), capture_output=True, text=True, check=False)
            if out.returncode != 0:
                failures.append(f"cycle {cycle}: child failed: {out.stderr.strip()[-200:]}")
                continue
            child = last_json(out.stdout)
            hits, written, state = child["hits"], child["written"], child["state"]
        else:
            stats, served = load(path, packs, version=1)
            hits, written, state = stats.hits, stats.written_bytes, stats.state
            if any(not np.array_equal(served[f"w{i}"], pack(i, 1)) for i in range(packs)):
                failures.append(f"cycle {cycle}: wrong bytes")
        if (hits, written, state) != (packs, 0, "mapped"):
            failures.append(f"cycle {cycle}: hits={hits} written={written} state={state}")
        if file_identity(path) != before:
            failures.append(f"cycle {cycle}: file changed {before} -> {file_identity(path)}")

    # A packer version change: exactly one repack of every pack, then converged. That build superseded
    # every version-1 pack, more bytes than it left live, so it compacted the file itself.
    stored_after_change = []
    sizes_after_change = []
    for _ in range(5):
        stats, served = load(path, packs, version=2)
        stored_after_change.append(stats.stored)
        sizes_after_change.append(os.path.getsize(path))
        if any(not np.array_equal(served[f"w{i}"], pack(i, 2)) for i in range(packs)):
            failures.append("wrong bytes after the version change")
        if stats.reclaimable_bytes != 0:
            failures.append(f"{stats.reclaimable_bytes} reclaimable bytes left after the version change")
    if stored_after_change != [packs, 0, 0, 0, 0]:
        failures.append(f"version change stored per load {stored_after_change}, expected [{packs}, 0, 0, 0, 0]")
    if len(set(sizes_after_change)) != 1:
        failures.append(f"the file changed size after converging: {sizes_after_change}")

    # Nothing is left for an explicit compaction to reclaim, and it changes no pack.
    grown = os.path.getsize(path)
    report = packcache.compact(path)
    stats, served = load(path, packs, version=2)
    if stats.hits != packs or any(not np.array_equal(served[f"w{i}"], pack(i, 2)) for i in range(packs)):
        failures.append("compaction lost or changed a pack")
    live = sum(pack(i, 2).nbytes for i in range(packs))
    return {
        "cycles": cycles,
        "packs": packs,
        "file_changes": sum("file changed" in f for f in failures),
        "stored_per_load_after_version_change": stored_after_change,
        "bytes_before_compaction": grown,
        "bytes_after_compaction": report.bytes_after,
        "live_bytes": live,
        "failures": failures,
    }
