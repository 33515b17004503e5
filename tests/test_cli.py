"""The packcache command line (``packcache.cli``): inspect, verify, compact, gc, what ``serve`` checks in the
master before any worker starts, and ``$PACKCACHE_KERNEL_PATH`` at startup (``run`` is in test_cli_run.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import build, plant_socket, without_build_compaction
from harness.serve import SRC
from packcache import WeightCache
from packcache import format as fmt
from packcache._sidefiles import lock_path_for
from packcache.cli import main, sanitize
from packcache.kernels import KERNEL_PATH_ENV, cpu_kernels
from test_kernels import _other_path
from test_maintenance import cli
from test_minilm import config, fifo, variant, write


def build_fp32(path: Path, names: list[str], version: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    """A cache of one float32 array per name, packed by packer ``fp32`` at ``version``; returns the arrays."""
    arrays = {n: np.full(1000 + i, i + version, np.float32) for i, n in enumerate(names)}
    build(path, arrays, key={"packer": "fp32", "version": version})
    return arrays


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_help_on_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "Exit codes" in capsys.readouterr().out
    for command in ("run", "inspect", "verify", "compact", "gc"):
        assert main([command, "--help"]) == 0
        assert "--json" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["gc", "/tmp"]) == 2  # --max-bytes is required
    assert "usage" in capsys.readouterr().err


def test_inspect_lists_header_and_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.pcache"
    with without_build_compaction():  # a file as packcache left it before builds compacted
        build_fp32(path, ["a", "b"])
        build_fp32(path, ["a", "b"], version=2)  # supersedes both: reclaimable bytes appear
    code, info = run_json(capsys, "inspect", str(path))
    assert code == 0 and info["generation"] == 2 and info["alignment"] == 64
    assert [(e["name"], e["packer"], e["dtype"], e["shape"]) for e in info["entries"]] == [
        ("a", "fp32/2", "f4", [1000]),
        ("b", "fp32/2", "f4", [1001]),
    ]
    assert info["live_bytes"] == 8004 and info["reclaimable_bytes"] >= 8004
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "generation 2" in text and "fp32/2" in text and "reclaimable by compaction" in text


def test_inspect_sanitises_hostile_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.pcache"
    build_fp32(path, ["evil\x1b]0;pwned\x07\x1b[2J", "ok"])
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07" in out
    assert sanitize("tab\there") == "tab\\there"


@pytest.mark.parametrize("command", ["inspect", "verify", "compact"])
def test_hostile_file_is_a_clean_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = tmp_path / "m.pcache"
    path.write_bytes(fmt.MAGIC + b"\xff" * 6000)
    code = main([command, str(path)])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err + captured.out
    assert "checksum" in captured.err + captured.out


def test_missing_file_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 1
    assert "No such file" in capsys.readouterr().err


def test_verify_ok_then_names_the_flipped_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.pcache"
    build_fp32(path, ["a", "b", "c"])
    code, report = run_json(capsys, "verify", str(path))
    assert code == 0 and report["ok"] and report["entries"] == 3
    _, info = run_json(capsys, "inspect", str(path))
    b = next(e for e in info["entries"] if e["name"] == "b")
    with open(path, "r+b") as f:
        f.seek(b["offset"] + 100)
        f.write(b"\x00\x01")
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"entry 'b' at offset {b['offset']}" in out


def test_compact_reclaims_and_keeps_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.pcache"
    with without_build_compaction():
        build_fp32(path, ["a", "b"])
        arrays = build_fp32(path, ["a", "b"], version=2)
    code, report = run_json(capsys, "compact", str(path))
    assert code == 0 and report["reclaimed_bytes"] > 8000 and report["entries"] == 2
    with WeightCache(path) as cache, cache.session() as s:
        for n, a in arrays.items():
            assert np.array_equal(
                s.get_or_pack(n, lambda: pytest.fail("hit expected"), key={"packer": "fp32", "version": 2}), a
            )


def test_gc_removes_stale_then_least_recently_used_but_never_a_locked_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = ["old", "mid", "new", "busy"]
    for i, name in enumerate(names):
        build_fp32(tmp_path / f"{name}.pcache", [f"w{j}" for j in range(8)])
        t = time.time() - 1000 * (len(names) - i)
        os.utime(tmp_path / f"{name}.pcache", (t, t))
    os.utime(tmp_path / "busy.pcache", (0, 0))  # least recently used of all, but locked below
    (tmp_path / "corrupt.pcache").write_bytes(fmt.MAGIC + bytes(5000))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a builder that died: its pid names no process now
    orphan = f".x.pcache.tmp-{gone.pid}-0123456789abcdef"
    (tmp_path / orphan).write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a cache file")
    size = (tmp_path / "old.pcache").stat().st_size
    holder = os.open(tmp_path / "busy.pcache.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        code, report = run_json(capsys, "gc", str(tmp_path), "--max-bytes", str(3 * size))
    finally:
        os.close(holder)
    removed = [Path(r["path"]).name for r in report["removed"]]
    assert set(removed[:2]) == {orphan, "corrupt.pcache"}, "stale files go first"
    assert removed[2:] == ["old.pcache"], "then the least recently used, skipping the locked one"
    assert report["skipped_locked"] == [str(tmp_path / "busy.pcache")]
    assert code == 0 and report["bytes_after"] <= 3 * size
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert left == ["busy.pcache", "mid.pcache", "new.pcache", "notes.txt"]


def test_gc_over_budget_with_only_locked_files_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_fp32(tmp_path / "a.pcache", ["w"])
    holder = os.open(tmp_path / "a.pcache.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        code, report = run_json(capsys, "gc", str(tmp_path), "--max-bytes", "0")
    finally:
        os.close(holder)
    assert code == 1 and report["removed"] == [] and (tmp_path / "a.pcache").exists()


def test_gc_dry_run_removes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_fp32(tmp_path / "a.pcache", ["w"])
    code, report = run_json(capsys, "gc", str(tmp_path), "--max-bytes", "0", "--dry-run")
    assert code == 0 and len(report["removed"]) == 1 and (tmp_path / "a.pcache").exists()


def test_python_dash_m_on_a_real_terminal(tmp_path: Path) -> None:
    """A real subprocess on a pseudo-terminal with a real size: output is clean text, exit 0."""
    path = tmp_path / "m.pcache"
    build_fp32(path, ["a"])
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, __import__("termios").TIOCSWINSZ, b"\x18\x00\x50\x00\x00\x00\x00\x00")  # 24 x 80
    proc = subprocess.Popen(
        [sys.executable, "-m", "packcache", "inspect", str(path)], stdout=follower, stderr=follower, close_fds=True
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(30) == 0
    text = b"".join(chunks).decode()
    assert "generation 1" in text and "Traceback" not in text


# ---------------------------------------------------------------------- a non-file at the cache path


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")  # a character device, reached through a symlink in a safe directory


def _link_to_fifo(path: Path) -> None:
    os.mkfifo(path.parent / "hidden-fifo")
    path.symlink_to(path.parent / "hidden-fifo")


NOT_FILES = [_fifo, plant_socket, _directory, _device, _link_to_fifo]


@pytest.mark.parametrize("command", ["inspect", "verify", "compact"])
@pytest.mark.parametrize("plant", NOT_FILES, ids=[p.__name__.strip("_").removeprefix("plant_") for p in NOT_FILES])
def test_cli_refuses_a_non_file_at_the_cache_path_without_hanging(tmp_path: Path, command: str, plant: Any) -> None:
    path = tmp_path / "model.pcache"
    plant(path)
    locks = {f"{path}.lock", lock_path_for(str(path))}  # beside the link, and beside what it names (/dev/zero)
    existed = {lock: os.path.lexists(lock) for lock in locks}
    done = cli(command, str(path))  # TimeoutExpired: it blocked (a FIFO opened for reading)
    assert done.returncode == 1, (done.stdout, done.stderr)
    said = done.stdout + done.stderr
    assert "Traceback" not in said and "not a regular file" in said, said
    assert {lock: os.path.lexists(lock) for lock in locks} == existed, "no lock file created for what is no cache"


# --------------------------------------------------------------------------- one line, never a traceback


@pytest.mark.parametrize("command", ["inspect", "verify", "compact"])
def test_cli_names_a_hostile_path_on_one_sanitised_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = tmp_path / "evil\x1b[2J\nname.pcache"
    for make in (lambda: None, lambda: path.write_bytes(b"\x89PKC\r\n\x1a\n" + b"\xff" * 5000)):
        make()
        assert main([command, str(path)]) == 1
        captured = capsys.readouterr()
        said = captured.err or captured.out
        assert "\x1b" not in said and "Traceback" not in said and "evil\\x1b[2J\\nname" in said
        if captured.err:
            assert captured.err.count("\n") == 1


def test_cli_gc_on_something_that_is_no_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["gc", str(tmp_path / "file"), "--max-bytes", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("packcache gc: ENOTDIR") and err.count("\n") == 1


# ----------------------------------------- serve checks the model directory before any worker starts


def serve_until_exit(argv: list[str], timeout: float = 90.0) -> tuple[int | None, str]:
    """Run ``packcache serve ARGV`` in its own session until it exits or ``timeout`` passes (then the whole group
    is killed: a worker stuck on a FIFO outlives its master); its exit code (None: it was still running) and stderr."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "packcache", "serve", "--port", "0", "--torch-threads", "1", *argv]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    code: int | None = None
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        err = "(still running)"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if code is None:
            err = (proc.communicate(timeout=10)[1] or "") + err  # reaps it and closes the pipe
    return code, err


