"""Operator tools on cache files: verify, compact, inspect, gc.

Opening a cache never reads pack data (a warm launch must stay fast), so data
checksums are checked when a pack is stored and on demand, here. Compaction
rewrites the live packs of the newest generation into a new file (temp file,
fsync, rename under the build lock), dropping superseded bytes; processes that
have the old file mapped keep valid pages.

Every entry point opens paths through :mod:`packcache._paths` and keeps the rules
:class:`~packcache.WeightCache` keeps (docs/RELIABILITY.md "Entry points"):

* **Nothing blocks on a path.** A FIFO, socket, device or directory at a cache,
  lock or temp path is refused at once, never opened for reading or waited on.
* **Nothing is read through a mapping.** Pack bytes are read with ``pread``: a file
  truncated by someone else mid-way is a :class:`~packcache.errors.FormatError`,
  not a SIGBUS.
* **The same trust everywhere.** ``compact`` (it writes) refuses what the cache
  refuses; ``verify`` and ``inspect`` (read-only) still look, but report why the
  cache would refuse the file; ``gc`` deletes only files of its own user.
* **One lock per file.** Writers and deleters take the build lock of the file's
  resolved path (:func:`packcache._sidefiles.acquire_build_lock`), so a symlink or
  ``..`` spelling meets the lock the cache takes.
"""

from __future__ import annotations

import contextlib
import os
import reprlib
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import _boundedjson as boundedjson
from . import format as fmt
from ._generations import chunk_buffer, keep_owner, read_chunks, read_committed, read_generation, rewrite_live
from ._paths import DEFAULT_LOCK_TIMEOUT, open_checked, open_for_reading, resolve_trusted, trust_problem
from ._sidefiles import acquire_build_lock, lock_path_for, parse_temp_name, pid_alive, still_linked, temp_prefix
from .errors import FormatError, LockTimeoutError, UntrustedFileError

__all__ = [
    "CompactReport",
    "GcFile",
    "GcReport",
    "InspectEntry",
    "InspectReport",
    "VerifyProblem",
    "VerifyReport",
    "compact",
    "gc",
    "inspect",
    "verify",
    "verify_open",
    "verifying",
]

