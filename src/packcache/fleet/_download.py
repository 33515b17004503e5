"""A blob downloaded by concurrent range reads written in place (private: :func:`packcache.fleet.fetch.fetch`'s).

:func:`download_into` splits ``[0, size)`` into parts of ``part_bytes``; up to ``streams`` worker threads
each take the next part and stream it from the store (:meth:`Store.download_range`), writing every
chunk with ``pwrite`` at its offset into the open temp file. Memory is bounded by the chunks in flight
(``streams`` chunks, 256 KiB each from an object store, :data:`~packcache.fleet.stores.CHUNK_BYTES` at most),
never a part or the file. The calling thread hashes: as the parts complete, it reads the written prefix
back (page cache) through sha256, in order, so the hash runs on another core while the download goes on
and ends a moment after it. Hashing after the download would add its whole time (a 400 MB file: 0.27 s of
CPU, ~1.3 s on a loaded 2-core machine); hashing the chunks as they arrive would have to hold the parts
that arrive out of order (memory), and reading back costs one copy from the page cache. Once hashed, a
part's writeback is started (:func:`_start_writeback`), so the caller's fsync finds little left to write.
It also keeps the two bounds of its :class:`~packcache.fleet.stores.StoreClock`, both in store time (a worker's
range read outstanding, not the chunks it writes, nor the hashing once every part is in): no byte for ``stall``
seconds, and the budget left (``remote_timeout``). Every worker is joined before it returns or raises.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import RemoteError
from ._storebase import GRACE, Store, StoreClock

__all__ = ["download_into"]

_HASH_BYTES = 1 << 20  # what the hashing thread reads back at a time
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_SYNC_FILE_RANGE: Any = None  # libc's sync_file_range, found once (False: not available)


def _start_writeback(fd: int, start: int, length: int) -> None:
    """Start writing a hashed part to disk (``sync_file_range``, Linux): the fsync before the rename then finds
    little left to write (measured, 400 MB on ext4: 0.2-0.3 s -> 0.01-0.04 s, the download no slower). Best effort:
    the fsync is what makes the file durable."""
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is None:
        _SYNC_FILE_RANGE = False
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).sync_file_range
            except (OSError, AttributeError):
                pass
            else:
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                function.restype = ctypes.c_int
                _SYNC_FILE_RANGE = function
    if _SYNC_FILE_RANGE:
        _SYNC_FILE_RANGE(fd, start, length, _SYNC_FILE_RANGE_WRITE)


class _Stopped(Exception):
    """Raised in a worker's sink once the download has failed elsewhere: ends its stream at once."""


