"""`packcache run`: the main job, on the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import without_build_compaction
from harness.serve import SRC
from packcache import format as fmt
from packcache import native
from packcache._generations import read_committed
from packcache.cli import main
from packcache.kernels import cpu_kernels
from packcache.models import minilm
from packcache.packers_torch import Int4WeightOnly, LinearFloat32
from test_safetensors import HANG, HOSTILE, write


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["run", *argv, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


class _Cycle:
    """Unreachable garbage only a collection frees: a cycle holding 32 MiB of touched heap."""

    def __init__(self) -> None:
        self.me = self
        self.bytes = np.ones(4 << 20)


def test_garbage_from_before_a_run_is_freed_before_its_baseline_not_during_the_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a process that did work before (a program calling ``main``, a test worker), cycles it left were freed by
    whichever collection ran during the load: Anonymous "grew" by minus their size (-22.7 MiB, once in a full suite)
    and ``run`` warned that its figures were 5 % apart. The baseline is read after a collection. Automatic
    collection is off here, so only that collection can free the planted cycle."""
    import gc
    import weakref

    from packcache import memory

    argv = ("--cache-dir", str(tmp_path), "--scheme", "int8")
    run(capsys, *argv)  # stores: the run below maps
    garbage_alive: list[bool] = []
    reading = memory.smaps_rollup

    def watched(pid: int | str = "self") -> dict[str, int]:
        garbage_alive.append(planted() is not None)
        return reading(pid)

    monkeypatch.setattr(memory, "smaps_rollup", watched)
    gc.disable()
    try:
        cycle = _Cycle()
        planted = weakref.ref(cycle)
        del cycle
        second = run(capsys, *argv)
    finally:
        gc.enable()
    assert second["stats"]["state"] == "mapped" and second["stats"]["heap_bytes"] == 0
    assert garbage_alive[:2] == [False, False], garbage_alive  # freed before the first reading of the load
    assert second["warnings"] == [], second["warnings"]


def test_run_twice_stores_then_maps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = run(capsys, "--cache-dir", str(tmp_path))
    second = run(capsys, "--cache-dir", str(tmp_path))
    named = minilm.default_cache_path(minilm.default_scheme(), cache_dir=tmp_path)  # by content: bert-int8-<hex>
    assert first["cache_file"] == second["cache_file"] == str(named) and named.name.startswith("bert-")
    assert first["stats"]["state"] == "stored" and first["stats"]["stored"] > 0
    assert second["stats"]["state"] == "mapped" and second["stats"]["hits"] == first["stats"]["stored"]
    assert second["stats"]["heap_bytes"] == 0 and second["stats"]["written_bytes"] == 0
    assert set(second["stats"]) == {f.name for f in dataclasses.fields(packcache.CacheStats)}
    assert second["embeddings_shape"] == [3, 384] and second["load_seconds"] > 0
    assert second["scheme"] == minilm.default_scheme() and second["scheme_chosen"] == "auto"
    assert second["kernel_path"] == cpu_kernels().default_path and second["cpu"] == cpu_kernels().flags()
    # The default scheme's kernel: packcache's int8 product where this CPU runs it (every row count), else fp32.
    few = "packcache int8" if native.status().isa is not None else "linear(float32)"
    assert second["kernels"] and few in second["kernels"]
    # Per kind of linear layer: BERT's query, key, value and the three dense layers.
    assert set(second["kernels_by_layer"]) == {"query", "key", "value", "dense"}
    assert all(few in ops for ops in second["kernels_by_layer"].values())
    speed = second["embed"]
    assert speed["texts"] == 3 and speed["runs"] >= 3 and speed["first_ms"] > 0 and speed["median_ms"] > 0
    assert speed["texts_per_second"] == pytest.approx(3 / (speed["median_ms"] / 1000))
    memory = second["memory"]
    assert memory["cache_mapping_size"] >= second["stats"]["mapped_bytes"] > 0
    assert 0 < memory["cache_mapping_rss"] <= memory["cache_mapping_size"]
    assert second["warnings"] == [], second["warnings"]


def test_run_without_cache_reports_heap_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, "--no-cache", "--scheme", "bf16", "--text", "one sentence", "--text", "")
    stats = result["stats"]
    assert result["cache_file"] is None and stats["state"] == "off"
    assert stats["heap_bytes"] == stats["heap_bytes_by_reason"]["disabled"] > 0 and stats["mapped_bytes"] == 0
    assert result["embeddings_shape"] == [2, 384]


def test_run_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--cache-dir", str(tmp_path), "--scheme", "fp32"]) == 0
    text = capsys.readouterr().out
    for label in ("state         stored", "load", "packed        mapped", "heap reasons  none", "file", "memory"):
        assert label in text, label
    assert "kernels       path fp32 (" in text and LinearFloat32().kernels("fp32") in text
    assert "embedding     3 texts: " in text and " texts/s), first call " in text