_UNTRUSTED = "WeightCache refuses this file (heap reason 'untrusted')"


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyProblem:
    """One thing wrong with a file: the entry (``None`` for structure or trust), where, and what."""

    entry: str | None
    offset: int
    message: str

    def __str__(self) -> str:
        what = f"entry {self.entry!r}" if self.entry is not None else "structure"
        return f"{what} at offset {self.offset}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found. ``ok`` when there is no problem.

    ``trust_problem`` is why :class:`~packcache.WeightCache` would refuse the file
    (``None``: it would use it); it is also the first of ``problems``, so an
    untrusted file is never ``ok``.
    """

    path: str
    generation: int
    entries: int
    checked_bytes: int
    problems: tuple[VerifyProblem, ...]
    trust_problem: str | None = None

    @property
    def ok(self) -> bool:
        """No problem at all: structure, checksums and trust."""
        return not self.problems


def verify(path: str | os.PathLike[str]) -> VerifyReport:
    """Check a cache file's trust, its structure and every pack's checksum.

    Reads the whole file with ``pread`` (never through a mapping, never blocking).
    A file the cache would refuse (another user's, group/world-writable, a symlink
    in an unsafe directory) is reported as a problem, and still checked: reading it
    is safe, and the checksums tell the operator whether it is merely misplaced or
    also damaged. A FIFO, socket, device or directory is reported, not read.
    Structure problems (docs/FORMAT.md rules) have ``entry=None``; a pack whose
    bytes do not match its checksum is reported by name and offset, in file order.

    Raises:
        OSError: the file cannot be opened or read (``FileNotFoundError``, EACCES, EIO).

    >>> import numpy as np, tempfile, os, packcache
    >>> p = os.path.join(tempfile.mkdtemp(), "m.pcache")
    >>> with packcache.WeightCache(p) as c, c.session() as s:
    ...     _ = s.get_or_pack("w", lambda: np.arange(4.0))
    >>> verify(p).ok
    True
    """
    name = os.fspath(path)
    try:
        fd, _, verdict = open_for_reading(name)
    except UntrustedFileError as exc:
        return VerifyReport(name, 0, 0, 0, (VerifyProblem(None, 0, f"untrusted: {exc.reason}"),), exc.reason)
    try:
        return verify_open(fd, name, verdict)
    finally:
        os.close(fd)


def verify_open(
    fd: int,
    name: str,
    verdict: str | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    only: Callable[[str], bool] | None = None,
) -> VerifyReport:
    """:func:`verify` of the cache file open as ``fd`` (``name`` for messages; ``verdict``: why the file would
    be refused, if it would): the file written, whatever its name resolves to meanwhile (a fetch's temp file).

    ``progress`` is called with the bytes of each chunk once it is checked (a caller paces the reads there: the
    background check of ``packcache serve``); ``only`` selects the entries checked by name (all by default).
    """
    problems = [VerifyProblem(None, 0, f"untrusted: {verdict}; {_UNTRUSTED}")] if verdict else []
    try:
        _, slot, entries = read_committed(fd, path=name)
    except FormatError as exc:
        problems.append(VerifyProblem(None, exc.offset or 0, str(exc)))
        return VerifyReport(name, 0, 0, 0, tuple(problems), verdict)
    problems += _newer_generations_broken(fd, name, slot)
    checked = 0
    ordered = sorted((e for e in entries.values() if only is None or only(e.name)), key=lambda e: e.offset)
    buffer = chunk_buffer(ordered)
    for entry in ordered:
        crc = 0
        try:
            for chunk in read_chunks(fd, entry.offset, entry.nbytes, buffer, name):
                crc = fmt.crc32(chunk, crc)
                if progress is not None:
                    progress(len(chunk))
        except FormatError as exc:
            problems.append(VerifyProblem(entry.name, entry.offset, str(exc)))
            continue
        checked += entry.nbytes
        if entry.nbytes and crc != entry.crc32:
            message = f"checksum {crc:08x} != stored {entry.crc32:08x} over {entry.nbytes} bytes"
            problems.append(VerifyProblem(entry.name, entry.offset, message))
    return VerifyReport(name, slot.generation if slot else 0, len(entries), checked, tuple(problems), verdict)


@contextlib.contextmanager
def verifying(on: bool = True) -> Iterator[None]:
    """Within the block, every cache made without an explicit ``verify`` checks each hit's checksum before serving
    it (the process default ``packed_cache_verify``, restored after): a load that checks every pack it maps, as
    ``run``, ``build`` and ``serve --verify`` load. A damaged pack is never served: a cache of a checkpoint packs it
    again; a cache file that holds its model, with nothing to pack it from, fails the load naming the entry.
    ``on=False`` changes nothing. Not for threads that make caches meanwhile: the default is the process's.

    >>> from packcache import WeightCache
    >>> with verifying():
    ...     WeightCache(None).verify
    True
    >>> WeightCache(None).verify
    False
    """
    if not on:
        yield
        return
    from .options import get_option, set_option

    before = get_option("packed_cache_verify")
    set_option("packed_cache_verify", True)
    try:
        yield
    finally:
        set_option("packed_cache_verify", before)


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


# --------------------------------------------------------------------------- compact


@dataclass(frozen=True)
class CompactReport:
    """What :func:`compact` did: sizes before and after, packs kept and dropped, the new generation."""

    path: str
    bytes_before: int
    bytes_after: int
    entries: int
    dropped: tuple[str, ...]  # packs whose bytes failed their checksum (they will be packed again)
    generation: int = 0

    @property
    def reclaimed_bytes(self) -> int:
        """Bytes the file shrank by."""
        return self.bytes_before - self.bytes_after


def compact(path: str | os.PathLike[str], *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> CompactReport:
    """Rewrite a cache file without superseded bytes.

    Refuses what :class:`~packcache.WeightCache` refuses, before writing anything
    (not even a lock file). Takes the build lock of the file's resolved path
    (waiting up to ``lock_timeout`` seconds), copies the newest generation's packs
    into a new file beside the resolved path with the same alignment, platform
    fingerprint, permission bits, owner and group, verifying each pack's checksum on
    the way (a pack that fails is dropped, not copied), then renames it over the
    resolved path (a symlink stays a symlink) and syncs the directory. Safe while
    other processes map the old file: their pages stay valid. If anything fails
    (ENOSPC, EPERM, Ctrl-C), the original is untouched and the temp file removed.

    Raises:
        UntrustedFileError: the file is another user's, group/world-writable, not a regular
            file, or a symlink in an unsafe directory (nothing is written).
        FormatError: the file is not a valid cache (nothing is written but the lock file).
        LockTimeoutError: another process held the build lock too long (a ``TimeoutError``).
        OSError: on I/O failure, or when the copy cannot be given the original's owner
            and group (compact a file as its owner); the original is left untouched.
    """
    name = os.fspath(path)
    # Trust first: an untrusted file or a FIFO is refused before anything is created.
    fd, st = open_checked(name, noatime=True)
    descriptors = [fd]
    try:
        real = resolve_trusted(name)  # renamed over: never through a symlink another user planted
        if not still_linked(fd, real):
            raise UntrustedFileError(name, "it was replaced while being opened")
        lock_path = lock_path_for(real)
        lock_fd = acquire_build_lock(
            real, lock_timeout, _lock_mode(real, stat.S_IMODE(st.st_mode)),
            # Whoever can use the cache must be able to lock it too.
            on_created=lambda created: keep_owner(created, st, lock_path),
        )  # fmt: skip
        descriptors.append(lock_fd)
        if not still_linked(fd, real):
            # A builder renamed a rebuilt file over the path before we got the lock: compact that one.
            fd, st = open_checked(real, noatime=True)
            descriptors.append(fd)
        return _compact_locked(name, real, fd, st)
    finally:
        for descriptor in reversed(descriptors):
            os.close(descriptor)


def _lock_mode(path: str, fallback: int) -> int:
    """The mode to open ``path``'s lock file with: an existing lock's own (``open_lock`` would chmod
    it otherwise), else the cache file's, as WeightCache creates it (never group/world-writable)."""
    with contextlib.suppress(OSError):
        lst = os.lstat(lock_path_for(path))
        if stat.S_ISREG(lst.st_mode):
            return stat.S_IMODE(lst.st_mode)
    return fallback & 0o644


def _compact_locked(name: str, real: str, fd: int, st: os.stat_result) -> CompactReport:
    # Compaction is no use of the cache: the copy keeps the original's access time (gc's LRU order).
    rewritten = rewrite_live(fd, st, real, path=name, atime_ns=st.st_atime_ns)
    os.close(rewritten.fd)
    return CompactReport(
        name, st.st_size, rewritten.slot.committed_end, len(rewritten.kept), rewritten.dropped,
        rewritten.slot.generation,
    )  # fmt: skip


# --------------------------------------------------------------------------- inspect

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120


@dataclass(frozen=True)
class InspectEntry:
    """One pack as :func:`inspect` lists it. ``packer`` is ``"?"`` when the key is not readable JSON."""

    name: str
    packer: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class InspectReport:
    """What :func:`inspect` read: layout, generation, fingerprint, entries, sizes, and the trust verdict.

    ``platform`` is the parsed fingerprint, or a printable placeholder string when it is
    not bounded JSON (too deep, huge integers, not UTF-8). ``trust_problem`` is why
    :class:`~packcache.WeightCache` would refuse the file; ``None`` when it would use it.
    """

    path: str
    format_version: int
    generation: int
    alignment: int
    data_start: int
    platform: Any
    file_bytes: int
    live_bytes: int
    index_bytes: int
    reclaimable_bytes: int
    entries: tuple[InspectEntry, ...]
    owner_uid: int
    owner_gid: int
    mode: int
    trust_problem: str | None

    @property
    def trusted(self) -> bool:
        """Whether WeightCache would use this file (``trust_problem`` is None)."""
        return self.trust_problem is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``packcache inspect --json`` prints)."""
        return {
            "path": self.path,
            "format_version": self.format_version,
            "generation": self.generation,
            "alignment": self.alignment,
            "data_start": self.data_start,
            "platform": self.platform,
            "file_bytes": self.file_bytes,
            "live_bytes": self.live_bytes,
            "index_bytes": self.index_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "owner_uid": self.owner_uid,
            "owner_gid": self.owner_gid,
            "mode": f"{self.mode:04o}",
            "trusted": self.trusted,
            "trust_problem": self.trust_problem,
            "entries": [
                {"name": e.name, "packer": e.packer, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset,
                 "nbytes": e.nbytes}
                for e in self.entries
            ],
        }  # fmt: skip


def inspect(path: str | os.PathLike[str]) -> InspectReport:
    """Read a cache file's header, newest generation and index, without reading pack data.

    A read-only look: a file :class:`~packcache.WeightCache` would refuse is still
    shown, with the reason in ``trust_problem``. Pack keys and the fingerprint are
    parsed with bounds (:mod:`packcache._boundedjson`): deep nesting, huge integers or
    bytes that are not UTF-8 become a placeholder, never an exception.

    Raises:
        FormatError: the file is not a valid cache file.
        UntrustedFileError: the path is not a regular file (a FIFO, socket, device, directory).
        OSError: it cannot be opened or read.

    >>> import numpy as np, tempfile, os, packcache
    >>> p = os.path.join(tempfile.mkdtemp(), "m.pcache")
    >>> with packcache.WeightCache(p) as c, c.session() as s:
    ...     _ = s.get_or_pack("w", lambda: np.arange(4.0), key={"packer": "f8", "version": 1})
    >>> report = inspect(p)
    >>> report.generation, report.entries[0].packer, report.trusted
    (1, 'f8/1', True)
    """
    name = os.fspath(path)
    fd, st, verdict = open_for_reading(name)
    try:
        header, slot, entries = read_committed(fd, path=name)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    ordered = sorted(entries.values(), key=lambda e: e.offset)
    return InspectReport(
        path=name,
        format_version=header.format_version,
        generation=slot.generation if slot else 0,
        alignment=header.alignment,
        data_start=header.data_start,
        platform=_json_or_placeholder(header.platform, "platform fingerprint") if header.platform else {},
        file_bytes=size,
        live_bytes=sum(e.nbytes for e in ordered),
        index_bytes=slot.index_size if slot else 0,
        reclaimable_bytes=max(0, size - fmt.compacted_size(ordered, header)) if slot else 0,
        entries=tuple(InspectEntry(e.name, _packer_of(e.key), e.dtype, e.shape, e.offset, e.nbytes) for e in ordered),
        owner_uid=st.st_uid,
        owner_gid=st.st_gid,
        mode=stat.S_IMODE(st.st_mode),
        trust_problem=verdict,
    )


def _json_or_placeholder(raw: bytes, what: str) -> Any:
    try:
        return boundedjson.loads(raw, what=what)
    except FormatError as exc:
        return f"<{len(raw)} bytes that are not bounded JSON: {exc}>"


def _packer_of(key: bytes) -> str:
    """``packer/version`` from a pack key, ``"?"`` when the key is not bounded JSON."""
    try:
        value = boundedjson.loads(key, what="pack key")
    except FormatError:
        return "?"
    if not isinstance(value, dict):
        return ""
    packer = value.get("packer", "")
    version = value.get("version", value.get("packer_version"))
    text = f"{_text(packer)}/{_text(version)}" if packer and version is not None else _text(packer)
    return text


def _text(value: object) -> str:
    return value if isinstance(value, str) and len(value) <= 120 else _SHORT.repr(value)


# --------------------------------------------------------------------------- gc


@dataclass(frozen=True)
class GcFile:
    """A file :func:`gc` removed (or, in a dry run, would remove), or one it kept and why.

    ``stale``: a temp file of a dead builder or an invalid cache file (always removed
    first, whatever the budget); otherwise a valid cache removed as least recently used.
    ``busy``: kept because a live process holds its build lock (or, for a temp file, is its builder).
    """

    path: str
    bytes: int
    stale: bool
    reason: str
    busy: bool = False


@dataclass(frozen=True)
class GcReport:
    """What :func:`gc` did to a directory: bytes of packcache files before and after, removed and kept files.

    ``bytes_before``/``bytes_after`` count every cache file and temp file of the
    directory (kept ones included), once per inode.
    """

    directory: str
    max_bytes: int
    dry_run: bool
    bytes_before: int
    bytes_after: int
    removed: tuple[GcFile, ...]
    kept: tuple[GcFile, ...]

    @property
    def fits(self) -> bool:
        """Whether the directory's packcache files now fit ``max_bytes``."""
        return self.bytes_after <= self.max_bytes


