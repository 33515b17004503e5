"""The store interface behind :mod:`packcache.fleet.stores`: :class:`ObjectInfo`, :class:`Store`,
:func:`check_key`, and what both implementations share (private: import from ``stores``)."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TypeVar

from .._storeurl import StoreURL, parse_store_url
from ..errors import RemoteError

__all__ = [
    "CHUNK_BYTES",
    "GRACE",
    "MAX_KEY_BYTES",
    "ObjectInfo",
    "Store",
    "StoreClock",
    "StoreURL",
    "T",
    "check_key",
    "check_range",
    "parse_store_url",
    "read_all",
    "remaining",
]

#: Longest key, in UTF-8 bytes (S3's limit).
MAX_KEY_BYTES = 1024
#: Largest chunk :meth:`Store.download` hands to its sink.
CHUNK_BYTES = 8 << 20
#: What a call may overrun its deadline by (a thread to notice, a connection to drop).
GRACE = 1.0

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What a store says about one object.

    Attributes:
        size: its size in bytes.
        etag: an opaque token for :meth:`Store.put_bytes` ``if_match``; ``None`` when the store gives
            none. Not a content hash (S3 multipart ETags are not): compare contents by sha256.
    """

    size: int
    etag: str | None


def check_key(key: str) -> str:
    """``key`` if it is a safe store key, else ``ValueError``.

    A key is ``/``-separated and relative: not empty, no leading ``/``, no empty, ``.`` or ``..``
    component, no NUL, backslash or other control character, at most :data:`MAX_KEY_BYTES` UTF-8 bytes.

    >>> check_key("blobs/sha256/ab.pcache")
    'blobs/sha256/ab.pcache'
    >>> check_key("manifests/../../etc/passwd")
    Traceback (most recent call last):
    ...
    ValueError: store key 'manifests/../../etc/passwd': a '.' or '..' component
    """
    if not isinstance(key, str):
        raise ValueError(f"store key {key!r}: not a string")
    problem = None
    if not key:
        problem = "empty"
    elif key.startswith("/"):
        problem = "absolute (a leading '/')"
    elif any(c == "\\" or ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        problem = "a NUL, backslash or control character"
    else:
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            size, problem = 0, "not valid UTF-8 (a lone surrogate)"
        if problem is None and size > MAX_KEY_BYTES:
            problem = f"{size} bytes (at most {MAX_KEY_BYTES})"
        elif problem is None:
            parts = key.split("/")
            if any(p in (".", "..") for p in parts):
                problem = "a '.' or '..' component"
            elif any(not p for p in parts):
                problem = "an empty component ('//' or a trailing '/')"
    if problem is not None:
        raise ValueError(f"store key {key!r}: {problem}")
    return key


def remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class StoreClock:
    """The time one operation (a fetch, a probe, a publish) spends waiting on its store, against its bounds.

    The clock runs only while a store call is outstanding (:meth:`waiting`; calls outstanding at once in several
    threads count once) and stops while the calling thread does local work inside one (:meth:`local`: a download's
    sink writing or hashing a chunk). What happens between store calls (hashing, signature checks, verifying and
    writing the file, parsing, waiting for the build lock) is the machine's time, not the store's: a busy machine
    spends none of the store's budget, and a store is never reported slow because the CPU was.

    Two bounds: ``total``, the store time the whole operation may spend (``remote_timeout``, ``fetch --deadline``);
    ``stall``, what one small call may take, whole, and how long a download may go without a byte
    (``fetch --timeout``). ``what`` names the operation in the timeout's message, ``url`` the store.

    >>> clock = StoreClock(5.0, 2.0, what="the probe")
    >>> clock.call(lambda deadline: deadline - time.monotonic() <= 2.0)  # one small call: the stall bound
    True
    >>> clock.spent() < 1.0
    True
    """

    def __init__(self, total: float, stall: float, *, what: str = "the fetch", url: str | None = None) -> None:
        self.total = float(total)
        self.stall = float(stall)
        self.what = what
        self.url = url
        self._lock = threading.Lock()
        self._inside = 0  # threads in a store call now, outside its sink
        self._since = 0.0  # when the first of them entered
        self._spent = 0.0  # store time before that

    def spent(self) -> float:
        """Seconds spent waiting on the store so far (a call outstanding now counts up to now)."""
        with self._lock:
            return self._spent + (time.monotonic() - self._since if self._inside else 0.0)

    def left(self) -> float:
        """Seconds of store time left (0 or less: spent)."""
        return self.total - self.spent()

    def out_of_time(self) -> RemoteError:
        """The ``remote_timeout`` of a spent budget, naming it."""
        return RemoteError(
            "remote_timeout", f"{self.what} ran out of its {self.total:g} s of waiting on the store", url=self.url
        )

    def deadline(self) -> float:
        """The deadline of one small store call starting now: the stall bound, within what is left.

        Raises:
            RemoteError: ``remote_timeout`` (:meth:`out_of_time`) when nothing is left.
        """
        left = self.left()
        if left <= 0:
            raise self.out_of_time()
        return time.monotonic() + min(self.stall, left)

    def call(self, fn: Callable[[float], T]) -> T:
        """``fn(deadline)``: one small store call, bounded by :meth:`deadline`, its time counted."""
        deadline = self.deadline()
        with self.waiting():
            return fn(deadline)

    def _enter(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._since = time.monotonic()
            self._inside += 1

    def _leave(self) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                self._spent += time.monotonic() - self._since

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The body is a store call: the clock runs while it is outstanding."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """The body is local work inside a store call (a sink): this thread stops counting while it runs."""
        self._leave()
        try:
            yield
        finally:
            self._enter()


class Store(abc.ABC):
    """A place holding objects under keys. Use as a context manager, or call :meth:`close`.

    Every method raises :class:`~packcache.errors.RemoteError` for a store problem (reasons in
    :mod:`packcache.fleet.stores`), ``ValueError`` for a bad key or range, and returns by ``deadline + 1 s``.
    """

    url: str  #: the redacted URL (what messages show)
    location: StoreURL  #: the parsed URL: its identity, its display form

    def identity(self, *, deadline: float) -> str:
        """The store's canonical identity (:attr:`StoreURL.identity`): what the rollback record is keyed by,
        the same for every spelling of the URL (credentials, case, default port, ``s3a``, a trailing ``/``)."""
        return self.location.identity

    @abc.abstractmethod
    def head(self, key: str, *, deadline: float) -> ObjectInfo:
        """Size and ETag of the object at ``key``."""

    @abc.abstractmethod
    def get(self, key: str, *, deadline: float, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """The whole object at ``key`` (a manifest); ``remote_corrupt`` if it holds more than ``max_bytes``."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int, *, deadline: float) -> bytes:
        """Bytes ``[start, end)`` of the object at ``key``; fewer only where the object ends (none past it)."""

    @abc.abstractmethod
    def download(self, key: str, sink: Callable[[memoryview], None], *, deadline: float, max_bytes: int) -> ObjectInfo:
        """Stream the object at ``key`` to ``sink`` in order, in chunks of at most :data:`CHUNK_BYTES`.

        ``sink`` runs in the calling thread; what it raises propagates unchanged. ``remote_corrupt``
        (before any byte reaches ``sink`` when the store says the size up front) if the object holds
        more than ``max_bytes``; ``remote_error`` if the transfer ends early.
        """

    @abc.abstractmethod
    def download_range(
        self, key: str, start: int, end: int, sink: Callable[[int, memoryview], None], *, deadline: float
    ) -> int:
        """Stream bytes ``[start, end)`` of the object at ``key`` to ``sink(offset, chunk)``, in order, in chunks of
        at most :data:`CHUNK_BYTES`; returns the object's whole size as the store says it. Several calls may run
        at once from several threads (a fetch's concurrent range reads).

        ``sink`` runs in the calling thread; what it raises propagates unchanged. ``remote_corrupt`` if the
        object ends before ``end`` or the store sends another range than asked; ``remote_error`` if the
        transfer ends early.
        """

    @abc.abstractmethod
    def put_file(
        self, key: str, path: str, *, deadline: float, progress: Callable[[int], object] | None = None
    ) -> bool:
        """Upload the local file ``path`` to ``key``, create-only.

        Returns ``True`` if created, ``False`` if an object already existed at ``key`` (never
        overwritten: the caller compares). Problems with the local file itself raise ``OSError``.
        ``progress`` is told the bytes sent as they go (a store that sends the file in one request: at its end).
        """

    @abc.abstractmethod
    def replace_file(self, key: str, path: str, *, deadline: float, if_match: str | None) -> None:
        """Write the local file ``path`` over the object at ``key`` (publish's repair of a damaged blob):
        only while that object's ETag is ``if_match`` (``remote_conflict`` otherwise), or whatever is
        there when ``if_match`` is ``None``. A reader sees the old object or the new one, whole."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, deadline: float, if_match: str | None) -> str:
        """Write ``data`` to ``key``: create-only when ``if_match`` is ``None``, else compare-and-swap on
        that ETag. ``remote_conflict`` when the condition fails. Returns the new ETag (``""`` when the
        store gives none)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the store holds (threads, connections). Idempotent."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def check_range(start: int, end: int) -> None:
    if not (isinstance(start, int) and isinstance(end, int)) or start < 0 or end < start:
        raise ValueError(f"byte range [{start}, {end}): need 0 <= start <= end")


def read_all(fd: int, size: int, start: int = 0) -> bytes:
    """Bytes ``[start, start + size)`` of ``fd`` by ``pread``, fewer only where the file ends."""
    chunks = []
    offset, stop = start, start + size
    while offset < stop:
        chunk = os.pread(fd, min(CHUNK_BYTES, stop - offset), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
