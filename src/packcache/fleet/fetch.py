"""Fetching a published cache file: checked before, during and after the download.

:func:`fetch` is what ``packcache fetch`` and a ``WeightCache(remote=...)`` miss run
(docs/FLEET.md, "Fetching"). Under the build lock of the local file (one download per machine):

1. read the manifest ``manifests/<model>/<class>.json`` (bounded), check its signature against
   the trusted keys, its model and class against this file's, its expiry, and its generation
   against the last one accepted from that store (no rollback: the records of this user and of the
   cache's directory, :func:`accepted_generation`);
2. read the blob's header by a range read: the platform must be this machine's;
3. check the local path as the cache would open it (no symlink another user could have planted on its
   way, no file there the cache would refuse: :func:`packcache._paths.open_trusted_parent`,
   :func:`packcache._paths.trust_problem`) and the free space of the cache directory;
4. download the blob into a preallocated temp file beside the local file by concurrent range reads written
   in place, hashed in order as the parts land (:mod:`packcache.fleet._download`; no byte past the manifest's
   size is asked for); check size and sha256, ``fsync``, verify every pack's checksum,
   and only then rename it over the local path (a mapped file is never truncated or rewritten:
   processes mapping the old one keep it), and record the stat it was verified at: a process that waited
   for the lock maps that file without hashing it again (:func:`_local_is`).

Every problem raises :class:`~packcache.errors.RemoteError` with one of
:data:`packcache.stats.REMOTE_REASONS` and leaves nothing behind but the lock file. Two bounds, both on the
time spent waiting on the store (a :class:`~packcache.fleet.stores.StoreClock`: the local work between and inside
the store calls, hashing, checking signatures, verifying and writing the file, waiting for the build lock, is the
machine's and never counts): a store that makes no progress for ``timeout`` seconds (no answer to the manifest or
header read, a stalled download) is ``remote_timeout``; ``total_timeout`` bounds all the store calls together, a
long healthy download included. A fetch killed mid-download leaves its temp file: the next holder of the build
lock (a fetch, a build) removes it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import _defaults
from .. import _faults as faults
from .. import format as fmt
from .._paths import (
    TrustedParent,
    make_dirs,
    open_checked,
    open_trusted_parent,
    resolve_trusted,
    trust_problem,
    user_cache_home,
)
from .._progress import bar as progress_bar
from .._sidefiles import (
    acquire_build_lock,
    create_temp,
    lock_path_for,
    read_record,
    remove_orphans,
    temp_prefix,
    write_record,
)
from .._storeurl import StoreURL, parse_store_url
from ..errors import FormatError, LockTimeoutError, RemoteError, UntrustedFileError
from ..identity import hash_file
from ..maintenance import verify_open
from ._download import download_into
from .keys import load_public_keys
from .manifest import (
    MAX_ENVELOPE_BYTES,
    Manifest,
    check_generation,
    check_manifest,
    check_model,
    check_publish_target,
    manifest_key,
)
from .platform import platform_class
from .stores import Store, StoreClock, open_store

__all__ = [
    "FetchReport",
    "accepted_file",
    "accepted_generation",
    "check_fetch_target",
    "file_identity",
    "fetch",
    "last_accepted",
    "load_trusted_keys",
    "state_dir",
]

logger = logging.getLogger("packcache")

_MARGIN = 1 << 20  # free space to leave besides the blob
_STATE_MAX_BYTES = 4096


def load_trusted_keys(keys: Sequence[bytes | str]) -> list[bytes]:
    """PEM bytes of each trusted key: ``bytes`` as given, a ``str`` read as the path of a public key file
    (:func:`packcache.fleet.keys.load_public_keys`: bounded, never blocking on a FIFO, checked).

    Raises:
        RemoteError: ``remote_untrusted``, naming a key file that cannot be read.
    """
    loaded = []
    for key in keys:
        if isinstance(key, bytes):
            loaded.append(key)
            continue
        try:
            loaded.extend(load_public_keys([key]))
        except (OSError, FormatError, UntrustedFileError) as exc:
            raise RemoteError("remote_untrusted", f"cannot use the trusted key: {exc}", url=key) from None
    return loaded


@dataclass(frozen=True)
class FetchReport:
    """What :func:`fetch` did. ``downloaded`` is False when the local file already was the published one.
    ``url`` is the store's redacted URL (no credentials, query or fragment)."""

    url: str
    path: str
    model: str
    platform_class: str
    generation: int
    sha256: str
    size: int
    downloaded: bool
    bytes: int  # bytes read from the store (manifest, header and blob)
    seconds: float
    signed_by: str | None
    download_seconds: float = 0.0  # the blob's download: range reads, written in place and hashed (0 when none)
    download_mbps: float = 0.0  # the blob's bytes over ``download_seconds``, in MB/s (10**6 bytes); 0 when none

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def state_dir() -> str:
    """Where this user keeps the last generation accepted per (store, model, class):
    ``$XDG_CACHE_HOME/packcache/fleet`` (or ``~/.cache/packcache/fleet``). A second record lies beside
    the cache file (:func:`accepted_generation`)."""
    return os.path.join(user_cache_home(), "fleet")


