"""Defaults in one home (``packcache._defaults``), and one rule: ``None`` means "the default", an explicit value wins.

Every default of the package is taken from ``_defaults`` by name, never written again as a literal
(checked on the source, so a ``32`` that equals the default today but would not follow it is caught);
the four cache options take the *process* default for ``None`` and keep an explicit value; and every
loader and command resolves the default scheme through the one rule.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness.files import committed, flip_bit
from harness.packs import build, packed
from packcache import WeightCache, _defaults, _paths, _registry, loader
from packcache.packers_torch import Int4WeightOnly

SRC = Path(packcache.__file__).resolve().parent

#: Parameter (or dataclass field, or command-line option) -> the ``_defaults`` constant its default must name.
HOMES = {
    "group_size": "GROUP_SIZE",
    "scheme": "SCHEME",
    "lock_timeout": "LOCK_TIMEOUT",
    "remote_timeout": "REMOTE_TIMEOUT",
    "alignment": "ALIGNMENT",
    "file_mode": "FILE_MODE",
    "dir_mode": "DIR_MODE",
    "kernel_path": "KERNEL_PATH",
}
#: Other names of a constant of ``_defaults`` (``maintenance.compact`` takes the lock timeout from ``_paths``).
ALIASES = {"DEFAULT_LOCK_TIMEOUT": "LOCK_TIMEOUT"}
#: Literal defaults still written outside the one home (relative path, parameter): none. A new one fails.
NOT_YET: set[tuple[str, str]] = set()
#: Fields named like a default that are results, not defaults a caller takes: ``ConversionReport.kernel_path``
#: (the path the packed layers run; :func:`packcache.torch.convert` always sets it).
RESULTS = {("torch.py", "kernel_path")}


def _names_home(node: ast.expr, constant: str) -> bool:
    """Whether a default expression is ``None`` or names ``constant`` (``GROUP_SIZE``, ``_defaults.GROUP_SIZE``)."""
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and ALIASES.get(name, name) == constant


def _defaults_in_source() -> list[tuple[str, int, str, ast.expr]]:
    """(file, line, parameter, default) of every function parameter, dataclass field and ``add_argument``
    option of the package whose name is one of :data:`HOMES`."""
    found: list[tuple[str, int, str, ast.expr]] = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "_defaults.py":
            continue
        where = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                positional = [*args.posonlyargs, *args.args]
                pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
                pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
                found += [(where, a.lineno, a.arg, d) for a, d in pairs if a.arg in HOMES]
            elif isinstance(node, ast.ClassDef):
                found += [
                    (where, item.lineno, item.target.id, item.value)
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None
                    and item.target.id in HOMES and (where, item.target.id) not in RESULTS
                ]  # fmt: skip
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args:
                flag = node.args[0]
                if isinstance(flag, ast.Constant) and isinstance(flag.value, str) and flag.value.startswith("--"):
                    name = flag.value[2:].replace("-", "_")
                    for keyword in node.keywords:
                        if keyword.arg == "default" and name in HOMES:
                            found.append((where, node.lineno, name, keyword.value))
    return found


def test_every_default_in_the_package_is_taken_from_the_one_home_by_name() -> None:
    found = _defaults_in_source()
    group_sizes = [f for f in found if f[2] == "group_size"]
    assert len(group_sizes) >= 9, "the scan sees hf, minilm, loader, packers_torch and the command line"
    stray = [
        f"{where}:{line}: {name} = {ast.unparse(default)} (take _defaults.{HOMES[name]}, or None for it)"
        for where, line, name, default in found
        if not _names_home(default, HOMES[name]) and (where, name) not in NOT_YET
    ]
    assert stray == []
    still = {(where, name) for where, _, name, default in found if not _names_home(default, HOMES[name])}
    assert still == NOT_YET, "a default listed as not yet taken from _defaults is now: remove it from NOT_YET"


def test_the_constants_are_what_the_documentation_says() -> None:
    assert (_defaults.SCHEME, _defaults.GROUP_SIZE, _defaults.LOCK_TIMEOUT, _defaults.KERNEL_PATH) == (
        "auto", 32, 30.0, None
    )  # fmt: skip
    assert dict(_defaults.OPTIONS) == {"enabled": True, "lock_timeout": 30.0, "read_only": False, "verify": False}
    assert _defaults.GROUP_SIZES == Int4WeightOnly.GROUP_SIZES
    assert _defaults.GROUP_SIZE in _defaults.GROUP_SIZES


def test_the_old_names_of_a_default_are_the_one_object() -> None:
    assert _paths.DEFAULT_LOCK_TIMEOUT is _defaults.LOCK_TIMEOUT
    assert _defaults.OPTIONS["lock_timeout"] is _defaults.LOCK_TIMEOUT


def test_the_process_defaults_are_a_mutable_copy_that_never_writes_back() -> None:
    assert dict(_defaults.OPTIONS) == _registry.DEFAULTS
    assert _registry.DEFAULTS is not _defaults.OPTIONS
    packcache.set_option("packed_cache_verify", True)
    assert _registry.DEFAULTS["verify"] is True and _defaults.OPTIONS["verify"] is False
    with pytest.raises(TypeError):
        _defaults.OPTIONS["verify"] = True  # type: ignore[index]


# --------------------------------------------------------------------------- the four cache options

#: option -> (key, a process default to set, an explicit value that differs from it)
OPTIONS: dict[str, tuple[str, Any, Any]] = {
    "enabled": ("packed_cache_enabled", False, True),
    "read_only": ("packed_cache_read_only", True, False),
    "verify": ("packed_cache_verify", True, False),
    "lock_timeout": ("packed_cache_lock_timeout", 5.0, _defaults.LOCK_TIMEOUT),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_an_explicit_option_wins_over_the_process_default(tmp_path: Path, option: str) -> None:
    key, process, explicit = OPTIONS[option]
    packcache.set_option(key, process)
    with WeightCache(tmp_path / "m.pcache", **{option: explicit}) as cache:
        assert getattr(cache, option) == explicit
        assert cache.get_option(key) == explicit


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("given", ["none", "omitted"])
def test_none_takes_the_process_default_as_the_cache_is_made(tmp_path: Path, option: str, given: str) -> None:
    key, process, _ = OPTIONS[option]
    packcache.set_option(key, process)
    arguments = {option: None} if given == "none" else {}
    with WeightCache(tmp_path / "m.pcache", **arguments) as cache:
        assert getattr(cache, option) == process
        packcache.set_option(key, _defaults.OPTIONS[option])  # read when the cache was made, not afterwards
        assert getattr(cache, option) == process


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_without_a_process_default_set_each_option_is_the_one_homes(tmp_path: Path, option: str) -> None:
    with WeightCache(tmp_path / "m.pcache") as cache:
        assert getattr(cache, option) == _defaults.OPTIONS[option]


def test_verify_false_serves_without_checking_even_when_the_process_verifies(tmp_path: Path) -> None:
    """The deliberate change: ``verify`` was OR-ed with the process default, so ``verify=False`` still checked."""
    path = tmp_path / "m.pcache"
    build(path, {"w": (1, 4096)})
    flip_bit(path, committed(path)[1]["w"].offset + 5)
    packcache.set_option("packed_cache_verify", True)
    with WeightCache(path, verify=False) as cache, cache.session() as s:
        unchecked = s.get_or_pack("w", lambda: packed(1, 4096))
        assert not np.array_equal(unchecked, packed(1, 4096)), "served as it is in the file: not checked"
    with WeightCache(path) as cache:  # None: the process default, which checks
        with cache.session() as s:
            checked = s.get_or_pack("w", lambda: packed(1, 4096))
        assert np.array_equal(checked, packed(1, 4096)) and cache.stats().stored == 1


def test_read_only_false_writes_even_when_the_process_is_read_only(tmp_path: Path) -> None:
    """The deliberate change: ``read_only`` was OR-ed with the process default, so ``read_only=False`` still refused."""
    packcache.set_option("packed_cache_read_only", True)
    with WeightCache(tmp_path / "w.pcache", read_only=False) as cache:
        with cache.session() as s:
            s.get_or_pack("w", lambda: packed(2))
        assert (cache.stats().state, cache.stats().stored) == ("stored", 1)
    with WeightCache(tmp_path / "r.pcache") as cache:
        with cache.session() as s:
            s.get_or_pack("w", lambda: packed(2))
        assert cache.stats().stored == 0 and not (tmp_path / "r.pcache").exists()


# --------------------------------------------------------------------------- the default scheme, resolved alike


@pytest.fixture
def other_default(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make the machine's default scheme one it is not (bf16 is never ``kernels.default_scheme()``): a caller
    that resolves ``auto`` by any other route than the loader's then names the wrong scheme."""
    monkeypatch.setattr(loader, "default_scheme", lambda: "bf16")
    return "bf16"


