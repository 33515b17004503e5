"""Publishing, fetching and read-through: real files, real stores, real processes.

Most tests use the directory store (the stdlib one, as on NFS) and core caches with a chosen
platform mapping, so they run in milliseconds; the end-to-end ones build real models with the
command line, and one runs against moto's S3 server. Each remote miss reason is produced for
real: an empty store, an unsigned or foreign-signed manifest, a tampered or truncated blob,
another platform, an expired or rolled-back manifest, a full tmpfs, a read-only directory, a
store that accepts connections and never answers, a refused port.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import read_only_bind, require_root, tmpfs
from harness.checkpoints import tiny_bert
from harness.keys import make_keys
from harness.tcp import silent_server
from packcache.fleet import fetch as fleet_fetch
from packcache.fleet.platform import platform_class
from packcache.fleet.publish import publish
from packcache.format import canonical_key
from packcache.stats import REMOTE_REASONS

SRC = Path(__file__).resolve().parents[1] / "src"
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}
OTHER_PLATFORM = {"packers": [{"id": "test.f32", "version": 2}], "cpu": "test"}


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a new machine user: its own accepted-generation records."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci", "other")


def build(path: Path, seed: int = 0, platform: dict[str, Any] = PLATFORM, count: int = 4) -> dict[str, np.ndarray]:
    """A core cache file of ``count`` packs under ``platform``; returns what it holds."""
    rng = np.random.default_rng(seed)
    arrays = {f"layer{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(count)}
    with packcache.WeightCache(path, platform=platform) as cache, cache.session() as s:
        for name, array in arrays.items():
            s.get_or_pack(name, lambda a=array: a, {"packer": "test.f32", "version": 1})
    return arrays


def load(path: Path, arrays: dict[str, np.ndarray], **remote: Any) -> packcache.CacheStats:
    """Load ``arrays`` through a cache at ``path`` (with ``remote=`` arguments); every byte checked."""
    with packcache.WeightCache(path, platform=PLATFORM, **remote) as cache:
        with cache.session() as s:
            for name, array in arrays.items():
                got = s.get_or_pack(name, lambda a=array: a, {"packer": "test.f32", "version": 1})
                assert np.array_equal(got, array)
        return cache.stats()


def misses(stats: packcache.CacheStats) -> dict[str, int]:
    assert set(stats.remote_misses_by_reason) == set(REMOTE_REASONS)  # every reason always present
    return {r: n for r, n in stats.remote_misses_by_reason.items() if n}


# --------------------------------------------------------------------------- the happy path


def test_a_published_file_is_fetched_on_a_local_miss_and_every_pack_is_then_mapped(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    store = tmp_path / "store"
    store.mkdir()
    report = publish(built, str(store), private_key=str(keys["ci"]))
    assert (report.generation, report.uploaded, report.size) == (1, True, built.stat().st_size)
    assert (store / report.blob_key).read_bytes() == built.read_bytes()
    local = tmp_path / "b" / "model-x.pcache"
    stats = load(local, arrays, remote=str(store), trusted_keys=[keys["ci.pub"]])
    assert (stats.remote_hits, stats.stored, stats.hits, stats.state) == (1, 0, len(arrays), "mapped"), stats
    assert stats.remote_bytes >= report.size and misses(stats) == {}
    assert local.read_bytes() == built.read_bytes()
    # A clean local hit never asks the store: a URL nothing answers changes nothing.
    again = load(local, arrays, remote="s3://nowhere/x", remote_timeout=0.5, trusted_keys=[keys["ci.pub"]])
    assert (again.remote_hits, misses(again), again.hits, again.state) == (0, {}, len(arrays), "mapped")


def test_a_partial_local_file_is_replaced_by_the_published_one(tmp_path: Path, keys: dict[str, Path]) -> None:
    """A local file missing packs (an interrupted build) is healed from the store, not packed again."""
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    (tmp_path / "store").mkdir()
    publish(built, str(tmp_path / "store"), private_key=str(keys["ci"]))
    local = tmp_path / "b" / "model-x.pcache"
    build(local, count=1)  # the same first pack, nothing else
    stats = load(local, arrays, remote=str(tmp_path / "store"), trusted_keys=[keys["ci.pub"]])
    assert (stats.remote_hits, stats.stored, stats.hits) == (1, 0, len(arrays)), stats


def test_a_newer_generation_replaces_the_local_file_by_rename_and_old_mappings_keep_their_bytes(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    store = str(tmp_path / "store")
    os.mkdir(store)
    first, second = tmp_path / "v1" / "model-x.pcache", tmp_path / "v2" / "model-x.pcache"
    old = build(first, seed=1)
    new = build(second, seed=2)
    publish(first, store, private_key=str(keys["ci"]))
    local = tmp_path / "b" / "model-x.pcache"
    platform = canonical_key(PLATFORM)
    assert fleet_fetch.fetch(store, local, platform=platform, trusted_keys=[keys["ci.pub"].read_bytes()]).downloaded
    with packcache.WeightCache(local, platform=PLATFORM) as reader, reader.session() as s:
        held = s.get_or_pack("layer0", lambda: old["layer0"], {"packer": "test.f32", "version": 1})
        inode = local.stat().st_ino
        assert publish(second, store, private_key=str(keys["ci"])).generation == 2
        report = fleet_fetch.fetch(store, local, platform=platform, trusted_keys=[keys["ci.pub"].read_bytes()])
        assert (report.downloaded, report.generation) == (True, 2)
        assert local.stat().st_ino != inode and local.read_bytes() == second.read_bytes()
        assert np.array_equal(held, old["layer0"])  # the mapped file was renamed over, never rewritten
    assert np.array_equal(held, old["layer0"])
    assert not np.array_equal(old["layer0"], new["layer0"])
    # Nothing to do the next time.
    again = fleet_fetch.fetch(store, local, platform=platform, trusted_keys=[keys["ci.pub"].read_bytes()])
    assert (again.downloaded, again.generation) == (False, 2)


# --------------------------------------------------------------------------- every miss reason, for real


def _published(tmp_path: Path, keys: dict[str, Path], **options: Any) -> tuple[str, dict[str, np.ndarray], Any]:
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    store = tmp_path / "store"
    store.mkdir()
    report = publish(built, str(store), **options)
    return str(store), arrays, report


def _assert_miss(stats: packcache.CacheStats, reason: str, arrays: dict[str, np.ndarray]) -> None:
    """One miss of ``reason``; the model then packed locally, every byte right (``load`` checked them)."""
    assert misses(stats) == {reason: 1}, (stats.remote_misses_by_reason, stats.remote_error)
    assert stats.remote_hits == 0 and stats.remote_error.startswith(reason), stats.remote_error
    assert stats.stored == len(arrays) and stats.state == "stored", stats


def test_an_empty_store_is_remote_absent(tmp_path: Path, keys: dict[str, Path]) -> None:
    (tmp_path / "store").mkdir()
    arrays = build(tmp_path / "a" / "model-x.pcache")
    stats = load(tmp_path / "b" / "model-x.pcache", arrays, remote=str(tmp_path / "store"))
    _assert_miss(stats, "remote_absent", arrays)


def test_unsigned_and_foreign_signed_manifests_are_remote_untrusted(tmp_path: Path, keys: dict[str, Path]) -> None:
    store, arrays, _ = _published(tmp_path, keys)  # unsigned
    trusted = [keys["ci.pub"]]
    _assert_miss(load(tmp_path / "b" / "model-x.pcache", arrays, remote=store, trusted_keys=trusted),
                 "remote_untrusted", arrays)  # fmt: skip
    stats = load(tmp_path / "c" / "model-x.pcache", arrays, remote=store, allow_unsigned=True)
    assert (stats.remote_hits, stats.stored) == (1, 0)
    store2 = str(tmp_path / "store2")
    os.mkdir(store2)
    publish(tmp_path / "a" / "model-x.pcache", store2, private_key=str(keys["other"]))
    _assert_miss(load(tmp_path / "d" / "model-x.pcache", arrays, remote=store2, trusted_keys=trusted),
                 "remote_untrusted", arrays)  # fmt: skip
    # Key rotation: the old key and the new one both trusted.
    stats = load(tmp_path / "e" / "model-x.pcache", arrays, remote=store2, trusted_keys=[*trusted, keys["other.pub"]])
    assert stats.remote_hits == 1


def test_a_trusted_key_file_that_cannot_be_read_is_a_counted_miss_not_an_error(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    store, arrays, _ = _published(tmp_path, keys, private_key=str(keys["ci"]))
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    for bad in (tmp_path / "missing.pub.pem", fifo, keys["ci"]):  # missing, a FIFO, a private key
        stats = load(tmp_path / f"b-{bad.name}" / "model-x.pcache", arrays, remote=store, trusted_keys=[bad])
        _assert_miss(stats, "remote_untrusted", arrays)


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_a_tampered_or_truncated_blob_is_remote_corrupt_and_never_lands(
    tmp_path: Path, keys: dict[str, Path], damage: str
) -> None:
    store, arrays, report = _published(tmp_path, keys, private_key=str(keys["ci"]))
    blob = Path(store) / report.blob_key
    data = bytearray(blob.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # a pack byte: only the sha256 (and the pack checksum) can tell
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data += b"\0" * 4096
    blob.write_bytes(bytes(data))
    local = tmp_path / "b" / "model-x.pcache"
    stats = load(local, arrays, remote=store, trusted_keys=[keys["ci.pub"]])
    _assert_miss(stats, "remote_corrupt", arrays)
    assert sorted(p.name for p in local.parent.iterdir()) == ["model-x.pcache", "model-x.pcache.lock"]


def test_a_manifest_for_another_platform_class_is_remote_incompatible(tmp_path: Path, keys: dict[str, Path]) -> None:
    """A manifest put at this class's key naming another class's blob (a careless copy): refused by its
    class; and a blob whose header names another platform, under an unsigned manifest claiming this
    class: refused by its header, before the download."""
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built, platform=OTHER_PLATFORM)
    store = tmp_path / "store"
    store.mkdir()
    report = publish(built, str(store))
    ours = platform_class(canonical_key(PLATFORM))
    target = store / "manifests" / "model-x" / f"{ours}.json"
    target.write_bytes((store / report.manifest_key).read_bytes())
    _assert_miss(load(tmp_path / "b" / "model-x.pcache", arrays, remote=str(store), allow_unsigned=True),
                 "remote_incompatible", arrays)  # fmt: skip
    envelope = json.loads(target.read_bytes())
    envelope["manifest"]["platform_class"] = ours
    target.write_text(json.dumps(envelope))
    stats = load(tmp_path / "c" / "model-x.pcache", arrays, remote=str(store), allow_unsigned=True)
    _assert_miss(stats, "remote_incompatible", arrays)
    assert stats.remote_bytes == 0 or stats.remote_bytes < report.size  # the header said so: no download


def test_expired_and_rolled_back_manifests_are_remote_stale(tmp_path: Path, keys: dict[str, Path]) -> None:
    trusted = [keys["ci.pub"]]
    store, arrays, _ = _published(tmp_path, keys, private_key=str(keys["ci"]), expires_in=1)
    time.sleep(1.2)
    _assert_miss(load(tmp_path / "b" / "model-x.pcache", arrays, remote=store, trusted_keys=trusted),
                 "remote_stale", arrays)  # fmt: skip
    # Rollback: generation 2 accepted, then the store serves generation 1's manifest again.
    built = tmp_path / "a" / "model-x.pcache"
    manifest = Path(store) / "manifests" / "model-x" / f"{platform_class(canonical_key(PLATFORM))}.json"
    publish(built, store, private_key=str(keys["ci"]))  # generation 2, fresh expiry
    first = manifest.read_bytes()
    publish(built, store, private_key=str(keys["ci"]))  # generation 3
    assert load(tmp_path / "c" / "model-x.pcache", arrays, remote=store, trusted_keys=trusted).remote_hits == 1
    manifest.write_bytes(first)
    _assert_miss(load(tmp_path / "d" / "model-x.pcache", arrays, remote=store, trusted_keys=trusted),
                 "remote_stale", arrays)  # fmt: skip


@pytest.mark.root
def test_a_full_disk_is_remote_no_space_and_a_read_only_directory_remote_write_failed(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    require_root()
    store, arrays, _ = _published(tmp_path, keys, private_key=str(keys["ci"]))
    with tmpfs(tmp_path / "small", size="64k") as small:
        # The blob does not fit: the fetch is refused before the download (statvfs), and the load's
        # own packs then go to heap (no_space), as without a store.
        with packcache.WeightCache(small / "model-x.pcache", platform=PLATFORM, remote=store,
                                   trusted_keys=[keys["ci.pub"]]) as cache:  # fmt: skip
            with cache.session() as s:
                for name, array in arrays.items():
                    got = s.get_or_pack(name, lambda a=array: a, {"packer": "test.f32", "version": 1})
                    assert np.array_equal(got, array)
            stats = cache.stats()
        assert misses(stats) == {"remote_no_space": 1}, stats.remote_error
        assert stats.remote_errno == errno.ENOSPC and stats.remote_hits == 0
        assert [p.name for p in small.iterdir() if ".tmp-" in p.name] == []
    empty = tmp_path / "empty"
    empty.mkdir()
    with read_only_bind(empty, tmp_path / "ro") as read_only:
        stats = load(read_only / "model-x.pcache", arrays, remote=store, trusted_keys=[keys["ci.pub"]])
        assert misses(stats) == {"remote_write_failed": 1}, stats.remote_error
        assert stats.remote_errno == errno.EROFS, stats
        assert stats.heap_bytes_by_reason["open_failed"] > 0 or stats.heap_bytes_by_reason["read_only"] > 0


@pytest.mark.serial
def test_a_hung_store_costs_at_most_remote_timeout_and_a_refused_one_is_remote_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays = build(tmp_path / "a" / "model-x.pcache")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    with silent_server() as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        began = time.monotonic()
        stats = load(tmp_path / "b" / "model-x.pcache", arrays, remote="s3://bucket/p", remote_timeout=1.5)
        elapsed = time.monotonic() - began
    _assert_miss(stats, "remote_timeout", arrays)
    assert elapsed < 1.5 + 1.5, elapsed
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    stats = load(tmp_path / "c" / "model-x.pcache", arrays, remote="s3://bucket/p", remote_timeout=5)
    _assert_miss(stats, "remote_error", arrays)


def test_remote_options_are_checked_when_the_cache_is_made(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    for bad in (0, -1, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ValueError, match="remote_timeout"):
            packcache.WeightCache(path, remote=str(tmp_path), remote_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trusted_keys"):
        packcache.WeightCache(path, remote=str(tmp_path), trusted_keys="key.pub.pem")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="remote"):
        packcache.WeightCache(path, remote="")


def test_the_options_channel_and_the_exporters_carry_the_remote_figures(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    arrays = build(tmp_path / "a" / "model-x.pcache")
    with packcache.WeightCache(tmp_path / "b" / "model-x.pcache", platform=PLATFORM,
                               remote=str(tmp_path / "store")) as cache:  # fmt: skip
        with cache.session() as s:
            for name, array in arrays.items():
                s.get_or_pack(name, lambda a=array: a, {"packer": "test.f32", "version": 1})
        assert cache.get_option("packed_cache_remote_misses")["remote_absent"] == 1
        assert cache.get_option("packed_cache_remote_hits") == 0
        assert cache.get_option("packed_cache_remote_error").startswith("remote_absent")
        from prometheus_client import CollectorRegistry, generate_latest

        from packcache.telemetry.prometheus import register

        registry = CollectorRegistry()
        register(registry)
        text = generate_latest(registry).decode()
        assert 'packcache_remote_misses{reason="remote_absent"} 1.0' in text, text
        assert all(f'reason="{r}"' in text for r in REMOTE_REASONS)
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from packcache.telemetry import otel

        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        otel.register(provider)
        data = reader.get_metrics_data()
        assert data is not None
        points = {m.name: list(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics}  # fmt: skip
        misses = {p.attributes["reason"]: p.value for p in points["packcache.remote_misses"]}
        assert misses == packcache.aggregate_stats().remote_misses_by_reason and misses["remote_absent"] >= 1
        assert points["packcache.remote_hits"][0].value == packcache.aggregate_stats().remote_hits
        provider.shutdown()


# --------------------------------------------------------------------------- processes


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=timeout, env=environment,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_eight_processes_fetching_at_once_download_once(tmp_path: Path, keys: dict[str, Path]) -> None:
    """The build lock makes one download per machine: the others wait for it and find the file there."""
    store, _, report = _published(tmp_path, keys, private_key=str(keys["ci"]))
    local = tmp_path / "b" / "model-x.pcache"
    code = (
        "import json, sys\n"
        "from packcache.fleet.fetch import fetch\n"
        "from packcache.format import canonical_key\n"
        f"r = fetch({store!r}, {str(local)!r}, platform=canonical_key({PLATFORM!r}), "
        f"trusted_keys=[open({str(keys['ci.pub'])!r}, 'rb').read()], timeout=60)\n"
        "print(json.dumps(r.to_json()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(8)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["downloaded"] for r in results) == [False] * 7 + [True]
    assert sum(r["bytes"] >= report.size for r in results) == 1


def test_two_publishers_racing_one_wins_the_other_gets_remote_conflict(tmp_path: Path, keys: dict[str, Path]) -> None:
    built = tmp_path / "a" / "model-x.pcache"
    build(built)
    twin = tmp_path / "b" / "model-x.pcache"  # two CI jobs, each with its own copy (one build lock each)
    twin.parent.mkdir()
    shutil.copy2(built, twin)
    store = str(tmp_path / "store")
    os.mkdir(store)
    code = (
        "import sys, time\n"
        "from packcache.fleet import publish as p\n"
        "real = p._current_generation\n"
        "def slow(*a, **k):\n"
        "    found = real(*a, **k)\n"
        "    time.sleep(1.0)  # both read 'no manifest' before either writes\n"
        "    return found\n"
        "p._current_generation = slow\n"
        "try:\n"
        f"    print(p.publish(sys.argv[1], {store!r}, private_key={str(keys['ci'])!r}).generation)\n"
        "except Exception as e:\n"
        "    print(getattr(e, 'reason', type(e).__name__))\n"
        "    print(str(e).replace(chr(10), ' '))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=env)
             for path in (built, twin)]  # fmt: skip
    outputs = sorted(proc.communicate(timeout=60)[0].strip().splitlines() for proc in procs)
    outcomes = [lines[0] for lines in outputs]
    assert outcomes == ["1", "remote_conflict"], outcomes
    # the loser is told what happened and what to do
    lost = outputs[1][1]
    assert "another publisher" in lost and "run it again" in lost, lost


def test_publish_refuses_a_file_with_superseded_bytes_or_sources_it_cannot_find(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    with packcache.WeightCache(built, platform=PLATFORM) as cache, cache.session() as s:
        s.get_or_pack("layer0", lambda: arrays["layer0"] * 2, {"packer": "test.f32", "version": 2})
    (tmp_path / "store").mkdir()
    done = _cli("publish", str(built), str(tmp_path / "store"), "--sign", str(keys["ci"]))
    assert done.returncode == 1 and "superseded bytes" in done.stderr and "packcache compact" in done.stderr
    assert list((tmp_path / "store").iterdir()) == []
    # A key naming a source by content: publish must find and hash it again.
    named = tmp_path / "n" / "model-y.pcache"
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * 4096)
    identity = f"sha256:{hashlib.sha256(source.read_bytes()).hexdigest()}:4096"
    with packcache.WeightCache(named, platform=PLATFORM) as cache, cache.session() as s:
        s.get_or_pack("w", lambda: np.ones(8, np.float32), {"packer": "test.f32", "source": identity})
    done = _cli("publish", str(named), str(tmp_path / "store"), "--sign", str(keys["ci"]))
    assert done.returncode == 1 and identity in done.stderr and "--model" in done.stderr, done.stderr
    source.write_bytes(b"x" * 4096)  # same size, other bytes: a corrupt blob keeps its name
    done = _cli("publish", str(named), str(tmp_path / "store"), "--model", str(tmp_path), "--sign", str(keys["ci"]))
    assert done.returncode == 1 and identity in done.stderr, done.stderr
    source.write_bytes(b"w" * 4096)
    done = _cli("publish", str(named), str(tmp_path / "store"), "--model", str(tmp_path), "--sign",
                str(keys["ci"]), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sources_checked"] == 1


# --------------------------------------------------------------------------- two machines, the command line


def machine(root: Path, **more: str) -> dict[str, str]:
    """The environment of one "machine": its own cache home, digest records and home directory."""
    root.mkdir(parents=True, exist_ok=True)
    return {"XDG_CACHE_HOME": str(root / "xdg"), "PACKCACHE_DIGEST_DIR": str(root / "digests"),
            "HOME": str(root), **more}  # fmt: skip


def test_built_once_published_and_fetched_on_another_machine_with_zero_packs_computed(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    """Machine A builds and publishes; machine B (another directory, a copy of the checkpoint at another
    path with other mtimes, other variables) builds, runs and fetches with --remote: nothing is packed."""
    a, b = tmp_path / "a", tmp_path / "b"
    checkpoint = tiny_bert(a / "ckpt", seed=7)
    env_a = machine(a)
    built = _cli("build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir", str(a / "cache"),
                 "--json", env=env_a)  # fmt: skip
    assert built.returncode == 0, built.stderr
    cache_file = json.loads(built.stdout)["cache_file"]
    store = tmp_path / "store"
    store.mkdir()
    published = _cli("publish", cache_file, str(store), "--sign", str(keys["ci"]), "--model", str(checkpoint),
                     "--json", env=env_a)  # fmt: skip
    assert published.returncode == 0, published.stderr
    report = json.loads(published.stdout)
    assert (report["generation"], report["sources_checked"], report["uploaded"]) == (1, 1, True)

    copy = b / "elsewhere" / "ckpt-copy"
    shutil.copytree(checkpoint, copy)
    later = time.time() + 3600
    for path in copy.iterdir():
        os.utime(path, (later, later))
    env_b = machine(b, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", PACKCACHE_KERNEL_PATH="fp32")
    remote = ["--remote", str(store), "--trusted-key", str(keys["ci.pub"])]
    done = _cli("build", str(copy), "--loader", "minilm", "--scheme", "int8", "--cache-dir", str(b / "cache"),
                *remote, "--json", env=env_b)  # fmt: skip
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert (stats["remote_hits"], stats["stored"], stats["state"]) == (1, 0, "mapped"), stats
    assert stats["hits"] == json.loads(built.stdout)["packs"]
    assert Path(json.loads(done.stdout)["cache_file"]).name == Path(cache_file).name
    ran = _cli("run", "--model", str(copy), "--scheme", "int8", "--cache-dir", str(b / "cache2"), *remote,
               env=env_b)  # fmt: skip
    assert ran.returncode == 0 and "remote        fetched from" in ran.stdout, ran.stdout + ran.stderr
    fetched = _cli("fetch", str(store), "--model", str(copy), "--scheme", "int8", "--cache-dir", str(b / "cache3"),
                   "--trusted-key", str(keys["ci.pub"]), "--json", env=env_b)  # fmt: skip
    assert fetched.returncode == 0 and json.loads(fetched.stdout)["downloaded"] is True, fetched.stderr
    # probe by URL: the manifest (signature checked), then the blob's header and index by range reads.
    manifest_url = f"file://{store}/{report['manifest_key']}"
    probed = _cli("probe", manifest_url, "--trusted-key", str(keys["ci.pub"]), "--json", env=env_b)
    verdict = json.loads(probed.stdout)
    assert probed.returncode == 0 and verdict["verdict"] == "compatible", probed.stdout + probed.stderr
    assert 0 < verdict["bytes_read"] < report["size"] // 10
    unverified = _cli("probe", manifest_url, "--json", env=env_b)
    assert unverified.returncode == 6 and json.loads(unverified.stdout)["verdict"] == "unverified"
    blob = _cli("probe", f"{store}/{report['blob_key']}".replace(str(store), f"file://{store}"), env=env_b)
    assert blob.returncode == 0 and "compatible" in blob.stdout, blob.stdout + blob.stderr
    # Without the key the fetch is refused, in one line, exit 1.
    refused = _cli("fetch", str(store), "--model", str(copy), "--scheme", "int8", "--cache-dir", str(b / "cache4"),
                   env=env_b)  # fmt: skip
    assert refused.returncode == 1 and "remote_untrusted" in refused.stderr and "Traceback" not in refused.stderr


def test_publish_and_read_through_against_a_real_s3_server(
    tmp_path: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto's S3 server over real HTTP: create-only blobs, compare-and-swap manifests, range reads."""
    from harness.s3server import moto_server

    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    with moto_server() as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        url = f"{server.url}/fleet"
        first = publish(built, url, private_key=str(keys["ci"]))
        again = publish(built, url, private_key=str(keys["ci"]))  # the blob is there: only the manifest moves
        assert (first.uploaded, first.generation, again.uploaded, again.generation) == (True, 1, False, 2)
        stats = load(tmp_path / "b" / "model-x.pcache", arrays, remote=url, trusted_keys=[keys["ci.pub"]])
        assert (stats.remote_hits, stats.stored, stats.state) == (1, 0, "mapped"), stats
        assert (tmp_path / "b" / "model-x.pcache").read_bytes() == built.read_bytes()
        server.kill()  # the store goes down: a local hit does not notice, a miss is counted
        stats = load(tmp_path / "b" / "model-x.pcache", arrays, remote=url, trusted_keys=[keys["ci.pub"]])
        assert (stats.remote_hits, misses(stats), stats.state) == (0, {}, "mapped")
        stats = load(tmp_path / "c" / "model-x.pcache", arrays, remote=url, remote_timeout=3,
                     trusted_keys=[keys["ci.pub"]])  # fmt: skip
        _assert_miss(stats, "remote_error", arrays)


