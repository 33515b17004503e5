"""Published names: a node with no checkpoint gets its cache file from a store by name (docs/FLEET.md,
"Published names").

A *name* (``org/model-int8``) is what ``packcache publish FILE URL --name NAME`` files a cache file under: the
signed manifest ``manifests/<NAME>/<class>.json`` of each platform class, which names the blob by sha256, like an
image tag over a digest. The name moves (each publish is the next generation); the blob does not, and every
generation keeps an immutable copy, ``manifests/<NAME>/<class>@<G>.json``, so ``NAME@G`` pins one.

:func:`fetch_name` is what ``packcache fetch URL --name NAME``, ``hf.from_pretrained(NAME, remote=URL, ...)`` and
``packcache run/serve --model NAME --remote URL`` run:

1. :func:`parse_name` checks the name before anything is asked (no ``..``, no ``/`` tricks, bounded);
2. the platform classes this machine could map it under, in a fixed order (:func:`candidates`): the scheme
   given, or auto's scheme first, then ``int8``, ``int4``, ``bf16``, ``fp32``; the first class the store has a
   manifest for is taken (one small read per class tried);
3. :func:`packcache.fleet.fetch.fetch` of that manifest into :func:`local_path` (every check fetch makes:
   signature, expiry, class, no rollback, size and sha256, every pack's checksum, the target's trust, the build
   lock). A local file the record beside it says is this blob is not read again, let alone downloaded;
4. with the store down or silent (``remote_error``, ``remote_timeout``), a local file accepted before from this
   store for this name, and unchanged since (:func:`packcache.fleet.fetch.accepted_file`), is used as it is: the
   report says ``reached=False`` and why.

>>> parse_name("org/model-int8@3")
('org/model-int8', 3)
>>> local_path("org/model-int8", 3, cache_dir="/var/cache/p")
'/var/cache/p/org--model-int8@3.pcache'
>>> is_local_path("org/model-int8"), is_local_path("./org/model-int8"), is_local_path("m.pcache")
(False, True, True)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

from .. import _defaults
from .._faults import errno_name
from .._paths import default_cache_dir
from .._remote import Fetched, note_fetched
from .._storeurl import StoreURL, parse_store_url
from ..errors import RemoteError
from ..hub import is_local_path
from .fetch import FetchReport, accepted_file, fetch, load_trusted_keys
from .manifest import check_published_name
from .platform import platform_class
from .stores import Store, StoreClock, open_store

__all__ = [
    "SCHEME_ORDER",
    "NameReport",
    "candidates",
    "fetch_name",
    "is_local_path",
    "local_path",
    "parse_name",
]

#: The schemes a name is looked for under when none is given, after auto's (this machine's default) scheme:
#: the smaller files first.
SCHEME_ORDER = ("int8", "int4", "bf16", "fp32")
_GENERATION = re.compile(r"[1-9][0-9]{0,17}")
_UNREACHED = ("remote_error", "remote_timeout")

logger = logging.getLogger("packcache")


def parse_name(text: str) -> tuple[str, int | None]:
    """``(name, generation or None)`` of ``NAME`` or ``NAME@GENERATION``: ``[A-Za-z0-9._-]`` segments separated
    by single ``/`` (:func:`packcache.fleet.manifest.check_published_name`: no ``..`` nor ``--``, at most 200
    characters and 16 segments), and a generation that is a positive decimal integer.

    Raises:
        ValueError: naming the text and what is wrong with it.

    >>> parse_name("org/model-int8")
    ('org/model-int8', None)
    >>> parse_name("../etc/passwd")
    Traceback (most recent call last):
    ...
    ValueError: name '../etc/passwd': segment '..' starts with a dot
    """
    if not isinstance(text, str):
        raise ValueError(f"a published name is a string, not {type(text).__name__}")
    name, at, generation = text.partition("@")
    if at and not _GENERATION.fullmatch(generation):
        raise ValueError(
            f"name {text[:80]!r}: the generation after '@' must be a positive integer, got {generation[:20]!r}"
        )
    return check_published_name(name), int(generation) if at else None


def local_path(name: str, generation: int | None = None, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Where the cache file of a published name lands: ``<cache_dir>/<name with '/' as '--'>.pcache`` (a pinned
    generation: ``...@<G>.pcache``, a file of its own), ``cache_dir`` defaulting to
    :func:`packcache._paths.default_cache_dir` (``$PACKCACHE_DIR``, else this user's cache).

    Raises:
        ValueError: ``name`` is no published name, or ``generation`` is under 1.
    """
    check_published_name(name)
    if generation is not None and (type(generation) is not int or generation < 1):
        raise ValueError(f"generation {generation!r} is not a positive integer")
    stem = name.replace("/", "--") + (f"@{generation}" if generation is not None else "")
    directory = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    return os.path.join(os.path.abspath(directory), stem + ".pcache")


