"""Opening paths (``packcache._paths``): never blocking on a FIFO, never following a symlink swapped in
after the check, trusting a file by its owner and mode, files and directories made with exactly the modes
asked for (the lock and temp files beside a cache file: tests/test_sidefiles.py).

Real FIFOs and symlinks. The trust refusals run as a real second user too: a child under ``setpriv
--reuid=65534 --regid=65534 --clear-groups`` (the user ``nobody``), started by the fault matrix's
``harness.driver.Env`` (the ``env`` fixture, which makes the interpreter and a copy of ``packcache``
reachable for nobody). tests/evidence/test_fault_injection.py covers the refusals as root (foreign owner,
world-writable, unsafe symlink) and the default modes under several umasks; nobody opening a root-owned
0644 cache (trusted: hits map, misses are ``read_only`` with EACCES) is the fault matrix's
``eacces-nobody/append`` case (tests/evidence/test_fault_matrix.py).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness import KEY, KIB, Packer, Spec, assert_same, build, build_keyed, error_records, file_state, packed
from harness.driver import FOREIGN_UID, NOBODY, Env, check_load, loaded
from packcache import WeightCache

# ---------------------------------------------------------------------- a symlink swapped in after the check


def test_a_symlink_swapped_in_after_the_check_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, no sticky bit: a symlink here is not to be followed
    path = shared / "m.pcache"
    build_keyed(path, {"w": 1})
    victim = tmp_path / "victim.pcache"
    build_keyed(victim, {"w": 2})  # a valid cache of other bytes, which the attacker wants served
    real_lstat = os.lstat

    def lstat_then_swap(p: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(p, *args, **kwargs)
        if os.fspath(p) == str(path) and stat.S_ISREG(result.st_mode):
            os.rename(path, shared / "moved.pcache")  # the race, at its worst instant
            os.symlink(victim, path)
        return result

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    with WeightCache(path) as cache:
        with cache.session() as s:
            w = s.get_or_pack("w", lambda: packed(1), KEY)
        st = cache.stats()
    monkeypatch.undo()
    assert_same(w, packed(1))  # never the victim's packed(2)
    assert st.hits == 0 and st.heap_bytes_by_reason["untrusted"] == 4 * KIB


# ----------------------------------------------------------------------------------------- a FIFO at the cache path


def test_a_fifo_at_the_cache_path_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    os.mkfifo(path, 0o600)
    with WeightCache(path) as cache:
        with cache.session() as s:
            s.get_or_pack("w", lambda: packed(1), KEY)
        st = cache.stats()
    assert st.heap_reason == "untrusted" and "FIFO" in st.error


# --------------------------------------------------------------------------- trust: refusals as a real second user


AB: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB)}
ABC: Spec = {**AB, "c": (3, 16 * KIB)}


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _give(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)


def _assert_refused(step: dict[str, Any], path: Path, nbytes: int) -> None:
    assert check_load(step, path, hits=0, stored=0, heap={"untrusted": nbytes}, errors=("untrusted",)) == []
    assert step["stats"]["state"] == "heap" and step["stats"]["written_bytes"] == 0


@pytest.mark.root
def test_nobody_refuses_a_cache_file_owned_by_another_non_root_user(env: Env) -> None:
    d = env.case_dir("foreign-owner")
    path = d / "model.pcache"
    build(path, AB, file_mode=0o644)
    _give(path, FOREIGN_UID)
    before = file_state(path)
    step = loaded(env, path, ABC, user="nobody")
    _assert_refused(step, path, 48 * KIB)
    assert any("owned by uid 12345" in m for _, m in step["records"]), step["records"]
    assert file_state(path) == before


@pytest.mark.root
@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666], ids=["group-writable", "world-writable", "both"])
def test_nobody_refuses_its_own_group_or_world_writable_file(env: Env, mode: int) -> None:
    d = env.case_dir("writable")
    _give(d, NOBODY)
    os.chmod(d, 0o700)
    path = d / "model.pcache"
    build(path, AB)
    for owned in (path, Path(f"{path}.lock")):
        _give(owned, NOBODY)
    os.chmod(path, mode)
    before = file_state(path)
    _assert_refused(loaded(env, path, AB, user="nobody"), path, 32 * KIB)
    assert file_state(path) == before


@pytest.mark.root
@pytest.mark.parametrize(("dir_mode", "trusted"), [(0o777, False), (0o1777, True)], ids=["no-sticky", "sticky"])
def test_nobody_symlink_in_world_writable_directory_is_trusted_only_with_sticky_bit(
    env: Env, dir_mode: int, trusted: bool
) -> None:
    """nobody's own valid cache, reached through a link in a shared directory anyone can write."""
    d = env.case_dir("symlink")
    real = d / "real"
    real.mkdir()
    target = real / "model.pcache"
    build(target, AB)
    for owned in (real, target, Path(f"{target}.lock")):
        _give(owned, NOBODY)
    shared = d / "shared"
    shared.mkdir()
    os.chmod(shared, dir_mode)
    link = shared / "model.pcache"
    link.symlink_to(target)
    before = file_state(target)
    step = loaded(env, link, AB, user="nobody")
    if trusted:
        assert check_load(step, link, hits=2, stored=0) == []
    else:
        _assert_refused(step, link, 32 * KIB)
        assert any("sticky" in m for _, m in step["records"]), step["records"]
    assert file_state(target) == before


