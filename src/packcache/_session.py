"""A session: one model load's ownership of a cache, and each of its requests gathered, routed and served.

:class:`Session` holds the cache's :class:`Owner` from its entry to its exit, takes the cross-process build
lock at its first miss, and commits what it stored when it ends. Each request is "gather the facts ->
:func:`packcache._routing.route` -> act": serve a hit, store, fetch first, take the lock first, or serve
from heap with a reason. A cache problem is counted, logged once per reason and answered with a heap pack;
it never raises.

Threads may share one session (a thread pool packing the layers of a cold build): ``pack()`` callables run
concurrently, while routing, appends and the bookkeeping are serialised by the session's mutex, two threads
asking for one name make one pack, and the build lock is waited for without the mutex (hits go on).
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType, TracebackType
from typing import Any, Protocol

import numpy as np

from . import format as fmt
from ._checks import PackFn, PackKey, Request, check_embedded_pack, owns_memory, read_only_view, request_key, validated
from ._commit import commit, commit_failed
from ._faults import Fault, ending
from ._ledger import Held, Ledger
from ._owner import CacheState, Owner
from ._remote import ReadThrough, RemoteState
from ._routing import Entry, Facts, Holding, Lock, Route, RouteKind, route
from ._store import FileStore
from .errors import SessionError
from .stats import FAILURE_REASONS, HeapReason

__all__ = ["Session", "SessionState"]

logger = logging.getLogger("packcache")

# Members as module names (read through the class, each costs ~0.2 us on Python 3.11); and the facts of
# a repeat (row 3: a hit), the warm path's commonest request, made once (tests/test_routing.py routes them).
_HIT, _NOTHING, _SERVABLE_HELD = RouteKind.HIT, Holding.NOTHING, Holding.SERVABLE
_RETRY, _UNBACKED = Holding.RETRY, Holding.UNBACKED
_SERVABLE = Facts(held=Holding.SERVABLE)


class SessionCache(Protocol):
    """What a session reads of its :class:`~packcache.WeightCache` (it is made by one)."""

    path: str | None
    platform: bytes
    enabled: bool
    verify: bool
    lock_timeout: float
    remote_timeout: float
    trusted_keys: tuple[bytes | str, ...]
    allow_unsigned: bool
    _owner: Owner
    _ledger: Ledger
    _store: FileStore | None
    _remote: ReadThrough

    @property
    def read_only(self) -> bool: ...

    @property
    def finalized(self) -> bool: ...


class SessionState(enum.Enum):
    """Where a :class:`Session` is in its life; it only moves down this list.

    ``UNOPENED`` (made by :meth:`WeightCache.session`, not entered yet) -> ``ACTIVE`` (entered: it owns the
    cache and serves requests) -> ``CLOSING`` (its ``__exit__`` runs: it waits for other threads' requests,
    commits, and takes no new request) -> ``CLOSED`` (ended: by its exit, by a failed entry, or by another
    session finding it abandoned). ``CLOSED`` is final and may be reached from every state. Each other
    move raises :class:`~packcache.errors.SessionError`, with one message per case: entering twice, or a
    request in each state but ``ACTIVE`` (:data:`_NOT_SERVING`). Pinned by tests/test_cache_session_states.py.
    """

    UNOPENED = "unopened"
    ACTIVE = "active"
    CLOSING = "closing"
    CLOSED = "closed"


#: Why a request cannot be served in each state but ``ACTIVE`` (the message of its SessionError).
_NOT_SERVING = {
    SessionState.UNOPENED: "before the session was entered",
    SessionState.CLOSING: "while the session is closing (its with block has been left)",
    SessionState.CLOSED: "after the session ended",
}


class Session:
    """One model load on a :class:`WeightCache`; use it as a context manager.

    While active it holds the cache's instance lock (other threads' sessions
    wait), and from its first miss the cross-process build lock. On exit it
    waits for requests still running in other threads, commits what it stored
    and releases both locks.

    Threads may share a session: their ``pack()`` calls run concurrently; routing,
    appends and bookkeeping are serialised; two threads asking for one name make
    one pack (the second waits for the first and is served the same array).

    Its life is one :class:`SessionState` (``state``), never a set of flags.
    """

    def __init__(self, cache: SessionCache) -> None:
        self._cache = cache
        # What a session shares with its cache, and all it touches of it besides public attributes.
        self._owner, self._ledger, self._store = cache._owner, cache._ledger, cache._store
        self._state = SessionState.UNOPENED  # moves only through _claim, __exit__ and _end (see SessionState)
        self._serial = 0
        self._mutex = threading.Lock()
        # Requests running, per thread. The exit waits only for *other* threads': a count of the
        # exiting thread's own is a request an interrupt cut short, which nothing will finish.
        self._calls: dict[int, int] = {}
        self._locking = threading.Lock()  # the thread waiting for the build lock holds it, not the mutex
        self._lock_fault: Fault | None = None
        self._inflight: dict[str, threading.Event] = {}
        self._thread = 0  # the thread that entered the session
        self._frame: FrameType | None = None  # the frame running the ``with`` block (see _abandoned)
        #: Called with the number of requests just answered (hits, stores and heap packs alike), outside every
        #: lock: a loader's progress bar (``packcache._progress``). ``None``: nothing is told.
        self.progress: Callable[[int], object] | None = None

    @property
    def cache(self) -> SessionCache:
        """The :class:`WeightCache` this session loads from."""
        return self._cache

    @property
    def state(self) -> SessionState:
        """Where this session is in its life (:class:`SessionState`)."""
        return self._state

    def __enter__(self) -> Session:
        try:
            self._claim(sys._getframe(1))
            return self
        # pinned by tests/test_cache_sessions.py::test_an_interrupt_while_a_session_starts_leaves_the_cache_usable
        except BaseException:  # KeyboardInterrupt in the refresh included: never leave the cache owned
            # Inline, not in a helper: calling a function is itself a point where a pending interrupt is raised.
            for _ in range(8):
                try:
                    self._end()
                    break
                except BaseException:  # another interrupt during the clean-up: finish it first
                    continue
            raise

    def _claim(self, frame: FrameType) -> None:
        """Become the cache's session (waiting for another thread's), then read the file."""
        owner = self._owner
        me = threading.get_ident()
        while True:
            with owner.lock:
                if self._state is not SessionState.UNOPENED:
                    was = self._state.value
                    raise SessionError(f"a session is entered once (this one is {was}); start another: cache.session()")
                current = owner.session
                if current is None:
                    if owner.state is CacheState.CLOSED:
                        raise SessionError(f"the cache {self._cache.path!r} is closed")
                    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("contextlib"):
                        frame = frame.f_back  # entered through an ExitStack: the user's frame is further out
                    self._thread, self._frame = me, frame
                    owner.session, owner.thread = self, me
                    owner.serial += 1
                    self._serial = owner.serial
                    self._state = SessionState.ACTIVE
                    self._ledger.set(commit_fault=None)  # a new load: its own packs will say what is durable
                    self._refresh()
                    return
                abandoned = current._abandoned()
                if not abandoned and owner.thread == me:
                    raise SessionError(f"a session on {self._cache.path!r} is already active in this thread")
            if abandoned:
                current._end()
            else:
                time.sleep(0.002)  # another thread's session: polled, so an interrupt cannot corrupt a wait

    def _abandoned(self) -> bool:
        """Whether nobody can end this session any more: the thread that entered it is gone, or
        (asked from that thread) the frame that entered it has returned, so its ``with`` block was
        left without ``__exit__`` running (an interrupt in the instant between the two)."""
        current = sys._current_frames()
        # pinned by tests/test_cache_sessions.py::test_a_session_whose_thread_died_is_ended_by_another_thread
        if self._thread not in current:
            return True
        if self._thread != threading.get_ident():
            return False  # alive elsewhere: that thread will end it
        frame: FrameType | None = sys._getframe()
        while frame is not None:
            if frame is self._frame:
                return False
            frame = frame.f_back
        return True

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        store = self._store
        try:
            me = threading.get_ident()
            while True:  # wait for other threads' requests still running (polled, see _claim)
                with self._mutex:
                    if self._state is SessionState.ACTIVE:
                        self._state = SessionState.CLOSING
                    # pinned by
                    # tests/test_cache_sessions.py::test_a_request_after_the_session_ended_raises_and_the_session_waits_for_running_ones  # noqa: E501
                    busy = any(count for thread, count in self._calls.items() if thread != me)
                if not busy:
                    break
                time.sleep(0.001)
            if store is not None and store.pending:
                commit(store, self._ledger, self._serial)
        finally:
            interrupted: BaseException | None = None
            for _ in range(8):  # inline for the same reason as in __enter__
                try:
                    self._end()
                    break
                except BaseException as exc:  # an interrupt during the clean-up: finish it, then raise it
                    interrupted = interrupted or exc
            if interrupted is not None:
                raise interrupted

    def _end(self) -> None:
        """Release the build lock and the cache, if this session holds them (idempotent)."""
        owner, store = self._owner, self._store
        self._state = SessionState.CLOSED
        with owner.lock:
            if owner.session is not self:
                return
            try:
                if store is not None:
                    if store.pending:  # interrupted before its commit: what it stored is not durable
                        names = store.pending_names
                        store.abort()
                        ended = Fault(HeapReason.WRITE_FAILED, 0, f"session on {store.path} ended before its commit")
                        commit_failed(store, self._ledger, self._serial, names, ended)
                    store.release_lock()
            finally:  # whatever interrupts the clean-up, the cache is free again
                owner.session, owner.thread, self._frame = None, None, None

    def _refresh(self) -> None:
        """Read what the file holds now. Runs with exclusive access: on entry, or under the mutex."""
        store, ledger = self._store, self._ledger
        if store is None or not self._cache.enabled:
            return
        started = time.perf_counter()
        store.refresh()
        ledger.add(map_seconds=time.perf_counter() - started)
        status = store.status
        ledger.set(file_bytes=status.size, reclaimable_bytes=status.reclaimable_bytes, blocking=status.blocking)
        if status.replacing and ledger.log_once("rebuild"):
            logger.warning("packcache: cache file %s will be rebuilt as a new file: %s", store.path, status.replacing)
        if status.blocking is not None:
            ledger.report(status.blocking.reason, status.blocking)

    def get_or_pack(
        self, name: str | None, pack: PackFn, key: Mapping[str, Any] | PackKey | None = None
    ) -> np.ndarray[Any, Any]:
        """Return the packed array for ``name``: mapped from the file, or packed now.

        Args:
            name: a stable name for the pack (e.g. ``"layers.0.attn.wq"``), or
                ``None`` when there is none (the pack then goes to heap, ``unnamed``).
            pack: zero-argument callable returning a numpy array. Not called on a hit.
                It may reuse its buffers: the cache copies what it serves from heap
                unless the returned array is exclusively its own.
            key: JSON-serialisable mapping of everything else that identifies the
                pack (packer id/version/params, source shape/dtype/identity), or a
                :class:`PackKey` made of one. A stored entry with another key is stale
                and is replaced.

        Returns:
            A read-only array with the dtype, shape and bytes ``pack()`` returns.

        Raises:
            PackResultError: ``pack()`` returned something that is not a cacheable array.
            SessionError: the session is not active (or is ending).
            TypeError/ValueError: invalid ``name`` or ``key``.
            Whatever ``pack()`` raises. Cache problems are never raised.
        """
        array = self._get_or_pack(name, pack, key)
        if self.progress is not None:
            self.progress(1)
        return array

    def _get_or_pack(
        self, name: str | None, pack: PackFn, key: Mapping[str, Any] | PackKey | None
    ) -> np.ndarray[Any, Any]:
        key_bytes = request_key(name, key)
        cached = self._cache.enabled and self._store is not None
        me = threading.get_ident()
        with self._mutex:
            if self._state is not SessionState.ACTIVE:
                raise self._not_serving("get_or_pack()")
            if cached and name is not None:
                if name not in self._ledger.held and not self._cache.verify:
                    first = self._serve_committed([name], [key_bytes])  # get_many's one-pass path
                    if first is not None and first[0] is not None:
                        return first[0]
                facts, found = self._facts(name, key_bytes)
                if found is not None and (facts is _SERVABLE or route(facts).kind is _HIT):
                    return found  # served without leaving the mutex: nothing to wait for at exit
            self._calls[me] = self._calls.get(me, 0) + 1
        try:
            if not cached:
                return self._heap_only(name, key_bytes, pack, True)
            if name is None:
                return self._heap_only(None, b"", pack, False)
            return self._route(name, pack, key_bytes)
        finally:
            with self._mutex:
                self._calls[me] -= 1

    def get_many(self, requests: Iterable[Request]) -> list[np.ndarray[Any, Any]]:
        """:meth:`get_or_pack` for many packs at once (a layer, a model): the arrays, in order.

        The committed packs among them are served in one pass, under one acquisition of the session's
        mutex, with one update of the statistics; each of the others (a miss, a pack held since an earlier
        session, a pack that needs a check) then goes through :meth:`get_or_pack`, with the same routing,
        counting and errors. Every name and key is checked before anything is served.

        Args:
            requests: ``(name, pack, key)`` triples, as :meth:`get_or_pack` takes them.

        Raises:
            as :meth:`get_or_pack`.

        >>> import numpy as np, tempfile, os
        >>> from packcache import PackKey, WeightCache
        >>> path = os.path.join(tempfile.mkdtemp(), "m.pcache")
        >>> key = PackKey({"packer": "ones", "version": 1})
        >>> requests = [("a", lambda: np.ones(2), key), ("b", lambda: np.zeros(3), key)]
        >>> for launch in ("cold", "warm"):
        ...     with WeightCache(path) as cache:
        ...         with cache.session() as s:
        ...             a, b = s.get_many(requests)
        ...         print(launch, cache.stats().stored, cache.stats().hits, b.shape)
        cold 2 0 (3,)
        warm 0 2 (3,)
        """
        asked = requests if isinstance(requests, list) else list(requests)
        keys = [request_key(name, key) for name, _, key in asked]
        served: list[np.ndarray[Any, Any] | None] = [None] * len(asked)
        with self._mutex:
            if self._state is not SessionState.ACTIVE:
                raise self._not_serving("get_many()")
            if self._cache.enabled and self._store is not None and not self._cache.verify:
                held = self._ledger.held
                names = [request[0] for request in asked]
                # A name asked twice is served once here; the other requests of it go through get_or_pack.
                unique = len(set(names)) == len(names)
                numbers = [i for i, name in enumerate(names) if name is not None and name not in held] if unique else []
                found = self._serve_committed([names[i] for i in numbers], [keys[i] for i in numbers])  # type: ignore[misc]  # numbers holds no None name
                if found is not None:
                    for i, array in zip(numbers, found, strict=True):
                        served[i] = array
        if self.progress is not None:
            self.progress(sum(array is not None for array in served))  # the rest count themselves in get_or_pack
        for i, request in enumerate(asked):
            if served[i] is None:
                served[i] = self.get_or_pack(request[0], request[1], PackKey.from_canonical(keys[i]))
        return served  # type: ignore[return-value]  # every slot is filled above

    def _not_serving(self, what: str) -> SessionError:
        return SessionError(
            f"{what} called outside an active session, {_NOT_SERVING[self._state]} (use 'with cache.session() as s')"
        )

    def _serve_committed(self, names: list[str], keys: list[bytes]) -> list[np.ndarray[Any, Any] | None] | None:
        """First hits, under the mutex: for each name (none held by this cache yet) and key, the committed pack
        mapped by :meth:`FileStore.serve_many <packcache._store.FileStore.serve_many>` and held, counted in one
        change of the ledger; None where that pass does not decide (the caller routes it), and None for all of
        them when it does not apply (see ``serve_many``)."""
        store = self._store
        assert store is not None
        if not names:
            return None
        started = time.perf_counter()
        found = store.serve_many(list(zip(names, keys, strict=True)))
        if found is None:
            return None
        serial, hits = self._serial, []
        arrays: list[np.ndarray[Any, Any] | None] = []
        for name, hit in zip(names, found, strict=True):
            if hit is None:
                arrays.append(None)
                continue
            arrays.append(hit[0])
            hits.append((name, Held(hit[0], hit[2], None, serial, hit[1])))  # the index's key bytes: one copy kept
        self._ledger.hold_hits(hits, map_seconds=time.perf_counter() - started)
        return arrays

    def _heap_only(self, name: str | None, key: bytes, pack: PackFn, disabled: bool) -> np.ndarray[Any, Any]:
        if name is not None:
            with self._mutex:
                held = self._ledger.held.get(name)
                if held is not None and held.key == key:
                    return held.array  # the same pack again: served and counted once
        array, owned = self._packed(pack)
        decided = route(Facts(cached=False) if disabled else Facts(named=False))
        with self._mutex:
            return self._serve_heap(name, key, array, owned, decided)

    def _route(self, name: str, pack: PackFn, key: bytes) -> np.ndarray[Any, Any]:
        """Gather the facts, route, act; again after waiting (for the build lock, or another thread's pack)."""
        while True:
            mine: threading.Event | None = None
            try:
                with self._mutex:
                    facts, found = self._facts(name, key)
                    decided = route(facts)
                    if decided.kind is RouteKind.HIT:
                        assert found is not None
                        return found  # held, or mapped from the file as it was looked up
                    # pinned by tests/test_cache_sessions.py::test_two_threads_asking_for_one_name_make_one_pack
                    waiting = self._inflight.get(name)
                    if waiting is not None and waiting.is_set():
                        del self._inflight[name]  # left by a request an interrupt cut short
                        waiting = None
                    if waiting is None and decided.kind is RouteKind.HEAP:
                        reused = self._reuse_heap(name, key, decided)
                        if reused is not None:
                            return reused
                    if waiting is None and (decided.kind is RouteKind.HEAP or decided.kind is RouteKind.STORE):
                        mine = self._inflight[name] = threading.Event()
                if mine is None:
                    if waiting is not None:
                        waiting.wait()  # another thread is making this pack: take its result
                    else:
                        self._take_build_lock(fetch=decided.kind is RouteKind.FETCH_FIRST)
                    continue
                array, owned = self._packed(pack)
                if name.startswith("packcache."):
                    check_embedded_pack(name, key, array)
                with self._mutex:
                    if decided.kind is RouteKind.HEAP:
                        return self._serve_heap(name, key, array, owned, decided)
                    return self._store_pack(name, key, array, owned, facts)
            finally:
                if mine is not None:
                    mine.set()  # first: a waiter must never wait on an event nobody will set
                    with self._mutex:
                        if self._inflight.get(name) is mine:
                            del self._inflight[name]

    def _holding(self, name: str, held: Held) -> Holding:
        """What a pack held under the request's name and key is worth now (the caller compared the key)."""
        if held.reason in FAILURE_REASONS and held.session != self._serial:
            # Sent to heap by a failure in an earlier session: routed again, the failure may be gone
            # (lock released, space freed), and the cache should heal.
            return _RETRY
        # A held mapped pack is served again only while the file still holds its bytes: another process may
        # have truncated, replaced or corrupted the file since (the refresh saw it); the old view could SIGBUS.
        store = self._store
        if held.origin is None or store is None or store.holds(name, held.key, held.origin):
            return _SERVABLE_HELD
        return _UNBACKED

    def _facts(self, name: str, key: bytes) -> tuple[Facts, np.ndarray[Any, Any] | None]:
        """What this session knows of a named request (under the mutex), and the array when that is a hit.

        Looking the entry up is mapping it (:meth:`FileStore.serve <packcache._store.FileStore.serve>` is one
        call): a valid entry is held and counted as a hit here, which is what :func:`route` answers for it.
        """
        cache, store, ledger = self._cache, self._store, self._ledger
        assert store is not None
        held = ledger.held.get(name)
        holding = _NOTHING
        if held is not None and held.key == key:
            holding = self._holding(name, held)
            if holding is _SERVABLE_HELD:
                return _SERVABLE, held.array  # the same pack again: served and counted once
        status = store.status
        entry, entry_fault = Entry.UNKNOWN, None
        if status.blocking is None:
            started = time.perf_counter()
            with ending() as end:
                served = store.serve(name, key, verify=cache.verify)
            if end.fault is None and served is not None:
                array, origin = served
                ledger.hold(
                    name, Held(array, key, None, self._serial, origin), outcome="hits",
                    map_seconds=time.perf_counter() - started,
                )  # fmt: skip
                return Facts(held=holding, entry=Entry.VALID), array
            ledger.add(map_seconds=time.perf_counter() - started)
            entry, entry_fault = (Entry.ABSENT, None) if end.fault is None else (Entry.UNMAPPABLE, end.fault)
        lock_fault = self._lock_fault
        lock = Lock.FAILED if lock_fault is not None else Lock.HELD if store.locked else Lock.NOT_TAKEN
        remote = cache._remote
        facts = Facts(
            held=holding, entry=entry, entry_fault=entry_fault, blocking=status.blocking, finalized=cache.finalized,
            read_only=cache.read_only, read_only_fault=status.read_only_fault, path=cache.path or "", lock=lock,
            lock_fault=lock_fault, remote=remote.state is not RemoteState.NONE, remote_tried=remote.tried,
        )  # fmt: skip
        return facts, None

    def _take_build_lock(self, fetch: bool) -> None:
        """Wait for the build lock without holding the mutex (other threads keep serving hits), then re-read
        the file: another process may have committed while we waited. ``fetch``: the route said to fetch the
        published file first (the fetch takes the lock itself, so one process per machine downloads)."""
        store = self._store
        assert store is not None
        with self._locking:
            with self._mutex:
                # pinned by
                # tests/test_cache_sessions.py::test_threads_racing_for_the_build_lock_take_it_once_without_waiting_on_their_own_process  # noqa: E501
                if store.locked or self._lock_fault is not None:
                    return  # another thread of this session got it (or failed) meanwhile
            cache = self._cache
            timeout = cache.lock_timeout
            if fetch and cache._remote.claim():
                assert cache.path is not None
                cache._remote.fetch(self._ledger, cache.path, cache.platform, {
                    "timeout": cache.remote_timeout, "lock_timeout": timeout, "trusted_keys": cache.trusted_keys,
                    "allow_unsigned": cache.allow_unsigned,
                    "file_mode": store.file_mode, "dir_mode": store.dir_mode,  # as the cache would have made the file
                })  # fmt: skip
            with ending() as end:
                store.take_lock(timeout)
            with self._mutex:
                if end.fault is not None:
                    self._lock_fault = end.fault
                    return
                store.hold_lock(timeout)
                self._refresh()

    def _reuse_heap(self, name: str, key: bytes, decided: Route) -> np.ndarray[Any, Any] | None:
        """Still failing since an earlier session: serve the heap copy already held, not a second one."""
        ledger = self._ledger
        held = ledger.held.get(name)
        if held is None or held.key != key or held.reason is None:
            return None
        assert decided.reason is not None
        ledger.report(decided.reason, decided.fault)
        ledger.reclassify(name, decided.reason, self._serial)
        return held.array

    def _store_pack(
        self, name: str, key: bytes, array: np.ndarray[Any, Any], owned: bool, facts: Facts
    ) -> np.ndarray[Any, Any]:
        store, ledger = self._store, self._ledger
        assert store is not None
        if self._state is SessionState.CLOSED:  # CLOSING still stores: its exit waits for this request, then commits
            raise SessionError("the session ended while this pack was being made")
        try:
            with ending(HeapReason.WRITE_FAILED, f"cannot store {name!r} in {store.path}") as end:
                view, origin = store.store(name, key, fmt.key_digest(name, key), array)
        finally:
            ledger.set(written=store.bytes_written)
        if end.fault is not None:
            # map_failed here means written (and committed at exit) but served from heap.
            return self._serve_heap(name, key, array, owned, route(facts._replace(store_fault=end.fault)))
        ledger.hold(name, Held(view, key, None, self._serial, origin), outcome="stored")
        return view

    def _packed(self, pack: PackFn) -> tuple[np.ndarray[Any, Any], bool]:
        """Call ``pack()``; return its array and whether the cache may keep it without a copy."""
        started = time.perf_counter()
        try:
            result = pack()
            # Exclusively ours when nothing else references it (this frame's name and getrefcount's
            # argument) and its memory is its own, or belongs to a chain of bases nothing else
            # references: a packer reusing a scratch buffer, or keeping one, gets a copy served.
            # pinned by tests/test_cache.py::test_heap_packs_stay_bit_identical_when_pack_reuses_its_buffer
            exclusive = type(result) is np.ndarray and sys.getrefcount(result) <= 2 and owns_memory(result)
            array, copied = validated(result)
            return array, exclusive or copied
        finally:
            elapsed = time.perf_counter() - started
            with self._mutex:
                self._ledger.add(pack_seconds=elapsed)

    def _serve_heap(
        self, name: str | None, key: bytes, array: np.ndarray[Any, Any], owned: bool, decided: Route
    ) -> np.ndarray[Any, Any]:
        """Serve ``array`` from heap (a copy unless the cache owns it), counted under ``decided.reason``."""
        ledger = self._ledger
        assert decided.reason is not None, "a heap route carries its reason"
        ledger.report(decided.reason, decided.fault)
        if not owned:
            try:
                array = array.copy()
            except MemoryError:  # no room for the copy: serve what pack() returned rather than fail the load
                if ledger.log_once("copy"):
                    logger.warning("packcache: no memory to copy a heap pack of %s; served as pack() returned it", name)
        view = read_only_view(array)
        ledger.hold(name, Held(view, key, decided.reason, self._serial))
        return view
