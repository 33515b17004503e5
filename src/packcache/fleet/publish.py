"""Publishing a cache file to a store: checked, content-addressed, named by a signed manifest.

:func:`publish` is what ``packcache publish FILE URL`` runs (docs/FLEET.md, "Publishing"):

1. The file is verified whole (every pack's checksum, :func:`packcache.verify`) under its build
   lock, which it holds to the end, so no build appends to or replaces it meanwhile. A file
   with superseded bytes is refused (``packcache compact FILE`` first): a published blob is
   downloaded by every machine, so it carries no dead bytes.
2. Every source the packs name (``sha256:<hex>:<size>`` in their keys) is found on this machine
   and hashed again, for real: a hub blob's name, a digest record or a key could all claim bytes
   the file does not hold (a corrupt blob keeps its name). Where to look: ``sources`` (the
   checkpoint directories or files), where this user last hashed each digest
   (:func:`packcache.identity.recorded_location`), and the Hugging Face hub cache (blobs are
   named by their sha256).
3. The file is hashed and uploaded create-only to ``blobs/sha256/<hex>.pcache``. An object already
   there is kept only once it is read back and hashed to the blob's sha256 and size: a damaged one
   (any size) is replaced, conditionally on its ETag where the store gives one. The key is the
   content's sha256, so any correct object there holds exactly these bytes: overwriting is safe.
4. The manifest ``manifests/<model>/<class>.json`` is written with a conditional put: created,
   or replaced only if it is still the one read (its ETag), with the next generation. Of two
   publishers racing, one wins; the other gets ``RemoteError("remote_conflict")`` saying another
   publisher won and to run it again.

Published by *name* (``name="org/model-int8"``, ``packcache publish --name``), the model is the name instead of
the file's, and the winner of step 4 then writes an immutable copy of its manifest,
``manifests/<name>/<class>@<G>.json`` (create-only), so ``NAME@G`` can be fetched later: the name moves, each of
its generations and the blobs they name stay (docs/FLEET.md, "Published names").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import _boundedjson as boundedjson
from .. import _defaults
from .. import format as fmt
from .._generations import read_committed
from .._paths import open_checked
from .._progress import bar as progress_bar
from .._sidefiles import acquire_build_lock, still_linked
from ..errors import FormatError, RemoteError
from ..hub import hub_cache_dir
from ..identity import hash_file, recorded_location
from ..maintenance import verify
from .manifest import (
    MAX_ENVELOPE_BYTES,
    check_publish_target,
    check_published_name,
    encode_unsigned,
    make_manifest,
    manifest_key,
    model_of,
    sign,
)
from .platform import platform_class
from .stores import StoreClock, StoreURL, open_store, parse_store_url

__all__ = [
    "DEFAULT_EXPIRES",
    "MAX_EXPIRES",
    "PublishReport",
    "check_expiry",
    "check_publish_target",
    "model_of",
    "publish",
    "source_identities",
]

_IDENTITY = re.compile(r"sha256:([0-9a-f]{64}):([0-9]{1,20})")
DEFAULT_EXPIRES = _defaults.MANIFEST_EXPIRY  # a month: a fleet that stops publishing stops trusting old manifests


@dataclass(frozen=True)
class PublishReport:
    """What :func:`publish` did. ``uploaded`` is False when the store already held the blob. ``url`` is the
    store's redacted URL (no credentials, query or fragment)."""

    url: str
    model: str
    platform_class: str
    blob_key: str
    manifest_key: str
    sha256: str
    size: int
    generation: int
    uploaded: bool
    signed_by: str | None  #: the first signer's key id (None: unsigned)
    sources_checked: int
    expires: int | None
    seconds: float
    signers: tuple[str, ...] = ()  #: the id of every key that signed the manifest, in the order given
    repaired: bool = False  #: an object at the blob's content address held other bytes and was replaced
    generation_key: str | None = None  #: (by name) the immutable copy of this generation's manifest

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def source_identities(keys: Iterable[bytes]) -> set[tuple[str, int]]:
    """Every ``(sha256, size)`` a pack key names its source by (any string of the form
    ``sha256:<64 hex>:<size>`` anywhere in a key that is bounded JSON)."""
    found: set[tuple[str, int]] = set()
    for raw in keys:
        try:
            value = boundedjson.loads(raw, what="pack key")
        except FormatError:
            continue
        for text in _strings(value):
            match = _IDENTITY.fullmatch(text)
            if match:
                found.add((match.group(1), int(match.group(2))))
    return found


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def publish(
    path: str | os.PathLike[str],
    url: str | StoreURL,
    *,
    private_key: str | Sequence[str] | None = None,
    sources: Sequence[str] = (),
    builder: str | None = None,
    expires_in: float | None = DEFAULT_EXPIRES,
    timeout: float = _defaults.PUBLISH_TIMEOUT,
    lock_timeout: float = _defaults.LOCK_TIMEOUT,
    name: str | None = None,
) -> PublishReport:
    """Publish the cache file at ``path`` to the store at ``url`` (module docstring).

    Args:
        private_key: the path of an ed25519 private key (PKCS#8 PEM) to sign the manifest with, or of
            several (during a key rotation: the old and the new key; every one signs); ``None`` publishes
            it unsigned (machines then need ``allow_unsigned``).
        sources: checkpoint directories or files to find the sources in (besides this user's
            records of where each was last hashed, and the hub cache).
        builder: free text recorded in the manifest (default: ``packcache <version>``).
        expires_in: seconds until the manifest expires (finite, over 0, at most :data:`MAX_EXPIRES`);
            ``None`` for never.
        timeout: seconds the store's calls may take together (one :class:`~packcache.fleet.stores.StoreClock`:
            waiting on the store counts, hashing and signing between the calls do not).
        name: publish under this name (``org/model-int8``: :func:`packcache.fleet.manifest.check_published_name`)
            instead of the file's name, and keep an immutable copy of each generation's manifest.

    Raises:
        ValueError: ``url`` is not a store URL, the file's name names no model, ``name`` is no name, ``expires_in``
            is out of range (all checked before any store call).
        FormatError: the file is not a valid cache, fails verification, or holds superseded bytes.
        FileNotFoundError: a source the packs name is nowhere to be found (the message names it).
        ValueError: a source found does not hold the bytes its name claims.
        RemoteError: the store failed (``remote_conflict``: another publisher won the race).
        UntrustedFileError, LockTimeoutError, OSError: opening or locking the file.
    """
    started = time.monotonic()
    published_as, name = name, os.fspath(path)
    # Everything the manifest needs is checked before the first store call: a bad value never costs an
    # upload. pinned by tests/test_cli_fleet_input.py::test_bad_input_is_one_line_exit_2_nothing_uploaded
    location = parse_store_url(url)
    check_expiry(expires_in)
    # pinned by tests/test_fleet_names.py::test_bad_names_are_refused_before_any_store_call
    model = check_publish_target(name) if published_as is None else check_published_name(published_as)
    key_files = [private_key] if isinstance(private_key, str) else list(private_key or ())
    signing_keys = []
    if key_files:
        from .keys import load_private_key

        signing_keys = [load_private_key(k) for k in key_files]
    fd, st = open_checked(name, noatime=True)
    try:
        real = os.path.realpath(name)
        lock_fd = acquire_build_lock(real, lock_timeout, stat.S_IMODE(st.st_mode) & 0o644)
        try:
            if not still_linked(fd, real):
                raise FormatError("the file was replaced while it was being opened: publish it again", path=name)
            header, slot, entries = read_committed(fd, path=name)
            if slot is None:
                raise FormatError("the file holds no committed generation: nothing to publish", path=name)
            report = verify(real)
            if not report.ok:
                raise FormatError(f"the file fails verification: {report.problems[0]}", path=name)
            size = os.fstat(fd).st_size
            dead = size - fmt.compacted_size(entries.values(), header)
            if dead > 0:
                raise FormatError(
                    f"{dead} superseded bytes: run `packcache compact {name}` first (every machine would fetch them)",
                    path=name,
                )
            checked = _check_sources(source_identities(e.key for e in entries.values()), sources)
            sha256 = hash_file(fd, name, os.fstat(fd))
            if (os.fstat(fd).st_size, os.fstat(fd).st_mtime_ns) != (size, st.st_mtime_ns):
                raise FormatError("the file changed while it was hashed: publish it again", path=name)
            cls = platform_class(header.platform)
            # The manifest as it will be written, but for its generation and times: every field is checked
            # (the builder text too) before the blob is uploaded.
            ttl = None if expires_in is None else int(expires_in)
            draft = make_manifest(model, cls, sha256, size, 1, builder=builder or _default_builder(), ttl_seconds=ttl)
            clock = StoreClock(timeout, timeout, what="the publish", url=location.display)
            with open_store(location, timeout=timeout) as store:
                manifest_name = manifest_key(model, cls)
                blob = f"blobs/sha256/{sha256}.pcache"
                with progress_bar(size, f"publishing {os.path.basename(real)}", nbytes=True) as tick:
                    uploaded = clock.call(lambda d: store.put_file(blob, real, deadline=d, progress=tick))
                repaired = not uploaded and _repair_blob(store, blob, real, sha256, size, clock)
                previous, etag = _current_generation(store, manifest_name, clock)
                manifest = make_manifest(model, cls, sha256, size, previous + 1, builder=draft.builder, ttl_seconds=ttl)
                if signing_keys:
                    # pinned by tests/test_fleet.py::
                    #   test_key_rotation_by_cli_machines_trusting_old_new_or_both_accept_the_dual_signed_manifest
                    envelope = sign(manifest, signing_keys)
                    signers = tuple(s["key"] for s in json.loads(envelope)["signatures"])
                else:
                    envelope, signers = encode_unsigned(manifest), ()
                try:
                    clock.call(lambda d: store.put_bytes(manifest_name, envelope, deadline=d, if_match=etag))
                except RemoteError as exc:
                    if exc.reason != "remote_conflict":
                        raise
                    # pinned by tests/test_fleet.py::test_two_publishers_racing_one_wins_the_other_gets_remote_conflict
                    raise RemoteError(
                        "remote_conflict", f"another publisher won: {manifest_name} changed after this publish read "
                        f"{f'its generation {previous}' if etag else 'that there was none'} (the blob is in place); "
                        "run it again: it publishes the next generation over the winner's", url=store.url,
                    ) from exc  # fmt: skip
                generation_key = None
                if published_as is not None:
                    generation_key = manifest_key(model, cls, manifest.generation)
                    _keep_generation(store, generation_key, envelope, clock)
        finally:
            os.close(lock_fd)
    finally:
        os.close(fd)
    return PublishReport(
        url=location.display, model=model, platform_class=cls, blob_key=blob, manifest_key=manifest_name,
        sha256=sha256, size=size, generation=manifest.generation, uploaded=uploaded,
        signed_by=signers[0] if signers else None, sources_checked=checked, expires=manifest.expires,
        seconds=round(time.monotonic() - started, 3), signers=signers, repaired=repaired,
        generation_key=generation_key,
    )  # fmt: skip


