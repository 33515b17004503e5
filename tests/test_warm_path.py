"""A warm open reads no pack data: checksums are checked at store time and on demand only.

Each measurement runs in a fresh subprocess: the cache file's pages are dropped
from the page cache (``posix_fadvise(DONTNEED)``), the cache is opened and every
pack requested (all hits, arrays not touched), and then

* ``rchar`` from ``/proc/self/io`` says how many bytes ``read``/``pread`` returned,
* ``mincore`` says how many of the packs' pages are resident in the page cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from packcache import WeightCache

PACKS = 16
PACK_BYTES = 4 << 20

MEASURE = textwrap.dedent(
    """
    import ctypes, json, mmap, os, sys
    import numpy as np, packcache

    path, verify = sys.argv[1], sys.argv[2] == "1"
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    r0 = rchar(); r1 = rchar()
    cache = packcache.WeightCache(path, verify=verify)
    with cache.session() as s:
        arrays = [s.get_or_pack(f"w{i}", lambda: sys.exit("hit expected")) for i in range(__PACKS__)]
    r2 = rchar()

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = mmap.PAGESIZE
    resident = 0
    for a in arrays:
        start = a.ctypes.data // page * page
        pages = (a.ctypes.data + a.nbytes - start + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(start, pages * page, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        resident += sum(v & 1 for v in vec) * page
    st = cache.stats()
    print(json.dumps({"read_bytes": (r2 - r1) - (r1 - r0), "resident_bytes": resident, "hits": st.hits,
                      "mapped": st.mapped_bytes, "file": st.file_bytes}))
    cache.close()
    """
).replace("__PACKS__", str(PACKS))


def measure(path: Path, verify: bool) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), "1" if verify else "0"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_warm_open_reads_no_pack_data(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    rng = np.random.default_rng(0)
    with WeightCache(path) as cache, cache.session() as s:
        for i in range(PACKS):
            s.get_or_pack(f"w{i}", lambda: rng.integers(0, 255, PACK_BYTES, dtype=np.uint8))
    total = PACKS * PACK_BYTES

    warm = measure(path, verify=False)
    assert warm["hits"] == PACKS and warm["mapped"] == total
    # Header (4 KiB) and index only; the packs are 64 MiB.
    assert warm["read_bytes"] < 64 * 1024, warm
    # Kernel readahead of the header read may pull in the first data pages, nothing more.
    assert warm["resident_bytes"] < total // 16, warm

    checked = measure(path, verify=True)  # the opt-in check reads every pack: the contrast
    assert checked["hits"] == PACKS
    assert checked["resident_bytes"] == total, checked