def check_fetch_target(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(absolute path, model)`` of a local cache file :func:`fetch` may fill: its name must be a model's
    (:func:`packcache.fleet.manifest.check_name`, ``.pcache`` dropped), as publish names it.

    Raises:
        ValueError: the file name names no model (e.g. a space in it).
    """
    name = os.path.abspath(os.fspath(path))
    return name, check_publish_target(name)  # the one rule, shared with publish


def fetch(
    url: str | StoreURL,
    path: str | os.PathLike[str],
    *,
    platform: bytes,
    trusted_keys: Sequence[bytes] = (),
    allow_unsigned: bool = False,
    timeout: float = _defaults.REMOTE_TIMEOUT,
    total_timeout: float | None = None,
    lock_timeout: float = _defaults.LOCK_TIMEOUT,
    file_mode: int = _defaults.FILE_MODE,
    dir_mode: int = _defaults.DIR_MODE,
    store: Store | None = None,
    model: str | None = None,
    generation: int | None = None,
    clock: StoreClock | None = None,
) -> FetchReport:
    """Make ``path`` the cache file published at ``url`` for its model and this platform.

    Args:
        platform: this machine's canonical platform bytes (``WeightCache.platform``); the
            published file must have been built under the same.
        trusted_keys: ed25519 public keys (SubjectPublicKeyInfo PEM bytes); one must have
            signed the manifest, unless ``allow_unsigned``.
        timeout: seconds the store may make no progress: the manifest and header reads (each whole),
            connecting, a stalled download.
        total_timeout: seconds all the store calls may take together, the download included (``None``:
            ``timeout``). Only time waiting on the store counts: hashing, signature checks, verifying and
            writing the file, and waiting for another process's download (``lock_timeout``) do not.
        lock_timeout: seconds to wait for another process fetching or building the same file.
        store: an open store to use instead of opening ``url`` (kept open).
        model: the model whose manifest names the file, when ``path``'s name is not it: a published name
            (:func:`packcache.fleet.manifest.check_model`, e.g. ``org/model-int8``; :mod:`packcache.fleet.names`).
        generation: fetch that generation's immutable copy (``manifests/<model>/<class>@<G>.json``, which a
            publish by name leaves) instead of the current manifest; the rollback record is never lowered.
        clock: the store time already spent by the caller and its bounds, instead of a new clock of
            ``total_timeout`` and ``timeout`` (:func:`packcache.fleet.names.fetch_name` shares one over the
            classes it tries).

    Raises:
        ValueError: ``url`` is not a store URL, or ``path``'s name names no model, or ``model`` or ``generation``
            is none a store key can hold (before any I/O).
        RemoteError: the reason says what failed; nothing was written but the lock file.
    """
    started = time.monotonic()
    # Every argument is checked before the first store call or file write.
    # pinned by tests/test_cli_fleet_input.py::test_bad_input_is_one_line_exit_2_nothing_uploaded
    location = store.location if store is not None else parse_store_url(url)
    if model is None:
        name, model = check_fetch_target(path)
    else:
        name = os.path.abspath(os.fspath(path))
    stall = float(timeout)
    if clock is None:
        total = stall if total_timeout is None else float(total_timeout)
        clock = StoreClock(total, stall, what=f"the fetch of {model!r}", url=location.display)
    cls = platform_class(platform)
    manifest_key(check_model(model), cls, generation)  # a bad model or generation: ValueError, before any I/O
    with faults.translating_into(functools.partial(_lock_error, name)):
        # The file the cache would open: never through a symlink another user planted (the cache refuses it as
        # untrusted; renaming over its target destroyed a root-owned file); pinned by
        #   tests/test_fleet_trust.py::test_fetch_through_a_symlink_nobody_planted_is_refused_and_its_target_kept
        make_dirs(os.path.dirname(name), dir_mode)  # as the cache makes them: each directory made gets dir_mode
        real = resolve_trusted(name)  # what the directories made resolve to
        lock_fd = acquire_build_lock(real, lock_timeout, file_mode)  # as FileStore opens it
        try:
            # The cache's directory, held open from a walk of the path: the record beside the file and the
            # download are made and renamed in it, so no directory renamed on the way meanwhile sends them
            # elsewhere; pinned by tests/test_fleet_trust.py::
            #   test_a_directory_swapped_for_a_symlink_during_a_fetch_is_never_written_through
            parent = open_trusted_parent(real)
        except BaseException:
            os.close(lock_fd)
            raise
    try:
        # Every temp of this file was left by a writer killed holding this lock: pinned by
        #   tests/test_fleet_trust.py::test_a_fetch_killed_mid_download_leaves_a_temp_the_next_fetch_removes
        with contextlib.suppress(OSError):
            remove_orphans(real)
        with contextlib.ExitStack() as stack:
            if store is None:
                store = stack.enter_context(open_store(location, timeout=stall))
            return _fetch_locked(store, location.display, name, parent, model, cls, platform, trusted_keys,
                                 allow_unsigned, clock, started, file_mode, generation)  # fmt: skip
    finally:
        parent.close()
        os.close(lock_fd)


def _fetch_locked(
    store: Store, url: str, name: str, parent: TrustedParent, model: str, cls: str, platform: bytes,
    trusted_keys: Sequence[bytes], allow_unsigned: bool, clock: StoreClock, started: float, file_mode: int,
    pinned: int | None = None,
) -> FetchReport:  # fmt: skip
    key = manifest_key(model, cls, pinned)
    # The store's identity first: no store call stands between reading the manifest and checking it, so what the
    # manifest is (untrusted, stale, another model's) is never hidden behind a later call's timeout.
    # pinned by tests/test_fleet_deadline.py::test_a_slow_step_never_hides_an_untrusted_manifest_behind_a_timeout
    identity = clock.call(lambda deadline: store.identity(deadline=deadline))
    # A small read is whole within the stall bound: a store that accepts and never answers costs that,
    # whatever the overall budget; the download (below) has the budget left, its stalls cut by the store.
    # pinned by tests/test_fleet_deadline.py::test_the_init_recipe_ends_fast_against_a_silent_store
    # and ::test_a_slow_healthy_download_is_not_cut_by_the_stall_bound
    data, _ = clock.call(lambda deadline: store.get(key, deadline=deadline, max_bytes=MAX_ENVELOPE_BYTES))
    read = len(data)
    real = parent.real
    records = _records(identity, parent, model, cls)
    accepted = [a for a in (accepted_generation(path, dir_fd=fd) for path, fd in records) if a is not None]
    if pinned is not None:  # an older generation asked for by number is no rollback; another blob for it is
        accepted = [a for a in accepted if a[0] == pinned]
    manifest, signed_by = check_manifest(
        data, model=model, platform_class=cls, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned,
        accepted=max(accepted, default=None), url=url, pinned=pinned,
    )  # fmt: skip
    for generation, sha256 in accepted:  # every trusted record, not only the newest: a same-generation other blob
        check_generation(manifest, generation, last_blob_sha256=sha256)
    done = _local_is(real, manifest, [(path, fd) for path, fd in records if fd is not None])
    download_seconds = 0.0
    if not done:
        _check_target(parent, name)
        blob, download_seconds = _download(store, url, name, parent, manifest, platform, clock, file_mode)
        read += blob
    landed = _identity_at(parent)
    for path, fd in records:
        # The record's temp file has the cache file's temp shape: a fetch killed while writing it leaves one the
        # next holder of the lock (or gc) removes; pinned by tests/test_fleet_trust.py::
        #   test_a_record_temp_a_killed_fetch_left_beside_the_cache_is_removed_by_the_next_fetch
        _accept(path, manifest, dir_fd=fd, temp=temp_prefix(parent.real) if fd is not None else None,
                file_id=landed if fd is not None else None)  # fmt: skip
    return FetchReport(
        url=url, path=name, model=model, platform_class=cls, generation=manifest.generation,
        sha256=manifest.blob_sha256, size=manifest.size, downloaded=not done, bytes=read,
        seconds=round(time.monotonic() - started, 3), signed_by=signed_by, download_seconds=round(download_seconds, 3),
        download_mbps=_mbps(manifest.size if not done else 0, download_seconds),
    )  # fmt: skip


def _mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e6, 1) if nbytes and seconds > 0 else 0.0


def _local_is(name: str, manifest: Manifest, records: Sequence[tuple[str, int]] = ()) -> bool:
    """Whether the local file already holds exactly the published blob (then nothing is downloaded). A record
    beside the file (``records``: (name, directory descriptor)) that accepted this blob for the very file there
    now (:func:`file_identity`) says so without reading it: a warm start of a 2 GB file hashes nothing."""
    try:
        fd, st = open_checked(name)
    except (OSError, UntrustedFileError):
        return False
    try:
        if st.st_size != manifest.size:
            return False
        # pinned by tests/test_fleet_names.py::test_a_warm_fetch_by_name_reads_only_the_manifest_and_hashes_nothing
        # and ::test_workers_that_waited_for_the_download_map_it_without_hashing_it, and by
        #   tests/test_fleet_download.py::test_processes_that_waited_for_a_fetch_map_it_without_hashing_it_again
        here = file_identity(st)
        for path, dir_fd in records:
            record = _read_accepted(path, dir_fd=dir_fd)
            if record is not None and record[1:] == (manifest.blob_sha256, here):
                logger.info("packcache: %s was accepted by the fetch that landed it; not hashed again", name)
                return True
        logger.info("packcache: hashing %s to compare it with the published blob", name)
        return hash_file(fd, name, st) == manifest.blob_sha256
    except (OSError, FormatError):  # unreadable, or changing under us: not the published bytes
        return False
    finally:
        os.close(fd)


def _check_target(parent: TrustedParent, name: str) -> None:
    """What the cache would refuse at ``name``'s file in the directory ``parent`` holds (the entry the download is
    renamed over), fetch never renames over: a FIFO, a directory, another user's file, one others can write (the
    cache's rule, :func:`packcache._paths.trust_problem`)."""
    real = parent.real
    try:
        st = os.stat(parent.name, dir_fd=parent.fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _write_error(exc, name) from None
    # pinned by tests/test_fleet_trust.py::test_fetch_never_renames_over_a_file_the_cache_would_refuse
    problem = trust_problem(st)
    if problem is not None:
        raise RemoteError("remote_write_failed", f"untrusted cache file {real}: {problem}", url=name)


def _download(
    store: Store, url: str, name: str, parent: TrustedParent, manifest: Manifest, platform: bytes, clock: StoreClock,
    file_mode: int,
) -> tuple[int, float]:  # fmt: skip
    """Download the published blob beside ``name`` and rename it over it; returns (bytes read, download seconds)."""
    blob = manifest.blob_key
    where = f"{url.rstrip('/')}/{blob}"  # url: the redacted display form
    # No HEAD first: the download refuses more bytes than the manifest's size before taking any, and
    # fewer are caught below (a HEAD costs a round trip, and on a directory store a hash of the blob).
    head = clock.call(lambda deadline: store.get_range(blob, 0, min(fmt.HEADER_READ_SIZE, manifest.size),
                                                       deadline=deadline))  # fmt: skip
    try:
        header = fmt.decode_header(head, path=where)
    except FormatError as exc:
        raise RemoteError("remote_corrupt", f"not a packcache file: {exc}", url=where) from None
    if header.platform != platform:
        raise RemoteError(
            "remote_incompatible", "its header names another platform than this machine's (the manifest's class "
            "does not match its blob)", url=where,
        )  # fmt: skip
    # The temp goes beside the file it replaces, in the directory held open: one rename, one directory.
    directory = os.path.dirname(parent.real)
    with _writing(directory):
        vfs = os.fstatvfs(parent.fd)
    free = vfs.f_bavail * vfs.f_frsize
    if free < manifest.size + _MARGIN:
        raise RemoteError(
            "remote_no_space", f"{free} bytes free in {directory}, the file needs {manifest.size}", url=where,
            errno=errno.ENOSPC,
        )  # fmt: skip
    with _writing(directory):
        fd, temp = create_temp(parent.real, file_mode, dir_fd=parent.fd)
    try:
        _preallocate(fd, manifest.size, temp)
        began = time.monotonic()
        # Concurrent range reads written in place, hashed in order as they land (fleet/_download.py); no more
        # bytes than the manifest's size are ever asked for. pinned by
        #   tests/test_fleet_download.py::test_parts_land_at_their_offsets_in_a_blob_of_several_uneven_parts
        with progress_bar(manifest.size, f"fetching {os.path.basename(name)}", nbytes=True) as tick:
            sha256 = download_into(
                store, blob, fd, manifest.size, clock=clock, streams=_defaults.FETCH_STREAMS,
                part_bytes=_defaults.FETCH_PART_BYTES, where=where, tick=tick,
                write_error=functools.partial(_write_error, where=temp),
            )  # fmt: skip
        seconds = time.monotonic() - began
        if sha256 != manifest.blob_sha256:
            raise RemoteError(
                "remote_corrupt", f"{manifest.size} bytes with sha256 {sha256[:16]}..., the manifest says "
                f"{manifest.blob_sha256[:16]}...", url=where,
            )  # fmt: skip
        with _writing(temp):
            os.fsync(fd)
        report = verify_open(fd, temp)  # the file written, whatever its name resolves to now
        if not report.ok:
            raise RemoteError("remote_corrupt", f"it fails verification: {report.problems[0]}", url=where)
        with _writing(name):
            parent.rename_over(temp)
            os.fsync(parent.fd)
    except BaseException:
        parent.unlink_quietly(temp)
        raise
    finally:
        os.close(fd)
    return manifest.size + len(head), seconds


def _preallocate(fd: int, size: int, temp: str) -> None:
    """Reserve the blob's blocks before the parts are written out of order: a full disk is found at once
    (``remote_no_space``), not by a worker half way through, and the file is not fragmented by the holes."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem without it: the writes find a full disk instead
        raise _write_error(exc, temp) from None


def _write_reason(err: int) -> str:
    """The remote miss a failed local write is: the fleet's own table over :data:`packcache._faults.NO_SPACE_ERRNOS`."""
    return "remote_no_space" if err in faults.NO_SPACE_ERRNOS else "remote_write_failed"


def _write_error(exc: OSError, where: str) -> RemoteError:
    code = exc.errno or 0
    return RemoteError(_write_reason(code), f"{faults.errno_name(code)}: {exc.strerror or exc}", url=where, errno=code)


def _writing(where: str) -> contextlib.AbstractContextManager[None]:
    """Every ``OSError`` of the body as its remote miss (:func:`_write_error`), ``where`` named."""
    return faults.translating_into(functools.partial(_write_error, where=where))


def _lock_error(name: str, exc: OSError) -> RemoteError:
    """What failing to take the local file's build lock is: waiting too long is ``remote_timeout``."""
    if isinstance(exc, LockTimeoutError):
        return RemoteError("remote_timeout", f"another process held the build lock: {exc}", url=name)
    if isinstance(exc, UntrustedFileError):
        return RemoteError("remote_write_failed", str(exc), url=name)
    return _write_error(exc, lock_path_for(name))


# --------------------------------------------------------------------------- accepted generations


def _digest(identity: str, model: str, cls: str) -> str:
    # pinned by tests/test_fleet_rollback.py::test_a_replayed_manifest_is_refused_through_every_spelling_of_the_store
    return hashlib.sha256(f"{identity}\0{model}\0{cls}".encode()).hexdigest()[:32]


def _records(identity: str, parent: TrustedParent, model: str, cls: str) -> list[tuple[str, int | None]]:
    """The two accepted-generation records of (store, model, class), each a (path, directory descriptor it
    is relative to): this user's, under :func:`state_dir`, and one beside the cache file, in the cache's
    directory held open (a pod's fresh home in front of a persistent cache volume still has the volume's).
    Keyed by the store's canonical identity (:meth:`Store.identity`): every spelling of one store,
    credentials or none, finds the same records."""
    digest = _digest(identity, model, cls)
    return [
        (os.path.join(state_dir(), f"{digest}.json"), None),
        # pinned by tests/test_fleet_rollback.py::test_a_fresh_pod_home_in_front_of_the_cache_volume_refuses_a_replay
        (f".{parent.name}.accepted-{digest}.json", parent.fd),
    ]


def last_accepted(store: Store, model: str, platform_class: str, *, deadline: float) -> tuple[int, str] | None:
    """The generation and blob sha256 this user last accepted from ``store`` for (model, class): the record
    under :func:`state_dir` fetch checks a manifest against (probe reads it, never writes it; it knows no
    cache file, so not the record beside one)."""
    digest = _digest(store.identity(deadline=deadline), model, platform_class)
    return accepted_generation(os.path.join(state_dir(), f"{digest}.json"))


def accepted_generation(path: str, *, dir_fd: int | None = None) -> tuple[int, str] | None:
    """The generation and blob sha256 recorded in the record at ``path``, or None (none, or one this user
    cannot trust: not a regular file of this user or root, writable by another, over 4 KiB; then it
    has nothing to compare with). A fetch checks against every trusted record of the two it keeps.
    ``dir_fd``: the directory ``path`` is relative to."""
    record = _read_accepted(path, dir_fd=dir_fd)
    return None if record is None else record[:2]


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What says a file is still the one a record accepted: device, inode, size, mtime and ctime (ns). Any
    write, truncation, ``utime`` or rename over it changes one of them (ctime cannot be set back)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_accepted(path: str, *, dir_fd: int | None = None) -> tuple[int, str, tuple[int, ...] | None] | None:
    """(generation, sha256, :func:`file_identity` of the file accepted or None) of the record at ``path``."""
    record, _ = read_record(path, dir_fd=dir_fd, max_bytes=_STATE_MAX_BYTES)
    if not isinstance(record, dict):
        return None
    generation, sha256, file = record.get("generation"), record.get("sha256"), record.get("file")
    if type(generation) is not int or generation < 0 or not isinstance(sha256, str):
        return None
    if isinstance(file, list) and len(file) == 5 and all(type(v) is int for v in file):
        return generation, sha256, tuple(file)
    return generation, sha256, None


def accepted_file(
    identity: str, path: str | os.PathLike[str], model: str, platform_class: str
) -> tuple[int, str] | None:
    """The generation and blob sha256 of ``model`` / ``platform_class`` that the record beside the cache file at
    ``path`` says a fetch from the store of canonical ``identity`` (:meth:`Store.identity`) accepted, when the
    file there is still the very file accepted (:func:`file_identity`) and one the cache would open
    (:func:`packcache._paths.open_checked`); else None. Reads no store and hashes nothing: what a warm start
    with the store away may map (:func:`packcache.fleet.names.fetch_name`)."""
    try:
        real = resolve_trusted(os.path.abspath(os.fspath(path)))
        fd, st = open_checked(real)
    except (OSError, UntrustedFileError):
        return None
    os.close(fd)
    digest = _digest(identity, model, platform_class)
    record = _read_accepted(os.path.join(os.path.dirname(real), f".{os.path.basename(real)}.accepted-{digest}.json"))
    if record is None or record[2] != file_identity(st):
        return None
    return record[0], record[1]


def _identity_at(parent: TrustedParent) -> tuple[int, ...] | None:
    """:func:`file_identity` of the file at ``parent``'s entry now (after a download landed, or as it was)."""
    try:
        return file_identity(os.stat(parent.name, dir_fd=parent.fd, follow_symlinks=False))
    except OSError:
        return None


def _accept(
    path: str, manifest: Manifest, *, dir_fd: int | None = None, temp: str | None = None,
    file_id: tuple[int, ...] | None = None,
) -> None:  # fmt: skip
    """Record ``manifest``'s generation as accepted (temp + rename; a failure only weakens the rollback check).
    ``dir_fd``: the cache's directory ``path`` is relative to; ``None``: this user's record under :func:`state_dir`.
    ``temp``: the temp file's name prefix (default ``.packcache-accepted.tmp-``). ``file_id``: the
    :func:`file_identity` of the cache file that holds the blob (the record beside it), so the next fetch and a
    start with the store away know it without hashing it."""
    accepted = _read_accepted(path, dir_fd=dir_fd)
    if accepted is not None and (
        accepted[0] > manifest.generation or (accepted[0] == manifest.generation and accepted[2] == file_id)
    ):
        return
    directory = os.path.dirname(path)
    fields: dict[str, Any] = {"generation": manifest.generation, "sha256": manifest.blob_sha256}
    if file_id is not None:
        fields["file"] = list(file_id)
    data = json.dumps(fields).encode()
    with contextlib.suppress(OSError):
        if dir_fd is None:
            make_dirs(directory, _defaults.PRIVATE_DIR_MODE, what="record directory")
            if trust_problem(os.stat(directory), directory=True) is not None:
                return
        # The cache's directory: the record is this user's file, mode 0600, by temp + rename (read_record
        # refuses one another user could have written).
        write_record(path, data, dir_fd=dir_fd, prefix=temp or ".packcache-accepted.tmp-")
