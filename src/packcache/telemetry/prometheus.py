"""Prometheus collector over the lock-free aggregate.

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> registry = CollectorRegistry()
>>> _ = register(registry)
>>> b'packcache_heap_bytes{reason="no_space"}' in generate_latest(registry)
True
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import REGISTRY, CollectorRegistry, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..cache import aggregate_stats
from ..stats import REMOTE_REASONS
from . import STATE_VALUES, reasons

__all__ = ["PackCacheCollector", "register"]


class PackCacheCollector(Collector):
    """Yields packcache's gauges at each scrape, from :func:`packcache.aggregate_stats`."""

    def collect(self) -> Iterator[Metric]:
        s = aggregate_stats()
        heap = GaugeMetricFamily("packcache_heap_bytes", "Bytes of packs held on heap, by reason", labels=["reason"])
        for reason in reasons():
            heap.add_metric([reason], s.heap_bytes_by_reason.get(reason, 0))
        yield heap
        yield GaugeMetricFamily("packcache_mapped_bytes", "Bytes of packs mapped from cache files", s.mapped_bytes)
        yield GaugeMetricFamily("packcache_file_bytes", "Size of cache files", s.file_bytes)
        yield GaugeMetricFamily(
            "packcache_reclaimable_bytes", "Bytes of cache files compaction would reclaim", s.reclaimable_bytes
        )
        state = GaugeMetricFamily("packcache_state", "0 off, 1 mapped, 2 stored, 3 heap, 4 degraded", labels=["state"])
        state.add_metric([s.state], STATE_VALUES[s.state])
        yield state
        yield GaugeMetricFamily("packcache_errno", "errno of the latest failure, 0 if none", s.errno)
        yield GaugeMetricFamily("packcache_remote_hits", "Cache files got from the store, not packed", s.remote_hits)
        yield GaugeMetricFamily("packcache_remote_bytes", "Bytes read from the store", s.remote_bytes)
        yield GaugeMetricFamily(
            "packcache_remote_download_mbps", "Throughput of the last download from the store, MB/s",
            s.remote_download_mbps,
        )  # fmt: skip
        misses = GaugeMetricFamily(
            "packcache_remote_misses", "Fetches from the store that did not give a cache its file, by reason",
            labels=["reason"],
        )  # fmt: skip
        for reason in REMOTE_REASONS:
            misses.add_metric([reason], s.remote_misses_by_reason.get(reason, 0))
        yield misses


def register(registry: CollectorRegistry = REGISTRY) -> PackCacheCollector:
    """Register a :class:`PackCacheCollector` on ``registry`` (default: the global one)."""
    collector = PackCacheCollector()
    registry.register(collector)
    return collector
