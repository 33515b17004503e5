"""The fleet's local files, trusted by one rule: the trusted public keys, the private signing key and
the file ``fetch`` renames into place pass the cache file's owner/mode rule, and a symlink on their way is
followed only if no other user can have planted or re-pointed it (``packcache._paths.entry_problem``); a
fetch killed mid-download leaves a temp file the next fetch of that file removes.

Real users (``nobody`` plants the key file, the symlink, the file at the target, with ``runuser``), real
processes (a fetch child killed with SIGKILL while a loopback HTTP server is sending it the blob).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import require_root
from harness.httpstore import faulty_store
from harness.keys import make_keys
from packcache.errors import RemoteError, UntrustedFileError
from packcache.fleet import fetch as fleet_fetch
from packcache.fleet.manifest import load_private_key
from packcache.fleet.publish import publish
from packcache.format import canonical_key

SRC = Path(packcache.__file__).resolve().parents[1]
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}
RECIPE = {"packer": "test.f32", "version": 1}
NOBODY = 65534

pytestmark = pytest.mark.root


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a new machine user: its own accepted-generation records."""
    require_root()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two key pairs in a private directory: ``ci`` (the fleet's) and ``other`` (an attacker's)."""
    return make_keys(tmp_path_factory.mktemp("keys"), "ci", "other")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory ``nobody`` can reach (pytest's own are root's 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="packcache-trust-"))
    os.chmod(directory, 0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def as_nobody(script: str) -> None:
    """Run a shell ``script`` as the real user ``nobody``."""
    subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", script], check=True, capture_output=True)


def build(path: Path, seed: int = 0, count: int = 4, side: int = 64) -> dict[str, np.ndarray]:
    """A core cache file of ``count`` packs; returns what it holds."""
    rng = np.random.default_rng(seed)
    arrays = {f"layer{i}": rng.standard_normal((side, side)).astype(np.float32) for i in range(count)}
    with packcache.WeightCache(path, platform=PLATFORM) as cache, cache.session() as s:
        for name, array in arrays.items():
            s.get_or_pack(name, lambda a=array: a, RECIPE)
    return arrays


def load(path: Path, arrays: dict[str, np.ndarray], **remote: Any) -> packcache.CacheStats:
    """Load ``arrays`` through a cache at ``path`` (with ``remote=`` arguments); every byte checked."""
    with packcache.WeightCache(path, platform=PLATFORM, **remote) as cache:
        with cache.session() as s:
            for name, array in arrays.items():
                got = s.get_or_pack(name, lambda a=array: a, RECIPE)
                assert np.array_equal(got, array), f"{name}: not the genuine weights"
        return cache.stats()


def _fetch(store: str, path: Path, key: Path, timeout: float = 30) -> fleet_fetch.FetchReport:
    return fleet_fetch.fetch(
        store, path, platform=canonical_key(PLATFORM), trusted_keys=[key.read_bytes()], timeout=timeout
    )


def _published(tmp_path: Path, keys: dict[str, Path], **build_options: Any) -> tuple[str, Path]:
    built = tmp_path / "a" / "model-x.pcache"
    build(built, **build_options)
    store = tmp_path / "store"
    store.mkdir()
    publish(built, str(store), private_key=str(keys["ci"]))
    return str(store), built


def _victim(tmp_path: Path) -> tuple[Path, os.stat_result]:
    """Root's private 0600 file, in a 0700 directory."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = private / "secret"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o600)
    return victim, os.lstat(victim)


def _kept(victim: Path, before: os.stat_result) -> None:
    after = os.lstat(victim)
    assert (after.st_ino, after.st_mtime_ns, victim.read_bytes()) == (before.st_ino, before.st_mtime_ns, b"precious")
    assert [p.name for p in victim.parent.iterdir()] == [victim.name], "nothing made beside it (no lock, no temp)"


# --------------------------------------------------------------------------- trusted and signing key files


