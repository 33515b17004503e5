"""Hub ids resolved offline (packcache.hub): a model named as transformers users name it (``org/name``), already in
the local Hugging Face hub cache, loads from its snapshot there; never the network, never the hub client's download
code. The hub cache is a fake one laid out on disk as the hub client lays it out (blobs, snapshots of relative
symlinks, refs), over tiny random checkpoints made here (nothing downloaded)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.checkpoints import hub_snapshot, tiny_bert
from packcache import FormatError, UntrustedFileError, hf, hub
from packcache.fleet import names

SRC = Path(__file__).resolve().parents[1] / "src"
REPO = "test-org/tiny-bert"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding ``test-org/tiny-bert`` at ``main`` and at the tag ``v1`` (one commit)."""
    base = tmp_path_factory.mktemp("hub")
    source = tiny_bert(base / "source", seed=3)
    hub_snapshot(base / "hub", REPO, source, commit=COMMIT, refs=("main", "v1"))
    return base / "hub"


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """``HF_HUB_CACHE`` the fake cache, a private default cache directory, and no socket may connect."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("PACKCACHE_DIR", str(tmp_path / "caches"))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return hub_cache


def test_the_hub_cache_is_found_where_the_hub_client_puts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    assert hub.hub_cache_dir() == "/home/u/.cache/huggingface/hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert hub.hub_cache_dir() == "/x/huggingface/hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hub.hub_cache_dir() == "/home/u/hf/hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "/legacy")
    assert hub.hub_cache_dir() == "/legacy"
    monkeypatch.setenv("HF_HUB_CACHE", "/explicit")
    assert hub.hub_cache_dir() == "/explicit"
    # huggingface_hub's own constants agree (imported in a child, read, nothing of it called)
    variables = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"
    for env in ({"HF_HUB_CACHE": "/explicit"}, {"HF_HOME": "/h"}, {"XDG_CACHE_HOME": "/x"}, {}):
        for name in variables:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True)
        assert done.stdout.strip() == hub.hub_cache_dir(), (env, done.stdout, done.stderr)


def test_a_hub_id_resolves_to_its_snapshot_by_ref_tag_or_commit(offline: Path) -> None:
    snapshot = str(offline / f"models--test-org--tiny-bert/snapshots/{COMMIT}")
    assert hub.resolve_model(REPO) == snapshot
    assert hub.resolve_model(f"{REPO}@main") == hub.resolve_model(f"{REPO}@v1") == snapshot
    assert hub.resolve_model(f"{REPO}@{COMMIT}") == snapshot
    assert hub.resolve_model(str(offline)) == str(offline)  # a local path is returned as given
    # the rule of what is local is one rule
    assert names.is_local_path is hub.is_local_path


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("../etc/passwd", ValueError),  # a local path by its shape: returned as given, never made a hub path
        ("org/../../x", ValueError),
        ("a/b/c", ValueError),
        ("org/na--me", ValueError),
        ("org/name@../../refs", ValueError),
        ("org/name@", ValueError),
        ("org/name@" + "x" * 300, ValueError),
        (".hidden/x", ValueError),
    ],
)
def test_a_name_that_is_not_a_hub_id_never_becomes_a_path(offline: Path, name: str, error: type) -> None:
    if hub.spelled_as_path(name):  # a local path by its shape: never made a hub path; nothing there here
        with pytest.raises(FileNotFoundError, match="no such model"):
            hub.resolve_model(name)
        return
    with pytest.raises(error, match=r"hub id|revision"):
        hub.resolve_model(name)


def test_what_a_ref_holds_is_checked(offline: Path, tmp_path: Path) -> None:
    source = offline / "models--test-org--tiny-bert" / "snapshots" / COMMIT
    fake = tmp_path / "hub2"
    folder = fake / "models--o--m"
    (folder / "refs").mkdir(parents=True)
    (folder / "snapshots").mkdir()
    os.symlink(source, folder / "snapshots" / COMMIT)
    (folder / "refs" / "main").write_text("../../../../etc")
    with pytest.raises(FormatError, match="not a 40-hex commit"):
        hub.snapshot_path("o/m", cache_dir=fake)
    (folder / "refs" / "main").write_text(COMMIT.upper())
    with pytest.raises(FormatError, match="not a 40-hex commit"):
        hub.snapshot_path("o/m", cache_dir=fake)
    (folder / "refs" / "main").write_text(COMMIT + "\n")  # a trailing newline is what a hand-written ref has
    assert hub.snapshot_path("o/m", cache_dir=fake) == str(folder / "snapshots" / COMMIT)
    os.unlink(folder / "refs" / "main")
    os.mkfifo(folder / "refs" / "main")  # refused at once, never waited on
    with pytest.raises(UntrustedFileError):
        hub.snapshot_path("o/m", cache_dir=fake)


def test_a_name_not_in_the_hub_cache_is_one_line_naming_where_it_looked(offline: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        hf.from_pretrained("test-org/absent", "int8")
    message = str(caught.value)
    assert "\n" not in message and str(offline / "models--test-org--absent" / "refs" / "main") in message, message
    assert "HF_HUB_CACHE" in message and "nothing is downloaded" in message
    with pytest.raises(FileNotFoundError, match=f"snapshots/{'f' * 40}"):
        hf.from_pretrained(f"{REPO}@{'f' * 40}", "int8")
    with pytest.raises(FileNotFoundError, match="refs/v2"):
        hf.from_pretrained(f"{REPO}@v2", "int8")


def test_a_hub_id_loads_from_the_local_hub_cache_offline(offline: Path, tmp_path: Path) -> None:
    """from_pretrained, tokenizer, pack_count and default_cache_path take the hub id as transformers does, and name
    the same content-named file as the snapshot directory itself (the hub's blobs are named by their sha256)."""
    snapshot = hub.resolve_model(REPO)
    model = hf.from_pretrained(REPO, "int8")
    stats = model.packcache.stats()
    assert stats.state == "stored" and model.packcache.path == str(hf.default_cache_path(REPO, "int8")), stats
    assert hf.default_cache_path(REPO, "int8") == hf.default_cache_path(snapshot, "int8")
    assert hf.pack_count(REPO, "int8") == hf.pack_count(snapshot, "int8")
    ids = torch.tensor([[101, 2023, 2003, 102]])
    with torch.inference_mode():
        first = model(input_ids=ids).last_hidden_state
    model.packcache.close()
    again = hf.from_pretrained(f"{REPO}@{COMMIT}", "int8")
    assert again.packcache.stats().state == "mapped"
    with torch.inference_mode():
        assert torch.equal(again(input_ids=ids).last_hidden_state, first)
    again.packcache.close()
    assert hf.tokenizer(f"{REPO}@v1")("a sentence").input_ids[0] == 101


def test_a_name_with_remote_stays_a_published_name(offline: Path, tmp_path: Path) -> None:
    """``remote=`` makes the same text a published name: the store is asked (and has nothing), the hub cache is not."""
    from packcache.errors import RemoteError

    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(RemoteError) as caught:
        hf.from_pretrained(REPO, remote=str(store), allow_unsigned=True)
    assert caught.value.reason == "remote_absent", caught.value
    with pytest.raises(ValueError, match="without remote=URL"):
        hf.from_pretrained(REPO, allow_unsigned=True)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC), **env}, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_the_cli_takes_a_hub_id_and_says_in_one_line_where_it_looked(hub_cache: Path, tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(hub_cache), "PACKCACHE_DIR": str(tmp_path / "caches"), "HF_HUB_OFFLINE": "0"}
    built = _cli("build", REPO, "--scheme", "int8", "--json", env=env)
    assert built.returncode == 0, built.stderr
    build = json.loads(built.stdout)
    ran = _cli("run", "--model", REPO, "--scheme", "int8", "--json", env=env)
    assert ran.returncode == 0, ran.stderr
    run = json.loads(ran.stdout)
    assert run["cache_file"] == build["cache_file"] and run["stats"]["state"] == "mapped", (run, build)
    assert Path(build["cache_file"]).parent == tmp_path / "caches"
    for argv in (["run", "--model", "test-org/absent"], ["build", "test-org/absent"]):
        done = _cli(*argv, env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert str(hub_cache / "models--test-org--absent" / "refs" / "main") in lines[0], lines[0]
    done = _cli("run", "--model", "test-org/absent", env=env)
    assert "for a published name give --remote URL" in done.stderr


# --------------------------------------------------------------------------- a directory another user plants at a name

NAME = "org/m-int8"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``org/m-int8``: the MiniLM loader's file of a tiny BERT (what ``run`` and ``serve`` map), published signed to a
    directory store; the public key that trusts it."""
    from harness.keys import make_keys
    from packcache.fleet.publish import publish
    from packcache.models import minilm

    base = tmp_path_factory.mktemp("published")
    genuine = tiny_bert(base / "genuine", seed=11)
    keys = make_keys(base, "ci")
    built = base / "built" / "m.pcache"
    minilm.load("int8", cache=built, model_path=genuine).close()
    store = base / "store"
    store.mkdir()
    publish(built, str(store), private_key=str(keys["ci"]), sources=[str(genuine)], name=NAME)
    return {"store": store, "pub": keys["ci.pub"], "built": built}


def _plant(env: Any) -> Path:
    """A sticky world-writable directory (as /tmp is) in which the real user ``nobody`` made ``org/m-int8``: a BERT
    checkpoint of its own (another seed), the way nobody would, with ``mkdir`` and ``cp``."""
    from harness.driver import NOBODY

    d = env.case_dir("planted-name")
    shared = d / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    source = tiny_bert(d / "nobodys", seed=12)
    for path in (source, *source.iterdir()):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    for argv in (["mkdir", str(shared / "org")], ["cp", "-r", str(source), str(shared / NAME)]):
        subprocess.run(["runuser", "-u", "nobody", "--", *argv], check=True, capture_output=True)
    assert os.stat(shared / NAME).st_uid == NOBODY
    return shared


def _cli_in(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "packcache", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})}, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.root
def test_a_directory_nobody_plants_never_stands_in_for_a_signed_name(
    env: Any, published: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run/serve/build --model org/m-int8 --remote URL --trusted-key PUB``, run by root from a directory another
    user can write: the unsigned checkpoint ``nobody`` planted at ``./org/m-int8`` was loaded (an existing path was a
    path), with no fetch, no signature check and no warning, while ``hf.from_pretrained`` refused the same call. Now
    one rule reads the name for the library and every command: with a store, a name is the published one, checked;
    the local path spelled the same is never used, and a warning names it."""
    from harness.serve import TEXTS, call, embed, server
    from packcache.models import minilm

    shared = _plant(env)
    node = tmp_path / "node"
    fetched = str(node / "org--m-int8.pcache")
    signed = ["--remote", str(published["store"]), "--trusted-key", str(published["pub"]), "--cache-dir", str(node)]
    ran = _cli_in(shared, "run", "--model", NAME, *signed, "--scheme", "int8", "--json")
    assert ran.returncode == 0, ran.stderr
    data = json.loads(ran.stdout)
    assert data["cache_file"] == fetched, (data["cache_file"], ran.stderr)
    assert data["stats"]["state"] == "mapped" and data["stats"]["stored"] == 0, data["stats"]
    assert f"the local path {shared / NAME} is not used" in ran.stderr, ran.stderr
    assert [p.name for p in node.glob("*.pcache")] == ["org--m-int8.pcache"], "something was packed from ./org"
    assert Path(fetched).read_bytes() == published["built"].read_bytes()
    built = _cli_in(shared, "build", NAME, *signed, "--json")
    assert built.returncode == 0 and json.loads(built.stdout)["cache_file"] == fetched, built.stderr
    # serve: the vectors it answers are the signed model's, not the planted one's
    monkeypatch.chdir(shared)
    with server(tmp_path / "srv", "--model", NAME, *signed, workers=1) as srv:
        _, served = embed(srv, TEXTS[:3])
        _, (_, listed) = call(srv, "GET", "/v1/models")
    # served under the name it was given and fetched by, not the planted directory's base name ("m-int8")
    assert [card["id"] for card in json.loads(listed)["data"]] == [NAME], listed
    signed_model = minilm.load(model_path=fetched)
    planted = minilm.load("int8", cache=False, model_path=f"./{NAME}")
    try:
        expected, other = signed_model.embed(TEXTS[:3]), planted.embed(TEXTS[:3])
    finally:
        signed_model.close()
        planted.close()
    assert np.allclose(served, expected, atol=1e-4), "serve answered another model's vectors"
    assert not np.allclose(served, other, atol=1e-2)
    # the library: the same call, the same file
    model = hf.from_pretrained(NAME, remote=str(published["store"]), trusted_keys=[published["pub"]], cache_dir=node)
    try:
        assert model.packcache_fetch.path == fetched and model.packcache.path == fetched
    finally:
        model.packcache.close()


@pytest.mark.root
def test_a_bare_name_another_user_planted_is_refused_without_a_store(env: Any, hub_cache: Path) -> None:
    """Without a store, a bare name that exists as a relative path was that path, whoever made it: from a directory
    other users can write, ``nobody`` chose what ``--model org/m-int8`` (meant as a hub id) loaded. A path taken for a
    bare name must now be one no other user could have put there (``_paths.replaceable``); spelled ``./org/m-int8`` it
    is the path asked for; a relative directory of root's in root's directory is still taken."""
    shared = _plant(env)
    ran = _cli_in(shared, "run", "--model", NAME, "--json", env={"HF_HUB_CACHE": str(hub_cache)})
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(lines) == 1, (ran.returncode, ran.stderr)
    assert f"untrusted model path {NAME}: {shared / 'org'} is owned by uid 65534" in lines[0], lines[0]
    assert f"spell it ./{NAME}" in lines[0], lines[0]
    previous = os.getcwd()
    os.chdir(shared)
    try:
        with pytest.raises(UntrustedFileError, match="owned by uid 65534"):
            hub.resolve_model(NAME)
        with pytest.raises(UntrustedFileError, match="owned by uid 65534"):
            hf.default_cache_path(NAME, "int8")
        assert hub.resolve_model(f"./{NAME}") == f"./{NAME}"  # spelled as a path: the path asked for
        assert hub.model_argument(Path(NAME)).kind == "path"  # so is a pathlib.Path
        assert hub.model_argument(NAME, remote=True).kind == "name"
    finally:
        os.chdir(previous)
    mine = env.case_dir("roots-own")
    tiny_bert(mine / "org" / "m", seed=3)
    os.chdir(mine)
    try:
        assert hub.model_argument("org/m") == hub.ModelArgument("path", "org/m", "./org/m")
    finally:
        os.chdir(previous)


def test_the_hub_cache_is_never_relative_to_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative ``$XDG_CACHE_HOME`` placed the hub cache under the working directory, where a hub id was then
    resolved: it is ignored, as the XDG base directory specification says."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert hub.hub_cache_dir() == "/home/u/.cache/huggingface/hub"
    with pytest.raises(FileNotFoundError, match=r"hub cache /home/u/\.cache/huggingface/hub \(~/\.cache/hugg"):
        hub.resolve_model("test-org/absent")