@pytest.mark.parametrize(
    ("edit", "file", "says"),
    [
        (fifo("tokenizer.json"), "tokenizer.json", "not a regular file (a FIFO)"),
        (fifo("config.json"), "config.json", "not a regular file (a FIFO)"),
        (config(num_attention_heads=0), "config.json", "num_attention_heads"),
        (config(num_hidden_layers=10_000_000), "config.json", "num_hidden_layers 10000000"),
        (write("tokenizer.json", "[]"), "tokenizer.json", "tokenizers library"),
    ],
    ids=["fifo-tokenizer", "fifo-config", "zero-heads", "absurd-layers", "bad-tokenizer"],
)
@pytest.mark.parametrize("cache", ["--cache-dir", "--no-cache"])
def test_serve_refuses_a_bad_model_directory_in_one_line_before_any_worker_starts(
    base: Path, tmp_path: Path, edit: Callable[[Path], None], file: str, says: str, cache: str
) -> None:
    directory = variant(base, tmp_path / "model", edit)
    where = [cache, str(tmp_path / "cache")] if cache == "--cache-dir" else [cache]
    code, err = serve_until_exit(["--model", str(directory), "--workers", "2", *where])
    assert code == 1, f"serve did not stop with exit 1 (exit {code}): {err[-2000:]}"
    assert err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("packcache serve: cannot load the model: ") and f"/{file}" in err and says in err, err


