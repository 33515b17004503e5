"""The bookkeeping behind a cache's statistics: what it holds, what it did, read without a lock.

A :class:`Ledger` is changed by one thread at a time (the session's mutex, or
the cache's instance lock outside sessions) and read by any thread without a
lock, through a sequence counter (a seqlock): every change makes ``seq`` odd
while it runs and even when it is done; a reader that sees ``seq`` odd, or
changed while it copied the figures, reads again, and after a few tries
returns the last consistent snapshot rather than wait. So a telemetry read
never waits on a model load and never sees half a change (docs/ACCOUNTING.md),
and a request costs no snapshot: one is built when someone reads.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ._faults import Fault, errno_name
from .stats import (
    FAILURE_REASONS,
    CacheStats,
    HeapReason,
    derive_state,
    dominant_reason,
    zero_reasons,
    zero_remote_reasons,
)

__all__ = ["Held", "Ledger"]

logger = logging.getLogger("packcache")


class Held:
    """One pack the cache holds: the array it handed out and where its bytes live."""

    __slots__ = ("array", "key", "nbytes", "origin", "reason", "session")

    def __init__(
        self,
        array: np.ndarray[Any, Any],
        key: bytes,  # the canonical key it was asked with: with the name, what it is
        reason: HeapReason | None,  # None: mapped (hit or stored)
        session: int,  # serial of the session that served it
        origin: tuple[int, int, int] | None = None,  # mapped: (st_dev, st_ino, offset) of its bytes
    ) -> None:
        self.array = array
        self.key = key
        self.nbytes = int(array.nbytes)
        self.reason = reason
        self.session = session
        self.origin = origin


class Ledger:
    """What a cache holds and what it did: the figures its statistics are made of (see the module docstring)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path  # the cache file, for log messages
        self.seq = 0
        self.held: dict[str, Held] = {}
        self.unnamed: dict[int, Held] = {}  # no name: their own namespace, never a user's name
        self.unnamed_serial = 0
        self.mapped = 0
        self.heap = zero_reasons()
        self.totals = {"mapped": 0, "heap": 0, "written": 0, "hits": 0, "stored": 0, "heap_packs": 0}
        self.file_bytes = 0
        self.reclaimable_bytes = 0
        self.errno = 0
        self.error = ""
        self.error_time = 0.0
        self.pack_seconds = 0.0
        self.map_seconds = 0.0
        self.blocking: Fault | None = None  # the store's blocking fault (FileStore.blocking): no file to use
        self.commit_fault: Fault | None = None  # the last commit failed
        self.remote = {"hits": 0, "bytes": 0}
        self.remote_seconds = 0.0
        self.remote_download_mbps = 0.0
        self.remote_misses = zero_remote_reasons()
        self.remote_errno = 0
        self.remote_error = ""
        self.logged: set[str] = set()
        self.cached: tuple[int, bool, CacheStats] | None = None

    # Every method below runs under the writer's exclusion, with ``seq`` odd while it runs and even after,
    # whatever line an interrupt stops it at: it sets ``seq`` from the value it started at, in a ``finally``.
    # The methods that change what is held recount the byte figures if stopped part-way (``except
    # BaseException``: an interrupt included; _recount).

    def hold(self, name: str | None, held: Held, *, outcome: str | None = None, map_seconds: float = 0.0) -> None:
        """Hold a pack served now; ``outcome`` ``"hits"`` or ``"stored"`` counts it (heap packs count themselves)."""
        start = self.seq
        try:
            self.seq = start + 1
            if outcome is not None:
                self.totals[outcome] += 1
            self.map_seconds += map_seconds
            if name is None:
                self.unnamed_serial += 1
                self.unnamed[self.unnamed_serial] = held
            else:
                old = self.held.pop(name, None)
                if old is not None:
                    self._uncount(old)  # same name, new key: the old pack is superseded
                self.held[name] = held
            if held.reason is None:
                self.mapped += held.nbytes
                self.totals["mapped"] += held.nbytes
            else:
                self.heap[held.reason.value] += held.nbytes
                self.totals["heap"] += held.nbytes
                self.totals["heap_packs"] += 1
        except BaseException:
            self._recount()
            raise
        finally:
            self.seq = start + 2

    def hold_hits(self, hits: list[tuple[str, Held]], *, map_seconds: float) -> None:
        """Hold packs served now from the file, none held before under its name: :meth:`hold` with
        ``outcome="hits"`` for each, as one change."""
        start = self.seq
        try:
            self.seq = start + 1
            held, nbytes = self.held, 0
            for name, pack in hits:
                held[name] = pack
                nbytes += pack.nbytes
            self.totals["hits"] += len(hits)
            self.map_seconds += map_seconds
            self.mapped += nbytes
            self.totals["mapped"] += nbytes
        except BaseException:
            self._recount()
            raise
        finally:
            self.seq = start + 2

    def _recount(self) -> None:
        """A change stopped part-way (an interrupt can land between any two of its lines): make the byte
        figures again from the packs held, so they add up to them whatever was done. The running totals
        (hits, bytes served so far) may miss the interrupted change; they are counts of what happened,
        not of what is held. Pinned by tests/test_ledger_interrupts.py."""
        mapped, heap = 0, zero_reasons()
        for held in (*self.held.values(), *self.unnamed.values()):
            if held.reason is None:
                mapped += held.nbytes
            else:
                heap[held.reason.value] += held.nbytes
        self.mapped, self.heap = mapped, heap

    def _uncount(self, held: Held) -> None:
        if held.reason is None:
            self.mapped -= held.nbytes
        else:
            self.heap[held.reason.value] -= held.nbytes

    def drop_all(self) -> None:
        """Stop holding every pack (the cache is closing)."""
        start = self.seq
        try:
            self.seq = start + 1
            for held in (*self.held.values(), *self.unnamed.values()):
                self._uncount(held)
            self.held.clear()
            self.unnamed.clear()
        except BaseException:
            self._recount()
            raise
        finally:
            self.seq = start + 2

    def drop(self, name: str | None, serial: int = 0) -> None:
        start = self.seq
        try:
            self.seq = start + 1
            self._uncount(self.held.pop(name) if name is not None else self.unnamed.pop(serial))
        except BaseException:
            self._recount()
            raise
        finally:
            self.seq = start + 2

    def reclassify(self, name: str, reason: HeapReason, session: int) -> None:
        """A held pack's bytes are now counted under ``reason`` (heap)."""
        start = self.seq
        try:
            self.seq = start + 1
            held = self.held[name]
            self._uncount(held)
            held.reason, held.session, held.origin = reason, session, None
            self.heap[reason.value] += held.nbytes
        except BaseException:
            self._recount()
            raise
        finally:
            self.seq = start + 2

    def add(self, **amounts: float) -> None:
        """Add to totals (``hits``, ``stored``) and timers (``pack_seconds``, ``map_seconds``)."""
        start = self.seq
        try:
            self.seq = start + 1
            for field, amount in amounts.items():
                if field in self.totals:
                    self.totals[field] += int(amount)
                else:
                    setattr(self, field, getattr(self, field) + amount)
        finally:
            self.seq = start + 2

    def set(self, **values: Any) -> None:
        """Set plain figures (``file_bytes``, ``reclaimable_bytes``, ``blocking``, ``commit_fault``, ``written``)."""
        start = self.seq
        try:
            self.seq = start + 1
            for field, value in values.items():
                if field == "written":
                    self.totals["written"] = value
                else:
                    setattr(self, field, value)
        finally:
            self.seq = start + 2

    def record_failure(self, fault: Fault) -> bool:
        """Keep the errno and message of the latest failure; True the first time its reason is seen."""
        start = self.seq
        try:
            self.seq = start + 1
            self.errno, self.error, self.error_time = fault.errno, fault.message, time.time()
        finally:
            self.seq = start + 2
        return self.log_once(fault.reason.value)

    def report(self, reason: HeapReason, fault: Fault | None = None) -> None:
        """Count a request sent to heap for ``reason``: keep a failure's errno and message, and
        log each reason once per cache (``ERROR`` for a failure, ``INFO`` for ``finalized``,
        ``DEBUG`` otherwise; docs/ROUTING.md)."""
        if fault is not None:
            # pinned by tests/test_ledger.py::test_failures_log_one_error_per_reason_per_cache
            if self.record_failure(fault):
                self._log(reason, fault.message, fault.errno)
        elif self.log_once(reason.value):
            self._log(reason, f"cache {self.path}")

    def _log(self, reason: HeapReason, message: str, err: int = 0) -> None:
        if reason in FAILURE_REASONS:
            name = errno_name(err, "no errno")
            logger.error("packcache: %s [%s]: %s; packs go to heap", reason.value, name, message)
        elif reason is HeapReason.FINALIZED:
            logger.info("packcache: cache %s is finalized; new packs go to heap", self.path)
        else:
            logger.debug("packcache: %s: packs go to heap (%s)", reason.value, message)

    def remote_result(self, *, nbytes: int, seconds: float, miss: str | None = None, err: int = 0,
                      message: str = "", download_mbps: float = 0.0) -> None:  # fmt: skip
        """Count one fetch from the store: a hit (``miss`` None) or a miss for reason ``miss``
        (one of :data:`packcache.stats.REMOTE_REASONS`), with its errno and message. ``download_mbps``: the
        throughput of its download, kept as the last one's when it downloaded (> 0)."""
        start = self.seq
        try:
            self.seq = start + 1
            self.remote["bytes"] += nbytes
            self.remote_seconds += seconds
            if download_mbps > 0:
                self.remote_download_mbps = download_mbps
            if miss is None:
                self.remote["hits"] += 1
            else:
                self.remote_misses[miss] += 1
                self.remote_errno, self.remote_error = err, message
        finally:
            self.seq = start + 2

    def log_once(self, what: str) -> bool:
        """True the first time ``what`` is asked about on this cache: the caller logs it then, and never again."""
        if what in self.logged:
            return False
        self.logged.add(what)
        return True

    def snapshot(self, enabled: bool, path: str) -> CacheStats:
        """A consistent :class:`CacheStats`; never waits (see the class docstring)."""
        for _ in range(64):
            seq = self.seq
            cached = self.cached
            if cached is not None and cached[0] == seq and cached[1] == enabled:
                return cached[2]
            if seq & 1:
                continue  # a change is under way in another thread
            snapshot = self._build(enabled, path)
            if self.seq == seq:
                self.cached = (seq, enabled, snapshot)
                return snapshot
        return self.cached[2] if self.cached is not None else CacheStats()

    def _build(self, enabled: bool, path: str) -> CacheStats:
        by_reason = dict(self.heap)
        totals = dict(self.totals)
        # pinned by tests/test_stats.py::test_a_file_that_cannot_be_opened_shows_degraded_before_any_pack,
        # ::test_an_untrusted_file_shows_degraded_before_any_pack
        failing = self.blocking is not None or self.commit_fault is not None
        state = derive_state(
            enabled=enabled, mapped_bytes=self.mapped, heap_bytes_by_reason=by_reason,
            written_bytes=totals["written"], failing=failing,
        )  # fmt: skip
        return CacheStats.fast(
            state=state.value,
            errno=self.errno,
            error=self.error,
            error_time=self.error_time,
            mapped_bytes=self.mapped,
            heap_bytes=sum(by_reason.values()),
            heap_bytes_by_reason=by_reason,
            heap_reason=dominant_reason(by_reason),
            mapped_bytes_total=totals["mapped"],
            heap_bytes_total=totals["heap"],
            written_bytes=totals["written"],
            file_bytes=self.file_bytes,
            reclaimable_bytes=self.reclaimable_bytes,
            hits=totals["hits"],
            stored=totals["stored"],
            heap_packs=totals["heap_packs"],
            pack_seconds=self.pack_seconds,
            map_seconds=self.map_seconds,
            path=path,
            failing=failing,
            remote_hits=self.remote["hits"],
            remote_bytes=self.remote["bytes"],
            remote_seconds=self.remote_seconds,
            remote_download_mbps=self.remote_download_mbps,
            remote_misses_by_reason=dict(self.remote_misses),
            remote_errno=self.remote_errno,
            remote_error=self.remote_error,
        )