def test_none_and_auto_resolve_through_the_loader(other_default: str) -> None:
    assert loader.resolve_scheme(None) == loader.resolve_scheme("auto") == loader.resolve_scheme() == other_default
    assert loader.resolve().scheme == other_default
    assert loader.scheme_packer(None).id == loader.scheme_packer(other_default).id


def test_hf_minilm_the_command_line_and_serve_take_the_same_default_scheme(
    other_default: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from packcache import hf
    from packcache.cli import build_parser, main
    from packcache.cli._common import chosen_scheme
    from packcache.fleet.platform import platform_class
    from packcache.format import canonical_key
    from packcache.models import minilm
    from packcache.server.engines import EngineSpec, load_engine

    assert minilm.default_scheme() == other_default
    expected = loader.resolve(other_default).platform()
    assert minilm.platform() == hf.platform() == minilm.platform("auto") == hf.platform(None) == expected
    parser = build_parser()
    for argv in (["run"], ["build", "x"], ["serve"], ["fetch", "file:///x"], ["platform"]):
        assert chosen_scheme(parser.parse_args(argv)) == other_default, argv
    assert main(["platform", "--json"]) == 0
    assert f'"class": "{platform_class(canonical_key(expected))}"' in capsys.readouterr().out

    # The default cache files are named after the resolved scheme, never "auto", and both loaders agree.
    model = minilm.default_model_path()
    named = minilm.default_cache_path(cache_dir=tmp_path)
    assert named.name.startswith(f"bert-{other_default}-")
    assert named == minilm.default_cache_path("auto", cache_dir=tmp_path)
    assert hf.default_cache_path(model, cache_dir=tmp_path) == named
    assert minilm.pack_count() == minilm.pack_count(other_default)

    threads = torch.get_num_threads()  # load_engine sets the worker's thread count
    try:
        engine = load_engine(EngineSpec(cache=None))
    finally:
        torch.set_num_threads(threads)
    assert EngineSpec().scheme is None and engine.scheme == other_default
    loaded = minilm.load(cache=False)
    try:
        assert loaded.scheme == other_default
    finally:
        loaded.close()


def test_the_command_line_option_defaults_are_the_one_homes() -> None:
    from packcache.cli import build_parser

    parser = build_parser()

    def defaults(argv: list[str]) -> argparse.Namespace:
        return parser.parse_args(argv)

    for argv in (["run"], ["serve"], ["build", "x"], ["fetch", "file:///x"], ["platform"]):
        assert defaults(argv).scheme == _defaults.SCHEME, argv
    for argv in (["build", "x"], ["fetch", "file:///x"], ["platform"]):
        assert defaults(argv).group_size == _defaults.GROUP_SIZE, argv
    probe = defaults(["probe", "f"])
    assert (probe.scheme, probe.group_size) == (None, None), "probe: the file's own, unless given"
    assert defaults(["compact", "f"]).lock_timeout == _defaults.LOCK_TIMEOUT
    assert defaults(["run"]).remote_timeout == defaults(["build", "x"]).remote_timeout == _defaults.REMOTE_TIMEOUT
    assert defaults(["run"]).kernel_path is _defaults.KERNEL_PATH
    with pytest.raises(SystemExit):
        defaults(["build", "x", "--group-size", "48"])  # only the sizes there are