# --------------------------------------------------------------------------- modes


@pytest.mark.root
def test_nobody_creates_its_cache_0600_in_a_0700_directory_it_owns(env: Env) -> None:
    d = env.case_dir("create")
    _give(d, NOBODY)
    path = d / "cache" / "model.pcache"
    step = loaded(env, path, AB, user="nobody")
    assert check_load(step, path, hits=0, stored=2) == []
    for created, mode in ((path.parent, 0o700), (path, 0o600), (Path(f"{path}.lock"), 0o600)):
        st = os.lstat(created)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, mode), created
    # And nobody trusts what it made: the next load maps everything.
    assert check_load(loaded(env, path, AB, user="nobody"), path, hits=2, stored=0) == []


def test_configured_file_and_dir_modes_are_applied_and_still_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "shared" / "model.pcache"
    old = os.umask(0o077)  # the umask must neither widen nor narrow the configured modes
    try:
        with WeightCache(path, file_mode=0o640, dir_mode=0o750) as cache, cache.session() as s:
            s.get_or_pack("w", lambda: packed(0, 4 * KIB))
    finally:
        os.umask(old)
    assert (_mode(path.parent), _mode(path), _mode(Path(f"{path}.lock"))) == (0o750, 0o640, 0o640)
    packer = Packer()
    with WeightCache(path) as cache:
        with cache.session() as s:
            assert_same(s.get_or_pack("w", packer("w", 0)), packed(0, 4 * KIB))
        assert (cache.stats().hits, packer.calls) == (1, {})
    assert error_records(caplog.records) == []


# --------------------------------------------------------------------------- a symlink another user plants


def _as_nobody(*argv: str) -> None:
    """Run ``argv`` as the real user ``nobody`` (what that user can do, it does itself)."""
    subprocess.run(["runuser", "-u", "nobody", "--", *argv], check=True, capture_output=True)


@pytest.mark.root
@pytest.mark.parametrize("where", ["sticky-shared", "nobodys-directory"])
@pytest.mark.parametrize("target", ["roots-file", "dangling"])
def test_a_symlink_nobody_plants_in_a_sticky_directory_is_untrusted_and_its_target_kept(
    env: Env, where: str, target: str
) -> None:
    """``nobody`` links root's cache path to root's private 0600 file (or to a name beside it): the cache's
    rebuild renamed a new file over the target (or created one there). The link is not followed: ``untrusted``."""
    d = env.case_dir("planted-symlink")
    shared = d / "shared"
    shared.mkdir()
    if where == "sticky-shared":
        os.chmod(shared, 0o1777)  # like /tmp
    else:
        _give(shared, NOBODY)  # nobody's own directory, which root was told to keep its cache in
    private = d / "private"
    private.mkdir(mode=0o700)
    victim = private / ("secret" if target == "roots-file" else "created-by-root")
    if target == "roots-file":
        victim.write_bytes(b"precious")
        os.chmod(victim, 0o600)
    before = os.lstat(victim) if victim.exists() else None
    link = shared / "model.pcache"
    _as_nobody("ln", "-s", str(victim), str(link))
    assert os.lstat(link).st_uid == NOBODY
    with WeightCache(link) as cache:
        with cache.session() as s:
            w = s.get_or_pack("w", lambda: packed(1), KEY)
        st = cache.stats()
    assert_same(w, packed(1))
    assert (st.stored, st.heap_bytes_by_reason["untrusted"]) == (0, 4 * KIB), st
    assert "65534" in st.error, st.error
    if before is None:
        assert not victim.exists(), "root created a file where nobody's link points"
    else:
        after = os.lstat(victim)
        assert (after.st_ino, after.st_mtime_ns, victim.read_bytes()) == (
            before.st_ino,
            before.st_mtime_ns,
            b"precious",
        )
    assert sorted(p.name for p in private.iterdir()) == ([victim.name] if before else []), "nothing beside it"
    assert os.path.islink(link) and os.readlink(link) == str(victim)


