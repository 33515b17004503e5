"""Committed generations of a cache file: read them, write them, rewrite the live ones into a new file.

The functions every writer and reader of a cache file shares below :class:`packcache._store.FileStore`:
the one commit sequence (:func:`write_generation`, docs/FORMAT.md W3), the one way to read the newest
valid generation (:func:`read_generation`), and the one compaction copy (:func:`rewrite_live`), used by
:func:`packcache.compact` and by a build that finds superseded bytes outweighing live ones. Pack bytes
are read with ``pread``, never through a mapping: a file truncated by someone else is a
:class:`~packcache.errors.FormatError`, not a SIGBUS.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from ._paths import TrustedParent, open_trusted_parent
from ._sidefiles import create_temp
from .errors import FormatError, UntrustedFileError

__all__ = [
    "Rewritten",
    "chunk_buffer",
    "keep_owner",
    "pwrite_all",
    "read_chunks",
    "read_committed",
    "read_generation",
    "rewrite_live",
    "write_generation",
]


def pwrite_all(fd: int, data: Any, offset: int) -> int:
    """``pwrite`` all of ``data`` at ``offset`` (a short write is continued); return the byte count."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


_CHUNK = 8 << 20  # pack bytes are read (and copied) in slices of this size


def read_chunks(fd: int, offset: int, nbytes: int, buffer: bytearray, path: str) -> Iterator[memoryview]:
    """The ``nbytes`` at ``offset``, read with ``pread`` into ``buffer`` one slice at a time
    (never through a mapping: a file truncated by someone else is an error, not a SIGBUS).

    Raises:
        FormatError: the file ends first (someone truncated it after its index was read).
    """
    done = 0
    with memoryview(buffer) as whole:
        while done < nbytes:
            got = os.preadv(fd, [whole[: min(len(whole), nbytes - done)]], offset + done)
            if got == 0:
                raise FormatError(
                    f"the file ends inside the {nbytes}-byte pack at offset {offset} (truncated?)",
                    path=path, offset=offset + done,
                )  # fmt: skip
            with whole[:got] as chunk:
                yield chunk
            done += got


def chunk_buffer(entries: list[fmt.Entry]) -> bytearray:
    """A buffer for :func:`read_chunks` over ``entries``: the largest pack, at most 8 MiB."""
    return bytearray(max(1, min(_CHUNK, max((e.nbytes for e in entries), default=0))))


def keep_owner(fd: int, original: os.stat_result, what: str) -> None:
    """Give ``fd`` the owner and group of ``original`` (a new file is created as the caller).

    Raises:
        PermissionError: not allowed (not root, or not a member of the group).
    """
    own = os.fstat(fd)
    uid = original.st_uid if own.st_uid != original.st_uid else -1
    gid = original.st_gid if own.st_gid != original.st_gid else -1
    if uid == -1 and gid == -1:
        return
    try:
        os.fchown(fd, uid, gid)
    except PermissionError as exc:
        raise PermissionError(
            exc.errno,
            f"cannot give {what} the owner {original.st_uid}:{original.st_gid} of the cache file ({exc.strerror}); "
            "run compact as the file's owner",
        ) from None


@dataclass(frozen=True)
class Rewritten:
    """A file :func:`rewrite_live` made and renamed over the old one: its open descriptor (the caller's to
    close or keep), its committed slot, the packs kept and those dropped for failing their checksum."""

    fd: int
    slot: fmt.Slot
    kept: tuple[fmt.Entry, ...]
    dropped: tuple[str, ...]


def rewrite_live(
    fd: int,
    st: os.stat_result,
    real: str,
    *,
    path: str,
    atime_ns: int,
    pwrite: Callable[[int, Any, int], int] | None = None,
) -> Rewritten:
    """Copy the newest generation's packs of the open cache file ``fd`` (status ``st``) into a new file
    beside ``real`` (its resolved path) and rename it over ``real``: compaction, for
    :func:`packcache.compact` and for a build that finds superseded bytes outweighing live ones.
    The caller holds the build lock.

    The copy has the original's alignment, platform fingerprint, permission bits, owner and group,
    and the access time ``atime_ns`` (``gc``'s record of use). Each pack's checksum is verified on the
    way; one that fails is dropped, not copied. The new generation continues the old number (it is
    another inode, so readers never compare the two), from 1 again at the last usable one (R45).
    Safe while other processes map the old file: their pages stay valid. If anything fails (ENOSPC,
    EPERM, Ctrl-C), the original is untouched and the temp file removed.

    Raises:
        FormatError: the file is not a valid cache. OSError: on I/O failure, or when the copy cannot
            be given the original's owner and group.
    """
    pwrite = pwrite or pwrite_all  # looked up now: a test may stand in for it
    header, slot, entries = read_committed(fd, path=path)
    ordered = sorted(entries.values(), key=lambda e: e.offset)
    previous = slot.generation if slot else 0
    # pinned by tests/test_generations.py::test_compact_at_the_last_usable_generation_restarts_the_generation
    generation = previous + 1 if previous + 1 < fmt.MAX_GENERATION else 1
    mode = stat.S_IMODE(st.st_mode)
    # Made and renamed within the directory held open from a walk of ``real`` (no directory renamed on the
    # way meanwhile can send the rename elsewhere), over the entry that still is this file; pinned by
    #   tests/test_paths.py::test_a_directory_swapped_for_a_symlink_during_the_walk_is_never_written_through
    parent = open_trusted_parent(real)
    try:
        here = os.stat(parent.name, dir_fd=parent.fd, follow_symlinks=False)
        if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            raise UntrustedFileError(real, "it was replaced while being compacted")
        temp_fd, temp = create_temp(real, mode, dir_fd=parent.fd)
    except BaseException:
        parent.close()
        raise
    try:
        return _rewrite_into(fd, temp_fd, temp, parent, st, header, ordered, generation, path, atime_ns, pwrite)
    finally:
        parent.close()


