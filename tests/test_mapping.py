"""Mappings of a cache file (``packcache._mapping``): a few reused windows, no descriptor kept per pack,
the file mapped once at its size. Measured in a child process under ``ulimit -n 64``.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness import run_child

# --------------------------------------------------------------------------- descriptors and mappings


MANY_PACKS = """
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from packcache.memory import file_mapping_usage
path = sys.argv[1]

def maps_of(p):
    real = os.path.realpath(p)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip("\\n").endswith(real))

cache = packcache.WeightCache(path)
with cache.session() as s:
    views = [s.get_or_pack(f"w{i}", lambda i=i: packed(i, 8 * 1024), {"v": 1}) for i in range(1100)]
    during = maps_of(path)
cold = stats_dict(cache)
cold_maps, cold_usage = maps_of(path), file_mapping_usage(path)
fds = len(os.listdir("/proc/self/fd"))
same = all(v.tobytes() == packed(i, 8 * 1024).tobytes() for i, v in enumerate(views))
del views
cache.close()
cache = packcache.WeightCache(path)
with cache.session() as s:
    warm_views = [s.get_or_pack(f"w{i}", lambda: None, {"v": 1}) for i in range(1100)]
warm = stats_dict(cache)
report(cold=cold, warm=warm, during=during, cold_maps=cold_maps, cold_size=cold_usage.size, fds=fds, same=same,
       warm_maps=maps_of(path), file_size=os.stat(path).st_size)
"""


def test_a_cold_build_of_1100_packs_needs_no_descriptor_per_pack_and_maps_the_file_once(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    out = run_child(MANY_PACKS, str(path), timeout=120)
    cold, warm = out["cold"], out["warm"]
    assert (cold["stored"], cold["heap_bytes"], cold["errno"], cold["state"]) == (1100, 0, 0, "stored"), cold
    assert out["same"]
    assert (warm["hits"], warm["heap_bytes"], warm["state"]) == (1100, 0, "mapped"), warm
    assert out["fds"] < 20  # ulimit -n 64: a descriptor per pack would have run out at ~60
    assert out["during"] <= 16 and out["cold_maps"] <= 16 and out["warm_maps"] <= 2
    page = os.sysconf("SC_PAGE_SIZE")
    # Mapped once, at the file's size: not once per pack plus once whole (the "112 MiB for 56 MiB").
    assert out["cold_size"] <= out["file_size"] + out["cold_maps"] * page