# --------------------------------------------------------------------------- a directory renamed on the way


def _swap_for_a_link(directory: Path, to: Path) -> None:
    """``nobody`` renames root's ``directory`` aside in its world-writable (non-sticky) parent and links
    its name to ``to``: what another user can do to any directory in such a parent, at any instant."""
    _as_nobody("mv", str(directory), f"{directory}.moved")
    _as_nobody("ln", "-s", str(to), str(directory))


@pytest.mark.root
@pytest.mark.parametrize("writer", ["rebuild", "compact"])
def test_a_directory_swapped_for_a_symlink_during_the_walk_is_never_written_through(
    env: Env, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Root's cache directory lies in a world-writable parent without the sticky bit. Right after the
    path was checked, ``nobody`` renames the directory aside and links its name to root's private
    directory: a check by path, then a create and a rename by path, replaced root's 0600 file of the
    same name there. The new file is made and renamed in the directory that was checked, held open."""
    import packcache._generations as generations_mod
    import packcache._store_write as store_write_mod

    d = env.case_dir("swapped-directory")
    shared = d / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    cache_dir = shared / "cache"
    cache_dir.mkdir(mode=0o700)
    path = cache_dir / "model.pcache"
    private = d / "private"
    private.mkdir(mode=0o700)
    victim = private / "model.pcache"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o600)
    before = os.lstat(victim)
    if writer == "compact":
        build(path, {"a": (1, 16 * KIB)})
        build(path, {"a": (2, 16 * KIB)})  # a stale entry: superseded bytes to reclaim
    module = store_write_mod if writer == "rebuild" else generations_mod
    real_create_temp = module.create_temp
    swapped = []

    def swap_then_create(*args: Any, **kwargs: Any) -> tuple[int, str]:
        if not swapped:
            _swap_for_a_link(cache_dir, private)
            swapped.append(True)
        return real_create_temp(*args, **kwargs)

    monkeypatch.setattr(module, "create_temp", swap_then_create)
    if writer == "rebuild":
        with WeightCache(path) as cache:
            with cache.session() as s:
                assert_same(s.get_or_pack("a", lambda: packed(1), KEY), packed(1))
    else:
        from packcache import compact

        compact(path)
    assert swapped, "the writer never made its temp file"
    after = os.lstat(victim)
    assert (after.st_ino, after.st_mtime_ns, victim.read_bytes()) == (before.st_ino, before.st_mtime_ns, b"precious")
    assert sorted(p.name for p in private.iterdir()) == ["model.pcache"], "a temp file was left beside root's file"
    moved = Path(f"{cache_dir}.moved")
    assert (moved / "model.pcache").is_file(), "the new file went to the directory that was checked"
    assert not [p.name for p in moved.iterdir() if ".tmp-" in p.name]


# --------------------------------------------------------------------------- the default cache directory and home

SRC = Path(__file__).resolve().parents[1] / "src"
UNUSED_UID = 54321  # a uid with no passwd entry (checked): a container run under an arbitrary uid


def _without_cache_variables(**extra: str) -> dict[str, str]:
    """This process's environment without what places the default cache (the suite's conftest sets them)."""
    gone = ("PACKCACHE_DIR", "PACKCACHE_DIGEST_DIR", "XDG_CACHE_HOME", "HOME", "HF_HUB_CACHE", "HF_HOME")
    return {**{k: v for k, v in os.environ.items() if k not in gone}, "PYTHONPATH": str(SRC), **extra}


def test_every_directory_made_on_the_way_to_the_default_cache_gets_the_private_mode(tmp_path: Path) -> None:
    """``os.makedirs(mode=0o700)`` gives the mode to the last directory only, through the umask: a first ``packcache
    build`` with a new home made ``~/.cache`` and ``~/.cache/packcache`` 0755 (the README says 0700), and the
    digest cache's ``makedirs`` was the first to make them. Every directory made on the way is 0700 now, whatever the
    umask, and one that was there is left as it was."""
    from harness.checkpoints import tiny_bert

    checkpoint = tiny_bert(tmp_path / "ckpt", seed=1)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    done = subprocess.run(
        [sys.executable, "-m", "packcache", "build", str(checkpoint), "--scheme", "int8", "--json"],
        env=_without_cache_variables(HOME=str(home)), capture_output=True, text=True, timeout=300, umask=0o022,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made = [home / ".cache", home / ".cache" / "packcache", home / ".cache" / "packcache" / "digests"]
    assert {str(p.relative_to(home)): oct(_mode(p)) for p in made} == {str(p.relative_to(home)): "0o700" for p in made}
    assert _mode(home) == 0o755  # there before: not changed
    assert list((home / ".cache" / "packcache").glob("bert-int8-*.pcache")), "the cache file went elsewhere"
    # the one helper, under any umask: every directory it makes gets exactly the mode asked for
    from packcache._paths import make_dirs

    old = os.umask(0o077)
    try:
        assert make_dirs(tmp_path / "a" / "b" / "c", 0o750) == str(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    assert [_mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o750] * 3
    os.chmod(tmp_path / "a", 0o711)
    make_dirs(tmp_path / "a" / "d", 0o700)
    assert (_mode(tmp_path / "a"), _mode(tmp_path / "a" / "d")) == (0o711, 0o700)


_NO_HOME = r"""
import contextlib, io, json, os, sys
from packcache import _paths, hub
from packcache.cli import main
from packcache.cli import build_parser
import locale, packcache.cli._common  # imported as root, parser and all: the interpreter lies under /root (0700)
build_parser().parse_args(["run"])
os.setgroups([])
os.setgid(UID)
os.setuid(UID)
os.chdir(sys.argv[1])
found = {}
for name, call in [("default_cache_dir", _paths.default_cache_dir), ("hub_cache_dir", hub.hub_cache_dir),
                   ("home", lambda: hub.model_argument("~/m"))]:
    try:
        found[name] = ["returned", str(call())]
    except Exception as exc:
        found[name] = [type(exc).__name__, str(exc)]