@dataclass
class _Candidate:
    path: str
    st: os.stat_result
    stale: bool
    reason: str
    cache_path: str  # whose build lock guards it: itself, or the cache a temp file was for
    pid: int | None = None  # a temp file's builder
    refusal: str | None = None  # why gc must leave it alone


def gc(directory: str | os.PathLike[str], max_bytes: int, *, dry_run: bool = False) -> GcReport:
    """Remove stale packcache files from ``directory``, then least recently used caches, until it fits.

    What counts: regular files that start with packcache's magic, and temp files named
    exactly as :func:`packcache._sidefiles.create_temp` names them (``.<cache>.tmp-<pid>-<16 hex>``).
    Anything else — a user's ``.notes.tmp-draft``, lock files, symlinks (never followed),
    FIFOs, sockets, devices, directories — is neither opened for reading nor deleted.

    What may be deleted, all of:

    * the file is owned by this effective user (as root: by root; a service user's
      caches in a shared directory are left to that user), is not group/world-writable,
      and has no other hard link (deleting one name would free nothing);
    * a temp file: its builder pid no longer exists;
    * gc holds the build lock of the cache (for a temp file: of the cache it was for),
      taken without waiting through :func:`packcache._sidefiles.acquire_build_lock`, so no
      builder can be appending, renaming or starting meanwhile; a held lock keeps the file;
    * under that lock the name still holds the inode that was examined.

    Stale files (temp files of dead builders, invalid caches) go first, whatever the
    budget; then valid caches by access time (reloading a cache writes nothing, so
    atime is the only record of use), until the counted bytes fit ``max_bytes``.
    A process mapping a removed cache keeps valid pages; its next launch rebuilds.

    Args:
        directory: the cache directory (not recursed into).
        max_bytes: the byte budget for packcache files in it.
        dry_run: remove nothing (and create no lock file); report what would go.

    Raises:
        OSError: the directory cannot be listed.

    >>> import tempfile
    >>> gc(tempfile.mkdtemp(), 0).fits
    True
    """
    name = os.fspath(directory)
    candidates = _gc_candidates(name)
    seen: set[tuple[int, int]] = set()
    total = 0
    for c in candidates:
        if (c.st.st_dev, c.st.st_ino) not in seen:
            seen.add((c.st.st_dev, c.st.st_ino))
            total += c.st.st_size
    before = total
    removed: list[GcFile] = []
    kept: list[GcFile] = []
    for c in sorted(candidates, key=lambda c: (not c.stale, c.st.st_atime)):
        if total <= max_bytes and not c.stale:
            break
        refusal = (c.refusal, False) if c.refusal else _remove(c, dry_run)
        if refusal is not None:
            kept.append(GcFile(c.path, c.st.st_size, c.stale, *refusal))
            continue
        total -= c.st.st_size
        removed.append(GcFile(c.path, c.st.st_size, c.stale, c.reason))
    return GcReport(name, max_bytes, dry_run, before, total, tuple(removed), tuple(kept))


