"""Core benchmarks: warm load against the bare-mmap limit, cold build against heap-only, telemetry reads.

Method (printed first when run):

* warm load — a complete cache of N packs is opened and every pack requested in
  one session (hits only), versus the limit: ``open`` + ``mmap`` + one
  ``numpy.frombuffer`` view per pack at the same offsets, with no validation or
  bookkeeping. Both run in this process, interleaved, page cache warm.
* warm open, checked — the same warm open with ``verify=True`` (every pack's
  checksum computed on open, which reads every data page), versus the default.
* cold build — a fresh cache file built from N in-memory packs (``pack()`` is a
  copy, so the figure is the cache's own overhead: write, checksum, map, commit
  with two fdatasyncs), versus the same session with caching off.
* telemetry — ``stats()`` and ``get_option()`` latency while another thread holds
  a session that is inside a slow ``pack()``, versus with no session.

Each figure is the median of repeated runs with its interquartile range, and
ratios are of medians measured in the same run. Absolute times drift on shared
machines; the ratios are what to compare.

Usage: python benchmarks/core.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import packcache
from packcache import format as fmt

#: What torch, oneDNN and packcache's compiled kernels run on a CPU without AVX512, forced on this one (the
#: ``--isa avx2`` of ``decode.py`` and ``decode_kernels.py``): same memory system, AVX2 code.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PACKCACHE_NATIVE": "avx2"}


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], statistics.median(samples), q[2]


def cpu_model() -> str:
    """The CPU's model name (``lscpu``), else what ``platform`` knows."""
    import contextlib
    import subprocess

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return model


def drop_pages(paths: list[str]) -> None:
    """Drop ``paths`` from the page cache: ``fsync`` (nothing dirty may stay), then ``POSIX_FADV_DONTNEED``
    (other files keep their pages; pages another process maps stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds() -> tuple[float, float]:
    """(every CPU's busy seconds, this process's): their difference over an interval is what others ran."""
    import resource

    with open("/proc/stat") as stat:
        fields = [int(n) for n in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def peak_rss_kib() -> int:
    """This process's peak resident set, KiB: ``VmHWM`` of ``/proc/self/status``, the high-water mark of its own
    address space. Not ``getrusage``'s ``ru_maxrss``: Linux carries that over ``execve``, so a child started by
    a large parent reports the parent's peak (a decode child of an 80 MiB process read 941 MiB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM line")


