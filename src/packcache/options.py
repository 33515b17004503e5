"""The string-keyed options channel, as runtimes expose backend options.

Read-only keys report statistics (per cache, or summed over every live cache
through the module-level functions). Writable keys configure a cache, or set
process-wide defaults for caches created afterwards: a ``WeightCache`` argument
left ``None`` takes the process default, an explicit one wins over it (the
defaults themselves are written once, in :mod:`packcache._defaults`). An unknown key raises
:class:`~packcache.errors.OptionError` naming the close matches; writing a
read-only key or a value of the wrong type raises too. Nothing is ever accepted
silently.

>>> import packcache
>>> cache = packcache.WeightCache(None)           # caching off: nothing held yet
>>> cache.get_option("packed_cache_state"), cache.get_option("packed_cache_heap_reason")
('off', 'none')
>>> cache.close()
>>> packcache.get_option("packed_cache_heap_mb")
Traceback (most recent call last):
...
packcache.errors.OptionError: unknown option 'packed_cache_heap_mb'; did you mean 'packed_cache_heap_mib'?
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._registry import DEFAULTS, LiveCache, aggregate_stats
from .errors import OptionError, OptionTypeError, OptionValueError, ReadOnlyOptionError
from .stats import CacheStats

__all__ = ["OPTION_KEYS", "get_instance_option", "get_option", "set_instance_option", "set_option"]

_MIB = float(1 << 20)
_PREFIX = "packed_cache_"


@dataclass(frozen=True)
class _Key:
    type: type
    doc: str
    read: Callable[[CacheStats], Any] | None = None  # set for statistics keys
    attribute: str | None = None  # set for configuration keys


def _stat(field: str, doc: str, kind: type = int) -> _Key:
    return _Key(kind, doc, read=lambda s: getattr(s, field))


def _mib(field: str, doc: str) -> _Key:
    return _Key(float, doc, read=lambda s: getattr(s, field) / _MIB)


_KEYS: dict[str, _Key] = {
    "packed_cache_state": _stat("state", "state: off, heap, degraded, stored or mapped", str),
    "packed_cache_errno": _stat("errno", "errno of the latest failure, 0 if none"),
    "packed_cache_error": _stat("error", "message of the latest failure, '' if none", str),
    "packed_cache_heap_reason": _stat("heap_reason", "reason holding the most heap bytes, 'none' if no heap", str),
    "packed_cache_heap_mib": _mib("heap_bytes", "heap MiB held"),
    "packed_cache_mapped_mib": _mib("mapped_bytes", "mapped MiB held"),
    "packed_cache_file_mib": _mib("file_bytes", "cache file size in MiB"),
    "packed_cache_written_mib": _mib("written_bytes", "MiB written to cache files"),
    "packed_cache_reclaimable_mib": _mib("reclaimable_bytes", "MiB of the cache file compaction would reclaim"),
    "packed_cache_heap_bytes": _stat("heap_bytes", "heap bytes held"),
    "packed_cache_mapped_bytes": _stat("mapped_bytes", "mapped bytes held"),
    "packed_cache_file_bytes": _stat("file_bytes", "cache file size in bytes"),
    "packed_cache_written_bytes": _stat("written_bytes", "bytes written to cache files"),
    "packed_cache_reclaimable_bytes": _stat(
        "reclaimable_bytes", "bytes of the cache file compaction would reclaim (superseded packs, older indexes)"
    ),
    "packed_cache_hits": _stat("hits", "packs mapped from existing entries"),
    "packed_cache_stored": _stat("stored", "packs written to the file and served mapped"),
    "packed_cache_heap_packs": _stat("heap_packs", "packs served from heap"),
    "packed_cache_remote_hits": _stat("remote_hits", "cache files got from the store (remote=) instead of packed"),
    "packed_cache_remote_bytes": _stat("remote_bytes", "bytes read from the store"),
    "packed_cache_remote_seconds": _stat("remote_seconds", "seconds spent asking the store", float),
    "packed_cache_remote_download_mbps": _stat(
        "remote_download_mbps", "throughput of the last download from the store, MB/s (0 if none)", float
    ),
    "packed_cache_remote_misses": _stat(
        "remote_misses_by_reason", "fetches that did not give the cache its file, by reason (a dict)", dict
    ),
    "packed_cache_remote_errno": _stat("remote_errno", "errno of the latest remote miss, 0 if none"),
    "packed_cache_remote_error": _stat("remote_error", "message of the latest remote miss, '' if none", str),
    "packed_cache_enabled": _Key(bool, "caching on (True) or off (False)", attribute="enabled"),
    "packed_cache_read_only": _Key(bool, "never write; missing entries go to heap (read_only)", attribute="read_only"),
    "packed_cache_verify": _Key(bool, "check each hit's checksum before serving it", attribute="verify"),
    "packed_cache_lock_timeout": _Key(
        float, "seconds to wait for another process's build lock", attribute="lock_timeout"
    ),
}

#: Every option key, sorted.
OPTION_KEYS: tuple[str, ...] = tuple(sorted(_KEYS))


def _lookup(key: object) -> _Key:
    if not isinstance(key, str):
        raise OptionTypeError(f"option keys are str, got {type(key).__name__}")
    spec = _KEYS.get(key)
    if spec is None:
        # Match on what follows the shared prefix, or every key looks close to every other.
        tail = key.removeprefix(_PREFIX)
        tails = [k.removeprefix(_PREFIX) for k in OPTION_KEYS]
        close = [_PREFIX + t for t in difflib.get_close_matches(tail, tails, n=3, cutoff=0.75)]
        hint = (
            f"; did you mean {' or '.join(repr(c) for c in close)}?"
            if close
            else f"; known keys: {', '.join(OPTION_KEYS)}"
        )
        raise OptionError(f"unknown option {key!r}{hint}")
    return spec


def _coerce(key: str, spec: _Key, value: object) -> Any:
    if spec.read is not None:
        raise ReadOnlyOptionError(f"option {key!r} is read-only ({spec.doc})")
    if spec.type is bool:
        if not isinstance(value, bool):
            raise OptionTypeError(f"option {key!r} takes a bool, got {type(value).__name__} {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError(f"option {key!r} takes a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise OptionValueError(f"option {key!r} must be finite and >= 0, got {value!r}")
    return float(value)


def get_instance_option(cache: LiveCache, key: str) -> Any:
    """Read ``key`` for one cache. Statistics come from its lock-free snapshot."""
    spec = _lookup(key)
    if spec.read is not None:
        return spec.read(cache.stats())
    assert spec.attribute is not None
    return getattr(cache, spec.attribute)


def set_instance_option(cache: LiveCache, key: str, value: object) -> None:
    """Write a configuration key for one cache.

    Raises:
        OptionError: unknown key. ReadOnlyOptionError: a statistics key.
        OptionTypeError / OptionValueError: a value of the wrong type or range.
    """
    spec = _lookup(key)
    value = _coerce(key, spec, value)
    assert spec.attribute is not None
    if spec.attribute == "enabled" and value and cache.path is None:
        raise OptionValueError("cannot enable a cache that has no path (WeightCache(None))")
    setattr(cache, spec.attribute, value)


def get_option(key: str) -> Any:
    """Read ``key`` process-wide: statistics summed over live caches, or a default.

    >>> get_option("packed_cache_lock_timeout")
    30.0
    """
    spec = _lookup(key)
    if spec.read is not None:
        return spec.read(aggregate_stats())
    assert spec.attribute is not None
    return DEFAULTS[spec.attribute]


def set_option(key: str, value: object) -> None:
    """Set a process-wide default, used by caches created afterwards that leave the argument ``None``
    (``WeightCache(path, verify=False)`` does not verify whatever the process default says).

    Raises:
        OptionError, ReadOnlyOptionError, OptionTypeError, OptionValueError.
    """
    spec = _lookup(key)
    value = _coerce(key, spec, value)
    assert spec.attribute is not None
    DEFAULTS[spec.attribute] = value
