"""Holes found by adversarial testing (wrong bytes, trust, data loss, routing, accounting).

Each test reproduces one reported failure with real parts (threads forced to
interleave, real processes, real symlinks, hardlinks and FIFOs, real
descriptor limits, a real interrupt) and fails on the code before its fix.
The class behind each hole is closed in one place (docs/RELIABILITY.md
"Attacks and the rule that closes each"); these tests pin the instances.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import KIB, assert_same, build, packed, run_child, two_appenders
from packcache import WeightCache
from packcache import _generations as generations
from packcache import _store as store_mod
from packcache import format as fmt

KEY = {"packer": "test", "version": 1}


@pytest.fixture
def switchy() -> Iterator[None]:
    """Let threads switch after every few bytecodes, so races show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def build_keyed(path: Path, names: dict[str, int]) -> None:
    """A valid cache holding ``packed(seed, 4 KiB)`` per name under ``KEY``, as ``load_all`` requests them."""
    build(path, {name: (seed, 4 * KIB) for name, seed in names.items()}, key=KEY)


def load_all(path: Path, names: dict[str, int], nbytes: int = 4 * KIB) -> packcache.CacheStats:
    """A fresh instance requests every pack; each must be bit-identical to pack()."""
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name, seed in names.items():
                assert_same(s.get_or_pack(name, lambda seed=seed: packed(seed, nbytes), KEY), packed(seed, nbytes))
        return cache.stats()


# --------------------------------------------------------------------------- 1. threads sharing one session


def test_threads_sharing_a_session_store_every_pack_at_its_own_offset(tmp_path: Path, switchy: None) -> None:
    path = tmp_path / "m.pcache"
    names = {f"t{t}.p{i}": 100 * t + i for t in range(8) for i in range(40)}
    served: dict[str, np.ndarray[Any, Any]] = {}
    barrier = threading.Barrier(8)
    with WeightCache(path) as cache:
        with cache.session() as s:

            def work(t: int) -> None:
                barrier.wait()
                for i in range(40):
                    name = f"t{t}.p{i}"
                    served[name] = s.get_or_pack(name, lambda seed=names[name]: packed(seed, 1 * KIB), KEY)

            threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            # Before the commit: every mapped array already holds its own pack's bytes.
            for name, seed in names.items():
                assert_same(served[name], packed(seed, 1 * KIB))
        st = cache.stats()
    assert (st.stored, st.heap_bytes, st.state) == (len(names), 0, "stored")
    for name, seed in names.items():  # and after it
        assert_same(served[name], packed(seed, 1 * KIB))
    assert packcache.verify(path).ok
    again = load_all(path, names, 1 * KIB)
    assert (again.hits, again.stored, again.heap_bytes) == (len(names), 0, 0)


def test_threads_racing_for_the_build_lock_take_it_once_without_waiting_on_their_own_process(
    tmp_path: Path, switchy: None
) -> None:
    path = tmp_path / "m.pcache"
    barrier = threading.Barrier(8)
    with WeightCache(path, lock_timeout=2.0) as cache:
        with cache.session() as s:

            def work(t: int) -> None:
                barrier.wait()  # every thread misses at once: all want the build lock
                s.get_or_pack(f"p{t}", lambda: packed(t, 1 * KIB), KEY)

            threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        st = cache.stats()
    assert st.heap_bytes_by_reason["locked"] == 0, st.error
    assert (st.stored, st.heap_bytes, st.errno) == (8, 0, 0)


def test_two_threads_asking_for_one_name_make_one_pack(tmp_path: Path, switchy: None) -> None:
    calls = []
    started = threading.Event()

    def slow_pack() -> np.ndarray[Any, Any]:
        calls.append(threading.get_ident())
        started.set()
        time.sleep(0.2)
        return packed(7)

    results: list[np.ndarray[Any, Any]] = []
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            first = threading.Thread(target=lambda: results.append(s.get_or_pack("w", slow_pack, KEY)))
            first.start()
            assert started.wait(5)
            results.append(s.get_or_pack("w", slow_pack, KEY))  # arrives while the first is packing
            first.join()
        st = cache.stats()
    assert len(calls) == 1
    assert results[0] is results[1]
    assert (st.stored, st.mapped_bytes) == (1, 4 * KIB)


