"""Read-only shared mappings of a cache file: few, reused, and O(1) in the number of packs.

A :class:`FileMap` serves every pack of one open file from a handful of
:class:`Window` mappings. A window may reach past the end of the file: a
builder maps the room its next packs will need once, and each pack written
there is served from that window, instead of one ``mmap`` per pack.

Python's ``mmap`` module cannot do that (it refuses a length past the end of
the file), and on Python < 3.13 it duplicates the descriptor for every map
(1,100 packs under ``ulimit -n 1024`` exhaust descriptors). So windows are made
with libc's ``mmap`` through ctypes: ``PROT_READ``, ``MAP_SHARED``, no
descriptor kept. Pages past the end of the file are never touched (only
written bytes are ever viewed), and an unused tail is unmapped when the
builder commits (:meth:`FileMap.trim`), so a built file is mapped once, at its size.

Lifetime: every array handed out keeps its window alive (array -> read-only
memoryview -> the window's ctypes buffer); the window is unmapped when the
last of them is collected, never while a view exists.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import Any

import numpy as np

__all__ = ["FileMap", "Window"]

PAGE = mmap.ALLOCATIONGRANULARITY

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

#: A builder's window reaches this far past the pack that needed it (doubling from the first
#: pack's size), so a build of N packs makes O(log N) windows at most, not N.
MIN_REACH = 1 << 20
MAX_REACH = 1 << 30


def page_floor(offset: int) -> int:
    """``offset`` rounded down to a page (mappings start on pages).

    >>> page_floor(4097) == PAGE or PAGE > 4096
    True
    """
    return offset - offset % PAGE


def page_ceil(offset: int) -> int:
    """``offset`` rounded up to a page."""
    return -(-offset // PAGE) * PAGE


def _unmap(address: int, length: int) -> None:
    _munmap(address, length)


class Window:
    """One read-only shared mapping of bytes ``[start, end)`` of a file (``end`` may lie past EOF).

    Raises:
        OSError: ``mmap`` failed (ENOMEM under ``RLIMIT_AS``, ENODEV, ...).
    """

    __slots__ = ("__weakref__", "_finalizer", "address", "buffer", "end", "start")

    def __init__(self, fd: int, start: int, length: int) -> None:
        if start % PAGE or length <= 0:
            raise ValueError(f"a window starts on a page and is not empty: start={start}, length={length}")
        address = _mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.address = int(address)
        self.start = start
        self.end = start + length
        pages: Any = type("_Pages", (ctypes.Array,), {"_type_": ctypes.c_ubyte, "_length_": length})
        raw = pages.from_address(self.address)
        # Unmap when the buffer (which every view references) is collected; at interpreter exit the
        # kernel reclaims it, and unmapping under arrays still alive then could crash late finalizers.
        self._finalizer = weakref.finalize(raw, _unmap, self.address, length)
        self._finalizer.atexit = False
        self.buffer = memoryview(raw).toreadonly()

    def covers(self, offset: int, end: int) -> bool:
        return self.start <= offset and end <= self.end

    def array(self, offset: int, nbytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        """A read-only array over ``nbytes`` at file offset ``offset`` (inside this window)."""
        flat = np.frombuffer(self.buffer, dtype, nbytes // dtype.itemsize, offset - self.start)
        return flat if len(shape) == 1 else flat.reshape(shape)

    def trim(self, used_end: int) -> None:
        """Unmap the pages past ``used_end`` (never viewed): the mapping ends at the data."""
        keep = page_ceil(max(used_end, self.start + 1)) - self.start
        length = self.end - self.start
        if keep >= length:
            return
        if _munmap(self.address + keep, length - keep) != 0:
            return  # e.g. ENOMEM splitting a mapping past vm.max_map_count: keep it whole
        self._finalizer.detach()
        owner = self.buffer.obj
        self._finalizer = weakref.finalize(owner, _unmap, self.address, keep)
        self._finalizer.atexit = False
        self.end = self.start + keep


class FileMap:
    """The windows of one open file, reused for every pack in them (a few per file, never one per pack).

    Args:
        fd: the file's descriptor (only used to make windows; they do not keep it open).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.windows: list[Window] = []
        self._reach = 0  # how far the next builder window reaches past its pack

    def _find(self, offset: int, end: int) -> Window | None:
        for window in reversed(self.windows):  # the newest first: packs are mostly asked in file order
            if window.covers(offset, end):
                return window
        return None

    def _add(self, start: int, end: int, reach_end: int) -> Window:
        start = page_floor(start)
        try:
            window = Window(self.fd, start, max(end, reach_end) - start)
        except OSError:
            if reach_end <= end:
                raise
            window = Window(self.fd, start, end - start)  # no room for the reach (RLIMIT_AS): the pack alone
        self.windows.append(window)
        return window

    def committed(self, offset: int, nbytes: int, file_size: int, data_start: int) -> Window:
        """The window holding committed bytes ``[offset, offset + nbytes)``.

        A new window starts where the windows below ``offset`` end (or at the data
        start) and reaches the end of the file, so it closes every gap above it:
        asked in any order, a file gets at most one more window than it had gaps.

        Raises:
            OSError: mapping failed.
        """
        end = offset + nbytes
        window = self._find(offset, end)
        if window is not None:
            return window
        start = max([data_start, *(w.end for w in self.windows if w.end <= offset)])
        return self._add(start, end, file_size)

    def written(self, offset: int, nbytes: int) -> Window:
        """The window for bytes a builder just wrote at ``offset``. A new one reaches past them,
        twice as far as the last one did, so the next packs land in it: a build makes
        O(log(bytes)) windows.

        Raises:
            OSError: mapping failed.
        """
        end = offset + nbytes
        window = self._find(offset, end)
        if window is not None:
            return window
        if self.windows and self.windows[-1].end > offset:
            self.windows[-1].trim(offset)  # the pack did not fit its reach: give back the rest
        # doubling, or a build maps once per pack (1,100 mappings for 1,100 packs); pinned by
        #   tests/test_mapping.py::test_a_cold_build_of_1100_packs_needs_no_descriptor_per_pack_and_maps_the_file_once
        self._reach = min(MAX_REACH, max(MIN_REACH, 2 * self._reach, nbytes))
        return self._add(offset, end, end + self._reach)

    def trim(self, used_end: int) -> None:
        """Unmap every window's pages past ``used_end``: what a commit leaves mapped is the file's data."""
        # the file ends up mapped once, at its size; pinned by
        #   tests/test_mapping.py::test_a_cold_build_of_1100_packs_needs_no_descriptor_per_pack_and_maps_the_file_once
        for window in self.windows:
            if window.end > used_end:
                window.trim(used_end)
