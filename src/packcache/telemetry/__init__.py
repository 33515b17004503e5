"""Exporters of packcache's figures to monitoring systems (optional extras).

Both read :func:`packcache.aggregate_stats`, which takes no lock, so a scrape
never waits on a model load.

* :mod:`packcache.telemetry.otel` — OpenTelemetry observable gauges
  (``pip install 'packcache[otel]'``).
* :mod:`packcache.telemetry.prometheus` — a Prometheus collector
  (``pip install 'packcache[prometheus]'``).
"""

from __future__ import annotations

from ..stats import CacheState, HeapReason

__all__ = ["STATE_VALUES", "reasons"]

#: Numeric encoding of the state for gauges: 0 off, 1 mapped, 2 stored, 3 heap, 4 degraded.
STATE_VALUES = {
    CacheState.OFF.value: 0,
    CacheState.MAPPED.value: 1,
    CacheState.STORED.value: 2,
    CacheState.HEAP.value: 3,
    CacheState.DEGRADED.value: 4,
}


def reasons() -> list[str]:
    """Every heap reason, in declaration order."""
    return [r.value for r in HeapReason]
