"""The files packcache makes beside a cache file, and the small records it keeps: one idea, what lives next door.

* **The build lock** (:func:`acquire_build_lock`): an ``flock`` on ``<resolved path>.lock`` (:func:`lock_path_for`),
  so every spelling of one file meets the same lock; re-checked after ``flock``, because a lock file a
  cleaner unlinked locks nobody out; opened as :mod:`packcache._paths` opens everything (no symlink, no FIFO,
  no foreign owner).
* **Temp files** (:func:`create_temp`): ``.<name>.tmp-<pid>-<16 hex>``, ``O_EXCL | O_NOFOLLOW``, exactly the
  mode asked; the orphans a killed writer leaves are removed under the build lock (:func:`remove_orphans`),
  and ``gc`` recognises no other shape (:func:`parse_temp_name`).
* **Records** (:func:`read_record`, :func:`write_record`): small JSON hints this user keeps (a digest, an
  accepted fleet generation), trusted as a cache file is, written by rename.

Every rule of trust is :mod:`packcache._paths`'s (:func:`~packcache._paths.trust_problem`,
:func:`~packcache._paths.resolve_trusted`); this module only decides where these files go and how they are named.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from typing import Any

from ._defaults import PRIVATE_FILE_MODE
from ._paths import resolve_trusted, trust_problem
from .errors import LockTimeoutError, UntrustedFileError

__all__ = [
    "acquire_build_lock",
    "close_if_same",
    "create_temp",
    "file_identity",
    "lock_path_for",
    "parse_temp_name",
    "pid_alive",
    "read_record",
    "remove_orphans",
    "still_linked",
    "temp_prefix",
    "wait_for_flock",
    "write_record",
]


def lock_path_for(path: str) -> str:
    """The build lock's path: beside the cache file's *resolved* path, so every spelling
    of one file (a symlink to it, ``..`` components) meets the same lock.

    >>> lock_path_for("/tmp/../tmp/m.pcache")
    '/tmp/m.pcache.lock'
    """
    # pinned (with the store's flock on the file's inode) by tests/test_store.py::
    #   test_two_processes_on_one_file_through_different_paths_never_change_a_served_pack
    return os.path.realpath(path) + ".lock"


def open_lock(lock_path: str, mode: int, *, create: bool = True) -> tuple[int, bool]:
    """Open a lock file (creating it with ``mode`` if ``create``): no symlink, no FIFO, no foreign owner.

    Returns:
        ``(fd, created)``: whether this call created the file.

    Raises:
        UntrustedFileError: the lock path is a symlink, not a regular file, or fails :func:`trust_problem`.
        FileNotFoundError: it does not exist and ``create`` is false.
        OSError: it cannot be opened or created.
    """
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    created = False
    try:
        try:
            fd = os.open(lock_path, flags)
        except FileNotFoundError:
            if not create:
                raise
            try:
                fd = os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, mode)
                created = True
            except FileExistsError:  # another process created it meanwhile
                fd = os.open(lock_path, flags)
    except OSError as exc:
        if exc.errno == errno_mod.ELOOP:
            raise UntrustedFileError(lock_path, "a symlink", what="lock file") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            # pinned by tests/test_paths.py::test_configured_file_and_dir_modes_are_applied_and_still_trusted
            os.fchmod(fd, mode)  # the umask must not leave it unopenable for writing
            st = os.fstat(fd)
        # pinned by
        #   tests/test_sidefiles.py::test_a_fifo_at_the_lock_path_is_refused_without_blocking,
        #   tests/test_maintenance.py::test_gc_does_not_hang_on_a_fifo_planted_at_a_lock_path
        problem = trust_problem(st)
        if problem is not None:
            raise UntrustedFileError(lock_path, problem, what="lock file")
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def wait_for_flock(fd: int, deadline: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, polling until ``deadline`` (``time.monotonic()``).

    ``flock`` has no timeout of its own; polling with a capped backoff keeps the
    wait interruptible and bounded. Returns False on timeout.

    Raises:
        OSError: ``flock`` itself failed (not EWOULDBLOCK).
    """
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)