def compared(
    workload: str, ours: tuple[str, list[float]], baseline: tuple[str, list[float]], ratio: str
) -> dict[str, Any]:
    """A workload's figures: quartiles of both sides (named ``ours[0]``, ``baseline[0]``) and the ratio of medians."""
    (ours_name, ours_times), (base_name, base_times) = ours, baseline
    o, b = quartiles(ours_times), quartiles(base_times)
    return {"workload": workload, ours_name: o, base_name: b, ratio: o[1] / b[1]}


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def make_packs(count: int, total_bytes: int) -> dict[str, np.ndarray[Any, Any]]:
    per = max(64, total_bytes // count // 4 * 4)
    rng = np.random.default_rng(0)
    return {f"layers.{i}.weight": rng.integers(-128, 127, per, dtype=np.int8) for i in range(count)}


def build(path: str, packs: dict[str, np.ndarray[Any, Any]]) -> None:
    with packcache.WeightCache(path) as cache, cache.session() as s:
        for name, a in packs.items():
            s.get_or_pack(name, lambda a=a: a.copy(), key={"packer": "copy", "version": 1})


def warm_packcache(path: str, names: list[str]) -> None:
    cache = packcache.WeightCache(path)
    with cache.session() as s:
        for name in names:
            s.get_or_pack(name, _never, key={"packer": "copy", "version": 1})
    assert cache.stats().hits == len(names)
    cache.close()


def _never() -> np.ndarray[Any, Any]:
    raise AssertionError("warm load must not pack")


def committed_layout(path: str) -> list[tuple[int, int]]:
    """(offset, nbytes) of each entry, read once outside the timed region."""
    with open(path, "rb") as f:
        head = f.read(fmt.HEADER_READ_SIZE)
        header = fmt.decode_header(head)
        slot = fmt.choose_slot(head)[0][0]
        f.seek(slot.index_offset)
        entries = fmt.decode_index(f.read(slot.index_size), slot, header)
    return [(e.offset, e.nbytes) for e in entries.values()]


def warm_limit(path: str, layout: list[tuple[int, int]]) -> None:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    views = [np.frombuffer(mm, dtype=np.int8, count=n, offset=o) for o, n in layout]
    assert len(views) == len(layout)


def bench_warm(directory: str, count: int, total: int, repeat: int) -> dict[str, Any]:
    packs = make_packs(count, total)
    path = os.path.join(directory, f"warm-{count}.pcache")
    build(path, packs)
    names = list(packs)
    layout = committed_layout(path)
    ours, limit = [], []
    for _ in range(repeat):  # interleaved, so drift hits both alike
        ours += timed(lambda: warm_packcache(path, names), 1)
        limit += timed(lambda: warm_limit(path, layout), 1)
    result = compared(
        f"warm load, {count} packs, {total >> 20} MiB", ("packcache_s", ours), ("limit_s", limit), "ratio_to_limit"
    )
    return {**result, "per_pack_us": result["packcache_s"][1] / count * 1e6}


def bench_warm_checked(directory: str, repeat: int) -> dict[str, Any]:
    """Warm open as shipped (structure validated, trust checked, no pack data read)
    versus the same open verifying every pack's checksum (``verify=True``)."""
    packs = make_packs(16, 64 << 20)
    path = os.path.join(directory, "warm-checked.pcache")
    build(path, packs)
    names = list(packs)

    def open_all(verify: bool) -> None:
        with packcache.WeightCache(path, verify=verify) as cache, cache.session() as s:
            for name in names:
                s.get_or_pack(name, _never, key={"packer": "copy", "version": 1})

    default, checked = [], []
    for _ in range(repeat):
        default += timed(lambda: open_all(False), 1)
        checked += timed(lambda: open_all(True), 1)
    return compared(
        "warm open, 16 packs, 64 MiB: default vs verify=True",
        ("verify_on_open_s", checked),
        ("default_s", default),
        "ratio_verify_to_default",
    )


def bench_cold(directory: str, count: int, total: int, repeat: int) -> dict[str, Any]:
    packs = make_packs(count, total)
    cached, heap = [], []
    for i in range(repeat):
        path = os.path.join(directory, f"cold-{count}-{i}.pcache")
        cached += timed(lambda path=path: build(path, packs), 1)
        heap += timed(lambda: build_off(packs), 1)
        os.unlink(path)
    return compared(
        f"cold build, {count} packs, {total >> 20} MiB",
        ("packcache_s", cached),
        ("heap_only_s", heap),
        "ratio_to_heap_only",
    )


def build_off(packs: dict[str, np.ndarray[Any, Any]]) -> None:
    with packcache.WeightCache(None) as cache, cache.session() as s:
        for name, a in packs.items():
            s.get_or_pack(name, lambda a=a: a.copy())


def bench_telemetry(directory: str, reads: int) -> dict[str, Any]:
    cache = packcache.WeightCache(os.path.join(directory, "telemetry.pcache"))

    def read_all() -> list[float]:
        out = []
        for i in range(reads):
            started = time.perf_counter()
            cache.stats() if i % 2 else cache.get_option("packed_cache_heap_mib")
            out.append(time.perf_counter() - started)
        return out

    idle = read_all()
    inside, done = threading.Event(), threading.Event()

    def slow() -> np.ndarray[Any, Any]:
        inside.set()
        done.wait(30)
        return np.ones(16)

    def loader() -> None:
        with cache.session() as s:
            s.get_or_pack("slow", slow)

    t = threading.Thread(target=loader)
    t.start()
    inside.wait(30)
    busy = read_all()
    done.set()
    t.join()
    cache.close()

    def summary(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median_us": xs[len(xs) // 2] * 1e6, "p99_us": xs[int(len(xs) * 0.99)] * 1e6, "max_us": xs[-1] * 1e6}

    return {"workload": f"telemetry, {reads} reads", "no_session": summary(idle), "session_held": summary(busy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and smaller models")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    repeat = 5 if args.quick else 15
    print(__doc__.split("Usage:")[0].strip())
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}, packcache {packcache.__version__}\n"
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="packcache-bench-") as d:
        for count, total in ((100, 256 << 20), (10_000, 64 << 20)):
            if args.quick and count > 1000:
                count = 2000
            results.append(bench_warm(d, count, total, repeat))
        results.append(bench_warm_checked(d, repeat))
        for count, total in ((100, 256 << 20),):
            results.append(bench_cold(d, count, total, max(3, repeat // 3)))
        results.append(bench_telemetry(d, 10_000))
    for r in results:
        print(r["workload"])
        for k, v in r.items():
            if k == "workload":
                continue
            if isinstance(v, tuple):
                print(f"  {k:<20} median {v[1] * 1e3:9.3f} ms   IQR [{v[0] * 1e3:.3f}, {v[2] * 1e3:.3f}]")
            elif isinstance(v, dict):
                print(f"  {k:<20} " + "  ".join(f"{kk} {vv:.1f}" for kk, vv in v.items()))
            else:
                print(f"  {k:<20} {v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
