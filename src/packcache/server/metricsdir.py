"""prometheus_client's multiprocess directory, checked once and then held open, never looked up again.

prometheus_client opens ``$PROMETHEUS_MULTIPROC_DIR/<kind>_<pid>.db`` by name, in every worker,
whenever a worker starts. A directory checked by path and then reached by path again can be
redirected between the two: a symlink re-pointed, or a directory renamed and a symlink put in
its place, by whoever can change a directory on the way, and root's workers then create their
files where that user chooses. So:

* The path is walked one component at a time, each directory opened relative to the one before
  with ``O_NOFOLLOW`` and compared (device, inode) with what ``lstat`` saw: what is checked is
  what is opened.
* A symlink on the way is followed only if no other user can change it: it is owned by this
  user or root, and lies in a directory owned by this user or root that no one else can write,
  or that is sticky (where only a link's owner can replace it). Any other symlink is refused.
  At most 40 links are followed.
* The directory reached must be this user's or root's and writable by no one else (the cache
  files' rule, :func:`packcache._paths.trust_problem`) and writable by this user.
* Then it is **held**: prometheus_client is given ``/proc/self/fd/N``, a link the kernel
  resolves to the opened directory itself, in the master and in every forked worker (which
  inherits descriptor N). Renaming that directory, or any above it, or putting a symlink in its
  place redirects nothing. A plain directory on the way that another user can write is
  therefore no danger and is accepted. Where ``/proc/self/fd`` cannot be used, the checked real
  path is given instead, and only if no other user can change any directory on the way.

With no directory given, the server makes a private ``0700`` directory in the temporary
directory (whose path gets the same walk) and removes it, through the descriptors, at exit.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from collections import deque
from dataclasses import dataclass

from .. import _defaults
from .._paths import entry_problem, trust_problem

__all__ = ["HeldDirectory", "hold_metrics_dir"]

MAX_LINKS = 40
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_WALK = _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _ours(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


# A symlink on the metrics directory's path is followed only if this user or root owns it and no other user can
# replace it (``_walk``); pinned by tests/test_server_metricsdir.py::
#   test_a_symlink_another_user_can_change_is_refused_before_anything_is_read_or_removed
def _entries_safe(directory: os.stat_result, entry_uid: int) -> bool:
    """Whether no other user can replace an entry owned by ``entry_uid`` in ``directory``."""
    return entry_problem(directory, entry_uid) is None  # the one rule every name packcache believes passes


def _walk(path: str, shown: str) -> tuple[int, str, bool]:
    """Open the directory ``path`` names, following only symlinks no other user can change.

    Returns an ``O_PATH`` descriptor of it, its real path, and whether another user could have
    replaced a directory on the way (a name in a directory they can write).

    Raises:
        ValueError: naming the component: a symlink another user controls, too many links, not a
            directory, missing, or changed while it was walked.
    """
    pending = deque(path.split("/"))
    fd = os.open("/" if path.startswith("/") else ".", _WALK & ~os.O_NOFOLLOW)
    real = [] if path.startswith("/") else [p for p in os.getcwd().split("/") if p]
    exposed, links, walked = False, 0, "/" if path.startswith("/") else ""
    try:
        here = os.fstat(fd)
        while pending:
            name = pending.popleft()
            if name in ("", "."):
                continue
            where = os.path.join(walked, name) if walked else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise ValueError(f"the metrics directory {shown}: {where} does not exist") from None
            if stat.S_ISLNK(st.st_mode) and name != "..":
                if not _ours(st.st_uid):
                    raise ValueError(
                        f"the metrics directory {shown}: {where} is a symlink owned by uid {st.st_uid}, another "
                        "user, who could re-point it; give the directory it names, or a private one"
                    )
                if not _entries_safe(here, st.st_uid):
                    raise ValueError(
                        f"the metrics directory {shown}: {where} is a symlink in a directory another user can "
                        f"change (owner uid {here.st_uid}, mode {stat.S_IMODE(here.st_mode):04o}), who could "
                        "replace it; give the directory it names, or a private one"
                    )
                links += 1
                if links > MAX_LINKS:
                    raise ValueError(f"the metrics directory {shown}: more than {MAX_LINKS} symlinks")
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd, real, walked = -1, [], "/"
                    fd = os.open("/", _WALK & ~os.O_NOFOLLOW)
                    here = os.fstat(fd)
                pending.extendleft(reversed(target.split("/")))
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ValueError(f"the metrics directory {shown}: {where} is not a directory")
            try:
                child = os.open(name, _WALK, dir_fd=fd)
            except OSError as exc:
                raise ValueError(f"the metrics directory {shown}: {where} changed while it was checked") from exc
            opened = os.fstat(child)
            if name != ".." and (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                os.close(child)
                raise ValueError(f"the metrics directory {shown}: {where} changed while it was checked")
            exposed = exposed or (name != ".." and not _entries_safe(here, opened.st_uid))
            os.close(fd)
            fd, here, walked = child, opened, where
            if name == "..":
                if real:
                    real.pop()
            else:
                real.append(name)
        return fd, "/" + "/".join(real), exposed
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


@dataclass
class HeldDirectory:
    """An open directory and the path that reaches it (``/proc/self/fd/N`` where possible).

    Attributes:
        fd: the directory, opened for reading; kept open for the server's life.
        path: what ``PROMETHEUS_MULTIPROC_DIR`` is set to.
        private: for a directory the server made: (descriptor of its parent, its name), to remove it.
    """

    fd: int
    path: str
    private: tuple[int, str] | None = None

    def wipe(self) -> None:
        """Remove the ``*.db`` files a previous run left (as the client library requires between runs)."""
        for name in os.listdir(self.fd):
            if name.endswith(".db"):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                    os.unlink(name, dir_fd=self.fd)

    def remove(self) -> None:
        """Remove a directory the server made (its files, then itself if its name still names it)."""
        if self.private is None:
            return
        parent, name = self.private
        with contextlib.suppress(OSError):
            for entry in os.listdir(self.fd):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=self.fd)
            held = os.fstat(self.fd)
            now = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                os.rmdir(name, dir_fd=parent)
        with contextlib.suppress(OSError):
            os.close(parent)
        self.private = None


def _proc_path(fd: int) -> str | None:
    """``/proc/self/fd/N`` if it reaches the directory ``fd`` holds, else None (no /proc)."""
    path = f"/proc/self/fd/{fd}"
    with contextlib.suppress(OSError):
        if os.path.samestat(os.stat(path), os.fstat(fd)):
            return path
    return None


def _reopen(path_fd: int) -> int:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
    if not os.path.samestat(os.fstat(fd), os.fstat(path_fd)):  # "." of a directory is itself; never another
        os.close(fd)
        raise ValueError("the metrics directory changed while it was opened")
    return fd


def hold_metrics_dir(given: str | None) -> HeldDirectory:
    """Check and open the metrics directory (``given``, else a new private one), and hold it.

    Raises:
        ValueError: the directory is missing, not a directory, reached through a symlink another
            user controls, another user's, writable by others, or not writable by this user.
    """
    if not given:
        return _private()
    if "\0" in given:
        raise ValueError("the metrics directory path contains a NUL byte")
    path_fd, real, exposed = _walk(given, given)
    try:
        st = os.fstat(path_fd)
        # pinned by tests/test_server_metricsdir.py::
        #   test_a_metrics_directory_other_users_can_write_is_refused_before_anything_is_written,
        #   test_hold_metrics_dir_walks_the_path_the_way_the_kernel_does_and_refuses_what_it_cannot_hold
        problem = trust_problem(st, directory=True)
        if problem is not None:
            raise ValueError(
                f"the metrics directory {given} is another user's or other users can write it (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}); use a private directory (0700)"
            )
        if os.geteuid() != 0 and (st.st_uid != os.geteuid() or st.st_mode & 0o300 != 0o300):
            raise ValueError(f"the metrics directory {given} is not a writable directory")
        fd = _reopen(path_fd)
    finally:
        os.close(path_fd)
    # the held descriptor's path, never the name: prometheus_client opens its files by name; pinned by
    # tests/test_server_metricsdir.py::
    #   test_a_nobody_process_swapping_symlinks_while_the_server_runs_never_gets_a_file_where_it_points
    held = _proc_path(fd)
    if held is None and exposed:
        os.close(fd)
        raise ValueError(
            f"the metrics directory {given}: another user can change a directory on its path, and without "
            "/proc/self/fd it cannot be held open; use a directory only this user and root can reach"
        )
    return HeldDirectory(fd, held or real)


def _private() -> HeldDirectory:
    base = tempfile.gettempdir()
    path_fd, real, _ = _walk(base, base)
    try:
        parent = _reopen(path_fd)
    finally:
        os.close(path_fd)
    try:
        for _ in range(100):
            name = f"packcache-serve-metrics-{secrets.token_hex(6)}"
            try:
                os.mkdir(name, _defaults.PRIVATE_DIR_MODE, dir_fd=parent)
                break
            except FileExistsError:
                continue
        else:
            raise ValueError(f"cannot make a private metrics directory in {base}")
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise ValueError(f"the private metrics directory {base}/{name} is not this user's 0700 directory")
    except BaseException:
        os.close(parent)
        raise
    # Without /proc: the real path. Only this user (or root) can rename a 0700 directory out of a
    # sticky temporary directory such as /tmp.
    return HeldDirectory(fd, _proc_path(fd) or os.path.join(real, name), (parent, name))
