"""Weight caches, sessions and routing: every request ends in exactly one row.

A :class:`WeightCache` owns one cache file (or none: caching off). A
:meth:`WeightCache.session` is one model load; it holds the instance lock from
start to end, takes the cross-process build lock at its first miss, and
commits what it stored when it ends. :meth:`Session.get_or_pack` routes each
request to ``hit``, ``stored`` or ``heap`` (with a reason), following the
routing table in DESIGN.md. A cache problem is counted, logged once per reason
and answered with a heap pack; it never raises.

Statistics are published as an immutable :class:`~packcache.stats.CacheStats`
replaced by one reference assignment, so :meth:`WeightCache.stats` and
:func:`aggregate_stats` never wait on a session.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from . import format as fmt
from .errors import PackResultError, SessionError
from .stats import FAILURE_REASONS, CacheStats, HeapReason, derive_state, dominant_reason, sum_stats, zero_reasons
from .store import Fault, FileStore

__all__ = ["Session", "WeightCache", "aggregate_stats", "live_caches"]

logger = logging.getLogger("packcache")

PackFn = Callable[[], "np.ndarray[Any, Any]"]

#: Process-wide defaults, changed through :func:`packcache.set_option`.
DEFAULTS: dict[str, Any] = {"enabled": True, "lock_timeout": 30.0, "read_only": False, "verify": False}

_registry_lock = threading.Lock()
_live: tuple[weakref.ref[WeightCache], ...] = ()


def live_caches() -> list[WeightCache]:
    """Every WeightCache that is alive and not closed, without taking any cache's lock."""
    return [c for c in (ref() for ref in _live) if c is not None]


def aggregate_stats() -> CacheStats:
    """Statistics summed over every live :class:`WeightCache` in this process.

    Takes no per-instance lock: each cache's published snapshot is read as is.

    >>> aggregate_stats().heap_bytes >= 0
    True
    """
    return sum_stats(c.stats() for c in live_caches())


def _register(cache: WeightCache) -> None:
    global _live
    with _registry_lock:
        _live = (*tuple(r for r in _live if r() is not None), weakref.ref(cache))


def _unregister(cache: WeightCache) -> None:
    global _live
    with _registry_lock:
        _live = tuple(r for r in _live if r() is not None and r() is not cache)


@dataclass
class _Held:
    array: np.ndarray[Any, Any]
    digest: bytes
    nbytes: int
    reason: HeapReason | None  # None: mapped (hit or stored)
    session: int  # serial of the session that served it
    origin: tuple[int, int, int] | None = None  # mapped: (st_dev, st_ino, offset) of the bytes it views


