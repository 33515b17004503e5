"""Trust: what a cache file must be before its bytes are served, and what packcache never does.

DESIGN.md "Processes, threads, trust": files ``0600`` in ``0700`` directories
unless configured; opening refuses (``untrusted``, one ERROR record) a file
owned by another user than the effective one or root, a group/world-writable
file, or a symlinked path in a world-writable directory without the sticky
bit; temp files are created with ``O_EXCL``; no pickle, no eval, anywhere.

tests/test_faults.py covers the refusals as root (foreign owner, world-writable,
unsafe symlink) and the default modes under several umasks. Here the refusals
run as a real second user: a child under ``setpriv --reuid=65534 --regid=65534
--clear-groups`` (the user ``nobody``), started by the fault matrix's
``harness.driver.Env`` (which makes the interpreter and a copy of ``packcache``
reachable for nobody). nobody opening a root-owned 0644 cache (trusted: hits map,
misses are ``read_only`` with EACCES) is the fault matrix's
``eacces-nobody/append`` case in tests/test_fault_matrix.py.
"""

from __future__ import annotations

import ast
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import KIB, ROOT_ONLY, Packer, Spec, assert_same, build, error_records, file_state, packed
from harness.driver import FOREIGN_UID, NOBODY, Env, check_load, environment, loaded
from packcache import WeightCache
from packcache import _paths as paths_mod

SRC = Path(__file__).resolve().parents[1] / "src" / "packcache"
AB: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB)}
ABC: Spec = {**AB, "c": (3, 16 * KIB)}


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    assert os.geteuid() == 0, ROOT_ONLY
    with environment() as made:
        yield made


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _give(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)


def _assert_refused(step: dict[str, Any], path: Path, nbytes: int) -> None:
    assert check_load(step, path, hits=0, stored=0, heap={"untrusted": nbytes}, errors=("untrusted",)) == []
    assert step["stats"]["state"] == "heap" and step["stats"]["written_bytes"] == 0


# --------------------------------------------------------------------------- refusals as a real second user


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


# --------------------------------------------------------------------------- configured modes


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


# --------------------------------------------------------------------------- O_EXCL temp files


def _planted_file(at: Path, victim: Path) -> None:
    at.write_bytes(b"planted by someone else")


def _planted_symlink(at: Path, victim: Path) -> None:
    victim.write_bytes(b"the victim's file")
    at.symlink_to(victim)


def _planted_dangling_symlink(at: Path, victim: Path) -> None:
    at.symlink_to(victim)  # victim does not exist: O_CREAT without O_EXCL would create it


@pytest.mark.parametrize("plant", [_planted_file, _planted_symlink, _planted_dangling_symlink])
def test_temp_file_is_created_with_o_excl_and_never_follows_a_planted_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, plant: Any
) -> None:
    """The first random temp name the library picks is already taken: it must pick another, untouched."""
    names = iter(["0000000000000000", "1111111111111111"])
    monkeypatch.setattr(paths_mod.secrets, "token_hex", lambda n: next(names))
    path = tmp_path / "cache" / "model.pcache"
    path.parent.mkdir(mode=0o700)
    planted = path.parent / f".model.pcache.tmp-{os.getpid()}-0000000000000000"
    victim = tmp_path / "victim"
    plant(planted, victim)
    before = {p: os.lstat(p) for p in (planted, victim) if os.path.lexists(p)}
    contents = {p: p.read_bytes() for p in before if p.exists()}
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name, (seed, nbytes) in AB.items():
                assert_same(s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes)),
                            packed(seed, nbytes))  # fmt: skip
        st = cache.stats()
    assert (st.stored, st.heap_bytes, st.state) == (2, 0, "stored")
    for p, old in before.items():
        new = os.lstat(p)
        assert (new.st_ino, new.st_size, new.st_mtime_ns, new.st_mode) == (
            old.st_ino, old.st_size, old.st_mtime_ns, old.st_mode,
        ), f"{p} was touched"  # fmt: skip
    assert {p: p.read_bytes() for p in contents} == contents
    assert os.path.lexists(victim) == (plant is _planted_symlink), "the symlink's target was created"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([planted.name, "model.pcache", "model.pcache.lock"])
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name in AB:
                s.get_or_pack(name, lambda: np.zeros(1))
        assert cache.stats().hits == 2
    assert error_records(caplog.records) == []


# --------------------------------------------------------------------------- nothing unpickled, nothing evaluated

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "copyreg"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_ATTRIBUTES = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load")}


def forbidden_uses(source: str, filename: str) -> list[str]:
    """Every way the code could unpickle or evaluate something: imports, calls, attributes, keyword flags.

    Works on the syntax tree, so a docstring saying "no pickle" is not a hit
    and ``module.eval()`` (torch's train/eval switch) is not Python's ``eval``.
    """
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_CALLS | FORBIDDEN_MODULES:
            found.append(f"{where}: {node.id}")
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) in FORBIDDEN_ATTRIBUTES or node.attr in {"read_pickle", "unsafe_load"}:
                found.append(f"{where}: {owner}.{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{where}: allow_pickle not False")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and str(arg.value).startswith("packcache.")):
                found.append(f"{where}: import_module of something other than a packcache module")
    return found


def test_no_module_of_the_package_unpickles_or_evaluates_anything() -> None:
    """Every .py under src/packcache, subpackages included (torch adapters, models, telemetry)."""
    files = sorted(SRC.rglob("*.py"))
    assert len(files) >= 10, files
    found = [hit for f in files for hit in forbidden_uses(f.read_text(encoding="utf-8"), str(f.relative_to(SRC)))]
    assert found == []


@pytest.mark.parametrize(
    "code",
    [
        "import pickle",
        "from pickle import loads",
        "import marshal as m",
        "import shelve",
        "x = eval('1')",
        "exec('x = 1')",
        "import torch\ntorch.load('w.pt')",
        "import yaml\nyaml.load(s)",
        "import numpy as np\nnp.load('a.npy', allow_pickle=True)",
        "import importlib\nimportlib.import_module('pickle')",
        "f = __import__('pickle')",
    ],
)
def test_forbidden_use_scanner_catches(code: str) -> None:
    assert forbidden_uses(code, "sample.py"), code


@pytest.mark.parametrize(
    "code",
    [
        '"""Read safetensors without pickle."""',
        "encoder.eval()",
        "import importlib\nimportlib.import_module('packcache.models.minilm')",
        "np.load('a.npy', allow_pickle=False)",
    ],
)
def test_forbidden_use_scanner_allows(code: str) -> None:
    assert forbidden_uses(code, "sample.py") == [], code
