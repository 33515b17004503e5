"""The write role of a cache file's store: append packs, commit them as a generation, or abort; compact.

:class:`FileWriter` does the writing a :class:`~packcache._store.FileStore` decides on. Its phases are
one value, :attr:`FileWriter.pending`: ``None`` (idle) or the :class:`PendingWrite` of this session
(writing), made by :meth:`~FileWriter.append_to` (in place, after the committed end) or
:meth:`~FileWriter.new_file` (a temp file renamed over the path at the commit), ended by
:meth:`~FileWriter.commit` or :meth:`~FileWriter.abort`.

Rules from the design that shape the code:

* A committed byte is never overwritten and the file is never truncated:
  another process may have it mapped, and shrinking a mapped file is SIGBUS.
* A new or rebuilt file is written as a temp file, synced, then renamed over
  the (resolved) path, so a failed build never destroys the previous file.
* Space is reserved with ``posix_fallocate`` before writing, so a full disk
  is an errno at a known point, never a SIGBUS through a mapping.
"""

from __future__ import annotations

import errno as errno_mod
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _faults as faults
from . import format as fmt
from ._faults import Fault
from ._generations import Rewritten, pwrite_all, rewrite_live, write_generation
from ._mapping import FileMap, Window
from ._paths import TrustedParent, open_trusted_parent
from ._sidefiles import close_if_same, create_temp, file_identity
from ._store_lock import ensure_dir
from ._store_state import Committed, OpenFile, StoreState, StoreStatus
from .errors import FormatError
from .stats import HeapReason

__all__ = ["DTYPES", "FileWriter", "Origin", "PendingWrite", "entry_array"]

Origin = tuple[int, int, int]  # (st_dev, st_ino, offset) of a pack's bytes: the file they live in now

DTYPES = {code: np.dtype(fmt.numpy_dtype_str(code)) for code in fmt.DTYPE_CODES}  # one object per code