def candidates(scheme: str | None = None, group_size: int | None = None) -> list[tuple[str, int, bytes]]:
    """``(scheme, group size, platform bytes)`` of each scheme a name is looked for under, in order: ``scheme``
    alone when given, else (``None`` or ``"auto"``) auto's scheme, then the rest of :data:`SCHEME_ORDER`. The
    platform is the one a loader of that scheme maps (:meth:`packcache.loader.Recipe.platform`); computing all four
    costs ~60 ms here (the packers' behavioural fingerprints), once per process, after torch is imported.

    Raises:
        ValueError: an unknown scheme or group size.
    """
    from ..format import canonical_key
    from ..loader import resolve, resolve_scheme

    size = _defaults.GROUP_SIZE if group_size is None else group_size
    if scheme not in (None, "auto"):
        order = [resolve_scheme(scheme)]
    else:
        first = resolve_scheme(None)
        order = [first, *(s for s in SCHEME_ORDER if s != first)]
    found = []
    for name in order:
        recipe = resolve(name, size)
        found.append((recipe.scheme, recipe.group_size, canonical_key(recipe.platform())))
    return found


@dataclass(frozen=True)
class NameReport(FetchReport):
    """What :func:`fetch_name` did: a :class:`~packcache.fleet.fetch.FetchReport` (``path``: the local cache file,
    ready to map; ``model``: the name without ``@G``) and ``name`` as asked (with ``@G`` if pinned), the ``scheme``
    and ``group_size`` whose class it was found under, ``reached`` (False: the store was down or silent and the file
    accepted before was used as it is) and ``store_error`` (why, then)."""

    name: str = ""
    scheme: str | None = None
    group_size: int = _defaults.GROUP_SIZE
    reached: bool = True
    store_error: str | None = None


def fetch_name(
    url: str | StoreURL,
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    trusted_keys: Sequence[bytes | str] = (),
    allow_unsigned: bool = False,
    timeout: float = _defaults.REMOTE_TIMEOUT,
    total_timeout: float | None = None,
    lock_timeout: float = _defaults.LOCK_TIMEOUT,
    scheme: str | None = None,
    group_size: int | None = None,
    store: Store | None = None,
) -> NameReport:
    """Make the local cache file of the published ``name`` (``NAME`` or ``NAME@GENERATION``) the one ``url``
    publishes for this machine (module docstring), and say where it is (``report.path``).

    Args:
        cache_dir: the directory of the local file (:func:`local_path`).
        trusted_keys: public keys, as PEM bytes or the paths of ``.pub.pem`` files; one must have signed the
            manifest, unless ``allow_unsigned``.
        timeout: seconds the store may make no progress (each small read, a stalled download).
        total_timeout: seconds all the store calls may take together, every class tried and the download
            included (``None``: ``timeout``); only time waiting on the store counts (a
            :class:`~packcache.fleet.stores.StoreClock`), not the local work between (computing the classes,
            hashing, checking, writing).
        scheme, group_size: look under this scheme's class only (``None``, ``"auto"``: :func:`candidates`' order).
        store: an open store to use instead of opening ``url`` (kept open).

    Raises:
        ValueError: ``url`` is no store URL, ``name`` no name, ``scheme`` or ``group_size`` unknown: before any
            store call or file write.
        RemoteError: the reason says what failed (``remote_absent``: nothing published under the name for any
            class tried, or no such generation); nothing was written but the lock file.
    """
    started = time.monotonic()
    location = store.location if store is not None else parse_store_url(url)
    # pinned by tests/test_fleet_names.py::test_bad_names_are_refused_before_any_store_call
    model, pinned = parse_name(name)
    path = local_path(model, pinned, cache_dir=cache_dir)
    tried = candidates(scheme, group_size)
    stall = float(timeout)
    budget = stall if total_timeout is None else float(total_timeout)
    # One clock over every class tried: only the store's time counts, so computing the platforms (importing torch
    # on a cold start) and hashing on a busy machine never make the store look silent.
    # pinned by tests/test_fleet_deadline.py::test_a_busy_machine_does_not_make_a_directory_store_time_out
    clock = StoreClock(budget, stall, what=f"the fetch of {name!r}", url=location.display)
    # Every outcome is counted (packcache._remote): by the cache that opens the file, or in aggregate_stats().
    # pinned by tests/test_fleet_names.py::test_a_load_by_name_shows_its_fetch_in_stats_and_every_exporter
    try:
        keys = load_trusted_keys(list(trusted_keys))
        with contextlib.ExitStack() as stack:
            if store is None:
                store = stack.enter_context(open_store(location, timeout=stall))
            report, unreached = _first_class(store, location, name, model, pinned, path, tried, keys, allow_unsigned,
                                             lock_timeout, clock, started)  # fmt: skip
    except (RemoteError, ImportError) as exc:
        note_fetched(None, Fetched.of(exc, time.monotonic() - started, location.scrub))
        raise
    seconds = time.monotonic() - started
    if unreached is None:
        note_fetched(path, Fetched.of(report, seconds))
    else:
        fetched = Fetched.of(unreached, seconds, location.scrub)
        note_fetched(path, fetched)
        logger.warning("packcache: %s [%s]: %s; using %s, accepted from that store before", fetched.miss,
                       errno_name(fetched.errno, "no errno"), fetched.message, path)  # fmt: skip
    return report