def test_run_forces_a_kernel_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, "--cache-dir", str(tmp_path), "--scheme", "int4", "--kernel-path", "fp32")
    assert result["scheme"] == "int4" and result["scheme_chosen"] == "given" and result["kernel_path"] == "fp32"
    # what int4 runs on the fp32 path: its compiled product at every row count (torch's float32 ones without it)
    assert result["kernels"] == Int4WeightOnly().kernels("fp32")
    assert main(["run", "--no-cache", "--scheme", "fp32", "--kernel-path", "bf16"]) == 1  # fp32 runs fp32 only
    assert "has no kernel path 'bf16'" in capsys.readouterr().err


def test_run_with_a_bad_model_path_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No such model is a usage error (exit 2), naming the path given (test_cli.py has every command's)."""
    assert main(["run", "--cache-dir", str(tmp_path), "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert f"no such model: '{tmp_path / 'missing'}'" in err and "Traceback" not in err, err


def test_run_says_when_superseded_packs_outweigh_live_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A launch that maps everything writes nothing, so it cannot compact a file that an earlier packcache (whose
    builds never compacted) left mostly superseded: ``run`` says so and names ``packcache compact``."""
    argv = ("--cache-dir", str(tmp_path), "--scheme", "int8")
    first = run(capsys, *argv)
    path = first["cache_file"]
    assert first["file_reclaimable_bytes"] == 0 and first["stats"]["reclaimable_bytes"] == 0
    assert first["warnings"] == []
    with without_build_compaction(), packcache.WeightCache(path, platform=minilm.platform("int8")) as cache:
        for version, size in enumerate((16 << 20, 16)):  # stored twice: its big first copy is superseded
            with cache.session() as s:
                s.get_or_pack("retired", lambda size=size: np.zeros(size, np.float32), key={"version": version})
    second = run(capsys, *argv)
    assert second["stats"]["state"] == "mapped" and second["stats"]["written_bytes"] == 0
    report = packcache.inspect(path)
    assert second["file_reclaimable_bytes"] == second["stats"]["reclaimable_bytes"] == report.reclaimable_bytes
    assert report.reclaimable_bytes >= report.live_bytes
    (warning,) = [w for w in second["warnings"] if "superseded" in w]
    assert f"'packcache compact {path}' reclaims them" in warning
    assert main(["run", *argv]) == 0
    assert "superseded" in capsys.readouterr().out  # the text report shows the figure too
    assert main(["compact", path]) == 0
    capsys.readouterr()
    third = run(capsys, *argv)
    assert third["file_reclaimable_bytes"] == 0 and third["warnings"] == []


@pytest.mark.parametrize("spelling", ["{d}", "{d}/", "{d}/./", "{rel}", "{copy}"])
def test_run_serve_and_build_name_one_cache_file_for_one_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """A directory with a dot in its name, a trailing slash, a relative spelling, or a copy elsewhere:
    ``run --model``, ``serve --model`` and ``build`` open one file, named by the checkpoint's content (they
    once disagreed on a dotted name, and once named files by path, so a copy or a prebuilt cache missed)."""
    from packcache.cli import build_parser
    from packcache.cli._model import cache_file as _cache_file
    from packcache.hf import default_cache_path

    directory = tmp_path / "minilm.v2"
    shutil.copytree(minilm.default_model_path(), directory)
    shutil.copytree(directory, tmp_path / "elsewhere" / "copy", copy_function=shutil.copy2)
    monkeypatch.chdir(tmp_path)
    given = spelling.format(d=directory, rel="minilm.v2", copy=tmp_path / "elsewhere" / "copy")
    parser = build_parser()
    run = _cache_file(parser.parse_args(["run", "--model", given, "--cache-dir", "/c"]), "int8")
    serve = _cache_file(parser.parse_args(["serve", "--model", given, "--cache-dir", "/c"]), "int8")
    build = str(default_cache_path(parser.parse_args(["build", given]).checkpoint, "int8", cache_dir="/c"))
    bundled = _cache_file(parser.parse_args(["run", "--cache-dir", "/c"]), "int8")
    assert run == serve == build == bundled  # the same bytes as the bundled model: the same file
    assert os.path.basename(build).startswith("bert-int8-") and "minilm" not in build and "copy" not in build
    assert _cache_file(parser.parse_args(["run", "--no-cache"]), "int8") is None


# ------------------------------------- a hostile model.safetensors: one line, no traceback, no hang


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json and tokenizer.json of the shipped model beside a model.safetensors each test replaces."""
    from packcache.models import minilm

    shipped = minilm.default_model_path()
    target = tmp_path_factory.mktemp("checkpoint")
    for name in ("config.json", "tokenizer.json", "sentence_bert_config.json"):
        shutil.copyfile(shipped / name, target / name)
    return target


@pytest.mark.parametrize("case", ["dtype-list", "deep-json", "huge-int-4301-digits", "dim-over-int64"])
def test_run_with_a_hostile_model_is_one_format_error_line(
    checkpoint_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    raw, data, message = HOSTILE[case]
    model = write(checkpoint_dir / "model.safetensors", raw, data)
    assert main(["run", "--model", str(model), "--cache-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("packcache run: cannot load the model: ") and f"{model}: offset " in captured.err
    assert message.split()[0] in captured.err


def test_run_with_a_fifo_as_model_exits_instead_of_hanging(checkpoint_dir: Path, tmp_path: Path) -> None:
    model = checkpoint_dir / "fifo.safetensors"
    os.mkfifo(model)
    done = subprocess.run(
        [sys.executable, "-m", "packcache", "run", "--model", str(model), "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "not a regular file (a FIFO)" in done.stderr and done.stderr.count("\n") == 1


# ------------------------------------- a damaged pack: --verify checks the load; no report claims more than it knows


def damage(path: Path, containing: str = "query.weight") -> fmt.Entry:
    """Flip 8 bytes in the middle of the first pack whose entry name holds ``containing`` (the file stays valid:
    its header and index are untouched, only that pack's checksum fails); the entry."""
    fd = os.open(path, os.O_RDONLY)
    try:
        entries = read_committed(fd)[2]
    finally:
        os.close(fd)
    entry = next(e for name, e in sorted(entries.items(), key=lambda kv: kv[1].offset) if containing in name)
    middle = entry.offset + entry.nbytes // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        data = f.read(8)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))
    assert not packcache.verify(path).ok
    return entry


def build_file(checkpoint: Path, target: Path, *extra: str) -> Path:
    """``packcache build CHECKPOINT --cache TARGET --scheme int8 [EXTRA]``: a cache file that holds its model."""
    assert main(["build", str(checkpoint), "--cache", str(target), "--scheme", "int8", *extra]) == 0
    return target


def copy_of(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    target.chmod(0o600)
    return target


@pytest.mark.parametrize("loader", ["minilm", "hf"])
def test_run_verify_refuses_a_self_contained_file_with_a_damaged_pack(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    """Bytes flipped inside a pack of a cache file that holds its model: a warm load reads no pack data, so ``run``
    said ``mapped``, exit 0, and embedded with the damaged weight. ``--verify`` checks every pack as the load maps
    it; with no checkpoint a damaged pack cannot be packed again, so ``run`` and ``build FILE`` fail, naming the
    entry and its offset (each loader's file: the error comes from the one place a file-only load packs)."""
    good = build_file(base, tmp_path / "good" / f"tiny-{loader}.pcache", "--loader", loader)
    capsys.readouterr()
    bad = copy_of(good, tmp_path / "bad" / f"tiny-{loader}.pcache")
    entry = damage(bad)
    commands = [["build", str(bad)]] + ([["run", "--model", str(bad)]] if loader == "minilm" else [])
    for command in commands:
        assert main([*command, "--json"]) == 0  # unchecked: mapped, and the report says it did not check
        unchecked = json.loads(capsys.readouterr().out)
        assert unchecked["stats"]["state"] == "mapped" and unchecked["checksums_checked"] is False
        assert main([*command, "--verify"]) == 1
        line = capsys.readouterr().err.splitlines()[-1]
        assert line.startswith(f"packcache {command[0]}: cannot load the"), line
        assert f"{bad}: offset {entry.offset}: the pack {entry.name!r} failed its checksum" in line, line
        assert "Traceback" not in line
    assert main(["build", str(good), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checksums_checked"] is True


def test_run_verify_packs_a_damaged_pack_of_a_checkpoints_cache_again(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache of a checkpoint has the source of a damaged pack: ``run --verify`` packs it again, appends it, and
    the file verifies afterwards; without ``--verify`` the text report says the checksums were not checked."""
    argv = ("--model", str(base), "--cache-dir", str(tmp_path), "--scheme", "int8")
    path = Path(run(capsys, *argv)["cache_file"])
    damage(path)
    assert main(["run", *argv]) == 0
    assert "checksums     not checked: a warm load reads no pack data (--verify checks" in capsys.readouterr().out
    healed = run(capsys, *argv, "--verify")
    assert healed["checksums_checked"] is True and healed["stats"]["state"] == "stored", healed["stats"]
    assert healed["stats"]["stored"] == 1 and healed["stats"]["hits"] > 0
    assert packcache.verify(path).ok
    assert main(["run", *argv, "--verify"]) == 0
    assert "checksums     every pack served matched its checksum (--verify" in capsys.readouterr().out
    from packcache.cli import build_parser
    from packcache.cli._model import _cache_arg

    with_remote = build_parser().parse_args(["run", *argv, "--verify", "--remote", str(tmp_path / "store")])
    remote_cache = _cache_arg(with_remote, str(path), minilm.platform("int8"))
    assert remote_cache.verify, "a cache made before the load (--remote) checks too"
    remote_cache.close()


def test_serve_verify_refuses_a_damaged_file_before_forking_a_worker(base: Path, tmp_path: Path) -> None:
    """A cache file that holds its model has no checkpoint to pack a damaged pack from: ``serve --verify`` stops in
    the master with one line naming the entry, and no worker boots."""
    bad = build_file(base, tmp_path / "tiny-int8.pcache")
    entry = damage(bad)
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "packcache", "serve", "--port", "0", "--workers", "2", "--model", str(bad), "--verify"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Booting worker" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("packcache serve: cannot load the model")]
    assert f"entry {entry.name!r} at offset {entry.offset}" in line and "--verify" in line, line