def _check_timeout(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"lock_timeout must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


class WeightCache:
    """A cache of packed weights in one memory-mapped file.

    Args:
        path: the cache file, or ``None`` to turn caching off (every pack goes to
            heap with reason ``disabled``, and the state is ``off``).
        read_only: never write; missing entries go to heap with reason ``read_only``.
            The process-wide option ``packed_cache_read_only`` forces it on too.
        lock_timeout: seconds to wait for another process's build lock before
            packing to heap with reason ``locked``; ``None`` takes the process
            default (``packed_cache_lock_timeout``, 30 s unless changed).
        alignment: byte alignment of every pack in a new file (power of two, 64..1 MiB).
        platform: JSON-serialisable mapping identifying what makes packs valid on
            this machine (packer versions, framework version, CPU capability).
            A file made under another platform is rebuilt.
        enabled: ``False`` turns caching off; ``None`` takes ``packed_cache_enabled``.
        file_mode: permission bits of new cache files (default ``0o600``).
        dir_mode: permission bits of directories created for them (default ``0o700``).
        verify: check each hit's checksum before serving it (reads every page of
            the pack, so off by default); a pack that fails is packed and stored again.
            The process-wide option ``packed_cache_verify`` forces it on too.

    Raises:
        ValueError/TypeError: for invalid arguments (never for a problem with the file).

    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with WeightCache(os.path.join(d, "model.pcache")) as cache:
    ...     with cache.session() as s:
    ...         w = s.get_or_pack("layer0.weight", lambda: np.ones((2, 3), np.float32))
    ...     cache.stats().state, cache.stats().stored, w.flags.writeable
    ('stored', 1, False)
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        read_only: bool = False,
        lock_timeout: float | None = None,
        alignment: int = 64,
        platform: Mapping[str, Any] | None = None,
        enabled: bool | None = None,
        file_mode: int = 0o600,
        dir_mode: int = 0o700,
        verify: bool = False,
    ) -> None:
        if alignment < fmt.MIN_ALIGNMENT or alignment > fmt.MAX_ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two in [64, 1048576], got {alignment}")
        platform_bytes = fmt.canonical_key(platform)
        if len(platform_bytes) > fmt.PLATFORM_MAX:
            raise ValueError(f"platform fingerprint is {len(platform_bytes)} bytes of JSON, at most 1984 allowed")
        self.path: str | None = os.fspath(path) if path is not None else None
        self.alignment = alignment
        self.platform = platform_bytes
        self.lock_timeout = _check_timeout(DEFAULTS["lock_timeout"] if lock_timeout is None else lock_timeout)
        self.read_only = bool(read_only) or bool(DEFAULTS["read_only"])
        self.enabled = (DEFAULTS["enabled"] if enabled is None else bool(enabled)) and self.path is not None
        self.verify = bool(verify) or bool(DEFAULTS["verify"])
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._closed = False
        self._finalized = False
        self._store: FileStore | None = None
        if self.path is not None:
            self._store = FileStore(
                self.path, alignment=alignment, platform=platform_bytes, read_only=self.read_only,
                file_mode=file_mode, dir_mode=dir_mode,
            )  # fmt: skip
            weakref.finalize(self, self._store.close)
        # The ledger: written only under self._lock, read by nobody but _publish.
        self._held: dict[str, _Held] = {}
        self._session_serial = 0
        self._unnamed = 0
        self._mapped = 0
        self._heap = zero_reasons()
        self._totals = {"mapped": 0, "heap": 0, "written": 0, "hits": 0, "stored": 0, "heap_packs": 0}
        self._file_bytes = 0
        self._errno = 0
        self._error = ""
        self._error_time = 0.0
        self._pack_seconds = 0.0
        self._map_seconds = 0.0
        self._logged: set[str] = set()
        self._snapshot = CacheStats()
        self._publish()
        _register(self)

    # ------------------------------------------------------------------ public

    def session(self) -> Session:
        """Start a load: a context manager holding this cache's lock until it exits.

        Raises:
            SessionError: if this thread already has a session on this cache, or
                the cache is closed.
        """
        return Session(self)

    def stats(self) -> CacheStats:
        """The latest published snapshot; never waits, takes no lock.

        >>> WeightCache(None).stats().state
        'off'
        """
        return self._snapshot

    def get_option(self, key: str) -> Any:
        """Read an option key (see :mod:`packcache.options`) for this cache."""
        from .options import get_instance_option

        return get_instance_option(self, key)

    def set_option(self, key: str, value: Any) -> None:
        """Write a configuration key for this cache; takes effect at the next request."""
        from .options import set_instance_option

        set_instance_option(self, key, value)

    def finalize(self) -> None:
        """Stop inserting: later misses go to heap with reason ``finalized``. Hits still map."""
        self._finalized = True

    @property
    def finalized(self) -> bool:
        return self._finalized

    @property
    def closed(self) -> bool:
        return self._closed

    def release(self, what: str | np.ndarray[Any, Any]) -> bool:
        """Stop holding a pack (by name, or the array that was handed out).

        The array stays valid for whoever still references it; it just stops
        counting. Returns whether something was released. Waits for a session
        running in another thread.
        """
        with self._locked("release()"):
            for name, held in self._held.items():
                if (isinstance(what, str) and name == what) or held.array is what:
                    self._drop(name)
                    self._publish()
                    return True
            return False

    def close(self) -> None:
        """Release every pack, close the file and the lock; idempotent.

        Arrays already handed out stay valid: each keeps its mapping alive.
        """
        if self._closed:
            return
        with self._locked("close()"):
            for name in list(self._held):
                self._drop(name)
            if self._store is not None:
                self._store.close()
            self._closed = True
            _unregister(self)
            self._publish()

    def __enter__(self) -> WeightCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._snapshot
        return f"WeightCache({self.path!r}, state={s.state!r}, mapped={s.mapped_bytes}, heap={s.heap_bytes})"

    # ------------------------------------------------------------------ internals

    def _locked(self, what: str) -> _Acquired:
        if self._owner == threading.get_ident():
            raise SessionError(f"{what} called inside this thread's own session on {self.path!r}")
        return _Acquired(self._lock)

    def _drop(self, name: str) -> None:
        held = self._held.pop(name)
        if held.reason is None:
            self._mapped -= held.nbytes
        else:
            self._heap[held.reason.value] -= held.nbytes

    def _hold(
        self,
        name: str | None,
        array: np.ndarray[Any, Any],
        digest: bytes,
        reason: HeapReason | None,
        origin: tuple[int, int, int] | None = None,
    ) -> None:
        if name is None:
            self._unnamed += 1
            name = f"\0unnamed-{self._unnamed}"  # NUL cannot start a real name's key
        elif name in self._held:
            self._drop(name)  # same name, new key: the old pack is superseded
        nbytes = int(array.nbytes)
        self._held[name] = _Held(array, digest, nbytes, reason, self._session_serial, origin)
        if reason is None:
            self._mapped += nbytes
            self._totals["mapped"] += nbytes
        else:
            self._heap[reason.value] += nbytes
            self._totals["heap"] += nbytes
            self._totals["heap_packs"] += 1

    def _record_failure(self, fault: Fault) -> None:
        self._errno = fault.errno
        self._error = fault.message
        self._error_time = time.time()
        self._log(fault.reason, fault.message, fault.errno)

    def _log(self, reason: HeapReason, message: str, err: int = 0) -> None:
        if reason.value in self._logged:
            return
        self._logged.add(reason.value)
        if reason in FAILURE_REASONS:
            name = errno_mod.errorcode.get(err, "no errno") if err else "no errno"
            logger.error("packcache: %s [%s]: %s; packs go to heap", reason.value, name, message)
        elif reason is HeapReason.FINALIZED:
            logger.info("packcache: cache %s is finalized; new packs go to heap", self.path)
        else:
            logger.debug("packcache: %s: packs go to heap (%s)", reason.value, message)

    def _publish(self) -> None:
        by_reason = dict(self._heap)
        state = derive_state(
            enabled=self.enabled, mapped_bytes=self._mapped, heap_bytes_by_reason=by_reason,
            written_bytes=self._totals["written"],
        )  # fmt: skip
        # One reference assignment: readers see the old or the new snapshot, never a mix.
        self._snapshot = CacheStats.fast(
            state=state.value,
            errno=self._errno,
            error=self._error,
            error_time=self._error_time,
            mapped_bytes=self._mapped,
            heap_bytes=sum(by_reason.values()),
            heap_bytes_by_reason=by_reason,
            heap_reason=dominant_reason(by_reason),
            mapped_bytes_total=self._totals["mapped"],
            heap_bytes_total=self._totals["heap"],
            written_bytes=self._totals["written"],
            file_bytes=self._file_bytes,
            hits=self._totals["hits"],
            stored=self._totals["stored"],
            heap_packs=self._totals["heap_packs"],
            pack_seconds=self._pack_seconds,
            map_seconds=self._map_seconds,
            path=self.path or "",
        )


class _Acquired:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _validated(result: object) -> np.ndarray[Any, Any]:
    if not isinstance(result, np.ndarray):
        raise PackResultError(f"pack() must return a numpy.ndarray, got {type(result).__name__}")
    dtype = result.dtype
    if dtype.str[1:] not in fmt.DTYPE_CODES or dtype.str[0] == ">":
        raise PackResultError(
            f"pack() returned dtype {dtype}; cacheable dtypes are little-endian {', '.join(fmt.DTYPE_CODES)}"
        )
    if len(result.shape) > fmt.MAX_NDIM:
        raise PackResultError(f"pack() returned {result.ndim} dimensions, at most {fmt.MAX_NDIM} are supported")
    # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    return result if result.flags.c_contiguous else result.copy(order="C")


def _read_only_view(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A view whose buffer is read-only, so ``flags.writeable = True`` cannot undo it."""
    if array.size == 0:
        empty = np.empty(array.shape, dtype=array.dtype)
        empty.flags.writeable = False
        return empty
    frozen = array.reshape(-1).view(np.uint8).data.toreadonly()
    return np.frombuffer(frozen, dtype=array.dtype).reshape(array.shape)


class Session:
    """One model load on a :class:`WeightCache`; use it as a context manager.

    While active it holds the cache's instance lock (other threads' sessions
    wait), and from its first miss the cross-process build lock. On exit it
    commits what it stored and releases both.
    """

    def __init__(self, cache: WeightCache) -> None:
        self._cache = cache
        self._active = False
        self._lock_fault: Fault | None = None

    @property
    def cache(self) -> WeightCache:
        """The :class:`WeightCache` this session loads from."""
        return self._cache

    def __enter__(self) -> Session:
        cache = self._cache
        if cache._owner == threading.get_ident():
            raise SessionError(f"a session on {cache.path!r} is already active in this thread")
        cache._lock.acquire()
        if cache._closed:
            cache._lock.release()
            raise SessionError(f"the cache {cache.path!r} is closed")
        cache._owner = threading.get_ident()
        cache._session_serial += 1
        self._active = True
        self._refresh()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        cache = self._cache
        store = cache._store
        try:
            if store is not None and store.pending:
                try:
                    store.commit()
                    cache._file_bytes = store.file_size
                except Fault as fault:
                    cache._record_failure(fault)
                except Exception as exc:  # a cache problem must never fail a model load
                    logger.debug("packcache: unexpected error committing %s", cache.path, exc_info=True)
                    store.abort()
                    cache._record_failure(Fault(HeapReason.WRITE_FAILED, 0, f"cannot commit {cache.path}: {exc!r}"))
                cache._totals["written"] = store.bytes_written
            if store is not None:
                store.release_lock()
        finally:
            self._active = False
            cache._owner = None
            cache._publish()
            cache._lock.release()

    def _refresh(self) -> None:
        cache, store = self._cache, self._cache._store
        if store is None or not cache.enabled:
            return
        started = time.perf_counter()
        try:
            store.refresh()
        except Exception as exc:  # a cache problem must never fail a model load
            logger.debug("packcache: unexpected error opening %s", cache.path, exc_info=True)
            store.problem = Fault(
                HeapReason.OPEN_FAILED, getattr(exc, "errno", 0) or 0, f"cannot open {cache.path}: {exc!r}"
            )
        cache._map_seconds += time.perf_counter() - started
        cache._file_bytes = store.file_size
        if store.rebuild_reason and store.fd is not None and "rebuild" not in cache._logged:
            cache._logged.add("rebuild")
            logger.warning(
                "packcache: cache file %s will be rebuilt as a new file: %s", cache.path, store.rebuild_reason
            )
        if store.problem is not None and store.problem.reason is not HeapReason.MAP_FAILED:
            cache._record_failure(store.problem)
        cache._publish()

    def get_or_pack(self, name: str | None, pack: PackFn, key: Mapping[str, Any] | None = None) -> np.ndarray[Any, Any]:
        """Return the packed array for ``name``: mapped from the file, or packed now.

        Args:
            name: a stable name for the pack (e.g. ``"layers.0.attn.wq"``), or
                ``None`` when there is none (the pack then goes to heap, ``unnamed``).
            pack: zero-argument callable returning a numpy array. Not called on a hit.
            key: JSON-serialisable mapping of everything else that identifies the
                pack (packer id/version/params, source shape/dtype/identity). A
                stored entry with another key is stale and is replaced.

        Returns:
            A read-only array with the dtype, shape and bytes ``pack()`` returns.

        Raises:
            PackResultError: ``pack()`` returned something that is not a cacheable array.
            TypeError/ValueError: invalid ``name`` or ``key``.
            Whatever ``pack()`` raises. Cache problems are never raised.
        """
        if not self._active:
            raise SessionError("get_or_pack() called outside an active session (use 'with cache.session() as s')")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        if name is not None and len(name.encode("utf-8")) > fmt.MAX_NAME_BYTES:
            raise ValueError(f"name is longer than {fmt.MAX_NAME_BYTES} UTF-8 bytes: {name[:40]!r}...")
        key_bytes = fmt.canonical_key(key)
        if len(key_bytes) > fmt.MAX_KEY_BYTES:
            raise ValueError(f"key is {len(key_bytes)} bytes of JSON, at most {fmt.MAX_KEY_BYTES} allowed")
        cache = self._cache
        try:
            return self._route(name, pack, key_bytes)
        finally:
            cache._publish()

    def _route(self, name: str | None, pack: PackFn, key: bytes) -> np.ndarray[Any, Any]:
        cache, store = self._cache, self._cache._store
        digest = fmt.key_digest(name, key) if name is not None else b""
        held = cache._held.get(name) if name is not None else None
        if held is not None and held.digest == digest and not self._retry(held) and self._still_backed(name, held):
            return held.array  # the same pack again: served and counted once
        if not cache.enabled or store is None:
            return self._heap(name, digest, pack, HeapReason.DISABLED, None)
        if name is None:
            return self._heap(None, digest, pack, HeapReason.UNNAMED, None)
        if store.problem is not None and store.problem.reason is not HeapReason.MAP_FAILED:
            return self._heap(name, digest, pack, store.problem.reason, store.problem)
        entry = self._lookup(name, digest)
        if entry is None:
            if cache._finalized:
                return self._heap(name, digest, pack, HeapReason.FINALIZED, None)
            if cache.read_only or store.read_only_fault is not None:
                fault = store.read_only_fault or Fault(HeapReason.READ_ONLY, 0, f"cache {cache.path} is read-only")
                return self._heap(name, digest, pack, HeapReason.READ_ONLY, fault)
            if self._lock_fault is not None:
                return self._heap(name, digest, pack, self._lock_fault.reason, self._lock_fault)
            if not store.locked:
                try:
                    store.acquire_lock(cache.lock_timeout)
                except Fault as fault:
                    self._lock_fault = fault
                    return self._heap(name, digest, pack, fault.reason, fault)
                self._refresh()  # another process may have committed while we waited
                if store.problem is not None and store.problem.reason is not HeapReason.MAP_FAILED:
                    return self._heap(name, digest, pack, store.problem.reason, store.problem)
                entry = self._lookup(name, digest)
        if entry is not None:
            started = time.perf_counter()
            try:
                array = store.view(entry)
            except Fault as fault:
                return self._heap(name, digest, pack, HeapReason.MAP_FAILED, fault)
            finally:
                cache._map_seconds += time.perf_counter() - started
            cache._hold(name, array, digest, None, store.origin_of(entry))
            cache._totals["hits"] += 1
            return array
        result = self._pack(pack)
        try:
            array = store.store(name, key, digest, result)
        except Fault as fault:
            # map_failed here means written (and committed at exit) but served from heap.
            return self._serve_heap(name, digest, result, fault.reason, fault)
        except Exception as exc:  # a cache problem must never fail a model load
            logger.debug("packcache: unexpected error storing %r in %s", name, cache.path, exc_info=True)
            failure = Fault(HeapReason.WRITE_FAILED, 0, f"cannot store {name!r} in {cache.path}: {exc!r}")
            return self._serve_heap(name, digest, result, failure.reason, failure)
        finally:
            cache._totals["written"] = store.bytes_written
        cache._hold(name, array, digest, None, store.origin_of(store.lookup(name, digest)))
        cache._totals["stored"] += 1
        return array

    def _lookup(self, name: str, digest: bytes) -> fmt.Entry | None:
        cache, store = self._cache, self._cache._store
        assert store is not None
        entry = store.lookup(name, digest)
        if entry is not None and cache.verify:
            started = time.perf_counter()
            ok = store.checksum_ok(entry)
            cache._map_seconds += time.perf_counter() - started
            if not ok:
                logger.error(
                    "packcache: entry %r of %s at offset %d failed its checksum; packing it again",
                    name, cache.path, entry.offset,
                )  # fmt: skip
                return None
        return entry

    def _still_backed(self, name: str | None, held: _Held) -> bool:
        """A held mapped pack is served again only while the file still holds its bytes.

        Another process may have truncated, replaced or corrupted the file since
        (the session's refresh saw it): serving the old view again could be
        SIGBUS on touch, so the request is routed afresh instead.
        """
        store = self._cache._store
        if held.origin is None or store is None or name is None:
            return True
        entry = store.lookup(name, held.digest)
        return entry is not None and store.origin_of(entry) == held.origin

    def _retry(self, held: _Held) -> bool:
        """A pack sent to heap by a failure in an earlier session is routed again: the
        failure may be gone (lock released, space freed), and the cache should heal."""
        return held.reason in FAILURE_REASONS and held.session != self._cache._session_serial

    def _pack(self, pack: PackFn) -> np.ndarray[Any, Any]:
        started = time.perf_counter()
        try:
            return _validated(pack())
        finally:
            self._cache._pack_seconds += time.perf_counter() - started

    def _heap(
        self, name: str | None, digest: bytes, pack: PackFn, reason: HeapReason, fault: Fault | None
    ) -> np.ndarray[Any, Any]:
        held = self._cache._held.get(name) if name is not None else None
        if held is not None and held.digest == digest and held.reason is not None:
            # Still failing since an earlier session: serve the heap copy already held, not a second one.
            self._cache._drop(name)  # type: ignore[arg-type]
            return self._serve_heap(name, digest, held.array, reason, fault, frozen=True)
        return self._serve_heap(name, digest, self._pack(pack), reason, fault)

    def _serve_heap(
        self,
        name: str | None,
        digest: bytes,
        array: np.ndarray[Any, Any],
        reason: HeapReason,
        fault: Fault | None,
        *,
        frozen: bool = False,
    ) -> np.ndarray[Any, Any]:
        cache = self._cache
        if fault is not None:
            cache._record_failure(fault)
        else:
            cache._log(reason, f"cache {cache.path}")
        view = array if frozen else _read_only_view(array)
        cache._hold(name, view, digest, reason)
        return view