def _gc_candidates(directory: str) -> list[_Candidate]:
    euid = os.geteuid()
    found = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        try:
            lst = os.lstat(path)
        except OSError:
            continue  # gone meanwhile
        if not stat.S_ISREG(lst.st_mode) or entry.endswith(".lock"):
            continue  # lock files are never replaced, so never deleted; the rest is not ours
        candidate = _temp_candidate(directory, entry, lst) or _cache_candidate(path)
        if candidate is None:
            continue
        st = candidate.st
        # pinned by tests/test_maintenance.py::test_gc_as_root_leaves_a_service_users_cache_and_temp_alone
        if st.st_uid != euid:
            candidate.refusal = f"owned by uid {st.st_uid}: gc removes only files of its own user ({euid})"
        elif trust_problem(st) is not None:
            candidate.refusal = f"untrusted: {trust_problem(st)}"
        # pinned by tests/test_maintenance.py::test_gc_never_follows_or_removes_symlinks_and_leaves_hard_links_alone
        elif st.st_nlink != 1:
            candidate.refusal = f"it has {st.st_nlink} hard links: removing one name frees nothing"
        found.append(candidate)
    return found


def _temp_candidate(directory: str, entry: str, lst: os.stat_result) -> _Candidate | None:
    """A temp file of cache ``.<cache>.tmp-<pid>-<16 hex>``, exactly as create_temp names them."""
    if not entry.startswith(".") or ".tmp-" not in entry:
        return None
    cache_path = os.path.join(directory, entry[1 : entry.rindex(".tmp-")])
    pid = parse_temp_name(entry, temp_prefix(cache_path))
    if pid is None:
        return None
    reason = f"temp file of builder pid {pid}, which is gone"
    return _Candidate(os.path.join(directory, entry), lst, True, reason, cache_path, pid)


