"""What a ``packcache serve`` worker loads (``packcache.server.engines``), run the way it is deployed:
real gunicorn workers on 127.0.0.1 (``harness.serve``), real HTTP and Prometheus scrapes. Each worker
loads its engine after the fork: on a cold start one builds the cache file and the others map it; workers
share one copy of the packed weights; a worker names its own cache file by content when it loads, so a
model updated in place reaches restarted workers; a fresh machine fetches the published file; the
sentence-transformers baseline never reaches a hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

import packcache
from harness.checkpoints import tiny_bert, tiny_sentence_transformer, tiny_transformer
from harness.serve import (
    SRC,
    STATES,
    TEXTS,
    assert_embeddings,
    assert_no_heap,
    call,
    embed_from_every_worker,
    loaded_workers,
    scrape,
    server,
)
from packcache.memory import MappingUsage, file_mapping_usage, smaps_rollup
from test_minilm import fifo, variant
from test_server_filecheck import log_lines, scraped

#: What a heap worker may hold besides its packed weights. A worker hands back what its load freed
#: (``release_free_heap``); before it did, glibc kept 7-13 MB of it, varying from run to run (measured 22.7-22.9 MB
#: more anonymous memory than a cache worker for 22.9 MB packed, int8, after; 29.6-31.4 MB before).
HEAP_SLACK = 2 << 20


def test_four_workers_cold_start_one_builds_the_others_map_and_all_serve_identical_embeddings(
    tmp_path: Path, reference: np.ndarray[Any, Any]
) -> None:
    from packcache.models import minilm

    cache_dir = tmp_path / "cache"
    assert not cache_dir.exists()
    with server(tmp_path, "--cache-dir", str(cache_dir), workers=4) as srv:
        s = loaded_workers(srv, 4)
        states = sorted(w.current_state for w in s.workers.values())
        assert states == ["mapped", "mapped", "mapped", "stored"], states
        (builder,) = [w for w in s.workers.values() if w.current_state == "stored"]
        path = Path(builder.info["cache_file"])
        assert path == minilm.default_cache_path("int8", cache_dir=cache_dir)  # named as `packcache run` names it
        for w in s.workers.values():
            assert w.info == {"engine": "packcache", "scheme": "int8", "kernel_path": w.info["kernel_path"],
                              "cache_file": str(path)}  # fmt: skip
            assert sorted(w.state) == sorted(STATES) and sum(w.state.values()) == 1
            assert_no_heap(w)
            # > 15 MiB: the int8 MiniLM file is 23 MB since its embedding tables are int8 rows.
            assert w.values["mapped_bytes"] > 15 << 20 and w.values["file_bytes"] == path.stat().st_size
            assert w.values["reclaimable_bytes"] == 0  # exported per worker; one build, nothing superseded
            assert w.values["load_seconds"] > 0
            if w is builder:
                assert w.values["written_bytes"] > 0 and w.packs["stored"] > 0 and w.packs["hit"] == 0
            else:  # waited for the builder's lock, then found every pack in the file
                assert w.values["written_bytes"] == 0 and w.packs["stored"] == 0
                assert w.packs["hit"] == builder.packs["stored"]
        seen = embed_from_every_worker(srv, set(s.workers), TEXTS)
        first = next(iter(seen.values()))[0]
        for answers in seen.values():
            for embeddings in answers:
                assert embeddings == first, "every worker serves bit-identical embeddings"
        assert_embeddings(first, reference)
        after = scrape(srv)
        for pid, answers in seen.items():
            assert after.requests[("/embed", "200", pid)] >= len(answers)
            assert after.latency_counts[("/embed", pid)] == after.requests[("/embed", "200", pid)]
        report = packcache.verify(path)
        assert report.ok, report
        # The file is checked once, in the background, by one checker for the four workers: each then says it passed
        # and /healthz stays ok (a damaged file: tests/test_server_filecheck.py).
        checks = scraped(srv, 4, "passed")
        assert all(c["failed_packs"] == 0 and c["checked_bytes"] > 15 << 20 for c in checks.values()), checks
        status, (_, body) = call(srv, "GET", "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok" and json.loads(body)["file_check"] == "passed"
        assert len(log_lines(srv, "INFO", "checking every pack of")) == 1, "one checker for the whole server"
        assert len(log_lines(srv, "INFO", f"{path} passed its checksum check")) == 1


def test_per_worker_pss_of_the_mapping_is_a_quarter_of_the_file_against_heap_workers(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    figures: dict[str, dict[int, tuple[dict[str, int], MappingUsage]]] = {}
    for mode, args in (("cache", ["--cache-dir", str(cache_dir)]), ("heap", ["--no-cache"])):
        with server(tmp_path, *args, "--prefault", workers=4, name=mode) as srv:
            s = loaded_workers(srv, 4)
            if mode == "cache":
                path = Path(next(iter(s.workers.values())).info["cache_file"])
                file_size = path.stat().st_size
                mapped = {w.values["mapped_bytes"] for w in s.workers.values()}
                assert len(mapped) == 1, mapped
                # The encoder's packs; the file also maps the pooler, the model record and the embedded files,
                # which a heap worker does not pack and --prefault does not touch.
                beside = sum(
                    e.nbytes for e in packcache.inspect(path).entries if e.name.startswith(("packcache.", "pooler."))
                )
                packed = int(mapped.pop()) - beside
            else:
                for w in s.workers.values():
                    assert (
                        w.current_state == "off" and w.heap_bytes["disabled"] == packed and w.info["cache_file"] == ""
                    )
            time.sleep(0.5)  # the scrape's own allocations settle
            figures[mode] = {pid: (smaps_rollup(pid), file_mapping_usage(path, pid)) for pid in s.workers}
    quarter = file_size / 4
    for pid, (_, m) in figures["cache"].items():
        # Every worker touched every page of every pack (--prefault), so each data page is mapped by
        # the 4 workers and the kernel charges each a quarter of it: PSS = resident / 4. The file's
        # header, index and alignment padding (0.1 % of it for MiniLM) and smaps' kB rounding are far
        # inside 5 %; unshared pages would put a worker near 4x, one worker holding fewer pages lower.
        assert m.rss >= 0.98 * packed, (pid, m.rss, packed)
        assert 0.95 * quarter <= m.pss <= 1.05 * quarter, (pid, m.pss, quarter)
        assert m.anonymous == 0 and m.deleted == 0
    for _, m in figures["heap"].values():
        assert m.mappings == 0, "caching off maps no cache file"
    fields = ("Anonymous", "Pss_Anon")
    median = {mode: {k: float(np.median([r[k] for r, _ in figures[mode].values()])) for k in fields}
              for mode in figures}  # fmt: skip
    heap, cache = median["heap"], median["cache"]
    # A heap worker holds the packed weights as its own anonymous memory; a cache worker does not.
    anonymous_saved = heap["Anonymous"] - cache["Anonymous"]
    assert 0.9 * packed <= anonymous_saved <= 1.1 * packed + HEAP_SLACK, (anonymous_saved, packed)
    # PSS charges those pages to the heap worker alone (pages shared by the 4 workers would count a quarter). Both
    # kinds of worker also hold ~145 MB of anonymous pages shared with the master since the fork, of which each
    # writes or frees a slightly different part: measured 0.90-0.97 of the packed size, quiet and beside 4 busy loops.
    pss_anon_saved = heap["Pss_Anon"] - cache["Pss_Anon"]
    assert 0.8 * packed <= pss_anon_saved <= 1.1 * packed + HEAP_SLACK, (pss_anon_saved, packed)
    # So a cache worker's PSS saves the packed bytes less its quarter of the file (its mapping's own PSS, checked
    # above). The rest of PSS is not compared: the libraries' file pages are shared with every process on the
    # machine that maps them, so their share moves between the two readings as other processes come and go
    # (Pss_File moved 1.5 MB more than the quarter once, in a full suite run).


def _new_model_version(model: Path) -> None:
    """Replace ``model.safetensors`` by another version of the model (temp + rename): the
    embedding LayerNorm's weight scaled by 1.5, every other byte the same."""
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (size,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + size])
    name = next(n for n in header if n.endswith("embeddings.LayerNorm.weight"))
    assert header[name]["dtype"] == "F32"
    start, end = (8 + size + o for o in header[name]["data_offsets"])
    values = np.frombuffer(bytes(data[start:end]), dtype="<f4") * np.float32(1.5)
    data[start:end] = values.astype("<f4").tobytes()
    temp = model / ".model.safetensors.new"
    temp.write_bytes(bytes(data))
    os.replace(temp, weights)