def _keep_generation(store: Any, key: str, envelope: bytes, clock: StoreClock) -> None:
    """Write the immutable copy of a generation's manifest at ``key``, create-only, after its publisher won the
    compare-and-swap of the current manifest (so no other publisher has that generation). One there already with
    the same bytes is kept (a republish that failed after it); other bytes there (a writer that bypassed the
    compare-and-swap) fail ``remote_conflict``: fetchers of ``NAME@G`` check its signature and generation."""
    try:
        clock.call(lambda d: store.put_bytes(key, envelope, deadline=d, if_match=None))
    except RemoteError as exc:
        if exc.reason != "remote_conflict":
            raise
        there, _ = clock.call(lambda d: store.get(key, deadline=d, max_bytes=MAX_ENVELOPE_BYTES))
        if there != envelope:
            raise RemoteError(
                "remote_conflict", f"the current manifest was published, but another object already lies at {key}, "
                "this generation's immutable copy (a writer that bypassed the compare-and-swap?): the generation "
                "cannot be fetched by number; remove it and publish again", url=store.url,
            ) from exc  # fmt: skip


def _holds(store: Any, blob: str, sha256: str, size: int, clock: StoreClock) -> tuple[bool, str | None]:
    """Whether the object at ``blob`` holds exactly ``size`` bytes hashing to ``sha256`` (read back whole and
    hashed: a name, a size or an ETag says nothing of the bytes), and its ETag (None: the store gives none)."""
    digest, count = hashlib.sha256(), 0

    def sink(chunk: memoryview) -> None:
        nonlocal count
        with clock.local():  # hashing is this machine's work, not the store's
            digest.update(chunk)
        count += len(chunk)

    try:
        info = clock.call(lambda d: store.download(blob, sink, deadline=d, max_bytes=size))
    except RemoteError as exc:
        if exc.reason != "remote_corrupt":  # remote_corrupt: it holds more than `size` bytes
            raise
        return False, clock.call(lambda d: store.head(blob, deadline=d)).etag
    good = count == size and digest.hexdigest() == sha256
    if info.etag is not None or good:
        return good, info.etag
    return good, clock.call(lambda d: store.head(blob, deadline=d)).etag


