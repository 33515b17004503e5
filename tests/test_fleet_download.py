"""A fetch's download: concurrent range reads written in place, hashed once, verified once.

Real stores: the directory store, moto's S3 server, and small HTTP servers on 127.0.0.1 that serve a
directory store's files over plain HTTP (an ``http://`` store through obstore) and misbehave on purpose:
a range sent short or from another offset, a part that stalls, a server process killed mid-part. Real
processes for the verify-once test: 4 fetches of one file at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import require_root
from harness.httpstore import faulty_store
from harness.keys import make_keys
from harness.s3server import S3Server
from packcache import _defaults
from packcache.errors import RemoteError
from packcache.fleet.fetch import FetchReport, fetch
from packcache.fleet.publish import publish
from packcache.format import canonical_key

SRC = Path(__file__).resolve().parents[1] / "src"
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}
RECIPE = {"packer": "test.f32", "version": 1}
PART = 100_003  # a part size no blob size here is a multiple of


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci")


def build(path: Path, count: int = 6, side: int = 256) -> None:
    """A cache file of ``count`` packs of ``side`` x ``side`` float32 (256 KiB each): several parts of PART."""
    rng = np.random.default_rng(7)
    with packcache.WeightCache(path, platform=PLATFORM) as cache, cache.session() as s:
        for i in range(count):
            array = rng.standard_normal((side, side)).astype(np.float32)
            s.get_or_pack(f"layer{i}", lambda a=array: a, RECIPE)


def published(tmp_path: Path, keys: dict[str, Path], url: str | None = None, **options: Any) -> tuple[str, Path]:
    built = tmp_path / "a" / "model-x.pcache"
    build(built, **options)
    if url is None:
        (tmp_path / "store").mkdir()
        url = str(tmp_path / "store")
    publish(built, url, private_key=str(keys["ci"]))
    return url, built


def do_fetch(url: str, local: Path, keys: dict[str, Path], **bounds: Any) -> FetchReport:
    return fetch(url, local, platform=canonical_key(PLATFORM), trusted_keys=[keys["ci.pub"].read_bytes()], **bounds)


def fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("packcache-fetch-")]


def leftovers(local: Path) -> list[str]:
    """What a failed fetch left beside the file: nothing but the lock and the rollback record."""
    return sorted(p.name for p in local.parent.iterdir() if not p.name.endswith((".lock", ".json")))


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_defaults, "FETCH_PART_BYTES", PART)
    monkeypatch.setattr(_defaults, "FETCH_STREAMS", 4)


# --------------------------------------------------------------------------- parts in place


@pytest.mark.usefixtures("small_parts")
@pytest.mark.parametrize("where", ["directory", "moto"])
def test_parts_land_at_their_offsets_in_a_blob_of_several_uneven_parts(
    tmp_path: Path, keys: dict[str, Path], where: str, request: pytest.FixtureRequest
) -> None:
    url = None
    if where == "moto":
        moto: S3Server = request.getfixturevalue("moto_env")
        url = f"{moto.url}/{uuid.uuid4().hex}"
    store, built = published(tmp_path, keys, url)
    size = built.stat().st_size
    assert size > 8 * PART and size % PART, size
    local = tmp_path / "b" / "model-x.pcache"
    report = do_fetch(store, local, keys)
    assert report.downloaded and local.read_bytes() == built.read_bytes()
    assert report.download_seconds > 0 and report.download_mbps > 0
    assert report.to_json()["download_mbps"] == report.download_mbps
    assert fetch_threads() == [] and leftovers(local) == ["model-x.pcache"]


# --------------------------------------------------------------------------- stores that lie, stall or die


@pytest.mark.usefixtures("small_parts")
@pytest.mark.parametrize("mode", ["short", "other-range", "shifted"])
def test_a_store_that_sends_a_short_or_wrong_range_is_remote_corrupt(
    tmp_path: Path, keys: dict[str, Path], mode: str
) -> None:
    store, _ = published(tmp_path, keys)
    local = tmp_path / "b" / "model-x.pcache"
    with faulty_store(Path(store), mode) as (url, _), pytest.raises(RemoteError) as caught:
        do_fetch(url, local, keys, timeout=10)
    assert caught.value.reason == "remote_corrupt", caught.value
    assert not local.exists() and leftovers(local) == [] and fetch_threads() == []


@pytest.mark.usefixtures("small_parts")
def test_a_stalled_range_is_remote_timeout_within_the_stall_bound_and_no_thread_outlives_it(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    """A part that stops half way, with a far overall deadline: the stall bound (2 s) ends the fetch."""
    store, _ = published(tmp_path, keys)
    local = tmp_path / "b" / "model-x.pcache"
    with faulty_store(Path(store), "stall") as (url, _):
        began = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            do_fetch(url, local, keys, timeout=2, total_timeout=120)
        elapsed = time.monotonic() - began
        # pinned by tests/test_fleet_download.py::test_no_thread_outlives_a_failed_fetch (the join in _download)
        assert fetch_threads() == [], "a worker of the failed fetch is still running"
    assert caught.value.reason == "remote_timeout", caught.value
    assert elapsed < 2 + 1 + 5, elapsed  # the stall bound, its grace, a loaded machine's slack
    assert not local.exists() and leftovers(local) == []


_KILLABLE_SERVER = textwrap.dedent(
    """
    import sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path
    root = Path(sys.argv[1])
    said = threading.Lock()  # parts are sent by concurrent threads: one whole line each
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass
        def do_GET(self):
            path = root / self.path.lstrip("/").split("?")[0]
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            first, _, last = self.headers.get("Range", "bytes=0-").removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(end - start))
            self.send_header("ETag", '"x"')
            self.end_headers()
            body = data[start:end]
            if path.name.endswith(".pcache") and end - start > 4096:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                with said:
                    print("sending", flush=True)
                threading.Event().wait()
            self.wfile.write(body)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    """
)


@pytest.mark.usefixtures("small_parts")
def test_no_thread_outlives_a_failed_fetch(tmp_path: Path, keys: dict[str, Path]) -> None:
    """The store's server process is SIGKILLed while parts are half sent: the fetch is an error (never a short
    file), leaves no temp file, and none of its threads runs on."""
    store, _ = published(tmp_path, keys)
    local = tmp_path / "b" / "model-x.pcache"
    server = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE_SERVER, store], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["report"] = do_fetch(f"http://127.0.0.1:{port}", local, keys, timeout=30, total_timeout=60)
            except RemoteError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        assert server.stdout.readline().strip() == "sending", "the fetch never asked for a part"
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        thread.join(60)
        assert not thread.is_alive()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        server.stdout.close()
    assert "report" not in outcome, outcome
    assert outcome["error"].reason in ("remote_error", "remote_corrupt"), outcome["error"]
    assert not local.exists() and leftovers(local) == [] and fetch_threads() == []


# --------------------------------------------------------------------------- verified once


_FETCHER = textwrap.dedent(
    """
    import json, logging, sys, time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from packcache.fleet.fetch import fetch
    from packcache.format import canonical_key
    store, local, key, platform, start = sys.argv[1:6]
    while time.time() < float(start):
        time.sleep(0.001)
    report = fetch(store, local, platform=canonical_key(json.loads(platform)),
                   trusted_keys=[open(key, "rb").read()], timeout=30, lock_timeout=60)
    print(json.dumps(report.to_json()))
    """
)


def _fetchers(store: str, local: Path, keys: dict[str, Path], count: int) -> list[tuple[dict[str, Any], str]]:
    """``count`` fetch processes started together; each one's report and log."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    start = str(time.time() + 3)  # after every interpreter started
    argv = [sys.executable, "-c", _FETCHER, store, str(local), str(keys["ci.pub"]), json.dumps(PLATFORM), start]
    children = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(count)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
        results.append((json.loads(out.strip().splitlines()[-1]), err))
    return results