def test_a_disk_that_fills_during_the_download_is_remote_no_space_and_leaves_nothing_behind(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    """Free space is checked before the download, but the disk can still fill while it runs: a file
    size limit (RLIMIT_FSIZE, EFBIG, in a child process) cuts the write half way through the blob."""
    store, _, report = _published(tmp_path, keys, private_key=str(keys["ci"]))
    local = tmp_path / "b" / "model-x.pcache"
    code = (
        "import json, resource, signal, sys\n"
        "import numpy as np\n"
        "import packcache\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death, as a full disk gives ENOSPC\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({report.size // 2}, {report.size // 2}))\n"
        f"cache = packcache.WeightCache({str(local)!r}, platform={PLATFORM!r}, remote={store!r}, "
        f"trusted_keys=[{str(keys['ci.pub'])!r}])\n"
        "rng = np.random.default_rng(0)\n"
        "with cache.session() as s:\n"
        "    for i in range(4):\n"
        "        a = rng.standard_normal((64, 64)).astype(np.float32)\n"
        "        got = s.get_or_pack(f'layer{i}', lambda a=a: a, {'packer': 'test.f32', 'version': 1})\n"
        "        assert np.array_equal(got, a)\n"
        "st = cache.stats()\n"
        "print(json.dumps({'misses': {k: v for k, v in st.remote_misses_by_reason.items() if v}, "
        "'errno': st.remote_errno, 'hits': st.remote_hits}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"misses": {"remote_no_space": 1}, "errno": errno.EFBIG, "hits": 0}, result
    assert [p.name for p in local.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_fetched_file_gets_the_modes_the_cache_would_have_made_it_with(tmp_path: Path, keys: dict[str, Path]) -> None:
    """A cache shared by several users (``file_mode=0o644``, ``dir_mode=0o755``) gets a fetched file
    they can read, as one it built itself."""
    store, arrays, _ = _published(tmp_path, keys, private_key=str(keys["ci"]))
    local = tmp_path / "b" / "shared" / "model-x.pcache"
    stats = load(local, arrays, remote=store, trusted_keys=[keys["ci.pub"]], file_mode=0o644, dir_mode=0o755)
    assert stats.remote_hits == 1 and stats.stored == 0
    assert (local.stat().st_mode & 0o777, local.parent.stat().st_mode & 0o777) == (0o644, 0o755)
    assert Path(f"{local}.lock").stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- key rotation, repair


def test_key_rotation_by_cli_machines_trusting_old_new_or_both_accept_the_dual_signed_manifest(
    tmp_path: Path,
) -> None:
    """``publish --sign OLD --sign NEW`` signs with both: machines that still trust only the old key, those
    that trust only the new one, and those with both all take the manifest (docs/FLEET.md, rotation)."""
    keydir = tmp_path / "keys"
    keydir.mkdir()
    for name in ("old", "new"):
        made = _cli("keygen", str(keydir / f"{name}.pem"))
        assert made.returncode == 0, made.stderr
    builder = machine(tmp_path / "ci")
    checkpoint = tiny_bert(tmp_path / "ci" / "ckpt", seed=3, layers=1)
    built = _cli("build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir",
                 str(tmp_path / "ci" / "cache"), "--json", env=builder)  # fmt: skip
    assert built.returncode == 0, built.stderr
    store = tmp_path / "store"
    store.mkdir()
    signs = ["--sign", str(keydir / "old.pem"), "--sign", str(keydir / "new.pem")]
    published = _cli("publish", json.loads(built.stdout)["cache_file"], str(store), "--model", str(checkpoint),
                     *signs, "--json", env=builder)  # fmt: skip
    assert published.returncode == 0, published.stderr
    envelope = json.loads((store / json.loads(published.stdout)["manifest_key"]).read_bytes())
    assert len(envelope["signatures"]) == 2, envelope["signatures"]
    for trusting in (["old"], ["new"], ["old", "new"]):
        env = machine(tmp_path / "-".join(trusting))
        keys_given = [arg for name in trusting for arg in ("--trusted-key", str(keydir / f"{name}.pub.pem"))]
        fetched = _cli("fetch", str(store), "--model", str(checkpoint), "--scheme", "int8", "--cache-dir",
                       str(tmp_path / "-".join(trusting) / "cache"), *keys_given, "--json", env=env)  # fmt: skip
        assert fetched.returncode == 0, (trusting, fetched.stderr)
        assert json.loads(fetched.stdout)["downloaded"] is True


def _damage(store: str, blob_key: str, how: str) -> None:
    """Write other bytes over the published blob, in place, as a bad disk or a hand-made upload would."""
    import obstore
    import obstore.store

    if store.startswith("s3://"):
        client = obstore.store.from_url(store, client_options={"allow_http": True})
        data = bytes(obstore.get(client, blob_key).bytes())
    else:
        data = (Path(store) / blob_key).read_bytes()
    damaged = {
        "same size": data[:5000] + bytes(b ^ 0xFF for b in data[5000:5100]) + data[5100:],
        "shorter": data[: len(data) // 2],
        "longer": data + b"\0" * 4096,
    }[how]
    if store.startswith("s3://"):
        obstore.put(client, blob_key, damaged)
    else:
        path = Path(store) / blob_key
        path.chmod(0o644)
        path.write_bytes(damaged)


@pytest.mark.xdist_group("weed")  # one weed mini at a time
@pytest.mark.parametrize("kind", ["directory", "moto", "weed"])
def test_republish_replaces_a_damaged_blob_of_any_size_and_fetches_then_succeed(
    tmp_path: Path, keys: dict[str, Path], kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object at the blob's content address is taken as the blob only once its bytes hash to it: a
    damaged one (same size, shorter, longer) is replaced by the next publish (a conditional PUT on its
    ETag, which SeaweedFS enforces too), and fetches succeed again."""
    import uuid

    from harness.s3server import weed_server

    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    servers = contextlib.ExitStack()
    request.addfinalizer(servers.close)
    if kind == "moto":
        store = f"{request.getfixturevalue('moto_env').url}/{uuid.uuid4().hex}"
    elif kind == "weed":
        server = servers.enter_context(weed_server())
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        store = f"{server.url}/{uuid.uuid4().hex}"
    else:
        store = str(tmp_path / "store")
        os.mkdir(store)
    first = publish(built, store, private_key=str(keys["ci"]))
    assert (first.uploaded, first.repaired) == (True, False)
    for number, how in enumerate(["same size", "shorter", "longer"]):
        _damage(store, first.blob_key, how)
        broken = load(tmp_path / f"broken{number}" / "model-x.pcache", arrays, remote=store,
                      trusted_keys=[keys["ci.pub"]])  # fmt: skip
        assert misses(broken) == {"remote_corrupt": 1}, (how, broken.remote_error)
        again = publish(built, store, private_key=str(keys["ci"]))
        assert (again.uploaded, again.repaired) == (False, True), (how, again)
        stats = load(tmp_path / f"fixed{number}" / "model-x.pcache", arrays, remote=store,
                     trusted_keys=[keys["ci.pub"]])  # fmt: skip
        assert (stats.remote_hits, stats.stored, misses(stats)) == (1, 0, {}), (how, stats.remote_error)
    kept = publish(built, store, private_key=str(keys["ci"]))  # a sound blob is kept, after its bytes are hashed
    assert (kept.uploaded, kept.repaired) == (False, False)


def test_a_missing_bucket_is_a_remote_error_for_fetch_and_publish_never_nothing_published(
    tmp_path: Path, keys: dict[str, Path], moto_env: Any
) -> None:
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    url = "s3://no-such-bucket-packcache/fleet"
    stats = load(tmp_path / "b" / "model-x.pcache", arrays, remote=url, trusted_keys=[keys["ci.pub"]])
    _assert_miss(stats, "remote_error", arrays)
    assert "does not exist" in stats.remote_error, stats.remote_error
    with pytest.raises(packcache.errors.RemoteError) as raised:
        publish(built, url, private_key=str(keys["ci"]))
    assert raised.value.reason == "remote_error" and "bucket" in str(raised.value), raised.value


def test_fetch_without_loader_picks_the_loader_that_reads_the_checkpoint_of_an_hf_built_file(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    """``packcache build DIR`` (the hf loader) of a llama checkpoint, published; ``packcache fetch URL --model
    DIR`` with no ``--loader`` used to fail with the minilm loader's "hidden_act 'silu' is not supported"."""
    import torch
    import transformers

    checkpoint = tmp_path / "ci" / "llama"
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    env = machine(tmp_path / "ci")
    built = _cli("build", str(checkpoint), "--scheme", "int8", "--auto-class", "AutoModelForCausalLM",
                 "--cache-dir", str(tmp_path / "ci" / "cache"), "--json", env=env)  # fmt: skip
    assert built.returncode == 0, built.stderr
    store = tmp_path / "store"
    store.mkdir()
    published = _cli("publish", json.loads(built.stdout)["cache_file"], str(store), "--model", str(checkpoint),
                     "--sign", str(keys["ci"]), env=env)  # fmt: skip
    assert published.returncode == 0, published.stderr
    other = machine(tmp_path / "b")
    common = ["--model", str(checkpoint), "--scheme", "int8", "--trusted-key", str(keys["ci.pub"]), "--auto-class",
              "AutoModelForCausalLM"]  # fmt: skip
    fetched = _cli("fetch", str(store), *common, "--cache-dir", str(tmp_path / "b" / "cache"), "--json", env=other)
    assert fetched.returncode == 0, fetched.stderr
    report = json.loads(fetched.stdout)
    assert report["downloaded"] is True and report["loader"] == "hf", report
    assert report["download_mbps"] > 0 and report["download_seconds"] > 0, report  # the download's throughput
    assert Path(report["path"]).name == Path(json.loads(built.stdout)["cache_file"]).name
    text = _cli("fetch", str(store), *common, "--cache-dir", str(tmp_path / "c" / "cache"), env=other)
    assert text.returncode == 0 and "loader        hf" in text.stdout and "minilm" in text.stdout, text.stdout
    assert " MB/s, " in text.stdout, text.stdout  # "read ... (download N MB/s, S s)"
    explicit = _cli("fetch", str(store), *common, "--loader", "minilm", "--cache-dir", str(tmp_path / "c"), env=other)
    assert explicit.returncode == 1 and "--loader hf" in explicit.stderr, explicit.stderr
    assert "Traceback" not in explicit.stderr
