"""Prometheus figures of every worker, in prometheus_client's multiprocess mode.

This is the setup the client library documents for gunicorn
(https://prometheus.github.io/client_python/multiprocess/): ``PROMETHEUS_MULTIPROC_DIR``
is set before ``prometheus_client`` is first imported (the master does it, then forks),
every worker writes its metrics to files in that directory, the master's ``child_exit``
hook calls :func:`mark_process_dead` for each worker that ends, and ``GET /metrics``
collects the files into a fresh ``CollectorRegistry`` with ``MultiProcessCollector``
(:func:`exposition`). No metric is registered on a registry: in multiprocess mode every
metric created is exported through the files.

Per worker (gauges in ``liveall`` mode: the client adds a ``pid`` label and drops the
series when the worker's pid is marked dead):

===========================================  ==============================================
``packcache_state{state}``                   1 for the cache's state, 0 for the four others
                                             (``off``, ``heap``, ``degraded``, ``stored``,
                                             ``mapped``): ``== 1`` selects, ``sum by (state)``
                                             counts workers per state
``packcache_heap_reason{reason}``            1 for the dominant heap reason (``none`` if no
                                             heap), 0 for every other
``packcache_heap_bytes{reason}``             heap bytes per reason, every reason, 0 included
``packcache_mapped_bytes``                   bytes served from the file mapping
``packcache_file_bytes``                     size of the cache file
``packcache_reclaimable_bytes``              bytes of it compaction would reclaim
``packcache_written_bytes``                  bytes this worker wrote to the file (its build)
``packcache_errno``                          errno of the latest failure, 0 if none
``packcache_packs{outcome}``                 requests that ended ``hit``, ``stored``, ``heap``
``packcache_remote_hits``                    cache files got from the store (``--remote``)
``packcache_remote_bytes``                   bytes read from the store
``packcache_remote_download_mbps``           throughput of the last download, MB/s (0 if none)
``packcache_remote_misses{reason}``          fetches that did not give the cache its file, by
                                             reason (every reason of docs/FLEET.md, 0 included)
``packcache_load_seconds``                   the worker's model load (cache open, map or pack)
``packcache_worker_info{engine,scheme,...}`` 1, with what the worker serves as labels
``packcache_file_check{state}``              1 for the state of the background check of the
                                             cache file it maps, 0 for the others (``none``,
                                             ``not_started``, ``running``, ``passed``,
                                             ``failed``, ``error``; :mod:`.filecheck`)
``packcache_file_check_failed_packs``        packs of that file whose bytes failed their
                                             checksum (``/healthz`` then answers 503)
``packcache_file_check_checked_bytes``       pack bytes the check has read so far
``packcache_file_check_finished_timestamp_`` when the check finished (Unix time; 0 until it
``seconds``                                  did)
===========================================  ==============================================

A worker of the ``sentence-transformers`` engine has no cache: it exports only
``packcache_worker_info`` and ``packcache_load_seconds``.

Requests, with an explicit ``pid`` label (counters and histograms are summed over the
files; the label keeps each worker's figures apart, ``sum without (pid)`` gives the
service's): ``packcache_http_requests_total{route,code,pid}`` and
``packcache_http_request_duration_seconds{route,pid}`` (a histogram of the time from the
request's arrival in the application to its response body being ready). ``route`` is
one of the application's paths (``/embed``, ``/v1/embeddings``, ``/v1/chat/completions``, ``/metrics``, ...) or
``other``, never a raw path the client chose. A worker serving a causal LM adds
``packcache_prompt_tokens_total{pid}`` and ``packcache_completion_tokens_total{pid}`` (tokens read and generated), the
histogram
``packcache_time_to_first_token_seconds{pid}`` (a request's arrival in the application to its first text), and the
gauge ``packcache_generation_tokens_per_second{pid}`` (tokens it generated over the last 10 s, per second). A replaced
worker's request series stay in the files (totals never go back) until the server
restarts, as the client library keeps them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.metrics_core import Metric

from ..stats import REMOTE_REASONS, CacheState, CacheStats, HeapReason
from .filecheck import CheckState, FileCheck

__all__ = ["WorkerMetrics", "exposition", "mark_process_dead"]

_STATES = tuple(s.value for s in CacheState)
_CHECK_STATES = tuple(s.value for s in CheckState)
_REASONS = tuple(r.value for r in HeapReason)
#: Seconds: an 8-text batch takes milliseconds, a 256-text batch of long texts seconds.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(name, documentation, labels, registry=None, multiprocess_mode="liveall")


class WorkerMetrics:
    """This worker's metrics. Create it in the worker, after the fork (the files carry its pid).

    Args:
        engine, scheme, kernel_path, cache_file: what the worker serves (``worker_info``'s labels).
        load_seconds: how long its model load took.
        file_check: what the background check of its cache file found so far
            (:meth:`~packcache.server.filecheck.FileChecker.current`), published beside the cache's figures.
    """

    def __init__(
        self,
        engine: str,
        scheme: str,
        kernel_path: str,
        cache_file: str,
        load_seconds: float,
        file_check: Callable[[], FileCheck] | None = None,
    ) -> None:
        self.pid = str(os.getpid())
        self._file_check = file_check
        self._check_gauges: tuple[Gauge, Gauge, Gauge, Gauge] | None = None
        self._published_check: FileCheck | None = None
        # Written after the cache's first figures (publish): a scrape that sees a worker's info then
        # always sees its state too (the tests, and dashboards, take info as "loaded").
        self._info: tuple[str, str, str, str, float] | None = (engine, scheme, kernel_path, cache_file, load_seconds)
        self.requests = Counter(
            "packcache_http_requests", "HTTP requests by route and status code", ("route", "code", "pid"), registry=None
        )
        self.latency = Histogram(
            "packcache_http_request_duration_seconds",
            "Seconds from a request's arrival in the application to its response body",
            ("route", "pid"),
            registry=None,
            buckets=_BUCKETS,
        )
        # Forwards of the model and what each carried: requests merged by the batcher, texts, tokens read.
        self.forward_requests = Histogram(
            "packcache_forward_requests", "Requests merged into one forward of the model", ("pid",),
            registry=None, buckets=_COUNT_BUCKETS,
        )  # fmt: skip
        self.forward_texts = Histogram(
            "packcache_forward_texts", "Texts in one forward of the model", ("pid",),
            registry=None, buckets=_COUNT_BUCKETS,
        )  # fmt: skip
        self.forward_tokens = Counter(
            "packcache_forward_tokens", "Tokens the model read (each text's, at most its max_tokens)", ("pid",),
            registry=None,
        )  # fmt: skip
        self._cache: tuple[Gauge, ...] | None = None
        self._generation: tuple[Counter, Counter, Histogram, Gauge] | None = None  # made by a causal LM's first count
        self._published: tuple[object, ...] | None = None

    def _cache_gauges(self) -> tuple[Gauge, ...]:
        if self._cache is None:
            self._cache = (
                _gauge("packcache_state", "1 for the cache's state (off, heap, degraded, stored, mapped)", ("state",)),
                _gauge("packcache_heap_reason", "1 for the dominant heap reason, none if no heap", ("reason",)),
                _gauge("packcache_heap_bytes", "Bytes of packs held on heap, by reason", ("reason",)),
                _gauge("packcache_mapped_bytes", "Bytes of packs mapped from the cache file"),
                _gauge("packcache_file_bytes", "Size of the cache file"),
                _gauge("packcache_reclaimable_bytes", "Bytes of the cache file compaction would reclaim"),
                _gauge("packcache_written_bytes", "Bytes this worker wrote to the cache file"),
                _gauge("packcache_errno", "errno of the latest failure, 0 if none"),
                _gauge("packcache_packs", "Pack requests by outcome (hit, stored, heap)", ("outcome",)),
                _gauge("packcache_remote_hits", "Cache files got from the store instead of packed"),
                _gauge("packcache_remote_bytes", "Bytes read from the store"),
                _gauge("packcache_remote_download_mbps", "Throughput of the last download from the store, MB/s"),
                _gauge("packcache_remote_misses", "Fetches that did not give the file, by reason", ("reason",)),
            )
        return self._cache

    def _announce(self) -> None:
        if self._info is None:
            return
        engine, scheme, kernel_path, cache_file, load_seconds = self._info
        info = _gauge(
            "packcache_worker_info", "What the worker serves", ("engine", "scheme", "kernel_path", "cache_file")
        )
        info.labels(engine, scheme, kernel_path, cache_file).set(1)
        _gauge("packcache_load_seconds", "Seconds the worker's model load took").set(load_seconds)
        self._info = None

    def publish(self, stats: CacheStats | None) -> None:
        """Write the cache's figures (a no-op when nothing changed since the last call, or for ``None``);
        the first call also writes ``packcache_worker_info`` and ``packcache_load_seconds``, after them."""
        if stats is None:
            self._announce()
            return
        self._publish_check()
        key = (
            stats.state, stats.heap_reason, tuple(sorted(stats.heap_bytes_by_reason.items())), stats.mapped_bytes,
            stats.file_bytes, stats.reclaimable_bytes, stats.written_bytes, stats.errno, stats.hits, stats.stored,
            stats.heap_packs, stats.remote_hits, stats.remote_bytes, stats.remote_download_mbps,
            tuple(sorted(stats.remote_misses_by_reason.items())),
        )  # fmt: skip
        if key == self._published:
            return
        state, reason, heap, mapped, file_bytes, reclaimable, written, errno, packs, *remote = self._cache_gauges()
        for name in _STATES:
            state.labels(name).set(1 if name == stats.state else 0)
        for name in (*_REASONS, "none"):
            reason.labels(name).set(1 if name == stats.heap_reason else 0)
        for name in _REASONS:
            heap.labels(name).set(stats.heap_bytes_by_reason.get(name, 0))
        mapped.set(stats.mapped_bytes)
        file_bytes.set(stats.file_bytes)
        reclaimable.set(stats.reclaimable_bytes)
        written.set(stats.written_bytes)
        errno.set(stats.errno)
        packs.labels("hit").set(stats.hits)
        packs.labels("stored").set(stats.stored)
        packs.labels("heap").set(stats.heap_packs)
        remote_hits, remote_bytes, remote_download_mbps, remote_misses = remote
        remote_hits.set(stats.remote_hits)
        remote_bytes.set(stats.remote_bytes)
        remote_download_mbps.set(stats.remote_download_mbps)
        for name in REMOTE_REASONS:
            remote_misses.labels(name).set(stats.remote_misses_by_reason.get(name, 0))
        self._published = key
        self._announce()

    def _publish_check(self) -> None:
        """The background check's figures, when they changed (a running check's every quarter second at most)."""
        if self._file_check is None:
            return
        check = self._file_check()
        if check is self._published_check:
            return
        if self._check_gauges is None:
            self._check_gauges = (
                _gauge("packcache_file_check", "1 for the state of the background check of the cache file", ("state",)),
                _gauge("packcache_file_check_failed_packs", "Packs of the cache file that failed their checksum"),
                _gauge("packcache_file_check_checked_bytes", "Pack bytes the background check has read so far"),
                _gauge("packcache_file_check_finished_timestamp_seconds", "When the check finished, 0 until then"),
            )
        state, failed, checked, finished = self._check_gauges
        for name in _CHECK_STATES:
            state.labels(name).set(1 if name == check.state else 0)
        failed.set(check.failed_packs)
        checked.set(check.checked_bytes)
        finished.set(check.finished)
        self._published_check = check

    def forward(self, requests: int, texts: int, tokens: int) -> None:
        """Count one forward of the model: the requests it answered, their texts and tokens."""
        self.forward_requests.labels(self.pid).observe(requests)
        self.forward_texts.labels(self.pid).observe(texts)
        self.forward_tokens.labels(self.pid).inc(tokens)

    def generated(
        self, *, prompt_tokens: int, completion_tokens: int, first_token_seconds: float | None, rate: float
    ) -> None:
        """Count a causal LM's tokens: a finished request's prompt, new completion tokens, a first token's latency,
        and set the worker's recent generation rate (tokens per second)."""
        if self._generation is None:
            self._generation = (
                Counter("packcache_prompt_tokens", "Prompt tokens of finished generations", ("pid",), registry=None),
                Counter("packcache_completion_tokens", "Tokens generated", ("pid",), registry=None),
                Histogram(
                    "packcache_time_to_first_token_seconds",
                    "Seconds from a generation request's arrival in the application to its first text",
                    ("pid",),
                    registry=None,
                    buckets=_BUCKETS,
                ),
                _gauge("packcache_generation_tokens_per_second", "Tokens this worker generated per second, last 10 s"),
            )
        prompt, completion, first, rate_gauge = self._generation
        if prompt_tokens:
            prompt.labels(self.pid).inc(prompt_tokens)
        if completion_tokens:
            completion.labels(self.pid).inc(completion_tokens)
        if first_token_seconds is not None:
            first.labels(self.pid).observe(first_token_seconds)
        rate_gauge.set(rate)

    def observe(self, route: str, code: int, seconds: float) -> None:
        """Count one request and its latency."""
        self.requests.labels(route, str(code), self.pid).inc()
        self.latency.labels(route, self.pid).observe(seconds)


