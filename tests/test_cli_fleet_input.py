"""Bad input to the fleet commands: one line on stderr and exit 2, never a traceback,
and nothing reaches a store: every argument is checked before the first store call.

Each row runs a real ``packcache`` process against a real directory store and a real cache file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import packcache
from packcache.fleet.manifest import generate_key, public_path_for

SRC = Path(__file__).resolve().parents[1] / "src"
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "XDG_CACHE_HOME": str(home / "xdg"), "HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=120, env=env,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    with packcache.WeightCache(path, platform=PLATFORM) as cache, cache.session() as s:
        s.get_or_pack("layer0", lambda: array, {"packer": "test.f32", "version": 1})


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Path]:
    store = tmp_path / "store"
    store.mkdir()
    good = tmp_path / "built" / "model-x.pcache"
    _build(good)
    spaced = tmp_path / "built" / "my model.pcache"
    _build(spaced)
    generate_key(tmp_path / "ci.pem")
    return {"store": store, "good": good, "spaced": spaced, "home": tmp_path,
            "pub": Path(public_path_for(tmp_path / "ci.pem"))}  # fmt: skip


BAD = [
    # (name, argv with {store} {good} {spaced} {tmp} placeholders, what stderr names)
    ("probe an unknown scheme", ["probe", "bogus://bucket/manifests/m/c.json"], "scheme"),
    ("probe a file URL with a host", ["probe", "file://host{store}/manifests/m/c.json"], "host"),
    ("fetch an unknown scheme", ["fetch", "bogus://bucket/p", "--cache", "{tmp}/c/model-x.pcache"], "scheme"),
    ("fetch a file URL with a host", ["fetch", "file://host{store}", "--cache", "{tmp}/c/model-x.pcache"], "host"),
    ("fetch a relative file URL", ["fetch", "file:relative/dir", "--cache", "{tmp}/c/model-x.pcache"], "absolute"),
    ("fetch a cache name with a space", ["fetch", "{store}", "--cache", "{tmp}/c/my model.pcache"], "my model"),
    ("fetch a cache name that is no model", ["fetch", "{store}", "--cache", "{tmp}/c/.pcache"], "model"),
    ("fetch an empty URL", ["fetch", "", "--cache", "{tmp}/c/model-x.pcache"], "URL"),
    ("fetch a URL with a NUL-like port", ["fetch", "s3://bucket:99999/p", "--cache", "{tmp}/c/model-x.pcache"], "port"),
    ("publish expiring in inf days", ["publish", "{good}", "{store}", "--expires-days", "inf"], "expires-days"),
    ("publish expiring in nan days", ["publish", "{good}", "{store}", "--expires-days", "nan"], "expires-days"),
    ("publish expiring in -1 days", ["publish", "{good}", "{store}", "--expires-days", "-1"], "expires-days"),
    ("publish expiring in 1e30 days", ["publish", "{good}", "{store}", "--expires-days", "1e30"], "expires-days"),
    ("publish a file whose name is no model", ["publish", "{spaced}", "{store}"], "my model"),
    ("publish to an unknown scheme", ["publish", "{good}", "bogus://bucket/p"], "scheme"),
    ("publish to a file URL with a host", ["publish", "{good}", "file://host{store}"], "host"),
    ("publish with a builder too long", ["publish", "{good}", "{store}", "--builder", "b" * 300], "--builder"),
    (
        "publish with a control character in the builder",
        ["publish", "{good}", "{store}", "--builder", "a\x1bb"],
        "--builder",
    ),
    ("publish signed by a public key", ["publish", "{good}", "{store}", "--sign", "{pub}"], "key"),
    ("publish signed by a missing key", ["publish", "{good}", "{store}", "--sign", "{tmp}/none.pem"], "none.pem"),
    ("run with an unknown remote scheme", ["run", "--remote", "bogus://bucket/p"], "scheme"),
    ("build with a remote file URL with a host", ["build", "{tmp}", "--remote", "file://host/x"], "host"),
    ("serve with an unknown remote scheme", ["serve", "--remote", "bogus://bucket/p"], "scheme"),
]


@pytest.mark.parametrize(("name", "argv", "named"), BAD, ids=[row[0] for row in BAD])
def test_bad_input_is_one_line_exit_2_nothing_uploaded(
    setup: dict[str, Path], name: str, argv: list[str], named: str
) -> None:
    values = {"store": str(setup["store"]), "good": str(setup["good"]), "spaced": str(setup["spaced"]),
              "tmp": str(setup["home"]), "pub": str(setup["pub"])}  # fmt: skip
    # A key that cannot be loaded is not a usage error (the file may be unreadable): exit 1, but it is
    # found before the upload.
    expected = 1 if "{tmp}/none.pem" in argv or "{pub}" in argv else 2
    done = _cli(*(a.format(**values) for a in argv), home=setup["home"])
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == expected, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) >= 1 and named in lines[-1], done.stderr
    assert list(setup["store"].iterdir()) == [], "something was uploaded"
