"""Where published caches live: one small store interface, a directory store and an object store.

A store holds objects under ``/``-separated relative keys (:func:`check_key`). Two kinds:

* :class:`DirectoryStore` (``file:///abs/path`` or a plain path): a local or NFS directory, stdlib
  only. A write lands by temp file + ``fsync`` + ``link`` (create-only) or ``rename`` under a lock
  (compare-and-swap), so a reader sees a whole object or none. No key escapes the root: every
  component is opened relative to its parent with ``O_NOFOLLOW``, so a symlink planted in a shared
  directory is refused, never followed; reads never block on a FIFO and read only regular files.
* :class:`ObjectStore` (``s3://``, ``gs://``, ``az://``, ``http(s)://``): through ``obstore`` (the
  ``fleet`` extra), with credentials and endpoints from each store's standard environment variables.

Every call takes an absolute ``deadline`` (a :func:`time.monotonic` time) and returns by
``deadline + 1 s`` at the latest, even against a server that accepts and never answers. Every store
problem raises :class:`~packcache.errors.RemoteError` with a reason:

==================  ==============================================================================
``remote_absent``   no object at the key
``remote_timeout``  the deadline passed (a silent or stalled server, a lock held too long)
``remote_corrupt``  the object is larger than ``max_bytes``
``remote_conflict`` a create-only put found an object, or ``if_match`` no longer matches (publish only)
``remote_no_space`` ENOSPC, EDQUOT or EFBIG while writing
``remote_error``    anything else: refused, 403, 5xx, DNS, a malformed answer, EACCES, a FIFO at a key
==================  ==============================================================================

>>> import tempfile, time
>>> store = open_store(tempfile.mkdtemp())
>>> deadline = time.monotonic() + 10
>>> store.put_bytes("manifests/m.json", b"{}", deadline=deadline, if_match=None)
'44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a'
>>> store.get("manifests/m.json", deadline=deadline, max_bytes=1024)[0]
b'{}'
>>> store.head("manifests/none.json", deadline=deadline)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
packcache.errors.RemoteError: remote_absent: ...: no object at 'manifests/none.json'
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno as errno_mod
import fcntl
import functools
import hashlib
import os
import re
import secrets
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

from packcache.errors import RemoteError

__all__ = [
    "CHUNK_BYTES",
    "MAX_KEY_BYTES",
    "DirectoryStore",
    "ObjectInfo",
    "ObjectStore",
    "Store",
    "check_key",
    "open_store",
]

#: Longest key, in UTF-8 bytes (S3's limit).
MAX_KEY_BYTES = 1024
#: Largest chunk :meth:`Store.download` hands to its sink.
CHUNK_BYTES = 8 << 20
#: What a call may overrun its deadline by (a thread to notice, a connection to drop).
_GRACE = 1.0
_NO_SPACE = frozenset({errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG})
_FLEET_EXTRA = "pip install 'packcache[fleet]'"

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


def _redact(url: str) -> str:
    """``url`` without user info, query or fragment (credentials and SAS tokens live there)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or len(parts.scheme) == 1:  # a plain path (or a drive letter)
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class Store(abc.ABC):
    """A place holding objects under keys. Use as a context manager, or call :meth:`close`.

    Every method raises :class:`~packcache.errors.RemoteError` for a store problem (reasons in the
    module docstring), ``ValueError`` for a bad key or range, and returns by ``deadline + 1 s``.
    """

    url: str

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
    def put_file(self, key: str, path: str, *, deadline: float) -> bool:
        """Upload the local file ``path`` to ``key``, create-only.

        Returns ``True`` if created, ``False`` if an object already existed at ``key`` (never
        overwritten: the caller compares). Problems with the local file itself raise ``OSError``.
        """

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