def _replace(store: Any, blob: str, path: str, etag: str | None, deadline: float) -> None:
    store.replace_file(blob, path, deadline=deadline, if_match=etag)


def _repair_blob(store: Any, blob: str, path: str, sha256: str, size: int, clock: StoreClock) -> bool:
    """Make the object at ``blob`` (which ``put_file`` found there) the file at ``path``: kept when it
    holds its bytes, else replaced (conditionally on the damaged object's ETag, where there is one) and
    read back again. Returns whether it was replaced (or uploaded again, if it vanished meanwhile).

    Raises:
        RemoteError: the store refused the replacement (a bucket policy that allows only create-only writes
            to blobs: the message says what a repair needs), or the object kept changing (``remote_conflict``).
    """
    # pinned by tests/test_fleet.py::test_republish_replaces_a_damaged_blob_of_any_size_and_fetches_then_succeed
    where = f"{store.url.rstrip('/')}/{blob}"  # redacted, as the store shows it
    replaced = False
    for _ in range(4):  # read back; replace; read back (again, if another writer changed it meanwhile)
        try:
            good, etag = _holds(store, blob, sha256, size, clock)
        except RemoteError as exc:
            if exc.reason != "remote_absent":
                raise
            if clock.call(lambda d: store.put_file(blob, path, deadline=d)):  # removed meanwhile: uploaded afresh
                return True
            continue
        if good:
            return replaced
        try:
            clock.call(functools.partial(_replace, store, blob, path, etag))
        except RemoteError as exc:
            if exc.reason == "remote_conflict":
                continue  # it changed since it was read: look again
            raise RemoteError(
                exc.reason, f"the object at the blob's content address holds other bytes (damaged) and replacing "
                f"it failed: {exc}. A repair overwrites it with a conditional PUT (If-Match on its ETag): the bucket "
                "policy must allow that for blobs/, or delete the object and publish again", url=where,
            ) from exc  # fmt: skip
        replaced = True
    raise RemoteError(
        "remote_conflict", "the object at the blob's content address kept changing while it was repaired "
        "(another writer?): run it again", url=where,
    )  # fmt: skip