def test_a_model_updated_in_place_while_serving_old_workers_keep_theirs_restarted_ones_map_the_new(
    tmp_path: Path,
) -> None:
    """Cache files are named by content, and each worker names its own when it loads: the next model
    version copied over the model directory, its cache built beside and renamed into place, is
    what replaced and restarted workers open, while the old workers keep serving the old file."""
    from packcache.models import minilm

    model = tmp_path / "model"
    shutil.copytree(minilm.default_model_path(), model)
    args = ("--cache-dir", str(tmp_path / "cache"), "--model", str(model))
    with server(tmp_path, *args, workers=2) as srv:
        old = loaded_workers(srv, 2)
        path = Path(next(iter(old.workers.values())).info["cache_file"])
        first = embed_from_every_worker(srv, set(old.workers), TEXTS)
        e1 = next(iter(first.values()))[0]
        old_bytes = path.read_bytes()

        # The next model version, its cache built elsewhere and renamed into the cache directory.
        _new_model_version(model)
        new_path = minilm.default_cache_path("int8", model_path=model, cache_dir=tmp_path / "cache")
        assert new_path != path, "another model, another file"
        staging = tmp_path / "staging" / new_path.name
        code = (
            "import json, sys, torch\n"
            "torch.set_num_threads(1)\n"
            "from packcache.models import minilm\n"
            "m = minilm.load('int8', cache=sys.argv[1], model_path=sys.argv[2])\n"
            "assert m.cache.stats().state == 'stored', m.cache.stats()\n"
            "print(json.dumps(m.embed(json.loads(sys.argv[3])).tolist()))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(
            [sys.executable, "-c", code, str(staging), str(model), json.dumps(TEXTS)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        e2 = np.asarray(json.loads(done.stdout))
        assert np.abs(e2 - np.asarray(e1)).max() > 1e-3, "the new version embeds differently"
        os.rename(staging, new_path)

        # The old workers keep serving the old model from the old file.
        again = embed_from_every_worker(srv, set(old.workers), TEXTS)
        assert all(a == e1 for answers in again.values() for a in answers)
        for pid in old.workers:
            assert file_mapping_usage(path, pid).mappings > 0

        # One worker replaced (SIGTERM: gunicorn starts another): old and new serve side by side.
        stopped, kept = sorted(old.workers)
        os.kill(stopped, signal.SIGTERM)
        mixed = loaded_workers(srv, 2, exclude={stopped})
        (fresh,) = set(mixed.workers) - {kept}
        seen = embed_from_every_worker(srv, {kept, fresh}, TEXTS)
        assert all(a == e1 for a in seen[kept])
        for a in seen[fresh]:
            np.testing.assert_allclose(a, e2, rtol=0, atol=2e-5)
        assert mixed.workers[fresh].current_state == "mapped" and mixed.workers[fresh].values["written_bytes"] == 0
        assert mixed.workers[fresh].info["cache_file"] == str(new_path)
        assert file_mapping_usage(new_path, fresh).mappings > 0 and file_mapping_usage(path, fresh).mappings == 0

        # A rolling restart (SIGHUP) replaces the rest: every worker maps the new file.
        os.kill(srv.pid, signal.SIGHUP)
        new = loaded_workers(srv, 2, exclude={kept, fresh, stopped})
        for w in new.workers.values():
            assert w.current_state == "mapped" and w.values["written_bytes"] == 0, w
            assert_no_heap(w)
            assert file_mapping_usage(new_path, w.pid).mappings > 0
        final = embed_from_every_worker(srv, set(new.workers), TEXTS)
        for answers in final.values():
            for a in answers:
                np.testing.assert_allclose(a, e2, rtol=0, atol=2e-5)
    assert path.read_bytes() == old_bytes  # nothing wrote to the old model's file
    for file in (path, new_path):
        report = packcache.verify(file)
        assert report.ok, report


def test_the_sentence_transformers_engine_never_reaches_a_hub_whatever_hf_hub_offline_says() -> None:
    """The baseline engine promises a local directory, never a hub. It only defaulted
    ``HF_HUB_OFFLINE=1``, so an operator's ``HF_HUB_OFFLINE=0`` let ``--model org/name`` download.
    A real listener stands in for the hub (``HF_ENDPOINT``); the worker's load must fail without
    one connection to it."""
    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(16)
    hub.settimeout(0.2)
    code = (
        "import json\n"
        "from packcache.server.engines import EngineSpec, load_engine\n"
        "try:\n"
        "    load_engine(EngineSpec(engine='sentence-transformers', model='someorg/some-model'))\n"
        "    print(json.dumps('loaded'))\n"
        "except Exception as e:\n"
        "    print(json.dumps(type(e).__name__))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
           "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}", "HF_HOME": tempfile.mkdtemp()}  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    connections = 0
    try:
        while child.poll() is None:
            with contextlib.suppress(TimeoutError):
                conn, _ = hub.accept()
                connections += 1
                conn.close()
        out, err = child.communicate(timeout=120)
    finally:
        hub.close()
        if child.poll() is None:
            child.kill()
        shutil.rmtree(env["HF_HOME"], ignore_errors=True)
    assert connections == 0, f"the engine asked the hub {connections} times"
    assert child.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) != "loaded", out


def _publish(tmp: Path, checkpoint: Path, store: Path, key: Path) -> dict[str, Any]:
    """Machine A's CI job: build the checkpoint's cache, publish it signed; the publish report."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore",
           "XDG_CACHE_HOME": str(tmp / "xdg"), "PACKCACHE_DIGEST_DIR": str(tmp / "digests")}  # fmt: skip
    cli = [sys.executable, "-m", "packcache"]
    built = subprocess.run(
        [*cli, "build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir", str(tmp / "cache"),
         "--json"], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    published = subprocess.run(
        [*cli, "publish", json.loads(built.stdout)["cache_file"], str(store), "--sign", str(key), "--model",
         str(checkpoint), "--json"], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr[-2000:]
    report: dict[str, Any] = json.loads(published.stdout)
    return report


def test_a_fresh_machine_serves_from_the_store_and_a_rolling_restart_picks_up_the_next_published_model(
    tmp_path: Path,
) -> None:
    """The two-machine scenario: machine A builds and publishes; machine B (another directory,
    a copy of the checkpoint at another path with other mtimes, other variables) starts 4 workers with
    --remote: one download, nothing packed, every worker mapped. Then A publishes the next model version,
    B's model directory is updated in place and a rolling restart picks it up while requests go on."""
    from packcache.fleet.manifest import generate_key, public_path_for

    a, b = tmp_path / "a", tmp_path / "b"
    key = a / "ci.pem"
    a.mkdir()
    generate_key(key)
    store = tmp_path / "store"
    store.mkdir()
    v1 = _publish(a, tiny_bert(a / "v1", seed=1), store, key)
    model = b / "models" / "current"
    shutil.copytree(a / "v1", model)
    later = time.time() + 3600
    for path in model.iterdir():
        os.utime(path, (later, later))
    remote = ("--remote", str(store), "--trusted-key", public_path_for(key))
    args = ("--cache-dir", str(b / "cache"), "--model", str(model), *remote)
    with server(b, *args, workers=4) as srv:
        first = loaded_workers(srv, 4, timeout=120)
        for w in first.workers.values():
            assert w.current_state == "mapped" and w.values["written_bytes"] == 0 and w.packs["stored"] == 0, w
            assert w.info["cache_file"].endswith(f"{v1['model']}.pcache"), w
        # A worker that started after the file landed never asked the store (a clean local hit);
        # those that missed waited for the one download and found the file there.
        assert sum(w.values["remote_hits"] for w in first.workers.values()) >= 1
        downloads = [w.pid for w in first.workers.values() if w.values["remote_bytes"] >= v1["size"]]
        assert len(downloads) == 1, {w.pid: w.values["remote_bytes"] for w in first.workers.values()}
        e1 = embed_from_every_worker(srv, set(first.workers), TEXTS)

        # The next version: published by A; B's operator copies it over the model directory, then SIGHUP.
        v2 = _publish(a, tiny_bert(a / "v2", seed=2), store, key)
        assert v2["model"] != v1["model"]
        failures: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    status, _ = call(srv, "POST", "/embed", json.dumps({"texts": TEXTS}).encode(), timeout=30)
                    if status != 200:
                        failures.append(str(status))
                except OSError as exc:
                    failures.append(repr(exc))

        client = threading.Thread(target=traffic)
        client.start()
        try:
            for name in os.listdir(a / "v2"):
                shutil.copy(a / "v2" / name, model / f".{name}.new")
                os.rename(model / f".{name}.new", model / name)
            os.kill(srv.pid, signal.SIGHUP)
            second = loaded_workers(srv, 4, exclude=set(first.workers), timeout=120)
        finally:
            stop.set()
            client.join(60)
        assert failures == [], failures[:5]
        for w in second.workers.values():
            assert w.current_state == "mapped" and w.values["written_bytes"] == 0 and w.packs["stored"] == 0, w
            assert w.info["cache_file"].endswith(f"{v2['model']}.pcache"), w
        e2 = embed_from_every_worker(srv, set(second.workers), TEXTS)
        assert np.abs(np.asarray(next(iter(e2.values()))[0]) - np.asarray(next(iter(e1.values()))[0])).max() > 1e-3


# --------------------------------------------------------- a worker booting on a bad model directory


def test_a_worker_booting_with_a_fifo_in_the_model_directory_stops_the_server_instead_of_hanging(
    base: Path, tmp_path: Path
) -> None:
    """The master checked the directory at start; a FIFO planted before a rolling restart (SIGHUP) reaches the
    new workers themselves. Each refuses it at once (gunicorn then stops the server: a worker that cannot load
    its model is a boot failure, exit 1); none waits on it until the worker timeout, to be replaced and wait again."""
    directory = variant(base, tmp_path / "model", lambda d: None)
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "packcache", "serve", "--port", "0", "--torch-threads", "1", "--workers", "2",
            "--no-cache", "--scheme", "fp32", "--model", str(directory), "--timeout", "60"]  # fmt: skip
    err_path = tmp_path / "serve.err"
    with open(tmp_path / "serve.out", "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "listening on" not in (tmp_path / "serve.out").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
            time.sleep(0.1)
        fifo("tokenizer.json")(directory)
        os.kill(proc.pid, signal.SIGHUP)
        try:
            code = proc.wait(45)  # well under the 60 s worker timeout that would kill a hung worker
        except subprocess.TimeoutExpired:
            code = None
        log = err_path.read_text()
        assert code == 1, f"the server did not stop (exit {code}): {log[-3000:]}"
        assert "tokenizer.json: not a regular file (a FIFO)" in log, log[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


# --------------------------------------------- any sentence-transformers model (the hf loader) and the fast path rule

#: Texts of every length class: empty, short, and one past any max_seq_length of the tiny models.
ST_TEXTS = [*TEXTS, "the river city light market " * 60]


@pytest.fixture(scope="module")
def st_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random sentence-transformers models of three architectures (``harness.checkpoints``), once per module."""
    base = tmp_path_factory.mktemp("st-models")
    return {
        # mean pooling, Normalize, prompts with a default one
        "xlm-roberta": tiny_sentence_transformer(
            base / "xlmr",
            "xlm-roberta",
            prompts={"query": "query: ", "passage": "passage: "},
            default_prompt_name="query",
        ),
        # CLS pooling, no Normalize: the model's output is not unit length
        "mpnet": tiny_sentence_transformer(base / "mpnet", "mpnet", pooling="cls", normalize=False),
        # a Dense module after the pooling (its weights are sentence-transformers', unpacked), then Normalize
        "bert-dense": tiny_sentence_transformer(base / "bert", "bert", dense=16),
        "xlm-roberta-plain": tiny_transformer(base / "plain", "xlm-roberta"),
    }


def _reference(directory: Path, *, before_normalize: bool = False) -> Any:
    """sentence-transformers' own model of ``directory`` (one torch thread, as a worker), optionally without
    its trailing Normalize module."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize

    torch.set_num_threads(1)
    model = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    modules = list(model)
    if before_normalize and isinstance(modules[-1], Normalize):
        model = SentenceTransformer(modules=modules[:-1], device="cpu")
    return model


def _encode(model: Any, texts: list[str]) -> np.ndarray[Any, Any]:
    # prompt="": no default prompt (the engine's caller applies prompts, as the app does)
    return np.asarray(model.encode(texts, prompt="", convert_to_numpy=True), dtype=np.float64)


def _cosines(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    result: np.ndarray[Any, Any] = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return result


def _hf_engine(model: Path | str, scheme: str = "fp32", **given: Any) -> Any:
    from packcache.server.engines import EngineSpec, load_engine

    return load_engine(EngineSpec(engine="packcache", loader="hf", model=str(model), scheme=scheme, **given))


@pytest.mark.parametrize("name", ["xlm-roberta", "mpnet", "bert-dense", "xlm-roberta-plain"])
def test_the_hf_engine_embeds_as_sentence_transformers_encodes_before_and_after_normalize(
    st_models: dict[str, Path], name: str
) -> None:
    directory = st_models[name]
    engine = _hf_engine(directory)  # fp32, caching off: the same float32 computation as sentence-transformers
    assert engine.name == "packcache" and engine.scheme == "fp32" and engine.cache_file == ""
    assert engine.stats().state == "off" and engine.model_id == directory.name
    raw = engine.embed(ST_TEXTS, normalize=False)
    unit = engine.embed(ST_TEXTS)
    assert raw.dtype == unit.dtype == np.float32 and raw.shape == unit.shape == (len(ST_TEXTS), engine.dimension)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(raw, _encode(_reference(directory, before_normalize=True), ST_TEXTS), atol=2e-5)
    reference = _encode(_reference(directory), ST_TEXTS)
    if name in ("xlm-roberta", "bert-dense"):  # the model normalises: its output is the engine's normalize=True
        np.testing.assert_allclose(unit, reference, atol=2e-5)
        assert not np.allclose(np.linalg.norm(raw[:-1], axis=1), 1.0, atol=1e-3), "normalize=False is before it"
    else:  # no Normalize module: the model's output is normalize=False
        np.testing.assert_allclose(raw, reference, atol=2e-5)
    # A row does not depend on the texts sharing its call (the batcher merges requests).
    alone = np.stack([engine.embed([text])[0] for text in ST_TEXTS])
    np.testing.assert_allclose(alone, unit, atol=2e-5)
    assert engine.embed([]).shape == (0, engine.dimension)


def test_the_hf_engine_counts_tokens_as_encode_tokenizes_and_truncates_to_max_seq_length(
    st_models: dict[str, Path],
) -> None:
    for name in ("xlm-roberta", "bert-dense", "xlm-roberta-plain"):
        engine = _hf_engine(st_models[name])
        reference = _reference(st_models[name])
        assert engine.max_tokens == reference.max_seq_length == (64 if name != "xlm-roberta-plain" else 128)
        counts = engine.tokens(ST_TEXTS)
        for text, count in zip(ST_TEXTS, counts, strict=True):
            features = reference.preprocess([text])
            assert int(features["attention_mask"].sum()) == min(count, engine.max_tokens), (name, text[:20])
        assert counts[-1] > engine.max_tokens and counts[TEXTS.index("")] == 2  # <s></s> or [CLS][SEP]
        assert engine.tokens([]) == []


def test_a_default_prompt_that_is_empty_is_kept_so_requests_are_not_refused(tmp_path: Path) -> None:
    """A model whose default prompt is the empty string (sentence-transformers' own are): the engine keeps it, so
    the app finds the default prompt by its name (dropping empty prompts answered every request with a 500)."""
    from packcache.server.app import EmbeddingApp

    directory = tiny_sentence_transformer(
        tmp_path / "m", "bert", prompts={"query": "", "passage": "passage: "}, default_prompt_name="query"
    )
    engine = _hf_engine(directory)
    assert engine.default_prompt_name == "query" and engine.prompts["query"] == ""
    # pinned here: the app's prompt step, as every route runs it
    assert EmbeddingApp._prompted(cast(Any, SimpleNamespace(engine=engine)), ["a text"], None) == ["a text"]


def test_the_hf_engine_takes_prompts_and_dimension_from_the_model(st_models: dict[str, Path]) -> None:
    xlmr = _hf_engine(st_models["xlm-roberta"], model_id="served-name")
    # The model's own prompts, and the empty ones sentence-transformers adds (a default prompt may name one).
    assert xlmr.prompts == {**xlmr.model.prompts, "query": "query: ", "passage": "passage: "}
    others = set(xlmr.prompts) - {"query", "passage"}
    assert xlmr.default_prompt_name == "query" and not any(xlmr.prompts[k] for k in others)
    assert xlmr.model_id == "served-name" and xlmr.dimension == 32
    dense = _hf_engine(st_models["bert-dense"])
    assert not any(dense.prompts.values()) and dense.default_prompt_name is None and dense.dimension == 16
    # The caller prefixes a prompt (as encode(prompt_name=...) does): the same embedding as sentence-transformers'.
    reference = _reference(st_models["xlm-roberta"])
    expected = np.asarray(reference.encode(TEXTS[:3], prompt_name="passage"), dtype=np.float64)
    np.testing.assert_allclose(xlmr.embed(["passage: " + t for t in TEXTS[:3]]), expected, atol=2e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_the_hf_engine_packs_every_architecture_close_to_float32(
    st_models: dict[str, Path], tmp_path: Path, scheme: str
) -> None:
    from packcache import hf

    for name in ("xlm-roberta", "mpnet", "bert-dense"):
        directory = st_models[name]
        engine = _hf_engine(
            directory, scheme, cache=str(tmp_path / "c.pcache"), cache_dir=str(tmp_path / name), prefault=True
        )
        # named by content in the cache directory, as `packcache build` names it
        assert engine.cache_file == str(hf.default_cache_path(directory, scheme, cache_dir=tmp_path / name))
        assert engine.stats().state == "stored" and engine.stats().heap_bytes == 0
        layers = hf.load_report(engine.model).converted
        assert layers, f"{name} {scheme}: no layer packed"
        similarity = _cosines(engine.embed(ST_TEXTS), _encode(_reference(directory), ST_TEXTS))
        assert similarity.min() >= 0.999, (name, scheme, similarity)


def test_the_loader_rule_keeps_the_minilm_fast_path_for_checkpoints_of_its_shape(
    st_models: dict[str, Path], base: Path, tmp_path: Path
) -> None:
    from packcache import hf
    from packcache.models import minilm
    from packcache.server.modelfiles import choose_loader

    assert choose_loader(None) == "minilm"
    assert choose_loader(str(minilm.default_model_path())) == "minilm"  # Transformer, mean pooling, Normalize
    assert choose_loader(str(base)) == "minilm"  # a plain BERT with MiniLM's tokenizer and truncation
    for name in ("xlm-roberta", "mpnet", "bert-dense", "xlm-roberta-plain"):
        assert choose_loader(str(st_models[name])) == "hf", name

    # Links to a copy of its own: a hard link to the installed model moves that file's ctime, and a server of another
    # test reading it at that moment refused it as changed since its header was read (its workers failed to boot).
    private = tmp_path / "installed-copy"
    shutil.copytree(minilm.default_model_path(), private)

    def shaped(edit: Any) -> str:
        target = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(private, target, copy_function=os.link)
        edit(target)
        return choose_loader(str(target))

    def rewrite(name: str, change: Any) -> Any:
        def edit(directory: Path) -> None:
            data = json.loads((directory / name).read_text())
            (directory / name).unlink()  # a hard link: never write through it
            (directory / name).write_text(json.dumps(change(data)))

        return edit

    cls_pooling = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    assert shaped(rewrite("1_Pooling/config.json", lambda c: {**c, **cls_pooling})) == "hf"
    assert shaped(rewrite("1_Pooling/config.json", lambda c: {"pooling_mode": "mean"})) == "minilm"
    assert shaped(rewrite("config_sentence_transformers.json", lambda c: {**c, "prompts": {"q": "q: "}})) == "hf"
    assert shaped(rewrite("config_sentence_transformers.json", lambda c: {**c, "prompts": {"q": ""}})) == "minilm"
    assert shaped(rewrite("config.json", lambda c: {**c, "hidden_act": "gelu_new"})) == "hf"
    assert shaped(rewrite("config.json", lambda c: {**c, "model_type": "roberta"})) == "hf"
    assert shaped(rewrite("sentence_bert_config.json", lambda c: {**c, "do_lower_case": True})) == "hf"
    # sentence-transformers truncates at the tokenizer's 128 where MiniLM's loader would read 512 positions
    no_limit, short = rewrite("sentence_bert_config.json", lambda c: {}), {"model_max_length": 128}
    assert shaped(lambda d: (no_limit(d), rewrite("tokenizer_config.json", lambda c: {**c, **short})(d))) == "hf"
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    assert shaped(rewrite("modules.json", lambda m: [*m, dense])) == "hf"
    # a malformed checkpoint of MiniLM's shape stays the MiniLM loader's to refuse (its one-line messages)
    assert shaped(rewrite("config.json", lambda c: {**c, "num_attention_heads": 0})) == "minilm"
    # cache files: by the loader that built them
    hf.sentence_transformer(st_models["mpnet"], "int8", tmp_path / "mpnet.pcache").packcache.close()
    assert choose_loader(str(tmp_path / "mpnet.pcache")) == "hf"
    minilm.load("int8", cache=tmp_path / "tiny.pcache", model_path=base).cache.close()
    assert choose_loader(str(tmp_path / "tiny.pcache")) == "minilm"  # a plain BERT's
    minilm.load("int4", cache=tmp_path / "tiny4.pcache", model_path=base).cache.close()
    assert choose_loader(str(tmp_path / "tiny4.pcache")) == "minilm"  # calibrated int4: MiniLM's alone
    bundled = tmp_path / "bundled.pcache"
    hf.sentence_transformer(minilm.default_model_path(), "int8", bundled).packcache.close()
    assert choose_loader(str(bundled)) == "minilm"  # built by packcache.hf, of MiniLM's shape


def test_the_transformer_folder_is_read_from_modules_json_and_must_stay_inside_the_model(tmp_path: Path) -> None:
    from packcache.errors import FormatError
    from packcache.server.modelfiles import transformer_folder_of

    assert transformer_folder_of(tmp_path) == ""  # a plain checkpoint
    ref = "sentence_transformers.models.Transformer"
    for modules, expected in (([{"type": ref, "path": ""}], ""), ([{"type": ref, "path": "0_T/"}], "0_T")):
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        assert transformer_folder_of(tmp_path) == expected
    for modules, says in (
        ([{"type": ref, "path": "../elsewhere"}], "not a folder inside the model"),
        ([{"type": ref, "path": "/etc"}], "not a folder inside the model"),
        ([{"type": ref, "path": ""}, {"type": ref, "path": "b"}], "2 Transformer modules"),
        ({"type": ref}, "not a JSON list"),
    ):
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        with pytest.raises(FormatError, match=says):
            transformer_folder_of(tmp_path)


def test_the_weights_source_is_derived_from_the_cache_statistics() -> None:
    from packcache.server.engines import weights_source
    from packcache.stats import CacheStats

    assert weights_source(CacheStats(state="stored", written_bytes=8)) == ("stored", "")
    assert weights_source(CacheStats(state="mapped")) == ("mapped", "")
    assert weights_source(CacheStats(state="mapped", remote_hits=1)) == ("remote", "")
    degraded = CacheStats(state="degraded", heap_reason="no_space", errno=28, error="no space left on /c")
    assert weights_source(degraded) == ("heap", "degraded: no_space, errno 28 (ENOSPC), no space left on /c")
    assert weights_source(CacheStats(state="heap", heap_reason="untrusted")) == ("heap", "heap: untrusted")
    assert weights_source(CacheStats(state="off")) == ("heap", "caching off")