@pytest.mark.parametrize("plant", ["nobodys-file", "world-writable-file", "nobodys-symlink"])
def test_a_key_file_another_user_owns_can_write_or_planted_is_refused(
    tmp_path: Path, keys: dict[str, Path], shared: Path, plant: str
) -> None:
    """The machine trusts ``<keys>/ci.pub.pem``. ``nobody`` makes that name hold their key (their own file in the
    sticky key directory; their write into a file others can write; their symlink to another root-owned key) and
    puts their weights, signed with their key, in the store: those were served. The key file is refused."""
    genuine = build(tmp_path / "genuine.pcache", seed=0)
    theirs = tmp_path / "t" / "model-x.pcache"
    build(theirs, seed=7)  # the same pack names and shapes, other weights
    store = tmp_path / "store"
    store.mkdir()
    publish(theirs, str(store), private_key=str(keys["other"]))
    directory = shared / "keys"
    directory.mkdir()
    trusted = directory / "ci.pub.pem"
    staged = shared / "theirs.pub.pem"
    shutil.copy(keys["other.pub"], staged)
    os.chmod(staged, 0o644)
    if plant == "nobodys-file":
        os.chmod(directory, 0o1777)
        as_nobody(f"cp {staged} {trusted}")
    elif plant == "world-writable-file":
        shutil.copy(keys["ci.pub"], trusted)
        os.chmod(trusted, 0o666)  # a careless mode
        as_nobody(f"cat {staged} > {trusted}")
    else:
        os.chmod(directory, 0o1777)
        as_nobody(f"ln -s {keys['other.pub']} {trusted}")  # root's key of another project
    stats = load(tmp_path / "b" / "model-x.pcache", genuine, remote=str(store), trusted_keys=[str(trusted)])
    assert (stats.remote_hits, stats.stored) == (0, len(genuine)), stats
    assert stats.remote_misses_by_reason["remote_untrusted"] == 1, stats.remote_misses_by_reason
    assert "untrusted public key" in stats.remote_error, stats.remote_error


@pytest.mark.parametrize("flaw", ["readable-by-others", "nobodys-file"])
def test_a_private_key_others_can_read_or_own_is_refused_and_nothing_is_published(
    tmp_path: Path, keys: dict[str, Path], shared: Path, flaw: str
) -> None:
    built = tmp_path / "a" / "model-x.pcache"
    build(built)
    store = tmp_path / "store"
    store.mkdir()
    key = shared / "signing.pem"
    if flaw == "readable-by-others":
        shutil.copy(keys["ci"], key)
        os.chmod(key, 0o644)
    else:
        staged = shared / "staged.pem"
        shutil.copy(keys["other"], staged)
        os.chmod(staged, 0o644)
        os.chmod(shared, 0o1777)
        as_nobody(f"cp {staged} {key} && chmod 600 {key}")
    with pytest.raises(UntrustedFileError, match="untrusted private key"):
        load_private_key(key)
    done = subprocess.run(
        [sys.executable, "-m", "packcache", "publish", str(built), str(store), "--sign", str(key)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)},
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "untrusted private key" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not list((store).rglob("*.json")), "a manifest was published"


# --------------------------------------------------------------------------- the file fetch renames into place


@pytest.mark.parametrize(
    "where", ["nobodys-link-in-sticky-directory", "a-link-in-an-open-directory", "nobodys-directory-link"]
)
def test_fetch_through_a_symlink_nobody_planted_is_refused_and_its_target_kept(
    tmp_path: Path, keys: dict[str, Path], shared: Path, where: str
) -> None:
    """The cache directory is shared. A symlink at the fetched path to root's private file: fetch renamed the blob
    over it (and locked beside it). The cache refuses such a link as ``untrusted``; fetch refuses it too."""
    store, _ = _published(tmp_path, keys)
    victim, before = _victim(tmp_path)
    cache_dir = shared / "cache"
    cache_dir.mkdir()
    link = cache_dir / "model-x.pcache"
    if where == "nobodys-link-in-sticky-directory":
        os.chmod(cache_dir, 0o1777)
        as_nobody(f"ln -s {victim} {link}")
    elif where == "nobodys-directory-link":  # a directory on the way, not the file: every hop is checked
        os.chmod(cache_dir, 0o1777)
        as_nobody(f"ln -s {victim.parent} {cache_dir / 'models'}")
        link = cache_dir / "models" / "model-x.pcache"
    else:
        os.chmod(cache_dir, 0o777)  # anyone may replace root's own link here
        link.symlink_to(victim)
    with pytest.raises(RemoteError) as raised:
        _fetch(store, link, keys["ci.pub"])
    assert raised.value.reason == "remote_write_failed" and "symlink" in str(raised.value), raised.value
    _kept(victim, before)
    assert len(list(cache_dir.iterdir())) == 1, "no lock, no temp"


