"""Opening paths another user may control: the one place packcache decides whether to trust what it opened.

Every entry point (:class:`~packcache.WeightCache`, :func:`~packcache.verify`,
:func:`~packcache.compact`, ``packcache inspect``/``gc``) opens paths that another
user may control. Three rules hold for all of them:

* **Never block on a path.** Every open carries ``O_NONBLOCK``: a FIFO planted
  at a cache or lock path is refused, it cannot hang the caller.
* **Check what was opened, not the path.** The descriptor is ``fstat``-ed: it
  must be a regular file, owned by the effective user or root, and not
  group/world-writable (:func:`trust_problem`). A path that ``lstat`` saw as a
  plain file is opened with ``O_NOFOLLOW`` and must still be the same inode, so
  a symlink swapped in between is never followed. A symlink anywhere on the way is
  followed only if no other user can have planted or re-pointed it (:func:`entry_problem`:
  the link and its directory this user's or root's, the directory writable by no one
  else, or sticky); the same rule decides every other name packcache believes (a key
  file, a hub blob), and every path it renames a new file over (:func:`resolve_trusted`).
* **One lock per file, whatever the spelling of its path.** The build lock
  lives beside the *resolved* path (:func:`packcache._sidefiles.lock_path_for`, which
  also names and makes temp files and records by these rules), is re-checked after
  ``flock`` (a lock file unlinked by a cleaner is not a lock), and a writer that
  appends to a file in place also locks the file's own inode
  (docs/RELIABILITY.md "The lock protocol").

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "m.pcache")
>>> with open(p, "wb") as f:
...     _ = f.write(b"x")
>>> fd, st = open_checked(p)
>>> st.st_size
1
>>> os.close(fd)
>>> os.mkfifo(os.path.join(d, "fifo"))
>>> open_checked(os.path.join(d, "fifo"))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
packcache.errors.UntrustedFileError: untrusted cache file .../fifo: not a regular file (a FIFO)
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import pwd
import stat
from collections import deque

from ._defaults import LOCK_TIMEOUT
from .errors import FormatError, UntrustedFileError

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "TrustedParent",
    "default_cache_dir",
    "entry_problem",
    "expand_home",
    "make_dirs",
    "open_checked",
    "open_for_reading",
    "open_trusted_parent",
    "pread_exact",
    "read_bounded",
    "read_trusted",
    "replaceable",
    "resolve_trusted",
    "trust_problem",
    "user_cache_home",
    "xdg_cache_home",
]

#: Seconds a writer waits for another process's build lock by default: :data:`packcache._defaults.LOCK_TIMEOUT`
#: under the name ``maintenance.compact`` imports it by (the process default is ``packed_cache_lock_timeout``).
DEFAULT_LOCK_TIMEOUT = LOCK_TIMEOUT


def default_cache_dir() -> str:
    """Where cache files go by default: ``$PACKCACHE_DIR``, else :func:`user_cache_home`.

    Raises:
        FileNotFoundError: no ``$PACKCACHE_DIR`` and this user has no cache home (:func:`user_cache_home`).
    """
    return os.environ.get("PACKCACHE_DIR") or user_cache_home()


def user_cache_home() -> str:
    """packcache's directory in this user's own cache: ``$XDG_CACHE_HOME/packcache`` when that is an absolute path
    (a relative one is ignored, as the XDG base directory specification says), else ``<home>/.cache/packcache``
    (:func:`home_dir`). Never a path relative to the working directory.

    Raises:
        FileNotFoundError: neither an absolute ``$XDG_CACHE_HOME`` nor a home directory (:func:`home_dir`).
    """
    return os.path.join(xdg_cache_home(), "packcache")


def xdg_cache_home() -> str:
    """This user's cache directory: ``$XDG_CACHE_HOME`` when absolute (a relative value is ignored, as the XDG base
    directory specification says), else ``<home>/.cache``.

    Raises:
        FileNotFoundError: as :func:`home_dir`, when ``$XDG_CACHE_HOME`` is unset, empty or relative.
    """
    given = os.environ.get("XDG_CACHE_HOME")
    if given and os.path.isabs(given):
        return given
    return os.path.join(home_dir(), ".cache")


def home_dir() -> str:
    """This user's home directory, always an absolute path: ``$HOME`` when absolute, else the passwd entry of the
    effective user. ``os.path.expanduser("~")`` returns ``"~"`` itself when both are missing (a container run under
    an arbitrary uid with ``HOME`` unset), which every path built on it made relative to the working directory.

    Raises:
        FileNotFoundError: neither (one line saying what to set).
    """
    # pinned by tests/test_paths.py::test_no_home_and_no_passwd_entry_is_refused_never_a_path_under_the_cwd
    given = os.environ.get("HOME")
    if given and os.path.isabs(given):
        return given
    uid = os.geteuid()
    try:
        entry = pwd.getpwuid(uid).pw_dir
    except KeyError:
        entry = ""
    if entry and os.path.isabs(entry):
        return entry
    shown = f"HOME={given!r} is not an absolute path" if given else "HOME is unset"
    raise FileNotFoundError(
        f"no home directory: {shown} and uid {uid} has no passwd entry with one; set PACKCACHE_DIR (where cache files "
        "go) or XDG_CACHE_HOME (this user's cache) to an absolute path, or HOME"
    )


def expand_home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded as ``os.path.expanduser`` does, except that ``~`` is
    :func:`home_dir` (never left as a relative ``~`` directory) and a ``~user`` with no such user is refused.

    Raises:
        FileNotFoundError: ``~`` with no home directory, or ``~user`` of an unknown user.
    """
    if not path.startswith("~"):
        return path
    user, sep, rest = path[1:].partition("/")
    if not user:
        return home_dir() + sep + rest if rest else home_dir()
    expanded = os.path.expanduser(path)
    if expanded.startswith("~") or not os.path.isabs(expanded):
        raise FileNotFoundError(f"{path[:120]!r}: no user {user[:60]!r} to expand '~{user[:60]}' for")
    return expanded


