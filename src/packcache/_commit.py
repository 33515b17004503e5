"""The end of a session's writes: commit what it stored, count what did not become durable, compact.

A session that stored packs commits them when it ends (still holding the build lock). A commit that
fails, or is interrupted, leaves the previous generation in place: the packs the session stored are
then counted as heap under the commit's reason (docs/ACCOUNTING.md, "When a commit fails"). A commit
that succeeds is followed by a compaction when superseded bytes outweigh the live ones. Neither ever
fails a model load: every problem ends here as a counted, logged :class:`~packcache._faults.Fault`.
"""

from __future__ import annotations

import logging

from ._faults import Fault, ending
from ._ledger import Ledger
from ._store import FileStore
from .stats import HeapReason

__all__ = ["commit", "commit_failed"]

logger = logging.getLogger("packcache")


def commit(store: FileStore, ledger: Ledger, serial: int) -> None:
    """Commit what session ``serial`` stored in ``store``, then compact if it pays; count the outcome.

    Raises:
        Only an interrupt (``KeyboardInterrupt``...), after counting what it cost.
    """
    names = store.pending_names
    try:
        try:
            with ending(HeapReason.WRITE_FAILED, f"cannot commit {store.path}") as end:
                store.commit()
        except BaseException as exc:  # interrupted: what was not committed is not durable
            # pinned by
            # tests/test_cache_sessions.py::test_an_interrupt_during_the_commit_keeps_the_previous_generation_and_counts_what_was_lost  # noqa: E501
            commit_failed(
                store, ledger, serial, names, Fault(HeapReason.WRITE_FAILED, 0, f"commit interrupted: {exc!r}")
            )
            raise
        if end.fault is None:
            ledger.set(commit_fault=None, blocking=None)
            _compact(store, ledger)
        else:
            if end.unexpected:
                store.abort()  # the store aborts on its own faults, not on what it did not expect
            commit_failed(store, ledger, serial, names, end.fault)
    finally:
        status = store.status
        ledger.set(file_bytes=status.size, reclaimable_bytes=status.reclaimable_bytes, written=store.bytes_written)


def _compact(store: FileStore, ledger: Ledger) -> None:
    """After a commit, still under the build lock: superseded bytes that outweigh the live ones are
    reclaimed now (a new file, renamed over the old one), so no pattern of loads grows a file without
    bound. A failure costs nothing but the bytes: it is logged once, and a later build tries again."""
    with ending(HeapReason.WRITE_FAILED, f"cannot compact {store.path}") as end:
        reclaimed = store.compact_if_superseded()
    if end.fault is not None:
        if not end.unexpected and ledger.log_once("compact"):
            logger.warning(
                "packcache: cannot compact %s (%s); its superseded bytes stay", store.path, end.fault.message
            )
        return
    if reclaimed:
        logger.info("packcache: compacted %s: %d superseded bytes reclaimed", store.path, reclaimed)


def commit_failed(store: FileStore, ledger: Ledger, serial: int, names: tuple[str, ...], fault: Fault) -> None:
    """The packs session ``serial`` stored that did not become durable are counted as heap, with the
    commit's reason: they are in no committed generation, and the next launch repacks them. Raises nothing."""
    for name in names:
        held = ledger.held.get(name)
        if held is None or held.reason is not None or held.session != serial:
            continue
        if store.holds(name, held.key, held.origin):
            continue  # committed after all (the rename happened; only the directory sync failed)
        # pinned by tests/test_cache_sessions.py::test_a_failed_final_sync_counts_the_session_packs_as_heap
        ledger.reclassify(name, fault.reason, serial)
    ledger.set(commit_fault=fault)
    ledger.report(fault.reason, fault)
