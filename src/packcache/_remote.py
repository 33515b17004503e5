"""A fetch from a store in a cache's figures, whichever path fetched it; and the remote read-through.

**Counting.** :class:`Fetched` is one fetch's outcome as the figures count it (a hit with its bytes, or a miss
with its reason, errno and message; :meth:`Fetched.of` is the one translation of a fetch's report or error), and
:func:`count` is the one place it enters a cache's ledger (docs/ACCOUNTING.md, "Remote read-through"). Two paths fetch:

- the read-through of a cache with ``remote=`` (:class:`ReadThrough`, below) counts into its own cache at once;
- a load by a published name (:func:`packcache.fleet.names.fetch_name`: ``hf.from_pretrained(NAME, remote=...)``,
  ``run``/``serve --model NAME --remote``, ``fetch --name``) fetches before any cache exists: it leaves its outcome
  here (:func:`note_fetched`, keyed by the identity of the file it landed, or of none), and the first cache this
  process opens on that very file takes it (:func:`take_fetched`, from ``WeightCache.__init__``); a ``serve``
  worker forked after its master fetched takes it in its own cache. Until a cache takes it, and for a fetch that
  gave no file (the store down with nothing accepted before, an untrusted manifest), it counts in
  ``aggregate_stats()`` (:data:`UNTAKEN`), so Prometheus and OpenTelemetry show it too.

**Read-through.** A :class:`ReadThrough` belongs to one ``WeightCache`` and lives in one :class:`RemoteState`:
``none`` (no ``remote=``), ``untried``, ``fetching`` (one thread of one session asks the store), then ``done`` (the
file was fetched, or found already there) or ``missed`` (a counted remote miss: the load packs locally).
It is tried once per cache, whatever the outcome. Every problem ends as a remote miss, counted in the
ledger and logged once per reason; nothing here fails a model load (docs/FLEET.md, "Read-through").
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ._checks import check_remote
from ._faults import ending as ending_faults
from ._faults import errno_name
from ._ledger import Ledger
from ._registry import register_unowned
from ._storeurl import StoreURL, redact_text
from .errors import RemoteError
from .stats import REMOTE_REASONS, CacheStats

__all__ = ["Fetched", "ReadThrough", "RemoteState", "note_fetched", "take_fetched"]

logger = logging.getLogger("packcache")


@dataclasses.dataclass(frozen=True)
class Fetched:
    """One fetch from a store as a cache's figures count it: a hit (``miss`` None: the store gave the file, or said
    the one there is its file) reading ``nbytes``, or a miss for reason ``miss`` (one of
    :data:`packcache.stats.REMOTE_REASONS`) with its ``errno`` and ``message`` (no secret of the store URL in it).

    >>> Fetched.of(RemoteError("remote_untrusted", "no trusted key signed it"), 0.5).miss
    'remote_untrusted'
    """

    seconds: float
    nbytes: int = 0
    download_mbps: float = 0.0
    miss: str | None = None
    errno: int = 0
    message: str = ""

    @classmethod
    def of(cls, outcome: Any, seconds: float, scrub: Callable[[str], str] = redact_text) -> Fetched:
        """The figures of a fetch's ``outcome``: its report (a :class:`~packcache.fleet.fetch.FetchReport`: a hit),
        or the exception it raised (a miss: a :class:`~packcache.errors.RemoteError`'s reason; an ``ImportError``
        is ``remote_error`` naming the extra to install; anything else ``remote_error``)."""
        if not isinstance(outcome, BaseException):
            return cls(seconds, nbytes=outcome.bytes, download_mbps=outcome.download_mbps)
        if isinstance(outcome, RemoteError):
            reason, err, message = outcome.reason, outcome.errno or 0, str(outcome)
        elif isinstance(outcome, ImportError):
            reason, err, message = "remote_error", 0, f"{outcome} (remote= needs: pip install 'packcache[fleet]')"
        else:
            err = getattr(outcome, "errno", 0) or 0
            reason, message = "remote_error", f"{type(outcome).__name__}: {outcome}"
        if reason not in REMOTE_REASONS:
            reason = "remote_error"
        return cls(seconds, miss=reason, errno=err if isinstance(err, int) else 0, message=scrub(message))


def count(ledger: Ledger, fetched: Fetched) -> None:
    """Count ``fetched`` in ``ledger``: the one place a fetch becomes a cache's figures (``remote_hits``,
    ``remote_bytes``, ``remote_seconds``, ``remote_download_mbps``, ``remote_misses_by_reason``, ``remote_errno``,
    ``remote_error``)."""
    ledger.remote_result(
        nbytes=fetched.nbytes, seconds=fetched.seconds, miss=fetched.miss, err=fetched.errno, message=fetched.message,
        download_mbps=fetched.download_mbps,
    )  # fmt: skip


def _identity(path: str) -> tuple[int, ...] | None:
    """What says the file at ``path`` is the one a fetch landed (as :func:`packcache.fleet.fetch.file_identity`)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class _Untaken:
    """The fetches of this process no cache has taken yet (:func:`note_fetched`): each with the identity of the file it
    landed (None: it gave none). Registered once with :func:`packcache._registry.register_unowned`, so
    ``aggregate_stats()`` counts them until a cache takes them (then that cache does)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fetches: tuple[tuple[tuple[int, ...] | None, Fetched], ...] = ()  # replaced whole: read without the lock

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # a fork while another thread held it: the child's copy is free

    def stats(self) -> CacheStats | None:
        """These fetches' figures as one snapshot (state ``off``: no cache), or None when there is none."""
        fetches = self.fetches
        if not fetches:
            return None
        ledger = Ledger(None)
        for _, fetched in fetches:
            count(ledger, fetched)
        return ledger.snapshot(False, "")


