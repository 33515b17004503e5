"""The files beside a cache file (``packcache._sidefiles``): its lock file, opened without blocking on a FIFO
planted there; its temp files, made with ``O_EXCL | O_NOFOLLOW`` so a name planted first is never opened.

Real FIFOs, files and symlinks, through :class:`~packcache.WeightCache`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import KEY, KIB, Spec, assert_same, error_records, packed
from packcache import WeightCache
from packcache import _sidefiles as sidefiles_mod

AB: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB)}

# ------------------------------------------------------------------------------------------ a FIFO at the lock path


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


# --------------------------------------------------------------------------- O_EXCL temp files


def _planted_file(at: Path, victim: Path) -> None:
    at.write_bytes(b"planted by someone else")


def _planted_symlink(at: Path, victim: Path) -> None:
    victim.write_bytes(b"the victim's file")
    at.symlink_to(victim)


def _planted_dangling_symlink(at: Path, victim: Path) -> None:
    at.symlink_to(victim)  # victim does not exist: O_CREAT without O_EXCL would create it


@pytest.mark.parametrize("plant", [_planted_file, _planted_symlink, _planted_dangling_symlink])
def test_temp_file_is_created_with_o_excl_and_never_follows_a_planted_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, plant: Any
) -> None:
    """The first random temp name the library picks is already taken: it must pick another, untouched."""
    names = iter(["0000000000000000", "1111111111111111"])
    monkeypatch.setattr(sidefiles_mod.secrets, "token_hex", lambda n: next(names))
    path = tmp_path / "cache" / "model.pcache"
    path.parent.mkdir(mode=0o700)
    planted = path.parent / f".model.pcache.tmp-{os.getpid()}-0000000000000000"
    victim = tmp_path / "victim"
    plant(planted, victim)
    before = {p: os.lstat(p) for p in (planted, victim) if os.path.lexists(p)}
    contents = {p: p.read_bytes() for p in before if p.exists()}
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name, (seed, nbytes) in AB.items():
                assert_same(s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes)),
                            packed(seed, nbytes))  # fmt: skip
        st = cache.stats()
    assert (st.stored, st.heap_bytes, st.state) == (2, 0, "stored")
    for p, old in before.items():
        new = os.lstat(p)
        assert (new.st_ino, new.st_size, new.st_mtime_ns, new.st_mode) == (
            old.st_ino, old.st_size, old.st_mtime_ns, old.st_mode,
        ), f"{p} was touched"  # fmt: skip
    assert {p: p.read_bytes() for p in contents} == contents
    assert os.path.lexists(victim) == (plant is _planted_symlink), "the symlink's target was created"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([planted.name, "model.pcache", "model.pcache.lock"])
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name in AB:
                s.get_or_pack(name, lambda: np.zeros(1))
        assert cache.stats().hits == 2
    assert error_records(caplog.records) == []
