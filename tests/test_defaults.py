"""Defaults in one home (``packcache._defaults``), and one rule: ``None`` means "the default", an explicit value wins.

Every default of the package is taken from ``_defaults`` by name, never written again as a literal
(checked on the source, so a ``32`` that equals the default today but would not follow it is caught);
the four cache options take the *process* default for ``None`` and keep an explicit value; and every
loader and command resolves the default scheme through the one rule.
"""

from __future__ import annotations

import argparse
import ast
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import literal_defaults
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
                pairs = literal_defaults.parameters(node)
                found += [(where, a.lineno, a.arg, d) for a, d in pairs if a.arg in HOMES]
            elif isinstance(node, ast.ClassDef):
                found += [
                    (where, line, name, value)
                    for name, line, value in literal_defaults.fields(node)
                    if name in HOMES and (where, name) not in RESULTS
                ]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args:
                flag = node.args[0]
                if isinstance(flag, ast.Constant) and isinstance(flag.value, str) and flag.value.startswith("--"):
                    name = flag.value[2:].replace("-", "_")
                    for keyword in node.keywords:
                        if keyword.arg == "default" and name in HOMES:
                            found.append((where, node.lineno, name, keyword.value))
    return found


# --------------------------------------------------------------------------- literal defaults, found by value

#: Values a default may write although a constant of ``_defaults`` equals them, because they mean something else
#: wherever they appear: ``None`` is the rule's own "the default" (and ``KERNEL_PATH``'s value), ``True`` and
#: ``False`` are every flag's only two values (the four cache options' are checked by behaviour, below).
#: ``_defaults`` holds no 0, 1, "" or (): a count, an off-switch or an empty value needs no allowance.
COLLIDE_BY_ACCIDENT = frozenset({literal_defaults.key(None), literal_defaults.key(True), literal_defaults.key(False)})

#: Sites whose literal equals a constant of ``_defaults`` but means something else: (file, site) -> why. One site
#: each, so the same value written as a default anywhere else still fails.
UNRELATED: dict[tuple[str, str], str] = {
    ("models/bert.py", "field BertConfig.hidden_size"): "MiniLM's width, 384, not FILE_MODE's 0o600",
    ("models/bert.py", "field BertConfig.max_position_embeddings"): "BERT's 512 positions, not LLM_MAX_BATCH_TOKENS",
    ("server/modelfiles.py", "get() fallback"): "a config.json without max_position_embeddings: BERT's 512 positions",
    ("packers_torch.py", "parameter out_features"): "the compiled kernel's 64-row block, not ALIGNMENT",
    ("packers_torch.py", "parameter in_features"): "a layer width every kernel takes (kernel()'s stand-in shape), "
    "not LLM_MAX_MODEL_LEN",
}


def scan_literal_defaults(root: Path) -> list[literal_defaults.Stray]:
    """Every literal default under ``root`` equal to a constant of ``_defaults``, but what the policy allows."""
    return literal_defaults.scan(
        root, literal_defaults.constants_by_value(_defaults), allowed=COLLIDE_BY_ACCIDENT, unrelated=UNRELATED,
        aliases=ALIASES,
    )  # fmt: skip


def test_every_default_in_the_package_is_taken_from_the_one_home_by_name() -> None:
    strays = scan_literal_defaults(SRC)
    assert [str(stray) for stray in strays] == [], "take the value from _defaults by name (or None for it)"
    # By parameter name as well: a literal that differs from its home's value (``group_size=64``) equals no
    # constant the value scan looks for, yet it is a second default of the same thing.
    found = _defaults_in_source()
    group_sizes = [f for f in found if f[2] == "group_size"]
    assert len(group_sizes) >= 9, "the scan sees hf, minilm, loader, packers_torch and the command line"
    stray = [
        f"{where}:{line}: {name} = {ast.unparse(default)} (take _defaults.{HOMES[name]}, or None for it)"
        for where, line, name, default in found
        if not _names_home(default, HOMES[name])
    ]
    assert stray == []


