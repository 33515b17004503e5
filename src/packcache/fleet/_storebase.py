"""The store interface behind :mod:`packcache.fleet.stores`: :class:`ObjectInfo`, :class:`Store`,
:func:`check_key`, and what both implementations share (private: import from ``stores``)."""

from __future__ import annotations

import abc
import dataclasses
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from .._storeurl import StoreURL, parse_store_url

__all__ = [
    "CHUNK_BYTES",
    "GRACE",
    "MAX_KEY_BYTES",
    "ObjectInfo",
    "Store",
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
