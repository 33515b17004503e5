"""Published names: a node with no checkpoint fetches a cache file by the name it was
published under, checked as every fetch is (docs/FLEET.md, "Published names").

Cache files are built through the library under the platform a loader of the scheme maps
(:meth:`packcache.loader.Recipe.platform`), published to real stores (a directory, moto's S3 server), and
fetched by :func:`packcache.fleet.names.fetch_name` and ``packcache fetch --name``.
"""

from __future__ import annotations

import hashlib
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
from packcache.errors import RemoteError
from packcache.fleet import fetch as fleet_fetch
from packcache.fleet.names import candidates, fetch_name, is_local_path, local_path, parse_name
from packcache.fleet.publish import publish
from packcache.format import canonical_key
from packcache.loader import resolve

SRC = Path(__file__).resolve().parents[1] / "src"
NAME = "org/model-int8"
KEY = {"packer": "test.f32", "version": 1}


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a new machine user: its own accepted-generation records and default cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PACKCACHE_DIR", raising=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci", "other")


def _platform(scheme: str = "int8") -> dict[str, Any]:
    return resolve(scheme).platform()


def build(path: Path, seed: int = 0, scheme: str = "int8", change: bool = False) -> dict[str, np.ndarray]:
    """A cache file of 3 packs under ``scheme``'s platform (the class a node of that scheme looks for); with
    ``change``, one value of one pack differs (a well-formed file, every checksum right, of the same size)."""
    rng = np.random.default_rng(seed)
    arrays = {f"layer{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(3)}
    if change:
        arrays["layer1"][7, 7] += 1.0
    path.parent.mkdir(parents=True, exist_ok=True)
    with packcache.WeightCache(path, platform=_platform(scheme)) as cache, cache.session() as s:
        for name, array in arrays.items():
            s.get_or_pack(name, lambda a=array: a, KEY)
    return arrays


def mapped(path: str, arrays: dict[str, np.ndarray], scheme: str = "int8") -> packcache.CacheStats:
    """Map ``path`` as a node would: every pack a hit (none packed), every byte the published one."""
    with packcache.WeightCache(path, platform=_platform(scheme)) as cache, cache.session() as s:
        for name, array in arrays.items():
            got = s.get_or_pack(name, lambda n=name: pytest.fail(f"{n} was packed, not mapped"), KEY)
            assert np.array_equal(got, array)
        return cache.stats()


def _store(tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> str:
    if kind == "moto":
        server = request.getfixturevalue("moto_env")
        return f"{server.url}/{uuid.uuid4().hex}"
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    return str(store)


def _put(store: str, key: str, data: bytes) -> None:
    """Write ``data`` at ``key`` as someone with write access to the store would, bypassing publish."""
    if store.startswith("s3://"):
        import obstore
        import obstore.store

        obstore.put(obstore.store.from_url(store, client_options={"allow_http": True}), key, data)
    else:
        path = Path(store) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.chmod(0o644)
        path.write_bytes(data)


def _get(store: str, key: str) -> bytes:
    if store.startswith("s3://"):
        import obstore
        import obstore.store

        client = obstore.store.from_url(store, client_options={"allow_http": True})
        return bytes(obstore.get(client, key).bytes())
    return (Path(store) / key).read_bytes()


def _left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("text", "expected"),
    [("org/model-int8", ("org/model-int8", None)), ("m", ("m", None)), ("a.b_c/d-e/f@12", ("a.b_c/d-e/f", 12)),
     ("x" * 200, ("x" * 200, None)), ("/".join("a" * 16), ("/".join("a" * 16), None))],
)  # fmt: skip
def test_parse_name_takes_segments_and_a_pinned_generation(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_name(text) == expected


@pytest.mark.parametrize(
    ("text", "named"),
    [("../etc/passwd", "starts with a dot"), ("org/../x", "starts with a dot"), ("org/.hidden", "starts with a dot"),
     ("/abs/name", "empty segment"), ("org//x", "empty segment"), ("org/", "empty segment"), ("", "characters"),
     ("a..b", "'..'"), ("org--x", "'--'"), ("org/a b", "A-Z"), ("org\\x", "A-Z"), ("mödel", "A-Z"),
     ("org/x\x00", "A-Z"), ("x" * 201, "characters"), ("/".join("a" * 17), "segments"),
     ("org/pc1-x.json", ".json"), ("org/m.pcache", ".pcache"), ("m@0", "positive integer"),
     ("m@-1", "positive integer"), ("m@01", "positive integer"), ("m@", "positive integer"),
     ("m@1@2", "positive integer"), ("m@+3", "positive integer"), ("m@1e3", "positive integer")],
)  # fmt: skip
def test_parse_name_refuses_tricks_naming_the_rule(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        parse_name(text)
    assert named in str(caught.value), caught.value


def test_is_local_path_tells_a_path_from_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for path in ("/x/y", "./org/m", "../org/m", "~/m", "~", "org/m.pcache", ".", ".."):
        assert is_local_path(path), path
    for name in ("org/model-int8", "org/model-int8@3", "bert-int8-0123"):
        assert not is_local_path(name), name
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model-int8").mkdir()
    assert is_local_path("org/model-int8")  # an existing path is a path


def test_local_path_writes_slashes_as_double_dashes_and_pins_into_a_file_of_their_own(tmp_path: Path) -> None:
    assert local_path("org/m", cache_dir=tmp_path) == str(tmp_path / "org--m.pcache")
    assert local_path("org/m", 3, cache_dir=tmp_path) == str(tmp_path / "org--m@3.pcache")
    assert local_path("m") == os.path.join(os.environ["XDG_CACHE_HOME"], "packcache", "m.pcache")
    with pytest.raises(ValueError, match="'--'"):
        local_path("org--m", cache_dir=tmp_path)


def test_bad_names_are_refused_before_any_store_call(tmp_path: Path, keys: dict[str, Path]) -> None:
    """A bad name is a ValueError at once: no store call (a missing store would be remote_error), nothing made."""
    built = tmp_path / "a" / "m.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    for bad in ("../x", "org/../../etc", "/etc/passwd", "a//b", "org/x@0", "a--b"):
        with pytest.raises(ValueError):
            fetch_name(str(tmp_path / "no-store"), bad, cache_dir=tmp_path / "cache", trusted_keys=[keys["ci.pub"]])
        with pytest.raises(ValueError):
            publish(built, str(store), name=bad, private_key=str(keys["ci"]))
    assert not (tmp_path / "cache").exists() and list(store.iterdir()) == []


# --------------------------------------------------------------------------- publish and fetch by name


@pytest.mark.parametrize("kind", ["directory", "moto"])
def test_a_node_with_no_checkpoint_fetches_a_published_name_and_maps_every_pack(
    tmp_path: Path, keys: dict[str, Path], kind: str, request: pytest.FixtureRequest
) -> None:
    built = tmp_path / "ci" / "anything.pcache"
    arrays = build(built)
    store = _store(tmp_path, kind, request)
    report = publish(built, store, name=NAME, private_key=str(keys["ci"]))
    cls = report.platform_class
    assert (report.model, report.generation, report.manifest_key, report.generation_key) == (
        NAME, 1, f"manifests/{NAME}/{cls}.json", f"manifests/{NAME}/{cls}@1.json")  # fmt: skip
    assert _get(store, report.manifest_key) == _get(store, report.generation_key)
    got = fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert got.path == str(tmp_path / "node" / "org--model-int8.pcache")
    assert (got.downloaded, got.reached, got.scheme, got.generation, got.model, got.name, got.platform_class) == (
        True, True, "int8", 1, NAME, NAME, cls)  # fmt: skip
    assert Path(got.path).read_bytes() == built.read_bytes()
    stats = mapped(got.path, arrays)
    assert (stats.hits, stats.stored, stats.state) == (len(arrays), 0, "mapped")
    # The default cache directory.
    default = fetch_name(store, NAME, trusted_keys=[keys["ci.pub"].read_bytes()])
    assert default.path == os.path.join(os.environ["XDG_CACHE_HOME"], "packcache", "org--model-int8.pcache")


def test_a_warm_fetch_by_name_reads_only_the_manifest_and_hashes_nothing(
    tmp_path: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record beside the file says which blob that very file is: a warm start reads the manifest and stops.
    A file changed since (its ctime moves) is hashed again; a file that no longer is the blob is replaced."""
    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    first = fetch_name(str(store), NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    hashed: list[str] = []
    real_hash = fleet_fetch.hash_file
    monkeypatch.setattr(fleet_fetch, "hash_file", lambda fd, name, st: hashed.append(name) or real_hash(fd, name, st))
    again = fetch_name(str(store), NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert (again.downloaded, hashed) == (False, [])
    assert again.bytes < 4096 < first.bytes  # the manifest only
    os.utime(first.path)  # same bytes, but not provably the file accepted: hashed once, then known again
    assert fetch_name(str(store), NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]]).downloaded is False
    assert hashed == [first.path]
    fetch_name(str(store), NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert hashed == [first.path]
    # Other bytes of the same size, written in place: the identity no longer matches; the hash says no; replaced.
    data = bytearray(Path(first.path).read_bytes())
    data[-100] ^= 1
    Path(first.path).write_bytes(bytes(data))
    assert fetch_name(str(store), NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]]).downloaded
    assert Path(first.path).read_bytes() == built.read_bytes()


def test_the_name_moves_and_a_pinned_generation_lands_in_its_own_file(tmp_path: Path, keys: dict[str, Path]) -> None:
    v1, v2 = tmp_path / "ci" / "v1.pcache", tmp_path / "ci" / "v2.pcache"
    old, new = build(v1, seed=1), build(v2, seed=2)
    store = tmp_path / "store"
    store.mkdir()
    publish(v1, str(store), name=NAME, private_key=str(keys["ci"]))
    assert publish(v2, str(store), name=NAME, private_key=str(keys["ci"])).generation == 2
    node, trusted = tmp_path / "node", [keys["ci.pub"]]
    current = fetch_name(str(store), NAME, cache_dir=node, trusted_keys=trusted)
    assert (current.generation, Path(current.path).read_bytes()) == (2, v2.read_bytes())
    pinned = fetch_name(str(store), f"{NAME}@1", cache_dir=node, trusted_keys=trusted)
    assert (pinned.generation, pinned.name, pinned.model, pinned.path) == (
        1, f"{NAME}@1", NAME, str(node / "org--model-int8@1.pcache"))  # fmt: skip
    assert Path(pinned.path).read_bytes() == v1.read_bytes()
    mapped(pinned.path, old)
    mapped(current.path, new)
    assert Path(current.path).read_bytes() == v2.read_bytes()  # the pinned fetch left the name's file alone
    # The pinned fetch lowered no record: the store serving generation 1 as current is still a rollback.
    cls = current.platform_class
    _put(str(store), f"manifests/{NAME}/{cls}.json", _get(str(store), f"manifests/{NAME}/{cls}@1.json"))
    with pytest.raises(RemoteError) as caught:
        fetch_name(str(store), NAME, cache_dir=tmp_path / "elsewhere", trusted_keys=trusted)
    assert caught.value.reason == "remote_stale", caught.value


def test_a_fetch_out_of_time_names_the_budget_it_had(
    tmp_path: Path, keys: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    """With no total timeout the whole fetch has ``timeout`` seconds, and the message names that figure."""
    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = _store(tmp_path, "directory", request)
    publish(built, store, name=NAME, private_key=str(keys["ci"]))
    for total, said in ((None, "1e-06 s"), (2e-6, "2e-06 s")):
        with pytest.raises(RemoteError) as caught:
            fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]], timeout=1e-6,
                       total_timeout=total)  # fmt: skip
        assert caught.value.reason == "remote_timeout", caught.value
        assert f"the fetch of {NAME!r} ran out of its {said}" in str(caught.value)
    assert [n for n in _left(tmp_path / "node") if not n.endswith(".lock")] == []


@pytest.mark.parametrize("kind", ["directory", "moto"])
def test_a_generation_that_does_not_exist_is_remote_absent_naming_it(
    tmp_path: Path, keys: dict[str, Path], kind: str, request: pytest.FixtureRequest
) -> None:
    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = _store(tmp_path, kind, request)
    publish(built, store, name=NAME, private_key=str(keys["ci"]))
    for asked in (f"{NAME}@2", "org/never-published"):
        with pytest.raises(RemoteError) as caught:
            fetch_name(store, asked, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
        assert caught.value.reason == "remote_absent", caught.value
        assert ("generation 2 of 'org/model-int8'" if "@" in asked else "'org/never-published'") in str(caught.value)
    assert [n for n in _left(tmp_path / "node") if not n.endswith(".lock")] == []


def test_a_pinned_copy_naming_another_generation_is_refused(tmp_path: Path, keys: dict[str, Path]) -> None:
    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    report = publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    (store / f"manifests/{NAME}/{report.platform_class}@2.json").chmod(0o644)
    (store / f"manifests/{NAME}/{report.platform_class}@2.json").write_bytes(
        (store / report.generation_key).read_bytes()
    )
    with pytest.raises(RemoteError) as caught:
        fetch_name(str(store), f"{NAME}@2", cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert caught.value.reason == "remote_incompatible" and "generation 1, not 2" in str(caught.value)


def test_probe_of_a_name_and_of_a_pinned_generation(tmp_path: Path, keys: dict[str, Path]) -> None:
    """probe reads a name's manifest (a model of segments) and a generation's copy with fetch's checks."""
    from packcache.fleet.probe import probe_url

    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    first = publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    second = publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    here = canonical_key(_platform())
    trusted = [keys["ci.pub"].read_bytes()]
    for key, generation in ((second.manifest_key, 2), (first.generation_key, 1), (second.generation_key, 2)):
        report = probe_url(f"file://{store}/{key}", expected_platform=here, trusted_keys=trusted)
        assert (report.verdict.value, report.manifest_generation) == ("compatible", generation), report
    assert second.generation_key is not None and first.generation_key is not None
    (store / second.generation_key).chmod(0o644)
    (store / second.generation_key).write_bytes((store / first.generation_key).read_bytes())
    report = probe_url(f"file://{store}/{second.generation_key}", expected_platform=here, trusted_keys=trusted)
    assert (report.verdict.value, report.remote_reason) == ("refused", "remote_incompatible"), report


def test_the_class_is_found_without_a_scheme_and_a_scheme_given_looks_only_there(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    built = tmp_path / "ci" / "m.pcache"
    arrays = build(built, scheme="bf16")
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name="org/model-bf16", private_key=str(keys["ci"]))
    got = fetch_name(str(store), "org/model-bf16", cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert got.scheme == "bf16"
    mapped(got.path, arrays, scheme="bf16")
    with pytest.raises(RemoteError) as caught:
        fetch_name(str(store), "org/model-bf16", cache_dir=tmp_path / "other", trusted_keys=[keys["ci.pub"]],
                   scheme="int8")  # fmt: skip
    assert caught.value.reason == "remote_absent" and "int8" in str(caught.value) and "bf16" not in str(
        caught.value).split("'org/model-bf16'")[1].split(":")[0]  # fmt: skip
    order = [scheme for scheme, _, _ in candidates()]
    assert [scheme for scheme, _, _ in candidates("auto")] == order
    assert [(scheme, size) for scheme, size, _ in candidates("int4", 64)] == [("int4", 64)]
    assert order[0] == resolve().scheme and sorted(order) == sorted({"int8", "int4", "bf16", "fp32"})


# --------------------------------------------------------------------------- safety (item 6)


@pytest.mark.parametrize("kind", ["directory", "moto"])
def test_a_blob_whose_packed_bytes_were_changed_is_remote_corrupt_and_nothing_is_kept(
    tmp_path: Path, keys: dict[str, Path], kind: str, request: pytest.FixtureRequest
) -> None:
    """The store's blob replaced by a well-formed file of the same size (one value of one pack changed, its
    checksum right, so `packcache verify` passes it): only the signed sha256 tells, and it does."""
    built, forged = tmp_path / "ci" / "m.pcache", tmp_path / "forger" / "m.pcache"
    build(built)
    build(forged, change=True)
    assert forged.stat().st_size == built.stat().st_size and forged.read_bytes() != built.read_bytes()
    assert packcache.verify(str(forged)).ok
    store = _store(tmp_path, kind, request)
    report = publish(built, store, name=NAME, private_key=str(keys["ci"]))
    _put(store, report.blob_key, forged.read_bytes())
    with pytest.raises(RemoteError) as caught:
        fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert caught.value.reason == "remote_corrupt", caught.value
    assert _left(tmp_path / "node") == ["org--model-int8.pcache.lock"]


@pytest.mark.parametrize("kind", ["directory", "moto"])
def test_a_manifest_changed_after_signing_or_signed_by_an_untrusted_key_is_remote_untrusted(
    tmp_path: Path, keys: dict[str, Path], kind: str, request: pytest.FixtureRequest
) -> None:
    built, forged = tmp_path / "ci" / "m.pcache", tmp_path / "forger" / "m.pcache"
    build(built)
    build(forged, change=True)
    store = _store(tmp_path, kind, request)
    report = publish(built, store, name=NAME, private_key=str(keys["ci"]))
    forged_blob = hashlib.sha256(forged.read_bytes()).hexdigest()
    _put(store, f"blobs/sha256/{forged_blob}.pcache", forged.read_bytes())
    envelope = json.loads(_get(store, report.manifest_key))
    envelope["manifest"]["blob_sha256"] = forged_blob  # the signature kept: changed after signing
    _put(store, report.manifest_key, json.dumps(envelope).encode())
    for allow in (False, True):  # a trusted key's signature that fails is refused even with allow_unsigned
        with pytest.raises(RemoteError) as caught:
            fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]], allow_unsigned=allow)
        assert caught.value.reason == "remote_untrusted" and "changed after" in str(caught.value)
    publish(forged, store, name=NAME, private_key=str(keys["other"]))  # a key this node does not trust
    with pytest.raises(RemoteError) as caught:
        fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert caught.value.reason == "remote_untrusted" and "not trusted" in str(caught.value)
    assert _left(tmp_path / "node") == ["org--model-int8.pcache.lock"]


def test_an_unsigned_name_is_refused_unless_allow_unsigned(tmp_path: Path, keys: dict[str, Path]) -> None:
    built = tmp_path / "ci" / "m.pcache"
    arrays = build(built)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name=NAME)
    for trusted in ([], [keys["ci.pub"]]):
        with pytest.raises(RemoteError) as caught:
            fetch_name(str(store), NAME, cache_dir=tmp_path / "node", trusted_keys=trusted)
        assert caught.value.reason == "remote_untrusted", caught.value
    got = fetch_name(str(store), NAME, cache_dir=tmp_path / "node", allow_unsigned=True)
    assert (got.downloaded, got.signed_by) == (True, None)
    mapped(got.path, arrays)


@pytest.mark.parametrize("kind", ["directory", "moto"])
def test_after_accepting_generation_2_a_store_serving_generation_1_is_refused(
    tmp_path: Path, keys: dict[str, Path], kind: str, request: pytest.FixtureRequest
) -> None:
    v1, v2 = tmp_path / "ci" / "v1.pcache", tmp_path / "ci" / "v2.pcache"
    build(v1, seed=1)
    build(v2, seed=2)
    store = _store(tmp_path, kind, request)
    first = publish(v1, store, name=NAME, private_key=str(keys["ci"]))
    replay = _get(store, first.manifest_key)
    publish(v2, store, name=NAME, private_key=str(keys["ci"]))
    got = fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert got.generation == 2
    _put(store, first.manifest_key, replay)
    with pytest.raises(RemoteError) as caught:
        fetch_name(store, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    assert caught.value.reason == "remote_stale" and "rollback" in str(caught.value)
    assert Path(got.path).read_bytes() == v2.read_bytes()


# --------------------------------------------------------------------------- the store away


def test_a_store_that_is_down_serves_the_file_accepted_before(tmp_path: Path, keys: dict[str, Path]) -> None:
    """Down (the directory gone: an unmounted share): the file accepted before for this name, unchanged since, is
    used as it is, and the report says the store was not reached. Anything else is the store's error."""
    built = tmp_path / "ci" / "m.pcache"
    arrays = build(built)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    node, trusted = tmp_path / "node", [keys["ci.pub"]]
    with pytest.raises(RemoteError) as caught:  # nothing accepted yet
        fetch_name(str(tmp_path / "gone"), NAME, cache_dir=node, trusted_keys=trusted)
    assert caught.value.reason == "remote_error"
    got = fetch_name(str(store), NAME, cache_dir=node, trusted_keys=trusted)
    store.rename(tmp_path / "away")
    warm = fetch_name(str(store), NAME, cache_dir=node, trusted_keys=trusted)
    assert (warm.reached, warm.downloaded, warm.path, warm.generation, warm.sha256, warm.bytes) == (
        False, False, got.path, 1, got.sha256, 0)  # fmt: skip
    assert warm.store_error is not None and warm.store_error.startswith("remote_error")
    mapped(warm.path, arrays)
    # Another name, or the file changed since it was accepted: not provably what was accepted.
    with pytest.raises(RemoteError):
        fetch_name(str(store), "org/other", cache_dir=node, trusted_keys=trusted)
    os.utime(got.path)
    with pytest.raises(RemoteError) as caught:
        fetch_name(str(store), NAME, cache_dir=node, trusted_keys=trusted)
    assert caught.value.reason == "remote_error"


def test_a_killed_s3_server_serves_the_file_accepted_before(tmp_path: Path, keys: dict[str, Path]) -> None:
    from harness.s3server import moto_server

    built = tmp_path / "ci" / "m.pcache"
    arrays = build(built)
    with moto_server() as server, server.environment():
        url = f"{server.url}/names"
        publish(built, url, name=NAME, private_key=str(keys["ci"]))
        got = fetch_name(url, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
        server.kill()
        warm = fetch_name(url, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]], timeout=3)
        assert (warm.reached, warm.path, warm.generation) == (False, got.path, 1), warm
        mapped(warm.path, arrays)


# --------------------------------------------------------------------------- the command line


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "XDG_CACHE_HOME": str(home / "xdg"), "HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=300, env=env,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_cli_publish_and_fetch_by_name(tmp_path: Path, keys: dict[str, Path]) -> None:
    built = tmp_path / "ci" / "m.pcache"
    arrays = build(built)
    store = tmp_path / "store"
    store.mkdir()
    done = _cli("publish", str(built), str(store), "--name", NAME, "--sign", str(keys["ci"]), home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "model         org/model-int8" in done.stdout and "fetch --name org/model-int8@1" in done.stdout
    done = _cli("publish", str(built), str(store), "--name", NAME, "--sign", str(keys["ci"]), "--json", home=tmp_path)
    published = json.loads(done.stdout)
    assert (published["model"], published["generation"], published["uploaded"]) == (NAME, 2, False)
    assert published["generation_key"].endswith("@2.json")
    fetch = ["fetch", str(store), "--name", NAME, "--cache-dir", str(tmp_path / "node"), "--trusted-key",
             str(keys["ci.pub"])]  # fmt: skip
    done = _cli(*fetch, home=tmp_path)
    assert done.returncode == 0, done.stderr
    path = str(tmp_path / "node" / "org--model-int8.pcache")
    assert done.stdout.splitlines()[0] == f"fetched       {path}", done.stdout
    assert "generation 2, signed by" in done.stdout and "scheme        int8" in done.stdout
    data = json.loads(_cli(*fetch, "--json", home=tmp_path).stdout)
    assert (data["path"], data["downloaded"], data["reached"], data["name"], data["generation"]) == (
        path, False, True, NAME, 2)  # fmt: skip
    mapped(path, arrays)
    pinned = _cli(*fetch[:3], f"{NAME}@1", *fetch[4:], "--json", home=tmp_path)
    assert json.loads(pinned.stdout)["path"] == str(tmp_path / "node" / "org--model-int8@1.pcache"), pinned.stderr
    # A miss is one line and exit 1; the store away, the accepted file is used (exit 0, said so).
    missing = _cli(*fetch[:3], f"{NAME}@9", *fetch[4:], home=tmp_path)
    assert missing.returncode == 1 and "remote_absent" in missing.stderr and "Traceback" not in missing.stderr
    store.rename(tmp_path / "away")
    offline = _cli(*fetch, home=tmp_path)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.startswith(f"offline       {path}") and "store         not reached (remote_error" in (
        offline.stdout)  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [["fetch", "{store}", "--name", "../etc"], ["fetch", "{store}", "--name", "org/x@0"],
     ["fetch", "{store}", "--name", "a--b"], ["fetch", "{store}", "--name", "org/m", "--cache", "{tmp}/m.pcache"],
     ["publish", "{file}", "{store}", "--name", "../etc"], ["publish", "{file}", "{store}", "--name", "org/m@2"],
     ["publish", "{file}", "{store}", "--name", "org//m"]],
)  # fmt: skip
def test_cli_publish_and_fetch_refuse_a_bad_name_with_exit_2(tmp_path: Path, argv: list[str]) -> None:
    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    done = _cli(*(a.format(store=store, file=built, tmp=tmp_path) for a in argv), home=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert list(store.iterdir()) == [] and not (tmp_path / "xdg" / "packcache").exists()


def test_workers_that_waited_for_the_download_map_it_without_hashing_it(tmp_path: Path, keys: dict[str, Path]) -> None:
    """Four processes fetch the name at once: one downloads (hashing as it streams), the three that waited for the
    build lock find the record the downloader wrote beside the file and hash nothing."""
    built = tmp_path / "ci" / "m.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name=NAME, private_key=str(keys["ci"]))
    code = (
        "import json, sys\n"
        "from packcache.fleet import fetch as f\n"
        "from packcache.fleet.names import fetch_name\n"
        "real = f.hash_file\n"
        "def counting(*a):\n"
        "    print('hashed', file=sys.stderr)\n"
        "    return real(*a)\n"
        "f.hash_file = counting\n"
        f"r = fetch_name({str(store)!r}, {NAME!r}, cache_dir={str(tmp_path / 'node')!r}, "
        f"trusted_keys=[{str(keys['ci.pub'])!r}], timeout=60, total_timeout=120)\n"
        "print(json.dumps(r.to_json()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    results, hashed = [], 0
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
        hashed += err.count("hashed")
    assert sorted(r["downloaded"] for r in results) == [False, False, False, True]
    assert hashed == 0


def test_a_silent_store_costs_the_stall_bound_once_and_serves_the_file_accepted_before(
    tmp_path: Path, keys: dict[str, Path], moto_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bucket behind an endpoint that accepts and never answers: one manifest read times out (not one per
    class tried), and the file accepted from that store before is used (the record is keyed by bucket and prefix)."""
    from harness.tcp import silent_server

    built = tmp_path / "ci" / "m.pcache"
    arrays = build(built)
    url = f"{moto_env.url}/{uuid.uuid4().hex}"
    publish(built, url, name=NAME, private_key=str(keys["ci"]))
    got = fetch_name(url, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]])
    with silent_server() as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        started = time.monotonic()
        with pytest.raises(RemoteError) as caught:  # nothing accepted in this directory: the timeout, once
            fetch_name(url, "org/other", cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]], timeout=1)
        assert caught.value.reason == "remote_timeout" and time.monotonic() - started < 8, caught.value
        warm = fetch_name(url, NAME, cache_dir=tmp_path / "node", trusted_keys=[keys["ci.pub"]], timeout=1)
    assert (warm.reached, warm.path, warm.generation) == (False, got.path, 1), warm
    assert warm.store_error is not None and warm.store_error.startswith("remote_timeout")
    mapped(warm.path, arrays)


# --------------------------------------------------------------------------- what a load by name counts

#: A node loading a published name through ``packcache.hf``, by a directory store and by moto's S3 server, then with
#: the directory store gone (once with the file accepted before, once into an empty directory): every figure a
#: cache's statistics, the options channel, the aggregate, Prometheus and OpenTelemetry show of it.
LOAD_BY_NAME = """
import sys
from packcache import hf
from packcache.errors import RemoteError
from packcache.telemetry import otel, prometheus
from prometheus_client import CollectorRegistry, generate_latest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

directory, bucket, public, node = sys.argv[1:5]
NAME = "org/bert-int8"

def figures(s):
    return {"hits": s.remote_hits, "bytes": s.remote_bytes, "error": s.remote_error,
            "misses": {r: n for r, n in s.remote_misses_by_reason.items() if n}}

result, models = {}, []
for kind, url in (("directory", directory), ("moto", bucket)):
    model = hf.from_pretrained(NAME, remote=url, trusted_keys=[public], cache_dir=os.path.join(node, kind))
    models.append(model)
    result[kind] = {**figures(model.packcache.stats()), "fetched": model.packcache_fetch.bytes,
                    "option": model.packcache.get_option("packed_cache_remote_hits")}
os.rename(directory, directory + ".away")
down = hf.from_pretrained(NAME, remote=directory, trusted_keys=[public], cache_dir=os.path.join(node, "directory"))
result["down"] = {**figures(down.packcache.stats()), "reached": down.packcache_fetch.reached}
try:
    hf.from_pretrained(NAME, remote=directory, trusted_keys=[public], cache_dir=os.path.join(node, "empty"))
except RemoteError as exc:
    result["no_file"] = exc.reason
result["aggregate"] = figures(packcache.aggregate_stats())
result["aggregate_option"] = packcache.get_option("packed_cache_remote_misses")
registry = CollectorRegistry()
prometheus.register(registry)
result["prometheus"] = generate_latest(registry).decode()
reader = InMemoryMetricReader()
otel.register(MeterProvider(metric_readers=[reader]))
points = {m.name: [[dict(p.attributes or {}), p.value] for p in m.data.data_points]
          for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
result["otel"] = {k: v for k, v in points.items() if k.startswith("packcache.remote")}
report(**result)
"""


def test_a_load_by_name_shows_its_fetch_in_stats_and_every_exporter(
    tmp_path: Path, keys: dict[str, Path], moto_env: Any
) -> None:
    """A load by name downloaded its file, yet its cache said ``remote_hits=0``, ``remote_bytes=0`` (and so did the
    aggregate, Prometheus and OpenTelemetry), where a read-through counts the same fetch: the figures of a node whose
    model came over the network said it came from nowhere. Now the cache opened on the fetched file counts the fetch;
    a store down is a counted miss with its reason, in the cache that loads the file accepted before, or (no file)
    in the aggregate."""
    from prometheus_client.parser import text_string_to_metric_families

    from harness.checkpoints import tiny_bert
    from harness.child import run_child
    from packcache import hf

    checkpoint = tiny_bert(tmp_path / "ckpt")
    built = tmp_path / "ci" / "bert.pcache"
    built.parent.mkdir()
    hf.from_pretrained(checkpoint, "int8", built).packcache.close()
    directory = tmp_path / "store"
    directory.mkdir()
    bucket = f"{moto_env.url}/{uuid.uuid4().hex}"
    for store in (str(directory), bucket):
        publish(built, store, name="org/bert-int8", private_key=str(keys["ci"]), sources=[str(checkpoint)])
    got = run_child(LOAD_BY_NAME, str(directory), bucket, str(keys["ci.pub"]), str(tmp_path / "node"))
    size = built.stat().st_size
    for kind in ("directory", "moto"):
        loaded = got[kind]
        assert (loaded["hits"], loaded["misses"], loaded["option"]) == (1, {}, 1), (kind, loaded)
        assert loaded["bytes"] == loaded["fetched"] > size, (kind, loaded)
    down = got["down"]
    assert (down["reached"], down["hits"], down["bytes"], down["misses"]) == (False, 0, 0, {"remote_error": 1}), down
    assert "ENOENT" in down["error"], down
    assert any(level == "WARNING" and "accepted from that store before" in text for level, text in got["records"])
    assert got["no_file"] == "remote_error"
    fetched = got["directory"]["fetched"] + got["moto"]["fetched"]
    aggregate = got["aggregate"]
    assert (aggregate["hits"], aggregate["bytes"], aggregate["misses"]) == (2, fetched, {"remote_error": 2}), aggregate
    assert got["aggregate_option"]["remote_error"] == 2
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(got["prometheus"])
        for s in family.samples
    }
    assert samples[("packcache_remote_hits", ())] == 2
    assert samples[("packcache_remote_bytes", ())] == fetched
    assert samples[("packcache_remote_misses", (("reason", "remote_error"),))] == 2
    otel = got["otel"]
    assert otel["packcache.remote_hits"] == [[{}, 2]] and otel["packcache.remote_bytes"] == [[{}, fetched]]
    assert [{"reason": "remote_error"}, 2] in otel["packcache.remote_misses"], otel


def test_every_serve_worker_shows_the_fetch_its_master_made_by_name(
    tmp_path: Path, keys: dict[str, Path], base: Path
) -> None:
    """``serve --model NAME --remote``: the master fetches once, the workers map the file. Their ``/metrics`` said
    ``packcache_remote_hits 0`` and their ready line ``source mapped``: a fleet's dashboards could not tell a node
    that got its model over the network. Each worker, forked after the fetch, counts it in its own cache."""
    from harness.serve import loaded_workers, server
    from packcache.models import minilm

    built = tmp_path / "ci" / "bert.pcache"
    built.parent.mkdir()
    minilm.load("int8", cache=built, model_path=base).close()
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), name="org/bert-int8", private_key=str(keys["ci"]), sources=[str(base)])
    args = ("--model", "org/bert-int8", "--remote", str(store), "--trusted-key", str(keys["ci.pub"]), "--cache-dir",
            str(tmp_path / "node"))  # fmt: skip
    with server(tmp_path / "srv", *args, workers=2) as srv:
        workers = loaded_workers(srv, 2, timeout=240).workers
    for w in workers.values():
        assert w.current_state == "mapped" and w.values["remote_hits"] == 1, w
        assert w.values["remote_bytes"] > built.stat().st_size, w
    assert (tmp_path / "srv" / "server.err").read_text().count("source remote") == 2
