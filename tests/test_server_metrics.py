"""The per-worker Prometheus figures of ``packcache serve`` (``packcache.server.metrics``) when the cache
cannot be used: a full disk (a real 1 MiB tmpfs) and a read-only cache directory (a real read-only bind
mount) still start and serve, and the scrape says why. Real servers on 127.0.0.1 (``harness.serve``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import read_only_bind, require_root, tmpfs
from harness.serve import SRC, TEXTS, assert_embeddings, call, embed, embed_from_every_worker, loaded_workers, server


@pytest.mark.root
def test_a_full_disk_still_starts_and_serves_and_the_scrape_says_degraded_no_space_enospc(
    tmp_path: Path, reference: np.ndarray[Any, Any]
) -> None:
    require_root()
    # 20 MiB for a ~56 MiB model: the disk fills up during the build.
    with tmpfs(tmp_path / "small", "20m") as small:
        with server(tmp_path, "--cache-dir", str(small / "cache"), workers=2) as srv:
            s = loaded_workers(srv, 2)
            for w in s.workers.values():
                assert w.current_state == "degraded", w
                assert w.current_reason == "no_space" and w.values["errno"] == errno.ENOSPC
                assert w.heap_bytes["no_space"] > 0 and w.values["mapped_bytes"] > 0
                assert sum(w.heap_bytes.values()) == w.heap_bytes["no_space"]
            assert call(srv, "GET", "/healthz")[0] == 200
            for answers in embed_from_every_worker(srv, set(s.workers), TEXTS).values():
                for a in answers:
                    assert_embeddings(a, reference)


@pytest.mark.root
def test_a_read_only_cache_directory_still_starts_and_serves_and_the_scrape_says_why(
    tmp_path: Path, reference: np.ndarray[Any, Any]
) -> None:
    require_root()
    # A cache directory shipped read-only with a partial file (built on a disk that filled up),
    # and one shipped empty.
    partial = tmp_path / "shipped"
    partial.mkdir(mode=0o700)
    with tmpfs(tmp_path / "small", "20m") as small:
        env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(
            [sys.executable, "-m", "packcache", "run", "--cache-dir", str(small), "--scheme", "int8", "--json"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["stats"]["state"] == "degraded"
        made = Path(json.loads(done.stdout)["cache_file"])
        shutil.copy2(made, partial / made.name)
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with read_only_bind(partial, tmp_path / "ro") as ro, read_only_bind(empty, tmp_path / "ro-empty") as ro_empty:
        with server(tmp_path, "--cache-dir", str(ro), workers=2, name="partial") as srv:
            s = loaded_workers(srv, 2)
            for w in s.workers.values():
                assert w.current_state == "degraded" and w.current_reason == "read_only", w
                assert w.values["errno"] == errno.EROFS and w.values["mapped_bytes"] > 0
                assert w.heap_bytes["read_only"] > 0 and sum(w.heap_bytes.values()) == w.heap_bytes["read_only"]
            for answers in embed_from_every_worker(srv, set(s.workers), TEXTS).values():
                for a in answers:
                    assert_embeddings(a, reference)
        with server(tmp_path, "--cache-dir", str(ro_empty), workers=1, name="empty") as srv:
            (w,) = loaded_workers(srv, 1).workers.values()
            # Nothing can be mapped: the state is `heap` (docs/ACCOUNTING.md), the reason and errno say why.
            # The file cannot be created: `open_failed` (docs/ROUTING.md row 5), the errno says why.
            assert w.current_state == "heap" and w.current_reason == "open_failed", w
            assert w.values["errno"] == errno.EROFS and w.values["mapped_bytes"] == 0
            assert w.heap_bytes["open_failed"] > 0 and sum(w.heap_bytes.values()) == w.heap_bytes["open_failed"]
            assert_embeddings(embed(srv, TEXTS)[1], reference)


# ---------------------------------------------------------------------------------------- a metrics file being born

_SCRAPE_WITH_AN_EMPTY_FILE = """
import os, sys
from packcache.server import metrics
from packcache.stats import CacheStats
worker = metrics.WorkerMetrics("packcache", "int8", "bf16", "m.pcache", 0.5)
worker.publish(CacheStats(state="mapped", mapped_bytes=123))
# A worker between prometheus_client's open(..., "a+b") and its truncate to 64 KiB, or one killed there:
# an empty file in the directory, with another pid's name.
open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "gauge_liveall_999999.db"), "wb").close()
body, kind = metrics.exposition()
sys.stdout.write(body.decode())
"""


def test_an_empty_metrics_file_of_a_worker_being_born_does_not_fail_the_scrape(tmp_path: Path) -> None:
    """/metrics answered 500 while workers started under load (seen in the default suite): the
    collector read a worker's file in the instant between its creation and its truncation to size, and
    ``struct.error`` on 0 bytes failed the whole exposition. A worker killed in that instant would leave
    it so until the server restarts. The scrape skips a file that holds nothing yet."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", _SCRAPE_WITH_AN_EMPTY_FILE], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'packcache_mapped_bytes{pid="' in done.stdout and "} 123.0" in done.stdout, done.stdout[-3000:]