def test_pack_calls_of_threads_sharing_a_session_run_concurrently(tmp_path: Path) -> None:
    # Each pack() waits for the other to start: this completes only if the two run at the same time.
    both = threading.Barrier(2, timeout=10)

    def pack(seed: int) -> Callable[[], np.ndarray[Any, Any]]:
        def run() -> np.ndarray[Any, Any]:
            both.wait()
            return packed(seed)

        return run

    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            other = threading.Thread(target=lambda: s.get_or_pack("a", pack(1), KEY))
            other.start()
            b = s.get_or_pack("b", pack(2), KEY)
            other.join()
        st = cache.stats()
    assert_same(b, packed(2))
    assert (st.stored, st.heap_bytes) == (2, 0)


def test_a_request_after_the_session_ended_raises_and_the_session_waits_for_running_ones(tmp_path: Path) -> None:
    release = threading.Event()
    entered = threading.Event()

    def slow() -> np.ndarray[Any, Any]:
        entered.set()
        assert release.wait(10)
        return packed(3)

    out: list[np.ndarray[Any, Any]] = []
    with WeightCache(tmp_path / "m.pcache") as cache:
        s = cache.session()
        with s:
            worker = threading.Thread(target=lambda: out.append(s.get_or_pack("late", slow, KEY)))
            worker.start()
            assert entered.wait(5)
            threading.Timer(0.2, release.set).start()
        # __exit__ returned only after the running request finished and was committed.
        worker.join()
        assert cache.stats().stored == 1
        with pytest.raises(packcache.SessionError):
            s.get_or_pack("after", lambda: packed(4), KEY)
    assert_same(out[0], packed(3))
    assert packcache.verify(tmp_path / "m.pcache").entries == 1


# --------------------------------------------------------------------------- 2. one file, several spellings

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


# --------------------------------------------------------------------------- 3. who owns a heap pack


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


# --------------------------------------------------------------------------- 5. a symlink swapped in after the check


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


# --------------------------------------------------------------------------- 7, 20. arguments refused at once


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


# --------------------------------------------------------------------------- 10. writer-side caps


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


# --------------------------------------------------------------------------- 11. descriptors and mappings


MANY_PACKS = """
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from packcache.memory import file_mapping_usage
path = sys.argv[1]

def maps_of(p):
    real = os.path.realpath(p)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip("\\n").endswith(real))

cache = packcache.WeightCache(path)
with cache.session() as s:
    views = [s.get_or_pack(f"w{i}", lambda i=i: packed(i, 8 * 1024), {"v": 1}) for i in range(1100)]
    during = maps_of(path)
cold = stats_dict(cache)
cold_maps, cold_usage = maps_of(path), file_mapping_usage(path)
fds = len(os.listdir("/proc/self/fd"))
same = all(v.tobytes() == packed(i, 8 * 1024).tobytes() for i, v in enumerate(views))
del views
cache.close()
cache = packcache.WeightCache(path)
with cache.session() as s:
    warm_views = [s.get_or_pack(f"w{i}", lambda: None, {"v": 1}) for i in range(1100)]
warm = stats_dict(cache)
report(cold=cold, warm=warm, during=during, cold_maps=cold_maps, cold_size=cold_usage.size, fds=fds, same=same,
       warm_maps=maps_of(path), file_size=os.stat(path).st_size)
"""


