"""The command line's defaults are one rule: build -> publish -> fetch with default flags hits (one loader rule), a
remote fetch is not counted as the load's memory, ``--version``, ``--group-size`` wherever int4 is offered, and
``probe`` reads a plain path as ``publish`` and ``fetch`` read one. Real ``packcache`` processes, a directory store."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.checkpoints import tiny_bert
from harness.keys import make_keys

SRC = Path(__file__).resolve().parents[1] / "src"


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})}, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _machine(root: Path) -> dict[str, str]:
    """One machine: its own default cache directory, digest records and home (accepted generations)."""
    root.mkdir(parents=True, exist_ok=True)
    return {"PACKCACHE_DIR": str(root / "cache"), "XDG_CACHE_HOME": str(root / "xdg"),
            "PACKCACHE_DIGEST_DIR": str(root / "digests"), "HOME": str(root)}  # fmt: skip


def _json(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr
    data: dict[str, object] = json.loads(done.stdout)
    return data


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci")


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_build_publish_fetch_with_default_flags_hits(tmp_path: Path, keys: dict[str, Path], scheme: str | None) -> None:
    """Machine A builds (no --loader, no --cache) and publishes; machine B fetches (no --loader) the one file and
    ``run --model`` maps it: nothing packed. int4 is where the loaders used to differ (build's hf file, fetch's and
    run's calibrated minilm file)."""
    checkpoint = tiny_bert(tmp_path / "ckpt", seed=5)
    schemes = ["--scheme", scheme] if scheme else []
    a, b = _machine(tmp_path / "a"), _machine(tmp_path / "b")
    built = _json(_cli("build", str(checkpoint), *schemes, "--json", env=a))
    assert built["loader"] == "minilm" and built["stats"]["state"] == "stored", built  # type: ignore[index]
    store = tmp_path / "store"
    store.mkdir()
    _json(_cli("publish", str(built["cache_file"]), str(store), "--model", str(checkpoint), "--sign", str(keys["ci"]),
               "--json", env=a))  # fmt: skip
    trust = ["--trusted-key", str(keys["ci.pub"])]
    fetched = _json(_cli("fetch", str(store), "--model", str(checkpoint), *schemes, *trust, "--json", env=b))
    assert fetched["downloaded"] is True and fetched["loader"] == "minilm", fetched
    assert Path(str(fetched["path"])) == Path(b["PACKCACHE_DIR"]) / Path(str(built["cache_file"])).name
    ran = _json(_cli("run", "--model", str(checkpoint), *schemes, "--json", env=b))
    stats = ran["stats"]
    assert ran["cache_file"] == fetched["path"], ran
    assert (stats["state"], stats["stored"], stats["heap_packs"]) == ("mapped", 0, 0), stats  # type: ignore[index]


def test_a_remote_fetch_is_not_counted_as_the_load_s_memory(tmp_path: Path) -> None:
    """run --remote on an empty cache directory fetches the file inside the load (its first miss): the fetch's
    anonymous memory (download buffers and threads, hashing: ~7 MiB for MiniLM's 23 MiB file) is reported apart,
    and no warning says the load grew it."""
    a, b = _machine(tmp_path / "a"), _machine(tmp_path / "b")
    built = _json(_cli("build", "--model", _shipped(), "--scheme", "int8", "--json", env=a))
    store = tmp_path / "store"
    store.mkdir()
    _json(_cli("publish", str(built["cache_file"]), str(store), "--model", _shipped(), "--json", env=a))
    ran = _json(_cli("run", "--scheme", "int8", "--remote", str(store), "--allow-unsigned", "--json", env=b))
    stats, memory = ran["stats"], ran["memory"]
    assert (stats["remote_hits"], stats["stored"], stats["state"]) == (1, 0, "mapped"), stats  # type: ignore[index]
    assert memory["anonymous_growth_fetch"] is not None, memory  # type: ignore[index]
    assert not [w for w in ran["warnings"] if "anonymous memory grew" in w], (ran["warnings"], memory)  # type: ignore[attr-defined]
    text = _cli("run", "--scheme", "int8", "--remote", str(store), "--allow-unsigned", env=_machine(tmp_path / "c"))
    assert text.returncode == 0 and "during the fetch before it" in text.stdout, text.stdout
    assert "WARNING" not in text.stdout, text.stdout


def _shipped() -> str:
    from packcache.models import minilm

    return str(minilm.default_model_path())


def test_version_is_the_installed_distribution_s() -> None:
    done = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"packcache {importlib.metadata.version('packcache')} ("), done.stdout
    assert str(SRC / "packcache") in done.stdout  # which copy runs


