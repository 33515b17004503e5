"""The cache file on disk: open, trust, validate, map, lock, append, commit.

This module does the I/O; ``format.py`` decides what bytes mean and
``_paths.py`` how a path is opened. Everything that can go wrong with the file
surfaces as a :class:`Fault`, which carries the heap reason, the errno and a
message. The cache turns a fault into a heap pack and a counted, logged
reason; nothing here ever fails a model load.

Rules from the design that shape the code:

* A committed byte is never overwritten and the file is never truncated:
  another process may have it mapped, and shrinking a mapped file is SIGBUS.
* A new or rebuilt file is written as a temp file, synced, then renamed over
  the (resolved) path, so a failed build never destroys the previous file.
* Space is reserved with ``posix_fallocate`` before writing, so a full disk
  is an errno at a known point, never a SIGBUS through a mapping.
* One lock protocol, tied to the file rather than to the spelling of its path:
  the sidecar build lock beside the resolved path (``_paths.acquire_build_lock``),
  and, for appends in place, an ``flock`` on the file's own inode (a hardlink,
  or a lock file a cleaner deleted, must not let two writers append at once).
* Mappings are few: packs are served from a :class:`~packcache._mapping.FileMap`
  whose windows are reused, so descriptors and mappings stay O(1) in the packs.

Faults are made at one point, :func:`packcache._faults.translating`: an ``except`` block
here does something else besides (clean up, fall back, decide a state), and says so.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _faults as faults
from . import format as fmt
from ._faults import Fault
from ._generations import pwrite_all, read_generation, rewrite_live, write_generation
from ._mapping import FileMap, Window
from ._paths import (
    acquire_build_lock,
    close_if_same,
    create_temp,
    file_identity,
    open_checked,
    remove_orphans,
    still_linked,
    trust_problem,
    unlink_quietly,
    wait_for_flock,
)
from .errors import FormatError, UntrustedFileError
from .stats import HeapReason

__all__ = ["FileStore"]

logger = logging.getLogger("packcache")

Origin = tuple[int, int, int]  # (st_dev, st_ino, offset) of a pack's bytes: the file they live in now

_DTYPES = {code: np.dtype(fmt.numpy_dtype_str(code)) for code in fmt.DTYPE_CODES}  # one object per code


def _lock_reason_with_file(err: int | None) -> HeapReason:
    # No inode or no quota left for the lock file; else, beside a file we could open, a refusal means read-only.
    return HeapReason.NO_SPACE if err in faults.NO_SPACE_ERRNOS else faults.open_failed_reason(err)


def _lock_reason_without_file(err: int | None) -> HeapReason:
    return HeapReason.NO_SPACE if err in faults.NO_SPACE_ERRNOS else HeapReason.OPEN_FAILED


def _create_reason(err: int | None) -> HeapReason:
    return HeapReason.NO_SPACE if err in faults.NO_SPACE_ERRNOS else HeapReason.OPEN_FAILED


@dataclass
class _Writer:
    """One session's writes: target file, entries carried over, entries added."""

    fd: int
    temp_path: str | None  # set when building a new file that replaces the path
    target: str  # the path a new file is renamed onto: the cache path, symlinks resolved
    header: fmt.Header
    base: dict[str, fmt.Entry]
    added: dict[str, fmt.Entry]
    append_at: int
    generation: int
    map: FileMap
    identity: tuple[int, int]  # (st_dev, st_ino) of the file written
    dir_fd: int | None = None  # a new file's directory, opened before the rename (no EMFILE after it)
    dir_identity: tuple[int, int] | None = None
    merged: dict[str, fmt.Entry] = field(default_factory=dict)  # base overlaid with added
    index_bytes: int = 0  # encoded size of an index listing ``merged``

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

    def close(self) -> None:
        close_if_same(self.dir_fd, self.dir_identity)
        self.dir_fd = None
        if self.temp_path is not None:
            close_if_same(self.fd, self.identity)