def _rewrite_into(
    fd: int, temp_fd: int, temp: str, parent: TrustedParent, st: os.stat_result, header: fmt.Header,
    ordered: list[fmt.Entry], generation: int, path: str, atime_ns: int,
    pwrite: Callable[[int, Any, int], int],
) -> Rewritten:  # fmt: skip
    """:func:`rewrite_live`'s copy into the temp file ``temp_fd`` made in ``parent``, renamed over its file there."""
    mode = stat.S_IMODE(st.st_mode)
    try:
        # pinned by tests/test_generations.py::test_compact_as_root_keeps_the_group_a_service_reads_through,
        # ::test_compact_that_cannot_keep_the_owner_leaves_the_original_and_no_temp
        keep_owner(temp_fd, st, "the compacted copy")
        os.fchmod(temp_fd, mode)  # chown clears set-id bits: the mode must come out exactly as it was
        pwrite(temp_fd, fmt.encode_header(header.alignment, header.platform), 0)
        at = header.data_start
        kept: list[fmt.Entry] = []
        dropped: list[str] = []
        buffer = chunk_buffer(ordered)
        for entry in ordered:
            at = fmt.align_up(at, header.alignment)
            crc = done = 0
            for chunk in read_chunks(fd, entry.offset, entry.nbytes, buffer, path):
                crc = fmt.crc32(chunk, crc)
                done += pwrite(temp_fd, chunk, at + done)
            if entry.nbytes and crc != entry.crc32:
                # Cut the copy off again: gaps must stay zero (W1). Truncating is safe here
                # and only here: the temp file is unpublished, nobody maps it.
                os.ftruncate(temp_fd, at)
                dropped.append(entry.name)
                continue
            kept.append(entry._replace(offset=at))
            at += entry.nbytes
        os.utime(temp_fd, ns=(atime_ns, time.time_ns()))
        new_slot = write_generation(temp_fd, kept, fmt.align_up(at, header.alignment), generation, pwrite=pwrite)
        parent.rename_over(temp)
    except BaseException:
        os.close(temp_fd)
        parent.unlink_quietly(temp)
        raise
    try:
        os.fsync(parent.fd)
    except BaseException:
        os.close(temp_fd)
        raise
    # The layout above is the one compacted_size() describes; inspect and the store rely on that.
    assert new_slot.committed_end == fmt.compacted_size(kept, header)
    return Rewritten(temp_fd, new_slot, tuple(kept), tuple(dropped))


def write_generation(
    fd: int,
    live: list[fmt.Entry],
    index_at: int,
    generation: int,
    *,
    pwrite: Callable[[int, Any, int], int] = pwrite_all,
) -> fmt.Slot:
    """Commit generation ``generation`` of an open file whose packs are written: the one commit
    sequence of every writer (a session's commit, and :func:`packcache.compact`'s copy).

    Order (docs/FORMAT.md W3): reserve and write the index after the data, ``fdatasync``,
    then write the commit slot that names it (the older of the two, ``generation % 2``) and
    ``fdatasync`` again. A crash before the second sync leaves the previous generation as the
    newest valid one; readers never see an index whose bytes are not on disk. A new file is then
    renamed over its path by the caller (and its directory synced).

    Returns:
        The slot written. Raises OSError (ENOSPC at the reservation, EIO at a sync, ...).
    """
    index = fmt.encode_index(live)
    slot = fmt.Slot(generation, index_at, len(index), len(live), fmt.crc32(index))
    os.posix_fallocate(fd, index_at, len(index))
    pwrite(fd, index, index_at)
    os.fdatasync(fd)
    pwrite(fd, fmt.encode_slot(slot), fmt.slot_offset(generation % 2))
    os.fdatasync(fd)
    return slot


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