def test_group_size_is_offered_wherever_int4_is(tmp_path: Path) -> None:
    from packcache.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    offering = []
    for name, sub in commands.items():
        options = {o: a for a in sub._actions for o in a.option_strings}
        if "--scheme" in options and "int4" in (options["--scheme"].choices or ()):
            offering.append(name)
            assert "--group-size" in options, f"{name} offers --scheme int4 without --group-size"
    assert {"run", "serve", "build", "fetch", "probe", "platform"} <= set(offering), offering
    checkpoint = tiny_bert(tmp_path / "ckpt", seed=6)
    env = _machine(tmp_path / "m")
    files = {}
    for size in ("32", "64"):
        argv = ["run", "--model", str(checkpoint), "--scheme", "int4", "--group-size", size, "--json"]
        ran = _json(_cli(*argv, env=env))
        assert ran["stats"]["state"] == "stored", ran  # type: ignore[index]
        files[size] = ran["cache_file"]
    assert files["32"] != files["64"]
    built = _json(_cli("build", str(checkpoint), "--scheme", "int4", "--group-size", "64", "--json", env=env))
    assert built["cache_file"] == files["64"] and built["stats"]["state"] == "mapped", built  # type: ignore[index]
    # the file's own group size, unless given: a cache file as --model
    again = _json(_cli("run", "--model", str(files["64"]), "--json", env=env))
    assert again["stats"]["state"] == "mapped", again  # type: ignore[index]


def test_probe_reads_a_plain_path_as_publish_and_fetch_do(tmp_path: Path, keys: dict[str, Path]) -> None:
    checkpoint = tiny_bert(tmp_path / "ckpt", seed=8)
    env = _machine(tmp_path / "m")
    built = _json(_cli("build", str(checkpoint), "--scheme", "int8", "--json", env=env))
    store = tmp_path / "store"
    store.mkdir()
    published = _json(_cli("publish", str(built["cache_file"]), str(store), "--model", str(checkpoint), "--sign",
                           str(keys["ci"]), "--json", env=env))  # fmt: skip
    manifest = store / str(published["manifest_key"])
    trust = ["--trusted-key", str(keys["ci.pub"])]
    probed = _cli("probe", str(manifest), *trust, "--json", env=env)
    assert probed.returncode == 0, (probed.stdout, probed.stderr)
    report = json.loads(probed.stdout)
    assert report["verdict"] == "compatible" and report["manifest_generation"] == 1, report
    unverified = _cli("probe", str(manifest), "--json", env=env)  # read as a manifest: its signature counts
    assert unverified.returncode == 6, (unverified.stdout, unverified.stderr)
    blob = _cli("probe", str(store / str(published["blob_key"])), "--json", env=env)
    assert blob.returncode == 0, (blob.stdout, blob.stderr)
    assert _cli("probe", str(built["cache_file"]), env=env).returncode == 0  # a local cache file, as before
    done = _cli("probe", str(store), env=env)  # the store itself: one line saying what to give
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "directory store" in lines[0], done.stderr
    loose = tmp_path / "loose.json"  # a manifest outside a store layout: read as a store's object, not applicable
    loose.write_text(manifest.read_text())
    done = _cli("probe", str(loose), env=env)
    assert done.returncode == 5 and "not a manifest's key" in done.stdout, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
