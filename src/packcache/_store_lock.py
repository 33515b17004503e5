"""The lock role of a cache file's store: the build lock, and the ``flock`` on the inode appended to.

One lock protocol, tied to the file rather than to the spelling of its path: the sidecar build lock
beside the path (:func:`packcache._sidefiles.acquire_build_lock`), and, for appends in place, an ``flock``
on the file's own inode (a hardlink, or a lock file a cleaner deleted, must not let two writers append
at once). :class:`BuildLock` holds both; the store owns one and asks it.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import os
import time

from . import _faults as faults
from ._faults import Fault
from ._paths import make_dirs, resolve_trusted
from ._sidefiles import acquire_build_lock, close_if_same, file_identity, remove_orphans, wait_for_flock
from ._store_state import StoreStateError
from .stats import HeapReason

__all__ = ["BuildLock", "ensure_dir"]

_Held = tuple[int, tuple[int, int]]  # a lock descriptor and the (st_dev, st_ino) it was opened on


def ensure_dir(path: str, dir_mode: int) -> None:
    """Create the missing directories of ``path`` (a cache file, its lock file beside it), each with
    exactly ``dir_mode``: the umask must not widen or narrow it.

    Raises:
        UntrustedFileError: ``path`` is reached through a symlink another user may have planted (nothing is made
            where it points).
        OSError: a directory cannot be made.
    """
    # The directories of the path as given (``mkdir -p``), never beyond a symlink to a missing place: a dangling
    # link at the cache path is ``open_failed`` (ENOENT), as before; never through a symlink another user planted.
    # pinned by tests/test_paths.py::test_a_symlink_nobody_plants_in_a_sticky_directory_is_untrusted_and_its_target_kept
    # and tests/test_torch.py::test_the_loaders_take_any_kind_of_file_at_a_cache_file_path
    make_dirs(os.path.dirname(os.path.abspath(path)), dir_mode)


def _lock_reason_with_file(err: int | None) -> HeapReason:
    # No inode or no quota left for the lock file; else, beside a file we could open, a refusal means read-only.
    return HeapReason.NO_SPACE if err in faults.NO_SPACE_ERRNOS else faults.open_failed_reason(err)


def _lock_reason_without_file(err: int | None) -> HeapReason:
    return HeapReason.NO_SPACE if err in faults.NO_SPACE_ERRNOS else HeapReason.OPEN_FAILED


class BuildLock:
    """The build lock of one cache path and the inode lock of the file being appended to.

    States: free, then *taken* (:meth:`take`: the ``flock`` is ours, no session has adopted it), then
    *held* (:meth:`hold`: the session builds under it), then free again (:meth:`release`, which also
    drops the inode lock). ``take`` while held and ``hold`` with nothing taken are the caller's bugs:
    :class:`~packcache._store_state.StoreStateError`.
    """

    def __init__(self, path: str, *, file_mode: int, dir_mode: int) -> None:
        self.path = path
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self._held: _Held | None = None  # the build lock a session adopted
        self._taken: _Held | None = None  # taken, not yet adopted by a session
        self._inode: int | None = None  # fd whose inode this writer flock-ed
        self._deadline = 0.0  # when waiting for the inode lock gives up

    @property
    def held(self) -> bool:
        """Whether a session holds the build lock."""
        return self._held is not None

    def take(self, timeout: float, *, file_open: bool) -> None:
        """Wait up to ``timeout`` seconds for the build lock (then :meth:`hold` adopts it).

        Changes nothing a session reads, so a thread may wait here while other threads keep serving
        hits. ``file_open``: whether the cache file itself could be opened (then a refusal to open
        the lock file means ``read_only``).

        Raises:
            Fault: ``locked`` on timeout; ``untrusted`` for a FIFO, symlink or foreign lock
            file; ``read_only``/``no_space``/``open_failed`` if it cannot be opened.
            StoreStateError: the lock is held already.
        """
        if self._held is not None:
            raise StoreStateError(f"take_lock() on {self.path} while its build lock is held")
        reason = _lock_reason_with_file if file_open else _lock_reason_without_file
        with faults.translating(reason, "cannot open lock file for", self.path):
            ensure_dir(self.path, self.dir_mode)
            acquire_build_lock(self.path, timeout, self.file_mode, track=self._track)

    def _track(self, fd: int | None) -> None:
        # Recorded before the flock is taken: an interrupt cannot leave a held lock unrecorded.
        self._taken = None if fd is None else (fd, file_identity(fd))

    def hold(self, timeout: float) -> None:
        """Adopt the lock :meth:`take` took (``timeout`` bounds the inode lock taken later).

        Raises:
            StoreStateError: no lock was taken.
        """
        if self._taken is None:
            raise StoreStateError(f"hold_lock() on {self.path} with no build lock taken (take_lock() first)")
        self._held, self._taken = self._taken, None
        self._deadline = time.monotonic() + timeout
        # Only the lock holder creates temp files, so any left now belong to dead writers
        # (a killed rebuild or compaction): reclaim their space.
        with contextlib.suppress(OSError):
            remove_orphans(resolve_trusted(self.path))

    def lock_inode(self, fd: int) -> None:
        """``flock`` the file being appended to: the build lock is per path, the file may have
        other names (a hardlink), and a cleaner may have deleted the lock file.

        Raises:
            Fault: ``locked`` when another writer keeps it past the lock timeout; ``open_failed``.
        """
        if self._inode == fd:
            return
        with faults.translating(HeapReason.OPEN_FAILED, "cannot lock", self.path):
            taken = wait_for_flock(fd, self._deadline)
        if not taken:
            raise Fault(
                HeapReason.LOCKED, errno_mod.EWOULDBLOCK,
                f"another process is appending to {self.path} through another name (a hardlink, or a lock "
                "file that was deleted) and held it past the lock timeout",
            )  # fmt: skip
        self._inode = fd

    def closing(self, fd: int) -> None:
        """``fd`` was closed, which dropped an inode lock taken on it: forget that lock."""
        if self._inode == fd:
            self._inode = None

    def release(self) -> None:
        """Release the build lock and the inode lock (closing the lock descriptor releases its flock)."""
        if self._inode is not None:
            with contextlib.suppress(OSError):  # not a translation: releasing must not fail the release
                fcntl.flock(self._inode, fcntl.LOCK_UN)
            self._inode = None
        for held in (self._held, self._taken):
            if held is not None:
                close_if_same(*held)
        self._held = self._taken = None
