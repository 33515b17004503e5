"""The bookkeeping behind the statistics (``packcache._ledger.Ledger``): read without a lock and never
half a change, unnamed packs in their own table, one log record per reason per cache.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import KEY, KIB, packed
from packcache import WeightCache
from test_cache import load

# --------------------------------------------------------------------------- read without a lock


def test_stats_reads_never_wait_on_a_slow_session(tmp_path: Path) -> None:
    """A session holds the cache for up to 2 s inside pack(); 10,000 reads finish meanwhile."""
    cache = WeightCache(tmp_path / "m.pcache")
    in_pack = threading.Event()
    reads_done = threading.Event()
    held_until_reads_done: list[bool] = []

    def slow_pack() -> np.ndarray[Any, Any]:
        in_pack.set()
        held_until_reads_done.append(reads_done.wait(2.0))
        return np.ones(1024, np.float32)

    def loader() -> None:
        with cache.session() as s:
            s.get_or_pack("slow", slow_pack)

    t = threading.Thread(target=loader)
    t.start()
    assert in_pack.wait(5)
    durations = []
    for i in range(10_000):
        started = time.perf_counter()
        if i % 2:
            cache.stats()
        else:
            cache.get_option("packed_cache_heap_mib")
        packcache.aggregate_stats() if i % 1000 == 0 else None
        durations.append(time.perf_counter() - started)
    reads_done.set()
    t.join(5)
    cache.close()
    assert held_until_reads_done == [True], "the reads did not all finish while the session held the lock"
    assert statistics.median(durations) < 1e-3
    assert max(durations) < 0.5, "a read waited for the session"


def test_stats_snapshot_is_consistent_under_contention(tmp_path: Path) -> None:
    """Readers racing a loader never see a snapshot whose sums disagree with its parts."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        cache = WeightCache(tmp_path / "m.pcache")
        stop = threading.Event()
        bad: list[Any] = []

        def reader() -> None:
            while not stop.is_set():
                s = cache.stats()
                if s.heap_bytes != sum(s.heap_bytes_by_reason.values()):
                    bad.append(s)

        readers = [threading.Thread(target=reader) for _ in range(2)]
        for r in readers:
            r.start()
        with cache.session() as s:
            for i in range(200):
                s.get_or_pack(None if i % 3 == 0 else f"w{i}", lambda: np.ones(16))
        stop.set()
        for r in readers:
            r.join(5)
        cache.close()
    finally:
        sys.setswitchinterval(old)
    assert bad == []


# --------------------------------------------------------------------------- unnamed packs


def test_a_name_like_an_internal_unnamed_pack_is_counted_apart(tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "m.pcache")
    with cache.session() as s:
        s.get_or_pack(None, lambda: packed(1), KEY)
        s.get_or_pack("\0unnamed-1", lambda: packed(2), KEY)
    st = cache.stats()
    assert (st.heap_bytes_by_reason["unnamed"], st.mapped_bytes, st.stored) == (4 * KIB, 4 * KIB, 1)
    cache.close()
    st = cache.stats()
    assert (st.mapped_bytes, st.heap_bytes) == (0, 0)


# --------------------------------------------------------------------------- logging


def test_failures_log_one_error_per_reason_per_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.pcache"
    with WeightCache(path) as cache:
        load(cache, {"a": np.ones(2)})
    caplog.set_level(logging.DEBUG, logger="packcache")
    for _ in range(2):
        with WeightCache(path, read_only=True) as cache:
            load(cache, {f"miss{i}": np.ones(2) for i in range(5)})
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, "one ERROR per reason per cache, not one per pack"
    assert all("read_only" in r.getMessage() and str(path) in r.getMessage() for r in errors)
    caplog.clear()
    with WeightCache(None) as cache:
        load(cache, {f"w{i}": np.ones(2) for i in range(3)})
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
