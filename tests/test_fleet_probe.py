"""The header-only probe: ``packcache.fleet.probe`` and ``packcache probe``.

The verdict must be what a :class:`~packcache.WeightCache` does with the file: ``compatible`` (or
``compatible_suboptimal``) exactly when a cache given this machine's platform maps the file's packs
without packing any again. Checked on real files: MiniLM-loader files of a tiny BERT built here and
in a child process under another CPU capability, core files with chosen platform mappings, and the
fuzzer's mutated and synthesised files against the format's reference reader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packcache
from harness import fuzz
from harness.checkpoints import tiny_bert
from packcache import format as fmt
from packcache.cli import main
from packcache.errors import FormatError
from packcache.fleet.platform import platform_class
from packcache.fleet.probe import EXIT_CODES, ProbeReport, Verdict, downgrade_unverified, probe_bytes, probe_file
from packcache.models import minilm

HERE_CAPABILITY = torch.backends.cpu.get_cpu_capability()
OTHER_CAPABILITY = "avx2" if HERE_CAPABILITY != "AVX2" else "default"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint; its int4 file built here (``minilm.load``) and one built by ``packcache build --loader
    minilm`` in a child process under another CPU capability."""
    base = tmp_path_factory.mktemp("probe")
    checkpoint = tiny_bert(base / "tiny", seed=7, layers=1)
    here = minilm.default_cache_path("int4", model_path=checkpoint, cache_dir=base / "here")
    model = minilm.load("int4", cache=here, model_path=checkpoint)
    assert model.cache.stats().state == "stored"
    model.close()
    env = {**os.environ, "ATEN_CPU_CAPABILITY": OTHER_CAPABILITY}
    command = [sys.executable, "-m", "packcache", "build", str(checkpoint), "--loader", "minilm", "--scheme", "int4",
               "--cache-dir", str(base / "other"), "--json"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    other = Path(json.loads(done.stdout)["cache_file"])
    assert other.name == here.name, "the file name does not carry the CPU: the header does"
    return {"checkpoint": checkpoint, "here": here, "other": other}


def probe_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["probe", *argv, "--json"])
    captured = capsys.readouterr()
    assert captured.err == ""
    return code, json.loads(captured.out)


def load_here(path: Path, checkpoint: Path, scheme: str = "int4") -> packcache.CacheStats:
    """What a real load on this machine does with the file: its cache's statistics."""
    model = minilm.load(scheme, cache=path, model_path=checkpoint)
    stats = model.cache.stats()
    model.close()
    return stats


