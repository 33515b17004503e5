"""No secret of a store URL is ever shown: one redaction for every place a URL is shown.

Every output path is driven with URLs carrying ``user:pass@`` and token query parameters, against a real
S3 server (moto, which ignores them: obstore sends its own signed requests) and a refused port: the
reports (``PublishReport``, ``FetchReport``), ``stats().remote_error`` and the options channel, log lines
at every level, exception text, and the command line's text and ``--json`` output of ``publish``,
``fetch``, ``probe``, ``run`` and ``build``, on success and on failure. No secret may appear in any.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness.checkpoints import tiny_bert
from harness.keys import make_keys
from harness.s3server import S3Server
from packcache._storeurl import parse_store_url
from packcache.errors import RemoteError
from packcache.fleet import fetch as fleet_fetch
from packcache.fleet.publish import publish
from packcache.format import canonical_key

SRC = Path(__file__).resolve().parents[1] / "src"
PLATFORM = {"packers": [{"id": "test.f32", "version": 1}], "cpu": "test"}
SECRETS = ("hunter2pass", "sigSECRETabc", "tokSECRETxyz", "frSECRET")


def _secret_url(base: str, *, user: bool = True) -> str:
    """``base`` (``scheme://host/path``) with a password, a signature, a token and a fragment added."""
    scheme, rest = base.split("://", 1)
    auth = "AKIAUSER:hunter2pass@" if user else ""
    return f"{scheme}://{auth}{rest}?X-Amz-Signature=sigSECRETabc&token=tokSECRETxyz#frSECRET"


def _clean(text: Any, where: str) -> None:
    shown = text if isinstance(text, str) else json.dumps(text, default=str)
    for secret in SECRETS:
        assert secret not in shown, f"{where} shows {secret!r}: {shown[:600]}"


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_keys(tmp_path_factory.mktemp("keys"), "ci")


def build(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {f"layer{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(3)}
    with packcache.WeightCache(path, platform=PLATFORM) as cache, cache.session() as s:
        for name, array in arrays.items():
            s.get_or_pack(name, lambda a=array: a, {"packer": "test.f32", "version": 1})
    return arrays


def load(path: Path, arrays: dict[str, np.ndarray], **remote: Any) -> packcache.WeightCache:
    cache = packcache.WeightCache(path, platform=PLATFORM, **remote)
    with cache.session() as s:
        for name, array in arrays.items():
            s.get_or_pack(name, lambda a=array: a, {"packer": "test.f32", "version": 1})
    return cache


def _cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(SRC), **env}
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=timeout, env=environment,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_no_library_output_shows_a_store_secret(
    tmp_path: Path, keys: dict[str, Path], moto_env: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    built = tmp_path / "a" / "model-x.pcache"
    arrays = build(built)
    url = _secret_url(f"{moto_env.url}/{uuid.uuid4().hex}")
    published = publish(built, url, private_key=str(keys["ci"]))
    _clean(published.to_json(), "PublishReport")
    _clean(repr(published), "repr(PublishReport)")
    fetched = fleet_fetch.fetch(url, tmp_path / "b" / "model-x.pcache", platform=canonical_key(PLATFORM),
                                trusted_keys=[keys["ci.pub"].read_bytes()])  # fmt: skip
    assert fetched.downloaded
    _clean(fetched.to_json(), "FetchReport")
    _clean(repr(fetched), "repr(FetchReport)")
    # Read-through, fetched: the INFO line names the store.
    cache = load(tmp_path / "c" / "model-x.pcache", arrays, remote=url, trusted_keys=[keys["ci.pub"]])
    assert cache.stats().remote_hits == 1
    _clean(repr(cache), "repr(WeightCache)")
    cache.close()
    # Failures: a refused HTTP store (obstore's own error text) and an absent manifest on S3.
    refused = _secret_url(f"http://127.0.0.1:{_refused_port()}/fleet")
    for remote in (refused, _secret_url(f"{moto_env.url}/{uuid.uuid4().hex}")):
        cache = load(tmp_path / uuid.uuid4().hex / "model-x.pcache", arrays, remote=remote, remote_timeout=5)
        stats = cache.stats()
        assert stats.remote_error, stats
        _clean(stats.remote_error, "stats().remote_error")
        _clean(cache.get_option("packed_cache_remote_error"), "packed_cache_remote_error")
        _clean(packcache.aggregate_stats().remote_error, "aggregate_stats().remote_error")
        cache.close()
        with pytest.raises(RemoteError) as raised:
            fleet_fetch.fetch(remote, tmp_path / "d" / "model-x.pcache", platform=canonical_key(PLATFORM),
                              timeout=5, allow_unsigned=True)  # fmt: skip
        _clean(str(raised.value), "str(RemoteError)")
        _clean(repr(raised.value), "repr(RemoteError)")
        _clean(raised.value.url or "", "RemoteError.url")
        _clean(str(raised.value.args), "RemoteError.args")
        _clean("".join(traceback.format_exception(raised.value)), "a RemoteError's traceback (its causes too)")
    # A bad URL's ValueError.
    with pytest.raises(ValueError) as bad:
        fleet_fetch.fetch(_secret_url("bogus://bucket/p"), tmp_path / "e" / "model-x.pcache",
                          platform=canonical_key(PLATFORM))  # fmt: skip
    _clean(str(bad.value), "ValueError")
    for record in caplog.records:
        _clean(record.getMessage(), f"log line {record.levelname}")
        if record.exc_info:
            _clean(logging.Formatter().formatException(record.exc_info), "a logged traceback")
    _clean(caplog.text, "the log")


def test_a_fetch_report_holds_the_redacted_url_only(tmp_path: Path, keys: dict[str, Path], moto_env: S3Server) -> None:
    """A store URL is parsed once, at the boundary: the report of a fetch given the URL's text or its parsed
    value carries the redacted form, in every field, its JSON and its repr."""
    built = tmp_path / "a" / "model-x.pcache"
    build(built)
    url = _secret_url(f"{moto_env.url}/{uuid.uuid4().hex}")
    publish(built, url, private_key=str(keys["ci"]))
    location = parse_store_url(url)
    assert location.raw == url and "hunter2pass" not in location.display
    for number, given in enumerate((url, location)):
        report = fleet_fetch.fetch(given, tmp_path / f"b{number}" / "model-x.pcache", platform=canonical_key(PLATFORM),
                                   trusted_keys=[keys["ci.pub"].read_bytes()])  # fmt: skip
        assert report.downloaded and report.url == location.display, report
        for field in dataclasses.fields(report):
            _clean(str(getattr(report, field.name)), f"FetchReport.{field.name}")
        _clean(repr(report), "repr(FetchReport)")
        _clean(report.to_json(), "FetchReport.to_json()")
        _clean(json.dumps(report.to_json()), "FetchReport's JSON")


def test_no_command_line_output_shows_a_store_secret(tmp_path: Path, keys: dict[str, Path], moto_s3: S3Server) -> None:
    env = {**moto_s3.env, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    checkpoint = tiny_bert(tmp_path / "ckpt", seed=3)
    made = _cli("build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir",
                str(tmp_path / "k0"), "--json", env=env)  # fmt: skip
    assert made.returncode == 0, made.stderr
    built = Path(json.loads(made.stdout)["cache_file"])
    base = f"{moto_s3.url}/{uuid.uuid4().hex}"
    url = _secret_url(base)
    outputs: dict[str, str] = {}
    for json_flag in ([], ["--json"]):
        done = _cli("publish", str(built), url, "--sign", str(keys["ci"]), "--model", str(checkpoint), *json_flag,
                    env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[f"publish {json_flag}"] = done.stdout + done.stderr
        done = _cli("fetch", url, "--model", str(checkpoint), "--scheme", "int8", "--cache-dir",
                    str(tmp_path / f"b{len(json_flag)}"), "--trusted-key", str(keys["ci.pub"]), *json_flag,
                    env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[f"fetch {json_flag}"] = done.stdout + done.stderr
        again = _cli("publish", str(built), base, "--sign", str(keys["ci"]), "--model", str(checkpoint), "--json",
                     env=env)  # fmt: skip
        manifest = json.loads(again.stdout)["manifest_key"]
        done = _cli("probe", _secret_url(f"{base}/{manifest}"), "--trusted-key", str(keys["ci.pub"]), *json_flag,
                    env=env)  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        outputs[f"probe {json_flag}"] = done.stdout + done.stderr
    refused = _secret_url(f"http://127.0.0.1:{_refused_port()}/fleet")
    for argv in (
        ["fetch", refused, "--cache", str(tmp_path / "c" / "model-x.pcache"), "--timeout", "5"],
        ["fetch", _secret_url(f"{moto_s3.url}/{uuid.uuid4().hex}"), "--cache", str(tmp_path / "c" / "model-x.pcache")],
        ["probe", _secret_url(f"http://127.0.0.1:{_refused_port()}/fleet/manifests/model-x/c.json"), "--timeout", "5"],
        ["fetch", _secret_url("bogus://bucket/p"), "--cache", str(tmp_path / "c" / "model-x.pcache")],
        ["publish", str(built), refused, "--timeout", "5", "--model", str(checkpoint)],
    ):
        done = _cli(*argv, env=env)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        outputs[f"{argv[0]} {len(outputs)}"] = done.stdout + done.stderr
    for argv in (
        ["build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir", str(tmp_path / "k1"),
         "--remote", refused, "--remote-timeout", "5", "--json"],
        ["build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir", str(tmp_path / "k2"),
         "--remote", refused, "--remote-timeout", "5"],
    ):  # fmt: skip
        done = _cli(*argv, env=env)
        assert done.returncode == 0, done.stderr
        assert "remote" in done.stdout, done.stdout
        outputs[f"{argv[0]} {len(outputs)}"] = done.stdout + done.stderr
    for where, text in outputs.items():
        _clean(text, where)