class FileStore:
    """One cache file and its build lock. Not thread-safe: the session serialises calls.

    Lifecycle per session: :meth:`refresh` (read what is committed), then
    :meth:`lookup` / :meth:`view` for hits; for misses :meth:`take_lock` and
    :meth:`hold_lock`, :meth:`refresh` again, :meth:`store`; finally
    :meth:`commit` (or :meth:`abort`) and :meth:`release_lock`.
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
        self.alignment = alignment
        self.platform = platform
        self._read_only = read_only
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        # What is committed on disk, as last read.
        self.fd: int | None = None
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self.header: fmt.Header | None = None
        self.slot: fmt.Slot | None = None
        self.entries: dict[str, fmt.Entry] = {}
        self.map: FileMap | None = None
        self.file_size = 0
        self.writable = False
        self.problem: Fault | None = None  # applies to every request: untrusted / open_failed
        self.read_only_fault: Fault | None = None  # why misses cannot be stored
        self.rebuild_reason: str | None = None  # why the next store must write a new file
        self.corrupt: set[str] = set()  # committed entries whose bytes failed their checksum
        self._lock_fd: tuple[int, tuple[int, int]] | None = None  # the build lock held: (fd, identity)
        self._lock_taken: tuple[int, tuple[int, int]] | None = None  # taken, not yet adopted by a session
        self._inode_locked: int | None = None  # fd whose inode this writer flock-ed
        self._lock_deadline = 0.0
        self._writer: _Writer | None = None
        self._stale = False  # the open mode no longer matches the configuration: reopen
        self._figures: tuple[int, int] | None = None  # (live, reclaimable) bytes of the committed file, once asked
        self.bytes_written = 0  # every byte this store wrote to any cache file, cumulative

    @property
    def read_only(self) -> bool:
        """Never write. Changing it takes effect at the next :meth:`refresh` (the file is reopened)."""
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        if value != self._read_only:
            self._read_only = value
            self._stale = True  # reopened (read-write or read-only) at the next refresh outside a write

    # ------------------------------------------------------------------ reading

    def refresh(self) -> bool:
        """Bring the view of the committed file up to date; return True if it changed.

        Cheap when nothing changed: one ``stat``, one ``fstat`` and one 4 KiB ``pread``. Never writes,
        never raises: whatever stops the file being used is left in :attr:`problem`.
        """
        try:
            return self._refresh()
        except Exception as exc:  # not the translator: any error at all blocks the store, never fails a load
            logger.debug("packcache: unexpected error opening %s", self.path, exc_info=True)
            self.problem = Fault(
                HeapReason.OPEN_FAILED, getattr(exc, "errno", 0) or 0, f"cannot open {self.path}: {exc!r}"
            )
            return True

    @property
    def replacing(self) -> str | None:
        """Why the existing file will be replaced by a new one at the next store (None: it will not)."""
        return self.rebuild_reason if self.fd is not None else None

    def _refresh(self) -> bool:
        if self._writer is not None:
            return False  # our own uncommitted writes are newer than the disk
        try:
            with faults.translating(HeapReason.OPEN_FAILED, "cannot stat", self.path):
                try:
                    st = os.stat(self.path)
                except FileNotFoundError:  # not the translator: no file is a state, not a fault
                    changed = self.identity is not None or self.rebuild_reason is None
                    self._forget()
                    self.rebuild_reason = "the cache file does not exist"
                    if self.read_only:
                        message = f"cache file {self.path} does not exist (read-only cache)"
                        self.problem = Fault(HeapReason.OPEN_FAILED, errno_mod.ENOENT, message)
                    return changed
        except Fault as fault:  # the path cannot be used: every request goes to heap
            self._forget()
            self.problem = fault
            return True
        if stat.S_ISDIR(st.st_mode):
            self._forget()
            self.problem = Fault(HeapReason.OPEN_FAILED, errno_mod.EISDIR, f"cache path {self.path} is a directory")
            return True
        same = self.fd is not None and self.identity == (st.st_dev, st.st_ino) and not self._stale
        # Opened read-only because writing was refused: try again, the refusal may be gone (chmod).
        if same and not (not self.writable and not self.read_only and self.read_only_fault is not None):
            return self._reread_same_file()
        return self._open()

    def _forget(self) -> None:
        close_if_same(self.fd, self.identity)  # also drops an inode flock held on it
        if self._inode_locked == self.fd:
            self._inode_locked = None
        self.fd = None
        self.identity = None
        self.header = None
        self.slot = None
        self.entries = {}
        self.map = None  # views keep their own windows; they unmap with the last of them
        self.file_size = 0
        self._figures = None
        self.writable = False
        self.problem = None
        self.read_only_fault = None
        self.rebuild_reason = None
        self.corrupt = set()

    @property
    def live_bytes(self) -> int:
        """Bytes of the packs the committed file's newest generation lists."""
        return self._live_and_reclaimable()[0]

    @property
    def reclaimable_bytes(self) -> int:
        """Bytes of the committed file that compaction would reclaim: superseded packs, older indexes,
        the bytes of failed writes (0 for a file that is missing, invalid or about to be rebuilt)."""
        return self._live_and_reclaimable()[1]

    def _live_and_reclaimable(self) -> tuple[int, int]:
        figures = self._figures
        if figures is None:
            header, slot, entries = self.header, self.slot, self.entries
            if header is None or slot is None or self.rebuild_reason is not None:
                figures = (0, 0)
            else:
                compacted = fmt.compacted_size(entries.values(), header, slot.index_size)
                figures = (sum(e.nbytes for e in entries.values()), max(0, self.file_size - compacted))
            self._figures = figures
        return figures

    def _open(self) -> bool:
        self._forget()
        self._stale = False
        fd: int | None = None
        try:
            with faults.translating(HeapReason.OPEN_FAILED, "cannot open", self.path):
                try:
                    if not self.read_only:
                        try:
                            fd, st = open_checked(self.path, write=True)
                            self.writable = True
                        except OSError as exc:  # not the translator: a refusal to write opens the file read-only
                            if isinstance(exc, UntrustedFileError) or exc.errno not in faults.READ_ONLY_ERRNOS:
                                raise
                            fault = faults.fault_from_os(exc, HeapReason.READ_ONLY, "cannot write", self.path)
                            self.read_only_fault = fault
                    else:
                        self.read_only_fault = Fault(HeapReason.READ_ONLY, 0, f"cache {self.path} is opened read-only")
                    if fd is None:
                        fd, st = open_checked(self.path)
                except FileNotFoundError:  # not the translator: removed since the stat, a state, not a fault
                    self.rebuild_reason = "the cache file does not exist"
                    return True
        except Fault as fault:  # untrusted, or cannot be opened: every request goes to heap
            self.problem = fault
            return True
        self.fd = fd
        self.identity = (st.st_dev, st.st_ino)
        self.map = FileMap(fd)
        self._load(st.st_size)
        return True

    def _reread_same_file(self) -> bool:
        assert self.fd is not None
        st = os.fstat(self.fd)
        untrusted = trust_problem(st)  # checked on every session: a chmod can make it trusted or not
        if untrusted:
            changed = self.problem is None or self.problem.reason is not HeapReason.UNTRUSTED
            self.header, self.slot, self.entries = None, None, {}
            self.problem = Fault(HeapReason.UNTRUSTED, 0, f"untrusted cache file {self.path}: {untrusted}")
            return changed
        was_untrusted = self.problem is not None and self.problem.reason is HeapReason.UNTRUSTED
        try:
            head = os.pread(self.fd, fmt.HEADER_READ_SIZE, 0)
        except OSError:  # not the translator: an unreadable header only means "read it all again"
            head = b""
        slots, _ = fmt.choose_slot(head) if len(head) >= fmt.HEADER_READ_SIZE else ([], True)
        newest = slots[0].generation if slots else None
        current = self.slot.generation if self.slot else None
        if (
            not was_untrusted
            and newest == current
            and st.st_size == self.file_size
            and self.rebuild_reason is None
            and (self.header is not None or not slots)
        ):
            return False
        if was_untrusted:
            self.problem = None
        self._load(st.st_size)
        return True

    def _load(self, size: int) -> None:
        """Read and validate header and index of the open file (no pack byte is read)."""
        assert self.fd is not None
        self.file_size = size
        self._figures = None
        self.header, self.slot, self.entries = None, None, {}
        self.rebuild_reason = None
        self.corrupt = set()
        try:
            head = os.pread(self.fd, fmt.HEADER_READ_SIZE, 0)
            header = fmt.decode_header(head, path=self.path)
            if header.platform != self.platform:
                self.rebuild_reason = "its platform fingerprint differs from this process's"
                return
            slot, entries = read_generation(self.fd, head, header, size, path=self.path)
        except FormatError as exc:  # not the translator: an invalid file is rebuilt, never a fault
            self.rebuild_reason = f"it is invalid: {exc}"
            return
        except OSError as exc:  # the same for a file that cannot be read
            self.rebuild_reason = f"it cannot be read: {faults.describe(exc, 'reading', self.path)}"
            return
        self.header, self.slot, self.entries = header, slot, entries

    def serve(self, name: str, key: bytes, *, verify: bool = False) -> tuple[np.ndarray[Any, Any], Origin] | None:
        """The committed (or stored this session) pack for ``(name, key)``: a read-only view of
        its bytes and where they live; None for a miss (with ``verify``, also for a pack whose bytes
        fail their checksum: it is remembered as corrupt and packed again).

        Raises:
            Fault: ``map_failed`` when the entry exists but its bytes cannot be mapped.
        """
        entry = self.lookup(name, key)
        if entry is None:
            return None
        if verify and not self.checksum_ok(entry):
            logger.error(
                "packcache: entry %r of %s at offset %d failed its checksum; packing it again",
                name, self.path, entry.offset,
            )  # fmt: skip
            return None
        view = self.view(entry)
        origin = self.origin_of(entry)
        assert origin is not None  # a looked-up entry lives in the open file or in the writer's
        return view, origin

    def serve_many(
        self, wanted: list[tuple[str, bytes]]
    ) -> list[tuple[np.ndarray[Any, Any], Origin, bytes] | None] | None:
        """:meth:`serve` for many committed packs in one pass: for each ``(name, key)``, a read-only view, its
        origin and the index's own copy of the key bytes (what a holder keeps: the request's copy can go), or
        None where this pass does not decide (a miss, an empty or corrupt pack, a window that
        cannot be mapped: :meth:`serve` then does, one by one). None for all of them while this session
        writes, or the file is not in use (a problem, a rebuild).

        The same checks as :meth:`serve` without ``verify``: the name and key bytes of an entry of the
        validated index, its bytes inside the mapped file.
        """
        header, fmap, identity = self.header, self.map, self.identity
        if (
            self._writer is not None or self.problem is not None or self.rebuild_reason is not None
            or header is None or fmap is None or identity is None
        ):  # fmt: skip
            return None
        entries, corrupt, size, dtypes = self.entries, self.corrupt, self.file_size, _DTYPES
        dev, ino = identity
        window: Window | None = None
        out: list[tuple[np.ndarray[Any, Any], Origin, bytes] | None] = []
        for name, key in wanted:
            entry = entries.get(name)
            # Entry fields by position (name, key, digest, dtype, shape, offset, nbytes, crc32): one pass per pack.
            if entry is None or entry[1] != key or not entry[6] or (corrupt and name in corrupt):
                out.append(None)
                continue
            offset, nbytes, shape = entry[5], entry[6], entry[4]
            end = offset + nbytes
            if end > size:
                out.append(None)
                continue
            if window is None or not window.covers(offset, end):
                try:
                    window = fmap.committed(offset, nbytes, size, header.data_start)
                except OSError:  # not the translator: this pass leaves it to serve(), which makes the fault
                    out.append(None)
                    continue
            out.append((window.array(offset, nbytes, dtypes[entry[3]], shape), (dev, ino, offset), entry[1]))
        return out

    def holds(self, name: str, key: bytes, origin: Origin | None) -> bool:
        """Whether the bytes at ``origin`` are still what ``(name, key)`` resolves to: the file was
        not replaced, truncated, rebuilt or corrupted since they were served (None: not mapped)."""
        return origin is not None and self.origin_of(self.lookup(name, key)) == origin

    def lookup(self, name: str, key: bytes) -> fmt.Entry | None:
        """The committed (or added this session) entry for ``name`` if its key matches.

        The key bytes themselves are compared, not their digest: the same answer for every file a writer
        made (W6), one ``bytes`` comparison instead of a sha256 per request, and a file whose digest field
        disagrees with its key (which opening does not check) is judged by what the key says."""
        writer = self._writer
        entry = writer.added.get(name) if writer is not None else None
        if entry is None and (writer is None or writer.temp_path is None) and name not in self.corrupt:
            entry = self.entries.get(name)
        if entry is None or entry.key != key:
            return None
        return entry

    def view(self, entry: fmt.Entry) -> np.ndarray[Any, Any]:
        """A read-only array over ``entry``'s bytes in the file mapping.

        Raises:
            Fault: ``map_failed`` when the bytes cannot be mapped.
        """
        writer = self._writer
        if writer is not None and writer.added.get(entry.name) is entry:
            return self._array(writer.map.written(entry.offset, entry.nbytes), entry)
        if self.problem is not None:
            raise self.problem
        if self.map is None or self.header is None or entry.offset + entry.nbytes > self.file_size:
            raise Fault(HeapReason.MAP_FAILED, 0, f"{self.path}: entry {entry.name!r} lies outside the file")
        with faults.translating(HeapReason.MAP_FAILED, "cannot map", self.path):
            window = self.map.committed(entry.offset, entry.nbytes, self.file_size, self.header.data_start)
        return self._array(window, entry)

    def _array(self, window: Window, entry: fmt.Entry) -> np.ndarray[Any, Any]:
        dtype = _DTYPES[entry.dtype]
        if entry.nbytes == 0:
            empty = np.empty(entry.shape, dtype=dtype)
            empty.flags.writeable = False
            return empty
        return window.array(entry.offset, entry.nbytes, dtype, entry.shape)

    def origin_of(self, entry: fmt.Entry | None) -> Origin | None:
        """(st_dev, st_ino, offset) of the bytes ``entry`` names: the file it lives in now."""
        if entry is None:
            return None
        writer = self._writer
        if writer is not None and writer.added.get(entry.name) is entry:
            return (*writer.identity, entry.offset)
        if self.identity is None or self.rebuild_reason is not None:
            return None
        return (*self.identity, entry.offset)

    def checksum_ok(self, entry: fmt.Entry) -> bool:
        """Whether a committed entry's bytes match its checksum; a failing entry is
        remembered as corrupt, so :meth:`lookup` stops returning it."""
        if entry.nbytes == 0 or entry.name not in self.entries:
            return True
        try:
            data = self.view(entry)
        except Fault:  # not the translator: an unmappable pack goes to heap as map_failed anyway, not corrupt
            return True
        if fmt.crc32(data.reshape(-1).view(np.uint8)) == entry.crc32:
            return True
        self.corrupt.add(entry.name)
        return False

    # ------------------------------------------------------------------ locking

    def take_lock(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the build lock (then :meth:`hold_lock` adopts it).

        Changes nothing the session reads, so a thread may wait here while other
        threads of the session keep serving hits.

        Raises:
            Fault: ``locked`` on timeout; ``untrusted`` for a FIFO, symlink or foreign lock
            file; ``read_only``/``no_space``/``open_failed`` if it cannot be opened.
        """
        reason = _lock_reason_with_file if self.fd is not None else _lock_reason_without_file
        with faults.translating(reason, "cannot open lock file for", self.path):
            self._ensure_dir()
            acquire_build_lock(self.path, timeout, self.file_mode, track=self._track_lock)

    def _track_lock(self, fd: int | None) -> None:
        # Recorded before the flock is taken: an interrupt cannot leave a held lock unrecorded.
        self._lock_taken = None if fd is None else (fd, file_identity(fd))

    def hold_lock(self, timeout: float) -> None:
        """Adopt the build lock :meth:`take_lock` took (``timeout`` bounds the inode lock taken later)."""
        self._lock_fd, self._lock_taken = self._lock_taken, None
        self._lock_deadline = time.monotonic() + timeout
        # Only the lock holder creates temp files, so any left now belong to dead writers
        # (a killed rebuild or compaction): reclaim their space.
        with contextlib.suppress(OSError):
            remove_orphans(os.path.realpath(self.path))

    def release_lock(self) -> None:
        """Release the build lock and the inode lock (closing the lock descriptor releases its flock)."""
        if self._inode_locked is not None:
            with contextlib.suppress(OSError):  # not a translation: releasing must not fail the release
                fcntl.flock(self._inode_locked, fcntl.LOCK_UN)
            self._inode_locked = None
        for held in (self._lock_fd, self._lock_taken):
            if held is not None:
                close_if_same(*held)
        self._lock_fd = self._lock_taken = None

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

    def store(
        self, name: str, key: bytes, digest: bytes, array: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, Any], Origin]:
        """Write ``array`` as entry ``name``; return a read-only view of the written bytes and their origin
        (st_dev, st_ino, offset).

        The caller holds the build lock. Space for the data and for the index
        that will describe it is reserved first, so the final commit cannot run
        out of space.

        Raises:
            Fault: ``no_space``/``write_failed`` (nothing added; ``no_space`` with EFBIG also
            when the index would exceed the format's caps), ``locked`` (another writer holds
            the file's inode), or ``map_failed`` (the entry was written and will be
            committed, but cannot be mapped).
        """
        writer = self._writer or self._start_writer()
        offset = fmt.align_up(writer.append_at, writer.header.alignment)
        data = array.reshape(-1).view(np.uint8)
        entry = fmt.Entry(
            name=name, key=key, digest=digest, dtype=array.dtype.str[1:], shape=tuple(int(d) for d in array.shape),
            offset=offset, nbytes=int(array.nbytes), crc32=0,
        )  # fmt: skip
        index_size = writer.index_size_with(entry)
        count = len(writer.merged) + (name not in writer.merged)
        if index_size > fmt.MAX_INDEX_BYTES or count > fmt.MAX_ENTRIES:
            # Readers reject an index over the caps (R17, R18, R26): a file they would refuse must never be written.
            raise Fault(
                HeapReason.NO_SPACE, errno_mod.EFBIG,
                f"cannot store {name!r} in {self._target(writer)}: the index would hold {count} entries in "
                f"{index_size} bytes, over the format's caps ({fmt.MAX_ENTRIES} entries, {fmt.MAX_INDEX_BYTES} "
                "bytes); compact the file or use another cache file",
            )  # fmt: skip
        data_end = offset + entry.nbytes
        index_at = fmt.align_up(data_end, writer.header.alignment)
        with faults.translating(faults.write_reason, "cannot write to", self._target(writer)):
            os.posix_fallocate(writer.fd, offset, index_at - offset + index_size)
            self._pwrite(writer.fd, data, offset)
        entry = entry._replace(crc32=fmt.crc32(data))
        writer.add(entry)
        writer.append_at = data_end
        with faults.translating(HeapReason.MAP_FAILED, "cannot map", self.path):
            view = self._array(writer.map.written(entry.offset, entry.nbytes), entry)
        return view, (*writer.identity, entry.offset)

    def _target(self, writer: _Writer) -> str:
        return self.path if writer.temp_path is None else f"{self.path} (new file {writer.temp_path})"

    def _lock_inode(self, fd: int) -> None:
        """``flock`` the file being appended to: the sidecar lock is per path, the file may have
        other names (a hardlink), and a cleaner may have deleted the sidecar."""
        if self._inode_locked == fd:
            return
        with faults.translating(HeapReason.OPEN_FAILED, "cannot lock", self.path):
            taken = wait_for_flock(fd, self._lock_deadline)
        if not taken:
            raise Fault(
                HeapReason.LOCKED, errno_mod.EWOULDBLOCK,
                f"another process is appending to {self.path} through another name (a hardlink, or a lock "
                "file that was deleted) and held it past the lock timeout",
            )  # fmt: skip
        self._inode_locked = fd

    def _start_writer(self) -> _Writer:
        if self.fd is not None and self.writable and self.rebuild_reason is None and self.header is not None:
            self._lock_inode(self.fd)
            # Another writer (another name of this file) may have committed while we waited.
            self._reread_same_file()
        last_generation = self.slot is not None and self.slot.generation + 1 >= fmt.MAX_GENERATION
        if (
            self.fd is not None
            and self.map is not None
            and self.writable
            and self.problem is None
            and self.rebuild_reason is None
            and self.header is not None
            and self.identity is not None
            and not last_generation  # generation + 1 would not fit its u64: start a new file
        ):
            committed = self.slot.committed_end if self.slot else self.header.data_start
            # Past the end of the file, not just past the commit: bytes of a failed
            # commit may still be served by the process that wrote them.
            append_at = max(committed, os.fstat(self.fd).st_size)
            self._writer = _Writer(
                fd=self.fd, temp_path=None, target=self.path, header=self.header, base=dict(self.entries),
                added={}, append_at=append_at, generation=(self.slot.generation if self.slot else 0) + 1,
                map=self.map, identity=self.identity,
            )  # fmt: skip
            return self._writer
        header_bytes = fmt.encode_header(self.alignment, self.platform)
        header = fmt.decode_header(header_bytes)
        # A rebuild replaces the file the path resolves to: a symlinked path keeps its symlink.
        target = os.path.realpath(self.path)
        with faults.translating(_create_reason, "cannot create a new cache file for", self.path):
            self._ensure_dir()
            fd, temp = create_temp(target, self.file_mode)
        try:  # not the translator alone: a failure must close and remove the temp file too
            with faults.translating(HeapReason.OPEN_FAILED, "cannot open the directory of", self.path):
                dir_fd = os.open(os.path.dirname(target), os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
        except BaseException:
            os.close(fd)
            unlink_quietly(temp)
            raise
        try:  # the same, and the directory descriptor closed
            with faults.translating(faults.write_reason, "cannot write to", f"{self.path} (new file {temp})"):
                os.posix_fallocate(fd, 0, header.data_start + fmt.index_size([]))
                self._pwrite(fd, header_bytes, 0)
                st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            unlink_quietly(temp)
            raise
        self._writer = _Writer(
            fd=fd, temp_path=temp, target=target, header=header, base={}, added={}, append_at=header.data_start,
            generation=1, map=FileMap(fd), identity=(st.st_dev, st.st_ino), dir_fd=dir_fd,
            dir_identity=file_identity(dir_fd),
        )  # fmt: skip
        return self._writer

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        done = pwrite_all(fd, data, offset)
        self.bytes_written += done
        return done

    @property
    def pending(self) -> bool:
        """True while this session has a writer open (commit or abort it)."""
        return self._writer is not None

    @property
    def pending_names(self) -> tuple[str, ...]:
        """Names of the entries this session stored and has not committed yet."""
        return tuple(self._writer.added) if self._writer is not None else ()

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
        try:  # not the translator alone: whatever stops the commit (an interrupt too) aborts it
            with faults.translating(faults.write_reason, "cannot commit", self._target(writer)):
                slot = write_generation(writer.fd, live, index_at, writer.generation, pwrite=self._pwrite)
                if writer.temp_path is not None:
                    os.rename(writer.temp_path, writer.target)
        except BaseException:
            self.abort()  # the previous generation stays, a temp file goes
            raise
        if writer.temp_path is None:
            self._adopt(writer, slot, live)
            return
        try:
            with faults.translating(HeapReason.WRITE_FAILED, "cannot sync the directory of", self.path):
                assert writer.dir_fd is not None
                os.fsync(writer.dir_fd)
        finally:  # the new file is in place and its data synced; only the rename's durability may be in doubt
            self._adopt(writer, slot, live)

    def _adopt(self, writer: _Writer, slot: fmt.Slot, live: list[fmt.Entry]) -> None:
        """Make a committed writer's file and entries the store's committed state."""
        self._writer = None
        close_if_same(writer.dir_fd, writer.dir_identity)
        writer.dir_fd = None
        if writer.temp_path is not None:
            self._forget()
            self.fd = writer.fd
            self.writable = True
            self.identity = writer.identity
            self.map = writer.map
        self.header, self.slot = writer.header, slot
        self.entries = {e.name: e for e in live}
        self.file_size = max(os.fstat(writer.fd).st_size, slot.committed_end)
        self._figures = None
        self.problem = None
        self.rebuild_reason = None
        writer.map.trim(writer.append_at)  # the builder's spare reach is never viewed: unmap it

    def compact_if_superseded(self) -> int:
        """Rewrite the committed file without superseded bytes when they outweigh its live ones; return
        the bytes reclaimed (0: nothing to do). For a session that holds the build lock, after its commit:
        no pattern of builds grows a file without bound (docs/RELIABILITY.md "Bounded growth").

        The copy is :func:`rewrite_live`'s (temp file beside the resolved path, synced, renamed over it),
        so processes mapping the old file keep valid pages; the store then serves from the new file.

        Raises:
            Fault: ``no_space``/``write_failed`` (or ``open_failed``): the committed file stays as it is.
        """
        fd = self.fd
        if not self.locked or self._writer is not None or fd is None or not self.writable or self.slot is None:
            return 0
        if self.reclaimable_bytes <= self.live_bytes:
            return 0
        real = os.path.realpath(self.path)
        if not still_linked(fd, real):
            return 0  # renamed over by someone else meanwhile: not this file's to replace
        before = self.file_size
        try:
            with faults.translating(faults.write_reason, "cannot compact", self.path):
                rewritten = rewrite_live(
                    fd, os.fstat(fd), real, path=self.path, atime_ns=time.time_ns(), pwrite=self._pwrite
                )
        except FormatError as exc:  # not an OSError: the file this session just committed no longer reads back
            raise Fault(HeapReason.WRITE_FAILED, 0, f"cannot compact {self.path}: {exc}") from None
        self._forget()
        self.fd, self.identity, self.writable = rewritten.fd, file_identity(rewritten.fd), True
        self.map = FileMap(rewritten.fd)
        self._load(rewritten.slot.committed_end)
        if rewritten.dropped:
            logger.warning(
                "packcache: compacting %s dropped %d pack(s) failing their checksum (packed again when asked): %s",
                self.path, len(rewritten.dropped), ", ".join(rewritten.dropped[:8]),
            )  # fmt: skip
        return before - self.file_size

    def abort(self) -> None:
        """Drop this session's uncommitted entries; a temp file is removed (views of it stay valid)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.map.trim(writer.append_at)
            writer.close()
            if writer.temp_path is not None:
                unlink_quietly(writer.temp_path)

    def close(self) -> None:
        """Abort uncommitted work, release the locks and close descriptors. Views stay valid."""
        self.abort()
        self.release_lock()
        self._forget()