def test_a_file_built_here_is_compatible_and_a_load_maps_every_pack(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = probe_cli(capsys, str(built["here"]))
    assert (code, report["verdict"], report["differences"]) == (0, "compatible", [])
    assert (
        report["platform_class"]
        == report["platform_class_here"]
        == platform_class(fmt.canonical_key(minilm.platform("int4")))
    )
    assert report["model"] == built["here"].name.removesuffix(".pcache") and report["superseded_bytes"] == 0
    copy = tmp_path / built["here"].name
    shutil.copy(built["here"], copy)
    stats = load_here(copy, built["checkpoint"])
    assert (stats.state, stats.stored, stats.hits, stats.heap_bytes) == ("mapped", 0, report["entries"], 0)
    assert stats.mapped_bytes == report["live_bytes"]


def test_a_file_built_under_another_cpu_capability_is_incompatible_and_a_load_rebuilds_it(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = probe_cli(capsys, str(built["other"]))
    assert (code, report["verdict"]) == (4, "incompatible")
    by_field = {d["field"]: (d["file"], d["here"]) for d in report["differences"]}
    assert sorted(by_field) == ["cpu_capability"]  # the packs' bytes are the same (int4's layout is packcache's)
    assert by_field["cpu_capability"] == (OTHER_CAPABILITY.upper(), HERE_CAPABILITY)
    assert f"cpu_capability: {OTHER_CAPABILITY.upper()} -> {HERE_CAPABILITY}" in report["reasons"]
    assert report["bytes_read"] == fmt.HEADER_READ_SIZE, "an incompatible file's index is not read"
    copy = tmp_path / built["other"].name
    shutil.copy(built["other"], copy)
    stats = load_here(copy, built["checkpoint"])
    assert (stats.state, stats.hits) == ("stored", 0) and stats.stored == report["entries"]
    code, again = probe_cli(capsys, str(copy))
    assert (code, again["verdict"]) == (0, "compatible"), "rebuilt here, it is of this machine's class"


def test_another_scheme_or_group_size_is_incompatible_naming_the_packers(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = probe_cli(capsys, str(built["here"]), "--scheme", "int8")
    # int4 packs its embedding tables as int8 does (torch.int8wo): the int4 packer is the difference.
    assert (code, [d["field"] for d in report["differences"]]) == (4, ["packers[torch.int4wo]"])
    code, report = probe_cli(capsys, str(built["here"]), "--scheme", "int4", "--group-size", "64")
    assert code == 4 and "packers[torch.int4wo].params.group_size" in [d["field"] for d in report["differences"]]
    copy = tmp_path / built["here"].name
    shutil.copy(built["here"], copy)
    stats = load_here(copy, built["checkpoint"], scheme="int8")
    assert (stats.hits, stats.state) == (0, "stored"), "a load of int8 rebuilds the int4 file"


def test_another_model_is_not_applicable_with_nothing_read(
    built: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = probe_cli(capsys, str(built["here"]), "--expected-model", "some-other-model")
    assert (code, report["verdict"], report["bytes_read"]) == (5, "not_applicable", 0)
    assert "not of 'some-other-model'" in report["reasons"][0]


def test_the_probe_reads_the_header_and_the_index_and_no_pack_byte(built: dict[str, Path]) -> None:
    data = built["here"].read_bytes()
    ranges: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        ranges.append((start, end))
        return data[start:end]

    report = probe_bytes(read, expected_platform=fmt.canonical_key(minilm.platform("int4")), size=len(data))
    slot = fmt.choose_slot(data[: fmt.HEADER_READ_SIZE])[0][0]
    assert ranges == [(0, fmt.HEADER_READ_SIZE), (slot.index_offset, slot.committed_end)]
    assert report.bytes_read == fmt.HEADER_READ_SIZE + slot.index_size < len(data) // 100
    assert report.verdict is Verdict.COMPATIBLE and report.generation == slot.generation


# --------------------------------------------------------------------------- core files, chosen platforms


def _core_file(path: Path, platform: dict[str, Any], packs: list[tuple[str, dict[str, Any]]]) -> None:
    for name, key in packs:  # one session each: a name packed again under another key supersedes its bytes
        with packcache.WeightCache(path, platform=platform) as cache, cache.session() as s:
            s.get_or_pack(name, lambda: np.arange(1024, dtype=np.float32), key=key)


def _packed_again(path: Path, platform: dict[str, Any], name: str, key: dict[str, Any]) -> bool:
    """Whether a WeightCache given ``platform`` packs ``name`` again instead of mapping it from the file."""
    calls = []

    def pack() -> np.ndarray[Any, Any]:
        calls.append(1)
        return np.arange(1024, dtype=np.float32)

    with packcache.WeightCache(path, platform=platform, read_only=True) as cache, cache.session() as s:
        s.get_or_pack(name, pack, key=key)
    return bool(calls)


CORE_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], list[tuple[str, dict[str, Any]]], Verdict]] = {
    "same mapping": ({"app": 1, "cpu": "x"}, {"app": 1, "cpu": "x"}, [("w", {"v": 1})], Verdict.COMPATIBLE),
    # Fewer superseded bytes than live ones: a build leaves them (it compacts a file they outweigh).
    "superseded packs": (
        {"app": 1},
        {"app": 1},
        [("a", {"v": 1}), ("b", {"v": 1}), ("w", {"v": 0}), ("w", {"v": 1})],
        Verdict.COMPATIBLE_SUBOPTIMAL,
    ),
    "another value": ({"app": 1}, {"app": 2}, [("w", {"v": 1})], Verdict.INCOMPATIBLE),
    "1 and 1.0": ({"app": 1}, {"app": 1.0}, [("w", {"v": 1})], Verdict.INCOMPATIBLE),
    "an extra field": ({"app": 1}, {"app": 1, "gpu": None}, [("w", {"v": 1})], Verdict.INCOMPATIBLE),
    "no mapping": ({}, {}, [("w", {"v": 1})], Verdict.COMPATIBLE),
}


@pytest.mark.parametrize("case", sorted(CORE_CASES))
def test_the_verdict_is_compatible_exactly_when_a_weightcache_maps_the_file(tmp_path: Path, case: str) -> None:
    made_with, here, packs, verdict = CORE_CASES[case]
    path = tmp_path / "core.pcache"
    _core_file(path, made_with, packs)
    report = probe_file(path, expected_platform=fmt.canonical_key(here))
    assert report.verdict is verdict, report.reasons
    name, key = packs[-1]
    assert _packed_again(path, here, name, key) == (verdict not in (Verdict.COMPATIBLE, Verdict.COMPATIBLE_SUBOPTIMAL))
    if verdict is Verdict.COMPATIBLE_SUBOPTIMAL:
        assert report.superseded_bytes > 0 and "packcache compact would reclaim them" in report.reasons[1]
        packcache.compact(path)
        assert probe_file(path, expected_platform=fmt.canonical_key(here)).verdict is Verdict.COMPATIBLE
    if verdict is Verdict.INCOMPATIBLE:
        assert report.differences and report.platform_class != report.platform_class_here


def test_a_file_weightcache_does_not_trust_in_place_is_at_best_suboptimal(tmp_path: Path) -> None:
    path = tmp_path / "shared.pcache"
    _core_file(path, {"app": 1}, [("w", {"v": 1})])
    os.chmod(path, 0o666)
    report = probe_file(path, expected_platform=fmt.canonical_key({"app": 1}))
    assert report.verdict is Verdict.COMPATIBLE_SUBOPTIMAL
    assert "does not trust this file in place (group- or world-writable" in report.reasons[-1]
    with packcache.WeightCache(path, platform={"app": 1}) as cache, cache.session() as s:
        s.get_or_pack("w", lambda: np.arange(1024, dtype=np.float32), key={"v": 1})
        assert cache.stats().heap_bytes_by_reason["untrusted"] > 0


def test_a_committed_generation_without_packs_is_suboptimal_and_a_header_alone_not_applicable(tmp_path: Path) -> None:
    never = tmp_path / "never.pcache"
    never.write_bytes(fmt.encode_header(64, b"{}"))
    report = probe_file(never, expected_platform=b"{}")
    assert report.verdict is Verdict.NOT_APPLICABLE and "never committed" in report.reasons[0]
    empty = tmp_path / "empty.pcache"
    _core_file(empty, {}, [("w", {"v": 1})])
    data = bytearray(empty.read_bytes())
    data[fmt.data_start_for(64)] ^= 0xFF  # the pack's first byte: compaction drops a pack failing its checksum
    empty.write_bytes(bytes(data))
    assert packcache.compact(empty).dropped == ("w",)
    report = probe_file(empty, expected_platform=b"{}")
    assert (report.verdict, report.entries, report.generation) == (Verdict.COMPATIBLE_SUBOPTIMAL, 0, 2)
    assert "holds no pack: every pack would be computed" in report.reasons[-1]
    assert _packed_again(empty, {}, "w", {"v": 1})


# --------------------------------------------------------------------------- hostile files


def _hostile(directory: Path, good: bytes) -> dict[str, Path]:
    slot = fmt.choose_slot(good[: fmt.HEADER_READ_SIZE])[0][0]
    huge = bytearray(good)
    body = fmt.Slot(slot.generation, slot.index_offset, fmt.MAX_INDEX_BYTES, slot.entry_count, slot.index_crc)
    at = fmt.slot_offset(slot.generation % 2)
    huge[at : at + 64] = fmt.encode_slot(body)
    flipped = bytearray(good)
    flipped[slot.index_offset + 20] ^= 0xFF
    files = {
        "empty": b"",
        "short": good[:100],
        "zeros": bytes(8192),
        "bad magic": b"NOTPCACH" + good[8:],
        "preamble crc": good[:60] + bytes(4) + good[64:],
        "truncated index": good[: slot.index_offset + 8],
        "huge index size": bytes(huge),
        "index crc": bytes(flipped),
        "text": b"hello\n" * 1000,
    }
    paths = {}
    for name, data in files.items():
        paths[name] = directory / (name.replace(" ", "-") + ".pcache")
        paths[name].write_bytes(data)
    paths["fifo"] = directory / "fifo.pcache"
    os.mkfifo(paths["fifo"])
    paths["directory"] = directory / "dir.pcache"
    paths["directory"].mkdir()
    paths["symlink to a fifo"] = directory / "link.pcache"
    os.symlink(paths["fifo"], paths["symlink to a fifo"])
    paths["device"] = Path("/dev/zero")
    return paths


def test_hostile_files_are_not_applicable_in_one_process_that_never_blocks(tmp_path: Path) -> None:
    """Every case in one child process under a timeout: a FIFO opened for reading with no writer would hang."""
    good = tmp_path / "good.pcache"  # one generation: a damaged newest one would fall back to an older one
    with packcache.WeightCache(good, platform=minilm.platform("fp32")) as cache, cache.session() as s:
        for name in ("w", "x"):
            s.get_or_pack(name, lambda: np.arange(1024, dtype=np.float32), key={"v": 1})
    paths = _hostile(tmp_path, good.read_bytes())
    code = (
        "import json, sys, contextlib, io\n"
        "from packcache.cli import main\n"
        "out = {}\n"
        "for name, path in json.loads(sys.argv[1]).items():\n"
        "    stdout, stderr = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):\n"
        "        rc = main(['probe', path, '--scheme', 'fp32', '--json'])\n"
        "    out[name] = [rc, json.loads(stdout.getvalue())['reasons'][0], stderr.getvalue()]\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps({k: str(v) for k, v in paths.items()})],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    assert {name: r[0] for name, r in results.items()} == dict.fromkeys(paths, EXIT_CODES[Verdict.NOT_APPLICABLE])
    assert {name: r[2] for name, r in results.items() if r[2]} == {}
    assert "not a regular file (a FIFO)" in results["fifo"][1]
    assert "index size 268435456" in results["huge index size"][1] or "past the end" in results["huge index size"][1]
    assert "checksum" in results["index crc"][1] and "bad magic" in results["bad magic"][1]


def test_a_missing_file_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", str(tmp_path / "absent.pcache")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("packcache probe: ENOENT") and err.count("\n") == 1


def test_a_read_error_propagates_and_a_short_read_is_a_truncated_file() -> None:
    def failing(start: int, end: int) -> bytes:
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        probe_bytes(failing, expected_platform=b"{}")
    report = probe_bytes(lambda start, end: b"", expected_platform=b"{}")
    assert report.verdict is Verdict.NOT_APPLICABLE and "shorter than the 4096-byte header" in report.reasons[0]
    with pytest.raises(FormatError, match="returned 8192 bytes"):
        probe_bytes(lambda start, end: bytes(8192), expected_platform=b"{}")


def test_another_format_version_is_incompatible_naming_it() -> None:
    head = bytearray(fmt.encode_header(64, b"{}"))
    head[8:12] = (1).to_bytes(4, "little")  # the version before this one
    head[60:64] = fmt.crc32(bytes(head[:60])).to_bytes(4, "little")
    report = probe_bytes(lambda start, end: bytes(head[start:end]), expected_platform=b"{}")
    assert report.verdict is Verdict.INCOMPATIBLE
    assert report.differences == [{"field": "format_version", "file": 1, "here": 2}]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    return fuzz.build_bases(str(tmp_path_factory.mktemp("bases")))


def _reference(data: bytes) -> tuple[str, dict[str, fmt.Entry]]:
    """What the format's reference reader (the cache's rule, harness.fuzz.pure_read) makes of ``data``."""
    try:
        entries = fuzz.pure_read(data)
    except FormatError:
        return "refused", {}
    slots = fmt.choose_slot(data[: fmt.HEADER_READ_SIZE])[0]
    return ("mapped" if slots else "never committed"), entries


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_on_fuzzed_files_the_verdict_agrees_with_the_reference_reader(bases: list[bytes], data: Any) -> None:
    raw: bytes = data.draw(st.one_of(fuzz.mutated(bases), fuzz.synthesised()))

    def read(start: int, end: int) -> bytes:
        return raw[start:end]

    size = len(raw) if data.draw(st.booleans()) else None  # without it, a short read finds what the size would
    report = probe_bytes(read, expected_platform=fuzz.PLATFORM_BYTES, size=size)
    outcome, entries = _reference(raw)
    usable = report.verdict in (Verdict.COMPATIBLE, Verdict.COMPATIBLE_SUBOPTIMAL)
    assert usable == (outcome == "mapped"), (report.verdict, report.reasons, outcome)
    if usable:
        assert report.entries == len(entries) and report.live_bytes == sum(e.nbytes for e in entries.values())
    assert report.bytes_read <= fmt.HEADER_READ_SIZE + fmt.MAX_INDEX_BYTES


def test_downgrade_unverified_keeps_worse_verdicts() -> None:
    fits = ProbeReport(Verdict.COMPATIBLE_SUBOPTIMAL, ["fits", "superseded"])
    assert downgrade_unverified(fits, "unsigned").verdict is Verdict.UNVERIFIED
    assert downgrade_unverified(fits, "unsigned").exit_code == 6
    worse = ProbeReport(Verdict.INCOMPATIBLE, ["other class"])
    assert downgrade_unverified(worse, "unsigned") == ProbeReport(Verdict.INCOMPATIBLE, ["other class", "unsigned"])
    assert json.loads(downgrade_unverified(fits, "unsigned").to_json())["verdict"] == "unverified"


def test_an_unusable_newest_generation_is_suboptimal_and_the_older_one_is_what_a_cache_maps(tmp_path: Path) -> None:
    path = tmp_path / "two.pcache"
    _core_file(path, {}, [("w", {"v": 1}), ("x", {"v": 1})])
    data = bytearray(path.read_bytes())
    newest = fmt.choose_slot(bytes(data[: fmt.HEADER_READ_SIZE]))[0][0]
    data[newest.index_offset + 20] ^= 0xFF  # the index no longer matches its checksum
    path.write_bytes(bytes(data))
    report = probe_file(path, expected_platform=b"{}")
    assert (report.verdict, report.generation, report.entries) == (Verdict.COMPATIBLE_SUBOPTIMAL, 1, 1)
    assert f"generation {newest.generation} is unusable" in report.reasons[1]
    assert not _packed_again(path, {}, "w", {"v": 1}) and _packed_again(path, {}, "x", {"v": 1})


def test_the_text_output_leads_with_the_verdict_and_names_each_difference(
    built: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", str(built["other"])]) == 4
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "verdict       incompatible" and lines[1] == f"file          {built['other']}"
    assert f"reason        cpu_capability: {OTHER_CAPABILITY.upper()} -> {HERE_CAPABILITY}" in lines
    assert not [line for line in lines if "packers[" in line], lines  # the packs' bytes are the same
    assert main(["probe", str(built["here"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "verdict       compatible"
    # "compatible" is a verdict on the header and index: a pack with flipped bytes probes the same; the output says
    # what it did not check, and what does
    (read,) = [line for line in lines if line.startswith("read ")]
    assert "no pack's checksum: `packcache verify` checks them" in read, read


# --------------------------------------------------------------------------- probe and fetch agree


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from packcache.fleet.manifest import generate_key, public_path_for

    directory = tmp_path_factory.mktemp("keys")
    made = {}
    for name in ("ci", "other"):
        generate_key(directory / f"{name}.pem")
        made[name], made[f"{name}.pub"] = directory / f"{name}.pem", Path(public_path_for(directory / f"{name}.pem"))
    return made


def _hostile_manifests(
    blob: bytes, model: str, cls: str, signing: dict[str, Path]
) -> list[tuple[str, bytes]]:  # fmt: skip
    """(case, envelope) in the order they are put at ``manifests/<model>/<cls>.json``: the first is good
    (fetch accepts it and records its generation 2), the rest each break one rule fetch applies."""
    import hashlib

    from packcache.fleet.manifest import Manifest, encode_unsigned, sign

    ci, other = signing["ci"].read_bytes(), signing["other"].read_bytes()
    sha = hashlib.sha256(blob).hexdigest()

    def made(**changes: Any) -> Manifest:
        fields = {"model": model, "platform_class": cls, "blob_sha256": sha, "size": len(blob), "generation": 2,
                  "created": int(time.time()) - 60, "expires": int(time.time()) + 3600, "builder": "ci"}  # fmt: skip
        return Manifest(**{**fields, **changes})

    tampered = json.loads(sign(made(generation=3), ci))
    tampered["manifest"]["generation"] = 9
    return [
        ("good", sign(made(), ci)),
        ("another model under this key", sign(made(model="model-b", generation=3), ci)),
        ("another class under this key", sign(made(platform_class="pc1-" + "f" * 32, generation=3), ci)),
        ("expired", sign(made(generation=3, created=1000, expires=2000), ci)),
        ("changed after signing", json.dumps(tampered).encode()),
        ("unsigned", encode_unsigned(made(generation=3))),
        ("signed by another key", sign(made(generation=3), other)),
        ("malformed", b'{"manifest": {"generation": 3}, "signatures": []}'),
        ("rolled back", sign(made(generation=1), ci)),
        ("same generation, another blob", sign(made(blob_sha256="0" * 64), ci)),
        ("another size than its blob", sign(made(generation=3, size=len(blob) + 4096), ci)),
        ("unsigned, and another size than its blob", encode_unsigned(made(generation=3, size=len(blob) + 4096))),
        ("unsigned, and expired", encode_unsigned(made(generation=3, created=1000, expires=2000))),
    ]


def test_probe_refuses_exactly_the_manifests_fetch_refuses_and_names_the_same_reason(
    built: dict[str, Path], signing: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A manifest is probed by the one function fetch checks it with: on each hostile manifest the probe's
    exit is 0 exactly when a real fetch takes it, and its ``remote_reason`` is the reason fetch refuses with."""
    import hashlib

    from packcache.errors import RemoteError
    from packcache.fleet.fetch import fetch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # one machine user: its accepted generations
    blob = built["here"].read_bytes()
    model = built["here"].name.removesuffix(".pcache")
    platform = fmt.canonical_key(minilm.platform("int4"))
    cls = platform_class(platform)
    store = tmp_path / "store"
    (store / "blobs" / "sha256").mkdir(parents=True)
    (store / "blobs" / "sha256" / f"{hashlib.sha256(blob).hexdigest()}.pcache").write_bytes(blob)
    (store / "manifests" / model).mkdir(parents=True)
    url = f"file://{store}"
    seen = []
    for number, (case, envelope) in enumerate(_hostile_manifests(blob, model, cls, signing)):
        (store / "manifests" / model / f"{cls}.json").write_bytes(envelope)
        code, report = probe_cli(capsys, f"{url}/manifests/{model}/{cls}.json", "--trusted-key", str(signing["ci.pub"]))
        try:
            fetch(url, tmp_path / f"m{number}" / f"{model}.pcache", platform=platform,
                  trusted_keys=[signing["ci.pub"].read_bytes()], timeout=30)  # fmt: skip
            reason = None
        except RemoteError as exc:
            reason = exc.reason
        seen.append((case, code, report.get("remote_reason"), reason))
        assert (code == 0) == (reason is None), (case, code, report["reasons"], reason)
        assert report.get("remote_reason") == reason, (case, report["reasons"], reason)
        if reason is not None:
            assert report["verdict"] in ("refused", "unverified"), (case, report)
    assert seen[0][1:] == (0, None, None) and all(r is not None for _, _, _, r in seen[1:]), seen


def test_a_probed_manifest_shows_its_own_generation_and_names_its_signers_when_no_key_is_trusted(
    built: dict[str, Path], signing: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from packcache.fleet.manifest import key_id
    from packcache.fleet.publish import publish

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = tmp_path / "store"
    store.mkdir()
    for _ in range(3):
        report = publish(built["here"], str(store), private_key=str(signing["ci"]), sources=[str(built["checkpoint"])])
    url = f"file://{store}/{report.manifest_key}"
    code, probed = probe_cli(capsys, url, "--trusted-key", str(signing["ci.pub"]))
    assert (code, probed["manifest_generation"]) == (0, 3), probed
    assert main(["probe", url, "--trusted-key", str(signing["ci.pub"])]) == 0
    assert "manifest      generation 3" in capsys.readouterr().out
    code, probed = probe_cli(capsys, url)  # no --trusted-key: the manifest IS signed, and says by whom
    signer = key_id(signing["ci.pub"].read_bytes())
    assert code == 6 and signer in probed["reasons"][0] and "--trusted-key" in probed["reasons"][0], probed
    assert "unsigned manifests are not allowed" not in probed["reasons"][0]
