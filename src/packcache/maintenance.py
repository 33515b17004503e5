"""Operator tools on a cache file: full verification and compaction.

Opening a cache never reads pack data (a warm launch must stay fast), so data
checksums are checked when a pack is stored and on demand, here. Compaction
rewrites the live packs of the newest generation into a new file (temp file,
fsync, rename under the build lock), dropping superseded bytes; processes that
have the old file mapped keep valid pages.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import zlib
from dataclasses import dataclass

from . import format as fmt
from .errors import FormatError
from .paths import acquire_build_lock, create_temp
from .store import entry_crc, pwrite_all, read_committed, read_generation

__all__ = ["CompactReport", "VerifyProblem", "VerifyReport", "compact", "verify"]


@dataclass(frozen=True)
class VerifyProblem:
    """One thing wrong with a file: the entry (``None`` for structure), where, and what."""

    entry: str | None
    offset: int
    message: str

    def __str__(self) -> str:
        what = f"entry {self.entry!r}" if self.entry is not None else "structure"
        return f"{what} at offset {self.offset}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found. ``ok`` when there is no problem."""

    path: str
    generation: int
    entries: int
    checked_bytes: int
    problems: tuple[VerifyProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str | os.PathLike[str]) -> VerifyReport:
    """Check a cache file's structure and every pack's checksum.

    Reads the whole file. Structure problems (docs/FORMAT.md rules) are
    reported with ``entry=None``; a pack whose bytes do not match its checksum
    is reported by name and offset, in file order.

    Raises:
        OSError: the file cannot be opened or read.

    >>> import numpy as np, tempfile, os, packcache
    >>> p = os.path.join(tempfile.mkdtemp(), "m.pcache")
    >>> with packcache.WeightCache(p) as c, c.session() as s:
    ...     _ = s.get_or_pack("w", lambda: np.arange(4.0))
    >>> verify(p).ok
    True
    """
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            _, slot, entries = read_committed(fd, path=name)
        except FormatError as exc:
            return VerifyReport(name, 0, 0, 0, (VerifyProblem(None, exc.offset or 0, str(exc)),))
        problems = _newer_generations_broken(fd, name, slot)
        checked = 0
        ordered = sorted(entries.values(), key=lambda e: e.offset)
        if any(e.nbytes for e in ordered):
            region = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            try:
                for entry in ordered:
                    actual = entry_crc(region, entry) if entry.nbytes else 0
                    checked += entry.nbytes
                    if entry.nbytes and actual != entry.crc32:
                        problems.append(
                            VerifyProblem(
                                entry.name,
                                entry.offset,
                                f"checksum {actual:08x} != stored {entry.crc32:08x} over {entry.nbytes} bytes",
                            )
                        )
            finally:
                region.close()
        return VerifyReport(name, slot.generation if slot else 0, len(entries), checked, tuple(problems))
    finally:
        os.close(fd)


def _newer_generations_broken(fd: int, name: str, used: fmt.Slot | None) -> list[VerifyProblem]:
    """Readers silently fall back past a broken newest generation; verification says so."""
    head = os.pread(fd, fmt.HEADER_READ_SIZE, 0)
    header = fmt.decode_header(head, path=name)
    problems = []
    for slot in fmt.choose_slot(head)[0]:
        if used is not None and slot.generation <= used.generation:
            break
        try:
            read_generation(fd, _only_slot(head, slot), header, os.fstat(fd).st_size, path=name)
        except FormatError as exc:
            problems.append(
                VerifyProblem(None, exc.offset or slot.index_offset, f"generation {slot.generation} unusable: {exc}")
            )
    return problems


def _only_slot(head: bytes, slot: fmt.Slot) -> bytes:
    """The header with only ``slot`` left in place, to validate one generation alone."""
    region = bytearray(head)
    other = fmt.slot_offset(1 - slot.generation % 2)
    region[other : other + fmt.SLOT.size] = bytes(fmt.SLOT.size)
    return bytes(region)


@dataclass(frozen=True)
class CompactReport:
    """What :func:`compact` did: sizes before and after, packs kept and dropped."""

    path: str
    bytes_before: int
    bytes_after: int
    entries: int
    dropped: tuple[str, ...]  # packs whose bytes failed their checksum (they will be packed again)

    @property
    def reclaimed_bytes(self) -> int:
        return self.bytes_before - self.bytes_after


def compact(path: str | os.PathLike[str], *, lock_timeout: float = 30.0) -> CompactReport:
    """Rewrite a cache file without superseded bytes.

    Takes the build lock (waiting up to ``lock_timeout`` seconds), copies the
    newest generation's packs into a new file with the same alignment,
    platform fingerprint and permission bits, verifying each pack's checksum
    on the way (a pack that fails is dropped, not copied), then renames it over
    the path. Safe while other processes map the old file: their pages stay valid.

    Raises:
        FormatError: the file is not a valid cache (nothing is written).
        OSError: on I/O failure; the original file is left untouched.
        TimeoutError: another process held the build lock too long.
    """
    name = os.fspath(path)
    lock_fd = acquire_build_lock(name, lock_timeout, 0o600)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _compact_locked(name, fd)
        finally:
            os.close(fd)
    finally:
        os.close(lock_fd)


def _compact_locked(name: str, fd: int) -> CompactReport:
    header, slot, entries = read_committed(fd, path=name)
    st = os.fstat(fd)
    ordered = sorted(entries.values(), key=lambda e: e.offset)
    region = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if any(e.nbytes for e in ordered) else None
    temp_fd, temp = create_temp(name, stat.S_IMODE(st.st_mode))
    try:
        head = fmt.encode_header(header.alignment, header.platform)
        pwrite_all(temp_fd, head, 0)
        at = header.data_start
        kept: list[fmt.Entry] = []
        dropped: list[str] = []
        for entry in ordered:
            if region is not None and entry.nbytes and entry_crc(region, entry) != entry.crc32:
                dropped.append(entry.name)
                continue
            at = fmt.align_up(at, header.alignment)
            if region is not None and entry.nbytes:
                with memoryview(region)[entry.offset : entry.offset + entry.nbytes] as data:
                    pwrite_all(temp_fd, data, at)
            kept.append(entry._replace(offset=at))
            at += entry.nbytes
        index_at = fmt.align_up(at, header.alignment)
        index = fmt.encode_index(kept)
        pwrite_all(temp_fd, index, index_at)
        os.fdatasync(temp_fd)
        generation = (slot.generation if slot else 0) + 1
        new_slot = fmt.Slot(generation, index_at, len(index), len(kept), zlib.crc32(index) & 0xFFFFFFFF)
        pwrite_all(temp_fd, fmt.encode_slot(new_slot), fmt.slot_offset(generation % 2))
        os.fsync(temp_fd)
        os.rename(temp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    finally:
        os.close(temp_fd)
        if region is not None:
            region.close()
    dir_fd = os.open(os.path.dirname(os.path.abspath(name)), os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    # The layout above is the one compacted_size() describes; inspect relies on that.
    assert new_slot.committed_end == fmt.compacted_size(kept, header)
    return CompactReport(name, st.st_size, new_slot.committed_end, len(kept), tuple(dropped))