def make_dirs(directory: str | os.PathLike[str], mode: int, *, what: str = "cache directory") -> str:
    """``mkdir -p directory``: every directory it creates on the way gets exactly ``mode``, whatever the umask
    (``os.makedirs(mode=)`` gives it to the last one only, and through the umask); one that exists is never changed.
    Never through a symlink another user may have planted (:func:`resolve_trusted`). Returns the resolved path.

    Raises:
        UntrustedFileError: a symlink on the way fails the rule (nothing is made where it points).
        OSError: a directory cannot be made.
    """
    # pinned by tests/test_paths.py::test_every_directory_made_on_the_way_to_the_default_cache_gets_the_private_mode
    real = resolve_trusted(os.path.abspath(os.fspath(directory)), what=what)
    missing = []
    here = real
    while not os.path.isdir(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for made in reversed(missing):
        try:
            os.mkdir(made, mode)
        except FileExistsError:
            continue  # made meanwhile by another process: not ours to change
        fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if os.fstat(fd).st_uid == os.geteuid():  # the one made here, not one swapped in after the mkdir
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return real


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symlink",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def trust_problem(st: os.stat_result, *, directory: bool = False) -> str | None:
    """Why a file with status ``st`` must not be trusted, or ``None``.

    Trusted: a regular file (``directory``: a directory) owned by the effective user or root,
    writable by its owner only.
    """
    if directory and not stat.S_ISDIR(st.st_mode):
        return f"not a directory ({_kind(st.st_mode)})"
    if not directory and not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({_kind(st.st_mode)})"
    # pinned by tests/test_paths.py::test_nobody_refuses_a_cache_file_owned_by_another_non_root_user
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root"
    # pinned by tests/test_paths.py::test_nobody_refuses_its_own_group_or_world_writable_file
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _ours(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def entry_problem(directory: os.stat_result, entry_uid: int) -> str | None:
    """Why another user could replace (or has made) an entry owned by ``entry_uid`` in ``directory``, or ``None``.

    No other user can: the entry is this user's or root's, and so is the directory, which no one else
    can write, or which is sticky (there only an entry's owner, the directory's owner and root may
    rename or unlink it: Linux's ``fs.protected_symlinks`` reasoning, narrowed to owners this user trusts).
    The one rule for every name packcache believes: a symlink it follows (:func:`resolve_trusted`),
    a hub blob's file name and the directories above it, a key file.
    """
    # pinned by tests/test_paths.py::test_a_symlink_nobody_plants_in_a_sticky_directory_is_untrusted_and_its_target_kept
    if not _ours(entry_uid):
        return f"owned by uid {entry_uid}, not by this user ({os.geteuid()}) or root"
    if not _ours(directory.st_uid):
        return f"in a directory owned by uid {directory.st_uid}, who may replace it"
    if directory.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not directory.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(directory.st_mode)
        return f"in a directory other users can write without the sticky bit (mode {mode:04o})"
    return None


#: Symlinks :func:`resolve_trusted` follows at most (the kernel's own limit).
MAX_LINKS = 40


def resolve_trusted(path: str | os.PathLike[str], *, what: str = "cache file") -> str:
    """``os.path.realpath(path)``, following only symlinks no other user can have planted or re-pointed
    (:func:`entry_problem`: the link and its directory this user's or root's, the directory writable by
    no one else or sticky). A missing component ends the walk: the rest is taken as written. It holds no
    descriptor (a cache opened with one descriptor left still opens); a writer that must land where it
    checked uses :func:`open_trusted_parent`.

    >>> resolve_trusted("/tmp/../tmp/m.pcache")
    '/tmp/m.pcache'

    Raises:
        UntrustedFileError: a symlink on the way fails the rule (the message names it), or more than
            :data:`MAX_LINKS` symlinks.
    """
    return _walk(os.fspath(path), what, hold=False)[1]


class TrustedParent:
    """The directory a file lies in (or is to be made in), held open: :func:`open_trusted_parent`.

    A new file is made in it (:func:`create_temp` with ``dir_fd``) and renamed within it
    (:meth:`rename_over`), so no rename of a directory on the way, after the walk, can send either
    into another directory (as metricsdir and the directory store hold theirs).
    """

    __slots__ = ("fd", "name", "real")

    def __init__(self, fd: int, name: str, real: str) -> None:
        self.fd = fd  # the directory, opened component by component
        self.name = name  # the file's name in it
        self.real = real  # the file's resolved path (for messages, and the lock beside it)

    def rename_over(self, temp: str) -> None:
        """Rename the temp file ``temp`` (made in this directory) over the file, within this directory."""
        os.rename(os.path.basename(temp), self.name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink_quietly(self, temp: str) -> None:
        """Remove the temp file ``temp`` made in this directory, ignoring any error."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.basename(temp), dir_fd=self.fd)

    def close(self) -> None:
        os.close(self.fd)


def open_trusted_parent(path: str | os.PathLike[str], *, what: str = "cache file") -> TrustedParent:
    """Open the directory ``path``'s file lies in, resolving ``path`` as :func:`resolve_trusted` does but
    one component at a time relative to the directory opened before it (``O_NOFOLLOW``, each symlink
    judged by the directory that holds it): what is opened is what was checked, whatever another user
    renames on the way meanwhile. The caller closes it.

    Raises:
        UntrustedFileError: a symlink on the way fails the rule.
        FileNotFoundError: the directory does not exist. OSError: it cannot be opened.
    """
    given = os.fspath(path)
    parent, real = _walk(given, what, hold=True)
    if parent is None:
        raise FileNotFoundError(errno_mod.ENOENT, "no such directory", os.path.dirname(real))
    return TrustedParent(parent, os.path.basename(real), real)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(given: str, what: str, *, hold: bool) -> tuple[int | None, str]:
    """Resolve ``given`` as :func:`resolve_trusted` says: (the open directory holding its last component, or
    None; the resolved path). Every symlink met must pass :func:`entry_problem` for the directory holding it.

    ``hold``: walk by descriptors, each directory opened ``O_NOFOLLOW`` relative to the one before (at most
    two open at once), so a component renamed or swapped for a symlink after it was looked at is refused or
    never reached, not followed; the directory of the last component is returned open (None when a directory
    on the way is missing). Else walk by path, holding no descriptor (and return None).
    """
    # A rename of a directory on the way between a check by path and a rename by path once sent a
    # rebuild or a fetch into another directory; pinned by
    #   tests/test_paths.py::test_a_directory_swapped_for_a_symlink_during_the_walk_is_never_written_through
    pending = deque((given if given.startswith("/") else os.path.join(os.getcwd(), given)).split("/"))
    here, links = "/", 0
    fd = os.open("/", _DIR_FLAGS) if hold else None

    def at(name: str) -> str:
        return name if fd is not None else os.path.join(here, name)

    def rest_of(name: str) -> str:
        return os.path.normpath(os.path.join(here, name, *[p for p in pending if p not in ("", ".")]))

    try:
        while pending:
            name = pending.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if here != "/":
                    if fd is not None:
                        up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                        os.close(fd)
                        fd = up
                    here = os.path.dirname(here)
                continue
            last = not [p for p in pending if p not in ("", ".")]
            try:
                st = os.stat(at(name), dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):  # missing: nothing more to follow, as realpath
                if last:
                    held, fd = fd, None
                    return held, rest_of(name)
                return None, rest_of(name)
            if stat.S_ISLNK(st.st_mode):
                problem = entry_problem(os.fstat(fd) if fd is not None else os.stat(here), st.st_uid)
                if problem is not None:
                    raise UntrustedFileError(given, f"{os.path.join(here, name)} is a symlink {problem}", what=what)
                links += 1
                if links > MAX_LINKS:
                    raise UntrustedFileError(given, f"more than {MAX_LINKS} symlinks", what=what)
                target = os.readlink(at(name), dir_fd=fd)
                if target.startswith("/"):
                    here = "/"
                    if fd is not None:
                        root = os.open("/", _DIR_FLAGS)
                        os.close(fd)
                        fd = root
                pending.extendleft(reversed(target.split("/")))
                continue
            if last:  # the last component: its directory is the answer
                held, fd = fd, None
                return held, os.path.join(here, name)
            if not stat.S_ISDIR(st.st_mode):
                return None, rest_of(name)
            if fd is not None:
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno_mod.ELOOP, errno_mod.ENOENT, errno_mod.ENOTDIR):
                        raise  # EMFILE, EACCES, ...: the caller's fault to translate
                    raise UntrustedFileError(given, f"{os.path.join(here, name)} changed while it was resolved",
                                             what=what) from None  # fmt: skip
                opened = os.fstat(child)
                os.close(fd)
                fd = child
                if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                    raise UntrustedFileError(given, f"{os.path.join(here, name)} changed while it was resolved",
                                             what=what)  # fmt: skip
            here = os.path.join(here, name)
        # only "", "." or ".." were left: ``given`` names the directory walked to
        if fd is None or here == "/":
            return None, here
        up = os.open("..", _DIR_FLAGS, dir_fd=fd)
        return up, here
    finally:
        if fd is not None:
            os.close(fd)


def replaceable(real: str) -> str | None:
    """Why another user could replace the file at the symlink-free path ``real`` or a directory on
    its way (:func:`entry_problem` for each step from ``/`` down), or ``None``."""
    parts = [p for p in real.split("/") if p]
    here = "/"
    for name in parts:
        child = os.path.join(here, name)
        problem = entry_problem(os.stat(here), os.lstat(child).st_uid)
        if problem is not None:
            return f"{child} is {problem}"
        here = child
    return None


def _unsafe_directory(path: str) -> str | None:
    parent = os.path.dirname(os.path.abspath(path))
    pst = os.stat(parent)
    # pinned by tests/test_paths.py::test_nobody_symlink_in_world_writable_directory_is_trusted_only_with_sticky_bit
    if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
        return f"a symlink in world-writable directory {parent} without the sticky bit"
    return None


def pread_exact(fd: int, size: int, offset: int, *, path: str, what: str) -> bytes:
    """Exactly ``size`` bytes of ``fd`` from ``offset`` (``pread`` until done).

    Raises:
        FormatError: the file ends first (shorter than it claimed, or truncated since it was
            measured); the message names ``what`` was being read and the offset where it ended.
    """
    chunks = []
    done = 0
    while done < size:
        chunk = os.pread(fd, size - done, offset + done)
        if not chunk:
            raise FormatError(f"file ends at byte {offset + done}, inside its {what}", path=path, offset=offset + done)
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def read_bounded(path: str, *, what: str, max_bytes: int) -> bytes:
    """The whole of a small file packcache does not own (a checkpoint's ``config.json``, its tokenizer),
    read as every source file is: without blocking on a FIFO, without following a symlink swapped in
    after the check, a regular file only (anyone's: ownership is not checked), and no larger than
    ``max_bytes``, measured before a byte is read.

    Raises:
        UntrustedFileError: not a regular file (its message names ``what``).
        FormatError: larger than ``max_bytes``, or it shrank while being read.
        OSError: it cannot be opened or read (``FileNotFoundError``, ``PermissionError``, ...).
    """
    try:
        # pinned by tests/test_minilm.py::test_a_fifo_in_the_model_directory_is_refused_at_once
        fd, st = open_checked(path, trust=False)
    except UntrustedFileError as exc:
        raise UntrustedFileError(path, exc.reason, what=what) from None
    try:
        if st.st_size > max_bytes:
            raise FormatError(f"the {what} is {st.st_size} bytes, past the {max_bytes}-byte cap", path=path)
        return pread_exact(fd, st.st_size, 0, path=path, what=what)
    finally:
        os.close(fd)


def read_trusted(path: str, *, what: str, max_bytes: int, secret: bool = False) -> bytes:
    """The whole of a small file packcache believes (a trusted public key, a private signing key): the cache
    file's rule (:func:`open_checked`: no FIFO, no symlink another user planted, this user's or root's,
    writable by no one else), no other user able to replace it or a directory on its way
    (:func:`replaceable`), ``secret``: readable by its owner only (as ssh refuses a private key), and no
    larger than ``max_bytes``, measured on what was opened before a byte is read.

    Raises:
        UntrustedFileError: it fails a rule (its message names ``what``).
        FormatError: larger than ``max_bytes``, or it shrank while being read.
        OSError: it cannot be opened or read.
    """
    try:
        # pinned by tests/test_fleet_trust.py::test_a_key_file_another_user_owns_can_write_or_planted_is_refused
        fd, st = open_checked(path)
        try:
            problem = replaceable(resolve_trusted(path))
            if problem is None and secret and st.st_mode & 0o077:
                problem = f"other users may read it (mode {stat.S_IMODE(st.st_mode):04o}; a private key is 0600)"
            if problem is not None:
                raise UntrustedFileError(path, problem)
            if st.st_size > max_bytes:
                raise FormatError(f"the {what} is {st.st_size} bytes, past the {max_bytes}-byte cap", path=path)
            return pread_exact(fd, st.st_size, 0, path=path, what=what)
        finally:
            os.close(fd)
    except UntrustedFileError as exc:
        raise UntrustedFileError(path, exc.reason, what=what) from None


def open_checked(
    path: str, *, write: bool = False, trust: bool = True, noatime: bool = False
) -> tuple[int, os.stat_result]:
    """Open an existing cache file without blocking or following a swapped-in symlink; check what was opened.

    Args:
        path: the file.
        write: open read-write (``O_RDWR``) instead of read-only.
        trust: also refuse a file that fails :func:`trust_problem` (ownership and mode);
            a non-regular file is refused either way.
        noatime: reads leave the access time alone (``O_NOATIME``; only the owner or root
            may ask, others' reads touch it as any reader's would). Access time is ``gc``'s
            record of use: an operator's look must not count as one.

    Returns:
        ``(fd, fstat of fd)``; the caller closes ``fd``.

    Raises:
        UntrustedFileError: not a regular file, a symlink in an unsafe directory, the path
            changed while it was opened, or (``trust``) a foreign owner or a writable mode, or a
            symlink on the way another user may have planted (:func:`resolve_trusted`).
        OSError: the path cannot be opened (``FileNotFoundError``, ``PermissionError``, ...).
    """
    if trust:
        # every symlink on the way, not only the last: pinned by
        #   tests/test_paths.py::test_a_symlink_nobody_plants_in_a_sticky_directory_is_untrusted_and_its_target_kept
        resolve_trusted(path)
    lst = os.lstat(path)
    # O_NONBLOCK: a symlink to a FIFO passes the lstat, and a read-only open of it would wait; pinned by
    #   tests/test_cli.py::test_cli_refuses_a_non_file_at_the_cache_path_without_hanging
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    if stat.S_ISLNK(lst.st_mode):
        unsafe = _unsafe_directory(path)
        if unsafe:
            raise UntrustedFileError(path, unsafe)
    elif stat.S_ISREG(lst.st_mode):
        # pinned (with the same-inode check after the open) by
        #   tests/test_paths.py::test_a_symlink_swapped_in_after_the_check_is_never_followed
        flags |= os.O_NOFOLLOW  # swapped for a symlink since the lstat: ELOOP, never its target
    else:
        # pinned (with the fstat check after the open) by
        #   tests/test_paths.py::test_a_fifo_at_the_cache_path_is_refused_without_blocking
        raise UntrustedFileError(path, f"not a regular file ({_kind(lst.st_mode)})")
    try:
        try:
            fd = os.open(path, flags | (os.O_NOATIME if noatime else 0))
        except PermissionError:
            if not noatime:
                raise
            fd = os.open(path, flags)  # not the owner: O_NOATIME is refused (EPERM), read as anyone
    except OSError as exc:
        if exc.errno == errno_mod.ELOOP:
            raise UntrustedFileError(path, "it was replaced by a symlink while being opened") from None
        raise
    try:
        st = os.fstat(fd)
        problem = trust_problem(st) if trust else (None if stat.S_ISREG(st.st_mode) else "not a regular file")
        if problem is None and not stat.S_ISLNK(lst.st_mode) and (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino):
            problem = "it was replaced while being opened"
        if problem is not None:
            raise UntrustedFileError(path, problem)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_for_reading(name: str) -> tuple[int, os.stat_result, str | None]:
    """``(fd, fstat, verdict)`` for a read-only look at a cache file (``inspect``, ``verify``, ``probe``);
    the verdict says why WeightCache would refuse the file (``None``: it would use it).

    Reading another user's file is safe when nothing is mapped and nothing blocks, so
    only what cannot be read at all raises: a FIFO, socket, device or directory.

    Raises:
        UntrustedFileError: not a regular file (directly or behind a symlink).
        OSError: it cannot be opened.
    """
    try:
        fd, st = open_checked(name, trust=False, noatime=True)
        verdict = trust_problem(st)
        if verdict is None:
            try:
                resolve_trusted(name)
            except UntrustedFileError as exc:
                verdict = exc.reason
    except UntrustedFileError as exc:
        if not os.path.islink(name):
            raise
        # A symlink in an unsafe directory: the cache refuses the path; what it names today
        # can still be looked at (no-follow, non-blocking, regular files only).
        fd, st = open_checked(os.path.realpath(name), trust=False, noatime=True)
        verdict = exc.reason
    return fd, st, verdict