#: A module that writes each kind of default again, each line a value of ``_defaults`` (the scan's own test).
PLANTED = """\
import os
from dataclasses import dataclass, field
from packcache import _defaults
from packcache._defaults import PROBE_TIMEOUT

DEFAULT_WAIT = 30.0


def fetch(url, *, timeout=10.0, deadline=_defaults.FETCH_DEADLINE):
    return url


def probe(url, timeout=PROBE_TIMEOUT):
    return url


@dataclass
class Limits:
    max_texts: int = 256
    chars: int = field(default=10_000)
    body: int = 4 << 20


def options(parser, environ, args):
    parser.add_argument("--port", type=int, default=8000)
    host = environ.get("HOST", "127.0.0.1")
    level = os.getenv("LEVEL", "info")
    sizes = getattr(args, "sizes", (32, 64, 128))
    os.mkdir("d", 0o700)
    os.makedirs("e", mode=0o755, exist_ok=True)
    fetch("x", deadline=600.0)
    probe("y", timeout=30)
    return host, level, sizes


def fine(flag=True, nothing=None, count=1, wait=0.25):
    fetch("x", timeout=_defaults.REMOTE_TIMEOUT)
    fetch("x", deadline=5.0)
    return flag, nothing, count, wait
"""


def test_the_scan_reports_a_default_written_again_at_every_kind_of_site(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(PLANTED)
    (tmp_path / "_defaults.py").write_text("TIMEOUT = 10.0\n")  # the one home is not read as a second one
    found = {(stray.line, stray.site): stray.value for stray in scan_literal_defaults(tmp_path)}
    lines = PLANTED.splitlines()

    def line(text: str) -> int:
        return next(number for number, written in enumerate(lines, 1) if text in written)

    assert found == {
        (line("DEFAULT_WAIT"), "constant DEFAULT_WAIT"): 30.0,
        (line("def fetch"), "parameter timeout"): 10.0,
        (line("max_texts"), "field Limits.max_texts"): 256,
        (line("field(default="), "field(default=)"): 10_000,
        (line("4 << 20"), "field Limits.body"): 4 << 20,
        (line("--port"), "add_argument(default=)"): 8000,
        (line("HOST"), "get() fallback"): "127.0.0.1",
        (line("LEVEL"), "getenv() fallback"): "info",
        (line("sizes"), "getattr() fallback"): (32, 64, 128),
        (line("os.mkdir"), "os.mkdir() mode"): 0o700,
        (line("os.makedirs"), "os.makedirs(mode=)"): 0o755,
        (line("deadline=600.0"), "fetch(deadline=)"): 600.0,
        (line("timeout=30)"), "probe(timeout=)"): 30,  # an int equals a float default: 30 is 30.0 seconds
    }
    assert all(stray.where == "planted.py" for stray in scan_literal_defaults(tmp_path))


def test_the_scan_fails_the_package_test_on_a_planted_duplicate(tmp_path: Path) -> None:
    """The check can fail: a copy of the package with one default written again as a literal is reported."""
    import shutil

    copy = tmp_path / "packcache"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert scan_literal_defaults(copy) == []
    app = copy / "server" / "wsgiapp.py"
    text = app.read_text()
    assert text.count("    header_timeout: float = _defaults.HEADER_TIMEOUT\n") == 1
    app.write_text(text.replace("header_timeout: float = _defaults.HEADER_TIMEOUT", "header_timeout: float = 10.0"))
    (stray,) = scan_literal_defaults(copy)
    assert (stray.where, stray.site, stray.value) == ("server/wsgiapp.py", "field Limits.header_timeout", 10.0)
    assert "HEADER_TIMEOUT" in stray.constants and str(stray).startswith("server/wsgiapp.py:")


def test_what_collides_by_accident_is_left_out_only_where_it_is_named(tmp_path: Path) -> None:
    """The allow-list: flags and ``None`` anywhere; an unrelated value only at the one site it names."""
    table = literal_defaults.constants_by_value(_defaults)
    assert not {literal_defaults.key(value) for value in (0, 1, "", ())} & set(table), "no allowance needed"
    models = tmp_path / "models"
    models.mkdir()
    (models / "bert.py").write_text("class BertConfig:\n    hidden_size: int = 384\n    width: int = 384\n")
    (stray,) = scan_literal_defaults(tmp_path)
    assert (stray.line, stray.site) == (3, "field BertConfig.width")


def test_every_constant_is_a_value_the_scan_looks_for() -> None:
    """Each scalar constant is in the scan's table (``OPTIONS``, a mapping, is checked by name above)."""
    table = literal_defaults.constants_by_value(_defaults)
    names = {name for names in table.values() for name in names}
    assert names == set(_defaults.__all__) - {"OPTIONS"}
    assert table[literal_defaults.key(10)] == ["BODY_TIMEOUT", "HEADER_TIMEOUT", "REMOTE_TIMEOUT", "SEND_TIMEOUT"]


def test_serve_takes_every_limit_and_process_setting_from_the_one_home() -> None:
    """The command line and the server's own defaults agree, because both name the constant."""
    from packcache.cli import build_parser
    from packcache.server.app import Batching, Limits
    from packcache.server.completions import Generation
    from packcache.server.engines import EngineSpec, preimport
    from packcache.server.master import ServeOptions

    args = build_parser().parse_args(["serve"])
    server = {
        "host": ServeOptions.host, "port": ServeOptions.port, "timeout": ServeOptions.timeout,
        "graceful_timeout": ServeOptions.graceful_timeout, "log_level": ServeOptions.log_level,
        "engine": EngineSpec.engine, **{name: getattr(Limits, name) for name in (
            "max_texts", "max_text_chars", "max_body_bytes", "header_timeout", "body_timeout", "send_timeout")},
        "max_batch_tokens": Batching.max_batch_tokens, "batch_wait": Batching.batch_wait,
        "max_tokens": Generation.max_tokens, "max_seqs": EngineSpec.max_seqs,
    }  # fmt: skip
    assert {name: getattr(args, name) for name in server} == server
    assert server == {
        "host": _defaults.SERVE_HOST, "port": _defaults.SERVE_PORT, "timeout": _defaults.SERVE_TIMEOUT,
        "graceful_timeout": _defaults.GRACEFUL_TIMEOUT, "log_level": _defaults.SERVE_LOG_LEVEL,
        "engine": _defaults.SERVE_ENGINE, "max_texts": _defaults.MAX_TEXTS, "max_text_chars": _defaults.MAX_TEXT_CHARS,
        "max_body_bytes": _defaults.MAX_BODY_BYTES, "header_timeout": _defaults.HEADER_TIMEOUT,
        "body_timeout": _defaults.BODY_TIMEOUT, "send_timeout": _defaults.SEND_TIMEOUT,
        "max_batch_tokens": _defaults.MAX_BATCH_TOKENS, "batch_wait": _defaults.BATCH_WAIT,
        "max_tokens": _defaults.LLM_MAX_TOKENS, "max_seqs": _defaults.LLM_MAX_SEQS,
    }  # fmt: skip
    assert ServeOptions.timeout > _defaults.LOCK_TIMEOUT, "a worker waiting for another's build is not killed"
    assert EngineSpec.loader == _defaults.SERVE_LOADER and EngineSpec.remote_timeout == _defaults.REMOTE_TIMEOUT
    assert preimport.__defaults__ == (_defaults.SERVE_LOADER,)


def test_the_fleet_commands_take_their_defaults_from_the_one_home() -> None:
    from packcache.cli import build_parser
    from packcache.fleet import manifest, probe, publish, stores

    parser = build_parser()
    published = parser.parse_args(["publish", "f", "file:///x"])
    assert published.expires_days * 86400 == _defaults.MANIFEST_EXPIRY == publish.DEFAULT_EXPIRES
    assert manifest.DEFAULT_TTL_SECONDS == _defaults.MANIFEST_EXPIRY
    assert published.timeout == _defaults.PUBLISH_TIMEOUT == _defaults.FETCH_DEADLINE
    assert parser.parse_args(["probe", "f"]).timeout == _defaults.PROBE_TIMEOUT
    fetched = parser.parse_args(["fetch", "file:///x"])
    assert (fetched.loader, fetched.timeout, fetched.deadline) == (
        _defaults.FETCH_LOADER, _defaults.REMOTE_TIMEOUT, _defaults.FETCH_DEADLINE
    )  # fmt: skip
    assert parser.parse_args(["build", "x"]).loader == _defaults.BUILD_LOADER == _defaults.FETCH_LOADER
    assert stores.open_store.__kwdefaults__ == {"timeout": _defaults.REMOTE_TIMEOUT}
    assert inspect.signature(probe.probe_url).parameters["timeout"].default == _defaults.PROBE_TIMEOUT
    assert inspect.signature(publish.publish).parameters["timeout"].default == _defaults.PUBLISH_TIMEOUT


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
    """``verify=False`` is an explicit value, so it wins over a process default that checks."""
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
    """``read_only=False`` is an explicit value, so it wins over a process default that refuses to write."""
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
    """Make the machine's default scheme one it is not (bf16 is never ``native.default_scheme()``): a caller
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
