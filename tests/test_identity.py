"""Source identity by content: keys and default file names name what a checkpoint *is*.

Real files and real processes: each launch below is a fresh interpreter (``launch``) loading the
MiniLM loader on a tiny random BERT checkpoint; it reports what it served, whether that equals a
fresh heap pack of the file as it is now (never stale), and which files it had to hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import packcache
from harness import require_root, run_child, without_build_compaction
from harness.checkpoints import tiny_bert
from packcache import hf, identity
from packcache.cli import main
from packcache.models import minilm
from packcache.safetensors import SafetensorsFile, TensorMeta
from packcache.torch import convert

TEXTS = ["a sentence about packed weights", "another, longer sentence about where the bytes of a model live"]
NOBODY = 65534

LAUNCH = r"""
import hashlib, json, os, sys
from packcache import identity
from packcache.models import minilm

checkpoint, cache, scheme = sys.argv[1], sys.argv[2], sys.argv[3]
hashed = []
real_hash = identity.hash_file

def counting(fd, path, st):
    if path.endswith(".safetensors"):  # the weights; the small files a cache file embeds are hashed once too
        hashed.append(os.path.basename(path))
    return real_hash(fd, path, st)

identity.hash_file = counting
texts = json.loads(sys.argv[4])
if len(sys.argv) > 5:  # a test stretches the racy window so that "young" cannot depend on how fast this child starts
    identity.RACY_SECONDS = float(sys.argv[5])
if not cache.endswith(".pcache"):
    cache = str(minilm.default_cache_path(scheme, model_path=checkpoint, cache_dir=cache))
model = minilm.load(scheme, cache=cache, model_path=checkpoint)
got = model.embed(texts)
s = model.cache.stats()
model.close()
found = list(hashed)
fresh = minilm.load(scheme, cache=False, model_path=checkpoint).embed(texts)
report(cache=cache, state=s.state, stored=s.stored, hits=s.hits, heap=s.heap_bytes, hashed=found,
       same_as_fresh=got.tobytes() == fresh.tobytes(), embedding=hashlib.sha256(got.tobytes()).hexdigest(),
       file_bytes=s.file_bytes, reclaimable=s.reclaimable_bytes)
"""


def launch(checkpoint: Path, cache: Path, scheme: str = "int8", racy: float | None = None) -> dict[str, Any]:
    """One launch in a fresh process: ``minilm.load`` of ``checkpoint`` through ``cache`` (a file, or a directory
    for the default name), then the same load with caching off, for comparison. ``racy``: the child's
    ``identity.RACY_SECONDS``."""
    extra = [] if racy is None else [str(racy)]
    return run_child(LAUNCH, str(checkpoint), str(cache), scheme, json.dumps(TEXTS), *extra, timeout=120)


def wait_settled(*paths: Path) -> None:
    """Sleep until every file's last change is older than the racy window: a digest may then be recorded."""
    newest = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in paths)
    remaining = newest / 1e9 + identity.RACY_SECONDS + 0.05 - time.time()
    if remaining > 0:
        time.sleep(remaining)


def records(directory: Path, of: Path | None = None) -> list[dict[str, Any]]:
    """The digest cache's records (``of``: those of that file only, by inode; a load also records the small files
    a cache file embeds: config, tokenizer)."""
    found = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    return found if of is None else [r for r in found if r["ino"] == of.stat().st_ino]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of one shape with other weights (``a``, ``b``), settled past the racy window."""
    base = tmp_path_factory.mktemp("models")
    made = {"a": tiny_bert(base / "a", seed=1), "b": tiny_bert(base / "b", seed=2)}
    wait_settled(*(p / "model.safetensors" for p in made.values()))
    return made


@pytest.fixture
def digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own digest cache (child processes inherit it), and an empty memo in this process."""
    directory = tmp_path / "digests"
    monkeypatch.setenv("PACKCACHE_DIGEST_DIR", str(directory))
    monkeypatch.setattr(identity, "_MEMO", {})
    return directory


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, copy_function=shutil.copy2)  # cp -p: mtimes kept
    return target