#: The longest expiry a manifest may have (ten years): beyond it a manifest is as good as never expiring.
MAX_EXPIRES = 10 * 366 * 86400


def check_expiry(expires_in: float | None) -> None:
    """``expires_in`` if :func:`publish` can write it: ``None``, or finite seconds over 0 and at most
    :data:`MAX_EXPIRES`.

    Raises:
        ValueError: naming the value and the range.
    """
    if expires_in is None:
        return
    if isinstance(expires_in, bool) or not isinstance(expires_in, (int, float)) or not 0 < expires_in <= MAX_EXPIRES:
        raise ValueError(f"expires_in {expires_in!r}: give seconds over 0 and at most {MAX_EXPIRES} (ten years), "
                         "or None for never")  # fmt: skip


def _default_builder() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"packcache {version('packcache')}"
    except PackageNotFoundError:
        return "packcache"


def _current_generation(store: Any, key: str, clock: StoreClock) -> tuple[int, str | None]:
    """The generation of the manifest at ``key`` and its ETag, or ``(0, None)`` when there is none.

    Only its generation is read, without checking its signature: a publisher needs the next
    number, and the conditional put makes sure nobody replaced the manifest meanwhile.
    """
    try:
        data, info = clock.call(lambda d: store.get(key, deadline=d, max_bytes=MAX_ENVELOPE_BYTES))
    except RemoteError as exc:
        if exc.reason == "remote_absent":
            return 0, None
        raise
    try:
        envelope = boundedjson.loads(data, what="manifest")
        generation = envelope["manifest"]["generation"]
    except (FormatError, KeyError, TypeError) as exc:
        raise RemoteError("remote_corrupt", f"the current manifest is not readable ({exc}): remove it to start over",
                          url=key) from None  # fmt: skip
    if type(generation) is not int or generation < 0:
        raise RemoteError("remote_corrupt", f"the current manifest's generation is {generation!r}", url=key)
    return generation, info.etag


