"""The cache file on disk: open, trust, validate, map, lock, append, commit.

This module does the I/O; ``format.py`` decides what bytes mean. Everything
that can go wrong with the file surfaces as a :class:`Fault`, which carries
the heap reason, the errno and a message. The cache turns a fault into a heap
pack and a counted, logged reason; nothing here ever fails a model load.

Three rules from the design shape the code:

* A committed byte is never overwritten and the file is never truncated:
  another process may have it mapped, and shrinking a mapped file is SIGBUS.
* A new or rebuilt file is written as a temp file, synced, then renamed over
  the path, so a failed build never destroys the previous file.
* Space is reserved with ``posix_fallocate`` before writing, so a full disk
  is an errno at a known point, never a SIGBUS through a mapping.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import mmap
import os
import stat
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import format as fmt
from .errors import FormatError
from .paths import create_temp, fsync_dir, remove_orphans, trust_problem, unlink_quietly
from .stats import HeapReason

__all__ = [
    "Fault",
    "FileStore",
    "classify_write_errno",
    "entry_crc",
    "open_failed_reason",
    "pwrite_all",
    "read_committed",
    "read_generation",
    "wait_for_lock",
]

_NO_SPACE_ERRNOS = frozenset({errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG})
_READ_ONLY_ERRNOS = frozenset({errno_mod.EACCES, errno_mod.EROFS, errno_mod.EPERM, errno_mod.ETXTBSY})
_PAGE = mmap.ALLOCATIONGRANULARITY


class Fault(Exception):
    """A cache problem: the reason a pack goes to heap, with errno and message."""

    def __init__(self, reason: HeapReason, err: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.errno = err
        self.message = message


def classify_write_errno(err: int | None) -> HeapReason:
    """``no_space`` for ENOSPC/EDQUOT/EFBIG, ``write_failed`` for anything else."""
    return HeapReason.NO_SPACE if err in _NO_SPACE_ERRNOS else HeapReason.WRITE_FAILED


def open_failed_reason(err: int | None) -> HeapReason:
    """``read_only`` when the errno says "you may only read", else ``open_failed``."""
    return HeapReason.READ_ONLY if err in _READ_ONLY_ERRNOS else HeapReason.OPEN_FAILED


def _describe(exc: OSError, what: str, path: str) -> str:
    name = errno_mod.errorcode.get(exc.errno or 0, "E?")
    return f"{what} {path}: {name} ({exc.strerror or exc})"


def _fault_from_os(exc: OSError, reason: HeapReason, what: str, path: str) -> Fault:
    return Fault(reason, exc.errno or 0, _describe(exc, what, path))


@dataclass
class _Writer:
    """One session's writes: target file, entries carried over, entries added."""

    fd: int
    temp_path: str | None  # set when building a new file that replaces the path
    header: fmt.Header
    base: dict[str, fmt.Entry]
    added: dict[str, fmt.Entry]
    append_at: int
    generation: int
    merged: dict[str, fmt.Entry] = field(default_factory=dict)  # base overlaid with added
    index_bytes: int = 0  # encoded size of an index listing ``merged``
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file written, once asked

    def __post_init__(self) -> None:
        self.merged = dict(self.base)
        self.index_bytes = fmt.index_size(self.merged.values())

    def index_size_with(self, entry: fmt.Entry) -> int:
        """Index size once ``entry`` is added (replacing any entry of the same name)."""
        size = self.index_bytes + fmt.entry_record_size(entry.name, entry.key, len(entry.shape))
        old = self.merged.get(entry.name)
        if old is not None:
            size -= fmt.entry_record_size(old.name, old.key, len(old.shape))
        return size

    def add(self, entry: fmt.Entry) -> None:
        self.index_bytes = self.index_size_with(entry)
        self.merged[entry.name] = entry
        self.added[entry.name] = entry

    def live(self) -> list[fmt.Entry]:
        return sorted(self.merged.values(), key=lambda e: e.offset)