#: Bytes of a metrics file's header (the used-bytes count): a file shorter holds no sample yet.
_HEADER_BYTES = 8


class _WrittenFiles:
    """``MultiProcessCollector`` over the directory's files that hold data.

    prometheus_client creates a worker's file empty and then truncates it to its size: a scrape in that
    instant read 0 bytes, and ``struct.error`` failed the whole exposition with a 500 (a worker killed
    there would leave it so until the server restarts). Such a file holds no sample, so it is skipped;
    a file removed between the listing and its reading (a worker marked dead) is a new listing.
    Pinned by tests/test_server_metrics.py::test_an_empty_metrics_file_of_a_worker_being_born_does_not_fail_the_scrape.
    """

    def __init__(self, path: str) -> None:
        self._path = path

    def _files(self) -> list[str]:
        files = []
        for name in sorted(glob.glob(os.path.join(self._path, "*.db"))):
            try:
                if os.stat(name).st_size >= _HEADER_BYTES:
                    files.append(name)
            except FileNotFoundError:
                continue
        return files

    def collect(self) -> Iterable[Metric]:
        for _ in range(2):
            try:
                return self._merged()
            except FileNotFoundError:  # a worker marked dead between the listing and the reading: list again
                continue
        return self._merged()

    def _merged(self) -> Iterable[Metric]:
        return multiprocess.MultiProcessCollector.merge(self._files(), accumulate=True)  # type: ignore[no-untyped-call,no-any-return]


def exposition() -> tuple[bytes, str]:
    """Every live worker's metrics (and every worker's request totals): the body and its content type."""
    registry = CollectorRegistry()
    registry.register(_WrittenFiles(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """Drop a worker's live gauges (the master's ``child_exit`` hook)."""
    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
