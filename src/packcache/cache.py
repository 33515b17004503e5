"""Weight caches, sessions and routing: every request ends in exactly one row.

A :class:`WeightCache` owns one cache file (or none: caching off). A
:meth:`WeightCache.session` is one model load; it holds the instance lock from
start to end, takes the cross-process build lock at its first miss, and
commits what it stored when it ends. :meth:`Session.get_or_pack` routes each
request to ``hit``, ``stored`` or ``heap`` (with a reason), following the
routing table in docs/ROUTING.md. A cache problem is counted, logged once per
reason and answered with a heap pack; it never raises.

Threads may share one session (a thread pool packing the layers of a cold
build): ``pack()`` callables run concurrently, while routing, appends and the
bookkeeping are serialised by the session's mutex, and two threads asking for
one name make one pack.

Statistics are read without any lock: the bookkeeping (:class:`~packcache._ledger.Ledger`)
is changed under the session's mutex and read through a sequence counter, so
:meth:`WeightCache.stats` and :func:`aggregate_stats` never wait on a session
and never see a half-made change.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

import numpy as np

from . import _defaults, _registry
from . import format as fmt
from ._faults import Fault
from ._ledger import Held, Ledger
from ._registry import DEFAULTS, aggregate_stats, register, unregister
from ._store import FileStore
from ._storeurl import StoreURL, parse_store_url, redact_text
from .errors import PackResultError, RemoteError, SessionError
from .options import get_instance_option, set_instance_option
from .stats import FAILURE_REASONS, REMOTE_REASONS, CacheStats, HeapReason

__all__ = ["PackKey", "Request", "Session", "SessionState", "WeightCache", "aggregate_stats", "live_caches"]

logger = logging.getLogger("packcache")

PackFn = Callable[[], "np.ndarray[Any, Any]"]


class _Route:
    """A request that goes to heap, and why."""

    __slots__ = ("fault", "reason")

    def __init__(self, reason: HeapReason, fault: Fault | None) -> None:
        self.reason = reason
        self.fault = fault


class PackKey:
    """A pack key encoded once: its canonical JSON (docs/FORMAT.md), to pass to
    :meth:`Session.get_or_pack` and :meth:`Session.get_many` any number of times.

    A mapping given as ``key`` is encoded on every request (about a microsecond); a loader
    that asks for many packs under one key, or asks again, encodes it once here.

    Raises:
        TypeError: the mapping is not JSON-serialisable. ValueError: it encodes to more than
        :data:`packcache.format.MAX_KEY_BYTES` bytes.

    >>> PackKey({"packer": "int8", "version": 1}).canonical
    b'{"packer":"int8","version":1}'
    >>> PackKey({"b": 1, "a": 2}) == PackKey({"a": 2, "b": 1})
    True
    """

    __slots__ = ("canonical",)

    def __init__(self, key: Mapping[str, Any] | None = None) -> None:
        self.canonical: bytes = _encoded(key)

    @classmethod
    def from_canonical(cls, canonical: bytes) -> PackKey:
        """A key from bytes its caller made canonical JSON itself (an adapter that assembles keys from
        pieces encoded once); nothing is checked but the type and the size cap, so the bytes must be
        exactly what :func:`packcache.format.canonical_key` gives for the mapping they stand for."""
        if type(canonical) is not bytes:
            raise TypeError(f"canonical key must be bytes, got {type(canonical).__name__}")
        if len(canonical) > fmt.MAX_KEY_BYTES:
            raise ValueError(f"key is {len(canonical)} bytes of JSON, at most {fmt.MAX_KEY_BYTES} allowed")
        made = cls.__new__(cls)
        made.canonical = canonical
        return made

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackKey) and other.canonical == self.canonical

    def __hash__(self) -> int:
        return hash(self.canonical)

    def __repr__(self) -> str:
        text = self.canonical.decode("ascii")
        return f"PackKey({text if len(text) <= 80 else text[:77] + '...'})"


def _encoded(key: Mapping[str, Any] | PackKey | None) -> bytes:
    """The canonical key bytes of a request's ``key``.

    Raises:
        TypeError, ValueError: as :class:`PackKey`.
    """
    if type(key) is PackKey:
        return key.canonical
    canonical = fmt.canonical_key(key)  # type: ignore[arg-type]  # a Mapping or None here
    if len(canonical) > fmt.MAX_KEY_BYTES:
        raise ValueError(f"key is {len(canonical)} bytes of JSON, at most {fmt.MAX_KEY_BYTES} allowed")
    return canonical


_SHORT_NAME = fmt.MAX_NAME_BYTES // 4  # characters: a str this long or shorter fits the cap, whatever it holds


def _request_key(name: object, key: Mapping[str, Any] | PackKey | None) -> bytes:
    """Check a request's name and return its canonical key bytes (what :meth:`Session.get_or_pack` and
    :meth:`Session.get_many` check of every request, before anything is served).

    Raises:
        TypeError: ``name`` is not a non-empty str or None; ``key`` as :class:`PackKey`.
        ValueError: ``name`` longer than the cap in UTF-8; ``key`` as :class:`PackKey`.
    """
    if name is not None and (type(name) is not str or not 0 < len(name) <= _SHORT_NAME):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        if len(name.encode("utf-8")) > fmt.MAX_NAME_BYTES:
            raise ValueError(f"name is longer than {fmt.MAX_NAME_BYTES} UTF-8 bytes: {name[:40]!r}...")
    canonical = key.canonical if type(key) is PackKey else _encoded(key)
    if name is not None and name.startswith("packcache.") and fmt.embedded_kind(name):
        # pinned by tests/test_bundle.py::test_a_session_refuses_an_embedded_entry_readers_would_reject
        problem = fmt.embedded_problem(fmt.Entry(name, canonical, b"", "u1", (0,), 0, 0, 0))
        if problem:
            raise ValueError(problem)
    return canonical


#: One request of :meth:`Session.get_many`: ``(name, pack, key)`` as :meth:`Session.get_or_pack` takes them.
Request = tuple["str | None", PackFn, "Mapping[str, Any] | PackKey | None"]


_NEEDS_LOCK = object()  # a miss that can be stored once the build lock is held


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


def live_caches() -> list[WeightCache]:
    """Every :class:`WeightCache` of this process that is alive and not closed; takes no cache's lock."""
    return [cache for cache in _registry.live_caches() if isinstance(cache, WeightCache)]  # only caches register