def overwrite_in_place(target: Path, source: Path) -> None:
    """Write ``source``'s bytes into ``target`` in place (same inode, same size), then restore ``target``'s mtime
    (``touch -r``, ``cp -p``, ``rsync -t`` all do this)."""
    before = target.stat()
    data = source.read_bytes()
    assert len(data) == before.st_size
    with open(target, "r+b") as f:
        f.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


# ----------------------------------------------------------------------------- a changed checkpoint is never stale


def test_an_in_place_same_size_edit_with_mtime_restored_is_repacked_never_stale(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    model = copy_model(models["a"], tmp_path / "model")
    weights = model / "model.safetensors"
    wait_settled(weights)
    first = launch(model, tmp_path / "cache")
    assert first["state"] == "stored" and first["same_as_fresh"] and first["hashed"] == ["model.safetensors"]
    (recorded,) = [r for r in records(digests) if r["ino"] == weights.stat().st_ino]
    assert recorded["sha256"] == sha256_of(weights)  # hashed once and recorded: the next launch reads no byte
    warm = launch(model, tmp_path / "cache")
    assert (warm["state"], warm["hashed"], warm["embedding"]) == ("mapped", [], first["embedding"])

    overwrite_in_place(weights, models["b"] / "model.safetensors")
    wait_settled(weights)  # past the racy window: only ctime tells the versions apart now
    edited = launch(model, tmp_path / "cache")
    assert edited["cache"] != first["cache"], "other content, another default file"
    assert edited["state"] == "stored" and edited["same_as_fresh"] and edited["hashed"] == ["model.safetensors"]
    assert edited["embedding"] != first["embedding"]
    # Even through the first file (an explicit path): the old packs are never served for the new bytes.
    explicit = launch(model, Path(first["cache"]))
    assert explicit["state"] == "stored" and explicit["same_as_fresh"] and explicit["embedding"] == edited["embedding"]


def test_a_tar_extracted_with_its_old_mtime_then_moved_over_is_repacked(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    model = copy_model(models["a"], tmp_path / "model")
    weights = model / "model.safetensors"
    first = launch(model, tmp_path / "c.pcache")
    assert first["state"] == "stored"
    archive = tmp_path / "release.tar"
    with tarfile.open(archive, "w") as tar:  # other weights, stamped with the old file's mtime
        info = tar.gettarinfo(models["b"] / "model.safetensors", arcname="model.safetensors")
        info.mtime = weights.stat().st_mtime
        with open(models["b"] / "model.safetensors", "rb") as f:
            tar.addfile(info, f)
    staging = tmp_path / "staging"
    staging.mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(staging)], check=True)
    assert int((staging / "model.safetensors").stat().st_mtime) == int(weights.stat().st_mtime)
    subprocess.run(["mv", str(staging / "model.safetensors"), str(weights)], check=True)
    moved = launch(model, tmp_path / "c.pcache")
    assert moved["state"] == "stored" and moved["same_as_fresh"] and moved["embedding"] != first["embedding"]
    again = launch(model, tmp_path / "c.pcache")
    assert again["state"] == "mapped" and again["embedding"] == moved["embedding"]


# ----------------------------------------------------------------------------- the same bytes anywhere are a hit