def download_into(
    store: Store, key: str, fd: int, size: int, *, clock: StoreClock, streams: int, part_bytes: int,
    where: str, write_error: Callable[[OSError], BaseException], tick: Callable[[int], object] | None = None,
) -> str:  # fmt: skip
    """Bytes ``[0, size)`` of ``key`` written at their offsets into ``fd``; returns their sha256 (hex).

    Args:
        clock: the fetch's store time and its bounds (``stall``: no byte for that long; ``total``: the budget).
        where: the blob as messages name it.
        write_error: what a failed ``pwrite`` raises instead (the caller's no-space or write-failed miss).
        tick: told the bytes landed, in order, by the hashing (calling) thread: never by the workers.

    Raises:
        RemoteError: the store's error; ``remote_corrupt`` if it says the object is not ``size`` bytes
            or sends another range or length than asked; ``remote_timeout`` after ``clock.stall`` seconds of
            store time without a byte, or once the clock's budget is spent.
    """
    parts = [(start, min(start + part_bytes, size)) for start in range(0, size, part_bytes)]
    state = threading.Condition()
    done = [False] * len(parts)
    errors: list[BaseException] = []
    stop = threading.Event()
    next_part = [0]
    stall = clock.stall
    progress = [clock.spent()]  # the store time at the last byte
    latest = [time.monotonic()]  # the latest deadline a worker's range read was given

    def fail(exc: BaseException) -> None:
        with state:
            errors.append(exc)
            stop.set()
            state.notify_all()

    def work(own: int) -> None:
        try:
            while not stop.is_set():
                with state:
                    if next_part[0] == len(parts):
                        return
                    index = next_part[0]
                    next_part[0] += 1
                left = clock.left()
                if left <= 0:
                    raise clock.out_of_time()
                # A range read is bounded by the budget left plus one stall bound: the chunks it writes are the
                # machine's time, which the clock does not count; the clock's budget is what ends the download.
                deadline = time.monotonic() + left + stall
                with state:
                    latest[0] = max(latest[0], deadline)
                _fetch_part(store, key, own, parts[index], size, clock, deadline, where, write_error, stop, progress)
                with state:
                    done[index] = True
                    state.notify_all()
        except _Stopped:
            pass
        except BaseException as exc:  # handed to the calling thread, which raises it
            fail(exc)
        finally:
            os.close(own)

    # Each worker writes through its own descriptor of the temp file: one still running when an interrupt cut the
    # join short can never write into whatever file reuses the caller's descriptor number once it is closed.
    owns = [os.dup(fd) for _ in range(max(1, min(streams, len(parts))))]
    workers = [
        threading.Thread(target=work, args=(own,), name=f"packcache-fetch-{i}", daemon=True)
        for i, own in enumerate(owns)
    ]
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_BYTES)
    try:
        for worker in workers:
            worker.start()
        hashed, part = 0, 0
        with memoryview(buffer) as view:
            while part < len(parts):
                with state:
                    # A worker's error is the answer, whatever the clock says meanwhile: checked first.
                    while not errors and not done[part]:
                        spent = clock.spent()
                        if spent >= clock.total:
                            raise clock.out_of_time()
                        if spent - progress[0] >= stall + GRACE:
                            raise RemoteError(
                                "remote_timeout", f"no byte of the download for {stall:g} s of waiting on the store",
                                url=where,
                            )  # fmt: skip
                        state.wait(0.1)
                    if errors:
                        raise errors[0]
                start, end = parts[part]
                while hashed < end:  # the written bytes, read back from the page cache
                    got = os.preadv(fd, [view[: min(_HASH_BYTES, end - hashed)]], hashed)
                    if not got:
                        raise write_error(OSError(errno.EIO, "the temp file is shorter than what was written"))
                    digest.update(view[:got])
                    hashed += got
                    if tick is not None:
                        tick(got)
                _start_writeback(fd, start, end - start)
                part += 1
    finally:
        stop.set()
        # A worker inside a store call ends within that call's own bounds (the stall and the deadline); joined
        # so no thread of this fetch outlives it. pinned by
        #   tests/test_fleet_download.py::test_no_thread_outlives_a_failed_fetch
        for worker, own in zip(workers, owns, strict=True):
            if worker.ident is None:  # never started: its descriptor is still this thread's to close
                os.close(own)
            else:
                worker.join(max(0.0, latest[0] - time.monotonic()) + GRACE)
    return digest.hexdigest()


def _fetch_part(
    store: Store, key: str, fd: int, part: tuple[int, int], size: int, clock: StoreClock, deadline: float,
    where: str, write_error: Callable[[OSError], BaseException], stop: threading.Event, progress: list[float],
) -> None:  # fmt: skip
    start, end = part
    offset = start

    def sink(at: int, chunk: memoryview) -> None:
        nonlocal offset
        if stop.is_set():
            raise _Stopped
        # pinned by tests/test_fleet_download.py::test_a_store_that_sends_a_short_or_wrong_range_is_remote_corrupt
        if at != offset or at + len(chunk) > end:
            raise RemoteError(
                "remote_corrupt", f"bytes [{at}, {at + len(chunk)}) came for the range [{start}, {end})", url=where
            )
        progress[0] = clock.spent()
        view = chunk
        # Writing the chunk is this machine's work, not the store's: the clock stops for it.
        # pinned by tests/test_fleet_deadline.py::test_a_busy_machine_does_not_make_a_directory_store_time_out
        with clock.local():
            try:
                while view:
                    written = os.pwrite(fd, view, offset)
                    view = view[written:]
                    offset += written
            except OSError as exc:
                raise write_error(exc) from None

    with clock.waiting():  # _Stopped propagates: the part is not done
        total = store.download_range(key, start, end, sink, deadline=deadline)
    if total != size:
        raise RemoteError("remote_corrupt", f"the store holds {total} bytes, the manifest says {size}", url=where)
    if offset != end:
        raise RemoteError("remote_corrupt", f"{offset - start} bytes came for the range [{start}, {end})", url=where)