class _Seat:
    """Who uses a cache now: the one active session, its thread, and whether the cache is closed.

    A cache and its sessions share this object and nothing else of each other's state (besides
    the ledger and the file store). Every change of owner happens inside ``with seat.lock``, a
    plain lock held only for the change, never across a session: an interrupt (Ctrl-C) can never
    leave the cache owned by a session that is gone.
    """

    __slots__ = ("closed", "lock", "owner", "serial", "session")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # entered with ``with``: a C-level enter leaves no gap for an interrupt
        self.session: Session | None = None
        self.owner: int | None = None  # the thread that entered ``session``
        self.closed = False
        self.serial = 0  # sessions started so far: each held pack records the one that served it


def _check_remote(remote: object) -> StoreURL | None:
    """``remote=`` parsed (:func:`packcache._storeurl.parse_store_url`), or ``None``.

    Raises:
        ValueError: it is no store URL (the message shows it redacted).
    """
    if remote is None or isinstance(remote, StoreURL):
        return remote
    value = os.fspath(remote) if isinstance(remote, (str, os.PathLike)) else remote
    if not isinstance(value, str) or not value:
        raise ValueError(f"remote must be a store URL or directory, got {type(remote).__name__}")
    try:
        return parse_store_url(value)
    except ValueError as exc:
        raise ValueError(f"remote must be a store URL or directory: {exc}") from None


def _scrub(cache: WeightCache, text: str) -> str:
    """``text`` with no secret of the cache's store URL in it (what the statistics and logs show)."""
    return cache._remote_url.scrub(text) if cache._remote_url is not None else redact_text(text)


