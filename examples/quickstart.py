"""The core in thirty lines: pack once, map afterwards, and see where every byte lives.

Run it twice: the first run packs and stores (state ``stored``), the second maps
(state ``mapped``, no packing at all). ``--dir`` picks the cache directory.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

import packcache


def quantize_int8(weight: np.ndarray) -> np.ndarray:
    """A toy packer: per-row symmetric int8 of a transposed weight."""
    w = np.ascontiguousarray(weight.T)
    scale = np.abs(w).max(axis=1, keepdims=True) / 127.0
    return np.round(w / np.where(scale == 0, 1, scale)).astype(np.int8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "packcache-quickstart"))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = {f"layers.{i}.weight": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(24)}

    cache = packcache.WeightCache(os.path.join(args.dir, "toy-model.pcache"), platform={"packer": "toy-int8/1"})
    started = time.perf_counter()
    with cache.session() as session:
        packed = {
            name: session.get_or_pack(name, lambda w=w: quantize_int8(w), key={"packer": "toy-int8", "version": 1})
            for name, w in weights.items()
        }
    elapsed = time.perf_counter() - started
    s = cache.stats()
    print(f"cache file : {s.path}")
    print(f"state      : {s.state}   (hits {s.hits}, stored {s.stored}, heap packs {s.heap_packs})")
    print(f"load time  : {elapsed * 1000:.1f} ms")
    print(f"mapped     : {s.mapped_bytes / 2**20:.1f} MiB   heap: {s.heap_bytes / 2**20:.1f} MiB ({s.heap_reason})")
    print(f"file       : {s.file_bytes / 2**20:.1f} MiB   written now: {s.written_bytes / 2**20:.1f} MiB")
    print(f"options    : packed_cache_state={cache.get_option('packed_cache_state')!r} "
          f"packed_cache_heap_mib={cache.get_option('packed_cache_heap_mib')}")
    checksum = sum(int(p[0, :8].astype(np.int64).sum()) for p in packed.values())
    print(f"checksum   : {checksum}  (identical on every run)")
    cache.close()


if __name__ == "__main__":
    main()