def entry_array(window: Window, entry: fmt.Entry) -> np.ndarray[Any, Any]:
    """A read-only array over ``entry``'s bytes in ``window`` (an empty pack needs no bytes at all)."""
    dtype = DTYPES[entry.dtype]
    if entry.nbytes == 0:
        empty = np.empty(entry.shape, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return window.array(entry.offset, entry.nbytes, dtype, entry.shape)


def _create_reason(err: int | None) -> HeapReason:
    return HeapReason.NO_SPACE if err in faults.NO_SPACE_ERRNOS else HeapReason.OPEN_FAILED


@dataclass
class PendingWrite:
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
    parent: TrustedParent | None = None  # a new file's directory, held from the walk (no EMFILE at the rename)
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
        if self.parent is not None:
            close_if_same(self.parent.fd, self.dir_identity)
            self.parent = None
        if self.temp_path is not None:
            close_if_same(self.fd, self.identity)


class FileWriter:
    """The write role of one cache path (module docstring). Not thread-safe: the session serialises calls."""

    def __init__(self, path: str, *, alignment: int, platform: bytes, file_mode: int, dir_mode: int) -> None:
        self.path = path
        self.alignment = alignment
        self.platform = platform
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.pending: PendingWrite | None = None
        self.bytes_written = 0  # every byte written to any cache file, cumulative

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        """:func:`~packcache._generations.pwrite_all`, counted in :attr:`bytes_written`."""
        done = pwrite_all(fd, data, offset)
        self.bytes_written += done
        return done

    def _target(self, pending: PendingWrite) -> str:
        return self.path if pending.temp_path is None else f"{self.path} (new file {pending.temp_path})"

    def append_to(self, file: OpenFile, committed: Committed) -> PendingWrite:
        """Start writing after the committed end of the open file (the caller holds its inode lock)."""
        slot, header = committed.slot, committed.header
        # Past the end of the file, not just past the commit: bytes of a failed
        # commit may still be served by the process that wrote them.
        append_at = max(slot.committed_end if slot else header.data_start, os.fstat(file.fd).st_size)
        self.pending = PendingWrite(
            fd=file.fd, temp_path=None, target=self.path, header=header, base=dict(committed.entries),
            added={}, append_at=append_at, generation=(slot.generation if slot else 0) + 1,
            map=file.map, identity=file.identity,
        )  # fmt: skip
        return self.pending

    def new_file(self) -> PendingWrite:
        """Start a new file: a temp file beside the resolved path, holding the header so far.

        Raises:
            Fault: ``no_space``/``open_failed`` (cannot create it), ``write_failed``/``no_space``
            (cannot write its header); nothing is left behind.
        """
        header_bytes = fmt.encode_header(self.alignment, self.platform)
        header = fmt.decode_header(header_bytes)
        with faults.translating(_create_reason, "cannot create a new cache file for", self.path):
            ensure_dir(self.path, self.dir_mode)
            # A rebuild replaces the file the path resolves to (a symlinked path keeps its symlink), never through a
            # symlink another user planted (an UntrustedFileError: ``untrusted``); pinned by
            #   tests/test_paths.py::test_a_symlink_nobody_plants_in_a_sticky_directory_is_untrusted_and_its_target_kept
            # The directory is held open from the walk on: the temp file is made and renamed in it, so no
            # directory renamed on the way meanwhile can send the rename elsewhere; pinned by
            #   tests/test_paths.py::test_a_directory_swapped_for_a_symlink_during_the_walk_is_never_written_through
            parent = open_trusted_parent(self.path)
            try:
                fd, temp = create_temp(parent.real, self.file_mode, dir_fd=parent.fd)
            except BaseException:
                parent.close()
                raise
        try:  # not the translator alone: a failure must close and remove the temp file, and the directory
            with faults.translating(faults.write_reason, "cannot write to", f"{self.path} (new file {temp})"):
                os.posix_fallocate(fd, 0, header.data_start + fmt.index_size([]))
                self.pwrite(fd, header_bytes, 0)
                st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            parent.unlink_quietly(temp)
            parent.close()
            raise
        self.pending = PendingWrite(
            fd=fd, temp_path=temp, target=parent.real, header=header, base={}, added={},
            append_at=header.data_start, generation=1, map=FileMap(fd), identity=(st.st_dev, st.st_ino), parent=parent,
            dir_identity=file_identity(parent.fd),
        )  # fmt: skip
        return self.pending

    def store(
        self, pending: PendingWrite, name: str, key: bytes, digest: bytes, array: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, Any], Origin]:
        """Write ``array`` as entry ``name`` of ``pending``; return a read-only view of the written bytes
        and their origin. Space for the data and for the index that will describe it is reserved first,
        so the final commit cannot run out of space.

        Raises:
            Fault: ``no_space``/``write_failed`` (nothing added; ``no_space`` with EFBIG also when the
            index would exceed the format's caps), or ``map_failed`` (the entry was written and will
            be committed, but cannot be mapped).
        """
        offset = fmt.align_up(pending.append_at, pending.header.alignment)
        data = array.reshape(-1).view(np.uint8)
        entry = fmt.Entry(
            name=name, key=key, digest=digest, dtype=array.dtype.str[1:], shape=tuple(int(d) for d in array.shape),
            offset=offset, nbytes=int(array.nbytes), crc32=0,
        )  # fmt: skip
        index_size = pending.index_size_with(entry)
        count = len(pending.merged) + (name not in pending.merged)
        # pinned by tests/test_store.py::test_the_writer_never_commits_an_index_the_readers_refuse,
        # ::test_the_writer_never_commits_more_entries_than_the_readers_accept
        if index_size > fmt.MAX_INDEX_BYTES or count > fmt.MAX_ENTRIES:
            # Readers reject an index over the caps (R17, R18, R26): a file they would refuse must never be written.
            raise Fault(
                HeapReason.NO_SPACE, errno_mod.EFBIG,
                f"cannot store {name!r} in {self._target(pending)}: the index would hold {count} entries in "
                f"{index_size} bytes, over the format's caps ({fmt.MAX_ENTRIES} entries, {fmt.MAX_INDEX_BYTES} "
                "bytes); compact the file or use another cache file",
            )  # fmt: skip
        data_end = offset + entry.nbytes
        index_at = fmt.align_up(data_end, pending.header.alignment)
        with faults.translating(faults.write_reason, "cannot write to", self._target(pending)):
            os.posix_fallocate(pending.fd, offset, index_at - offset + index_size)
            self.pwrite(pending.fd, data, offset)
        entry = entry._replace(crc32=fmt.crc32(data))
        pending.add(entry)
        pending.append_at = data_end
        with faults.translating(HeapReason.MAP_FAILED, "cannot map", self.path):
            view = entry_array(pending.map.written(entry.offset, entry.nbytes), entry)
        return view, (*pending.identity, entry.offset)

    def commit(self, status: StoreStatus, become: Callable[[StoreStatus], None]) -> None:
        """Make the pending entries durable, then hand ``become`` (the store's) the status that serves them:
        READY, in the file appended to (``status``'s) or in the new one.

        Order: index after the data, fdatasync, then the older commit slot, fdatasync;
        a new file is then renamed over the path and its directory synced. A write that added
        nothing is aborted instead: a new generation (or an empty rebuilt file) must not replace
        the old one.

        Raises:
            Fault: ``no_space``/``write_failed``; the previous generation stays intact (or, when only
            the directory sync failed, the new file is in place and adopted all the same).
        """
        pending = self.pending
        assert pending is not None, "commit() with nothing pending: the store checks first"
        if not pending.added:
            self.abort()
            return
        live = pending.live()
        index_at = fmt.align_up(pending.append_at, pending.header.alignment)
        try:  # not the translator alone: whatever stops the commit (an interrupt too) aborts it
            with faults.translating(faults.write_reason, "cannot commit", self._target(pending)):
                slot = write_generation(pending.fd, live, index_at, pending.generation, pwrite=self.pwrite)
                if pending.temp_path is not None:  # within the directory held since the walk (new_file)
                    assert pending.parent is not None
                    pending.parent.rename_over(pending.temp_path)
        except BaseException:
            self.abort()  # the previous generation stays, a temp file goes
            raise
        if pending.temp_path is None:
            self._adopted(pending, slot, live, status, become)
            return
        try:
            with faults.translating(HeapReason.WRITE_FAILED, "cannot sync the directory of", self.path):
                assert pending.parent is not None
                os.fsync(pending.parent.fd)
        finally:  # the new file is in place and its data synced; only the rename's durability may be in doubt
            self._adopted(pending, slot, live, status, become)

    def _adopted(
        self, pending: PendingWrite, slot: fmt.Slot, live: list[fmt.Entry], status: StoreStatus,
        become: Callable[[StoreStatus], None],
    ) -> None:  # fmt: skip
        self.pending = None
        if pending.parent is not None:
            close_if_same(pending.parent.fd, pending.dir_identity)
            pending.parent = None
        entries = {e.name: e for e in live}
        size = max(os.fstat(pending.fd).st_size, slot.committed_end)
        if pending.temp_path is None:  # appended in place: the same file, and what was learned of its bytes
            assert status.file is not None and status.file.fd == pending.fd
            corrupt = status.committed.corrupt if status.committed is not None else set()
            committed, file = Committed(pending.header, slot, entries, corrupt), status.file
        else:
            committed = Committed(pending.header, slot, entries)
            file = OpenFile(pending.fd, pending.identity, pending.map, writable=True)
        become(StoreStatus(StoreState.READY, file=file, size=size, committed=committed))
        pending.map.trim(pending.append_at)  # the builder's spare reach is never viewed: unmap it

    def abort(self) -> None:
        """Drop the pending entries; a temp file is removed (views of it stay valid)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.map.trim(pending.append_at)
            if pending.temp_path is not None and pending.parent is not None:  # whatever its path names now
                pending.parent.unlink_quietly(pending.temp_path)
            pending.close()

    def compact(self, fd: int, real: str) -> Rewritten:
        """Copy the live packs of the committed file open as ``fd`` into a new file renamed over ``real``
        (:func:`~packcache._generations.rewrite_live`: the one compaction copy). The caller holds the build lock.

        Raises:
            Fault: ``no_space``/``write_failed``: the committed file stays as it is.
        """
        try:
            with faults.translating(faults.write_reason, "cannot compact", self.path):
                return rewrite_live(fd, os.fstat(fd), real, path=self.path, atime_ns=time.time_ns(), pwrite=self.pwrite)
        except FormatError as exc:  # not an OSError: the file this session just committed no longer reads back
            raise Fault(HeapReason.WRITE_FAILED, 0, f"cannot compact {self.path}: {exc}") from None
