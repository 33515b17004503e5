"""all-MiniLM-L6-v2 end to end: quality per scheme, same bytes same answers, memory shared by workers.

The reference embeddings in tests/data/minilm_reference.json were made by sentence-transformers
with scripts/make_reference_embeddings.py (see docs/TORCH.md).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from packcache.kernels import cpu_kernels
from packcache.models import minilm
from packcache.safetensors import SafetensorsFile

REFERENCE = json.loads((Path(__file__).parent / "data" / "minilm_reference.json").read_text(encoding="utf-8"))
SENTENCES: list[str] = REFERENCE["sentences"]
MIN_COSINE_VS_FP32 = {"bf16": 0.999, "int8": 0.995, "int4": 0.95}


def _cosines(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    result: np.ndarray[Any, Any] = (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    return result


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Per scheme: a cold launch (packs stored), a warm launch (mapped) and a heap launch (caching off)."""
    directory = tmp_path_factory.mktemp("minilm")
    tokenizer = minilm.load_tokenizer()
    result: dict[str, dict[str, Any]] = {}
    for scheme in minilm.SCHEMES:
        path = directory / f"minilm-{scheme}.pcache"
        runs: dict[str, Any] = {"path": path}
        for launch, cache in (("cold", path), ("warm", path), ("heap", None)):
            started = time.perf_counter()
            model = minilm.load(scheme, cache=cache, tokenizer=tokenizer)
            runs[f"{launch}_seconds"] = time.perf_counter() - started
            runs[launch] = model.embed(SENTENCES)
            runs[f"{launch}_stats"] = model.cache.stats()
            runs[f"{launch}_packed"] = model.report.packed_bytes
            model.close()
            del model
            gc.collect()
        result[scheme] = runs
    yield result


def test_fp32_reproduces_sentence_transformers(launches: dict[str, dict[str, Any]]) -> None:
    reference = np.asarray(REFERENCE["embeddings"], dtype=np.float32)
    got = launches["fp32"]["cold"]
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(got, reference).min() >= 0.9999


@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4"])
def test_quantized_schemes_stay_close_to_fp32(launches: dict[str, dict[str, Any]], scheme: str) -> None:
    cosines = _cosines(launches[scheme]["cold"], launches["fp32"]["cold"])
    assert SENTENCES[0] == ""  # the hardest row is in the set
    assert cosines.min() >= MIN_COSINE_VS_FP32[scheme], dict(zip(SENTENCES, cosines.round(4).tolist(), strict=True))


@pytest.mark.parametrize("scheme", minilm.SCHEMES)
def test_cold_warm_and_heap_launches_give_bit_identical_embeddings(
    launches: dict[str, dict[str, Any]], scheme: str
) -> None:
    runs = launches[scheme]
    assert runs["cold"].tobytes() == runs["warm"].tobytes() == runs["heap"].tobytes()
    cold, warm, heap = runs["cold_stats"], runs["warm_stats"], runs["heap_stats"]
    assert (cold.state, cold.heap_bytes, cold.stored > 0) == ("stored", 0, True)
    assert (warm.state, warm.heap_bytes, warm.stored, warm.written_bytes) == ("mapped", 0, 0, 0)
    assert warm.mapped_bytes == runs["warm_packed"] == runs["cold_packed"]
    assert (heap.state, heap.heap_bytes_by_reason["disabled"]) == ("off", runs["heap_packed"])


@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4"])
def test_both_kernel_paths_agree_within_the_schemes_tolerance(launches: dict[str, dict[str, Any]], scheme: str) -> None:
    tokenizer = minilm.load_tokenizer()
    got = {}
    for kernel_path in ("bf16", "fp32"):
        model = minilm.load(scheme, cache=launches[scheme]["path"], tokenizer=tokenizer, kernel_path=kernel_path)
        assert model.kernel_path == kernel_path and f"kernel_path={kernel_path!r}" in repr(model)
        assert model.cache.stats().state == "mapped"  # a cache made on the default path is a hit on both
        got[kernel_path] = model.embed(SENTENCES)
        model.close()
    threshold = MIN_COSINE_VS_FP32[scheme]
    for kernel_path, embeddings in got.items():
        assert _cosines(embeddings, launches["fp32"]["cold"]).min() >= threshold, kernel_path
        assert _cosines(embeddings, launches[scheme]["heap"]).min() >= threshold, kernel_path
    assert _cosines(got["bf16"], got["fp32"]).min() >= threshold
    # The heap launch ran this machine's default path: forcing that path changes nothing.
    assert got[cpu_kernels().default_path].tobytes() == launches[scheme]["heap"].tobytes()


@pytest.mark.parametrize("scheme", minilm.SCHEMES)
def test_pack_count_is_what_a_load_requests(launches: dict[str, dict[str, Any]], scheme: str) -> None:
    runs = launches[scheme]
    assert minilm.pack_count(scheme) == runs["cold_stats"].stored == runs["warm_stats"].hits
    assert minilm.pack_count(scheme) == runs["heap_stats"].heap_packs


