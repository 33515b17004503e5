"""A replayed older manifest is refused whatever spelling of the store a fetch is given, and on a fresh
"pod" (a new ``$XDG_CACHE_HOME``) in front of a persistent cache volume.

Real files, a real directory store, moto's S3 server over HTTP, real ``packcache fetch`` processes.
Each test accepts generation 2, then puts generation 1's signed manifest back in the store (a replay:
it verifies, it has not expired) and fetches again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness.keys import make_keys
from harness.s3server import S3Server
from packcache.errors import RemoteError
from packcache.fleet import fetch as fleet_fetch
from packcache.fleet.platform import platform_class
from packcache.fleet.publish import publish
from packcache.fleet.stores import open_store
from packcache.format import canonical_key

SRC = Path(__file__).resolve().parents[1] / "src"
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}
CLASS = platform_class(canonical_key(PLATFORM))
MANIFEST = f"manifests/model-x/{CLASS}.json"


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci")


def build(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with packcache.WeightCache(path, platform=PLATFORM) as cache, cache.session() as s:
        for i in range(3):
            array = rng.standard_normal((64, 64)).astype(np.float32)
            s.get_or_pack(f"layer{i}", lambda a=array: a, {"packer": "test.f32", "version": 1})


def _two_generations(tmp_path: Path, keys: dict[str, Path], url: str) -> tuple[bytes, Path, Path]:
    """Generation 1 (old bytes) then 2 (new bytes) published at ``url``; returns generation 1's envelope."""
    old, new = tmp_path / "v1" / "model-x.pcache", tmp_path / "v2" / "model-x.pcache"
    build(old, seed=1)
    build(new, seed=2)
    assert publish(old, url, private_key=str(keys["ci"])).generation == 1
    with open_store(url) as store:
        first, _ = store.get(MANIFEST, deadline=time.monotonic() + 10, max_bytes=1 << 16)
    assert publish(new, url, private_key=str(keys["ci"])).generation == 2
    return first, old, new


def _replay(url: str, envelope: bytes) -> None:
    with open_store(url) as store:
        _, info = store.get(MANIFEST, deadline=time.monotonic() + 10, max_bytes=1 << 16)
        store.put_bytes(MANIFEST, envelope, deadline=time.monotonic() + 10, if_match=info.etag)


def _fetch(url: str, local: Path, keys: dict[str, Path]) -> Any:
    return fleet_fetch.fetch(url, local, platform=canonical_key(PLATFORM), trusted_keys=[keys["ci.pub"].read_bytes()])


def test_a_replayed_manifest_is_refused_through_every_spelling_of_the_store(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / "link").symlink_to(store)
    first, _, new = _two_generations(tmp_path, keys, str(store))
    local = tmp_path / "cache" / "model-x.pcache"
    assert _fetch(str(store), local, keys).generation == 2
    _replay(str(store), first)
    spellings = [
        f"file://{store}", f"file://localhost{store}/", f"FILE://{store}//", f"{store}/.", f"{store}/../store",
        f"file://{store}?token=rotated", str(tmp_path / "link"), f"file://{tmp_path / 'link'}",
    ]  # fmt: skip
    for spelling in spellings:
        with pytest.raises(RemoteError) as refused:
            _fetch(spelling, local, keys)
        assert refused.value.reason == "remote_stale", (spelling, refused.value)
        assert local.read_bytes() == new.read_bytes(), spelling  # the newer local file stays


def test_a_replay_on_s3_is_refused_whatever_credentials_the_url_carries(
    tmp_path: Path, keys: dict[str, Path], moto_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = uuid.uuid4().hex
    url = f"{moto_env.url}/{prefix}"
    first, _, new = _two_generations(tmp_path, keys, url)
    local = tmp_path / "cache" / "model-x.pcache"
    assert _fetch(f"s3://AKIA1:old-token@{moto_env.bucket}/{prefix}", local, keys).generation == 2
    _replay(url, first)
    spellings = [
        f"s3://AKIA2:rotated-token@{moto_env.bucket}/{prefix}", f"s3://{moto_env.bucket}/{prefix}/",
        f"s3a://{moto_env.bucket}/{prefix}", f"S3://{moto_env.bucket}/{prefix}?X-Amz-Signature=abc&token=new",
    ]  # fmt: skip
    for spelling in spellings:
        with pytest.raises(RemoteError) as refused:
            _fetch(spelling, local, keys)
        assert refused.value.reason == "remote_stale", (spelling, refused.value)
        assert local.read_bytes() == new.read_bytes(), spelling
    # A second pod: a fresh home, the same cache volume, another spelling: still refused.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "pod2"))
    with pytest.raises(RemoteError, match="remote_stale"):
        _fetch(f"s3://AKIA3:third@{moto_env.bucket}/{prefix}", local, keys)
    assert local.read_bytes() == new.read_bytes()


def _pod(store: str, local: Path, keys: dict[str, Path], home: Path) -> subprocess.CompletedProcess[str]:
    """A fetch in a new process with a fresh ``$XDG_CACHE_HOME`` and ``$HOME``: a new pod."""
    code = (
        "import json, sys\n"
        "from packcache.errors import RemoteError\n"
        "from packcache.fleet.fetch import fetch\n"
        "from packcache.format import canonical_key\n"
        "try:\n"
        f"    r = fetch({store!r}, {str(local)!r}, platform=canonical_key({PLATFORM!r}), "
        f"trusted_keys=[open({str(keys['ci.pub'])!r}, 'rb').read()])\n"
        "except RemoteError as exc:\n"
        "    sys.exit(str(exc))\n"
        "print(json.dumps(r.to_json()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "XDG_CACHE_HOME": str(home / "xdg"), "HOME": str(home)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def test_a_fresh_pod_home_in_front_of_the_cache_volume_refuses_a_replay(tmp_path: Path, keys: dict[str, Path]) -> None:
    """FLEET.md's Kubernetes recipe: each pod starts with a fresh home, the cache volume persists."""
    store = tmp_path / "store"
    store.mkdir()
    first, _, new = _two_generations(tmp_path, keys, str(store))
    volume = tmp_path / "volume"
    local = volume / "model-x.pcache"
    done = _pod(str(store), local, keys, tmp_path / "pod1")
    assert done.returncode == 0 and json.loads(done.stdout)["generation"] == 2, done.stderr
    second = (store / MANIFEST).read_bytes()
    _replay(str(store), first)
    again = _pod(f"file://{store}", local, keys, tmp_path / "pod2")
    assert again.returncode == 1 and "remote_stale" in again.stderr, (again.stdout, again.stderr)
    assert (volume / "model-x.pcache").read_bytes() == new.read_bytes()
    # A record another user could have written (group/world-writable) is not trusted: here it would
    # claim a generation no store holds, and must not block the real one.
    records = [p for p in volume.iterdir() if ".accepted-" in p.name]
    assert len(records) == 1 and records[0].stat().st_mode & 0o077 == 0, records
    records[0].write_text(json.dumps({"generation": 99, "sha256": "0" * 64}))
    os.chmod(records[0], 0o666)
    _replay(str(store), second)
    third = _pod(str(store), local, keys, tmp_path / "pod3")
    assert third.returncode == 0 and json.loads(third.stdout)["generation"] == 2, third.stderr