def _cache_candidate(path: str) -> _Candidate | None:
    """A file that starts with packcache's magic; stale if it breaks docs/FORMAT.md."""
    try:
        # A read-only look (no owner check needed yet) that must not make the file the most recently used.
        fd, st = open_checked(path, trust=False, noatime=True)
    except OSError:
        return None  # unreadable, or swapped for something else since the lstat: not ours to judge
    try:
        if os.pread(fd, len(fmt.MAGIC), 0) != fmt.MAGIC:
            return None  # not a packcache file: never touched
        try:
            read_committed(fd, path=path)
        except FormatError as exc:
            return _Candidate(path, st, True, f"invalid cache file: {exc}", path)
        return _Candidate(path, st, False, "least recently used", path)
    except OSError:
        return None
    finally:
        os.close(fd)


def _remove(c: _Candidate, dry_run: bool) -> tuple[str, bool] | None:
    """Remove ``c`` under its cache's build lock; ``None`` when removed, else why it was kept
    and whether a live process is the reason."""
    if c.pid is not None and pid_alive(c.pid):
        return f"its builder (pid {c.pid}) is alive", True
    lock_path = lock_path_for(c.cache_path)
    lock_fd = None
    try:
        lock_fd = acquire_build_lock(
            c.cache_path, 0, _lock_mode(c.cache_path, stat.S_IMODE(c.st.st_mode)), create=not dry_run
        )  # a dry run creates no lock file
    except LockTimeoutError:
        # pinned by
        # tests/test_maintenance.py::test_gc_keeps_a_dead_builders_temp_while_another_process_holds_the_caches_lock
        return f"a live process holds the build lock {lock_path}", True
    except FileNotFoundError:
        pass  # dry run, and no lock file: nobody can hold it
    except OSError as exc:  # a FIFO, symlink or foreign file at the lock path: refused, never waited on
        return f"cannot take the build lock: {exc}", False
    try:
        try:
            now = os.lstat(c.path)
        except FileNotFoundError:
            return "it was removed meanwhile", False
        if (now.st_dev, now.st_ino) != (c.st.st_dev, c.st.st_ino):
            return "it was replaced meanwhile", False
        if c.pid is not None and pid_alive(c.pid):
            return f"its builder (pid {c.pid}) is alive", True
        if not dry_run:
            try:
                os.unlink(c.path)
            except OSError as exc:
                return f"cannot remove it: {exc}", False
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    return None
