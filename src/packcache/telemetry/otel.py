"""OpenTelemetry metrics bridge: observable gauges over the lock-free aggregate.

>>> from opentelemetry.sdk.metrics import MeterProvider
>>> from opentelemetry.sdk.metrics.export import InMemoryMetricReader
>>> reader = InMemoryMetricReader()
>>> instruments = register(MeterProvider(metric_readers=[reader]))
>>> sorted(m.name for rm in reader.get_metrics_data().resource_metrics
...        for sm in rm.scope_metrics for m in sm.metrics)[:2]
['packcache.file_bytes', 'packcache.heap_bytes']
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, MeterProvider, ObservableGauge, Observation, get_meter_provider

from ..cache import aggregate_stats
from ..stats import REMOTE_REASONS
from . import STATE_VALUES, reasons

__all__ = ["register"]


def _heap(options: CallbackOptions) -> Iterable[Observation]:
    by_reason = aggregate_stats().heap_bytes_by_reason
    return [Observation(by_reason.get(r, 0), {"reason": r}) for r in reasons()]


def _mapped(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(aggregate_stats().mapped_bytes)]


def _file(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(aggregate_stats().file_bytes)]


def _reclaimable(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(aggregate_stats().reclaimable_bytes)]


def _remote_hits(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(aggregate_stats().remote_hits)]


def _remote_bytes(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(aggregate_stats().remote_bytes)]


def _remote_download_mbps(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(aggregate_stats().remote_download_mbps)]


def _remote_misses(options: CallbackOptions) -> Iterable[Observation]:
    by_reason = aggregate_stats().remote_misses_by_reason
    return [Observation(by_reason.get(r, 0), {"reason": r}) for r in REMOTE_REASONS]


def _state(options: CallbackOptions) -> Iterable[Observation]:
    state = aggregate_stats().state
    return [Observation(STATE_VALUES[state], {"state": state})]


def register(meter_provider: MeterProvider | None = None) -> list[ObservableGauge]:
    """Create packcache's gauges on ``meter_provider`` (default: the global one).

    Gauges: ``packcache.heap_bytes`` (attribute ``reason``), ``packcache.mapped_bytes``,
    ``packcache.file_bytes``, ``packcache.reclaimable_bytes``, ``packcache.state`` (0 off, 1 mapped, 2 stored, 3 heap,
    4 degraded; attribute ``state``), ``packcache.remote_hits``, ``packcache.remote_bytes``,
    ``packcache.remote_download_mbps`` (the last download's throughput, MB/s: the highest of the live caches') and
    ``packcache.remote_misses`` (attribute ``reason``: every reason of docs/FLEET.md). Other values are
    summed over every live cache.
    """
    meter = (meter_provider or get_meter_provider()).get_meter("packcache")
    return [
        meter.create_observable_gauge(
            "packcache.heap_bytes", [_heap], unit="By", description="bytes of packs held on heap, by reason"
        ),
        meter.create_observable_gauge(
            "packcache.mapped_bytes", [_mapped], unit="By", description="bytes of packs mapped from cache files"
        ),
        meter.create_observable_gauge("packcache.file_bytes", [_file], unit="By", description="cache file sizes"),
        meter.create_observable_gauge(
            "packcache.reclaimable_bytes",
            [_reclaimable],
            unit="By",
            description="bytes of cache files compaction would reclaim",
        ),
        meter.create_observable_gauge(
            "packcache.remote_hits", [_remote_hits], description="cache files got from the store instead of packed"
        ),
        meter.create_observable_gauge(
            "packcache.remote_bytes", [_remote_bytes], unit="By", description="bytes read from the store"
        ),
        meter.create_observable_gauge(
            "packcache.remote_download_mbps",
            [_remote_download_mbps],
            unit="MBy/s",
            description="throughput of the last download from the store",
        ),
        meter.create_observable_gauge(
            "packcache.remote_misses",
            [_remote_misses],
            description="fetches from the store that did not give a cache its file, by reason",
        ),
        meter.create_observable_gauge(
            "packcache.state", [_state], description="0 off, 1 mapped, 2 stored, 3 heap, 4 degraded"
        ),
    ]
