"""The cache file on disk (``packcache._store.FileStore``), reached through ``WeightCache`` as a load
reaches it: one lock per file whatever the spelling of its path, the readers' caps kept by the writer, the
file reopened when its configuration or its trust changes, a warm open that reads no pack byte, a file at
its last generation.

Real processes, symlinks and hardlinks; the page-cache figures (``rchar``, ``mincore``) are measured in
fresh subprocesses. The tests of the holes in docs/RELIABILITY.md reproduce one reported failure each and fail on the
code before its fix (docs/RELIABILITY.md "Attacks and the rule that closes each").
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import KEY, KIB, assert_same, build_keyed, fuzz, load_all, packed, two_appenders
from packcache import WeightCache
from packcache import _generations as generations
from packcache import format as fmt

# --------------------------------------------------------------------------- one file, several spellings


def _spell(tmp_path: Path, how: str) -> tuple[Path, Path]:
    """(the path process A uses, the path process B uses) for one cache file."""
    real = tmp_path / "real" / "m.pcache"
    real.parent.mkdir(mode=0o700)
    build_keyed(real, {"base": 0})
    if how == "symlink":
        other = tmp_path / "link.pcache"
        other.symlink_to(real)
    elif how == "hardlink":
        other = tmp_path / "real" / "hard.pcache"
        os.link(real, other)
    else:  # the same path; a cleaner deletes the lock file while A holds it
        other = real
    return real, other


@pytest.mark.parametrize("how", ["symlink", "hardlink", "deleted-lock"])
def test_two_processes_on_one_file_through_different_paths_never_change_a_served_pack(tmp_path: Path, how: str) -> None:
    path_a, path_b = _spell(tmp_path, how)
    result_a, result_b = two_appenders(path_a, path_b, tmp_path, delete_lock=how == "deleted-lock")
    assert result_a["same"] == [True, True]
    assert result_b["same"] == [True, True], "a pack served as mapped changed under its reader"
    report = packcache.verify(path_a)
    assert report.ok, report.problems
    final = load_all(path_a, {"base": 0})
    assert final.hits == 1
    with WeightCache(path_b) as cache, cache.session() as s:  # both writers' packs survived
        for name, seed in (("a-1", 10), ("a-2", 11), ("b-1", 20), ("b-2", 21)):
            assert_same(s.get_or_pack(name, lambda seed=seed: packed(seed, 64 * KIB), {"v": 1}), packed(seed, 64 * KIB))
        assert cache.stats().hits == 4


def test_a_rebuild_through_a_symlink_replaces_the_target_not_the_symlink(tmp_path: Path) -> None:
    real = tmp_path / "store" / "m.pcache"
    real.parent.mkdir(mode=0o700)
    real.write_bytes(b"not a cache, to be rebuilt")
    os.chmod(real, 0o600)
    link = tmp_path / "m.pcache"
    link.symlink_to(real)
    build_keyed(link, {"w": 1})
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert load_all(real, {"w": 1}).hits == 1


# --------------------------------------------------------------------------- writer-side caps


def test_the_writer_never_commits_an_index_the_readers_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real caps need ~4,100 entries of 66 KB keys (stress/faults.py "caps/index" does that);
    # lowered caps apply to writer and readers alike, so the same rule is checked at a small size.
    monkeypatch.setattr(fmt, "MAX_INDEX_BYTES", 8 * KIB)
    path = tmp_path / "m.pcache"
    long_key = {"pad": "x" * 900}
    with WeightCache(path) as cache:
        with cache.session() as s:
            for i in range(12):
                assert_same(s.get_or_pack(f"w{i}", lambda i=i: packed(i, 64), long_key), packed(i, 64))
        st = cache.stats()
    kept = st.stored
    assert 0 < kept < 12
    assert st.heap_bytes_by_reason["no_space"] == (12 - kept) * 64
    assert st.errno == errno.EFBIG and "caps" in st.error
    fd = os.open(path, os.O_RDONLY)
    _, slot, entries = generations.read_committed(fd, path=str(path))
    os.close(fd)
    assert slot is not None and slot.index_size <= 8 * KIB and len(entries) == kept
    with WeightCache(path) as cache, cache.session() as s:  # readers accept it: every kept pack maps
        for i in range(kept):
            s.get_or_pack(f"w{i}", lambda: np.zeros(1), long_key)
        assert cache.stats().hits == kept


def test_the_writer_never_commits_more_entries_than_the_readers_accept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fmt, "MAX_ENTRIES", 5)
    path = tmp_path / "m.pcache"
    with WeightCache(path) as cache:
        with cache.session() as s:
            for i in range(8):
                s.get_or_pack(f"w{i}", lambda i=i: packed(i, 64), KEY)
        st = cache.stats()
    assert (st.stored, st.heap_packs, st.errno) == (5, 3, errno.EFBIG)
    assert packcache.verify(path).ok


# ----------------------------------------------------------- a change of configuration or trust takes effect


def test_setting_read_only_false_makes_the_cache_store_again(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"a": 1})
    cache = WeightCache(path, read_only=True)
    with cache.session() as s:
        s.get_or_pack("b", lambda: packed(2), KEY)
    assert cache.stats().heap_bytes_by_reason["read_only"] == 4 * KIB
    cache.set_option("packed_cache_read_only", False)
    assert cache.get_option("packed_cache_read_only") is False
    with cache.session() as s:
        assert_same(s.get_or_pack("b", lambda: packed(2), KEY), packed(2))
    st = cache.stats()
    assert (st.stored, st.heap_bytes, st.state) == (1, 0, "stored")
    cache.close()
    assert load_all(path, {"a": 1, "b": 2}).hits == 2


def test_chmod_600_makes_an_untrusted_file_trusted_at_the_next_session(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"a": 1})
    os.chmod(path, 0o666)
    cache = WeightCache(path)
    with cache.session() as s:
        s.get_or_pack("a", lambda: packed(1), KEY)
    assert cache.stats().heap_reason == "untrusted"
    os.chmod(path, 0o600)  # the README's remedy
    with cache.session() as s:
        s.get_or_pack("a", lambda: packed(1), KEY)
    st = cache.stats()
    assert (st.hits, st.heap_bytes, st.state) == (1, 0, "mapped")
    cache.close()


# ------------------------------------------- a warm open reads no pack data: checksums at store time and on demand only


PACKS = 16
PACK_BYTES = 4 << 20

MEASURE = textwrap.dedent(
    """
    import ctypes, json, mmap, os, sys
    import numpy as np, packcache

    path, verify = sys.argv[1], sys.argv[2] == "1"
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    r0 = rchar(); r1 = rchar()
    cache = packcache.WeightCache(path, verify=verify)
    with cache.session() as s:
        arrays = [s.get_or_pack(f"w{i}", lambda: sys.exit("hit expected")) for i in range(__PACKS__)]
    r2 = rchar()

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = mmap.PAGESIZE
    resident = 0
    for a in arrays:
        start = a.ctypes.data // page * page
        pages = (a.ctypes.data + a.nbytes - start + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(start, pages * page, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        resident += sum(v & 1 for v in vec) * page
    st = cache.stats()
    print(json.dumps({"read_bytes": (r2 - r1) - (r1 - r0), "resident_bytes": resident, "hits": st.hits,
                      "mapped": st.mapped_bytes, "file": st.file_bytes}))
    cache.close()
    """
).replace("__PACKS__", str(PACKS))


def measure(path: Path, verify: bool) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), "1" if verify else "0"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_warm_open_reads_no_pack_data(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    rng = np.random.default_rng(0)
    with WeightCache(path) as cache, cache.session() as s:
        for i in range(PACKS):
            s.get_or_pack(f"w{i}", lambda: rng.integers(0, 255, PACK_BYTES, dtype=np.uint8))
    total = PACKS * PACK_BYTES

    warm = measure(path, verify=False)
    assert warm["hits"] == PACKS and warm["mapped"] == total
    # Header (4 KiB) and index only; the packs are 64 MiB.
    assert warm["read_bytes"] < 64 * 1024, warm
    # Kernel readahead of the header read may pull in the first data pages, nothing more.
    assert warm["resident_bytes"] < total // 16, warm

    checked = measure(path, verify=True)  # the opt-in check reads every pack: the contrast
    assert checked["hits"] == PACKS
    assert checked["resident_bytes"] == total, checked


# ------------------------------------------------------------------ a file at its last generation (found by the fuzzer)


def test_valid_file_at_the_last_generation_never_fails_a_load(tmp_path: Path) -> None:
    """Found by the fuzzer: a valid file whose slot holds generation 2**64-1.

    Appending to it must not raise out of the session (a cache problem never
    fails a model load): the next generation does not fit the u64 field, so the
    cache has to rebuild the file (or refuse such a slot when reading).
    """
    import struct

    from packcache import format as fmt

    bases = fuzz.build_bases(str(tmp_path))
    buf = bytearray(bases[0])
    slots = fmt.choose_slot(bytes(buf[: fmt.HEADER_READ_SIZE]))[0]
    newest = slots[0]
    last = fmt.Slot(2**64 - 1, newest.index_offset, newest.index_size, newest.entry_count, newest.index_crc)
    body = fmt.SLOT.pack(fmt.SLOT_MAGIC, last.generation, last.index_offset, last.index_size, last.entry_count,
                         last.index_crc, bytes(20), 0)  # fmt: skip
    buf[fmt.SLOT_OFFSETS[0] : fmt.SLOT_OFFSETS[0] + 64] = bytes(64)
    buf[fmt.SLOT_OFFSETS[1] : fmt.SLOT_OFFSETS[1] + 64] = body[:-4] + struct.pack("<I", fuzz.crc(body[:-4]))
    counts = fuzz.Counts()
    names = fuzz._names(bytes(buf))
    assert names[-1] == "never-stored"
    fuzz.run_case(str(tmp_path / "last.pcache"), bytes(buf), [0, len(names) - 1], counts, 10.0)  # a hit and a miss
    assert counts.failures == []
    assert counts.valid_opens + counts.rebuilds == 1


# ------------------------------------------------------------------ the serving path reads index entries by position


def test_the_serving_paths_entry_indexes_name_its_fields() -> None:
    """``FileStore.serve_many`` and ``holds`` read ``fmt.Entry`` by index (the interpreter specialises a tuple
    index, not a named tuple's field getter): each index must be the position of the field it is named after."""
    from packcache import _store

    indexes = [_store._KEY, _store._DTYPE, _store._SHAPE, _store._OFFSET, _store._NBYTES]
    assert [fmt.Entry._fields[i] for i in indexes] == ["key", "dtype", "shape", "offset", "nbytes"]
