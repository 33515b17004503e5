"""A non-regular file at the cache path never stops a load (issue 20, item 6).

A container runtime that bind-mounts a host path which did not exist creates a *directory* there: with
``-v /srv/cache/bert-int8-….pcache:…`` the cache file ``run`` and ``serve`` open is a directory. That, a FIFO,
a socket, a directory at the lock file, a file where the cache directory should be, a dangling symlink or a
symlink loop: each is a cache problem, counted under its reason with its errno (docs/ROUTING.md rows 4-5),
and the model is served from heap. ``run`` and ``build`` run through ``packcache.cli.main`` in a child
(``harness.cli_child``); ``serve`` is a real gunicorn server on 127.0.0.1 with two workers.

A directory given *as an argument* under any other name than ``*.pcache`` is still refused by the library
loaders (``minilm.load(cache=<dir>)``): it is a mistake of argument (the directory meant to hold the file),
and the message names the file to give (``tests/test_minilm.py::test_cache_argument_forms``).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.checkpoints import tiny_bert
from harness.cli_child import run_cli_cases
from harness.serve import TEXTS, assert_embeddings, call, embed, loaded_workers, server
from packcache import hf
from packcache.models import minilm


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.close()  # the socket file stays


def _lock_directory(path: Path) -> None:
    Path(f"{path}.lock").mkdir()


def _file_for_the_directory(path: Path) -> None:
    path.parent.rmdir()
    path.parent.write_text("not a directory")


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "gone" / "m.pcache")


def _loop(path: Path) -> None:
    path.symlink_to(path)


#: What sits at (or in the way of) the cache file -> (the reason, its errno, a phrase of the message).
KINDS: dict[str, tuple[Callable[[Path], None], str, int, str]] = {
    "a directory": (_directory, "open_failed", errno.EISDIR, "is a directory"),
    "a FIFO": (_fifo, "untrusted", 0, "not a regular file (a FIFO)"),
    "a socket": (_socket, "untrusted", 0, "not a regular file (a socket)"),
    "a directory at the lock file": (_lock_directory, "open_failed", errno.EISDIR, "lock file"),
    "a file for the cache directory": (_file_for_the_directory, "open_failed", errno.ENOTDIR, "Not a directory"),
    "a dangling symlink": (_dangling, "open_failed", errno.ENOENT, "No such file"),
    "a symlink loop": (_loop, "open_failed", errno.ELOOP, "symbolic links"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("model") / "tiny", hidden=32)


def planted(base: Path, name: str, path_of: Callable[[Path], Path]) -> Path:
    """A fresh cache directory under ``base`` whose cache file (``path_of(directory)``) has ``name``'s kind."""
    directory = base / name.replace(" ", "-")
    directory.mkdir()
    KINDS[name][0](path_of(directory))
    return directory


def assert_counted(stats: dict[str, Any], name: str) -> None:
    _, reason, err, phrase = KINDS[name]
    assert stats["state"] == "heap" and stats["heap_reason"] == reason, (name, stats)
    assert stats["errno"] == err and phrase in stats["error"], (name, stats)
    assert stats["heap_bytes"] == stats["heap_bytes_by_reason"][reason] > 0 and stats["mapped_bytes"] == 0, stats


def test_run_counts_any_kind_of_file_at_its_cache_path_and_embeds_from_heap(tmp_path: Path, tiny: Path) -> None:
    cases = []
    for name in KINDS:
        directory = planted(tmp_path, name, lambda d: minilm.default_cache_path("int8", model_path=tiny, cache_dir=d))
        cases.append((name, ["run", "--model", str(tiny), "--cache-dir", str(directory), "--scheme", "int8", "--json"]))
    results = run_cli_cases(cases)
    for name, result in results.items():
        assert result.get("rc") == 0, (name, result)
        report = json.loads(result["stdout"])
        assert report["embeddings_shape"] == [3, 32], name
        assert_counted(report["stats"], name)
    assert (tmp_path / "a-directory" / minilm.default_cache_path("int8", model_path=tiny).name).is_dir()  # as it was


def test_run_with_the_bundled_model_and_a_directory_at_its_cache_file_still_embeds(tmp_path: Path) -> None:
    """The issue's case, end to end: ``<cache-dir>/bert-int8-<hex>.pcache`` is a directory."""
    minilm.default_cache_path("int8", cache_dir=tmp_path).mkdir()
    (result,) = run_cli_cases(
        [("bundled", ["run", "--cache-dir", str(tmp_path), "--scheme", "int8", "--json"])]
    ).values()
    assert result.get("rc") == 0, result
    report = json.loads(result["stdout"])
    assert report["embeddings_shape"] == [3, 384]
    assert_counted(report["stats"], "a directory")
    assert "EISDIR" in result["stderr"]  # the ERROR line the cache logs once, with the errno's name