def open_store(url: str, *, timeout: float = 10.0) -> Store:
    """The store for ``url``.

    ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix`` (and the other forms
    ``obstore`` knows), ``http(s)://…``: an :class:`ObjectStore`, whose ``timeout`` bounds connecting
    and a stalled read. ``file:///abs/path`` or a plain path: a :class:`DirectoryStore`.

    Raises:
        ValueError: an unknown URL scheme, or a ``file:`` URL with a host or a relative path.
        ModuleNotFoundError: an object store URL without the ``fleet`` extra (the message says what to install).
        RemoteError: the object store cannot be configured from ``url`` (``remote_error``).
    """
    scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url else ""
    if not scheme:
        return DirectoryStore(url)
    if scheme == "file":
        return DirectoryStore(url)
    if scheme in _OBJECT_SCHEMES:
        return ObjectStore(url, timeout=timeout)
    raise ValueError(f"store URL {_redact(url)!r}: unknown scheme {scheme!r} (s3, gs, az, http, https, file)")


_OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https"})


# ---------------------------------------------------------------------------------------------------
# The directory store


def _run_bounded(fn: Callable[[], T], deadline: float, on_late: Callable[[T], None] | None = None) -> T | None:
    """``fn()`` in a daemon thread, waited for until ``deadline + _GRACE``; ``None`` if it did not finish.

    A hard-mounted NFS server that stops answering blocks ``open`` and ``read`` in the kernel, where
    no signal reaches them: the caller gives up on the thread instead. ``on_late`` gets a result that
    arrives after the caller left (an open descriptor to close).
    """
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            box["error"] = exc
        else:
            with lock:
                if box.get("abandoned") and on_late is not None:
                    on_late(value)
                    return
                box["value"] = value
        finally:
            done.set()

    threading.Thread(target=run, name="packcache-store-io", daemon=True).start()
    if not done.wait(_remaining(deadline) + _GRACE / 2):
        with lock:
            box["abandoned"] = True
            if "value" in box and on_late is not None:
                on_late(box["value"])
        return None
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


_CAS_LOCKS: dict[str, threading.Lock] = {}
_CAS_LOCKS_GUARD = threading.Lock()