@pytest.mark.parametrize("planted", ["nobodys-file", "world-writable-file", "fifo"])
def test_fetch_never_renames_over_a_file_the_cache_would_refuse(
    tmp_path: Path, keys: dict[str, Path], shared: Path, planted: str
) -> None:
    store, _ = _published(tmp_path, keys)
    cache_dir = shared / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o1777)
    path = cache_dir / "model-x.pcache"
    if planted == "nobodys-file":
        as_nobody(f"echo theirs > {path}")
    elif planted == "world-writable-file":
        path.write_bytes(b"theirs\n")
        os.chmod(path, 0o666)
    else:
        os.mkfifo(path)
    before = os.lstat(path)
    with pytest.raises(RemoteError) as raised:
        _fetch(store, path, keys["ci.pub"])
    assert raised.value.reason == "remote_write_failed" and "untrusted cache file" in str(raised.value), raised.value
    after = os.lstat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # What the cache itself makes of the path: untrusted too (no fetch could have made it usable).
    with packcache.WeightCache(path, platform=PLATFORM) as cache, cache.session() as s:
        s.get_or_pack("layer0", lambda: np.zeros(4, np.float32), RECIPE)
        assert cache.stats().heap_bytes_by_reason["untrusted"] == 16


# --------------------------------------------------------------------------- a fetch killed mid-download


