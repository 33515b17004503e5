"""Heap reasons, cache states and the immutable statistics snapshot.

A :class:`CacheStats` is frozen: a cache's ledger builds one when someone reads,
from figures it reads without a lock and without seeing half a change
(:mod:`packcache._ledger`, docs/ACCOUNTING.md).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "FAILURE_REASONS",
    "REMOTE_REASONS",
    "CacheState",
    "CacheStats",
    "HeapReason",
    "derive_state",
    "dominant_reason",
    "sum_stats",
    "zero_reasons",
    "zero_remote_reasons",
]


class HeapReason(str, enum.Enum):
    """Why a pack was served from heap instead of the cache file."""

    DISABLED = "disabled"  #: caching is off (no path, or disabled by option)
    UNNAMED = "unnamed"  #: the request had no stable name
    READ_ONLY = "read_only"  #: the entry is missing and the file can only be read
    LOCKED = "locked"  #: another process held the build lock past the timeout
    OPEN_FAILED = "open_failed"  #: the file could not be opened or created
    NO_SPACE = "no_space"  #: ENOSPC, EDQUOT or EFBIG while reserving or writing
    WRITE_FAILED = "write_failed"  #: any other write or sync error
    MAP_FAILED = "map_failed"  #: mapping the file failed
    UNTRUSTED = "untrusted"  #: the file failed the ownership/permission check
    FINALIZED = "finalized"  #: the cache was finalized; no more inserts

    def __str__(self) -> str:
        return self.value


#: Reasons that mean the cache failed to do its job (they make a cache ``degraded``).
FAILURE_REASONS = frozenset(
    {
        HeapReason.READ_ONLY,
        HeapReason.LOCKED,
        HeapReason.OPEN_FAILED,
        HeapReason.NO_SPACE,
        HeapReason.WRITE_FAILED,
        HeapReason.MAP_FAILED,
        HeapReason.UNTRUSTED,
    }
)


#: Why a cache with ``remote=`` did not get its file from the store (docs/FLEET.md). Every key is
#: always present in ``CacheStats.remote_misses_by_reason``.
REMOTE_REASONS = (
    "remote_absent",  # no manifest for this (model, platform class), or its blob is missing
    "remote_error",  # the store failed: down, refused, 403, 5xx, a malformed answer
    "remote_timeout",  # the store did not answer within remote_timeout (the total for one fetch)
    "remote_untrusted",  # the manifest is unsigned (without allow_unsigned), or no trusted key signed it
    "remote_stale",  # the manifest expired, or is older than one this machine already accepted
    "remote_incompatible",  # the manifest or the blob's header is for another model or platform class
    "remote_corrupt",  # the blob's size or sha256 is not the manifest's, or the file fails verification
    "remote_no_space",  # not enough free space for the blob, or ENOSPC/EDQUOT/EFBIG while writing it
    "remote_write_failed",  # the cache directory cannot take the file (read-only, permissions, ...)
)


# Plain strings for the hot path: enum attribute access costs more than the rest of a snapshot.
_FAILURE_VALUES = tuple(r.value for r in HeapReason if r in FAILURE_REASONS)
_OTHER_VALUES = tuple(r.value for r in HeapReason if r not in FAILURE_REASONS)
_REASON_VALUES = tuple(r.value for r in HeapReason)


class CacheState(str, enum.Enum):
    """What a cache holds, in one word (rule in :func:`derive_state`)."""

    OFF = "off"
    HEAP = "heap"
    DEGRADED = "degraded"
    STORED = "stored"
    MAPPED = "mapped"

    def __str__(self) -> str:
        return self.value


def derive_state(
    *,
    enabled: bool,
    mapped_bytes: int,
    heap_bytes_by_reason: Mapping[str, int],
    written_bytes: int,
    failing: bool = False,
) -> CacheState:
    """Derive the state from what a cache holds; the first rule that applies wins.

    ``failing``: a failure is already known (the file cannot be opened or trusted, or
    the last commit failed), so the cache is ``degraded`` before any pack shows it.

    >>> derive_state(enabled=True, mapped_bytes=0, heap_bytes_by_reason={"unnamed": 8}, written_bytes=0)
    <CacheState.HEAP: 'heap'>
    >>> derive_state(enabled=True, mapped_bytes=8, heap_bytes_by_reason={"unnamed": 8}, written_bytes=8).value
    'stored'
    >>> derive_state(enabled=True, mapped_bytes=0, heap_bytes_by_reason={}, written_bytes=0, failing=True).value
    'degraded'
    """
    if not enabled:
        return CacheState.OFF
    if mapped_bytes == 0 and any(heap_bytes_by_reason.values()):
        return CacheState.HEAP
    if failing:
        return CacheState.DEGRADED
    get = heap_bytes_by_reason.get
    for reason in _FAILURE_VALUES:
        if get(reason, 0) > 0:
            return CacheState.DEGRADED
    if written_bytes > 0:
        return CacheState.STORED
    return CacheState.MAPPED


def zero_reasons() -> dict[str, int]:
    """A fresh ``{reason: 0}`` dict with every reason present."""
    return dict.fromkeys(_REASON_VALUES, 0)


def zero_remote_reasons() -> dict[str, int]:
    """A fresh ``{remote reason: 0}`` dict with every reason of :data:`REMOTE_REASONS` present."""
    return dict.fromkeys(REMOTE_REASONS, 0)


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of one cache (or of all live caches, summed).

    Byte counts under "held" are packs the cache currently holds (a pack served
    twice counts once; a released pack stops counting). ``*_total`` fields are
    cumulative over the cache's life, for rates.

    >>> CacheStats().state
    'off'
    """

    state: str = CacheState.OFF.value
    errno: int = 0  #: errno of the most recent failure, 0 if none
    error: str = ""  #: message of the most recent failure
    error_time: float = 0.0  #: time.time() of the most recent failure, 0.0 if none
    mapped_bytes: int = 0
    heap_bytes: int = 0
    heap_bytes_by_reason: dict[str, int] = field(default_factory=zero_reasons)
    heap_reason: str = "none"  #: the reason holding the most heap bytes
    mapped_bytes_total: int = 0
    heap_bytes_total: int = 0
    written_bytes: int = 0  #: bytes this instance wrote to cache files
    file_bytes: int = 0  #: size of the cache file on disk
    #: bytes of the cache file that compaction would reclaim (superseded packs, older indexes)
    reclaimable_bytes: int = 0
    hits: int = 0
    stored: int = 0
    heap_packs: int = 0
    pack_seconds: float = 0.0  #: time spent inside pack() callables
    map_seconds: float = 0.0  #: time spent opening, validating and mapping files
    path: str = ""  #: the cache file ('' when off; for aggregates, '' unless one cache)
    #: a failure is known now (file cannot be opened or trusted, last commit failed), with or without packs
    failing: bool = False
    #: cache files this cache got from its store (``remote=``) instead of packing: downloaded, or found
    #: already fetched by another process once the build lock was free
    remote_hits: int = 0
    remote_bytes: int = 0  #: bytes read from the store (manifests, headers, blobs)
    remote_seconds: float = 0.0  #: time spent asking the store, waiting included
    #: throughput of the last blob download, MB/s (10**6 bytes; range reads written in place and hashed), 0 if
    #: none; an aggregate gives the highest of its caches
    remote_download_mbps: float = 0.0
    #: fetches that did not give this cache its file, by reason (every reason present; docs/FLEET.md)
    remote_misses_by_reason: dict[str, int] = field(default_factory=zero_remote_reasons)
    remote_errno: int = 0  #: errno of the latest remote miss, 0 if none (or an HTTP failure)
    remote_error: str = ""  #: message of the latest remote miss, '' if none

    @classmethod
    def fast(cls, **fields: Any) -> CacheStats:
        """Build a snapshot from every field, skipping the frozen ``__init__``.

        The cache publishes one snapshot per request; the generated frozen
        ``__init__`` (one ``object.__setattr__`` per field) was most of that cost.
        """
        if fields.keys() != _FIELD_NAMES:
            raise TypeError(f"CacheStats.fast() needs exactly the fields {sorted(_FIELD_NAMES)}")
        snapshot = object.__new__(cls)
        snapshot.__dict__.update(fields)
        return snapshot


