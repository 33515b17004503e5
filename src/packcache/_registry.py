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

__all__ = ["DEFAULTS", "LiveCache", "aggregate_stats", "live_caches", "register", "unregister"]


class LiveCache(Protocol):
    """What this module and :mod:`packcache.options` need of a cache: its path and its statistics.

    :class:`packcache.WeightCache` is one. A protocol here, below :mod:`packcache.cache`, so that no
    module of this layer names the cache class, not even for its type (tests/test_architecture.py
    counts type-only imports as edges of the import graph).
    """

    @property
    def path(self) -> str | None: ...

    def stats(self) -> CacheStats: ...


#: Process-wide defaults of the four cache options, changed through :func:`packcache.set_option`: a mutable
#: copy of :data:`packcache._defaults.OPTIONS`. A :class:`~packcache.WeightCache` argument left ``None`` takes
#: the value here when the cache is made; an explicit one wins.
DEFAULTS: dict[str, Any] = dict(_defaults.OPTIONS)

_registry_lock = threading.Lock()
_live: tuple[weakref.ref[LiveCache], ...] = ()


def live_caches() -> list[LiveCache]:
    """Every :class:`~packcache.WeightCache` that is alive and not closed, without taking any cache's lock."""
    return [c for c in (ref() for ref in _live) if c is not None]


def aggregate_stats() -> CacheStats:
    """Statistics summed over every live :class:`~packcache.WeightCache` in this process.

    Takes no per-instance lock: each cache's statistics are read as
    :meth:`~packcache.WeightCache.stats` reads them.

    >>> aggregate_stats().heap_bytes >= 0
    True
    """
    return sum_stats(c.stats() for c in live_caches())


def register(cache: LiveCache) -> None:
    global _live
    with _registry_lock:
        _live = (*tuple(r for r in _live if r() is not None), weakref.ref(cache))


def unregister(cache: LiveCache) -> None:
    global _live
    with _registry_lock:
        _live = tuple(r for r in _live if r() is not None and r() is not cache)
