"""Sessions of a WeightCache (``packcache.cache.Session``): their lifetime, threads sharing one,
threads and caches waiting for each other, interrupts.

Threads are forced to interleave (``sys.setswitchinterval``, barriers) and interrupts are raised at the
worst instant, so a race or a lock left held fails a test instead of showing up once in a while.
The tests of the holes in docs/RELIABILITY.md reproduce one reported failure each and fail on the code before its fix
(docs/RELIABILITY.md "Attacks and the rule that closes each").
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import KEY, KIB, assert_same, build_keyed, load_all, packed, stuck_in_pack
from packcache import SessionError, WeightCache
from packcache import _store as store_mod
from test_cache import load, never, packs

# --------------------------------------------------------------------------- misuse


def test_session_misuse_raises_session_error(tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "m.pcache")
    session = cache.session()
    with pytest.raises(SessionError, match="outside an active session"):
        session.get_or_pack("w", lambda: np.ones(1))
    with cache.session():
        with pytest.raises(SessionError, match="already active"):
            with cache.session():
                pass
        with pytest.raises(SessionError, match="inside this thread's own session"):
            cache.close()
    cache.close()


# --------------------------------------------------------------------------- threads


def test_sessions_of_two_threads_on_one_cache_serialise(tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "m.pcache")
    entered_b = threading.Event()

    def b() -> None:
        with cache.session() as s:
            entered_b.set()
            s.get_or_pack("b", lambda: np.zeros(4))

    tb = threading.Thread(target=b)
    with stuck_in_pack(cache, "a", timeout=5):  # a's session is inside pack() until the block ends
        tb.start()
        assert not entered_b.wait(0.3), "second session entered while the first held the cache"
    tb.join(5)
    assert entered_b.is_set() and cache.stats().stored == 2
    cache.close()


def test_two_caches_on_one_path_in_one_thread_do_not_deadlock(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    first, second = WeightCache(path), WeightCache(path, lock_timeout=0.1)
    with first.session() as s1:
        s1.get_or_pack("a", lambda: np.ones(4))  # first now holds the build lock
        started = time.monotonic()
        with second.session() as s2:
            got = s2.get_or_pack("b", lambda: np.zeros(4))
        assert time.monotonic() - started < 5
    assert second.stats().heap_reason == "locked" and np.array_equal(got, np.zeros(4))
    with second.session() as s2:
        s2.get_or_pack("a", never)
        s2.get_or_pack("c", lambda: np.full(4, 3.0))
    assert second.stats().hits == 1 and second.stats().stored == 1
    first.close()
    second.close()


def test_two_caches_on_one_path_in_two_threads_wait_then_map(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    arrays = packs()
    barrier = threading.Barrier(2)
    caches = [WeightCache(path), WeightCache(path)]
    results: list[dict[str, Any]] = [{}, {}]

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = load(caches[i], arrays)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stored = sorted(c.stats().stored for c in caches)
    hits = sorted(c.stats().hits for c in caches)
    assert stored == [0, 4] and hits == [0, 4], "exactly one builds, the other waits and maps"
    for r in results:
        assert all(np.array_equal(r[n], a) for n, a in arrays.items())
    for c in caches:
        c.close()


# --------------------------------------------------------------------------- threads sharing one session


@pytest.fixture
def switchy() -> Iterator[None]:
    """Let threads switch after every few bytecodes, so races show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


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


# --------------------------------------------------------------------------- interrupts and failed commits


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


# --------------------------------------------------------------------------- sessions nobody ended


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