_FIELD_NAMES = frozenset(f.name for f in fields(CacheStats))


def dominant_reason(heap_bytes_by_reason: Mapping[str, int]) -> str:
    """The reason a dashboard must see: the *failure* reason holding the most heap bytes when
    any failure bytes exist, otherwise the reason holding the most heap bytes; ``"none"``
    when there are none. Ties go to the order of :class:`HeapReason`.

    >>> dominant_reason({"unnamed": 4, "no_space": 4})
    'no_space'
    >>> dominant_reason({"disabled": 1000, "no_space": 4})
    'no_space'
    >>> dominant_reason({"disabled": 1000, "unnamed": 4})
    'disabled'
    """
    get = heap_bytes_by_reason.get
    # pinned by tests/test_stats.py::test_aggregate_heap_reason_names_the_failure_not_a_bigger_legitimate_reason
    for group in (_FAILURE_VALUES, _OTHER_VALUES):  # a legitimate reason must never hide a failure
        best, best_bytes = "none", 0
        for reason in group:
            held = get(reason, 0)
            if held > best_bytes:
                best, best_bytes = reason, held
        if best_bytes:
            return best
    return "none"


def sum_stats(snapshots: Iterable[CacheStats]) -> CacheStats:
    """Sum snapshots into one; the state is derived again from the sums.

    The most recent failure (by ``error_time``) supplies ``errno`` and ``error``.
    With no snapshot at all the result is the ``off`` state with zeros.
    """
    items = list(snapshots)
    if not items:
        return CacheStats()
    by_reason = {r.value: sum(s.heap_bytes_by_reason.get(r.value, 0) for s in items) for r in HeapReason}
    latest = max(items, key=lambda s: s.error_time)
    mapped = sum(s.mapped_bytes for s in items)
    written = sum(s.written_bytes for s in items)
    enabled = any(s.state != CacheState.OFF.value for s in items)
    failing = any(s.failing for s in items)
    return CacheStats(
        state=derive_state(
            enabled=enabled,
            mapped_bytes=mapped,
            heap_bytes_by_reason=by_reason,
            written_bytes=written,
            failing=failing,
        ).value,
        errno=latest.errno,
        error=latest.error,
        error_time=latest.error_time,
        mapped_bytes=mapped,
        heap_bytes=sum(by_reason.values()),
        heap_bytes_by_reason=by_reason,
        heap_reason=dominant_reason(by_reason),
        mapped_bytes_total=sum(s.mapped_bytes_total for s in items),
        heap_bytes_total=sum(s.heap_bytes_total for s in items),
        written_bytes=written,
        file_bytes=sum(s.file_bytes for s in items),
        reclaimable_bytes=sum(s.reclaimable_bytes for s in items),
        hits=sum(s.hits for s in items),
        stored=sum(s.stored for s in items),
        heap_packs=sum(s.heap_packs for s in items),
        pack_seconds=sum(s.pack_seconds for s in items),
        map_seconds=sum(s.map_seconds for s in items),
        path=items[0].path if len(items) == 1 else "",
        failing=failing,
        remote_hits=sum(s.remote_hits for s in items),
        remote_bytes=sum(s.remote_bytes for s in items),
        remote_seconds=sum(s.remote_seconds for s in items),
        remote_download_mbps=max((s.remote_download_mbps for s in items), default=0.0),
        remote_misses_by_reason={r: sum(s.remote_misses_by_reason.get(r, 0) for s in items) for r in REMOTE_REASONS},
        remote_errno=next((s.remote_errno for s in items if s.remote_error), 0),
        remote_error=next((s.remote_error for s in items if s.remote_error), ""),
    )