def _check_timeout(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"lock_timeout must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _check_mode(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o7777:
        raise ValueError(f"{what} must be permission bits (an int in [0, 0o7777]), got {value!r}")
    # pinned by tests/test_cache.py::test_a_file_mode_the_trust_check_would_refuse_is_refused_at_construction,
    # ::test_a_dir_mode_other_users_may_write_is_refused
    if value & 0o022:
        # The trust check refuses group/world-writable files and unsafe directories:
        # a mode that makes the cache refuse its own file on the next launch is a mistake.
        raise ValueError(
            f"{what} {value:04o} lets other users write; packcache refuses such files as untrusted "
            f"(use e.g. {value & ~0o022:04o})"
        )
    return value


class WeightCache:
    """A cache of packed weights in one memory-mapped file.

    Args:
        path: the cache file, or ``None`` to turn caching off (every pack goes to
            heap with reason ``disabled``, and the state is ``off``).
        read_only: never write; missing entries go to heap with reason ``read_only``.
            ``None`` takes the process default (``packed_cache_read_only``, off unless changed).
        lock_timeout: seconds to wait for another process's build lock before
            packing to heap with reason ``locked``; ``None`` takes the process
            default (``packed_cache_lock_timeout``, 30 s unless changed).
        alignment: byte alignment of every pack in a new file (power of two, 64..1 MiB; default 64).
        platform: JSON-serialisable mapping identifying what makes packs valid on
            this machine (packer versions, framework version, CPU capability).
            A file made under another platform is rebuilt.
        enabled: ``False`` turns caching off; ``None`` takes the process default
            (``packed_cache_enabled``, on unless changed).
        file_mode: permission bits of new cache files (default ``0o600``); never group/world-writable.
        dir_mode: permission bits of directories created for them (default ``0o700``); same rule.
        verify: check each hit's checksum before serving it (reads every page of
            the pack, so off by default); a pack that fails is packed and stored again.
            ``None`` takes the process default (``packed_cache_verify``, off unless changed).
        remote: a store URL (``s3://bucket/prefix``, ``gs://...``, ``file:///dir`` or a plain
            directory; docs/FLEET.md). At a session's first miss, before packing, the cache fetches
            the file published there for its model (the file's name without ``.pcache``) and this
            platform, checked, into ``path``. A clean local hit never asks the store; a store
            problem is a counted remote miss (``CacheStats.remote_misses_by_reason``), never an
            error: the load packs locally.
        remote_timeout: seconds for everything one fetch asks the store (manifest, header, blob).
        trusted_keys: ed25519 public keys (SubjectPublicKeyInfo PEM: ``bytes`` of the PEM, or the
            path of a ``.pub.pem`` file); one of them must have signed the manifest.
        allow_unsigned: accept manifests nobody signed (a private store you trust as it is).

    Raises:
        ValueError/TypeError: for invalid arguments (an empty path, a writable mode, ...),
            never for a problem with the file.

    The four cache options (``read_only``, ``lock_timeout``, ``enabled``, ``verify``) follow one rule:
    ``None`` takes the process default (:func:`packcache.set_option`) as the cache is made, and an
    explicit value always wins over it. (``read_only=False`` and ``verify=False`` were once OR-ed with
    the process default, so ``WeightCache(path, verify=False)`` after ``set_option("packed_cache_verify",
    True)`` verified; it no longer does.) The defaults themselves are written once, in
    :mod:`packcache._defaults`.

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
        read_only: bool | None = None,
        lock_timeout: float | None = None,
        alignment: int = _defaults.ALIGNMENT,
        platform: Mapping[str, Any] | None = None,
        enabled: bool | None = None,
        file_mode: int = _defaults.FILE_MODE,
        dir_mode: int = _defaults.DIR_MODE,
        verify: bool | None = None,
        remote: str | os.PathLike[str] | StoreURL | None = None,
        remote_timeout: float = _defaults.REMOTE_TIMEOUT,
        trusted_keys: Sequence[bytes | str | os.PathLike[str]] = (),
        allow_unsigned: bool = False,
    ) -> None:
        platform_bytes = fmt.canonical_key(platform)
        fmt.check_new_file(alignment, platform_bytes)
        self.path: str | None = os.fspath(path) if path is not None else None
        # pinned by tests/test_cache.py::test_an_empty_or_nul_path_is_refused
        if self.path is not None and (not isinstance(self.path, str) or not self.path or "\0" in self.path):
            raise ValueError(f"path must be a non-empty file path (or None for caching off), got {path!r}")
        _check_mode(file_mode, "file_mode")
        _check_mode(dir_mode, "dir_mode")
        self.alignment = alignment
        self.platform = platform_bytes
        # None: the process default, read now (packcache._registry.DEFAULTS); an explicit value wins.
        self.lock_timeout = _check_timeout(DEFAULTS["lock_timeout"] if lock_timeout is None else lock_timeout)
        self.enabled = bool(DEFAULTS["enabled"] if enabled is None else enabled) and self.path is not None
        self.verify = bool(DEFAULTS["verify"] if verify is None else verify)
        # Parsed once: a bad URL fails here, and only the fetch sees its secrets; ``remote`` is what
        # every message shows.
        # pinned by tests/test_fleet_redaction.py::test_no_library_output_shows_a_store_secret
        self._remote_url = _check_remote(remote)
        self.remote = self._remote_url.display if self._remote_url is not None else None
        if (
            isinstance(remote_timeout, bool)
            or not isinstance(remote_timeout, (int, float))
            or not (math.isfinite(remote_timeout) and remote_timeout > 0)
        ):
            raise ValueError(f"remote_timeout must be a finite number of seconds > 0, got {remote_timeout!r}")
        self.remote_timeout = float(remote_timeout)
        if isinstance(trusted_keys, (str, bytes, os.PathLike)):
            raise TypeError("trusted_keys is a list of keys (PEM bytes or paths), not one key")
        self.trusted_keys: tuple[bytes | str, ...] = tuple(
            k if isinstance(k, bytes) else os.fspath(k) for k in trusted_keys
        )  # fmt: skip
        self.allow_unsigned = bool(allow_unsigned)
        self._remote_tried = False
        self._seat = _Seat()
        self._finalized = False
        self._store: FileStore | None = None
        self._read_only = bool(DEFAULTS["read_only"] if read_only is None else read_only)
        if self.path is not None:
            self._store = FileStore(
                self.path, alignment=alignment, platform=platform_bytes, read_only=self._read_only,
                file_mode=file_mode, dir_mode=dir_mode,
            )  # fmt: skip
            weakref.finalize(self, self._store.close)
        self._ledger = Ledger(self.path)
        register(self)

    # ------------------------------------------------------------------ public

    @property
    def read_only(self) -> bool:
        """Never write (``packed_cache_read_only``). Setting it takes effect at the next session."""
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        self._read_only = bool(value)
        if self._store is not None:
            self._store.read_only = self._read_only

    def session(self) -> Session:
        """Start a load: a context manager holding this cache's lock until it exits.

        Raises:
            SessionError: (on entry) if this thread already has a session on this cache,
                or the cache is closed.
        """
        return Session(self)

    def stats(self) -> CacheStats:
        """A consistent snapshot of this cache's figures; never waits, takes no lock.

        >>> WeightCache(None).stats().state
        'off'
        """
        return self._ledger.snapshot(self.enabled, self.path or "")

    def get_option(self, key: str) -> Any:
        """Read an option key (see :mod:`packcache.options`) for this cache."""
        return get_instance_option(self, key)

    def set_option(self, key: str, value: Any) -> None:
        """Write a configuration key for this cache; takes effect at the next request."""
        set_instance_option(self, key, value)

    def finalize(self) -> None:
        """Stop inserting: later misses go to heap with reason ``finalized``. Hits still map."""
        self._finalized = True

    @property
    def finalized(self) -> bool:
        return self._finalized

    @property
    def closed(self) -> bool:
        return self._seat.closed

    def release(self, what: str | np.ndarray[Any, Any]) -> bool:
        """Stop holding a pack (by name, or the array that was handed out).

        The array stays valid for whoever still references it; it just stops
        counting. Returns whether something was released. Waits for a session
        running in another thread.
        """
        with self._exclusive("release()"):
            ledger = self._ledger
            if isinstance(what, str):
                if what in ledger.held:
                    ledger.drop(what)
                    return True
                return False
            for name, held in ledger.held.items():
                if held.array is what:
                    ledger.drop(name)
                    return True
            for serial, held in ledger.unnamed.items():
                if held.array is what:
                    ledger.drop(None, serial)
                    return True
            return False

    def close(self) -> None:
        """Release every pack, close the file and the lock; idempotent.

        Arrays already handed out stay valid: each keeps its mapping alive.
        """
        if self._seat.closed:
            return
        with self._exclusive("close()"):
            self._ledger.drop_all()
            if self._store is not None:
                self._store.close()
            self._seat.closed = True
            unregister(self)

    def __enter__(self) -> WeightCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return f"WeightCache({self.path!r}, state={s.state!r}, mapped={s.mapped_bytes}, heap={s.heap_bytes})"

    def __reduce_ex__(self, protocol: object) -> Any:
        # pickle.dumps, copy.deepcopy and torch.save of an object holding a cache (model.packcache) reach here.
        raise TypeError(
            f"a WeightCache ({self.path!r}) cannot be pickled or copied: it holds an open file, its locks and live "
            "mappings. Save what it serves instead: the model's state_dict() or save_pretrained() (docs/HF.md, "
            "'Saving a packed model'); open the cache again by its path in the other process"
        )

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Run the body with no session active on this cache (waiting for one in another thread)."""
        seat = self._seat
        while True:
            with seat.lock:
                current = seat.session
                if current is None:
                    yield
                    return
                abandoned = current._abandoned()
                if not abandoned and seat.owner == threading.get_ident():
                    raise SessionError(f"{what} called inside this thread's own session on {self.path!r}")
            if abandoned:
                current._end()
            else:
                time.sleep(0.002)  # polled, not a condition: an interrupt cannot leave a lock half-taken


def _validated(result: object) -> tuple[np.ndarray[Any, Any], bool]:
    """What ``pack()`` returned, as a plain C-contiguous array; and whether it is a new copy."""
    if not isinstance(result, np.ndarray):
        raise PackResultError(f"pack() must return a numpy.ndarray, got {type(result).__name__}")
    masked = sys.modules.get("numpy.ma")  # imported if a MaskedArray exists; never import it here (EMFILE)
    # pinned by tests/test_cache.py::test_a_masked_array_is_a_pack_result_error_not_a_write_failure
    if masked is not None and isinstance(result, masked.MaskedArray):
        raise PackResultError(
            "pack() returned a numpy.ma.MaskedArray: its mask cannot be cached; return .filled(...) or .data"
        )
    array = result if type(result) is np.ndarray else result.view(np.ndarray)  # np.memmap, np.matrix: the bytes
    dtype = array.dtype
    if dtype.str[1:] not in fmt.DTYPE_CODES or dtype.str[0] == ">":
        raise PackResultError(
            f"pack() returned dtype {dtype}; cacheable dtypes are little-endian {', '.join(fmt.DTYPE_CODES)}"
        )
    if len(array.shape) > fmt.MAX_NDIM:
        raise PackResultError(f"pack() returned {array.ndim} dimensions, at most {fmt.MAX_NDIM} are supported")
    if not fmt.shape_fits(array.shape, array.dtype.itemsize):
        raise PackResultError(f"pack() returned shape {array.shape}, whose size does not fit 2**63-1 bytes")
    if array.flags.c_contiguous:
        return array, False
    return array.copy(order="C"), True  # not np.ascontiguousarray: it turns a 0-d array into a 1-d one


def _check_embedded_pack(name: str, key: bytes, array: np.ndarray[Any, Any]) -> None:
    """An embedded entry's pack (docs/FORMAT.md R47-R50) before it is stored: ``u1`` bytes within the cap, the
    sha256 its key names. A file readers would reject is never written (W6).

    Raises:
        PackResultError: it is not.
    """
    if not fmt.embedded_kind(name):
        return
    entry = fmt.Entry(name, key, b"", array.dtype.str[1:], array.shape, 0, array.nbytes, 0)
    problem = fmt.embedded_problem(entry)
    if problem is None and fmt.embedded_key(fmt.embedded_kind(name) or "file", array.data) != key:
        problem = f"embedded entry {name!r}: pack() returned bytes other than the sha256 its key names (R50)"
    if problem:
        raise PackResultError(problem)


def _owns_memory(array: np.ndarray[Any, Any]) -> bool:
    """Whether ``array``'s memory can be reached only through it: it owns it, or each base up to
    the owner is a plain ndarray referenced by nothing but the view above it."""
    while not array.flags.owndata:
        if type(array.base) is not np.ndarray or sys.getrefcount(array.base) > 2:
            return False  # a foreign buffer, or a base someone else still holds
        array = array.base
    return True


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
    waits for requests still running in other threads, commits what it stored
    and releases both locks.

    Threads may share a session: their ``pack()`` calls run concurrently; routing,
    appends and bookkeeping are serialised; two threads asking for one name make
    one pack (the second waits for the first and is served the same array).

    Its life is one :class:`SessionState` (``state``), never a set of flags.
    """

    def __init__(self, cache: WeightCache) -> None:
        self._cache = cache
        # What a session shares with its cache, and all it touches of it besides public attributes.
        self._seat, self._ledger, self._store = cache._seat, cache._ledger, cache._store
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
    def cache(self) -> WeightCache:
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
        seat = self._seat
        me = threading.get_ident()
        while True:
            with seat.lock:
                if self._state is not SessionState.UNOPENED:
                    was = self._state.value
                    raise SessionError(f"a session is entered once (this one is {was}); start another: cache.session()")
                current = seat.session
                if current is None:
                    if seat.closed:
                        raise SessionError(f"the cache {self._cache.path!r} is closed")
                    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("contextlib"):
                        frame = frame.f_back  # entered through an ExitStack: the user's frame is further out
                    self._thread, self._frame = me, frame
                    seat.session, seat.owner = self, me
                    seat.serial += 1
                    self._serial = seat.serial
                    self._state = SessionState.ACTIVE
                    self._ledger.set(commit_fault=None)  # a new load: its own packs will say what is durable
                    self._refresh()
                    return
                abandoned = current._abandoned()
                if not abandoned and seat.owner == me:
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
                self._commit(store)
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
        seat, store = self._seat, self._store
        self._state = SessionState.CLOSED
        with seat.lock:
            if seat.session is not self:
                return
            try:
                if store is not None:
                    if store.pending:  # interrupted before its commit: what it stored is not durable
                        names = store.pending_names
                        store.abort()
                        ended = Fault(HeapReason.WRITE_FAILED, 0, f"session on {store.path} ended before its commit")
                        self._commit_failed(store, names, ended)
                    store.release_lock()
            finally:  # whatever interrupts the clean-up, the cache is free again
                seat.session, seat.owner, self._frame = None, None, None

    def _commit(self, store: FileStore) -> None:
        ledger = self._ledger
        names = store.pending_names
        try:
            store.commit()
        except Fault as fault:
            self._commit_failed(store, names, fault)
        except Exception as exc:  # a cache problem must never fail a model load
            logger.debug("packcache: unexpected error committing %s", store.path, exc_info=True)
            store.abort()
            self._commit_failed(store, names, Fault(HeapReason.WRITE_FAILED, 0, f"cannot commit {store.path}: {exc!r}"))
        except BaseException as exc:  # interrupted: what was not committed is not durable
            # pinned by
            # tests/test_cache_sessions.py::test_an_interrupt_during_the_commit_keeps_the_previous_generation_and_counts_what_was_lost  # noqa: E501
            self._commit_failed(store, names, Fault(HeapReason.WRITE_FAILED, 0, f"commit interrupted: {exc!r}"))
            raise
        else:
            ledger.set(commit_fault=None, blocking=None)
            self._compact(store)
        finally:
            status = store.status
            ledger.set(file_bytes=status.size, reclaimable_bytes=status.reclaimable_bytes, written=store.bytes_written)

    def _compact(self, store: FileStore) -> None:
        """After a commit, still under the build lock: superseded bytes that outweigh the live ones are
        reclaimed now (a new file, renamed over the old one), so no pattern of loads grows a file without
        bound. A failure costs nothing but the bytes: it is logged once, and a later build tries again."""
        try:
            reclaimed = store.compact_if_superseded()
        except Fault as fault:
            if self._ledger.first("compact"):
                logger.warning(
                    "packcache: cannot compact %s (%s); its superseded bytes stay", store.path, fault.message
                )
            return
        except Exception:  # a cache problem must never fail a model load
            logger.debug("packcache: unexpected error compacting %s", store.path, exc_info=True)
            return
        if reclaimed:
            logger.info("packcache: compacted %s: %d superseded bytes reclaimed", store.path, reclaimed)

    def _commit_failed(self, store: FileStore, names: tuple[str, ...], fault: Fault) -> None:
        """The session's stored packs that did not become durable are counted as heap, with the
        commit's reason: they are in no committed generation, and the next launch repacks them."""
        ledger = self._ledger
        for name in names:
            held = ledger.held.get(name)
            if held is None or held.reason is not None or held.session != self._serial:
                continue
            if store.holds(name, held.key, held.origin):
                continue  # committed after all (the rename happened; only the directory sync failed)
            # pinned by tests/test_cache_sessions.py::test_a_failed_final_sync_counts_the_session_packs_as_heap
            ledger.reclassify(name, fault.reason, self._serial)
        ledger.set(commit_fault=fault)
        ledger.report(fault.reason, fault)

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
        if status.replacing and ledger.first("rebuild"):
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
        key_bytes = _request_key(name, key)
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
                found = self._serve_existing(name, key_bytes)
                if isinstance(found, np.ndarray):
                    return found  # a hit, served without leaving the mutex: nothing to wait for at exit
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
        keys = [_request_key(name, key) for name, _, key in asked]
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
        route = _Route(HeapReason.DISABLED if disabled else HeapReason.UNNAMED, None)
        with self._mutex:
            return self._serve_heap(name, key, array, owned, route)

    def _route(self, name: str, pack: PackFn, key: bytes) -> np.ndarray[Any, Any]:
        while True:
            mine: threading.Event | None = None
            try:
                with self._mutex:
                    found = self._serve_existing(name, key)
                    if isinstance(found, np.ndarray):
                        return found
                    # pinned by tests/test_cache_sessions.py::test_two_threads_asking_for_one_name_make_one_pack
                    waiting = self._inflight.get(name)
                    if waiting is not None and waiting.is_set():
                        del self._inflight[name]  # left by a request an interrupt cut short
                        waiting = None
                    if waiting is None:
                        route = found if found is not None else self._miss_route()
                        if route is not _NEEDS_LOCK:
                            if isinstance(route, _Route):
                                reused = self._reuse_heap(name, key, route)
                                if reused is not None:
                                    return reused
                            mine = self._inflight[name] = threading.Event()
                if mine is None:
                    if waiting is not None:
                        waiting.wait()  # another thread is making this pack: take its result
                    else:
                        self._take_build_lock()
                    continue
                array, owned = self._packed(pack)
                if name.startswith("packcache."):
                    _check_embedded_pack(name, key, array)
                with self._mutex:
                    if isinstance(route, _Route):
                        return self._serve_heap(name, key, array, owned, route)
                    return self._store_pack(name, key, array, owned)
            finally:
                if mine is not None:
                    mine.set()  # first: a waiter must never wait on an event nobody will set
                    with self._mutex:
                        if self._inflight.get(name) is mine:
                            del self._inflight[name]

    def _serve_existing(self, name: str, key: bytes) -> np.ndarray[Any, Any] | _Route | None:
        """A held or committed pack for ``(name, key)``; a route to heap if it cannot be mapped; None: a miss."""
        store, ledger = self._store, self._ledger
        assert store is not None
        held = ledger.held.get(name)
        if held is not None and held.key == key and not self._retry(held) and self._still_backed(name, held):
            return held.array  # the same pack again: served and counted once
        if store.status.blocking is not None:
            return None
        started = time.perf_counter()
        try:
            served = store.serve(name, key, verify=self._cache.verify)
        except Fault as fault:
            ledger.add(map_seconds=time.perf_counter() - started)
            return _Route(HeapReason.MAP_FAILED, fault)
        if served is None:
            ledger.add(map_seconds=time.perf_counter() - started)
            return None
        array, origin = served
        ledger.hold(
            name,
            Held(array, key, None, self._serial, origin),
            outcome="hits",
            map_seconds=time.perf_counter() - started,
        )
        return array

    def _miss_route(self) -> _Route | object | None:
        """Where a miss goes: heap with a reason, the file (None), or first the build lock."""
        cache, store = self._cache, self._store
        assert store is not None
        status = store.status
        if status.blocking is not None:
            return _Route(status.blocking.reason, status.blocking)
        if cache.finalized:
            return _Route(HeapReason.FINALIZED, None)
        if cache.read_only or status.read_only_fault is not None:
            fault = status.read_only_fault or Fault(HeapReason.READ_ONLY, 0, f"cache {cache.path} is read-only")
            return _Route(HeapReason.READ_ONLY, fault)
        if self._lock_fault is not None:
            return _Route(self._lock_fault.reason, self._lock_fault)
        if not store.locked:
            return _NEEDS_LOCK
        return None

    def _take_build_lock(self) -> None:
        """Wait for the build lock without holding the mutex (other threads keep serving hits),
        then re-read the file: another process may have committed while we waited."""
        store = self._store
        assert store is not None
        with self._locking:
            with self._mutex:
                # pinned by
                # tests/test_cache_sessions.py::test_threads_racing_for_the_build_lock_take_it_once_without_waiting_on_their_own_process  # noqa: E501
                if store.locked or self._lock_fault is not None:
                    return  # another thread of this session got it (or failed) meanwhile
            timeout = self._cache.lock_timeout
            if self._cache.remote is not None and not self._cache._remote_tried:
                self._cache._remote_tried = True
                self._fetch_remote()
            try:
                store.take_lock(timeout)
            except Fault as fault:
                with self._mutex:
                    self._lock_fault = fault
                return
            with self._mutex:
                store.hold_lock(timeout)
                self._refresh()

    def _fetch_remote(self) -> None:
        """The first miss of a cache with ``remote=``: fetch the published file before building one.

        Runs before the build lock is taken (the fetch takes it itself, so one process per
        machine downloads and the others find the file there), without the mutex: other threads
        keep serving hits meanwhile. The file lands by rename; the caller's refresh maps it.
        Every problem is counted as a remote miss and logged once per reason: the load goes on.
        """
        cache, ledger = self._cache, self._ledger
        assert cache.path is not None and cache.remote is not None
        started = time.perf_counter()
        try:
            from .fleet.fetch import fetch, load_trusted_keys

            store = self._store
            assert store is not None
            report = fetch(
                cache._remote_url or cache.remote, cache.path, platform=cache.platform,
                trusted_keys=load_trusted_keys(cache.trusted_keys),
                allow_unsigned=cache.allow_unsigned, timeout=cache.remote_timeout, lock_timeout=cache.lock_timeout,
                file_mode=store.file_mode, dir_mode=store.dir_mode,  # as the cache would have made the file
            )  # fmt: skip
        except RemoteError as exc:
            reason, err, message = exc.reason, exc.errno or 0, str(exc)
        except ImportError as exc:
            reason, err, message = "remote_error", 0, f"{exc} (remote= needs: pip install 'packcache[fleet]')"
        except Exception as exc:  # a store problem must never fail a model load
            logger.debug("packcache: unexpected error fetching %s: %s", cache.remote,
                         _scrub(cache, f"{type(exc).__name__}: {exc}"))  # fmt: skip
            reason, err, message = "remote_error", getattr(exc, "errno", 0) or 0, f"{type(exc).__name__}: {exc}"
        else:
            ledger.remote_result(
                nbytes=report.bytes, seconds=time.perf_counter() - started, download_mbps=report.download_mbps
            )
            logger.info(
                "packcache: %s %s from %s (generation %d, %d bytes read, %.0f MB/s)",
                "fetched" if report.downloaded else "found", cache.path, cache.remote, report.generation, report.bytes,
                report.download_mbps,
            )  # fmt: skip
            return
        if reason not in REMOTE_REASONS:
            reason = "remote_error"
        message = _scrub(cache, message)
        ledger.remote_result(nbytes=0, seconds=time.perf_counter() - started, miss=reason, err=err, message=message)
        if ledger.first(reason):
            name = errno.errorcode.get(err, "no errno") if err else "no errno"
            logger.warning("packcache: %s [%s]: %s; packing locally", reason, name, message)

    def _reuse_heap(self, name: str, key: bytes, route: _Route) -> np.ndarray[Any, Any] | None:
        """Still failing since an earlier session: serve the heap copy already held, not a second one."""
        ledger = self._ledger
        held = ledger.held.get(name)
        if held is None or held.key != key or held.reason is None:
            return None
        ledger.report(route.reason, route.fault)
        ledger.reclassify(name, route.reason, self._serial)
        return held.array

    def _store_pack(self, name: str, key: bytes, array: np.ndarray[Any, Any], owned: bool) -> np.ndarray[Any, Any]:
        store, ledger = self._store, self._ledger
        assert store is not None
        if self._state is SessionState.CLOSED:  # CLOSING still stores: its exit waits for this request, then commits
            raise SessionError("the session ended while this pack was being made")
        try:
            view, origin = store.store(name, key, fmt.key_digest(name, key), array)
        except Fault as fault:
            # map_failed here means written (and committed at exit) but served from heap.
            return self._serve_heap(name, key, array, owned, _Route(fault.reason, fault))
        except Exception as exc:  # a cache problem must never fail a model load
            logger.debug("packcache: unexpected error storing %r in %s", name, store.path, exc_info=True)
            failure = Fault(HeapReason.WRITE_FAILED, 0, f"cannot store {name!r} in {store.path}: {exc!r}")
            return self._serve_heap(name, key, array, owned, _Route(failure.reason, failure))
        finally:
            ledger.set(written=store.bytes_written)
        ledger.hold(name, Held(view, key, None, self._serial, origin), outcome="stored")
        return view

    def _still_backed(self, name: str, held: Held) -> bool:
        """A held mapped pack is served again only while the file still holds its bytes.

        Another process may have truncated, replaced or corrupted the file since
        (the session's refresh saw it): serving the old view again could be
        SIGBUS on touch, so the request is routed afresh instead.
        """
        store = self._store
        return held.origin is None or store is None or store.holds(name, held.key, held.origin)

    def _retry(self, held: Held) -> bool:
        """A pack sent to heap by a failure in an earlier session is routed again: the
        failure may be gone (lock released, space freed), and the cache should heal."""
        return held.reason in FAILURE_REASONS and held.session != self._serial

    def _packed(self, pack: PackFn) -> tuple[np.ndarray[Any, Any], bool]:
        """Call ``pack()``; return its array and whether the cache may keep it without a copy."""
        started = time.perf_counter()
        try:
            result = pack()
            # Exclusively ours when nothing else references it (this frame's name and getrefcount's
            # argument) and its memory is its own, or belongs to a chain of bases nothing else
            # references: a packer reusing a scratch buffer, or keeping one, gets a copy served.
            # pinned by tests/test_cache.py::test_heap_packs_stay_bit_identical_when_pack_reuses_its_buffer
            exclusive = type(result) is np.ndarray and sys.getrefcount(result) <= 2 and _owns_memory(result)
            array, copied = _validated(result)
            return array, exclusive or copied
        finally:
            elapsed = time.perf_counter() - started
            with self._mutex:
                self._ledger.add(pack_seconds=elapsed)

    def _serve_heap(
        self, name: str | None, key: bytes, array: np.ndarray[Any, Any], owned: bool, route: _Route
    ) -> np.ndarray[Any, Any]:
        """Serve ``array`` from heap (a copy unless the cache owns it), counted under ``route.reason``."""
        ledger = self._ledger
        ledger.report(route.reason, route.fault)
        if not owned:
            try:
                array = array.copy()
            except MemoryError:  # no room for the copy: serve what pack() returned rather than fail the load
                if ledger.first("copy"):
                    logger.warning("packcache: no memory to copy a heap pack of %s; served as pack() returned it", name)
        view = _read_only_view(array)
        ledger.hold(name, Held(view, key, route.reason, self._serial))
        return view