class DirectoryStore(Store):
    """A store in a local or NFS directory (stdlib only).

    Objects are files under ``root``; directories on the way are created ``0o755`` and objects
    ``0o644`` (whatever the umask: a store is there for other users to read). One identity publishes
    (the lock file and the objects are its own), anyone may read. The ETag of an object is the sha256
    hex of its content: :meth:`head` computes it only for objects up to 64 MiB (``None`` above), and
    :meth:`get` and :meth:`download` always give it.

    The root must exist: a missing root is ``remote_error`` (ENOENT: an unmounted share is not "nothing
    published"). A symlinked component, a FIFO, a directory or any non-regular file at a key is
    ``remote_error``; nothing outside ``root`` is ever opened, except that ``root`` itself may be a symlink.
    """

    #: Objects up to this size get a content ETag from :meth:`head`.
    HEAD_ETAG_MAX = 64 << 20
    #: The sidecar file whose ``fcntl`` lock serializes compare-and-swap puts (never replaced).
    LOCK_NAME = ".packcache-store.lock"

    def __init__(self, url: str) -> None:
        """``url``: ``file:///abs/path`` (host empty or ``localhost``) or a path (made absolute)."""
        if url.lower().startswith("file:"):
            parts = urllib.parse.urlsplit(url)
            if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
                raise ValueError(f"store URL {_redact(url)!r}: a file URL needs an absolute path and no host")
            root = urllib.parse.unquote(parts.path)
        else:
            root = os.path.abspath(url)
        if "\0" in root:
            raise ValueError(f"store URL {url!r}: a NUL in the path")
        self.url = _redact(url)
        self.root = root

    # -- errors, at one point

    def _error(self, exc: OSError, key: str, doing: str) -> RemoteError:
        code = exc.errno or 0
        name = errno_mod.errorcode.get(code, str(code))
        if code in _NO_SPACE:
            reason = "remote_no_space"
        elif code == errno_mod.ENOENT:
            return RemoteError("remote_absent", f"no object at {key!r}", url=self.url, errno=code)
        else:
            reason = "remote_error"
        hint = ""
        if code in (errno_mod.ELOOP, errno_mod.ENOTDIR):
            hint = " (a symlink or non-directory on the key's path: refused, never followed)"
        return RemoteError(reason, f"{doing} {key!r}: {name} ({exc.strerror}){hint}", url=self.url, errno=code)

    def _timeout(self, key: str, doing: str) -> RemoteError:
        return RemoteError("remote_timeout", f"{doing} {key!r}: the deadline passed", url=self.url)

    def _bounded(
        self, key: str, doing: str, deadline: float, fn: Callable[[], T], on_late: Callable[[T], None] | None = None
    ) -> T:
        try:
            result = _run_bounded(fn, deadline, on_late)
        except RemoteError:
            raise
        except OSError as exc:
            raise self._error(exc, key, doing) from exc
        if result is None:
            raise self._timeout(key, doing)
        return result

    # -- walking to a key without leaving the root

    def _open_root(self) -> int:
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            code = exc.errno or 0
            raise RemoteError(
                "remote_error",
                f"store directory {self.root!r}: {errno_mod.errorcode.get(code, code)} ({exc.strerror})",
                url=self.url,
                errno=code,
            ) from exc

    def _parent(self, key: str, *, create: bool) -> tuple[int, str]:
        """(descriptor of the key's directory, leaf name); each component opened with ``O_NOFOLLOW``."""
        parts = check_key(key).split("/")
        fd = self._open_root()
        try:
            for name in parts[:-1]:
                made = False
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                        made = True
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                child = os.open(name, flags, dir_fd=fd)
                if made:
                    os.fchmod(child, 0o755)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def _open_object(self, key: str) -> tuple[int, int]:
        """(descriptor, size) of the regular file at ``key``: never a FIFO wait, never a symlink."""
        dfd, leaf = self._parent(key, create=False)
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "special"
            raise RemoteError("remote_error", f"{key!r} is not a regular file ({kind})", url=self.url)
        return fd, st.st_size

    @staticmethod
    def _read_all(fd: int, size: int) -> bytes:
        chunks = []
        offset = 0
        while offset < size:
            chunk = os.pread(fd, min(CHUNK_BYTES, size - offset), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    # -- reads

    def head(self, key: str, *, deadline: float) -> ObjectInfo:
        """See :meth:`Store.head`."""
        check_key(key)

        def run() -> ObjectInfo:
            fd, size = self._open_object(key)
            try:
                if size > self.HEAD_ETAG_MAX:
                    return ObjectInfo(size, None)
                data = self._read_all(fd, size)
                return ObjectInfo(len(data), hashlib.sha256(data).hexdigest())
            finally:
                os.close(fd)

        return self._bounded(key, "head", deadline, run)

    def get(self, key: str, *, deadline: float, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """See :meth:`Store.get`."""
        check_key(key)

        def run() -> tuple[bytes, ObjectInfo]:
            fd, size = self._open_object(key)
            try:
                if size > max_bytes:
                    raise RemoteError(
                        "remote_corrupt", f"{key!r} holds {size} bytes (at most {max_bytes})", url=self.url
                    )
                data = self._read_all(fd, size)
            finally:
                os.close(fd)
            return data, ObjectInfo(len(data), hashlib.sha256(data).hexdigest())

        return self._bounded(key, "get", deadline, run)

    def get_range(self, key: str, start: int, end: int, *, deadline: float) -> bytes:
        """See :meth:`Store.get_range`."""
        check_key(key)
        _check_range(start, end)

        def run() -> bytes:
            fd, size = self._open_object(key)
            try:
                stop = min(end, size)
                return self._read_all_at(fd, start, stop) if start < stop else b""
            finally:
                os.close(fd)

        return self._bounded(key, "get_range", deadline, run)

    @staticmethod
    def _read_all_at(fd: int, start: int, stop: int) -> bytes:
        chunks = []
        offset = start
        while offset < stop:
            chunk = os.pread(fd, min(CHUNK_BYTES, stop - offset), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def download(self, key: str, sink: Callable[[memoryview], None], *, deadline: float, max_bytes: int) -> ObjectInfo:
        """See :meth:`Store.download`. Each read runs bounded by the deadline; ``sink`` runs here."""
        check_key(key)
        fd, size = self._bounded(
            key, "download", deadline, lambda: self._open_object(key), lambda opened: os.close(opened[0])
        )
        try:
            if size > max_bytes:
                raise RemoteError("remote_corrupt", f"{key!r} holds {size} bytes (at most {max_bytes})", url=self.url)
            digest = hashlib.sha256()
            offset = 0
            while offset < size:
                if time.monotonic() > deadline:
                    raise self._timeout(key, "download")
                want = min(CHUNK_BYTES, size - offset)
                chunk = self._bounded(key, "download", deadline, functools.partial(os.pread, fd, want, offset))
                if not chunk:
                    raise RemoteError(
                        "remote_error", f"download {key!r}: ended after {offset} of {size} bytes", url=self.url
                    )
                digest.update(chunk)
                offset += len(chunk)
                sink(memoryview(chunk))
        finally:
            os.close(fd)
        return ObjectInfo(size, digest.hexdigest())

    # -- writes

    def _write_temp(self, dfd: int, leaf: str, write: Callable[[int], None]) -> str:
        """A new temp file beside ``leaf``, filled by ``write``, mode 0o644, fsynced; returns its name."""
        for attempt in range(8):
            temp = f".{leaf[:200]}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                fd = os.open(
                    temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
                )
            except FileExistsError:
                if attempt == 7:
                    raise
                continue
            try:
                os.fchmod(fd, 0o644)
                write(fd)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dfd)
                raise
            os.close(fd)
            return temp
        raise AssertionError("unreachable")

    def _link_new(self, dfd: int, temp: str, leaf: str) -> bool:
        """Link ``temp`` to ``leaf`` unless something is there; unlink ``temp``; fsync the directory."""
        try:
            os.link(temp, leaf, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dfd)
        os.fsync(dfd)
        return True

    def put_file(self, key: str, path: str, *, deadline: float) -> bool:
        """See :meth:`Store.put_file`: copied into a temp file beside the key, fsynced, then linked."""
        check_key(key)
        src = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno_mod.EINVAL, "not a regular file", path)

            def copy(fd: int) -> None:
                offset = 0
                while offset < st.st_size:
                    if time.monotonic() > deadline:
                        raise self._timeout(key, "put_file")
                    sent = os.sendfile(fd, src, offset, min(CHUNK_BYTES, st.st_size - offset))
                    if sent == 0:
                        raise OSError(errno_mod.EIO, f"{path} ended after {offset} of {st.st_size} bytes")
                    offset += sent

            def run() -> bool:
                dfd, leaf = self._parent(key, create=True)
                try:
                    if _exists(dfd, leaf):
                        return False  # no copy at all for the common "already published" case
                    return self._link_new(dfd, self._write_temp(dfd, leaf, copy), leaf)
                finally:
                    os.close(dfd)

            return self._bounded(key, "put_file", deadline, run)
        finally:
            os.close(src)

    def put_bytes(self, key: str, data: bytes, *, deadline: float, if_match: str | None) -> str:
        """See :meth:`Store.put_bytes`. Create-only by ``link``; compare-and-swap by ``rename`` under an
        ``fcntl`` lock on :attr:`LOCK_NAME` in the root (NFS carries ``fcntl`` locks)."""
        check_key(key)
        data = bytes(data)
        etag = hashlib.sha256(data).hexdigest()

        def write(fd: int) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view[:CHUNK_BYTES]) :]

        def create() -> str:
            dfd, leaf = self._parent(key, create=True)
            try:
                if not self._link_new(dfd, self._write_temp(dfd, leaf, write), leaf):
                    raise RemoteError("remote_conflict", f"an object already exists at {key!r}", url=self.url)
            finally:
                os.close(dfd)
            return etag

        def swap() -> str:
            with self._cas_lock(deadline, key):
                dfd, leaf = self._parent(key, create=True)
                try:
                    try:
                        current = self._current_etag(dfd, leaf, key)
                    except FileNotFoundError:
                        current = None
                    if current != if_match:
                        what = "no object" if current is None else "another version"
                        raise RemoteError(
                            "remote_conflict", f"{key!r} changed: {what} (expected ETag {if_match})", url=self.url
                        )
                    temp = self._write_temp(dfd, leaf, write)
                    try:
                        os.rename(temp, leaf, src_dir_fd=dfd, dst_dir_fd=dfd)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(temp, dir_fd=dfd)
                        raise
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            return etag

        return self._bounded(key, "put_bytes", deadline, create if if_match is None else swap)

    def close(self) -> None:
        """Nothing to release: every call opens and closes what it uses."""

    def _current_etag(self, dfd: int, leaf: str, key: str) -> str:
        fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RemoteError("remote_error", f"{key!r} is not a regular file", url=self.url)
            return hashlib.sha256(self._read_all(fd, st.st_size)).hexdigest()
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _cas_lock(self, deadline: float, key: str) -> Any:
        # fcntl locks belong to the process, so threads of one process also need a lock of their own.
        with _CAS_LOCKS_GUARD:
            local = _CAS_LOCKS.setdefault(self.root, threading.Lock())
        if not local.acquire(timeout=_remaining(deadline)):
            raise self._timeout(key, "put_bytes (waiting for the store lock)")
        try:
            rfd = self._open_root()
            try:
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                fd = os.open(self.LOCK_NAME, flags, 0o644, dir_fd=rfd)
            finally:
                os.close(rfd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise RemoteError("remote_error", f"{self.LOCK_NAME} is not a regular file", url=self.url)
                delay = 0.005
                while True:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno_mod.EAGAIN, errno_mod.EACCES):
                            raise
                    if time.monotonic() + delay > deadline:
                        raise self._timeout(key, "put_bytes (another publisher holds the store lock)")
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
                yield
            finally:
                os.close(fd)  # closing drops the fcntl lock
        finally:
            local.release()