def test_fp32_runs_the_fp32_path_only(launches: dict[str, dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="has no kernel path 'bf16'"):
        minilm.load("fp32", cache=None, kernel_path="bf16")
    model = minilm.load("fp32", cache=launches["fp32"]["path"], kernel_path="fp32")
    assert model.kernel_path == "fp32" and model.kernels == "linear(float32)"
    assert model.embed(SENTENCES).tobytes() == launches["fp32"]["warm"].tobytes()
    model.close()


def test_int4_warm_launch_reads_no_source_byte_and_runs_no_calibration(
    launches: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_reading(self: SafetensorsFile, name: str) -> np.ndarray[Any, Any]:
        raise AssertionError(f"a warm launch read source tensor {name!r}")

    # Calibration materialises the float32 model through SafetensorsFile.read too.
    monkeypatch.setattr(SafetensorsFile, "read", no_reading)
    model = minilm.load("int4", cache=launches["int4"]["path"])
    assert model.cache.stats().state == "mapped"
    assert model.embed(SENTENCES).tobytes() == launches["int4"]["warm"].tobytes()
    model.close()
    with pytest.raises(AssertionError, match="read source tensor"):
        minilm.load("int8", cache=None)  # proves the patched reader is the one packs go through


def test_cache_argument_forms(tmp_path: Path) -> None:
    off = minilm.load("int8", cache=None)
    assert isinstance(off.cache, packcache.WeightCache) and off.cache.stats().state == "off"
    with pytest.raises(ValueError, match="is a directory") as refused:
        minilm.load("int8", cache=tmp_path)
    assert str(minilm.default_cache_path("int8", cache_dir=tmp_path)) in str(refused.value)  # the file it suggests
    with pytest.raises(ValueError, match="another platform"):
        minilm.load("int8", cache=packcache.WeightCache(tmp_path / "x.pcache", platform={"other": 1}))
    given = packcache.WeightCache(tmp_path / "y.pcache", platform=minilm.platform("int8"))
    assert minilm.load("int8", cache=given).cache is given
    with pytest.raises(ValueError, match="unknown scheme"):
        minilm.load("int3", cache=None)
    names = {scheme: minilm.default_cache_path(scheme).name for scheme in minilm.SCHEMES}
    assert all(name.startswith(f"bert-{scheme}-") and name.endswith(".pcache") for scheme, name in names.items())
    assert minilm.default_cache_path("int4", group_size=64).name not in names.values()  # another recipe, another file


def test_default_cache_path_is_in_the_directory_packcache_run_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from packcache.cli import default_cache_dir

    name = minilm.default_cache_path("int8").name
    monkeypatch.setenv("PACKCACHE_DIR", str(tmp_path / "explicit"))
    assert minilm.default_cache_path("int8") == tmp_path / "explicit" / name
    monkeypatch.delenv("PACKCACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert minilm.default_cache_path("int8") == tmp_path / "xdg" / "packcache" / name
    assert str(minilm.default_cache_path("fp32").parent) == default_cache_dir()
    assert minilm.default_cache_path("int8", cache_dir=tmp_path / "given") == tmp_path / "given" / name


def test_model_path_takes_a_checkpoint_with_bert_prefixed_names(
    tmp_path: Path, launches: dict[str, dict[str, Any]]
) -> None:
    shipped = minilm.default_model_path()
    source = SafetensorsFile(shipped / "model.safetensors")
    raw = (shipped / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    renamed = {(k if k == "__metadata__" else f"bert.{k}"): v for k, v in header.items()}
    encoded = json.dumps(renamed).encode()
    target = tmp_path / "checkpoint"
    target.mkdir()
    (target / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + header_len :])
    for name in ("config.json", "tokenizer.json", "sentence_bert_config.json"):
        (target / name).write_bytes((shipped / name).read_bytes())
    model = minilm.load("fp32", cache=None, model_path=target)
    assert len(source.names()) == len(renamed) - 1
    assert model.embed(SENTENCES).tobytes() == launches["fp32"]["heap"].tobytes()


# ------------------------------------------------------------------------- real processes

WORKER = r"""
import gc, json, sys, zlib
import torch
torch.set_num_threads(1)  # four workers on two cores: no thread pools fighting over them
from packcache.models import minilm
from packcache.torch import scheme_packer

def anonymous_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    raise RuntimeError("no Anonymous line")

scheme, path, wait = sys.argv[1], sys.argv[2] or None, sys.argv[3] == "wait"
# What every launch pays whatever the weights' origin happens before the baseline: the
# tokenizer, the packers' fingerprints and the kernel self-check of the path the load runs (once
# per process), and Python's allocator warmed by building and dropping one weightless (meta)
# skeleton of the model (~0.25 MiB of module objects).
tokenizer = minilm.load_tokenizer()
minilm.platform(scheme)
linear = scheme_packer(scheme)
linear.check_path(linear.kernel_path(None))
with torch.device("meta"):
    skeleton = minilm.BertEncoder(minilm.BertConfig.from_file(minilm.default_model_path() / "config.json"))
del skeleton
gc.collect()
before = anonymous_kib()
model = minilm.load(scheme, cache=path, tokenizer=tokenizer)
# Read every byte of every packed tensor (a crc, which allocates nothing), so every page is resident.
crc = 0
for tensor in [*model.encoder.parameters(), *model.encoder.buffers()]:
    crc = zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).numpy(), crc)
gc.collect()
after = anonymous_kib()
s = model.cache.stats()
print(json.dumps({"state": s.state, "heap_bytes": s.heap_bytes, "mapped_bytes": s.mapped_bytes,
                  "packed_bytes": model.report.packed_bytes, "anonymous_growth": (after - before) * 1024,
                  "crc": crc, "load_seconds": model.load_seconds}), flush=True)
if wait:
    sys.stdin.readline()  # hold the mapping until the parent has read /proc/<pid>/smaps
"""


def _worker(scheme: str, path: Path | None, wait: bool) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", WORKER, scheme, str(path) if path else "", "wait" if wait else "exit"]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"worker failed ({proc.returncode}):\n{err}")
    result: dict[str, Any] = json.loads(line)
    return result


def _mapping_kib(pid: int, path: Path) -> dict[str, int]:
    """Rss and Pss (KiB) summed over the VMAs of ``pid`` that map ``path``; Anonymous of the whole process."""
    totals = {"Rss": 0, "Pss": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields and fields[0].rstrip(":") in totals:
            totals[fields[0].rstrip(":")] += int(fields[1])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            totals["Anonymous"] = int(line.split()[1])
    return totals


def _finish(proc: subprocess.Popen[str]) -> int:
    """Release a worker waiting on its stdin, wait for it, close its pipes; its exit code."""
    _, err = proc.communicate(input="\n", timeout=120)
    assert proc.returncode == 0, err
    return proc.returncode


def _run_once(scheme: str, path: Path | None) -> dict[str, Any]:
    proc = _worker(scheme, path, wait=False)
    result = _report(proc)
    _finish(proc)
    return result


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_warm_launch_adds_almost_no_anonymous_memory(launches: dict[str, dict[str, Any]], scheme: str) -> None:
    warm = _run_once(scheme, launches[scheme]["path"])
    assert (warm["state"], warm["heap_bytes"]) == ("mapped", 0)
    assert warm["mapped_bytes"] == warm["packed_bytes"] > 50 * 2**20
    assert warm["anonymous_growth"] < 0.01 * warm["packed_bytes"], warm
    # The same measurement does see weights on heap: a heap launch grows by about the packed size.
    heap = _run_once(scheme, None)
    assert heap["state"] == "off" and heap["heap_bytes"] == heap["packed_bytes"]
    assert heap["anonymous_growth"] > 0.9 * heap["packed_bytes"], heap
    assert heap["crc"] == warm["crc"]  # same bytes


def test_four_workers_share_one_copy_of_the_packed_weights(tmp_path: Path) -> None:
    path = tmp_path / "minilm-int8.pcache"
    built = _run_once("int8", path)  # a cold build in its own process: this test process never maps the file
    assert built["state"] == "stored"
    workers = [_worker("int8", path, wait=True) for _ in range(4)]
    heap_workers: list[subprocess.Popen[str]] = []
    try:
        reports = [_report(w) for w in workers]  # every worker has loaded and touched every page: the barrier
        shared = [_mapping_kib(w.pid, path) for w in workers]
        for w in workers:
            _finish(w)
        heap_workers = [_worker("int8", None, wait=True) for _ in range(4)]
        heap_reports = [_report(w) for w in heap_workers]
        private = [_mapping_kib(w.pid, path) for w in heap_workers]
        for w in heap_workers:
            _finish(w)
    finally:
        for w in workers + heap_workers:
            if w.poll() is None:
                w.kill()
                w.communicate()
    packed_kib = built["packed_bytes"] / 1024
    for report, kib in zip(reports, shared, strict=True):
        assert (report["state"], report["heap_bytes"]) == ("mapped", 0)
        assert kib["Rss"] >= 0.99 * packed_kib  # every packed page resident in this worker...
        assert 0.22 * kib["Rss"] <= kib["Pss"] <= 0.28 * kib["Rss"], kib  # ...and a quarter of it charged to it
        assert report["anonymous_growth"] < 0.01 * report["packed_bytes"], report
    for report, kib in zip(heap_reports, private, strict=True):
        assert report["state"] == "off" and kib["Rss"] == kib["Pss"] == 0  # no mapping at all
        assert report["anonymous_growth"] > 0.9 * report["packed_bytes"], report  # each pays the full size