@pytest.mark.root
def test_a_cp_p_copy_by_another_user_at_another_path_is_a_full_hit(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    require_root()
    cache = tmp_path / "cache"
    built = launch(models["a"], cache)
    assert built["state"] in ("stored", "mapped")
    shared = Path(tempfile.mkdtemp(prefix="packcache-shared-"))
    try:
        source = copy_model(models["a"], shared / "source")
        target = shared / "theirs"
        target.mkdir()
        os.chown(target, NOBODY, NOBODY)
        for path in (shared, *source.rglob("*"), source):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        subprocess.run(["runuser", "-u", "nobody", "--", "cp", "-rp", str(source), str(target / "copy")], check=True)
        copy = target / "copy"
        assert (copy / "model.safetensors").stat().st_uid == NOBODY
        hit = launch(copy, cache)
        # Another inode, another owner, another path: the copy is hashed (it is younger than the racy window, so
        # once for its file name and once by the load), then every pack is a hit in the same file.
        assert (hit["cache"], hit["state"], hit["stored"], hit["heap"]) == (built["cache"], "mapped", 0, 0)
        assert set(hit["hashed"]) == {"model.safetensors"} and hit["embedding"] == built["embedding"]
        parser_names = {
            _cli_cache_file(["run", "--model", str(models["a"]), "--cache-dir", str(cache)]),
            _cli_cache_file(["serve", "--model", str(copy), "--cache-dir", str(cache)]),
            str(hf.default_cache_path(copy, "int8", cache_dir=cache)),
        }
        assert parser_names == {built["cache"]}
    finally:
        shutil.rmtree(shared)


def _cli_cache_file(argv: list[str]) -> str:
    from packcache.cli import build_parser
    from packcache.cli._model import cache_file as _cache_file

    path = _cache_file(build_parser().parse_args(argv), "int8")
    assert path is not None
    return path


def test_build_and_run_prebuild_each_other_where_they_pack_alike_and_never_share_a_recipe(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], digests: Path
) -> None:
    """int8 packs alike in ``packcache.hf`` and the MiniLM loader: ``build`` prebuilds ``run --model``. int4 is
    calibrated in one and not the other: ``build --loader hf``'s file and run's are two files, each converging,
    never replacing the other's packs; and ``build`` by its default rule (or ``--loader minilm``) prebuilds the
    calibrated one."""
    model = str(models["a"])

    def cli(*argv: str) -> dict[str, Any]:
        assert main([*argv, "--json"]) == 0
        result: dict[str, Any] = json.loads(capsys.readouterr().out)
        return result

    built = cli("build", model, "--scheme", "int8", "--cache-dir", str(tmp_path / "c8"))
    ran = cli("run", "--model", model, "--scheme", "int8", "--cache-dir", str(tmp_path / "c8"))
    assert ran["cache_file"] == built["cache_file"]
    assert (ran["stats"]["state"], ran["stats"]["stored"]) == ("mapped", 0)

    rounds = []
    for _ in range(2):
        rounds.append(
            (
                cli("build", model, "--loader", "hf", "--scheme", "int4", "--cache-dir", str(tmp_path / "c4")),
                cli("run", "--model", model, "--scheme", "int4", "--cache-dir", str(tmp_path / "c4")),
            )
        )
    (build1, run1), (build2, run2) = rounds
    assert build1["cache_file"] != run1["cache_file"], "two int4 recipes, two files"
    assert build1["stats"]["state"] == run1["stats"]["state"] == "stored"
    assert (build2["stats"]["state"], build2["stats"]["stored"]) == ("mapped", 0)
    assert (run2["stats"]["state"], run2["stats"]["stored"]) == ("mapped", 0)
    for report in (build2, run2):
        assert report["stats"]["reclaimable_bytes"] == 0

    prebuilt = cli("build", model, "--loader", "minilm", "--scheme", "int4", "--cache-dir", str(tmp_path / "p4"))
    served = cli("run", "--model", model, "--scheme", "int4", "--cache-dir", str(tmp_path / "p4"))
    assert prebuilt["loader"] == "minilm" and prebuilt["stats"]["state"] == "stored"
    assert served["cache_file"] == prebuilt["cache_file"]
    assert (served["stats"]["state"], served["stats"]["stored"]) == ("mapped", 0)
    assert Path(served["cache_file"]).name == Path(run1["cache_file"]).name
    other_groups = minilm.default_cache_path("int4", model_path=model, group_size=64)
    assert other_groups.name != Path(run1["cache_file"]).name, "another group size, another file"


# ----------------------------------------------------------------------------- growth is bounded


