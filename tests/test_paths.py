"""Opening paths (``packcache._paths``): never blocking on a FIFO, never following a symlink swapped in
after the check, trusting a file by its owner and mode, temp files made with ``O_EXCL``.

Real FIFOs, symlinks and, where ownership is the point, the real user ``nobody`` (the ``env`` fixture).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from harness import KEY, KIB, assert_same, build_keyed, packed
from packcache import WeightCache

# ---------------------------------------------------------------------- a symlink swapped in after the check (issue 10)


def test_a_symlink_swapped_in_after_the_check_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, no sticky bit: a symlink here is not to be followed
    path = shared / "m.pcache"
    build_keyed(path, {"w": 1})
    victim = tmp_path / "victim.pcache"
    build_keyed(victim, {"w": 2})  # a valid cache of other bytes, which the attacker wants served
    real_lstat = os.lstat

    def lstat_then_swap(p: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(p, *args, **kwargs)
        if os.fspath(p) == str(path) and stat.S_ISREG(result.st_mode):
            os.rename(path, shared / "moved.pcache")  # the race, at its worst instant
            os.symlink(victim, path)
        return result

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    with WeightCache(path) as cache:
        with cache.session() as s:
            w = s.get_or_pack("w", lambda: packed(1), KEY)
        st = cache.stats()
    monkeypatch.undo()
    assert_same(w, packed(1))  # never the victim's packed(2)
    assert st.hits == 0 and st.heap_bytes_by_reason["untrusted"] == 4 * KIB


# ------------------------------------------------------------------------- FIFOs at the cache and lock paths (issue 10)


def test_a_fifo_at_the_lock_path_is_refused_without_blocking(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.pcache"
    os.mkfifo(str(path) + ".lock", 0o600)
    caplog.set_level(logging.ERROR, logger="packcache")
    with WeightCache(path, lock_timeout=1) as cache:
        with cache.session() as s:
            assert_same(s.get_or_pack("w", lambda: packed(1), KEY), packed(1))
        st = cache.stats()
    assert st.heap_bytes_by_reason["untrusted"] == 4 * KIB
    assert "lock file" in st.error and "FIFO" in st.error


def test_a_fifo_at_the_cache_path_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    os.mkfifo(path, 0o600)
    with WeightCache(path) as cache:
        with cache.session() as s:
            s.get_or_pack("w", lambda: packed(1), KEY)
        st = cache.stats()
    assert st.heap_reason == "untrusted" and "FIFO" in st.error
