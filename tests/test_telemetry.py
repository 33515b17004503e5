"""Telemetry exporters with the real libraries: OpenTelemetry SDK reader, Prometheus over HTTP."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import packcache
from harness import stuck_in_pack
from packcache.telemetry import otel, prometheus


@pytest.fixture
def caches(tmp_path: Path) -> Iterator[list[packcache.WeightCache]]:
    """One cache mapping 4000 bytes, one with 800 heap bytes under read_only."""
    path = tmp_path / "m.pcache"
    with packcache.WeightCache(path) as c, c.session() as s:
        s.get_or_pack("a", lambda: np.ones(1000, np.float32))
    mapped = packcache.WeightCache(path)
    with mapped.session() as s:
        s.get_or_pack("a", lambda: pytest.fail("hit expected"))
    degraded = packcache.WeightCache(path, read_only=True)
    with degraded.session() as s:
        s.get_or_pack("missing", lambda: np.ones(100, np.float64))
    yield [mapped, degraded]
    mapped.close()
    degraded.close()


def otel_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        m.name: list(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }


def test_otel_gauges_report_the_aggregate(caches: list[packcache.WeightCache]) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    otel.register(provider)
    points = otel_points(reader)
    heap = {p.attributes["reason"]: p.value for p in points["packcache.heap_bytes"]}
    expected = packcache.aggregate_stats()
    assert heap == expected.heap_bytes_by_reason and heap["read_only"] >= 800
    assert points["packcache.mapped_bytes"][0].value == expected.mapped_bytes >= 4000
    assert points["packcache.file_bytes"][0].value == expected.file_bytes > 0
    (state,) = points["packcache.state"]
    assert state.attributes["state"] == expected.state == "degraded" and state.value == 4
    provider.shutdown()


def test_prometheus_collector_scraped_over_real_http(caches: list[packcache.WeightCache]) -> None:
    registry = CollectorRegistry()
    prometheus.register(registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    expected = packcache.aggregate_stats()
    assert samples[("packcache_heap_bytes", (("reason", "read_only"),))] == expected.heap_bytes_by_reason["read_only"]
    assert samples[("packcache_mapped_bytes", ())] == expected.mapped_bytes
    assert samples[("packcache_state", (("state", "degraded"),))] == 4
    assert samples[("packcache_errno", ())] == expected.errno


def test_scrapes_never_wait_on_a_session(tmp_path: Path) -> None:
    """A scrape during a session stuck inside pack() completes: exporters read the lock-free aggregate."""
    registry = CollectorRegistry()
    prometheus.register(registry)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    otel.register(provider)
    cache = packcache.WeightCache(tmp_path / "m.pcache")
    try:
        with stuck_in_pack(cache, timeout=10) as t:
            from prometheus_client import generate_latest

            assert b"packcache_mapped_bytes" in generate_latest(registry)
            assert "packcache.heap_bytes" in otel_points(reader)
            assert t.is_alive(), "the session was still inside pack() during both scrapes"
    finally:
        cache.close()
        provider.shutdown()


def test_reclaimable_bytes_reach_the_stats_the_options_and_both_exporters(tmp_path: Path) -> None:
    """Superseded bytes (fewer than the live ones, so no build compacts them) are reported everywhere a
    dashboard reads: CacheStats, the options channel, Prometheus and OpenTelemetry."""
    path = tmp_path / "m.pcache"
    with packcache.WeightCache(path) as c:
        with c.session() as s:
            s.get_or_pack("big", lambda: np.ones(20_000, np.float32))
            s.get_or_pack("small", lambda: np.ones(1000, np.float32), key={"version": 1})
        with c.session() as s:  # a new version of the small pack supersedes its first copy
            s.get_or_pack("small", lambda: np.zeros(1000, np.float32), key={"version": 2})
        assert c.stats().reclaimable_bytes == packcache.inspect(path).reclaimable_bytes >= 4000
    registry = CollectorRegistry()
    prometheus.register(registry)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    otel.register(provider)
    cache = packcache.WeightCache(path)
    try:
        with cache.session() as s:
            s.get_or_pack("big", lambda: pytest.fail("hit expected"))
        expected = packcache.inspect(path).reclaimable_bytes
        assert cache.stats().reclaimable_bytes == expected and cache.stats().state == "mapped"
        assert cache.get_option("packed_cache_reclaimable_bytes") == expected
        assert cache.get_option("packed_cache_reclaimable_mib") == expected / 2**20
        total = packcache.aggregate_stats().reclaimable_bytes
        assert total >= expected and packcache.get_option("packed_cache_reclaimable_bytes") == total
        from prometheus_client import generate_latest

        scraped = {
            s.name: s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
        }
        assert scraped["packcache_reclaimable_bytes"] == total
        assert otel_points(reader)["packcache.reclaimable_bytes"][0].value == total
    finally:
        cache.close()
        provider.shutdown()


def test_the_last_downloads_throughput_reaches_the_stats_the_options_and_both_exporters(tmp_path: Path) -> None:
    """A cache that got its file from a store reports the download's MB/s in CacheStats, the options channel,
    Prometheus and OpenTelemetry (the field ``packcache fetch`` prints)."""
    from packcache.fleet.publish import publish

    platform = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}
    built = tmp_path / "a" / "model-x.pcache"
    with packcache.WeightCache(built, platform=platform) as c, c.session() as s:
        s.get_or_pack("w", lambda: np.ones(1 << 20, np.float32), {"packer": "test.f32", "version": 1})
    (tmp_path / "store").mkdir()
    publish(built, str(tmp_path / "store"))
    registry = CollectorRegistry()
    prometheus.register(registry)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    otel.register(provider)
    cache = packcache.WeightCache(
        tmp_path / "b" / "model-x.pcache", platform=platform, remote=str(tmp_path / "store"), allow_unsigned=True
    )
    try:
        with cache.session() as s:
            s.get_or_pack("w", lambda: pytest.fail("the fetched file holds it"), {"packer": "test.f32", "version": 1})
        mbps = cache.stats().remote_download_mbps
        assert cache.stats().remote_hits == 1 and mbps > 0
        assert cache.get_option("packed_cache_remote_download_mbps") == mbps
        total = packcache.aggregate_stats().remote_download_mbps
        assert total >= mbps
        from prometheus_client import generate_latest

        scraped = {
            s.name: s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
        }
        assert scraped["packcache_remote_download_mbps"] == total
        assert otel_points(reader)["packcache.remote_download_mbps"][0].value == total
    finally:
        cache.close()
        provider.shutdown()