def _first_class(
    store: Store, location: StoreURL, name: str, model: str, pinned: int | None, path: str,
    tried: Sequence[tuple[str, int, bytes]], keys: Sequence[bytes], allow_unsigned: bool, lock_timeout: float,
    clock: StoreClock, started: float,
) -> tuple[NameReport, RemoteError | None]:  # fmt: skip
    """:func:`fetch_name`'s fetch of the first class of ``tried`` the store has a manifest for; with the store down
    or silent, the file accepted before. Returns its report and, for the latter, the error that left it unreached."""
    stall = clock.stall
    absent: list[str] = []
    for number, (chosen, size, platform) in enumerate(tried):
        try:
            if clock.left() <= 0:
                # pinned by tests/test_fleet_names.py::test_a_fetch_out_of_time_names_the_budget_it_had
                raise clock.out_of_time()
            report = fetch(location, path, platform=platform, trusted_keys=keys, allow_unsigned=allow_unsigned,
                           timeout=stall, lock_timeout=lock_timeout, store=store, model=model, generation=pinned,
                           clock=clock)  # fmt: skip
        except RemoteError as exc:
            if exc.reason in _UNREACHED:
                # pinned by tests/test_fleet_names.py::test_a_store_that_is_down_serves_the_file_accepted_before
                warm = _accepted_here(store, path, model, tried, clock)
                if warm is not None:
                    chosen, size, cls, (generation, sha256) = warm
                    return NameReport(
                        url=location.display, path=path, model=model, platform_class=cls, generation=generation,
                        sha256=sha256, size=os.stat(path).st_size, downloaded=False, bytes=0,
                        seconds=round(time.monotonic() - started, 3), signed_by=None, name=name, scheme=chosen,
                        group_size=size, reached=False, store_error=str(exc),
                    ), exc  # fmt: skip
            if exc.reason != "remote_absent":
                raise
            absent.append(f"{chosen} ({platform_class(platform)})")
            if number < len(tried) - 1:
                continue
            what = f"generation {pinned} of {model!r}" if pinned is not None else repr(model)
            raise RemoteError(
                "remote_absent", f"nothing published for {what} under the class of scheme "
                f"{', nor '.join(absent)}: {exc}", url=location.display,
            ) from None  # fmt: skip
        values = {f.name: getattr(report, f.name) for f in fields(FetchReport)}
        return NameReport(**values, name=name, scheme=chosen, group_size=size), None
    raise AssertionError("unreachable: candidates() is never empty")


def _accepted_here(
    store: Store, path: str, model: str, tried: Sequence[tuple[str, int, bytes]], clock: StoreClock
) -> tuple[str, int, str, tuple[int, str]] | None:
    """The first class of ``tried`` whose record beside ``path`` says the file there was accepted from ``store``
    for ``model`` and is unchanged since: (scheme, group size, class, (generation, sha256)), or None. The store's
    identity is asked within what is left of ``clock`` (at least nothing: a directory store still gets its grace)."""
    try:
        with clock.waiting():
            identity = store.identity(deadline=time.monotonic() + min(clock.stall, max(clock.left(), 0.0)))
    except RemoteError:
        return None
    for chosen, size, platform in tried:
        cls = platform_class(platform)
        accepted = accepted_file(identity, path, model, cls)
        if accepted is not None:
            return chosen, size, cls, accepted
    return None
