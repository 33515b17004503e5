"""Process-wide state of the cache: option defaults and the registry of live caches.

Its own module so that :mod:`packcache.options` (which reads and sets the defaults and
sums the live caches) and :mod:`packcache.cache` (which registers them) both depend on
it and not on each other. Nothing here takes a cache's lock.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from . import _defaults
from .stats import CacheStats, sum_stats

__all__ = ["DEFAULTS", "LiveCache", "aggregate_stats", "live_caches", "register", "register_unowned", "unregister"]


class LiveCache(Protocol):
    """What this module and :mod:`packcache.options` need of a cache: its path and its statistics.

    :class:`packcache.WeightCache` is one. A protocol here, below :mod:`packcache.cache`, so that no
    module of this layer names the cache class, not even for its type (tests/test_architecture.py
    counts type-only imports as edges of the import graph).
    """

    @property
    def path(self) -> str | None: ...

    def stats(self) -> CacheStats: ...


class Unowned(Protocol):
    """Figures of this process that belong to no cache (:data:`packcache._remote.UNTAKEN`: the fetches by name no
    cache has taken yet): ``stats()`` is ``None`` while there are none."""

    def stats(self) -> CacheStats | None: ...


#: Process-wide defaults of the four cache options, changed through :func:`packcache.set_option`: a mutable
#: copy of :data:`packcache._defaults.OPTIONS`. A :class:`~packcache.WeightCache` argument left ``None`` takes
#: the value here when the cache is made; an explicit one wins.
DEFAULTS: dict[str, Any] = dict(_defaults.OPTIONS)

_registry_lock = threading.Lock()
_live: tuple[weakref.ref[LiveCache], ...] = ()
_unowned: tuple[Unowned, ...] = ()


def live_caches() -> list[LiveCache]:
    """Every :class:`~packcache.WeightCache` that is alive and not closed, without taking any cache's lock."""
    return [c for c in (ref() for ref in _live) if c is not None]


def aggregate_stats() -> CacheStats:
    """Statistics summed over every live :class:`~packcache.WeightCache` in this process, and the figures that belong
    to no cache yet (a fetch by name whose file no cache has opened, or that gave no file: docs/ACCOUNTING.md).

    Takes no per-instance lock: each cache's statistics are read as
    :meth:`~packcache.WeightCache.stats` reads them.

    >>> aggregate_stats().heap_bytes >= 0
    True
    """
    unowned = [s for s in (u.stats() for u in _unowned) if s is not None]
    return sum_stats([*(c.stats() for c in live_caches()), *unowned])


def register(cache: LiveCache) -> None:
    global _live
    with _registry_lock:
        _live = (*tuple(r for r in _live if r() is not None), weakref.ref(cache))


def register_unowned(figures: Unowned) -> None:
    """Count ``figures`` in :func:`aggregate_stats` for as long as the process lives (held, not weakly)."""
    global _unowned
    with _registry_lock:
        _unowned = (*_unowned, figures)


def unregister(cache: LiveCache) -> None:
    global _live
    with _registry_lock:
        _live = tuple(r for r in _live if r() is not None and r() is not cache)