def test_ten_alternations_of_two_checkpoints_on_one_file_stay_under_twice_the_live_bytes(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    path = tmp_path / "shared.pcache"
    fresh = {name: minilm.load("int8", cache=False, model_path=models[name]).embed(TEXTS) for name in ("a", "b")}
    sizes = []
    for launch_number in range(10):
        name = "ab"[launch_number % 2]
        with minilm.load("int8", cache=path, model_path=models[name]) as model:
            assert model.embed(TEXTS).tobytes() == fresh[name].tobytes(), launch_number
            stats = model.cache.stats()
        report = packcache.inspect(path)
        sizes.append(path.stat().st_size)
        # Every launch repacks (the file holds the other model's packs under the same names) and then compacts.
        assert stats.state == "stored" and stats.reclaimable_bytes == report.reclaimable_bytes, launch_number
        assert path.stat().st_size <= 2 * report.live_bytes, (launch_number, sizes, report.live_bytes)
    assert packcache.verify(path).ok
    # The file does not grow: a build compacts once superseded bytes outweigh the live ones. The tokenizer and
    # config this tiny model's file holds are live bytes that both checkpoints share, so it compacts every other
    # launch, between the same two sizes.
    assert max(sizes[-4:]) <= max(sizes[:4]), sizes


def test_keys_of_the_previous_release_are_repacked_once_then_mapped(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    """A file built when keys named the source by name, size, mtime and inode: one repack, then hits, and the
    superseded old packs do not stay (the repacking build compacts)."""
    path = tmp_path / "old.pcache"
    weights = models["a"] / "model.safetensors"
    st = weights.stat()
    old_identity = f"model.safetensors:size={st.st_size}:mtime_ns={st.st_mtime_ns}:ino={st.st_ino}"

    class PreviousRelease:
        def __init__(self) -> None:
            self.file = SafetensorsFile(weights)

        def meta(self, name: str) -> TensorMeta:
            meta = self.file.meta(name)
            return TensorMeta(meta.name, meta.shape, meta.dtype, old_identity)

        def read(self, name: str) -> np.ndarray[Any, Any]:
            return self.file.read(name)

    config = minilm.BertConfig.from_file(models["a"] / "config.json")
    from packcache.loader import resolve

    recipe = resolve("int8", 32)
    with torch.device("meta"):
        skeleton = minilm.BertEncoder(config)
    with without_build_compaction(), packcache.WeightCache(path, platform=minilm.platform("int8")) as cache:
        convert(
            skeleton, cache, recipe.linear, source=PreviousRelease(), other=recipe.other, embedding=recipe.embedding
        )
        assert cache.stats().stored > 0
    states = []
    for _ in range(3):
        with minilm.load("int8", cache=path, model_path=models["a"]) as model:
            states.append((model.cache.stats().state, model.cache.stats().stored, model.cache.stats().hits))
    packs = states[0][1]
    assert states == [("stored", packs, 0), ("mapped", 0, packs), ("mapped", 0, packs)]
    report = packcache.inspect(path)
    # The old packs are superseded once and never again (the hits above); they are reclaimed by a build as soon as
    # they outweigh the live bytes, which here include the embedded tokenizer and config.
    assert report.reclaimable_bytes <= report.live_bytes and len(report.entries) == packs
    assert packcache.compact(path).reclaimed_bytes == report.reclaimable_bytes
    assert packcache.inspect(path).reclaimable_bytes == 0


# ----------------------------------------------------------------------------- never hash on a warm launch


def test_an_edit_within_the_racy_window_is_never_recorded_and_is_repacked(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    """A file changed less than RACY_SECONDS ago may be changed again within the same timestamp tick, keeping
    its stat: its digest is neither recorded nor looked up until it settles. The first two launches stretch the
    window to an hour, so the file is young for them however long a busy machine takes to start a process."""
    model = copy_model(models["a"], tmp_path / "model")
    weights = model / "model.safetensors"
    young = launch(model, tmp_path / "c.pcache", racy=3600)
    assert young["state"] == "stored" and young["hashed"] == ["model.safetensors"]
    assert records(digests, weights) == [], "a young file's digest is not recorded"
    overwrite_in_place(weights, models["b"] / "model.safetensors")  # within the window, mtime restored
    edited = launch(model, tmp_path / "c.pcache", racy=3600)
    assert edited["hashed"] == ["model.safetensors"] and records(digests, weights) == []
    assert edited["state"] == "stored" and edited["same_as_fresh"] and edited["embedding"] != young["embedding"]
    wait_settled(weights)
    settled = launch(model, tmp_path / "c.pcache")
    assert (settled["state"], settled["hashed"]) == ("mapped", ["model.safetensors"])
    assert [r["sha256"] for r in records(digests, weights)] == [sha256_of(weights)]
    warm = launch(model, tmp_path / "c.pcache")
    assert (warm["state"], warm["hashed"], warm["embedding"]) == ("mapped", [], edited["embedding"])


@pytest.mark.parametrize("filesystem", [0x6969, 0x65735546, 0xFF534D42, None])  # NFS, FUSE, SMB, unknown
def test_a_filesystem_whose_stat_may_lie_is_hashed_on_every_launch(
    models: dict[str, Path], digests: Path, monkeypatch: pytest.MonkeyPatch, filesystem: int | None
) -> None:
    weights = models["a"] / "model.safetensors"
    assert identity.digest_path(weights).how == "hashed"
    assert identity.digest_path(weights).how in ("memo", "digest-cache"), "a reliable filesystem: found, not read"
    monkeypatch.setattr(identity, "_statfs_type", lambda fd: filesystem)  # only the statfs answer is pretended
    monkeypatch.setattr(identity, "_MEMO", {})
    for _ in range(2):
        found = identity.digest_path(weights)
        assert (found.how, found.sha256) == ("hashed", sha256_of(weights))
    assert len(records(digests)) == 1, "nothing recorded from the pretended filesystem"


def test_a_hub_blob_is_named_by_its_file_name_and_a_git_blob_name_is_hashed(
    models: dict[str, Path], tmp_path: Path, digests: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = (models["a"] / "model.safetensors").read_bytes()
    content = hashlib.sha256(data).hexdigest()
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / content).write_bytes(data)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / content)
    real_hash = identity.hash_file

    def no_hashing(fd: int, path: str, st: os.stat_result) -> str:
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(identity, "hash_file", no_hashing)
    found = SafetensorsFile(snapshot / "model.safetensors").digest
    assert (found.how, found.sha256, found.size) == ("hub-blob", content, len(data))
    sha1_named = repo / "blobs" / ("1" * 40)  # a git blob's sha1: not a content digest
    sha1_named.write_bytes(data)
    monkeypatch.setattr(identity, "hash_file", real_hash)
    assert identity.digest_path(sha1_named).how == "hashed"


@pytest.mark.root
def test_another_users_blob_named_like_the_real_model_is_hashed_never_packed_as_it(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    """``nobody`` lays out a hub cache whose blob is named by the genuine model's sha256 and holds other weights of
    the same size. Believed by its name, it was packed under the genuine model's identity, and the genuine model then
    loaded ``mapped`` with those weights. Another user's blob is hashed: it gets its own identity."""
    require_root()
    genuine, other = models["a"] / "model.safetensors", models["b"] / "model.safetensors"
    assert genuine.stat().st_size == other.stat().st_size
    content = sha256_of(genuine)
    shared = Path(tempfile.mkdtemp(prefix="packcache-shared-"))
    try:
        os.chmod(shared, 0o1777)  # a shared scratch directory, like /tmp
        staging = shared / "staging"
        shutil.copytree(models["b"], staging)
        for path in (staging, *staging.iterdir()):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        repo = shared / "hub" / "models--org--tiny"
        snapshot = repo / "snapshots" / ("0" * 40)
        script = (
            f"mkdir -p {repo}/blobs {snapshot} && cp {staging}/model.safetensors {repo}/blobs/{content} && "
            f"cp {staging}/*.json {snapshot}/ && ln -s ../../blobs/{content} {snapshot}/model.safetensors"
        )
        subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", script], check=True)
        assert (repo / "blobs" / content).stat().st_uid == NOBODY
        wait_settled(repo / "blobs" / content)
        planted = launch(snapshot, tmp_path / "cache")
        real = launch(models["a"], tmp_path / "cache")
        assert real["same_as_fresh"], f"the genuine model was served the planted file's weights: {real}"
        assert planted["hashed"] == ["model.safetensors"], "another user's blob name was believed"
        assert real["cache"] != planted["cache"] and real["embedding"] != planted["embedding"]
    finally:
        shutil.rmtree(shared)


# ----------------------------------------------------------------------------- a hostile digest cache


def _plant(kind: str, digests: Path, weights: Path, lie: str) -> None:
    """Put a hostile record (or directory) where the digest of ``weights`` would be looked up."""
    st = weights.stat()
    name = f"{st.st_dev:x}-{st.st_ino:x}.json"
    exact = {"format": "packcache-digest/1", "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sha256": lie}  # fmt: skip
    digests.mkdir(mode=0o700, exist_ok=True)
    record = digests / name
    if kind == "fifo":
        os.mkfifo(record, 0o600)
    elif kind == "corrupt":
        record.write_bytes(b'{"format": "packcache-digest/1", "sha256": [' + b"[" * 500)
        os.chmod(record, 0o600)
    elif kind == "oversized":
        record.write_text(json.dumps({**exact, "padding": "x" * 10_000}))
        os.chmod(record, 0o600)
    elif kind == "stale":  # a record of the file before its last change: the ctime differs
        record.write_text(json.dumps({**exact, "ctime_ns": st.st_ctime_ns - 1}))
        os.chmod(record, 0o600)
    elif kind == "other-owner":
        record.write_text(json.dumps(exact))
        os.chown(record, NOBODY, NOBODY)
    elif kind == "writable":
        record.write_text(json.dumps(exact))
        os.chmod(record, 0o666)
    elif kind == "symlink":
        elsewhere = digests.parent / "elsewhere.json"
        elsewhere.write_text(json.dumps(exact))
        os.chmod(elsewhere, 0o600)
        record.symlink_to(elsewhere)
    elif kind in ("open-directory", "foreign-directory"):
        record.write_text(json.dumps(exact))
        if kind == "open-directory":
            os.chmod(digests, 0o777)
        else:
            os.chown(digests, NOBODY, NOBODY)
    else:
        raise AssertionError(kind)


HOSTILE = ["fifo", "corrupt", "oversized", "stale", "other-owner", "writable", "symlink", "open-directory",
           "foreign-directory"]  # fmt: skip


@pytest.fixture(scope="module")
def poisoned(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A cache file holding model ``b``'s packs, and the digest of ``b``: what a lying record would point ``a`` at."""
    base = tmp_path_factory.mktemp("poisoned")
    path = base / "shared.pcache"
    with minilm.load("int8", cache=path, model_path=models["b"]) as model:
        assert model.cache.stats().state == "stored"
    return {"cache": path, "lie": sha256_of(models["b"] / "model.safetensors")}


@pytest.mark.root
@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_digest_cache_costs_a_rehash_never_wrong_bytes(
    models: dict[str, Path], poisoned: dict[str, Any], tmp_path: Path, digests: Path, kind: str
) -> None:
    """Each record claims that ``a`` has ``b``'s digest, whose packs are in the file: believed, it would serve
    ``b``'s weights for ``a``. None is believed: ``a`` is hashed, packed and served as ``a``."""
    require_root()
    cache = tmp_path / "shared.pcache"
    shutil.copy2(poisoned["cache"], cache)
    weights = models["a"] / "model.safetensors"
    _plant(kind, digests, weights, poisoned["lie"])
    started = time.monotonic()
    result = launch(models["a"], cache)
    assert time.monotonic() - started < 60, "never blocked on the record"
    assert result["hashed"] == ["model.safetensors"], result
    assert result["same_as_fresh"] and result["state"] == "stored" and result["heap"] == 0, result


def test_records_are_private_to_this_user_and_found_on_the_next_launch(models: dict[str, Path], digests: Path) -> None:
    """What is trusted (docs/RELIABILITY.md "Content identity"): a record this user wrote, in a directory only this
    user can write, naming the file's exact (device, inode, size, mtime, ctime)."""
    weights = models["a"] / "model.safetensors"
    truth = identity.digest_path(weights)
    (record,) = digests.glob("*.json")
    assert stat.S_IMODE(digests.stat().st_mode) == 0o700 and stat.S_IMODE(record.stat().st_mode) == 0o600
    st = weights.stat()
    assert json.loads(record.read_text()) == {
        "format": "packcache-digest/1", "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
        "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sha256": truth.sha256,
    }  # fmt: skip
    identity._MEMO.clear()
    assert identity.digest_path(weights).how == "digest-cache"


def test_an_unusable_digest_directory_is_said_once_and_only_costs_hashing(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PACKCACHE_DIGEST_DIR", str(blocker / "digests"))  # ENOTDIR: can never be created
    monkeypatch.setattr(identity, "_MEMO", {})
    monkeypatch.setattr(identity, "_NOTICES", set())
    weights = models["a"] / "model.safetensors"
    for _ in range(3):
        identity._MEMO.clear()
        assert identity.digest_path(weights).sha256 == sha256_of(weights)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "digest cache" in r.getMessage()]
    assert len(warnings) == 1 and "PACKCACHE_DIGEST_DIR" in warnings[0] and "ENOTDIR" in warnings[0], warnings


def test_a_file_changed_after_it_was_opened_is_refused_not_named_by_its_old_digest(
    models: dict[str, Path], tmp_path: Path, digests: Path
) -> None:
    weights = copy_model(models["a"], tmp_path / "model") / "model.safetensors"
    source = SafetensorsFile(weights)  # header read; digest not yet found
    overwrite_in_place(weights, models["b"] / "model.safetensors")
    with pytest.raises(packcache.FormatError, match="changed since"):
        source.meta("embeddings.word_embeddings.weight")
    assert SafetensorsFile(weights).identity == f"sha256:{sha256_of(weights)}:{weights.stat().st_size}"


def test_records_are_written_by_temp_and_rename_and_stay_bounded(
    models: dict[str, Path], digests: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity, "_MAX_RECORDS", 4)
    weights = models["a"] / "model.safetensors"
    digests.mkdir(mode=0o700)
    dead = digests / ".tmp-999999999-0123456789abcdef"  # a writer that died mid-record
    dead.write_text("{")
    for i in range(6):
        (digests / f"{i:x}-{i:x}.json").write_text("{}")
        os.utime(digests / f"{i:x}-{i:x}.json", ns=(i * 10**9, i * 10**9))
    identity.digest_path(weights)
    names = sorted(p.name for p in digests.iterdir())
    mine = f"{weights.stat().st_dev:x}-{weights.stat().st_ino:x}.json"
    assert not dead.exists() and len(names) <= 4 and mine in names, names
    assert not [n for n in names if n.startswith(".tmp-")]


@pytest.mark.root
def test_a_full_digest_directory_costs_only_hashing(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No inode left for a record (ENOSPC): the digest is still right, nothing is left behind, a load goes on."""
    from harness import tmpfs

    require_root()
    with tmpfs(tmp_path / "full", "64k,nr_inodes=2") as full:  # the root and the digest directory: nothing more
        (full / "digests").mkdir(mode=0o700)
        monkeypatch.setenv("PACKCACHE_DIGEST_DIR", str(full / "digests"))
        code = (
            "import os\nfrom packcache import identity\n"
            "d = identity.digest_path(os.environ['WEIGHTS'])\n"
            "report(how=d.how, sha=d.sha256, left=sorted(os.listdir(os.environ['PACKCACHE_DIGEST_DIR'])))\n"
        )
        monkeypatch.setenv("WEIGHTS", str(models["a"] / "model.safetensors"))
        result = run_child(code)
    expected = sha256_of(models["a"] / "model.safetensors")
    assert (result["how"], result["sha"], result["left"]) == ("hashed", expected, [])
    warned = [m for level, m in result["records"] if level == "WARNING" and "digest cache" in m]
    assert len(warned) == 1 and "cannot write a record: ENOSPC" in warned[0], result["records"]


def test_file_digest_refuses_a_stat_that_is_no_longer_the_files(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc")
    fd = os.open(path, os.O_RDONLY)
    try:
        before = os.fstat(fd)
        with open(path, "ab") as f:
            f.write(b"d")
        with pytest.raises(packcache.FormatError, match="changed since it was opened"):
            identity.file_digest(fd, str(path), before)
    finally:
        os.close(fd)
