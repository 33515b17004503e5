"""The directory store (stdlib only): see :class:`DirectoryStore` (private: import from ``stores``)."""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import functools
import hashlib
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from packcache import _faults as faults
from packcache.errors import RemoteError

from .. import _defaults
from ._storebase import (
    CHUNK_BYTES,
    GRACE,
    ObjectInfo,
    Store,
    StoreURL,
    T,
    check_key,
    check_range,
    parse_store_url,
    read_all,
    remaining,
)

__all__ = ["DirectoryStore"]


def run_bounded(fn: Callable[[], T], deadline: float, on_late: Callable[[T], None] | None = None) -> T | None:
    """``fn()`` in a daemon thread, waited for until ``deadline + GRACE``; ``None`` if it did not finish.

    A hard-mounted NFS server that stops answering blocks ``open`` and ``read`` in the kernel, where
    no signal reaches them: the caller gives up on the thread instead. ``on_late`` gets a result that
    arrives after the caller left (an open descriptor to close). An answer (a value or an error) that is
    in when the caller gives up is the answer, never a timeout: on a busy machine the caller's own wakeup
    may come late, and a timeout must not hide what the store said.
    """
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            with lock:
                box["error"] = exc
        else:
            with lock:
                if box.get("abandoned"):
                    if on_late is not None:
                        on_late(value)
                    return
                box["value"] = value
        finally:
            done.set()

    threading.Thread(target=run, name="packcache-store-io", daemon=True).start()
    if not done.wait(remaining(deadline) + GRACE / 2):
        with lock:
            # Given up on only if no answer is in: one that came while this thread woke up late is the answer.
            if "value" not in box and "error" not in box:
                box["abandoned"] = True
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

    def __init__(self, url: str | StoreURL, *, timeout: float | None = None) -> None:
        """``url``: ``file:///abs/path`` (host empty or ``localhost``) or a path (made absolute).

        ``timeout``: seconds one filesystem step may take (a stalled read of a hung NFS server), within
        each call's deadline; ``None``: the deadline alone.

        Raises:
            ValueError: not a directory store's URL (:func:`packcache._storeurl.parse_store_url`).
        """
        location = parse_store_url(url)
        if location.root is None:
            raise ValueError(f"store URL {location.display!r}: not a directory store")
        self.location = location
        self.url = location.display
        self.root = location.root
        self._stall = None if timeout is None else max(float(timeout), 0.001)

    def identity(self, *, deadline: float) -> str:
        """See :meth:`Store.identity`: ``file://`` and the root's real path (symlinks resolved, bounded by
        ``deadline``: a hung NFS server; the lexical path if it cannot be resolved in time)."""
        real = run_bounded(lambda: os.path.realpath(self.root), deadline)
        return f"file://{real if real is not None else self.root}"

    # -- errors, at one point

    def _error(self, key: str, doing: str, exc: OSError) -> RemoteError | None:
        """The one translation of an ``OSError`` into a :class:`RemoteError` (None: it is one already)."""
        if isinstance(exc, RemoteError):
            return None
        code = exc.errno or 0
        name = faults.errno_name(code, str(code))
        if code in faults.NO_SPACE_ERRNOS:
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
        with faults.translating_into(functools.partial(self._error, key, doing), cause=True):
            result = run_bounded(fn, deadline, on_late)
        if result is None:
            raise self._timeout(key, doing)
        return result

    # -- walking to a key without leaving the root

    def _open_root(self) -> int:
        with faults.translating_into(self._root_error, cause=True):
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)

    def _root_error(self, exc: OSError) -> RemoteError:
        """A root that cannot be opened is ``remote_error``, ENOENT too: an unmounted share is not "nothing
        published"."""
        code = exc.errno or 0
        return RemoteError(
            "remote_error", f"store directory {self.root!r}: {faults.errno_name(code, str(code))} ({exc.strerror})",
            url=self.url, errno=code,
        )  # fmt: skip

    def _parent(self, key: str, *, create: bool) -> tuple[int, str]:
        """(descriptor of the key's directory, leaf name); each component opened with ``O_NOFOLLOW``."""
        parts = check_key(key).split("/")
        fd = self._open_root()
        try:
            for name in parts[:-1]:
                made = False
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, _defaults.SHARED_DIR_MODE, dir_fd=fd)
                        made = True
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                child = os.open(name, flags, dir_fd=fd)
                if made:
                    os.fchmod(child, _defaults.SHARED_DIR_MODE)
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

    # -- reads

    def head(self, key: str, *, deadline: float) -> ObjectInfo:
        """See :meth:`Store.head`."""
        check_key(key)

        def run() -> ObjectInfo:
            fd, size = self._open_object(key)
            try:
                if size > self.HEAD_ETAG_MAX:
                    return ObjectInfo(size, None)
                data = read_all(fd, size)
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
                data = read_all(fd, size)
            finally:
                os.close(fd)
            return data, ObjectInfo(len(data), hashlib.sha256(data).hexdigest())

        return self._bounded(key, "get", deadline, run)

    def get_range(self, key: str, start: int, end: int, *, deadline: float) -> bytes:
        """See :meth:`Store.get_range`."""
        check_key(key)
        check_range(start, end)

        def run() -> bytes:
            fd, size = self._open_object(key)
            try:
                stop = min(end, size)
                return read_all(fd, stop - start, start) if start < stop else b""
            finally:
                os.close(fd)

        return self._bounded(key, "get_range", deadline, run)

    def download(self, key: str, sink: Callable[[memoryview], None], *, deadline: float, max_bytes: int) -> ObjectInfo:
        """See :meth:`Store.download`. Each read runs bounded by the deadline; ``sink`` runs here."""
        check_key(key)
        fd, size = self._bounded(
            key, "download", deadline, lambda: self._open_object(key), lambda opened: os.close(opened[0])
        )
        try:
            if size > max_bytes:
                raise RemoteError("remote_corrupt", f"{key!r} holds {size} bytes (at most {max_bytes})", url=self.url)
            self._pread_span(fd, key, "download", 0, size, deadline, lambda _, chunk: sink(chunk))
        finally:
            os.close(fd)
        # No ETag: hashing every blob here as well as in the caller (which checks the manifest's sha256)
        # halved a fetch's throughput; a download's caller has what it needs.
        return ObjectInfo(size, None)

    def download_range(
        self, key: str, start: int, end: int, sink: Callable[[int, memoryview], None], *, deadline: float
    ) -> int:
        """See :meth:`Store.download_range`: ``pread`` a chunk at a time, each read bounded (a hung NFS server)."""
        check_key(key)
        check_range(start, end)
        fd, size = self._bounded(
            key, "download_range", deadline, lambda: self._open_object(key), lambda opened: os.close(opened[0])
        )
        try:
            if size < end:
                raise RemoteError(
                    "remote_corrupt", f"{key!r} holds {size} bytes, the range ends at {end}", url=self.url
                )
            self._pread_span(fd, key, "download_range", start, end, deadline, sink)
        finally:
            os.close(fd)
        return size

    def _pread_span(
        self, fd: int, key: str, doing: str, start: int, end: int, deadline: float,
        sink: Callable[[int, memoryview], None],
    ) -> None:  # fmt: skip
        """Bytes ``[start, end)`` of the open object, ``pread`` a chunk at a time (each read bounded by the deadline
        and the stall bound: a hung NFS server), handed to ``sink(offset, chunk)``. The time ``sink`` takes is the
        caller's (writing, hashing), not the store's: the deadline moves on by it.

        Raises:
            RemoteError: ``remote_timeout`` past the deadline, ``remote_error`` for an object that ends early.
        """
        offset = start
        sunk = 0.0  # seconds spent in the sink so far
        # One buffer for every chunk of the span, read into in place: a fresh 8 MiB object per chunk cost its page
        # faults and zeroing inside the store's time, 2-4x the copy itself. A read given up on (its bound passed)
        # ends the span, so a late one can only write into a buffer no one reads any more.
        buffer = memoryview(bytearray(min(CHUNK_BYTES, end - start)))
        while offset < end:
            # pinned by tests/test_fleet_deadline.py::test_a_busy_machine_does_not_make_a_directory_store_time_out
            moved = deadline + sunk
            if time.monotonic() > moved:
                raise self._timeout(key, doing)
            want = min(CHUNK_BYTES, end - offset)
            step = moved if self._stall is None else min(moved, time.monotonic() + self._stall)
            got = self._bounded(key, doing, step, functools.partial(os.preadv, fd, [buffer[:want]], offset))
            if not got:
                raise RemoteError(
                    "remote_error", f"{doing} {key!r}: ended after {offset - start} of {end - start} bytes",
                    url=self.url,
                )  # fmt: skip
            began = time.monotonic()
            sink(offset, buffer[:got])
            sunk += time.monotonic() - began
            offset += got

    # -- writes

    def _write_temp(self, dfd: int, leaf: str, write: Callable[[int], None]) -> str:
        """A new temp file beside ``leaf``, filled by ``write``, mode 0o644, fsynced; returns its name."""
        for attempt in range(8):
            temp = f".{leaf[:200]}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                fd = os.open(
                    temp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    _defaults.SHARED_FILE_MODE,
                    dir_fd=dfd,
                )
            except FileExistsError:
                if attempt == 7:
                    raise
                continue
            try:
                os.fchmod(fd, _defaults.SHARED_FILE_MODE)
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

    def _copier(
        self, src: int, path: str, key: str, doing: str, deadline: float,
        progress: Callable[[int], object] | None = None,
    ) -> Callable[[int], None]:  # fmt: skip
        """A ``write`` for :meth:`_write_temp` that copies the regular file open at ``src``."""
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno_mod.EINVAL, "not a regular file", path)

        def copy(fd: int) -> None:
            offset = 0
            while offset < st.st_size:
                if time.monotonic() > deadline:
                    raise self._timeout(key, doing)
                sent = os.sendfile(fd, src, offset, min(CHUNK_BYTES, st.st_size - offset))
                if sent == 0:
                    raise OSError(errno_mod.EIO, f"{path} ended after {offset} of {st.st_size} bytes")
                offset += sent
                if progress is not None:
                    progress(sent)

        return copy

    def put_file(
        self, key: str, path: str, *, deadline: float, progress: Callable[[int], object] | None = None
    ) -> bool:
        """See :meth:`Store.put_file`: copied into a temp file beside the key, fsynced, then linked."""
        check_key(key)
        src = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            copy = self._copier(src, path, key, "put_file", deadline, progress)

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

    def replace_file(self, key: str, path: str, *, deadline: float, if_match: str | None) -> None:
        """See :meth:`Store.replace_file`: a temp file beside the key, fsynced, renamed over it under the
        store lock, after comparing the current object's ETag (its sha256) when ``if_match`` is given."""
        check_key(key)
        src = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            copy = self._copier(src, path, key, "replace_file", deadline)

            def run() -> bool:  # not None: _bounded's None means "did not finish"
                with self._cas_lock(deadline, key):
                    dfd, leaf = self._parent(key, create=True)
                    try:
                        self._swap(dfd, leaf, key, if_match, copy)
                    finally:
                        os.close(dfd)
                return True

            self._bounded(key, "replace_file", deadline, run)
        finally:
            os.close(src)

    def _swap(self, dfd: int, leaf: str, key: str, if_match: str | None, write: Callable[[int], None]) -> None:
        """Under the store lock: compare ``leaf``'s ETag with ``if_match`` (None: no comparison), then
        rename a temp file filled by ``write`` over it and fsync the directory."""
        if if_match is not None:
            try:
                current: str | None = self._current_etag(dfd, leaf, key)
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
            assert if_match is not None
            with self._cas_lock(deadline, key):
                dfd, leaf = self._parent(key, create=True)
                try:
                    self._swap(dfd, leaf, key, if_match, write)
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
            return hashlib.sha256(read_all(fd, st.st_size)).hexdigest()
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _cas_lock(self, deadline: float, key: str) -> Any:
        # fcntl locks belong to the process, so threads of one process also need a lock of their own.
        with _CAS_LOCKS_GUARD:
            local = _CAS_LOCKS.setdefault(self.root, threading.Lock())
        if not local.acquire(timeout=remaining(deadline)):
            raise self._timeout(key, "put_bytes (waiting for the store lock)")
        try:
            rfd = self._open_root()
            try:
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                fd = os.open(self.LOCK_NAME, flags, _defaults.SHARED_FILE_MODE, dir_fd=rfd)
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
