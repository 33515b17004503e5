"""Ownership of a cache: the one session that uses it now, its thread, and the cache's own state.

A ``WeightCache`` and its sessions share one :class:`Owner`. A session becomes the owner on entry and
stops being it at its end; ``release()`` and ``close()`` wait until nobody owns the cache. Every change
happens inside ``with owner.lock``, a plain lock held only for the change, never across a session: an
interrupt (Ctrl-C) can never leave the cache owned by a session that is gone.
"""

from __future__ import annotations

import enum
import threading
from typing import Protocol

__all__ = ["CacheState", "Owner"]


class CacheState(enum.Enum):
    """Where a cache is in its life: ``open`` -> ``finalized`` (``WeightCache.finalize()``: misses go to
    heap, hits still map) -> ``closed`` (final; a closed cache inserts nothing either). It only moves
    down, and ``closed`` is reached from both."""

    OPEN = "open"
    FINALIZED = "finalized"
    CLOSED = "closed"


class Occupant(Protocol):
    """What another thread may do with the session that owns a cache: find it abandoned, and end it."""

    def _abandoned(self) -> bool: ...

    def _end(self) -> None: ...


class Owner:
    """Who owns a cache now (the active session and the thread that entered it), and the cache's state.

    >>> owner = Owner()
    >>> owner.session is None, owner.state.value
    (True, 'open')
    """

    __slots__ = ("lock", "serial", "session", "state", "thread")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # entered with ``with``: a C-level enter leaves no gap for an interrupt
        self.session: Occupant | None = None
        self.thread: int | None = None  # the thread that entered ``session``
        self.state = CacheState.OPEN
        self.serial = 0  # sessions started so far: each held pack records the one that served it