#: This process's fetches by name that no cache has taken (see the module docstring).
UNTAKEN = _Untaken()
register_unowned(UNTAKEN)
os.register_at_fork(after_in_child=UNTAKEN.after_fork)


def note_fetched(path: str | None, fetched: Fetched) -> None:
    """Leave ``fetched`` for the first cache opened on the file at ``path`` as it is now (None: the fetch gave no
    file: it stays in ``aggregate_stats()``)."""
    identity = _identity(path) if path is not None else None
    with UNTAKEN.lock:
        UNTAKEN.fetches = (*UNTAKEN.fetches, (identity, fetched))


def take_fetched(ledger: Ledger, path: str) -> None:
    """Count in ``ledger`` (a cache just opened on ``path``) every fetch left for the file there
    (:func:`note_fetched`), and take them off :data:`UNTAKEN`. A file replaced since (another generation landed,
    any write) is not the one fetched: its fetch stays untaken."""
    if not any(identity is not None for identity, _ in UNTAKEN.fetches):
        return  # no stat on a cache's open when nothing was fetched
    identity = _identity(path)
    if identity is None:
        return
    with UNTAKEN.lock:
        taken = [fetched for at, fetched in UNTAKEN.fetches if at == identity]
        UNTAKEN.fetches = tuple(entry for entry in UNTAKEN.fetches if entry[0] != identity)
    for fetched in taken:
        count(ledger, fetched)


class RemoteState(enum.Enum):
    """Where a cache's read-through is; it only moves down this list (``none`` never moves)."""

    NONE = "none"
    UNTRIED = "untried"
    FETCHING = "fetching"
    DONE = "done"
    MISSED = "missed"


class ReadThrough:
    """The store a cache reads through (``remote=``), parsed once, and its :class:`RemoteState`.

    Raises:
        ValueError: (made with) ``remote`` is no store URL; the message shows it redacted.
    """

    __slots__ = ("display", "state", "url")

    def __init__(self, remote: object) -> None:
        # Parsed once: a bad URL fails here, and only the fetch sees its secrets; ``display`` is what
        # every message shows.
        # pinned by tests/test_fleet_redaction.py::test_no_library_output_shows_a_store_secret
        self.url: StoreURL | None = check_remote(remote)
        self.display: str | None = self.url.display if self.url is not None else None
        self.state = RemoteState.NONE if self.url is None else RemoteState.UNTRIED

    @property
    def tried(self) -> bool:
        """Whether this cache has asked its store (or is asking): it asks once."""
        return self.state is not RemoteState.NONE and self.state is not RemoteState.UNTRIED

    def scrub(self, text: str) -> str:
        """``text`` with no secret of the store URL in it (what the statistics and logs show)."""
        return self.url.scrub(text) if self.url is not None else redact_text(text)

    def claim(self) -> bool:
        """Move ``untried`` to ``fetching``: True for the one caller that is to fetch. Call it under a lock."""
        if self.state is not RemoteState.UNTRIED:
            return False
        self.state = RemoteState.FETCHING
        return True

    def fetch(self, ledger: Ledger, path: str, platform: bytes, fetch_options: dict[str, Any]) -> None:
        """Fetch the published file into ``path`` (after :meth:`claim`); count the result in ``ledger``.

        Runs before the build lock is taken (the fetch takes it itself, so one process per machine
        downloads and the others find the file there), without the session's mutex: other threads keep
        serving hits meanwhile. The file lands by rename; the session's refresh maps it. ``fetch_options``:
        what :func:`packcache.fleet.fetch.fetch` takes besides (``timeout``, ``lock_timeout``, modes, keys).
        Raises nothing but an interrupt.
        """
        assert self.state is RemoteState.FETCHING and self.url is not None
        started = time.perf_counter()
        trusted = fetch_options.pop("trusted_keys", ())
        with ending_faults(
            None, f"fetching from {self.display}", expected=(Exception,), scrub=self.scrub
        ) as end:  # a store problem must never fail a model load
            from .fleet.fetch import fetch, load_trusted_keys

            report = fetch(self.url, path, platform=platform, trusted_keys=load_trusted_keys(trusted), **fetch_options)
        exc = end.exc
        fetched = Fetched.of(report if exc is None else exc, time.perf_counter() - started, self.scrub)
        count(ledger, fetched)
        if exc is None:
            self.state = RemoteState.DONE
            logger.info(
                "packcache: %s %s from %s (generation %d, %d bytes read, %.0f MB/s)",
                "fetched" if report.downloaded else "found", path, self.display, report.generation, report.bytes,
                report.download_mbps,
            )  # fmt: skip
            return
        if not isinstance(exc, RemoteError | ImportError):
            logger.debug("packcache: unexpected error fetching %s: %s", self.display,
                         self.scrub(f"{type(exc).__name__}: {exc}"))  # fmt: skip
        self.state = RemoteState.MISSED
        assert fetched.miss is not None
        if ledger.log_once(fetched.miss):
            logger.warning("packcache: %s [%s]: %s; packing locally", fetched.miss,
                           errno_name(fetched.errno, "no errno"), fetched.message)  # fmt: skip