def test_build_reports_a_directory_at_its_cache_file_and_exits_1_without_a_traceback(
    tmp_path: Path, tiny: Path
) -> None:
    """``build`` is a deploy step: the file must hold the model afterwards, so it fails, but as a report of the
    cache's figures (the reason and errno), not as a checkpoint it cannot load."""
    cases = []
    for loader in ("hf", "minilm"):
        directory = tmp_path / loader
        directory.mkdir()
        named = (
            hf.default_cache_path(tiny, "int8")
            if loader == "hf"
            else minilm.default_cache_path("int8", model_path=tiny)
        )
        (directory / named.name).mkdir()
        cases.append(
            (
                loader,
                ["build", str(tiny), "--loader", loader, "--scheme", "int8", "--cache-dir", str(directory), "--json"],
            )
        )
    for loader, result in run_cli_cases(cases).items():
        assert result.get("rc") == 1 and "cannot load" not in result["stderr"], (loader, result)
        assert_counted(json.loads(result["stdout"])["stats"], "a directory")


# ------------------------------------------------------------------------------------------- the library


@pytest.mark.parametrize("name", list(KINDS))
def test_the_loaders_take_any_kind_of_file_at_a_cache_file_path(tmp_path: Path, tiny: Path, name: str) -> None:
    directory = planted(tmp_path, name, lambda d: d / "model.pcache")
    with minilm.load("int8", cache=directory / "model.pcache", model_path=tiny) as model:
        assert model.embed(["a"]).shape == (1, 32)
        assert_counted(_stats(model.cache), name)
    model = hf.from_pretrained(tiny, "int8", directory / "model.pcache")
    assert_counted(_stats(model.packcache), name)
    model.packcache.close()


def test_a_directory_given_by_another_name_is_still_a_mistake_of_argument(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"is a directory; give a file path such as .*bert-int8-"):
        minilm.load("int8", cache=tmp_path, model_path=tiny)
    with pytest.raises(ValueError, match=r"is a directory; give a file path such as .*bert-int8-"):
        hf.from_pretrained(tiny, "int8", tmp_path)


def _stats(cache: Any) -> dict[str, Any]:
    stats = cache.stats()
    return {
        "state": stats.state, "heap_reason": stats.heap_reason, "errno": stats.errno, "error": stats.error,
        "heap_bytes": stats.heap_bytes, "heap_bytes_by_reason": stats.heap_bytes_by_reason,
        "mapped_bytes": stats.mapped_bytes,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------- serve


@pytest.fixture(scope="module")
def reference() -> np.ndarray[Any, Any]:
    """TEXTS embedded here by ``minilm.load("int8", cache=None)`` on one torch thread, as the workers run."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with minilm.load("int8", cache=None) as model:
            result: np.ndarray[Any, Any] = model.embed(TEXTS)
    finally:
        torch.set_num_threads(threads)
    return result


@pytest.fixture
def docker_cache_dir(tmp_path: Path) -> Iterator[Path]:
    """A cache directory whose bundled int8 cache file is a directory, as a bind mount of a missing host path leaves."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    minilm.default_cache_path("int8", cache_dir=directory).mkdir()
    yield directory


def test_serve_workers_boot_and_serve_from_heap_with_a_directory_at_the_cache_file(
    tmp_path: Path, docker_cache_dir: Path, reference: np.ndarray[Any, Any]
) -> None:
    with server(tmp_path, "--cache-dir", str(docker_cache_dir), workers=2) as srv:
        scrape = loaded_workers(srv, 2)
        for worker in scrape.workers.values():
            assert worker.current_state == "heap" and worker.current_reason == "open_failed", worker
            assert worker.values["errno"] == errno.EISDIR and worker.values["mapped_bytes"] == 0, worker
            assert (
                worker.heap_bytes["open_failed"] > 0
                and sum(worker.heap_bytes.values()) == worker.heap_bytes["open_failed"]
            )
        assert call(srv, "GET", "/healthz")[0] == 200
        health = json.loads(call(srv, "GET", "/healthz")[1][1])
        assert health["state"] == "heap" and health["heap_reason"] == "open_failed"
        assert_embeddings(embed(srv, list(TEXTS))[1], reference)
        assert set(srv.workers()) == set(scrape.workers), "no worker died or was replaced"