def still_linked(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a cleaner may have unlinked or replaced it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def acquire_build_lock(
    path: str,
    timeout: float,
    mode: int,
    *,
    track: Callable[[int | None], None] | None = None,
    create: bool = True,
    on_created: Callable[[int], None] | None = None,
) -> int:
    """Take the exclusive build lock of cache file ``path``; return the lock file's descriptor.

    The lock file is :func:`lock_path_for` ``path`` (created with ``mode`` if missing;
    its directory must exist). After ``flock`` succeeds the path must still name the
    locked file: a lock file that a cleaner unlinked or replaced meanwhile locks
    nobody out, so it is opened again. Closing the descriptor releases the lock.

    ``track`` is told each descriptor as soon as it is opened (before it can hold the
    lock) and ``None`` when this function closes it: a caller interrupted in the
    instant this function returns still knows which descriptor holds the lock.
    ``create=False`` never creates the lock file (``FileNotFoundError`` if it is missing);
    ``on_created`` is called with the descriptor of a lock file this call created (to give
    it an owner, say) before it is locked.

    Raises:
        LockTimeoutError: another process held the lock for more than ``timeout`` seconds.
        UntrustedFileError: the lock path is a FIFO, symlink, foreign or writable file, or ``path``
            is reached through a symlink another user may have planted (:func:`resolve_trusted`).
        OSError: the lock file cannot be opened or created, or ``flock`` failed.
    """
    # pinned by tests/test_paths.py::test_a_symlink_nobody_plants_in_a_sticky_directory_is_untrusted_and_its_target_kept
    lock_path = resolve_trusted(path) + ".lock"  # lock_path_for, refusing a symlink another user planted
    deadline = time.monotonic() + timeout
    while True:
        fd, created = open_lock(lock_path, mode, create=create)
        try:
            if track is not None:
                track(fd)
            if created and on_created is not None:
                on_created(fd)
            if not wait_for_flock(fd, deadline):
                raise LockTimeoutError(f"another process held the build lock {lock_path} for more than {timeout:g} s")
            if still_linked(fd, lock_path):
                return fd
        except BaseException:
            os.close(fd)
            if track is not None:
                track(None)
            raise
        os.close(fd)  # unlinked or replaced after we opened it: lock whatever the path names now
        if track is not None:
            track(None)


def file_identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of an open descriptor."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def close_if_same(fd: int | None, identity: tuple[int, int] | None) -> None:
    """Close ``fd`` only if it is still open on the file ``identity`` names.

    Callers close first and forget the number after; an interrupt between the two
    must not make the next clean-up close a number the process has reused since.
    """
    if fd is None or identity is None:
        return
    try:
        st = os.fstat(fd)
    except OSError:
        return  # closed already
    if (st.st_dev, st.st_ino) == identity:
        os.close(fd)


def temp_prefix(path: str) -> str:
    """Name prefix of ``path``'s temp files: ``.<name>.tmp-`` (then ``<pid>-<16 hex digits>``)."""
    return f".{os.path.basename(path)}.tmp-"


def create_temp(path: str, mode: int, *, dir_fd: int | None = None) -> tuple[int, str]:
    """Create a new, empty temp file beside ``path`` with exactly ``mode``; return (fd, temp path).

    ``O_EXCL | O_NOFOLLOW``: a file or symlink planted at the name is never
    opened; another random name is tried instead. With ``dir_fd`` (``path``'s directory, held open:
    :class:`TrustedParent`) the file is made in that directory, whatever its path names meanwhile.

    Raises:
        OSError: the file cannot be created.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = temp_prefix(path)
    for attempt in range(8):
        temp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            # pinned by tests/test_sidefiles.py::test_temp_file_is_created_with_o_excl_and_never_follows_a_planted_name
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(temp if dir_fd is None else os.path.basename(temp), flags, mode, dir_fd=dir_fd)
        except FileExistsError:
            if attempt == 7:
                raise
            continue
        try:
            # pinned by tests/test_paths.py::test_configured_file_and_dir_modes_are_applied_and_still_trusted
            os.fchmod(fd, mode)  # the umask must not widen or narrow the documented mode
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp if dir_fd is None else os.path.basename(temp), dir_fd=dir_fd)
            raise
        return fd, temp
    raise AssertionError("unreachable")


def parse_temp_name(name: str, prefix: str) -> int | None:
    """The builder pid in a temp file name ``<prefix><pid>-<16 hex digits>``, or ``None`` if it is not one.

    >>> parse_temp_name(".m.pcache.tmp-42-0123456789abcdef", ".m.pcache.tmp-")
    42
    >>> parse_temp_name(".m.pcache.tmp-draft", ".m.pcache.tmp-") is None
    True
    """
    if not name.startswith(prefix):
        return None
    pid_text, _, token = name[len(prefix) :].partition("-")
    # pinned by tests/test_maintenance.py::test_gc_keeps_a_users_file_named_like_a_temp_file
    if not pid_text.isdigit() or len(pid_text) > 10 or len(token) != 16:
        return None
    if any(c not in "0123456789abcdef" for c in token):
        return None
    return int(pid_text)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one we may not signal counts as alive)."""
    if pid <= 0:
        return True  # not a real builder pid: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_orphans(path: str) -> list[str]:
    """Delete temp files of ``path`` (its resolved path) left by writers that died; the caller holds the build lock.

    Every writer of a temp file of ``path`` (a rebuild, a compaction, a fetch) holds ``path``'s build
    lock while the file exists, so whatever the caller finds was left by one killed holding it, whatever
    its pid says (a pid reused since, or one of another pid namespace, would keep it for ever); only
    this process's own pid is spared. Only names of the exact shape :func:`create_temp` makes, holding
    a regular file this user may trust.
    Returns the removed paths.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = temp_prefix(path)
    removed = []
    for name in os.listdir(directory):
        # pinned by tests/test_fleet_trust.py::test_a_fetch_killed_mid_download_leaves_a_temp_the_next_fetch_removes
        pid = parse_temp_name(name, prefix)
        if pid is None or pid == os.getpid():  # this process's own name is no dead writer's
            continue
        candidate = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if trust_problem(os.lstat(candidate)) is None:
                os.unlink(candidate)
                removed.append(candidate)
    return removed


# --------------------------------------------------------------------------- small records of this user's


def read_record(name: str, *, dir_fd: int | None = None, max_bytes: int) -> tuple[Any, str | None]:
    """A small JSON record this user keeps (a digest record, where a digest was hashed, an accepted
    fleet generation): opened without following a symlink or blocking, and trusted only if it is a
    regular file of this user or root that nobody else can write, of at most ``max_bytes``.

    Returns:
        ``(value, None)``; ``(None, None)`` when it is missing or cannot be read; ``(None, why)`` when
        it is there but refused (a record is a hint: the caller goes on without it).
    """
    # pinned by tests/test_identity.py::test_a_hostile_digest_cache_costs_a_rehash_never_wrong_bytes
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return None, None  # missing, a symlink (ELOOP), unreadable
    try:
        st = os.fstat(fd)
        # pinned by tests/test_identity.py::test_a_hostile_digest_cache_costs_a_rehash_never_wrong_bytes
        problem = trust_problem(st)
        if problem is None and st.st_size > max_bytes:
            problem = f"{st.st_size} bytes, over {max_bytes}"
        if problem is not None:
            return None, problem
        raw = os.pread(fd, max_bytes, 0)
    except OSError:
        return None, None
    finally:
        os.close(fd)
    try:
        # A few KiB at most: the stdlib parser's own limits suffice (deep nesting is a RecursionError, not a
        # crash), and it costs a warm launch microseconds where the bounded parser's set-up costs a hundred.
        return json.loads(raw), None
    except (ValueError, RecursionError) as exc:
        return None, type(exc).__name__


def write_record(name: str, data: bytes, *, dir_fd: int | None = None, prefix: str = ".tmp-") -> None:
    """Write a record for :func:`read_record`: a temp file beside ``name`` (``<prefix><pid>-<16 hex>``,
    ``O_EXCL | O_NOFOLLOW``, mode 0600 whatever the umask), then renamed over it.

    Raises:
        OSError: it cannot be written (the temp file is removed).
    """
    directory, _ = os.path.split(name)
    temp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(
        temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE, dir_fd=dir_fd
    )
    try:
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # the umask must not leave it group-readable, nor widen it
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