def _exists(dfd: int, leaf: str) -> bool:
    try:
        os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _check_range(start: int, end: int) -> None:
    if not (isinstance(start, int) and isinstance(end, int)) or start < 0 or end < start:
        raise ValueError(f"byte range [{start}, {end}): need 0 <= start <= end")


# ---------------------------------------------------------------------------------------------------
# The object store


def _import_obstore() -> Any:
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"object store URLs (s3://, gs://, az://, http(s)://) need obstore, from the fleet extra: {_FLEET_EXTRA}",
            name="obstore",
        ) from exc
    return obstore


# obstore's runtime threads do not survive fork: in a child forked after its parent used obstore every
# request hangs (test_a_child_forked_after_obstore_was_used_gets_an_error_not_a_hang). Such a child
# gets a clear error at once instead of a timeout on every call.
_obstore_used = False
_inherited_obstore = False


def _after_fork_in_child() -> None:
    global _inherited_obstore
    _inherited_obstore = _inherited_obstore or _obstore_used


os.register_at_fork(after_in_child=_after_fork_in_child)

_STATUS = re.compile(r"status(?: code)?: (\d{3})")
_OS_CODE = re.compile(r"Os \{\s*code: (\d+)")
_SINGLE_PUT_MAX = 1 << 30  # a create-only PUT holds the whole file in memory (obstore sends it in one request)
_ENDPOINT_ENV = {
    "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "s3a": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "gs": ("GOOGLE_CLOUD_STORAGE_URL", "GOOGLE_BASE_URL"),
}


