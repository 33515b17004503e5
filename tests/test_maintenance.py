"""Verification (on demand and on hit) and compaction."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import build, flip_bit, without_build_compaction
from packcache import WeightCache
from packcache import format as fmt
from packcache._generations import read_committed


def arrays(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(1000 + 357 * i).astype(np.float32) for i in range(5)}


def entries_of(path: Path) -> dict[str, fmt.Entry]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_committed(fd)[2]
    finally:
        os.close(fd)


def test_verify_passes_on_a_healthy_cache(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, packs)
    report = packcache.verify(path)
    assert report.ok and report.entries == 5 and report.generation == 1
    assert report.checked_bytes == sum(a.nbytes for a in packs.values())


def test_flipped_bit_anywhere_in_pack_data_is_found_and_named(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build(path, arrays())
    rng = np.random.default_rng(1)
    pristine = tmp_path / "pristine"
    shutil.copyfile(path, pristine)
    for entry in entries_of(path).values():
        for position in (0, entry.nbytes - 1, *rng.integers(0, entry.nbytes, 3)):
            shutil.copyfile(pristine, path)
            flip_bit(path, entry.offset + int(position), int(rng.integers(0, 8)))
            report = packcache.verify(path)
            assert [(p.entry, p.offset) for p in report.problems] == [(entry.name, entry.offset)], position
            assert f"entry {entry.name!r} at offset {entry.offset}" in str(report.problems[0])


def test_verify_reports_a_broken_newest_generation_that_readers_skip(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, dict(list(packs.items())[:2]))
    build(path, packs)  # generation 2 appends three packs and a new index
    fd = os.open(path, os.O_RDONLY)
    slot = fmt.choose_slot(os.pread(fd, 4096, 0))[0][0]
    os.close(fd)
    assert slot.generation == 2
    flip_bit(path, slot.index_offset + 20)
    report = packcache.verify(path)
    assert report.generation == 1 and not report.ok
    assert report.problems[0].entry is None and "generation 2 unusable" in report.problems[0].message


def test_verify_reports_structure_errors_of_a_hostile_file(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    path.write_bytes(b"\x89PKC\r\n\x1a\n" + bytes(5000))
    report = packcache.verify(path)
    assert not report.ok and report.problems[0].entry is None and "checksum" in report.problems[0].message


def test_verify_on_hit_packs_a_corrupt_entry_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, packs)
    victim = entries_of(path)["w2"]
    flip_bit(path, victim.offset + 5)
    with WeightCache(path) as cache:  # without verification the flip goes unseen: that is the trade-off
        with cache.session() as s:
            unseen = s.get_or_pack("w2", lambda: packs["w2"])
        assert not np.array_equal(unseen, packs["w2"])
    caplog.set_level(logging.ERROR, logger="packcache")
    with WeightCache(path, verify=True) as cache:
        with cache.session() as s:
            served = {n: s.get_or_pack(n, lambda a=a: a) for n, a in packs.items()}
        st = cache.stats()
    assert all(np.array_equal(served[n], a) for n, a in packs.items())
    assert (st.hits, st.stored, st.state) == (4, 1, "stored")
    assert any("'w2'" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    assert packcache.verify(path).ok, "the repacked entry replaced the corrupt one"


def test_compact_reclaims_superseded_bytes_and_keeps_live_packs_identical(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    with without_build_compaction():  # as packcache left files before builds compacted
        for version in range(4):  # each version supersedes every pack: the file grows
            packs = {n: a + version for n, a in arrays().items()}
            build(path, packs, key={"version": version})
    grown = path.stat().st_size
    live = sum(a.nbytes for a in packs.values())
    with WeightCache(path) as cache, cache.session() as s:  # a reader holding views of the old file
        held = {n: s.get_or_pack(n, lambda n=n: packs[n], key={"version": 3}) for n in packs}
    inode = path.stat().st_ino
    report = packcache.compact(path)
    assert report.entries == 5 and report.dropped == () and report.bytes_before == grown
    assert path.stat().st_ino != inode and path.stat().st_size == report.bytes_after
    assert report.bytes_after < grown / 3 and report.bytes_after < live + 4096 + 5 * 64 + 1024 + 64 * 5
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert all(np.array_equal(held[n], a) for n, a in packs.items()), "old mappings stay valid"
    assert packcache.verify(path).ok
    with WeightCache(path) as cache:
        with cache.session() as s:
            again = {n: s.get_or_pack(n, lambda: pytest.fail("hit expected"), key={"version": 3}) for n in packs}
        assert (cache.stats().hits, cache.stats().written_bytes) == (5, 0)
    assert all(np.array_equal(again[n], a) for n, a in packs.items())


def test_compact_drops_packs_that_fail_their_checksum(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, packs)
    flip_bit(path, entries_of(path)["w1"].offset)
    report = packcache.compact(path)
    assert report.dropped == ("w1",) and report.entries == 4
    assert set(entries_of(path)) == set(packs) - {"w1"} and packcache.verify(path).ok


def test_compact_waits_for_the_build_lock_and_gives_up_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build(path, arrays())
    before = path.read_bytes()
    holder = os.open(str(path) + ".lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(TimeoutError, match="build lock"):
            packcache.compact(path, lock_timeout=0.1)
    finally:
        os.close(holder)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pcache", "m.pcache.lock"]


def test_compact_of_an_invalid_file_raises_format_error_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    path.write_bytes(bytes(8192))
    with pytest.raises(packcache.FormatError, match="magic"):
        packcache.compact(path)
    assert path.read_bytes() == bytes(8192)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pcache", "m.pcache.lock"]