# --------------------------------------------------------------------------- sources


def _check_sources(wanted: set[tuple[str, int]], given: Sequence[str]) -> int:
    """Find and rehash every source in ``wanted``; return how many were checked.

    Raises:
        FileNotFoundError: one is nowhere to be found. ValueError: one found does not match.
    """
    if not wanted:
        return 0
    candidates = _given_files(given)
    for sha256, size in sorted(wanted):
        tried: list[str] = []
        for candidate in _candidates(sha256, size, candidates):
            tried.append(candidate)
            try:
                fd, st = open_checked(candidate, trust=False)
            except OSError:
                continue
            try:
                if st.st_size == size and hash_file(fd, candidate, st) == sha256:
                    break
            except FormatError:
                continue  # it changed while it was read: not what the packs name
            finally:
                os.close(fd)
        else:
            where = f" (tried {', '.join(tried[:4])}{' ...' if len(tried) > 4 else ''})" if tried else ""
            raise FileNotFoundError(
                f"no file here holds source sha256:{sha256}:{size}, which packs of this cache name{where}: "
                "give the checkpoint (--model DIR); publish hashes every source again before it vouches for it"
            )
    return len(wanted)


def _given_files(given: Sequence[str]) -> dict[int, list[str]]:
    """Regular files under ``given`` (directories two levels deep), by size."""
    by_size: dict[int, list[str]] = {}
    for root in given:
        paths = [root] if not os.path.isdir(root) else _walk(root, depth=2)
        for candidate in paths:
            with contextlib.suppress(OSError):
                st = os.stat(candidate)
                if stat.S_ISREG(st.st_mode):
                    by_size.setdefault(st.st_size, []).append(candidate)
    return by_size


def _walk(root: str, depth: int) -> list[str]:
    found: list[str] = []
    with contextlib.suppress(OSError), os.scandir(root) as it:
        for entry in it:
            if entry.is_file():
                found.append(entry.path)
            elif entry.is_dir(follow_symlinks=False) and depth > 1:
                found.extend(_walk(entry.path, depth - 1))
    return found


def _candidates(sha256: str, size: int, given: dict[int, list[str]]) -> Iterator[str]:
    yield from given.get(size, [])
    seen = recorded_location(sha256)
    if seen is not None:
        yield seen
    # the hub cache the hub ids resolve in (packcache.hub.hub_cache_dir, the hub client's own order); none (no home
    # to find it in, or missing): no candidate from it
    with contextlib.suppress(OSError), os.scandir(hub_cache_dir()) as it:
        for repo in it:
            if repo.name.startswith("models--"):
                blob = os.path.join(repo.path, "blobs", sha256)
                if os.path.isfile(blob):
                    yield blob