class FileStore:
    """One cache file and its sidecar lock. Not thread-safe: the cache serialises calls.

    Lifecycle per session: :meth:`refresh` (read what is committed), then
    :meth:`lookup` / :meth:`view` for hits; for misses :meth:`acquire_lock`,
    :meth:`refresh` again, :meth:`store`; finally :meth:`commit` (or
    :meth:`abort`) and :meth:`release_lock`.
    """

    def __init__(
        self,
        path: str,
        *,
        alignment: int,
        platform: bytes,
        read_only: bool,
        file_mode: int,
        dir_mode: int,
    ) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        self.alignment = alignment
        self.platform = platform
        self.read_only = read_only
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        # What is committed on disk, as last read.
        self.fd: int | None = None
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self.header: fmt.Header | None = None
        self.slot: fmt.Slot | None = None
        self.entries: dict[str, fmt.Entry] = {}
        self.mapping: mmap.mmap | None = None
        self.file_size = 0
        self.writable = False
        self.problem: Fault | None = None  # applies to every request: untrusted / open_failed / map_failed
        self.read_only_fault: Fault | None = None  # why misses cannot be stored
        self.rebuild_reason: str | None = None  # why the next store must write a new file
        self.corrupt: set[str] = set()  # committed entries whose bytes failed their checksum
        self._lock_fd: int | None = None
        self._writer: _Writer | None = None
        self.bytes_written = 0  # every byte this store wrote to any cache file, cumulative

    # ------------------------------------------------------------------ reading

    def refresh(self) -> bool:
        """Bring the view of the committed file up to date; return True if it changed.

        Cheap when nothing changed: one ``stat`` and one 4 KiB ``pread``. Never writes.
        """
        if self._writer is not None:
            return False  # our own uncommitted writes are newer than the disk
        try:
            lst = os.lstat(self.path)
        except FileNotFoundError:
            changed = self.identity is not None or self.rebuild_reason is None
            self._forget()
            self.rebuild_reason = "the cache file does not exist"
            if self.read_only:
                self.problem = Fault(
                    HeapReason.OPEN_FAILED, errno_mod.ENOENT, f"cache file {self.path} does not exist (read-only cache)"
                )
            return changed
        except OSError as exc:
            self._forget()
            self.problem = _fault_from_os(exc, HeapReason.OPEN_FAILED, "cannot stat", self.path)
            return True
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._forget()
            self.problem = _fault_from_os(exc, HeapReason.OPEN_FAILED, "cannot stat", self.path)
            return True
        if self.fd is not None and self.identity == (st.st_dev, st.st_ino):
            return self._reread_same_file(st.st_size)
        return self._open(lst)

    def _forget(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
        self.identity = None
        self.header = None
        self.slot = None
        self.entries = {}
        self.mapping = None  # views keep their own reference; the map closes with the last one
        self.file_size = 0
        self.writable = False
        self.problem = None
        self.read_only_fault = None
        self.rebuild_reason = None

    def _open(self, lst: os.stat_result) -> bool:
        self._forget()
        if stat.S_ISLNK(lst.st_mode):
            parent = os.path.dirname(os.path.abspath(self.path))
            try:
                pst = os.stat(parent)
            except OSError as exc:
                self.problem = _fault_from_os(exc, HeapReason.OPEN_FAILED, "cannot stat directory of", self.path)
                return True
            if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
                self.problem = Fault(
                    HeapReason.UNTRUSTED, 0,
                    f"untrusted cache file {self.path}: a symlink in world-writable directory {parent} "
                    "without the sticky bit",
                )  # fmt: skip
                return True
        elif stat.S_ISDIR(lst.st_mode):
            self.problem = Fault(HeapReason.OPEN_FAILED, errno_mod.EISDIR, f"cache path {self.path} is a directory")
            return True
        elif not stat.S_ISREG(lst.st_mode):
            self.problem = Fault(HeapReason.UNTRUSTED, 0, f"untrusted cache file {self.path}: not a regular file")
            return True
        # O_NONBLOCK: a FIFO planted behind a symlink must not hang the open.
        flags = os.O_CLOEXEC | os.O_NONBLOCK
        fd: int | None = None
        if not self.read_only:
            try:
                fd = os.open(self.path, os.O_RDWR | flags)
                self.writable = True
            except OSError as exc:
                if exc.errno not in _READ_ONLY_ERRNOS:
                    self.problem = _fault_from_os(exc, HeapReason.OPEN_FAILED, "cannot open", self.path)
                    return True
                self.read_only_fault = _fault_from_os(exc, HeapReason.READ_ONLY, "cannot write", self.path)
        else:
            self.read_only_fault = Fault(HeapReason.READ_ONLY, 0, f"cache {self.path} is opened read-only")
        if fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY | flags)
            except OSError as exc:
                self.problem = _fault_from_os(exc, HeapReason.OPEN_FAILED, "cannot open", self.path)
                return True
        self.fd = fd
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)
        untrusted = trust_problem(st)
        if untrusted:
            self.problem = Fault(HeapReason.UNTRUSTED, 0, f"untrusted cache file {self.path}: {untrusted}")
            return True
        self._load(st.st_size)
        return True

    def _reread_same_file(self, size: int) -> bool:
        assert self.fd is not None
        if self.problem is not None and self.problem.reason is HeapReason.UNTRUSTED:
            return False
        try:
            head = os.pread(self.fd, fmt.HEADER_READ_SIZE, 0)
        except OSError:
            head = b""
        slots, _ = fmt.choose_slot(head) if len(head) >= fmt.HEADER_READ_SIZE else ([], True)
        newest = slots[0].generation if slots else None
        current = self.slot.generation if self.slot else None
        if newest == current and size == self.file_size and self.rebuild_reason is None:
            return False
        self._load(size)
        return True

    def _load(self, size: int) -> None:
        """Read and validate header and index of the open file, then map it."""
        assert self.fd is not None
        self.file_size = size
        self.header, self.slot, self.entries, self.mapping = None, None, {}, None
        self.rebuild_reason = None
        self.corrupt = set()
        if self.problem is not None and self.problem.reason is HeapReason.MAP_FAILED:
            self.problem = None
        try:
            head = os.pread(self.fd, fmt.HEADER_READ_SIZE, 0)
            header = fmt.decode_header(head, path=self.path)
            if header.platform != self.platform:
                self.rebuild_reason = "its platform fingerprint differs from this process's"
                return
            slot, entries = read_generation(self.fd, head, header, size, path=self.path)
        except FormatError as exc:
            self.rebuild_reason = f"it is invalid: {exc}"
            return
        except OSError as exc:
            self.rebuild_reason = f"it cannot be read: {_describe(exc, 'reading', self.path)}"
            return
        self.header, self.slot, self.entries = header, slot, entries
        self._remap()

    def lookup(self, name: str, digest: bytes) -> fmt.Entry | None:
        """The committed (or added this session) entry for ``name`` if its key matches."""
        entry = self._writer.added.get(name) if self._writer else None
        if entry is None and (self._writer is None or self._writer.temp_path is None) and name not in self.corrupt:
            entry = self.entries.get(name)
        if entry is None or entry.digest != digest:
            return None
        return entry

    def view(self, entry: fmt.Entry) -> np.ndarray[Any, Any]:
        """A read-only array over ``entry``'s bytes in the file mapping.

        Raises:
            Fault: ``map_failed`` when the file is not mapped or too short.
        """
        if self._writer is not None and entry.name in self._writer.added:
            return self._map_range(self._writer.fd, entry)
        if self.problem is not None:
            raise self.problem
        if self.mapping is None or entry.offset + entry.nbytes > len(self.mapping):
            raise Fault(HeapReason.MAP_FAILED, 0, f"{self.path}: entry {entry.name!r} lies outside the mapping")
        return _array(self.mapping, entry, entry.offset)

    def origin_of(self, entry: fmt.Entry | None) -> tuple[int, int, int] | None:
        """(st_dev, st_ino, offset) of the bytes ``entry`` names: the file it lives in now."""
        if entry is None:
            return None
        writer = self._writer
        if writer is not None and writer.added.get(entry.name) is entry:
            if writer.identity is None:
                st = os.fstat(writer.fd)
                writer.identity = (st.st_dev, st.st_ino)
            return (*writer.identity, entry.offset)
        if self.identity is None or self.rebuild_reason is not None:
            return None
        return (*self.identity, entry.offset)

    def checksum_ok(self, entry: fmt.Entry) -> bool:
        """Whether a committed entry's bytes match its checksum; a failing entry is
        remembered as corrupt, so :meth:`lookup` stops returning it."""
        if self.mapping is None or entry.nbytes == 0 or entry.name not in self.entries:
            return True
        if entry_crc(self.mapping, entry) == entry.crc32:
            return True
        self.corrupt.add(entry.name)
        return False

    # ------------------------------------------------------------------ locking

    def acquire_lock(self, timeout: float) -> None:
        """Take the exclusive build lock, waiting up to ``timeout`` seconds.

        Raises:
            Fault: ``locked`` on timeout; ``read_only``/``open_failed`` if the lock file cannot be opened.
        """
        if self._lock_fd is not None:
            return
        try:
            self._ensure_dir()
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, self.file_mode)
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, self.file_mode)  # the umask must not leave it unopenable for writing
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:  # no inode or no quota left for the lock file
                reason = HeapReason.NO_SPACE
            elif self.fd is not None:
                reason = open_failed_reason(exc.errno)
            else:
                reason = HeapReason.OPEN_FAILED
            raise _fault_from_os(exc, reason, "cannot open lock file for", self.path) from None
        try:
            wait_for_lock(fd, timeout, self.lock_path)
        except Fault:
            os.close(fd)
            raise
        self._lock_fd = fd
        # Only the lock holder creates temp files, so any left now belong to dead writers
        # (a killed rebuild or compaction): reclaim their space.
        with contextlib.suppress(OSError):
            remove_orphans(self.path)

    def release_lock(self) -> None:
        """Release the build lock (closing the descriptor releases the flock)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def _ensure_dir(self) -> None:
        """Create missing directories, each with exactly ``dir_mode`` (the umask must not widen or narrow it)."""
        directory = os.path.dirname(os.path.abspath(self.path))
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            parent = os.path.dirname(directory)
            if parent == directory:
                break
            directory = parent
        for path in reversed(missing):
            try:
                os.mkdir(path, self.dir_mode)
            except FileExistsError:
                continue  # created meanwhile by another process: not ours to chmod
            os.chmod(path, self.dir_mode)

    # ------------------------------------------------------------------ writing

    def store(self, name: str, key: bytes, digest: bytes, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Write ``array`` as entry ``name`` and return a read-only view of the written bytes.

        The caller holds the build lock. Space for the data and for the index
        that will describe it is reserved first, so the final commit cannot run
        out of space.

        Raises:
            Fault: ``no_space``/``write_failed`` (nothing added), or ``map_failed``
            (the entry was written and will be committed, but cannot be mapped).
        """
        writer = self._writer or self._start_writer()
        offset = fmt.align_up(writer.append_at, writer.header.alignment)
        data = array.reshape(-1).view(np.uint8)
        entry = fmt.Entry(
            name=name, key=key, digest=digest, dtype=array.dtype.str[1:], shape=tuple(int(d) for d in array.shape),
            offset=offset, nbytes=int(array.nbytes), crc32=0,
        )  # fmt: skip
        data_end = offset + entry.nbytes
        index_at = fmt.align_up(data_end, writer.header.alignment)
        try:
            os.posix_fallocate(writer.fd, offset, index_at - offset + writer.index_size_with(entry))
            self._pwrite(writer.fd, data, offset)
        except OSError as exc:
            raise _fault_from_os(
                exc, classify_write_errno(exc.errno), "cannot write to", self._target(writer)
            ) from None
        entry = entry._replace(crc32=_crc32(data))
        writer.add(entry)
        writer.append_at = data_end
        return self._map_range(writer.fd, entry)

    def _target(self, writer: _Writer) -> str:
        return self.path if writer.temp_path is None else f"{self.path} (new file {writer.temp_path})"

    def _start_writer(self) -> _Writer:
        last_generation = self.slot is not None and self.slot.generation + 1 >= fmt.MAX_GENERATION
        if (
            self.fd is not None
            and self.writable
            and self.rebuild_reason is None
            and self.header is not None
            and not last_generation  # generation + 1 would not fit its u64: start a new file
        ):
            committed = self.slot.committed_end if self.slot else self.header.data_start
            # Past the end of the file, not just past the commit: bytes of a failed
            # commit may still be served by the process that wrote them.
            append_at = max(committed, os.fstat(self.fd).st_size)
            self._writer = _Writer(
                fd=self.fd, temp_path=None, header=self.header, base=dict(self.entries), added={},
                append_at=append_at, generation=(self.slot.generation if self.slot else 0) + 1,
            )  # fmt: skip
            return self._writer
        header_bytes = fmt.encode_header(self.alignment, self.platform)
        header = fmt.decode_header(header_bytes)
        try:
            self._ensure_dir()
            fd, temp = create_temp(self.path, self.file_mode)
        except OSError as exc:
            reason = HeapReason.OPEN_FAILED
            if exc.errno in _NO_SPACE_ERRNOS:
                reason = HeapReason.NO_SPACE
            raise _fault_from_os(exc, reason, "cannot create a new cache file for", self.path) from None
        try:
            os.posix_fallocate(fd, 0, header.data_start + fmt.index_size([]))
            self._pwrite(fd, header_bytes, 0)
        except OSError as exc:
            os.close(fd)
            unlink_quietly(temp)
            where = f"{self.path} (new file {temp})"
            raise _fault_from_os(exc, classify_write_errno(exc.errno), "cannot write to", where) from None
        self._writer = _Writer(
            fd=fd, temp_path=temp, header=header, base={}, added={}, append_at=header.data_start, generation=1
        )  # fmt: skip
        return self._writer

    def _map_range(self, fd: int, entry: fmt.Entry) -> np.ndarray[Any, Any]:
        if entry.nbytes == 0:
            empty = np.empty(entry.shape, dtype=fmt.numpy_dtype_str(entry.dtype))
            empty.flags.writeable = False
            return empty
        start = entry.offset - entry.offset % _PAGE
        region = self._map(fd, entry.offset + entry.nbytes - start, start)
        return _array(region, entry, entry.offset - start)

    def _map(self, fd: int, length: int, offset: int) -> mmap.mmap:
        """A read-only shared mapping (``length`` 0: the whole file).

        Raises:
            Fault: ``map_failed`` with the errno (ENOMEM under RLIMIT_AS, for one).
        """
        try:
            return mmap.mmap(fd, length, offset=offset, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            err = getattr(exc, "errno", 0) or 0
            raise Fault(
                HeapReason.MAP_FAILED, err, f"cannot map {self.path}: {errno_mod.errorcode.get(err, 'E?')} ({exc})"
            ) from None

    def _pwrite(self, fd: int, data: Any, offset: int) -> None:
        self.bytes_written += pwrite_all(fd, data, offset)

    @property
    def pending(self) -> bool:
        """True while this session has a writer open (commit or abort it)."""
        return self._writer is not None

    def commit(self) -> None:
        """Make this session's entries durable.

        Order: index after the data, fdatasync, then the older commit slot, fdatasync;
        a new file is then renamed over the path and its directory synced.

        Raises:
            Fault: ``no_space``/``write_failed``; the previous generation stays intact.
        """
        writer = self._writer
        if writer is None:
            return
        if not writer.added:
            # Every store of the session failed: nothing to commit, and a new
            # generation (or an empty rebuilt file) must not replace the old one.
            self.abort()
            return
        live = writer.live()
        index_at = fmt.align_up(writer.append_at, writer.header.alignment)
        index = fmt.encode_index(live)
        slot = fmt.Slot(writer.generation, index_at, len(index), len(live), _crc32(index))
        target = self._target(writer)
        try:
            os.posix_fallocate(writer.fd, index_at, len(index))
            self._pwrite(writer.fd, index, index_at)
            os.fdatasync(writer.fd)
            self._pwrite(writer.fd, fmt.encode_slot(slot), fmt.slot_offset(slot.generation % 2))
            os.fdatasync(writer.fd)
            if writer.temp_path is not None:
                os.rename(writer.temp_path, self.path)
                fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except OSError as exc:
            self.abort()
            raise _fault_from_os(exc, classify_write_errno(exc.errno), "cannot commit", target) from None
        self._writer = None
        if writer.temp_path is not None:
            self._forget()
            self.fd = writer.fd
            self.writable = True
            st = os.fstat(writer.fd)
            self.identity = (st.st_dev, st.st_ino)
        self.header, self.slot = writer.header, slot
        self.entries = {e.name: e for e in live}
        self.file_size = max(os.fstat(writer.fd).st_size, slot.committed_end)
        self.mapping = None  # replaced below; this session's views keep their own maps
        self.problem = None
        self._remap()

    def _remap(self) -> None:
        if self.fd is None or not self.entries:
            return
        try:
            self.mapping = self._map(self.fd, 0, 0)
        except Fault as fault:
            self.problem = fault

    def abort(self) -> None:
        """Drop this session's uncommitted entries; a temp file is removed."""
        writer, self._writer = self._writer, None
        if writer is not None and writer.temp_path is not None:
            os.close(writer.fd)
            unlink_quietly(writer.temp_path)

    def close(self) -> None:
        """Abort uncommitted work, release the lock and close descriptors. Views stay valid."""
        self.abort()
        self.release_lock()
        self._forget()


def read_generation(
    fd: int, head: bytes, header: fmt.Header, size: int, *, path: str | None = None
) -> tuple[fmt.Slot | None, dict[str, fmt.Entry]]:
    """The newest generation of an open file whose slot and index validate.

    ``head`` is the file's first 4096 bytes, already checked by ``decode_header``.
    Returns ``(None, {})`` for a file never committed.

    Raises:
        FormatError: no generation is usable (docs/FORMAT.md R14, R43).
    """
    slots, written = fmt.choose_slot(head)
    if not slots:
        if written:
            raise FormatError("no commit slot is valid", path=path, offset=fmt.slot_offset(0))
        return None, {}
    first_error: FormatError | None = None
    for slot in slots:
        try:
            fmt.validate_slot_bounds(slot, header, size, path=path)
            buf = os.pread(fd, slot.index_size, slot.index_offset)
            return slot, fmt.decode_index(buf, slot, header, path=path)
        except FormatError as exc:
            first_error = first_error or exc
    assert first_error is not None
    raise first_error


def read_committed(fd: int, *, path: str | None = None) -> tuple[fmt.Header, fmt.Slot | None, dict[str, fmt.Entry]]:
    """Header and newest valid generation of an open cache file (reads no pack data).

    Raises:
        FormatError: the file breaks docs/FORMAT.md. OSError: it cannot be read.
    """
    head = os.pread(fd, fmt.HEADER_READ_SIZE, 0)
    header = fmt.decode_header(head, path=path)
    slot, entries = read_generation(fd, head, header, os.fstat(fd).st_size, path=path)
    return header, slot, entries


def wait_for_lock(fd: int, timeout: float, lock_path: str) -> None:
    """Take an exclusive ``flock`` on ``fd``, polling for up to ``timeout`` seconds.

    ``flock`` has no timeout of its own; polling with a capped backoff keeps the
    wait interruptible and bounded.

    Raises:
        Fault: ``locked`` (EWOULDBLOCK) on timeout; ``open_failed`` if flock itself fails.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError as exc:
            raise _fault_from_os(exc, HeapReason.OPEN_FAILED, "cannot lock", lock_path) from None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Fault(
                HeapReason.LOCKED, errno_mod.EWOULDBLOCK,
                f"another process held the build lock {lock_path} for more than {timeout:g} s",
            )  # fmt: skip
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)


def _array(buffer: mmap.mmap, entry: fmt.Entry, offset: int) -> np.ndarray[Any, Any]:
    dtype = np.dtype(fmt.numpy_dtype_str(entry.dtype))
    count = entry.nbytes // dtype.itemsize
    # frombuffer over an ACCESS_READ map is read-only, and the array keeps the map alive.
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(entry.shape)


def pwrite_all(fd: int, data: Any, offset: int) -> int:
    """``pwrite`` all of ``data`` at ``offset`` (a short write is continued); return the byte count."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


_CHUNK = 8 << 20  # checksum in slices: a memoryview slice of a map copies nothing


def entry_crc(region: mmap.mmap, entry: fmt.Entry) -> int:
    """crc32 of an entry's bytes in a mapping of its file (reads every page of it)."""
    crc = 0
    for start in range(entry.offset, entry.offset + entry.nbytes, _CHUNK):
        end = min(start + _CHUNK, entry.offset + entry.nbytes)
        with memoryview(region) as whole, whole[start:end] as chunk:
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def _crc32(data: Any) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF
