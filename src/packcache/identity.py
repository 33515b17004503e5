"""Content identity: what names a source file, and a default cache file, wherever it lies.

A pack key names its source by the sha256 of the source file's bytes and its size
(:attr:`FileDigest.identity`), never by its path, name, mtime, inode or device: the
same bytes at another path, in another container or on another machine give the
same keys, and other bytes never do. A warm launch must not read the file, so the
digest is found, cheapest first (:func:`file_digest`):

1. **A Hugging Face hub blob.** A file reached from a hub repository's own
   ``<root>/models--<name>/snapshots/`` whose resolved path is
   ``<root>/models--<name>/blobs/<64 hex>`` is named by its sha256 already (the hub
   stores every LFS file so), when no other user can have put other bytes under that
   name: every symlink on the way, the blob and each directory above it pass the cache
   file's rule (this user's or root's, writable by no one else, or sticky), and so does
   the blob itself. Anything else is hashed: a wrong belief may cost a hash, never a wrong
   byte. A 40-hex name is a git blob sha1 of a small file, not a content digest: it is hashed.
2. **The in-process memo, then the per-user digest cache** (:func:`digest_dir`):
   one small JSON record per file, keyed by ``(st_dev, st_ino, size, mtime_ns,
   ctime_ns)``. ``ctime`` is in the key because user space cannot set it (``touch
   -r``, ``cp -p``, ``rsync -t`` and ``tar`` restore mtime; any write moves ctime).
   Records are trusted only on filesystems whose stat is reliable
   (:data:`RELIABLE_FILESYSTEMS`, by ``fstatfs`` type: NFS, FUSE, SMB and anything
   unknown are hashed on every launch), and only for a file whose last change is
   at least :data:`RACY_SECONDS` old: a write within the timestamp granularity of
   the previous one can leave the stat unchanged (git's "racy git", ccache's
   ``min_age``), so a younger file is neither recorded nor looked up.
3. **Otherwise the file is streamed once** through sha256, and the digest recorded
   when the rules above allow it.

A digest cache that is hostile or wrong costs a rehash, never a wrong byte: a
record is read only from a directory owned by this user (or root) that no one
else can write, only if it is a regular file of that owner (no FIFO, no symlink,
never blocking), JSON of exactly the expected fields, and only if every
stat field equals the file's ``fstat`` now. A record that fails any check is
ignored and the file hashed. What remains is a record forged by this user or
root with the file's exact stat: such a writer could as well rewrite the cache
file itself (docs/RELIABILITY.md "Content identity").

A default cache file is named by the same rule, from its sources' identities, its packers
and its recipe: :func:`model_cache_name` (:mod:`packcache._cachename`).

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
>>> with open(path, "wb") as f:
...     _ = f.write(b"abc")
>>> d = digest_path(path)
>>> d.sha256[:16], d.size, d.how
('ba7816bf8f01cfea', 3, 'hashed')
>>> d.identity == "sha256:" + d.sha256 + ":3"
True
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_mod
import hashlib
import json
import logging
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import _defaults
from ._cachename import model_cache_name  # docs/TORCH.md names it here, beside the identities it is made of
from ._paths import make_dirs, open_checked, replaceable, resolve_trusted, trust_problem, user_cache_home
from ._sidefiles import parse_temp_name, pid_alive, read_record, write_record
from .errors import FormatError

__all__ = [
    "RACY_SECONDS",
    "RELIABLE_FILESYSTEMS",
    "FileDigest",
    "digest_dir",
    "digest_path",
    "file_digest",
    "hash_file",
    "model_cache_name",
    "recorded_location",
    "stat_key",
]

logger = logging.getLogger("packcache")

#: A file changed less than this many seconds ago is hashed and its digest not recorded: a
#: second write within the timestamp granularity of the first can leave its stat unchanged.
RACY_SECONDS = 2.0

#: ``statfs`` magic numbers of filesystems whose stat changes with every write (``f_type`` ->
#: name). Elsewhere (NFS's attribute cache, FUSE servers, SMB, unknown types) a record is never
#: trusted: the file is hashed on every launch.
RELIABLE_FILESYSTEMS: dict[int, str] = {
    0xEF53: "ext2/ext3/ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
}

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_RECORD_FORMAT = "packcache-digest/1"
_LOCATION_FORMAT = "packcache-location/1"
_WHERE = "where"  # subdirectory of the digest cache: where each digest was last hashed
_RECORD_MAX_BYTES = 4096
_MAX_RECORDS = 4096  # more than this in the directory: the least recently written quarter goes
_TEMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20
_MEMO_MAX = 65536

StatKey = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)


@dataclass(frozen=True)
class FileDigest:
    """The content digest of one file, and how it was found.

    Attributes:
        sha256: 64 lowercase hex digits.
        size: the file's size in bytes.
        how: ``"hub-blob"`` (the file's name), ``"memo"`` (found earlier in this process),
            ``"digest-cache"`` (a record of the per-user digest cache) or ``"hashed"`` (read now).
    """

    sha256: str
    size: int
    how: str

    @property
    def identity(self) -> str:
        """``sha256:<64 hex>:<size>``: what pack keys name the file by."""
        return f"sha256:{self.sha256}:{self.size}"


def digest_dir() -> str:
    """The per-user digest cache: ``$PACKCACHE_DIGEST_DIR``, else ``$XDG_CACHE_HOME/packcache/digests``,
    else ``~/.cache/packcache/digests``.

    It is the user's own even when cache files live in a directory shared with other users
    (``$PACKCACHE_DIR``): a record is trusted only from a directory nobody else can write.
    """
    return os.environ.get("PACKCACHE_DIGEST_DIR") or os.path.join(user_cache_home(), "digests")


def digest_path(path: str | os.PathLike[str]) -> FileDigest:
    """:func:`file_digest` of the file at ``path``, opened as a source file is (never blocking,
    a regular file only, no symlink swapped in after the check; anyone's file).

    Raises:
        UntrustedFileError: not a regular file. FormatError: it changed while being read.
        OSError: it cannot be opened or read.
    """
    name = os.fspath(path)
    fd, st = open_checked(name, trust=False)
    try:
        return file_digest(fd, name, st)
    finally:
        os.close(fd)


def file_digest(fd: int, path: str, st: os.stat_result | None = None) -> FileDigest:
    """The sha256 of the regular file open as ``fd`` (named ``path`` in messages and for the hub rule).

    ``st`` is the ``fstat`` the caller validated the file with; the file must still match it
    (a file changed since is refused, not hashed under the old stat). See the module docstring
    for the order in which the digest is looked for, and what is trusted.

    Raises:
        FormatError: the file changed since ``st`` was taken, or while it was hashed.
        OSError: it cannot be read.
    """
    now = os.fstat(fd)
    if st is None:
        st = now
    key = stat_key(st)
    # pinned by tests/test_identity.py::test_file_digest_refuses_a_stat_that_is_no_longer_the_files
    if stat_key(now) != key:
        raise FormatError("the file changed since it was opened; open it again", path=path)
    blob = _hub_blob(path, st)
    if blob is not None:
        return FileDigest(blob, st.st_size, "hub-blob")
    # a record is trusted only past the racy window and on a filesystem whose stat does not lie; pinned by
    #   tests/test_identity.py::test_an_edit_within_the_racy_window_is_never_recorded_and_is_repacked,
    #   tests/test_identity.py::test_a_filesystem_whose_stat_may_lie_is_hashed_on_every_launch
    trusted = _settled(st) and _reliable(fd)
    if trusted:
        found = _MEMO.get(key)
        if found is not None:
            return FileDigest(found, st.st_size, "memo")
        with _records() as records:
            found = records.lookup(key)
        if found is not None:
            _remember(key, found)
            return FileDigest(found, st.st_size, "digest-cache")
    if st.st_size >= 64 << 20:
        logger.info("packcache: hashing %s (%.0f MiB) to name its packs by content", path, st.st_size / (1 << 20))
    digest = hash_file(fd, path, st)
    # Still the same file after the read (a write meanwhile moved its ctime): the digest is of this stat.
    if trusted and stat_key(os.fstat(fd)) == key:
        _remember(key, digest)
        with _records(create=True) as records:
            records.store(key, digest)
            records.store_location(digest, path)
    return FileDigest(digest, st.st_size, "hashed")


def recorded_location(sha256: str) -> str | None:
    """Where this user last hashed a file with content ``sha256`` (a path to look at, never trusted:
    ``packcache publish`` hashes what it finds there again), or None."""
    if not _SHA256_HEX.fullmatch(sha256):
        return None
    with _records() as records:
        return records.location(sha256)


def stat_key(st: os.stat_result) -> StatKey:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``: one version of one file on this machine.
    Every write moves ctime, which user space cannot set back."""
    # ctime too: touch -r, cp -p and rsync -t restore mtime after an in-place write, nothing restores ctime; pinned by
    #   tests/test_identity.py::test_an_in_place_same_size_edit_with_mtime_restored_is_repacked_never_stale
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _settled(st: os.stat_result) -> bool:
    """Whether the file's last change (mtime or ctime, whichever is later) is :data:`RACY_SECONDS` old.
    A future mtime (``touch -d tomorrow``) never is: such a file is hashed on every launch."""
    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= RACY_SECONDS * 1e9


_HUB_REPO = re.compile(r"(models|datasets|spaces)--.+")


def _hub_blob(path: str, st: os.stat_result) -> str | None:
    """The sha256 a Hugging Face hub cache names the file by (``<repo>/blobs/<64 hex>``), if it is one
    no other user can have put other bytes under (module docstring, rule 1)."""
    # Believed only in a hub layout, reached from the repository's own snapshots, through trusted symlinks, and
    # only if neither the blob nor a directory above it is another user's to write or replace; pinned by
    #   tests/test_identity.py::test_another_users_blob_named_like_the_real_model_is_hashed_never_packed_as_it
    try:
        real = resolve_trusted(path, what="source file")
        blobs = os.path.dirname(real)
        repo = os.path.dirname(blobs)
        if (
            os.path.basename(blobs) != "blobs" or not _SHA256_HEX.fullmatch(os.path.basename(real))
            or not _HUB_REPO.fullmatch(os.path.basename(repo))
        ):  # fmt: skip
            return None
        reached_from = resolve_trusted(os.path.dirname(os.path.abspath(path)), what="source directory")
        if not reached_from.startswith(os.path.join(repo, "snapshots") + "/"):
            return None
        if trust_problem(st) is not None or replaceable(real) is not None:
            return None
        now = os.stat(real, follow_symlinks=False)
    except OSError:  # UntrustedFileError too: a symlink another user controls
        return None
    # The resolved path must name the file that was opened: a symlink re-pointed since names another.
    return os.path.basename(real) if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) else None


_STATFS_TYPE: Any = None  # libc's fstatfs, found once


def _statfs_type(fd: int) -> int | None:
    """``f_type`` of the filesystem holding ``fd`` (``fstatfs``), or None where it cannot be asked."""
    global _STATFS_TYPE
    if not sys.platform.startswith("linux"):
        return None
    if _STATFS_TYPE is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fstatfs.restype = ctypes.c_int
        _STATFS_TYPE = libc.fstatfs
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _STATFS_TYPE(fd, buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def _reliable(fd: int) -> bool:
    kind = _statfs_type(fd)
    if kind in RELIABLE_FILESYSTEMS:
        return True
    if _first_notice(f"fs:{kind}"):
        shown = f"0x{kind:x}" if kind is not None else "unknown"
        logger.info(
            "packcache: source files on filesystem type %s are hashed on every launch: its stat may not change "
            "when a file does (see RELIABLE_FILESYSTEMS)", shown,
        )  # fmt: skip
    return False


def hash_file(fd: int, path: str, st: os.stat_result) -> str:
    """The sha256 (hex) of the file open as ``fd``, read now: no memo, record or hub name consulted
    (:func:`file_digest` uses it when those fail; ``packcache publish`` and ``fetch`` when only the
    bytes themselves may be believed). Streamed with ``pread``, 1 MiB at a time (hashlib drops the
    GIL for each).

    Raises:
        FormatError: the file's size is not what ``st`` says (it is changing).
    """
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    offset = 0
    with memoryview(buffer) as view:
        while True:
            got = os.preadv(fd, [view], offset)
            if not got:
                break
            digest.update(view[:got])
            offset += got
    if offset != st.st_size:
        raise FormatError(f"the file was {st.st_size} bytes when opened and {offset} when hashed", path=path)
    return digest.hexdigest()


# --------------------------------------------------------------------------- memo and records

_MEMO: dict[StatKey, str] = {}
_NOTICES: set[str] = set()
_NOTICES_LOCK = threading.Lock()


def _remember(key: StatKey, digest: str) -> None:
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    _MEMO[key] = digest


def _first_notice(what: str) -> bool:
    with _NOTICES_LOCK:
        if what in _NOTICES:
            return False
        _NOTICES.add(what)
        return True


class _Records:
    """The digest cache directory, held open once checked: records are opened relative to its descriptor,
    so a path swapped after the check changes nothing. ``fd`` is None when the directory cannot be used."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path, self.fd = path, fd

    def lookup(self, key: StatKey) -> str | None:
        """The digest recorded for ``key``, or None (no record, or one that fails a check)."""
        return None if self.fd is None else self._read(_record_name(key), key)

    def _read(self, name: str, key: StatKey) -> str | None:
        record, problem = read_record(name, dir_fd=self.fd, max_bytes=_RECORD_MAX_BYTES)
        if problem is not None:
            logger.debug("packcache: digest record %s/%s ignored: %s", self.path, name, problem)
        expected = {"format": _RECORD_FORMAT, "dev": key[0], "ino": key[1], "size": key[2], "mtime_ns": key[3],
                    "ctime_ns": key[4]}  # fmt: skip
        if not isinstance(record, dict) or set(record) != {*expected, "sha256"}:
            return None
        # pinned by tests/test_identity.py::test_a_hostile_digest_cache_costs_a_rehash_never_wrong_bytes
        if any(type(record[field]) is not type(value) or record[field] != value for field, value in expected.items()):
            return None  # a record of another version of the file (or of another file): stale, not a digest
        digest = record["sha256"]
        return digest if isinstance(digest, str) and _SHA256_HEX.fullmatch(digest) else None

    def store(self, key: StatKey, digest: str) -> None:
        """Record ``digest`` for ``key`` (temp file + rename in the checked directory); failures only cost a rehash."""
        if self.fd is None:
            return
        try:
            self._write(_record_name(key), key, digest)
        except OSError as exc:
            _unusable(self.path, f"cannot write a record: {_errno_text(exc)}")

    def _write(self, name: str, key: StatKey, digest: str) -> None:
        assert self.fd is not None
        record = {"format": _RECORD_FORMAT, "dev": key[0], "ino": key[1], "size": key[2], "mtime_ns": key[3],
                  "ctime_ns": key[4], "sha256": digest}  # fmt: skip
        write_record(name, json.dumps(record, sort_keys=True).encode(), dir_fd=self.fd, prefix=_TEMP_PREFIX)
        self._prune()

    def store_location(self, digest: str, path: str) -> None:
        """Record where a file of content ``digest`` was hashed (``where/<sha256>``: a hint for publish)."""
        if self.fd is None:
            return
        record = json.dumps({"format": _LOCATION_FORMAT, "path": os.path.abspath(path)}).encode()
        if len(record) > _RECORD_MAX_BYTES:
            return
        with contextlib.suppress(OSError):
            with contextlib.suppress(FileExistsError):
                os.mkdir(_WHERE, _defaults.PRIVATE_DIR_MODE, dir_fd=self.fd)
            where = os.open(_WHERE, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            try:
                if trust_problem(os.fstat(where), directory=True) is not None:
                    return
                write_record(digest, record, dir_fd=where, prefix=_TEMP_PREFIX)
                self._prune_where(where)
            finally:
                os.close(where)

    def location(self, digest: str) -> str | None:
        """The path :meth:`store_location` recorded for ``digest``, or None."""
        if self.fd is None:
            return None
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        try:
            where = os.open(_WHERE, flags | os.O_DIRECTORY, dir_fd=self.fd)
        except OSError:
            return None
        try:
            record, _ = read_record(digest, dir_fd=where, max_bytes=_RECORD_MAX_BYTES)
        finally:
            os.close(where)
        if not isinstance(record, dict) or record.get("format") != _LOCATION_FORMAT:
            return None
        path = record.get("path")
        return path if isinstance(path, str) and path.startswith("/") and "\0" not in path else None

    @staticmethod
    def _prune_where(where: int) -> None:
        names = [n for n in os.listdir(where) if _SHA256_HEX.fullmatch(n)]
        if len(names) <= _MAX_RECORDS:
            return
        dated = []
        for name in names:
            with contextlib.suppress(OSError):
                dated.append((os.stat(name, dir_fd=where, follow_symlinks=False).st_mtime_ns, name))
        for _, name in sorted(dated)[: len(dated) - _MAX_RECORDS * 3 // 4]:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=where)

    def _prune(self) -> None:
        """Remove temp records of writers that died, and the oldest records past :data:`_MAX_RECORDS`."""
        assert self.fd is not None
        records: list[tuple[int, str]] = []
        for name in os.listdir(self.fd):
            with contextlib.suppress(OSError):
                lst = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if not stat.S_ISREG(lst.st_mode) or lst.st_uid != os.geteuid():
                    continue
                pid = parse_temp_name(name, _TEMP_PREFIX)
                if pid is not None:
                    if not pid_alive(pid):
                        os.unlink(name, dir_fd=self.fd)
                elif name.endswith(".json"):
                    records.append((lst.st_mtime_ns, name))
        if len(records) > _MAX_RECORDS:
            for _, name in sorted(records)[: len(records) - _MAX_RECORDS * 3 // 4]:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)


@contextlib.contextmanager
def _records(*, create: bool = False) -> Iterator[_Records]:
    """The digest cache directory (created ``0700`` with ``create``), opened and checked: this user's or root's,
    writable by its owner only. One that cannot be used finds nothing and records nothing (said once)."""
    try:
        path = digest_dir()
    except FileNotFoundError as exc:  # no home to keep it in (packcache._paths.home_dir): hashed every launch
        if create:
            _unusable("(none)", str(exc))
        yield _Records("", None)
        return
    if create:
        with contextlib.suppress(OSError):
            # every directory made on the way is 0700, not only the last; pinned by tests/test_paths.py::
            #   test_every_directory_made_on_the_way_to_the_default_cache_gets_the_private_mode
            make_dirs(path, _defaults.PRIVATE_DIR_MODE, what="digest cache")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if create or not isinstance(exc, FileNotFoundError):
            _unusable(path, f"cannot open it: {_errno_text(exc)}")
        yield _Records(path, None)
        return
    try:
        # pinned by tests/test_identity.py::test_a_hostile_digest_cache_costs_a_rehash_never_wrong_bytes
        problem = trust_problem(os.fstat(fd), directory=True)
        if problem is not None:
            _unusable(path, problem)
        yield _Records(path, fd if problem is None else None)
    finally:
        os.close(fd)


def _record_name(key: StatKey) -> str:
    """One record per file (device and inode): a new version of a file replaces its old record."""
    return f"{key[0]:x}-{key[1]:x}.json"


def _errno_text(exc: OSError) -> str:
    return f"{errno_mod.errorcode.get(exc.errno or 0, 'E?')} ({exc.strerror or exc})"


def _unusable(path: str, why: str) -> None:
    if _first_notice(f"dir:{path}"):
        logger.warning(
            "packcache: digest cache %s is not usable (%s): source files are hashed on every launch; "
            "set PACKCACHE_DIGEST_DIR to a directory of this user's", path, why,
        )  # fmt: skip