# ------------------------------------------------- no such model: one line naming what was given, one exit code


def test_no_such_model_is_one_line_naming_what_was_given_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run/serve --model /missing/dir`` named ``/missing/config.json`` and exited 1, ``run --model notamodel``
    printed a raw ``[Errno 2]``, an uncached hub id exited 2 with a hint that omitted the directory it had searched.
    Every command that takes a model now says, in one line, "no such model", what was given, and where it looked
    (the path; the hub cache and what placed it there); exit 2 (a usage error), whichever it is."""
    from harness.cli_child import run_cli_cases

    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    store = tmp_path / "store"
    store.mkdir()
    built = tmp_path / "m.pcache"
    build(built, {"w": (1, 4096)})
    models = {"absolute": "/missing/dir", "relative": "./missing/dir", "file": "/missing/m.pcache",
              "hub-id": "notamodel", "org-hub-id": "org/notamodel", "neither": "not a model"}  # fmt: skip
    commands = {
        "run": lambda m: ["run", "--model", m, "--cache-dir", str(tmp_path / "c")],
        "build": lambda m: ["build", m, "--cache-dir", str(tmp_path / "c")],
        "serve": lambda m: ["serve", "--model", m, "--cache-dir", str(tmp_path / "c")],
        "fetch": lambda m: ["fetch", str(store), "--model", m, "--cache-dir", str(tmp_path / "c")],
        "publish": lambda m: ["publish", str(built), str(store), "--model", m],
    }
    cases = [(f"{c}/{k}", argv(m)) for c, argv in commands.items() for k, m in models.items()]
    outcomes = run_cli_cases(cases, seconds=60)
    for name, outcome in outcomes.items():
        kind = name.split("/")[1]
        err = outcome["stderr"]
        assert outcome.get("rc") == 2 and len(err.strip().splitlines()) == 1, (name, outcome)
        assert "no such model: " in err and repr(models[kind]) in err and "Errno" not in err, (name, err)
        if kind.endswith("hub-id"):
            assert f"Hugging Face hub cache {hub} ($HF_HUB_CACHE)" in err, (name, err)
        elif kind != "neither":
            assert "does not exist" in err and os.path.abspath(models[kind]) in err, (name, err)
    assert list(store.iterdir()) == [] and not (tmp_path / "c").exists()


# ------------------------------------- $PACKCACHE_KERNEL_PATH checked at startup; --kernel-path wins over it


def test_the_command_line_names_the_variable_and_its_values_as_the_library_does() -> None:
    from packcache.cli import _model
    from packcache.kernels import KERNEL_PATHS

    assert _model._KERNEL_PATH_ENV == KERNEL_PATH_ENV
    assert sorted(_model._KERNEL_PATH_CHOICES) == sorted(["auto", *KERNEL_PATHS])


def _cli(tmp_path: Path, env_value: str | None, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != KERNEL_PATH_ENV}
    if env_value is not None:
        env[KERNEL_PATH_ENV] = env_value
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, "-m", "packcache", *argv],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--no-cache", "--scheme", "int8"],
        ["build", "no-such-checkpoint", "--cache-dir", "."],
        ["serve", "--port", "0", "--workers", "1", "--no-cache", "--scheme", "int8"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_invalid_environment_value_without_a_choice_is_one_usage_error_at_startup(
    tmp_path: Path, argv: list[str]
) -> None:
    """No ``--kernel-path``: a bad ``$PACKCACHE_KERNEL_PATH`` stops ``run``, ``build`` and ``serve`` before
    anything loads or listens, with one line naming the variable and exit 2 (as a bad ``--kernel-path``)."""
    started = time.monotonic()
    done = _cli(tmp_path, "gpu", *argv, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and KERNEL_PATH_ENV in lines[0] and "'gpu'" in lines[0], done.stderr[-3000:]
    assert lines[0].startswith(f"packcache {argv[0]}: ") and "unset it" in lines[0], lines
    assert ("--kernel-path" in lines[0]) == (argv[0] != "build"), lines  # build has no such option
    assert done.stdout == "" and "listening" not in done.stderr
    assert time.monotonic() - started < 60


def test_an_explicit_cli_kernel_path_wins_over_the_environment(tmp_path: Path) -> None:
    """``--kernel-path fp32`` runs with an invalid ``$PACKCACHE_KERNEL_PATH``; ``--kernel-path auto`` is the
    machine's rule whatever the variable says (it is an explicit choice too)."""
    done = _cli(tmp_path, "gpu", "run", "--no-cache", "--scheme", "int8", "--kernel-path", "fp32", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["kernel_path"] == "fp32"
    done = _cli(tmp_path, _other_path(), "run", "--no-cache", "--scheme", "int8", "--kernel-path", "auto", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["kernel_path"] == cpu_kernels().default_path
    done = _cli(tmp_path, _other_path(), "run", "--no-cache", "--scheme", "int8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["kernel_path"] == _other_path()  # no choice: the environment's