def test_processes_that_waited_for_a_fetch_map_it_without_hashing_it_again(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    """4 processes fetch one file at once: one downloads (and hashes as it downloads); the 3 that waited for its
    lock find the record it wrote (the blob and the landed file's identity) and hash nothing. A file changed
    after that (its ctime moves) is hashed again."""
    store, built = published(tmp_path, keys, count=16)  # 4 MiB
    local = tmp_path / "b" / "model-x.pcache"
    results = _fetchers(store, local, keys, 4)
    downloaded = [report for report, _ in results if report["downloaded"]]
    assert len(downloaded) == 1, [report for report, _ in results]
    waiters = [log for report, log in results if not report["downloaded"]]
    for log in waiters:
        assert "accepted by the fetch that landed it; not hashed again" in log, log
        assert "hashing" not in log, log
    assert local.read_bytes() == built.read_bytes()
    # The same bytes, another ctime (a write would move it too): no record names this stat, so it is hashed.
    os.utime(local)
    ((report, log),) = _fetchers(store, local, keys, 1)
    assert not report["downloaded"] and "hashing" in log and "not hashed again" not in log, log
    # ...and recorded: the next process trusts what that hash found.
    ((report, log),) = _fetchers(store, local, keys, 1)
    assert not report["downloaded"] and "not hashed again" in log and "hashing" not in log, log


def test_a_record_another_user_could_have_written_is_ignored_and_the_file_hashed(
    tmp_path: Path, keys: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The record names the file's exact stat and the published sha256, but another user owns it, or others may
    write it: it is no proof, so the waiter hashes the file."""
    require_root()
    store, _ = published(tmp_path, keys)
    local = tmp_path / "b" / "model-x.pcache"
    assert do_fetch(store, local, keys).downloaded
    (record,) = local.parent.glob(".model-x.pcache.accepted-*.json")  # names the blob and this very file
    exact = record.read_text()
    caplog.set_level(logging.INFO, logger="packcache")
    for owner, mode, trusted in ((0, 0o600, True), (65534, 0o600, False), (0, 0o666, False)):
        record.write_text(exact)
        os.chown(record, owner, owner)
        os.chmod(record, mode)
        caplog.clear()
        assert not do_fetch(store, local, keys).downloaded
        hashed = "hashing" in caplog.text and "not hashed again" not in caplog.text
        assert hashed != trusted, (owner, oct(mode), caplog.text)