@pytest.mark.parametrize("then", ["fetch", "load"])
@pytest.mark.parametrize("spelling", ["direct", "through-a-symlink"])
def test_a_fetch_killed_mid_download_leaves_a_temp_the_next_fetch_removes(
    tmp_path: Path, keys: dict[str, Path], spelling: str, then: str
) -> None:
    """A real fetch process, SIGKILLed while the store is half-way through the blob, leaves its partial temp file
    (nothing can remove it then). The next fetch of that file, or load through the store, holding the lock the
    killed one held, removes it, however the path is spelled (this user's own symlink to it, too)."""
    store, built = _published(tmp_path, keys, count=8, side=512)  # 8 MiB: the download is still running
    local = tmp_path / "b" / "model-x.pcache"
    local.parent.mkdir()
    given = local
    if spelling == "through-a-symlink":
        given = tmp_path / "link" / "model-x.pcache"
        given.parent.mkdir()
        given.symlink_to(local)

    def temps() -> list[Path]:
        return [*local.parent.glob(".model-x.pcache.tmp-*"), *given.parent.glob(".model-x.pcache.tmp-*")]

    with faulty_store(Path(store), "stall") as (url, sending):
        code = (
            "from packcache.fleet.fetch import fetch\n"
            "from packcache.format import canonical_key\n"
            f"fetch({url!r}, {str(given)!r}, platform=canonical_key({PLATFORM!r}), "
            f"trusted_keys=[open({str(keys['ci.pub'])!r}, 'rb').read()], timeout=60)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        with subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, env=env) as child:
            try:
                assert sending.wait(60), "the fetch never asked for the blob"
                deadline = time.monotonic() + 30
                while not [p for p in temps() if p.stat().st_size]:
                    assert time.monotonic() < deadline and child.poll() is None, child.stderr
                    time.sleep(0.05)
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait()
    (temp,) = set(temps())
    # Preallocated to the blob's size (its parts land at their offsets), half of it written.
    assert temp.stat().st_size == built.stat().st_size and temp.read_bytes() != built.read_bytes()
    assert not local.exists()
    if then == "fetch":
        assert _fetch(store, given, keys["ci.pub"]).downloaded
    else:
        arrays = build(tmp_path / "same.pcache", count=8, side=512)  # what the published file holds
        stats = load(given, arrays, remote=store, trusted_keys=[str(keys["ci.pub"])])
        assert (stats.remote_hits, stats.stored, stats.hits) == (1, 0, len(arrays)), stats
    assert local.read_bytes() == built.read_bytes()
    assert temps() == [], "the killed fetch's temp file is still there"
    names = sorted(p.name for p in local.parent.iterdir())
    records = [n for n in names if n.startswith(".model-x.pcache.accepted-") and n.endswith(".json")]
    assert len(records) == 1, names  # the rollback record kept beside the file (docs/FLEET.md)
    assert sorted(set(names) - set(records)) == ["model-x.pcache", "model-x.pcache.lock"]


def test_a_directory_swapped_for_a_symlink_during_a_fetch_is_never_written_through(
    tmp_path: Path, keys: dict[str, Path], shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root's cache directory lies in a world-writable parent without the sticky bit. Once fetch has
    checked the path, ``nobody`` renames the directory aside and links its name to root's private
    directory: a temp file made and renamed by path replaced root's 0600 file of the same name there.
    The download is made and renamed in the directory that was checked, held open."""
    store, _ = _published(tmp_path, keys)
    parent = shared / "world-writable"
    parent.mkdir()
    os.chmod(parent, 0o777)
    cache_dir = parent / "cache"
    cache_dir.mkdir(mode=0o700)
    path = cache_dir / "model-x.pcache"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = private / "model-x.pcache"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o600)
    before = os.lstat(victim)
    real_create_temp = fleet_fetch.create_temp
    swapped = []

    def swap_then_create(*args: Any, **kwargs: Any) -> tuple[int, str]:
        if not swapped:
            as_nobody(f"mv '{cache_dir}' '{cache_dir}.moved' && ln -s '{private}' '{cache_dir}'")
            swapped.append(True)
        return real_create_temp(*args, **kwargs)

    monkeypatch.setattr(fleet_fetch, "create_temp", swap_then_create)
    report = _fetch(store, path, keys["ci.pub"])
    assert swapped and report.downloaded
    after = os.lstat(victim)
    assert (after.st_ino, after.st_mtime_ns, victim.read_bytes()) == (before.st_ino, before.st_mtime_ns, b"precious")
    assert sorted(p.name for p in private.iterdir()) == ["model-x.pcache"], "a temp file was left beside root's file"
    moved = Path(f"{cache_dir}.moved")
    assert packcache.verify(moved / "model-x.pcache").ok, "the fetched file went to the directory that was checked"
    assert [p.name for p in moved.iterdir() if ".tmp-" in p.name] == []


def test_a_record_temp_a_killed_fetch_left_beside_the_cache_is_removed_by_the_next_fetch(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    """A real fetch process killed while it writes the rollback record beside the cache file (the blob is in
    place) leaves the record's temp file. It has the cache file's temp shape, so the next fetch, holding the
    lock the killed one held, removes it (a name of its own was never swept, not even by ``gc``)."""
    store, built = _published(tmp_path, keys)
    local = tmp_path / "b" / "model-x.pcache"
    code = (
        "import os, signal\n"
        "real = os.rename\n"
        "def rename(src, dst, *args, **kwargs):\n"
        "    if '.accepted-' in str(dst):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)  # between the record's temp file and its rename\n"
        "    return real(src, dst, *args, **kwargs)\n"
        "os.rename = rename\n"
        "from packcache.fleet.fetch import fetch\n"
        "from packcache.format import canonical_key\n"
        f"fetch({store!r}, {str(local)!r}, platform=canonical_key({PLATFORM!r}), "
        f"trusted_keys=[open({str(keys['ci.pub'])!r}, 'rb').read()], timeout=60)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert local.read_bytes() == built.read_bytes()
    left = sorted(p.name for p in local.parent.iterdir() if ".tmp-" in p.name)
    assert len(left) == 1 and left[0].startswith(".model-x.pcache.tmp-"), left
    assert not _fetch(store, local, keys["ci.pub"]).downloaded
    assert sorted(p.name for p in local.parent.iterdir() if ".tmp-" in p.name) == []