def test_a_cold_build_of_1100_packs_needs_no_descriptor_per_pack_and_maps_the_file_once(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    out = run_child(MANY_PACKS, str(path), timeout=120)
    cold, warm = out["cold"], out["warm"]
    assert (cold["stored"], cold["heap_bytes"], cold["errno"], cold["state"]) == (1100, 0, 0, "stored"), cold
    assert out["same"]
    assert (warm["hits"], warm["heap_bytes"], warm["state"]) == (1100, 0, "mapped"), warm
    assert out["fds"] < 20  # ulimit -n 64: a descriptor per pack would have run out at ~60
    assert out["during"] <= 16 and out["cold_maps"] <= 16 and out["warm_maps"] <= 2
    page = os.sysconf("SC_PAGE_SIZE")
    # Mapped once, at the file's size: not once per pack plus once whole (the "112 MiB for 56 MiB").
    assert out["cold_size"] <= out["file_size"] + out["cold_maps"] * page


# --------------------------------------------------------------------------- 12. interrupts


def test_an_interrupt_while_a_session_starts_leaves_the_cache_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"w": 1})
    cache = WeightCache(path)
    real_refresh = store_mod.FileStore.refresh

    def interrupted(self: store_mod.FileStore) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(store_mod.FileStore, "refresh", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with cache.session():
            pass
    monkeypatch.setattr(store_mod.FileStore, "refresh", real_refresh)
    done = threading.Event()

    def other_thread() -> None:
        with cache.session() as s:
            s.get_or_pack("w", lambda: packed(1), KEY)
        done.set()

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    assert done.wait(10), "another thread's session blocked on a lock the interrupted session kept"
    with cache.session() as s:  # and this thread is not "already active"
        assert_same(s.get_or_pack("w", lambda: packed(1), KEY), packed(1))
    assert (cache.stats().hits, cache.stats().mapped_bytes) == (1, 4 * KIB)  # held since the other thread's hit
    cache.close()


def test_an_interrupt_during_the_commit_keeps_the_previous_generation_and_counts_what_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"old": 1})
    before = path.read_bytes()
    calls = {"n": 0}
    real = os.fdatasync

    def interrupt_second_sync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # after the index, before the slot is durable
        real(fd)

    cache = WeightCache(path)
    monkeypatch.setattr(store_mod.os, "fdatasync", interrupt_second_sync)
    with pytest.raises(KeyboardInterrupt):
        with cache.session() as s:
            s.get_or_pack("old", lambda: packed(1), KEY)
            new = s.get_or_pack("new", lambda: packed(2), KEY)
    monkeypatch.undo()
    assert_same(new, packed(2))
    st = cache.stats()
    assert (st.mapped_bytes, st.heap_bytes_by_reason["write_failed"], st.state) == (4 * KIB, 4 * KIB, "degraded")
    with cache.session() as s:  # usable, and it heals: "new" is stored again and committed
        s.get_or_pack("new", lambda: packed(2), KEY)
    assert cache.stats().state == "stored"
    cache.close()
    assert packcache.verify(path).ok and len(path.read_bytes()) > len(before)
    assert load_all(path, {"old": 1, "new": 2}).hits == 2


# --------------------------------------------------------------------------- 13, 17, 19. raised instead of routed


