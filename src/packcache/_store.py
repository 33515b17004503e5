"""The cache file on disk: :class:`FileStore`, its condition, and its read role (open, trust, validate, map, serve).

This module reads; ``format.py`` decides what bytes mean and ``_paths.py`` how a path is opened. The
store's two other roles live beside it and are owned by it: writing (:mod:`packcache._store_write`:
append, commit, abort, compact) and locking (:mod:`packcache._store_lock`: the build lock and the
inode lock). Its condition is one value, :class:`~packcache._store_state.StoreStatus`, replaced whole
by each transition (:class:`~packcache._store_state.StoreState` lists them).

Everything that can go wrong with the file surfaces as a :class:`~packcache._faults.Fault`, which
carries the heap reason, the errno and a message, made at one point (:func:`packcache._faults.translating`).
The cache turns a fault into a heap pack and a counted, logged reason; nothing here ever fails a model load.
Mappings are few: packs are served from a :class:`~packcache._mapping.FileMap` whose windows are reused,
so descriptors and mappings stay O(1) in the packs.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import stat
from typing import Any, Final

import numpy as np

from . import _faults as faults
from . import format as fmt
from ._faults import Fault
from ._generations import read_generation
from ._mapping import FileMap, Window
from ._paths import open_checked, resolve_trusted, trust_problem
from ._sidefiles import close_if_same, file_identity, still_linked
from ._store_lock import BuildLock
from ._store_state import Committed, OpenFile, StoreState, StoreStateError, StoreStatus
from ._store_write import DTYPES, FileWriter, Origin, PendingWrite, entry_array
from .errors import FormatError, UntrustedFileError
from .stats import HeapReason

__all__ = ["FileStore"]

#: Positions of the :class:`~packcache.format.Entry` fields the serving path reads by index (see
#: :meth:`FileStore.serve_many`); pinned by tests/test_store.py::test_the_serving_paths_entry_indexes_name_its_fields
_KEY: Final = 1
_DTYPE: Final = 3
_SHAPE: Final = 4
_OFFSET: Final = 5
_NBYTES: Final = 6

logger = logging.getLogger("packcache")

_NO_FILE = "the cache file does not exist"
_READY, _CLOSED = StoreState.READY, StoreState.CLOSED  # module constants: the per-request checks read them


class FileStore:
    """One cache file, its condition (:attr:`status`), and its three roles. Not thread-safe: the session
    serialises calls.

    Roles, by composition: this class reads (and decides); its :class:`~packcache._store_write.FileWriter`
    writes what it decides, its :class:`~packcache._store_lock.BuildLock` locks. Every transition goes
    through :meth:`_become`, which also closes the file a new status no longer holds.

    Lifecycle per session: :meth:`refresh` (read what is committed), then :meth:`serve_many` /
    :meth:`serve` for hits; for misses :meth:`take_lock` and :meth:`hold_lock`, :meth:`refresh` again,
    :meth:`store`; finally :meth:`commit` (or :meth:`abort`) and :meth:`release_lock`; :meth:`close` at
    the end of the cache. States, transitions and the calls each state refuses (with a
    :class:`~packcache._store_state.StoreStateError`): :class:`~packcache._store_state.StoreState`.
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
        self.platform = platform
        # Never write. Changing it takes effect at the next refresh: a file open in the other mode is reopened.
        self.read_only = read_only
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.status = StoreStatus(StoreState.UNREAD)
        self._writer = FileWriter(path, alignment=alignment, platform=platform, file_mode=file_mode, dir_mode=dir_mode)
        self._lock = BuildLock(path, file_mode=file_mode, dir_mode=dir_mode)

    # ------------------------------------------------------------------ the condition

    def _become(self, status: StoreStatus) -> None:
        """Make ``status`` the store's condition, whole. A file it no longer holds is closed first (one
        descriptor at a time; also drops an inode flock held on it); views keep their own windows."""
        old = self.status.file
        if old is not None and old is not status.file:
            close_if_same(old.fd, old.identity)
            self._lock.closing(old.fd)
        self.status = status

    def _refuse_closed(self, operation: str) -> None:
        if self.status.state is _CLOSED:
            raise StoreStateError(f"{operation} on the store of {self.path}, which is closed")

    # ------------------------------------------------------------------ reading the file

    def refresh(self) -> bool:
        """Bring the view of the committed file up to date; return True if it changed.

        Cheap when nothing changed: one ``stat``, one ``fstat`` and one 4 KiB ``pread``. Never writes,
        never raises a cache problem: whatever stops the file being used is left in :attr:`blocking`.

        Raises:
            StoreStateError: the store is closed.
        """
        self._refuse_closed("refresh()")
        try:
            return self._refresh()
        except Exception as exc:  # not the translator: any error at all blocks the store, never fails a load
            logger.debug("packcache: unexpected error opening %s", self.path, exc_info=True)
            fault = Fault(HeapReason.OPEN_FAILED, getattr(exc, "errno", 0) or 0, f"cannot open {self.path}: {exc!r}")
            status = self.status
            self._become(StoreStatus(StoreState.BLOCKED, file=status.file, size=status.size, blocking=fault))
            return True

    def _refresh(self) -> bool:
        if self._writer.pending is not None:
            return False  # our own uncommitted writes are newer than the disk
        try:
            return self._look()
        except Fault as fault:  # the path cannot be used at all: every request goes to heap
            self._become(StoreStatus(StoreState.BLOCKED, blocking=fault))
            return True

    def _look(self) -> bool:
        with faults.translating(HeapReason.OPEN_FAILED, "cannot stat", self.path):
            try:
                st = os.stat(self.path)
            except FileNotFoundError:  # not the translator: no file is a state (MISSING), not a fault
                changed = self.status.state is not StoreState.MISSING
                blocking = None
                if self.read_only:
                    message = f"cache file {self.path} does not exist (read-only cache)"
                    blocking = Fault(HeapReason.OPEN_FAILED, errno_mod.ENOENT, message)
                self._become(StoreStatus(StoreState.MISSING, rebuild=_NO_FILE, blocking=blocking))
                return changed
        if stat.S_ISDIR(st.st_mode):
            raise Fault(HeapReason.OPEN_FAILED, errno_mod.EISDIR, f"cache path {self.path} is a directory")
        file = self.status.file
        # The same file, open in the mode the configuration asks for: read it again. Otherwise reopen (opened
        # read-only because writing was refused: try again, the refusal may be gone, e.g. after a chmod).
        if file is not None and file.identity == (st.st_dev, st.st_ino) and file.writable != self.read_only:
            return self._reread(file)
        return self._open()

    def _open(self) -> bool:
        self._become(StoreStatus(StoreState.UNREAD))  # the old file is closed first: one descriptor at a time
        read_only_fault: Fault | None = None
        opened: tuple[int, os.stat_result] | None = None
        with faults.translating(HeapReason.OPEN_FAILED, "cannot open", self.path):
            try:
                if self.read_only:
                    read_only_fault = Fault(HeapReason.READ_ONLY, 0, f"cache {self.path} is opened read-only")
                else:
                    try:
                        opened = open_checked(self.path, write=True)
                    except OSError as exc:  # not the translator: a refusal to write opens the file read-only
                        if isinstance(exc, UntrustedFileError) or exc.errno not in faults.READ_ONLY_ERRNOS:
                            raise
                        read_only_fault = faults.fault_from_os(exc, HeapReason.READ_ONLY, "cannot write", self.path)
                if opened is None:
                    opened = open_checked(self.path)
            except FileNotFoundError:  # not the translator: removed since the stat, a state, not a fault
                self._become(StoreStatus(StoreState.MISSING, rebuild=_NO_FILE, read_only_fault=read_only_fault))
                return True
        fd, st = opened
        file = OpenFile(fd, (st.st_dev, st.st_ino), FileMap(fd), writable=read_only_fault is None)
        self._become(self._loaded(file, st.st_size, read_only_fault))
        return True

    def _reread(self, file: OpenFile) -> bool:
        """The file held open is still at the path: check its trust again, and read it again if it changed."""
        status = self.status
        st = os.fstat(file.fd)
        was_untrusted = status.blocking is not None and status.blocking.reason is HeapReason.UNTRUSTED
        untrusted = trust_problem(st)  # checked on every session: a chmod can make it trusted or not
        if untrusted:
            fault = Fault(HeapReason.UNTRUSTED, 0, f"untrusted cache file {self.path}: {untrusted}")
            self._become(StoreStatus(
                StoreState.BLOCKED, file=file, size=status.size, blocking=fault, read_only_fault=status.read_only_fault
            ))  # fmt: skip
            return not was_untrusted
        try:
            head = os.pread(file.fd, fmt.HEADER_READ_SIZE, 0)
        except OSError:  # not the translator: an unreadable header only means "read it all again"
            head = b""
        slots, _ = fmt.choose_slot(head) if len(head) >= fmt.HEADER_READ_SIZE else ([], True)
        newest = slots[0].generation if slots else None
        committed = status.committed
        current = committed.slot.generation if committed is not None and committed.slot is not None else None
        if status.state is StoreState.READY and newest == current and st.st_size == status.size:
            return False
        self._become(self._loaded(file, st.st_size, status.read_only_fault))
        return True

    def _loaded(self, file: OpenFile, size: int, read_only_fault: Fault | None) -> StoreStatus:
        """The status of ``file`` (``size`` bytes): its header and newest generation validated (no pack byte is
        read) make it READY; an invalid file, or one of another platform, is REBUILD."""
        try:
            head = os.pread(file.fd, fmt.HEADER_READ_SIZE, 0)
            header = fmt.decode_header(head, path=self.path)
            if header.platform != self.platform:
                rebuild = "its platform fingerprint differs from this process's"
            else:
                slot, entries = read_generation(file.fd, head, header, size, path=self.path)
                committed = Committed(header, slot, entries)
                return StoreStatus(
                    StoreState.READY, file=file, size=size, committed=committed, read_only_fault=read_only_fault
                )
        except FormatError as exc:  # not the translator: an invalid file is rebuilt, never a fault
            rebuild = f"it is invalid: {exc}"
        except OSError as exc:  # the same for a file that cannot be read
            rebuild = f"it cannot be read: {faults.describe(exc, 'reading', self.path)}"
        return StoreStatus(
            StoreState.REBUILD, file=file, size=size, rebuild=rebuild, read_only_fault=read_only_fault
        )  # fmt: skip

    # ------------------------------------------------------------------ serving

    def serve(self, name: str, key: bytes, *, verify: bool = False) -> tuple[np.ndarray[Any, Any], Origin] | None:
        """The committed (or stored this session) pack for ``(name, key)``: a read-only view of
        its bytes and where they live; None for a miss (with ``verify``, also for a pack whose bytes
        fail their checksum: it is remembered as corrupt and packed again).

        Raises:
            Fault: ``map_failed`` when the entry exists but its bytes cannot be mapped.
            StoreStateError: the store is closed.
        """
        if self.status.state is _CLOSED:
            self._refuse_closed("serve()")
        entry = self._lookup(name, key)
        if entry is None:
            return None
        if verify and not self._checksum_ok(entry):
            logger.error(
                "packcache: entry %r of %s at offset %d failed its checksum: not served (packed again if the load has "
                "its source)",
                name, self.path, entry.offset,
            )  # fmt: skip
            return None
        view = self._view(entry)
        origin = self._origin_of(entry)
        assert origin is not None  # a looked-up entry lives in the open file or in the writer's
        return view, origin

    def serve_many(
        self, wanted: list[tuple[str, bytes]]
    ) -> list[tuple[np.ndarray[Any, Any], Origin, bytes] | None] | None:
        """:meth:`serve` for many committed packs in one pass: for each ``(name, key)``, a read-only view, its
        origin and the index's own copy of the key bytes (what a holder keeps: the request's copy can go), or
        None where this pass does not decide (a miss, an empty or corrupt pack, a window that
        cannot be mapped: :meth:`serve` then does, one by one). None for all of them unless the store is
        READY with no write pending.

        The same checks as :meth:`serve` without ``verify``: the name and key bytes of an entry of the
        validated index, its bytes inside the mapped file.

        Raises:
            StoreStateError: the store is closed.
        """
        status = self.status
        serving = status.serving
        if serving is None or self._writer.pending is not None:
            self._refuse_closed("serve_many()")
            return None
        entries, corrupt, size = serving.entries, serving.corrupt, serving.size
        fmap, data_start, dev, ino = serving.map, serving.data_start, serving.dev, serving.ino
        # Locals, not globals, in the loop below: one load per read, as a literal index costs.
        dtypes = DTYPES
        key_at: Final = _KEY
        dtype_at: Final = _DTYPE
        shape_at: Final = _SHAPE
        offset_at: Final = _OFFSET
        nbytes_at: Final = _NBYTES
        window: Window | None = None
        out: list[tuple[np.ndarray[Any, Any], Origin, bytes] | None] = []
        for name, key in wanted:
            entry = entries.get(name)
            # fmt.Entry's fields by index, not by name: a tuple index is specialised by the interpreter, a
            # named tuple's field getter is not, and this loop runs once per pack.
            if entry is None or entry[key_at] != key or not entry[nbytes_at] or (corrupt and name in corrupt):
                out.append(None)
                continue
            offset, nbytes, shape = entry[offset_at], entry[nbytes_at], entry[shape_at]
            end = offset + nbytes
            if end > size:
                out.append(None)
                continue
            if window is None or not window.covers(offset, end):
                try:
                    window = fmap.committed(offset, nbytes, size, data_start)
                except OSError:  # not the translator: this pass leaves it to serve(), which makes the fault
                    out.append(None)
                    continue
            view = window.array(offset, nbytes, dtypes[entry[dtype_at]], shape)
            out.append((view, (dev, ino, offset), entry[key_at]))
        return out

    def holds(self, name: str, key: bytes, origin: Origin | None) -> bool:
        """Whether the bytes at ``origin`` are still what ``(name, key)`` resolves to: the file was
        not replaced, truncated, rebuilt or corrupted since they were served (None: not mapped).

        Raises:
            StoreStateError: the store is closed.
        """
        status = self.status
        serving = status.serving
        if serving is not None and origin is not None and self._writer.pending is None:
            # The common case inline (a pack held since an earlier session asked again): _lookup, then _origin_of.
            entry = serving.entries.get(name)
            return (
                entry is not None and entry[_KEY] == key and origin == (serving.dev, serving.ino, entry[_OFFSET])
                and name not in serving.corrupt
            )  # fmt: skip
        if status.state is _CLOSED:
            self._refuse_closed("holds()")
        return origin is not None and self._origin_of(self._lookup(name, key)) == origin

    def _lookup(self, name: str, key: bytes) -> fmt.Entry | None:
        """The committed (or added this session) entry for ``name`` if its key matches.

        The key bytes themselves are compared, not their digest: the same answer for every file a writer
        made (W6), one ``bytes`` comparison instead of a sha256 per request, and a file whose digest field
        disagrees with its key (which opening does not check) is judged by what the key says."""
        pending = self._writer.pending
        entry = pending.added.get(name) if pending is not None else None
        committed = self.status.committed
        if (
            entry is None and committed is not None and (pending is None or pending.temp_path is None)
            and name not in committed.corrupt
        ):  # fmt: skip
            entry = committed.entries.get(name)
        if entry is None or entry.key != key:
            return None
        return entry

    def _view(self, entry: fmt.Entry) -> np.ndarray[Any, Any]:
        """A read-only array over ``entry``'s bytes in the file mapping.

        Raises:
            Fault: ``map_failed`` when the bytes cannot be mapped; the blocking fault, if any.
        """
        pending = self._writer.pending
        if pending is not None and pending.added.get(entry.name) is entry:
            return entry_array(pending.map.written(entry.offset, entry.nbytes), entry)
        status = self.status
        if status.blocking is not None:
            raise status.blocking
        committed, file = status.committed, status.file
        if committed is None or file is None or entry.offset + entry.nbytes > status.size:
            raise Fault(HeapReason.MAP_FAILED, 0, f"{self.path}: entry {entry.name!r} lies outside the file")
        with faults.translating(HeapReason.MAP_FAILED, "cannot map", self.path):
            window = file.map.committed(entry.offset, entry.nbytes, status.size, committed.header.data_start)
        return entry_array(window, entry)

    def _origin_of(self, entry: fmt.Entry | None) -> Origin | None:
        """(st_dev, st_ino, offset) of the bytes ``entry`` names: the file it lives in now."""
        if entry is None:
            return None
        pending = self._writer.pending
        if pending is not None and pending.added.get(entry.name) is entry:
            return (*pending.identity, entry.offset)
        status = self.status
        file = status.file
        if status.state is not _READY or file is None:
            return None
        return (*file.identity, entry.offset)

    def _checksum_ok(self, entry: fmt.Entry) -> bool:
        """Whether a committed entry's bytes match its checksum; a failing entry is
        remembered as corrupt, so :meth:`_lookup` stops returning it."""
        committed = self.status.committed
        if entry.nbytes == 0 or committed is None or entry.name not in committed.entries:
            return True
        try:
            data = self._view(entry)
        except Fault:  # not the translator: an unmappable pack goes to heap as map_failed anyway, not corrupt
            return True
        if fmt.crc32(data.reshape(-1).view(np.uint8)) == entry.crc32:
            return True
        committed.corrupt.add(entry.name)
        return False

    # ------------------------------------------------------------------ locking (the lock role)

    def take_lock(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the build lock (then :meth:`hold_lock` adopts it); see
        :meth:`BuildLock.take <packcache._store_lock.BuildLock.take>`.

        Raises:
            Fault: ``locked``, ``untrusted``, ``read_only``, ``no_space`` or ``open_failed``.
            StoreStateError: the store is closed, or its build lock is held already.
        """
        self._refuse_closed("take_lock()")
        self._lock.take(timeout, file_open=self.status.file is not None)

    def hold_lock(self, timeout: float) -> None:
        """Adopt the build lock :meth:`take_lock` took (``timeout`` bounds the inode lock taken later).

        Raises:
            StoreStateError: the store is closed, or no build lock was taken.
        """
        self._refuse_closed("hold_lock()")
        self._lock.hold(timeout)

    def release_lock(self) -> None:
        """Release the build lock and the inode lock, if held (always allowed: clean-up must not fail)."""
        self._lock.release()

    @property
    def locked(self) -> bool:
        """Whether this store's session holds the build lock."""
        return self._lock.held

    # ------------------------------------------------------------------ writing (the write role)

    @property
    def bytes_written(self) -> int:
        """Every byte this store wrote to any cache file, cumulative."""
        return self._writer.bytes_written

    @property
    def pending(self) -> bool:
        """True while this session has a write pending (commit or abort it)."""
        return self._writer.pending is not None

    @property
    def pending_names(self) -> tuple[str, ...]:
        """Names of the entries this session stored and has not committed yet."""
        pending = self._writer.pending
        return tuple(pending.added) if pending is not None else ()

    def store(
        self, name: str, key: bytes, digest: bytes, array: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, Any], Origin]:
        """Write ``array`` as entry ``name``; return a read-only view of the written bytes and their origin
        (st_dev, st_ino, offset). The caller holds the build lock. The first store of a session appends
        to the committed file if it is READY and writable (under its inode lock, read again meanwhile),
        else starts a new file; see :meth:`FileWriter.store <packcache._store_write.FileWriter.store>`.

        Raises:
            Fault: ``no_space``/``write_failed``/``open_failed``, ``locked`` (another writer holds the
            file's inode), or ``map_failed`` (written, and committed at the end, but not mapped).
            StoreStateError: no write is pending and the state allows none (:class:`StoreState`).
        """
        pending = self._writer.pending
        if pending is None:
            self._refuse_writing()
            pending = self._start_writing()
        return self._writer.store(pending, name, key, digest, array)

    def _refuse_writing(self) -> None:
        status = self.status
        self._refuse_closed("store()")
        if status.state is StoreState.UNREAD:
            raise StoreStateError(f"store() on {self.path} before its first refresh(): what it holds is not known")
        problem = status.blocking or status.read_only_fault
        if problem is not None:
            kind = "blocked" if problem is status.blocking else "open read-only"
            raise StoreStateError(
                f"store() on {self.path} while it is {kind} ({problem.message}): such misses go to heap"
            )

    def _start_writing(self) -> PendingWrite:
        status = self.status
        if status.state is StoreState.READY and status.file is not None and status.file.writable:
            self._lock.lock_inode(status.file.fd)
            self._reread(status.file)  # another writer (another name of this file) may have committed meanwhile
            status = self.status
        file, committed = status.file, status.committed
        if (
            status.state is StoreState.READY and file is not None and file.writable and committed is not None
            # Generation + 1 would not fit its u64: start a new file.
            and not (committed.slot is not None and committed.slot.generation + 1 >= fmt.MAX_GENERATION)
        ):  # fmt: skip
            return self._writer.append_to(file, committed)
        return self._writer.new_file()

    def commit(self) -> None:
        """Make this session's entries durable (:meth:`FileWriter.commit <packcache._store_write.FileWriter.commit>`);
        the store then serves the new generation.

        Raises:
            Fault: ``no_space``/``write_failed``; the previous generation stays intact.
            StoreStateError: nothing is pending (nothing was stored, or the store is closed).
        """
        if self._writer.pending is None:
            closed = ", which is closed," if self.status.state is StoreState.CLOSED else ""
            raise StoreStateError(f"commit() on the store of {self.path}{closed} with nothing stored to commit")
        self._writer.commit(self.status, self._become)

    def compact_if_superseded(self) -> int:
        """Rewrite the committed file without superseded bytes when they outweigh its live ones; return
        the bytes reclaimed (0: nothing to do). For a session that holds the build lock, after its commit:
        no pattern of builds grows a file without bound (docs/RELIABILITY.md "Bounded growth").

        The copy is :func:`~packcache._generations.rewrite_live`'s (temp file beside the resolved path,
        synced, renamed over it), so processes mapping the old file keep valid pages; the store then
        serves from the new file.

        Raises:
            Fault: ``no_space``/``write_failed`` (or ``open_failed``): the committed file stays as it is.
            StoreStateError: the store is closed.
        """
        self._refuse_closed("compact_if_superseded()")
        status = self.status
        file, committed = status.file, status.committed
        if (
            not self._lock.held or self._writer.pending is not None or status.state is not StoreState.READY
            or file is None or not file.writable or committed is None or committed.slot is None
        ):  # fmt: skip
            return 0
        live, reclaimable = status.figures
        if reclaimable <= live:
            return 0
        try:
            real = resolve_trusted(self.path)  # renamed over below: never through a symlink another user planted
        except OSError:
            return 0
        if not still_linked(file.fd, real):
            return 0  # renamed over by someone else meanwhile: not this file's to replace
        rewritten = self._writer.compact(file.fd, real)
        new = OpenFile(rewritten.fd, file_identity(rewritten.fd), FileMap(rewritten.fd), writable=True)
        self._become(self._loaded(new, rewritten.slot.committed_end, None))
        if rewritten.dropped:
            logger.warning(
                "packcache: compacting %s dropped %d pack(s) failing their checksum (packed again when asked): %s",
                self.path, len(rewritten.dropped), ", ".join(rewritten.dropped[:8]),
            )  # fmt: skip
        return status.size - self.status.size

    def abort(self) -> None:
        """Drop this session's uncommitted entries; a temp file is removed (views of it stay valid).
        Always allowed: clean-up must not fail."""
        self._writer.abort()

    def close(self) -> None:
        """Abort uncommitted work, release the locks and close descriptors: CLOSED, for good. Views stay
        valid. Closing again does nothing."""
        self._writer.abort()
        self._lock.release()
        self._become(StoreStatus(StoreState.CLOSED))
