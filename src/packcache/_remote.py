"""Remote read-through: a cache with ``remote=`` fetches the file published for it once, at its first miss.

A :class:`ReadThrough` belongs to one ``WeightCache`` and lives in one :class:`RemoteState`: ``none`` (no
``remote=``), ``untried``, ``fetching`` (one thread of one session asks the store), then ``done`` (the
file was fetched, or found already there) or ``missed`` (a counted remote miss: the load packs locally).
It is tried once per cache, whatever the outcome. Every problem ends as a remote miss, counted in the
ledger and logged once per reason; nothing here fails a model load (docs/FLEET.md, "Read-through").
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any

from ._checks import check_remote
from ._faults import ending as ending_faults
from ._faults import errno_name
from ._ledger import Ledger
from ._storeurl import StoreURL, redact_text
from .errors import RemoteError
from .stats import REMOTE_REASONS

__all__ = ["ReadThrough", "RemoteState"]

logger = logging.getLogger("packcache")


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
        if exc is None:
            self.state = RemoteState.DONE
            ledger.remote_result(
                nbytes=report.bytes, seconds=time.perf_counter() - started, download_mbps=report.download_mbps
            )
            logger.info(
                "packcache: %s %s from %s (generation %d, %d bytes read, %.0f MB/s)",
                "fetched" if report.downloaded else "found", path, self.display, report.generation, report.bytes,
                report.download_mbps,
            )  # fmt: skip
            return
        if isinstance(exc, RemoteError):
            reason, err, message = exc.reason, exc.errno or 0, str(exc)
        elif isinstance(exc, ImportError):
            reason, err, message = "remote_error", 0, f"{exc} (remote= needs: pip install 'packcache[fleet]')"
        else:
            logger.debug("packcache: unexpected error fetching %s: %s", self.display,
                         self.scrub(f"{type(exc).__name__}: {exc}"))  # fmt: skip
            err = getattr(exc, "errno", 0) or 0
            reason, message = "remote_error", f"{type(exc).__name__}: {exc}"
        self.state = RemoteState.MISSED
        if reason not in REMOTE_REASONS:
            reason = "remote_error"
        message = self.scrub(message)
        ledger.remote_result(nbytes=0, seconds=time.perf_counter() - started, miss=reason, err=err, message=message)
        if ledger.log_once(reason):
            logger.warning("packcache: %s [%s]: %s; packing locally", reason, errno_name(err, "no errno"), message)
