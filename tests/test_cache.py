"""Routing, accounting and arguments of WeightCache, and the lifetime of what it hands out.

Sessions themselves (threads, interrupts, misuse) are in test_cache_sessions.py, ``get_many`` and
``PackKey`` in test_cache_get_many.py.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import KEY, KIB, assert_same, build_keyed, load_all, packed
from packcache import HeapReason, PackResultError, SessionError, WeightCache


def packs(seed: int = 0, count: int = 4) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.weight": rng.standard_normal((64 + i, 32)).astype(np.float32) for i in range(count)}


def load(cache: WeightCache, arrays: dict[str, np.ndarray[Any, Any]], key: Any = None) -> dict[str, Any]:
    with cache.session() as s:
        return {name: s.get_or_pack(name, lambda a=a: a.copy(), key=key) for name, a in arrays.items()}


def never() -> np.ndarray[Any, Any]:
    raise AssertionError("pack() must not be called on a hit")


def test_first_load_stores_and_second_load_maps_every_pack(tmp_path: Path) -> None:
    arrays = packs()
    path = tmp_path / "model.pcache"
    with WeightCache(path) as cache:
        served = load(cache, arrays)
        s = cache.stats()
    assert (s.state, s.stored, s.hits, s.heap_bytes) == ("stored", 4, 0, 0)
    assert s.mapped_bytes == sum(a.nbytes for a in arrays.values())
    assert s.written_bytes > s.mapped_bytes and s.file_bytes == path.stat().st_size
    for name, a in arrays.items():
        assert np.array_equal(served[name], a) and served[name].dtype == a.dtype

    with WeightCache(path) as cache:
        with cache.session() as sess:
            warm = {name: sess.get_or_pack(name, never) for name in arrays}
        s = cache.stats()
    assert (s.state, s.stored, s.hits, s.heap_bytes, s.written_bytes) == ("mapped", 0, 4, 0, 0)
    for name, a in arrays.items():
        assert warm[name].tobytes() == a.tobytes()


def test_reload_of_complete_cache_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "model.pcache"
    arrays = packs()
    with WeightCache(path) as cache:
        load(cache, arrays)
    before = path.stat()
    lock_before = Path(str(path) + ".lock").stat()
    time.sleep(0.01)  # make an mtime change observable if anything did write
    for _ in range(3):
        with WeightCache(path) as cache:
            load(cache, arrays)
            assert cache.stats().state == "mapped"
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert Path(str(path) + ".lock").stat().st_mtime_ns == lock_before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pcache", "model.pcache.lock"]


def test_partial_cache_appends_missing_packs_then_full_hit(tmp_path: Path) -> None:
    path = tmp_path / "model.pcache"
    arrays = packs(count=6)
    first = dict(list(arrays.items())[:3])
    with WeightCache(path) as cache:
        load(cache, first)
    inode = path.stat().st_ino
    with WeightCache(path) as cache:
        served = load(cache, arrays)
        s = cache.stats()
    assert (s.state, s.hits, s.stored, s.heap_bytes) == ("stored", 3, 3, 0)
    assert path.stat().st_ino == inode, "appending must not replace the file"
    with WeightCache(path) as cache:
        with cache.session() as sess:
            warm = {n: sess.get_or_pack(n, never) for n in arrays}
        assert (cache.stats().state, cache.stats().hits) == ("mapped", 6)
    for n, a in arrays.items():
        assert np.array_equal(served[n], a) and np.array_equal(warm[n], a)


def test_stale_key_repacks_once_and_converges(tmp_path: Path) -> None:
    path = tmp_path / "model.pcache"
    arrays = packs()
    with WeightCache(path) as cache:
        load(cache, arrays, key={"packer": "fp32", "version": 1})
    doubled = {n: a * 2 for n, a in arrays.items()}
    with WeightCache(path) as cache:
        served = load(cache, doubled, key={"packer": "fp32", "version": 2})
        assert (cache.stats().stored, cache.stats().hits) == (4, 0)
    with WeightCache(path) as cache:
        with cache.session() as sess:
            warm = {n: sess.get_or_pack(n, never, key={"packer": "fp32", "version": 2}) for n in arrays}
        assert (cache.stats().state, cache.stats().hits) == ("mapped", 4)
    for n in arrays:
        assert np.array_equal(served[n], doubled[n]) and np.array_equal(warm[n], doubled[n])


def test_caching_off_packs_to_heap_with_reason_disabled() -> None:
    arrays = packs()
    with WeightCache(None) as cache:
        served = load(cache, arrays)
        s = cache.stats()
    total = sum(a.nbytes for a in arrays.values())
    assert (s.state, s.heap_bytes, s.heap_reason, s.mapped_bytes, s.errno) == ("off", total, "disabled", 0, 0)
    assert s.heap_bytes_by_reason["disabled"] == total and s.heap_packs == 4
    assert set(s.heap_bytes_by_reason) == {r.value for r in HeapReason}
    assert all(np.array_equal(served[n], a) for n, a in arrays.items())


def test_enabled_false_turns_a_path_cache_off_and_writes_nothing(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "m.pcache", enabled=False) as cache:
        load(cache, packs())
        assert cache.stats().state == "off"
    assert list(tmp_path.iterdir()) == []


def test_unnamed_pack_is_heap_but_not_a_failure(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            a = s.get_or_pack(None, lambda: np.arange(8, dtype=np.int32))
            assert cache.stats().state == "heap" and cache.stats().heap_reason == "unnamed"
            s.get_or_pack("named", lambda: np.ones(4, np.float32))
            b = s.get_or_pack(None, lambda: np.arange(8, dtype=np.int32))
        s2 = cache.stats()
    assert s2.state == "stored", "an unnamed pack plus a stored one is stored, not degraded"
    assert s2.heap_bytes_by_reason["unnamed"] == 64 and s2.heap_packs == 2 and s2.errno == 0
    assert a is not b and np.array_equal(a, b)


def test_finalized_cache_maps_hits_and_sends_new_packs_to_heap(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    arrays = packs()
    with WeightCache(path) as cache:
        load(cache, arrays)
    size = path.stat().st_size
    with WeightCache(path) as cache:
        cache.finalize()
        with cache.session() as s:
            for n in arrays:
                s.get_or_pack(n, never)
            extra = s.get_or_pack("extra", lambda: np.full(100, 7, np.int64))
        st = cache.stats()
    assert (st.hits, st.heap_packs, st.heap_bytes_by_reason["finalized"], st.heap_reason) == (4, 1, 800, "finalized")
    assert st.state == "mapped", "finalized is not a failure: mapped + finalized heap is not degraded"
    assert path.stat().st_size == size and int(extra.sum()) == 700


def test_read_only_flag_maps_hits_and_sends_misses_to_heap(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    arrays = packs()
    with WeightCache(path) as cache:
        load(cache, dict(list(arrays.items())[:2]))
    before = path.stat()
    with WeightCache(path, read_only=True) as cache:
        served = load(cache, arrays)
        st = cache.stats()
    assert (st.state, st.hits, st.stored, st.heap_reason) == ("degraded", 2, 0, "read_only")
    assert st.heap_bytes == sum(a.nbytes for a in list(arrays.values())[2:])
    assert all(np.array_equal(served[n], a) for n, a in arrays.items())
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_process_wide_read_only_default_applies_to_new_caches(tmp_path: Path) -> None:
    packcache.set_option("packed_cache_read_only", True)
    with WeightCache(tmp_path / "m.pcache") as cache:
        load(cache, packs(count=1))
        st = cache.stats()
    # Nothing to map and nothing may be created: the file "cannot be opened".
    assert (st.state, st.heap_reason, st.errno) == ("heap", "open_failed", errno.ENOENT)
    assert not (tmp_path / "m.pcache").exists()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float16).reshape(3, 4),
        np.array([True, False, True]),
        np.arange(6, dtype=np.complex128).reshape(2, 3) * (1 + 2j),
        np.array(3.5, dtype=np.float64),  # 0-d
        np.zeros((0, 5), dtype=np.int8),  # zero-size
        np.arange(24, dtype=np.uint16).reshape(2, 3, 4)[:, ::2, :],  # not contiguous
        np.arange(10, dtype=np.int64),
    ],
    ids=["f2", "b1", "c16", "0d", "empty", "strided", "i8"],
)
def test_same_bytes_whatever_the_outcome(tmp_path: Path, array: np.ndarray[Any, Any]) -> None:
    served = []
    for path in (tmp_path / "m.pcache", tmp_path / "m.pcache", None):  # stored, hit, heap
        with WeightCache(path) as cache, cache.session() as s:
            served.append(s.get_or_pack("w", lambda: array))
    for got in served:
        assert got.dtype == array.dtype
        assert got.shape == array.shape and got.tobytes() == np.ascontiguousarray(array).tobytes()
        assert not got.flags.writeable


def test_handed_out_arrays_are_read_only(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    for p in (path, path, None):
        with WeightCache(p) as cache, cache.session() as s:
            got = s.get_or_pack("w", lambda: np.ones(16, np.float32))
        with pytest.raises(ValueError, match="read-only"):
            got[0] = 2.0
        with pytest.raises(ValueError):
            got.flags.writeable = True
        assert float(got[0]) == 1.0


def test_mapped_packs_are_aligned(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    arrays = {f"w{i}": np.ones(i * 7 + 1, np.int8) for i in range(6)}
    for _ in range(2):  # stored, then mapped
        with WeightCache(path, alignment=4096) as cache:
            served = load(cache, arrays)
            for a in served.values():
                assert a.ctypes.data % 4096 == 0


def test_pack_requested_twice_counts_once_and_release_stops_counting(tmp_path: Path) -> None:
    calls = []

    def pack() -> np.ndarray[Any, Any]:
        calls.append(1)
        return np.ones(1000, np.float64)

    for path in (tmp_path / "m.pcache", None):
        calls.clear()
        with WeightCache(path) as cache:
            with cache.session() as s:
                a = s.get_or_pack("w", pack)
                b = s.get_or_pack("w", pack)
            held = cache.stats().mapped_bytes + cache.stats().heap_bytes
            assert a is b and held == 8000 and len(calls) == 1
            assert cache.release("w") and not cache.release("w")
            assert cache.stats().mapped_bytes + cache.stats().heap_bytes == 0
            assert float(a.sum()) == 1000.0  # released, still valid


def test_release_by_array_identity(tmp_path: Path) -> None:
    with WeightCache(None) as cache:
        with cache.session() as s:
            a = s.get_or_pack(None, lambda: np.ones(4))
        assert cache.release(a) and cache.stats().heap_bytes == 0


def test_views_stay_valid_after_session_close_and_gc(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    arrays = packs()
    cache = WeightCache(path)
    stored = load(cache, arrays)
    cache.close()
    cache.close()  # idempotent
    cache = WeightCache(path)
    mapped = load(cache, arrays)
    del cache
    gc.collect()
    for n, a in arrays.items():
        assert np.array_equal(stored[n], a) and np.array_equal(mapped[n], a)


def test_close_releases_every_pack_and_leaves_aggregate(tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "m.pcache")
    load(cache, packs())
    assert cache in packcache.cache.live_caches()
    cache.close()
    assert cache.stats().mapped_bytes == 0 and cache not in packcache.cache.live_caches()
    with pytest.raises(SessionError, match="closed"):
        with cache.session():
            pass


def test_failing_pack_propagates_and_session_commits_what_it_stored(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"

    def boom() -> np.ndarray[Any, Any]:
        raise RuntimeError("packer exploded")

    with WeightCache(path) as cache:
        with pytest.raises(RuntimeError, match="packer exploded"):
            with cache.session() as s:
                s.get_or_pack("good", lambda: np.ones(8, np.float32))
                s.get_or_pack("bad", boom)
    with WeightCache(path) as cache, cache.session() as s:
        assert float(s.get_or_pack("good", never).sum()) == 8.0


@pytest.mark.parametrize(
    ("result", "match"),
    [
        ([1, 2, 3], "numpy.ndarray"),
        (np.array(["a"], dtype=object), "dtype"),
        (np.arange(4, dtype=">f4"), "dtype"),
        (np.zeros(2, dtype=[("a", "i4")]), "dtype"),
    ],
)
def test_uncacheable_pack_result_raises_pack_result_error(tmp_path: Path, result: Any, match: str) -> None:
    for path in (tmp_path / "m.pcache", None):
        with WeightCache(path) as cache, cache.session() as s:
            with pytest.raises(PackResultError, match=match):
                s.get_or_pack("w", lambda: result)


def test_invalid_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="alignment"):
        WeightCache(tmp_path / "m", alignment=100)
    with pytest.raises(ValueError, match="platform"):
        WeightCache(tmp_path / "m", platform={"x": "y" * 3000})
    with pytest.raises(ValueError, match="lock_timeout"):
        WeightCache(tmp_path / "m", lock_timeout=-1)
    with WeightCache(tmp_path / "m") as cache, cache.session() as s:
        with pytest.raises(TypeError, match="name"):
            s.get_or_pack("", lambda: np.ones(1))
        with pytest.raises(TypeError, match="JSON"):
            s.get_or_pack("w", lambda: np.ones(1), key={"f": object()})
        with pytest.raises(TypeError, match="mapping"):
            s.get_or_pack("w", lambda: np.ones(1), key=[1, 2])  # type: ignore[arg-type]


def test_platform_change_rebuilds_once_then_maps(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    arrays = packs()
    with WeightCache(path, platform={"torch": "2.13.0"}) as cache:
        load(cache, arrays)
    with WeightCache(path, platform={"torch": "2.14.0"}) as cache:
        load(cache, arrays)
        assert (cache.stats().state, cache.stats().stored) == ("stored", 4)
    with WeightCache(path, platform={"torch": "2.14.0"}) as cache:
        load(cache, arrays)
        assert (cache.stats().state, cache.stats().hits) == ("mapped", 4)


# --------------------------------------------------------------------------- accounting vs the OS

_ANON = textwrap.dedent(
    """
    import json, sys, numpy as np, packcache

    def anonymous():
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no Anonymous line")

    path = sys.argv[1] if sys.argv[1] != "-" else None
    cache = packcache.WeightCache(path)
    base = anonymous()
    arrays = []
    with cache.session() as s:
        for i in range(16):
            a = s.get_or_pack(f"w{i}", lambda i=i: np.full(4 << 20, i, np.float32))
            arrays.append(a)
    touched = sum(int(a.view(np.uint8)[::4096].sum()) for a in arrays)  # one byte of every page
    st = cache.stats()
    print(json.dumps({"anon": anonymous() - base, "heap": st.heap_bytes, "mapped": st.mapped_bytes,
                      "state": st.state, "touched": touched}))
    """
)


def _run_anon(arg: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _ANON, arg], capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_heap_bytes_match_anonymous_memory_growth() -> None:
    r = _run_anon("-")
    assert r["state"] == "off" and r["heap"] == 256 << 20
    assert abs(r["anon"] - r["heap"]) <= 0.03 * r["heap"], r


def test_cold_build_streams_and_warm_cache_adds_almost_no_anonymous_memory(tmp_path: Path) -> None:
    path = str(tmp_path / "m.pcache")
    cold = _run_anon(path)
    assert cold["state"] == "stored" and cold["mapped"] == 256 << 20
    # A cold build streams: each 16 MiB heap copy is dropped once written. glibc may
    # keep one freed chunk, so allow a few chunks, far below the 256 MiB model.
    assert cold["anon"] < 0.15 * cold["mapped"], cold
    warm = _run_anon(path)
    assert warm["state"] == "mapped" and warm["mapped"] == 256 << 20 and warm["heap"] == 0
    assert warm["anon"] < 0.01 * warm["mapped"], warm


def test_a_cache_refuses_to_be_pickled_or_copied_and_says_what_to_save(tmp_path: Path) -> None:
    """An object holding a cache (a model's ``packcache`` attribute) is pickled or deep-copied whole by
    ``torch.save(model)`` and ``copy.deepcopy``: one TypeError that says what to save, not pickle's
    complaint about a lock."""
    import copy
    import pickle

    with WeightCache(tmp_path / "m.pcache") as cache:
        holder = {"weights": np.ones(4), "packcache": cache}
        for attempt in (lambda: pickle.dumps(holder), lambda: copy.deepcopy(holder), lambda: copy.copy(cache)):
            with pytest.raises(TypeError, match=r"cannot be pickled or copied.*state_dict\(\) or save_pretrained"):
                attempt()
        assert cache.stats().state == "mapped" and not cache.closed  # refusing changed nothing


# --------------------------------------------------------------------------- arguments refused at once


@pytest.mark.parametrize("mode", [0o664, 0o666, 0o620, 0o602])
def test_a_file_mode_the_trust_check_would_refuse_is_refused_at_construction(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ValueError, match="untrusted"):
        WeightCache(tmp_path / "m.pcache", file_mode=mode)


def test_a_dir_mode_other_users_may_write_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dir_mode 0777"):
        WeightCache(tmp_path / "d" / "m.pcache", dir_mode=0o777)


def test_a_readable_file_mode_is_accepted_and_reopened_as_trusted(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    with WeightCache(path, file_mode=0o644) as cache, cache.session() as s:
        s.get_or_pack("w", lambda: packed(1), KEY)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert load_all(path, {"w": 1}).hits == 1


@pytest.mark.parametrize("path", ["", "a\0b"])
def test_an_empty_or_nul_path_is_refused(tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="non-empty file path"):
        WeightCache(path)
    assert list(tmp_path.iterdir()) == []  # no ".lock" in the working directory


# --------------------------------------------------------------------------- raised instead of routed


def test_a_masked_array_is_a_pack_result_error_not_a_write_failure(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            with pytest.raises(packcache.PackResultError, match="MaskedArray"):
                s.get_or_pack("w", lambda: np.ma.masked_array([1.0, 2.0], mask=[0, 1]), KEY)
        st = cache.stats()
    assert (st.errno, st.error, st.heap_bytes) == (0, "", 0)


# --------------------------------------------------------------------------- who owns a heap pack


class ScratchPacker:
    """A packer that packs into one reused buffer and returns it (or a view of it)."""

    def __init__(self, view: bool) -> None:
        self.buffer = np.zeros(1024, np.float32)
        self.view = view

    def __call__(self, seed: int) -> Callable[[], np.ndarray[Any, Any]]:
        def pack() -> np.ndarray[Any, Any]:
            self.buffer[:] = packed(seed, 4 * KIB).reshape(-1)
            return self.buffer[:].reshape(64, 16) if self.view else self.buffer

        return pack


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("how", ["disabled", "read_only", "stored"])
def test_heap_packs_stay_bit_identical_when_pack_reuses_its_buffer(tmp_path: Path, how: str, view: bool) -> None:
    path = tmp_path / "m.pcache"
    if how == "read_only":
        build_keyed(path, {"other": 9})  # a valid cache that may not grow
    packer = ScratchPacker(view)
    cache = WeightCache(None if how == "disabled" else path, read_only=how == "read_only")
    with cache, cache.session() as s:
        served = {seed: s.get_or_pack(f"w{seed}", packer(seed), KEY) for seed in range(5)}
        st = cache.stats()
    assert (st.heap_packs if how != "stored" else st.stored) == 5
    for seed, array in served.items():
        assert_same(array, packed(seed, 4 * KIB).reshape(array.shape))