class ObjectStore(Store):
    """A store in an object store (S3, GCS, Azure, HTTP) through ``obstore`` (the ``fleet`` extra).

    Credentials and endpoints come from each store's standard environment (S3: ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``; plain
    ``http://`` is allowed when the endpoint is an ``http://`` URL). Create-only puts send
    ``If-None-Match: *`` and compare-and-swap sends ``If-Match: <etag>``: the server must honour them
    (AWS S3, moto and SeaweedFS do; see docs/FLEET.md).

    Each call builds its own client whose overall timeout is the time left to the call's deadline, so
    obstore itself cuts a silent or stalled server at the deadline and no request outlives its call.
    (obstore's async API would allow cancelling instead, but its runtime can abort the interpreter at
    exit after an async call: the synchronous API does not.) Requests are retried at most twice
    (5xx, dropped connections) within the deadline.
    """

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        """``timeout`` (seconds) bounds connecting and a stalled read; each call's deadline bounds the whole call.

        Raises:
            ModuleNotFoundError: obstore is not installed.
            RemoteError: obstore cannot make a store of ``url`` (``remote_error``).
        """
        self._obstore = _import_obstore()
        self.url = _redact(url)
        self._raw_url = url
        self._stall = max(float(timeout), 0.001)
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        self._allow_http = scheme == "http" or any(
            os.environ.get(name, "").lower().startswith("http://") for name in _ENDPOINT_ENV.get(scheme, ())
        )
        self._closed = False
        self._client(time.monotonic() + self._stall, "configure", "")  # a bad URL or configuration fails here

    def _client(self, deadline: float, doing: str, key: str) -> Any:
        """An obstore store whose requests end by ``deadline`` (connect and stall bounded by ``timeout`` too)."""
        global _obstore_used
        if self._closed:
            raise RemoteError("remote_error", f"{doing} {key!r}: the store is closed", url=self.url)
        if _inherited_obstore:
            raise RemoteError(
                "remote_error",
                f"{doing} {key!r}: obstore was used before this process was forked and its runtime does not "
                "survive fork; use object stores only in processes that did not inherit them",
                url=self.url,
            )
        left = _remaining(deadline)
        if left <= 0:
            raise RemoteError("remote_timeout", f"{doing} {key!r}: the deadline passed", url=self.url)
        whole = timedelta(seconds=left)
        stall = timedelta(seconds=min(left, self._stall))
        client_options = {
            "allow_http": self._allow_http,
            "connect_timeout": stall,
            "read_timeout": stall,
            "timeout": whole,
        }
        retry_config = {
            "max_retries": 2,
            "retry_timeout": whole,
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=1), "base": 2},
        }
        try:
            client = self._obstore.store.from_url(
                self._raw_url, client_options=client_options, retry_config=retry_config
            )
        except Exception as exc:
            raise self._error(exc, key, doing, deadline) from exc
        _obstore_used = True
        return client

    def _error(self, exc: BaseException, key: str, doing: str, deadline: float) -> RemoteError:
        """The one translation of an obstore error into a :class:`RemoteError`."""
        text = str(exc)
        first = text.split("\n", 1)[0].strip()[:400]
        status_match = _STATUS.search(text)
        code_match = _OS_CODE.search(text)
        code = int(code_match.group(1)) if code_match else 0
        status = f" (HTTP {status_match.group(1)})" if status_match else ""
        where = f"{doing} {key!r}" if key else doing
        exceptions = self._obstore.exceptions
        if isinstance(exc, FileNotFoundError):
            return RemoteError("remote_absent", f"no object at {key!r}", url=self.url)
        if isinstance(exc, exceptions.AlreadyExistsError):
            return RemoteError("remote_conflict", f"{where}: an object already exists{status}", url=self.url)
        if isinstance(exc, exceptions.PreconditionError):
            return RemoteError(
                "remote_conflict", f"{where}: the object changed (its ETag no longer matches)", url=self.url
            )
        if not status_match and time.monotonic() >= deadline - 0.05:
            return RemoteError("remote_timeout", f"{where}: no answer before the deadline ({first})", url=self.url)
        os_error = f" ({errno_mod.errorcode.get(code, code)}: {os.strerror(code)})" if code else ""
        return RemoteError(
            "remote_error", f"{where}{status}{os_error}: {type(exc).__name__}: {first}", url=self.url, errno=code
        )

    def _call(self, key: str, doing: str, deadline: float, call: Callable[[Any], T]) -> T:
        client = self._client(deadline, doing, key)
        try:
            return call(client)
        except Exception as exc:
            raise self._error(exc, key, doing, deadline) from exc

    # -- reads

    def head(self, key: str, *, deadline: float) -> ObjectInfo:
        """See :meth:`Store.head`."""
        check_key(key)
        meta = self._call(key, "head", deadline, lambda client: self._obstore.head(client, key))
        return ObjectInfo(int(meta["size"]), meta.get("e_tag"))

    def get(self, key: str, *, deadline: float, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """See :meth:`Store.get`: streamed and counted, so a body longer than announced is caught."""
        parts: list[bytes] = []
        info = self.download(key, lambda chunk: parts.append(bytes(chunk)), deadline=deadline, max_bytes=max_bytes)
        return b"".join(parts), info

    def get_range(self, key: str, start: int, end: int, *, deadline: float) -> bytes:
        """See :meth:`Store.get_range`."""
        check_key(key)
        _check_range(start, end)
        if start == end:
            self.head(key, deadline=deadline)  # an absent key is absent, whatever the range
            return b""
        try:
            data = self._call(
                key, "get_range", deadline, lambda c: bytes(self._obstore.get_range(c, key, start=start, end=end))
            )
        except RemoteError as exc:
            if "(HTTP 416)" in str(exc):
                return b""  # the range starts at or past the object's end
            raise
        if len(data) > end - start:
            raise RemoteError(
                "remote_error", f"get_range {key!r}: {len(data)} bytes for a range of {end - start}", url=self.url
            )
        return data

    def download(self, key: str, sink: Callable[[memoryview], None], *, deadline: float, max_bytes: int) -> ObjectInfo:
        """See :meth:`Store.download`."""
        check_key(key)
        client = self._client(deadline, "download", key)
        try:
            result = self._obstore.get(client, key)
            meta = result.meta
            stream = iter(result.stream(min_chunk_size=CHUNK_BYTES // 2))
        except Exception as exc:
            raise self._error(exc, key, "download", deadline) from exc
        size, etag = int(meta["size"]), meta.get("e_tag")
        if size > max_bytes:
            raise RemoteError("remote_corrupt", f"{key!r} holds {size} bytes (at most {max_bytes})", url=self.url)
        received = 0
        while True:
            try:
                chunk = next(stream)
            except StopIteration:
                break
            except Exception as exc:
                raise self._error(exc, key, "download", deadline) from exc
            received += len(chunk)
            if received > size:
                raise RemoteError("remote_corrupt", f"{key!r}: more than the {size} bytes announced", url=self.url)
            view = memoryview(chunk)
            for at in range(0, len(view), CHUNK_BYTES):
                sink(view[at : at + CHUNK_BYTES])  # what the sink raises is the caller's: it propagates as is
        if received != size:
            raise RemoteError("remote_error", f"download {key!r}: ended after {received} of {size} bytes", url=self.url)
        return ObjectInfo(size, etag)

    # -- writes

    def put_file(self, key: str, path: str, *, deadline: float) -> bool:
        """See :meth:`Store.put_file`. Up to 1 GiB: one create-only PUT (the file is held in memory while it
        is sent). Larger: a multipart upload after a HEAD finds no object; two publishers racing on the
        same key may then both write (blob keys are content hashes: the same bytes)."""
        check_key(key)
        obs = self._obstore
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno_mod.EINVAL, "not a regular file", path)
            try:
                self.head(key, deadline=deadline)
                return False
            except RemoteError as exc:
                if exc.reason != "remote_absent":
                    raise
            if st.st_size <= _SINGLE_PUT_MAX:
                data = DirectoryStore._read_all(fd, st.st_size)
                if len(data) != st.st_size:
                    raise OSError(errno_mod.EIO, f"{path} changed while it was read")
                try:
                    self._call(
                        key, "put_file", deadline, lambda c: obs.put(c, key, data, mode="create", use_multipart=False)
                    )
                except RemoteError as exc:
                    if exc.reason == "remote_conflict":
                        return False
                    raise
                return True
            with open(os.dup(fd), "rb", closefd=True) as source:
                self._call(
                    key, "put_file", deadline, lambda c: obs.put(c, key, source, use_multipart=True, max_concurrency=4)
                )
            return True
        finally:
            os.close(fd)

    def put_bytes(self, key: str, data: bytes, *, deadline: float, if_match: str | None) -> str:
        """See :meth:`Store.put_bytes`."""
        check_key(key)
        payload = bytes(data)
        mode: Any = "create" if if_match is None else {"e_tag": if_match}
        try:
            result = self._call(
                key, "put_bytes", deadline, lambda c: self._obstore.put(c, key, payload, mode=mode, use_multipart=False)
            )
        except RemoteError as exc:
            if if_match is not None and exc.reason == "remote_absent":  # deleted since: it no longer matches
                raise RemoteError("remote_conflict", f"put_bytes {key!r}: the object is gone", url=self.url) from exc
            raise
        return str(result.get("e_tag") or "")

    def close(self) -> None:
        """See :meth:`Store.close`: every call has its own client, so nothing stays open."""
        self._closed = True
