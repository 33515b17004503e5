"""What ``packcache run`` and ``build`` say about a load: the cache's figures against the kernel's (memory,
superseded bytes, the store). The progress bar while it packs is the loader's (``packcache._progress``).
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import os
from collections.abc import Mapping
from typing import Any

from ..errors import PackCacheError
from ..maintenance import InspectReport, inspect
from ._common import mib, sanitize

__all__ = ["LoadReport", "kernel_lines", "remote_line"]


@dataclasses.dataclass
class LoadReport:
    """What ``run`` and ``build`` report about a load: the cache's figures against the kernel's."""

    data: dict[str, Any]
    lines: list[str]
    warning_lines: list[str]

    @classmethod
    def of(
        cls,
        cache: Any,
        path: str | None,
        load_seconds: float,
        before: dict[str, int],
        after: dict[str, int],
        fetched: dict[str, int] | None = None,
    ) -> LoadReport:
        """The report of a load between the smaps readings ``before`` and ``after``; ``fetched``: the reading when
        the cache's remote fetch ended (the load's first miss with ``--remote``), if it fetched: the load's growth
        is counted from there, and the fetch's (its download's buffers, threads and hashing) reported apart."""
        from ..memory import file_mapping_usage

        stats = cache.stats()
        mapping = file_mapping_usage(path) if path and os.path.exists(path) else None
        # pinned by tests/test_defaults_cli.py::test_a_remote_fetch_is_not_counted_as_the_load_s_memory
        start = fetched if fetched is not None else before
        anon_growth = after["Anonymous"] - start["Anonymous"]
        fetch_growth = fetched["Anonymous"] - before["Anonymous"] if fetched is not None else None
        memory: dict[str, Any] = {
            "anonymous_before": before["Anonymous"],
            "anonymous_after_load": after["Anonymous"],
            "anonymous_growth_load": anon_growth,
            "anonymous_growth_fetch": fetch_growth,
            "rss_file_growth_load": (after["Rss"] - after["Anonymous"]) - (start["Rss"] - start["Anonymous"]),
            "cache_mapping_size": mapping.size if mapping else 0,
            "cache_mapping_rss": mapping.rss if mapping else 0,
            "cache_mapping_pss": mapping.pss if mapping else 0,
        }
        warnings = _memory_warnings(stats.heap_bytes, stats.mapped_bytes, anon_growth, memory["cache_mapping_size"])
        superseded = _superseded(path)
        if superseded is not None and superseded.reclaimable_bytes >= superseded.live_bytes > 0:
            warnings.append(
                f"the cache file holds {mib(superseded.reclaimable_bytes)} of superseded packs, as much as its "
                f"{mib(superseded.live_bytes)} of live ones or more: these names were packed again with other keys "
                f"(another checkpoint or recipe on this file); "
                f"'packcache compact {sanitize(path or '')}' reclaims them"
            )
        data = {
            "stats": dataclasses.asdict(stats),
            "cache_file": path,
            "load_seconds": load_seconds,
            "memory": memory,
            "file_reclaimable_bytes": superseded.reclaimable_bytes if superseded is not None else None,
            "warnings": warnings,
        }
        reasons = ", ".join(
            f"{r} {mib(b)}" for r, b in sorted(stats.heap_bytes_by_reason.items(), key=lambda kv: -kv[1]) if b
        )
        errno_text = f" [{errno_mod.errorcode.get(stats.errno, stats.errno)}] {stats.error}" if stats.errno else ""
        reclaimable = superseded.reclaimable_bytes if superseded else 0
        lines = [
            f"cache file    {sanitize(path) if path else '(caching off)'}",
            f"state         {stats.state}   (hits {stats.hits}, stored {stats.stored}, heap packs {stats.heap_packs})",
            f"load          {load_seconds * 1000:.1f} ms",
            f"packed        mapped {mib(stats.mapped_bytes)}   heap {mib(stats.heap_bytes)}",
            f"heap reasons  {reasons or 'none'}{sanitize(errno_text)}",
            f"file          {mib(stats.file_bytes)}" + (f", {mib(reclaimable)} superseded" if reclaimable else ""),
            f"memory        anonymous {_signed(anon_growth)} during the load (reported heap {mib(stats.heap_bytes)})"
            + (f", {_signed(fetch_growth)} during the fetch before it" if fetch_growth is not None else ""),
            f"              cache file mapped {mib(memory['cache_mapping_size'])} (reported mapped "
            f"{mib(stats.mapped_bytes)}), resident now {mib(memory['cache_mapping_rss'])}",
        ]
        return cls(data, lines, [f"WARNING       {w}" for w in warnings])


def _signed(n: int) -> str:
    """A growth as the reports show it: ``+12.3 MiB``, ``-0.4 MiB`` (a trimmed heap can shrink)."""
    return ("-" if n < 0 else "+") + mib(abs(n))


def _superseded(path: str | None) -> InspectReport | None:
    """The cache file's :func:`~packcache.inspect` report (live and reclaimable bytes), or None.

    Packs named alike with other keys (another checkpoint or another recipe on one explicitly
    given file) supersede each other's bytes; a build compacts the file once they outweigh the
    live ones, but a read-only launch cannot. ``run`` and ``build`` say so. Any problem reading
    the file only drops the figure.
    """
    if path is None:
        return None
    try:
        return inspect(path)
    except (PackCacheError, OSError):
        return None


#: The part of the packed bytes by which the kernel's anonymous growth and the reported heap may differ before a
#: load's report warns ...
MEMORY_WARNING_SHARE = 0.05
#: ... and the bytes below which it never does: what a process spends once, on its first load, whatever the model
#: (measured on this project's loads: ~2 MiB of allocator slack on every cold load, ~20 MiB of thread pools and their
#: malloc arenas on the first int4 calibration, 7 MiB for a model class imported inside the load), which against 5 %
#: of a small model (0.13 MiB of a 2.5 MiB one) made every cold build of one warn. A heap copy of a model's weights
#: is still seen from a model of 640 MiB by the share, and of any model this size or larger by the floor.
MEMORY_WARNING_FLOOR = 32 << 20


def _memory_warnings(heap: int, mapped: int, anon_growth: int, mapping_size: int) -> list[str]:
    """Compare reported figures with the kernel's; apart by more than :data:`MEMORY_WARNING_SHARE` of the packed
    bytes *and* more than :data:`MEMORY_WARNING_FLOOR` is worth a warning.

    * Anonymous memory that grew during the load and is not explained by heap
      packs (or heap packs that did not grow it). ``anon_growth`` is the
      load's: a remote fetch's growth (its download and hashing) is not the load's, and is not compared.
    * Reported mapped bytes that the process does not actually map from the cache
      file. (Resident pages are reported but not compared: a mapped page is read
      in only when touched, so a table the inputs barely used is partly resident.)
    """
    warnings = []
    packed = heap + mapped
    apart = anon_growth - heap
    # pinned by tests/test_cli_report.py::test_a_cold_build_of_a_tiny_model_does_not_warn_and_a_real_leak_does
    if packed and abs(apart) > max(MEMORY_WARNING_SHARE * packed, MEMORY_WARNING_FLOOR):
        moved = "grew" if anon_growth >= 0 else "shrank"
        warnings.append(
            f"anonymous memory {moved} {mib(abs(anon_growth))} during the load, reported heap is {mib(heap)}: "
            f"{mib(abs(apart))} apart, more than {MEMORY_WARNING_SHARE:.0%} of the {mib(packed)} packed and more "
            f"than {mib(MEMORY_WARNING_FLOOR)}"
        )
    if mapped and mapping_size < 0.95 * mapped:
        warnings.append(f"the process maps {mib(mapping_size)} of the cache file, reported mapped is {mib(mapped)}")
    return warnings


def kernel_lines(kernels: Mapping[str, str]) -> list[str]:
    """One line per kind of linear layer: the ops it runs (``ConversionReport.kernels``)."""
    width = max((len(kind) for kind in kernels), default=0)
    return [f"  {sanitize(kind):<{width}}  {ops}" for kind, ops in kernels.items()]


def remote_line(stats: Any, remote: str | None) -> list[str]:
    """The text report's line about the store, when ``--remote`` was given."""
    if remote is None:
        return []
    if stats.remote_hits:
        return [f"remote        fetched from {sanitize(remote)} ({mib(stats.remote_bytes)} read)"]
    misses = ", ".join(f"{r} {n}" for r, n in stats.remote_misses_by_reason.items() if n)
    if misses:
        return [f"remote        miss: {misses}: {sanitize(stats.remote_error)}; packed locally"]
    return [f"remote        not asked: the local file held every pack ({sanitize(remote)})"]