def test_an_empty_entry_with_an_absurd_shape_is_rejected_never_raised_by_a_load(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    header = fmt.encode_header(64, b"{}")
    entry = fmt.Entry("w", b"{}", fmt.key_digest("w", b"{}"), "f8", (2**62, 0), fmt.data_start_for(64), 0, 0)
    record = fmt.ENTRY_FIXED.pack(entry.digest, entry.offset, 0, 0, 1, 2, 0, b"f8\0\0", 2)
    index_body = record + np.array(entry.shape, "<u8").tobytes() + b"w" + b"{}"
    index_body += bytes(fmt.align_up(len(index_body), 8) - len(index_body))
    index = fmt.INDEX_HEAD.pack(fmt.INDEX_MAGIC, 1, 0) + index_body
    at = fmt.data_start_for(64)
    slot = fmt.Slot(1, at, len(index), 1, fmt.zlib.crc32(index) & 0xFFFFFFFF)
    data = bytearray(header) + index
    data[fmt.slot_offset(1) : fmt.slot_offset(1) + 64] = fmt.encode_slot(slot)
    path.write_bytes(bytes(data))
    os.chmod(path, 0o600)
    assert not packcache.verify(path).ok
    with WeightCache(path) as cache:
        with cache.session() as s:
            w = s.get_or_pack("w", lambda: np.zeros(3), KEY)  # rebuilt, never "array is too big"
        assert cache.stats().stored == 1
    assert w.shape == (3,)


def test_a_masked_array_is_a_pack_result_error_not_a_write_failure(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            with pytest.raises(packcache.PackResultError, match="MaskedArray"):
                s.get_or_pack("w", lambda: np.ma.masked_array([1.0, 2.0], mask=[0, 1]), KEY)
        st = cache.stats()
    assert (st.errno, st.error, st.heap_bytes) == (0, "", 0)


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


# --------------------------------------------------------------------------- 18. options and fixes take effect


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


# --------------------------------------------------------------------------- 21, 22, commit. what the state says


def test_a_file_that_cannot_be_opened_shows_degraded_before_any_pack(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    with WeightCache(blocker / "m.pcache") as cache:
        with cache.session():
            pass  # nothing requested yet
        st = cache.stats()
        assert (st.state, st.errno, st.failing) == ("degraded", errno.ENOTDIR, True)
        assert cache.get_option("packed_cache_state") == "degraded"
        assert packcache.get_option("packed_cache_state") == "degraded"


def test_an_untrusted_file_shows_degraded_before_any_pack(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"a": 1})
    os.chmod(path, 0o666)
    with WeightCache(path) as cache:
        with cache.session():
            pass
        assert cache.stats().state == "degraded"


def test_aggregate_heap_reason_names_the_failure_not_a_bigger_legitimate_reason(tmp_path: Path) -> None:
    opted_out = WeightCache(None)
    path = tmp_path / "m.pcache"
    build_keyed(path, {"a": 1})
    failing = WeightCache(path, read_only=True)
    with opted_out.session() as s:
        s.get_or_pack("big", lambda: packed(1, 1024 * KIB), KEY)
    with failing.session() as s:
        s.get_or_pack("a", lambda: packed(1), KEY)  # mapped: the aggregate is degraded, not heap
        s.get_or_pack("small", lambda: packed(2, 4 * KIB), KEY)
    total = packcache.aggregate_stats()
    assert total.state == "degraded"
    assert total.heap_reason == "read_only"
    assert packcache.get_option("packed_cache_heap_reason") == "read_only"
    opted_out.close()
    failing.close()


def test_a_failed_final_sync_counts_the_session_packs_as_heap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # EIO from fdatasync cannot be produced reliably on this machine (no faulty device); the
    # failure is injected at exactly the commit's last sync.
    path = tmp_path / "m.pcache"
    build_keyed(path, {"old": 1})
    calls = {"n": 0}
    real = os.fdatasync

    def fail_second(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(store_mod.os, "fdatasync", fail_second)
    with WeightCache(path) as cache:
        with cache.session() as s:
            s.get_or_pack("old", lambda: packed(1), KEY)
            s.get_or_pack("new", lambda: packed(2), KEY)
        st = cache.stats()
    assert (st.mapped_bytes, st.heap_bytes_by_reason["write_failed"], st.errno) == (4 * KIB, 4 * KIB, errno.EIO)
    assert st.state == "degraded"


# --------------------------------------------------------------------------- FIFOs and foreign lock files


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


def _enter_and_leave_without_exit(cache: WeightCache) -> packcache.Session:
    """What an interrupt in the instant between a ``with`` block's end and ``__exit__`` leaves behind."""
    session = cache.session()
    session.__enter__()
    session.get_or_pack("stored-then-abandoned", lambda: packed(5), KEY)
    return session  # this frame returns: the session's ``with`` block is gone, __exit__ never ran


def test_a_session_left_without_exit_is_ended_by_the_same_threads_next_session(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"w": 1})
    cache = WeightCache(path)
    abandoned = _enter_and_leave_without_exit(cache)
    with cache.session() as s:  # not "already active": the abandoned session is ended first
        assert_same(s.get_or_pack("w", lambda: packed(1), KEY), packed(1))
    st = cache.stats()
    # What the abandoned session stored was never committed: counted as heap, not as mapped.
    assert st.heap_bytes_by_reason["write_failed"] == 4 * KIB and st.hits == 1
    with pytest.raises(packcache.SessionError):
        abandoned.get_or_pack("late", lambda: packed(6), KEY)
    cache.close()
    assert packcache.verify(path).ok


def test_a_nested_session_in_the_same_thread_is_still_an_error(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session():
            with pytest.raises(packcache.SessionError, match="already active in this thread"):
                with cache.session():
                    pass
            with pytest.raises(packcache.SessionError, match="inside this thread's own session"):
                cache.close()


def test_a_session_whose_thread_died_is_ended_by_another_thread(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build_keyed(path, {"w": 1})
    cache = WeightCache(path)
    worker = threading.Thread(target=_enter_and_leave_without_exit, args=(cache,))
    worker.start()
    worker.join()
    done = threading.Event()

    def other() -> None:
        with cache.session() as s:
            s.get_or_pack("w", lambda: packed(1), KEY)
        done.set()

    threading.Thread(target=other, daemon=True).start()
    assert done.wait(10), "a session left by a dead thread blocked every other thread"
    cache.close()