for command in (["run", "--model", "/nowhere"], ["build", "/nowhere"], ["fetch", "/nowhere", "--name", "org/m"]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            found[command[0]] = [main(command), err.getvalue()]
    except BaseException as exc:  # past the refusal: whatever the command went on to do
        found[command[0]] = [repr(exc), err.getvalue()]
print(json.dumps(found))
""".replace("UID", str(UNUSED_UID))


@pytest.mark.root
def test_no_home_and_no_passwd_entry_is_refused_never_a_path_under_the_cwd(env: Env) -> None:
    """A process whose uid has no passwd entry, with ``HOME`` unset (a container under an arbitrary uid):
    ``expanduser("~")`` is ``"~"`` itself, so the default cache was ``./~/.cache/packcache``, under whatever
    directory the process ran in. Now there is no default cache directory: the library says so in one line (what
    to set), the commands refuse at startup (exit 2), and nothing is made in the working directory."""
    import json
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwuid(UNUSED_UID)
    cwd = env.case_dir("no-home") / "shared"  # reachable by any user
    cwd.mkdir()
    os.chmod(cwd, 0o1777)  # the child may write here, as it may in /tmp
    done = subprocess.run(
        [sys.executable, "-c", _NO_HOME, str(cwd)], env=_without_cache_variables(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    for name in ("default_cache_dir", "hub_cache_dir", "home"):
        kind, message = found[name]
        assert kind == "FileNotFoundError" and "no home directory: HOME is unset" in message, (name, found[name])
        assert f"uid {UNUSED_UID} has no passwd entry" in message and "PACKCACHE_DIR" in message, message
    for command in ("run", "build", "fetch"):
        code, err = found[command]
        assert code == 2 and "no default cache directory" in err and "--cache-dir" in err, (command, code, err)
        assert len(err.strip().splitlines()) == 1, err
    assert list(cwd.iterdir()) == [], "something was made under the working directory"


def test_a_relative_xdg_cache_home_is_ignored_and_a_relative_home_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The XDG base directory specification: a relative ``$XDG_CACHE_HOME`` is invalid and ignored (it was used,
    relative to whatever directory the process ran in); a relative ``$HOME`` gives way to the passwd entry."""
    import pwd

    from packcache import _paths, hub

    monkeypatch.delenv("PACKCACHE_DIR", raising=False)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    assert _paths.default_cache_dir() == "/home/u/.cache/packcache"
    assert hub.hub_cache_dir() == "/home/u/.cache/huggingface/hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert (_paths.default_cache_dir(), hub.hub_cache_dir()) == ("/x/packcache", "/x/huggingface/hub")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "relative/home")
    entry = pwd.getpwuid(os.geteuid()).pw_dir
    assert _paths.default_cache_dir() == os.path.join(entry, ".cache", "packcache")
    assert _paths.expand_home("~/m") == os.path.join(entry, "m")
