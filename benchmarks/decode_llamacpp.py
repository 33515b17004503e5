"""llama.cpp rows of the decode benchmark: GGUF files made by llama.cpp's own tools, one measured run.

Method. The checkpoint is the benchmark's own (``benchmarks/decode.py`` makes it: random weights, bf16
safetensors). :func:`add_tokenizer` gives it a tiny sentencepiece tokenizer so llama.cpp's converter accepts it
offline (token ids are fed directly, so the tokenizer's content never matters; the converter pads the vocabulary
to the config's ``vocab_size``). :func:`make_ggufs` converts it to BF16 with the vendored
``convert_hf_to_gguf.py`` and quantises that file to Q8_0 and Q4_0 with ``llama_model_quantize`` (llama.cpp's
default per-tensor choices), timing each step and recording what every file holds. :func:`run` loads one GGUF
in a fresh process through llama-cpp-python (mmap, 2 threads), evaluates the prompt in one batch, then decodes
greedily one token per ``Llama.eval`` call with a numpy argmax over the last logits.

Everything here runs with the decode environment's python (``benchmarks/setup_decode.sh``)::

    .bench/decode/venv/bin/python benchmarks/decode_llamacpp.py make CHECKPOINT_DIR OUT
    .bench/decode/venv/bin/python benchmarks/decode_llamacpp.py run OUT/model-Q8_0.gguf --json q8.json [--cold|--warm]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import io
import json
import mmap
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import core

LLAMA_CPP_PYTHON = "0.3.36"
PROMPT = list(range(1000, 1032))
NEW_TOKENS = 64
GGUF_TYPES = ("BF16", "Q8_0", "Q4_0")
MANIFEST = "ggufs.json"
# The binding's names for the llama_ftype values (llama.h) this script quantises to.
_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
_CONVERT_TIMEOUT_S = 3600
_QUANTIZE_TIMEOUT_S = 3600
_REPO = Path(__file__).resolve().parents[1]


def decode_env() -> Path:
    """The decode benchmark's environment directory (the one ``setup_decode.sh`` builds).

    ``$PACKCACHE_DECODE_ENV`` first (as in the setup script), then the environment of the running python
    (``ENV/venv/bin/python``), then ``.bench/decode`` in this repository.

    Returns:
        The directory holding ``venv`` and ``src/llama_cpp_python-<version>``.

    Raises:
        FileNotFoundError: no such environment; run ``bash benchmarks/setup_decode.sh``.
    """
    candidates = [Path(os.environ["PACKCACHE_DECODE_ENV"])] if "PACKCACHE_DECODE_ENV" in os.environ else []
    candidates += [Path(sys.prefix).parent, _REPO / ".bench" / "decode"]
    for env in candidates:
        if (env / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}").is_dir():
            return env.resolve()
    raise FileNotFoundError(
        f"no decode environment with llama_cpp_python-{LLAMA_CPP_PYTHON} sources in {[str(c) for c in candidates]}: "
        "run `bash benchmarks/setup_decode.sh` (or set PACKCACHE_DECODE_ENV)"
    )


def llama_cpp_tree() -> Path:
    """The llama.cpp tree vendored by the llama-cpp-python sdist (its converter and gguf-py).

    Raises:
        FileNotFoundError: see :func:`decode_env`.
    """
    return decode_env() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def _tokenizer_corpus(lines: int = 400) -> list[str]:
    # Generated, not downloaded: any text trains a tokenizer good enough to be carried in the GGUF.
    rng = random.Random(0)
    words = ["cache", "packed", "weights", "memory", "mapped", "file", "decode", "token", "prompt", "tensor"]
    words += ["layer", "head", "row", "column", "scale", "group", "block", "float", "kernel", "thread", "page"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def add_tokenizer(checkpoint_dir: str | os.PathLike[str], vocab: int = 512) -> Path:
    """Give a checkpoint a tiny sentencepiece tokenizer so llama.cpp's converter takes it without a download.

    Trains a BPE sentencepiece model (unk 0, bos 1, eos 2, byte fallback, as Llama 2's) on generated text and
    writes ``tokenizer.model`` and a minimal ``tokenizer_config.json`` (no BOS/EOS added: the benchmark feeds
    token ids). The converter's sentencepiece path pads the vocabulary with ``[PAD<i>]`` tokens up to the
    config's ``vocab_size``, so embedding and output head keep all their rows.

    Args:
        checkpoint_dir: a Hugging Face checkpoint directory (``config.json`` + safetensors).
        vocab: the sentencepiece vocabulary size (at least 256 + 3 for byte fallback); far below the model's.

    Returns:
        The path of ``tokenizer.model``.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` has no ``config.json``.
        ValueError: the config's ``vocab_size`` is smaller than ``vocab``.
    """
    import sentencepiece

    directory = Path(checkpoint_dir)
    config = json.loads((directory / "config.json").read_text())
    if config["vocab_size"] < vocab:
        raise ValueError(f"{directory / 'config.json'}: vocab_size {config['vocab_size']} < tokenizer vocab {vocab}")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_tokenizer_corpus()),
        model_writer=model,
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = directory / "tokenizer.model"
    path.write_bytes(model.getvalue())
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": config.get("max_position_embeddings", 2048),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path


def _gguf_module() -> Any:
    # The vendored gguf-py, not a PyPI gguf: the reader must know every type this llama.cpp writes.
    tree = str(llama_cpp_tree() / "gguf-py")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    import gguf

    return gguf


def gguf_contents(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a GGUF file holds, read with llama.cpp's gguf-py ``GGUFReader``.

    Args:
        path: a GGUF file.

    Returns:
        ``{"bytes", "file_type", "n_vocab", "tensor_count", "tensor_types": {type: count},
        "tensor_bytes": {type: bytes}, "roles": {name with blk.N -> blk.*: [types]}, "token_embd": {"type",
        "shape", "bytes"}, "output": the same or None}``. ``output`` is None when the head is tied to
        ``token_embd`` (llama.cpp then multiplies by the embedding tensor).

    Raises:
        OSError: the file cannot be read; ValueError: it is not a GGUF file.
    """
    gguf = _gguf_module()
    reader = gguf.GGUFReader(str(path), "r")
    type_counts: collections.Counter[str] = collections.Counter()
    type_bytes: collections.Counter[str] = collections.Counter()
    roles: dict[str, set[str]] = collections.defaultdict(set)
    named: dict[str, dict[str, Any]] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        type_counts[type_name] += 1
        type_bytes[type_name] += int(tensor.n_bytes)
        roles[re.sub(r"^blk\.\d+\.", "blk.*.", tensor.name)].add(type_name)
        if tensor.name in ("token_embd.weight", "output.weight"):
            named[tensor.name] = {
                "type": type_name,
                "shape": [int(n) for n in tensor.shape],
                "bytes": int(tensor.n_bytes),
            }
    tokens = reader.get_field("tokenizer.ggml.tokens")
    file_type = reader.get_field("general.file_type")
    return {
        "bytes": Path(path).stat().st_size,
        "file_type": int(file_type.contents()) if file_type is not None else None,
        "n_vocab": len(tokens.data) if tokens is not None else None,
        "tensor_count": len(reader.tensors),
        "tensor_types": dict(sorted(type_counts.items())),
        "tensor_bytes": dict(sorted(type_bytes.items())),
        "roles": {role: sorted(types) for role, types in sorted(roles.items())},
        "token_embd": named.get("token_embd.weight"),
        "output": named.get("output.weight"),
    }


def _run_logged(argv: list[str], log: Path, env: dict[str, str], timeout: float) -> float:
    # Output to a log file, not a pipe: the converter logs every tensor, and a full pipe would block it.
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{argv[1]} exited {process.returncode} (log {log}):\n{tail}")
    return seconds


def _checkpoint_signature(checkpoint: Path) -> list[list[Any]]:
    return [
        [p.name, p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(checkpoint.iterdir())
        if p.suffix in (".safetensors", ".json", ".model")
    ]


def make_ggufs(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    types: tuple[str, ...] = GGUF_TYPES,
    threads: int = 2,
    *,
    rebuild: bool = False,
) -> dict[str, Any]:
    """Make the benchmark's GGUF files from a checkpoint with llama.cpp's own converter and quantiser.

    ``BF16`` by ``convert_hf_to_gguf.py --outtype bf16`` (a subprocess of this python, offline, the vendored
    gguf-py first on PYTHONPATH); every other type quantised from that BF16 file by ``llama_model_quantize``
    with llama.cpp's default parameters (``nthread=threads``), each in its own subprocess (the quantiser's
    buffers stay out of the caller's memory). The result is also written to ``OUT_DIR/ggufs.json``, and
    reused (``"reused": true``, the first build's seconds) while the checkpoint's files are unchanged, unless
    ``rebuild``. Logs go to ``OUT_DIR/<type>.log``.

    Args:
        checkpoint_dir: a checkpoint with a tokenizer (see :func:`add_tokenizer`).
        out_dir: where ``model-<type>.gguf`` files go (created).
        types: any of ``BF16``, ``Q8_0``, ``Q4_0`` (``BF16`` is always made: the others are quantised from it).
        threads: threads for the quantiser.
        rebuild: make the files even if ``ggufs.json`` says they are up to date.

    Returns:
        ``{"files": {type: Path}, "seconds": {type: s}, "process_seconds": {type: s}, "steps": {type: what
        ran}, "contents": {type: gguf_contents()}, "checkpoint", "llama_cpp_python", "reused"}``. ``seconds``
        is the cold build of that file: for BF16 the converter's wall time (python start-up included), for a
        quantisation the ``llama_model_quantize`` call alone (``process_seconds``: its whole subprocess).

    Raises:
        FileNotFoundError: no ``tokenizer.model`` in the checkpoint, or no decode environment.
        ValueError: an unknown type.
        RuntimeError: the converter or the quantiser failed (the message holds the log's tail).
        subprocess.TimeoutExpired: a step took over an hour.
    """
    checkpoint = Path(checkpoint_dir).resolve()
    out = Path(out_dir)
    wanted = ["BF16", *(t for t in _FTYPES if t in types)]
    unknown = sorted(set(types) - {"BF16", *_FTYPES})
    if unknown:
        raise ValueError(f"unknown GGUF types {unknown}: choose from BF16, {', '.join(_FTYPES)}")
    if not (checkpoint / "tokenizer.model").is_file():
        raise FileNotFoundError(f"{checkpoint / 'tokenizer.model'}: call add_tokenizer({str(checkpoint)!r}) first")
    signature = _checkpoint_signature(checkpoint)
    manifest_path = out / MANIFEST
    if not rebuild and manifest_path.is_file():
        previous = json.loads(manifest_path.read_text())
        if (
            previous.get("signature") == signature
            and previous.get("llama_cpp_python") == LLAMA_CPP_PYTHON
            and all(t in previous["files"] and Path(previous["files"][t]).is_file() for t in wanted)
        ):
            previous["files"] = {t: Path(f) for t, f in previous["files"].items()}
            previous["reused"] = True
            return previous
    tree = llama_cpp_tree()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    made: dict[str, Any] = {"files": {}, "seconds": {}, "process_seconds": {}, "steps": {}, "contents": {}}
    bf16 = out / "model-BF16.gguf"
    convert_argv = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16"]
    seconds = _run_logged([*convert_argv, "--outfile", str(bf16)], out / "BF16.log", env, _CONVERT_TIMEOUT_S)
    made["files"]["BF16"] = bf16
    made["seconds"]["BF16"] = made["process_seconds"]["BF16"] = seconds
    made["steps"]["BF16"] = "convert_hf_to_gguf.py --outtype bf16"
    for gguf_type in wanted[1:]:
        path = out / f"model-{gguf_type}.gguf"
        result = out / f"{gguf_type}.quantize.json"
        quantize_argv = [sys.executable, __file__, "quantize", str(bf16), str(path), gguf_type]
        process_seconds = _run_logged(
            [*quantize_argv, "--threads", str(threads), "--json", str(result)],
            out / f"{gguf_type}.log",
            env,
            _QUANTIZE_TIMEOUT_S,
        )
        step = json.loads(result.read_text())
        result.unlink()
        made["files"][gguf_type] = path
        made["seconds"][gguf_type] = step["seconds"]
        made["process_seconds"][gguf_type] = process_seconds
        made["steps"][gguf_type] = f"llama_model_quantize(BF16 -> {step['ftype_name']}, nthread={threads})"
    for gguf_type, path in made["files"].items():
        made["contents"][gguf_type] = gguf_contents(path)
    made.update(checkpoint=str(checkpoint), signature=signature, llama_cpp_python=LLAMA_CPP_PYTHON, reused=False)
    manifest_path.write_text(json.dumps({**made, "files": {t: str(p) for t, p in made["files"].items()}}, indent=2))
    return made


def quantize(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], gguf_type: str, threads: int = 2
) -> dict[str, Any]:
    """Quantise a GGUF with ``llama_cpp.llama_model_quantize`` and llama.cpp's default per-tensor choices.

    Args:
        src: the BF16 GGUF.
        dst: the file to write.
        gguf_type: ``Q8_0`` or ``Q4_0``.
        threads: the quantiser's ``nthread``.

    Returns:
        ``{"seconds": the call's wall time, "ftype": llama_ftype, "ftype_name": llama.cpp's name for it}``.

    Raises:
        ValueError: an unknown type.
        RuntimeError: ``llama_model_quantize`` returned non-zero.
    """
    import llama_cpp

    if gguf_type not in _FTYPES:
        raise ValueError(f"unknown quantisation {gguf_type!r}: choose from {', '.join(_FTYPES)}")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _FTYPES[gguf_type])
    params.nthread = threads
    start = time.perf_counter()
    status = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {gguf_type}) returned {status}")
    name = llama_cpp.llama_ftype_name(params.ftype)
    return {"seconds": seconds, "ftype": int(params.ftype), "ftype_name": name.decode() if name else gguf_type}


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def page_cache_fraction(path: str | os.PathLike[str]) -> float:
    """The fraction of a file's pages in the page cache (``mincore`` on a fresh read-only mapping).

    Raises:
        OSError: the file cannot be opened, mapped or queried.
    """
    page = mmap.PAGESIZE
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return 1.0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + page - 1) // page
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(byte & 1 for byte in vector) / pages
        finally:
            _libc.munmap(address, size)


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Evict one file's clean pages from the page cache (``POSIX_FADV_DONTNEED``); other files keep theirs.

    Pages another process maps or that are dirty stay; :func:`page_cache_fraction` says what is left.

    Raises:
        OSError: the file cannot be opened.
    """
    core.drop_pages([os.fspath(path)])  # dirty pages are not dropped: written back first (a GGUF just made)


def read_into_page_cache(path: str | os.PathLike[str], chunk: int = 1 << 24) -> None:
    """Read a whole file once so that its pages are in the page cache (a warm start).

    Raises:
        OSError: the file cannot be read.
    """
    buffer = bytearray(chunk)
    with open(path, "rb", buffering=0) as file:
        while file.readinto(buffer):
            pass


def weight_bytes_per_token(contents: dict[str, Any]) -> int:
    """The weight bytes one decode step reads: every tensor once, but an untied embedding only one row.

    Args:
        contents: :func:`gguf_contents` of the model.
    """
    total = sum(contents["tensor_bytes"].values())
    if contents["output"] is not None and contents["token_embd"] is not None:
        rows = contents["token_embd"]["shape"][-1]
        total -= contents["token_embd"]["bytes"] - contents["token_embd"]["bytes"] // rows
    return int(total)


def kernel_path(load_log: str) -> dict[str, Any]:
    """Where llama.cpp put the weights, from its load log: buffer sizes (MiB) and repacked layouts.

    ``CPU_Mapped`` is the GGUF's own mapping; ``CPU_REPACK`` holds tensors copied into the interleaved layouts
    of the CPU kernels (``repacked``: layout -> tensor count, e.g. ``q4_0_8x8``); ``AMX`` the AMX kernels'.
    """
    buffers = {
        name: float(mib)
        for name, mib in re.findall(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", load_log)
    }
    repacked = collections.Counter(re.findall(r"repack tensor \S+ with (\w+)", load_log))
    amx = len(re.findall(r"amx repack tensor", load_log))
    return {"buffers_mib": buffers, "repacked": dict(sorted(repacked.items())), "amx_repacked": amx}


def _memory_kib() -> dict[str, int]:
    fields = {"Rss": "rss_kib", "Pss": "pss_kib", "Pss_Anon": "pss_anon_kib", "Pss_File": "pss_file_kib"}
    memory = {"peak_rss_kib": core.peak_rss_kib()}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            memory[fields[key]] = int(value.split()[0])
    return memory


def run(
    gguf_path: str | os.PathLike[str],
    prompt: list[int] | None = None,
    new_tokens: int = NEW_TOKENS,
    threads: int = 2,
    *,
    logits_path: str | os.PathLike[str] | None = None,
    cold: bool = False,
    warm: bool = False,
    long_prompt: int = 0,
) -> dict[str, Any]:
    """Load a GGUF with llama-cpp-python, evaluate the prompt, greedily decode; meant for a fresh process.

    ``Llama(n_ctx=max(256, long_prompt), n_threads=n_threads_batch=threads, n_batch=512, use_mmap=True,
    logits_all=False)`` (``n_batch`` as llama-server's ``--ubatch-size`` default). The
    prompt is one ``eval`` (one batch); its last logits give the first token; each further token is one
    ``eval([token])`` followed by a numpy argmax over ``llama_get_logits_ith(ctx, -1)`` (the binding's sampler
    is never used). With mmap, weights are read by the page faults of the first evaluation, so a cold cache
    shows in ``prefill_s`` more than in ``load_s``: compare ``first_token_s``. Tensors llama.cpp repacks for
    its CPU kernels (``CPU_REPACK``) are copied out of the mapping into anonymous memory at load.

    Args:
        gguf_path: the model.
        prompt: token ids (default ``PROMPT``: 32 ids from 1000).
        new_tokens: tokens to generate, the first one from the prompt's logits.
        threads: llama.cpp threads for both prompt and decode.
        logits_path: where to save the last prompt position's logits (float32 ``.npy``), if given.
        cold: evict the file from the page cache first (``posix_fadvise(DONTNEED)``).
        long_prompt: after decoding, this many tokens (ids from 1000) evaluated on an emptied KV cache
            (``prefill_long_s``; 0: not measured).
        warm: read the file through first if any page of it is not cached. Neither: the cache as found
            (``page_cache_fraction_before`` says how much of the file it held).

    Returns:
        A JSON-ready dict: ``gguf``, ``gguf_bytes``, ``threads``, ``prompt_tokens``, ``new_tokens``, ``cache``
        ("cold", "warm" or "as found"), ``page_cache_fraction_before`` (``mincore`` just before loading),
        ``import_s`` (``import llama_cpp``), ``load_s`` (``Llama(...)``), ``prefill_s``, ``first_token_s``
        (load + prefill), ``decode_s`` (tokens 2..n), ``tok_s`` ((new_tokens - 1) / decode_s), ``token_ms``
        (``median``, ``min``, ``max`` and ``each`` decode step, in order), ``tok_s_median_step`` (1000 / median
        step ms: robust to the stalls another process's load causes), ``others_cpu_share`` (CPU time other
        processes took during decoding, as a share of all CPUs: above ~0.05 the run was contended), ``tokens``
        (the generated ids), ``logits_path``, ``prefill_long_s`` (when ``long_prompt``), memory at the end
        (``peak_rss_kib``: the process's own ``VmHWM``; ``rss_kib``, ``pss_kib``, ``pss_anon_kib``,
        ``pss_file_kib`` from ``/proc/self/smaps_rollup``),
        ``n_vocab``, ``file_types`` (tensor type counts), ``weight_bytes_per_token`` (every tensor once; an
        untied embedding counts one row), ``kernel_path`` (llama.cpp's weight buffers in MiB and its repacked
        layouts, from its load log), ``llama_cpp_python``, ``system_info`` (``llama_print_system_info``: the
        SIMD paths compiled in).

    Raises:
        FileNotFoundError: no such GGUF.
        ValueError: ``new_tokens`` < 2, an empty prompt, or both ``cold`` and ``warm``.
        RuntimeError: llama.cpp failed to load or evaluate.
    """
    prompt = list(PROMPT if prompt is None else prompt)
    if new_tokens < 2 or not prompt:
        raise ValueError(f"need a prompt and at least 2 new tokens (got {len(prompt)} and {new_tokens})")
    if cold and warm:
        raise ValueError("cold and warm exclude each other")
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if cold:
        drop_from_page_cache(path)
    elif warm and page_cache_fraction(path) < 1.0:
        read_into_page_cache(path)
    cached = page_cache_fraction(path)

    start = time.perf_counter()
    import llama_cpp

    import_s = time.perf_counter() - start
    log: list[str] = []

    # Replaces the binding's logger (which prints nothing when verbose=False): the load log names the buffers.
    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        log.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        result = _measure(llama_cpp, path, prompt, new_tokens, threads, logits_path, long_prompt)
    finally:
        # llama.cpp logs while freeing too: once collect is garbage it would call freed memory, so the model is
        # freed first and the binding's own logger put back (seen: a TypeError from a reused object at exit).
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    # After the measurement: reading the GGUF's header maps it again and touches its first pages.
    contents = gguf_contents(path)
    return {
        "gguf": str(path),
        "gguf_bytes": path.stat().st_size,
        "threads": threads,
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "cache": "cold" if cold else "warm" if warm else "as found",
        "page_cache_fraction_before": round(cached, 4),
        "import_s": import_s,
        **result,
        "logits_path": None if logits_path is None else str(logits_path),
        "file_types": contents["tensor_types"],
        "weight_bytes_per_token": weight_bytes_per_token(contents),
        "kernel_path": kernel_path("".join(log)),
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


def _measure(
    llama_cpp: Any,
    path: Path,
    prompt: list[int],
    new_tokens: int,
    threads: int,
    logits_path: str | os.PathLike[str] | None,
    long_prompt: int = 0,
) -> dict[str, Any]:
    import numpy as np

    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=max(256, long_prompt),
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        use_mmap=True,
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - start
    n_vocab = llm.n_vocab()

    def last_logits() -> Any:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    start = time.perf_counter()
    llm.eval(prompt)
    logits = last_logits()
    generated = [int(logits.argmax())]
    prefill_s = time.perf_counter() - start
    if logits_path is not None:
        np.save(logits_path, logits.astype(np.float32, copy=True))
    token_s = []
    busy_start, own_start = core.cpu_seconds()
    decode_start = time.perf_counter()
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        llm.eval([generated[-1]])
        generated.append(int(last_logits().argmax()))
        token_s.append(time.perf_counter() - start)
    decode_s = time.perf_counter() - decode_start
    busy_end, own_end = core.cpu_seconds()
    long: dict[str, float] = {}
    if long_prompt:
        llm.reset()  # position 0: eval removes the KV cache's entries from there on
        start = time.perf_counter()
        llm.eval(list(range(1000, 1000 + long_prompt)))
        last_logits()
        long["prefill_long_s"] = time.perf_counter() - start
    memory = _memory_kib()
    llm.close()
    token_ms = [round(1000 * s, 3) for s in token_s]
    ordered = sorted(token_ms)
    return {
        "load_s": load_s,
        "prefill_s": prefill_s,
        "first_token_s": load_s + prefill_s,
        "decode_s": decode_s,
        "tok_s": (new_tokens - 1) / decode_s,
        "tok_s_median_step": 1000 / ordered[len(ordered) // 2],
        "others_cpu_share": max(0.0, (busy_end - busy_start) - (own_end - own_start)) / (decode_s * os.cpu_count()),
        "token_ms": {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1], "each": token_ms},
        "tokens": generated,
        **long,
        **memory,
        "n_vocab": n_vocab,
    }


def main(argv: list[str] | None = None) -> int:
    """``make DIR OUT`` (tokenizer + GGUFs, prints the manifest), ``run GGUF`` (prints one run), ``quantize``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="decode_llamacpp.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make", help="add a tokenizer to CHECKPOINT and make its GGUF files in OUT")
    make.add_argument("checkpoint", type=Path)
    make.add_argument("out", type=Path)
    make.add_argument("--types", default=",".join(GGUF_TYPES), help="comma-separated (default %(default)s)")
    make.add_argument("--threads", type=int, default=2)
    make.add_argument("--json", type=Path, help="also write the manifest here")
    one = commands.add_parser("run", help="one measured run of a GGUF (use a fresh process per run)")
    one.add_argument("gguf", type=Path)
    one.add_argument("--json", type=Path, help="also write the result here")
    one.add_argument("--logits", type=Path, help="save the last prompt position's logits (.npy)")
    cache = one.add_mutually_exclusive_group()
    cache.add_argument("--cold", action="store_true", help="evict the GGUF from the page cache first")
    cache.add_argument("--warm", action="store_true", help="read the GGUF into the page cache first")
    one.add_argument("--threads", type=int, default=2)
    one.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    quant = commands.add_parser("quantize", help="quantise a GGUF (make runs this in a subprocess)")
    quant.add_argument("src", type=Path)
    quant.add_argument("dst", type=Path)
    quant.add_argument("type", choices=sorted(_FTYPES))
    quant.add_argument("--threads", type=int, default=2)
    quant.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    result: dict[str, Any]
    if args.command == "make":
        add_tokenizer(args.checkpoint)
        made = make_ggufs(args.checkpoint, args.out, tuple(args.types.split(",")), args.threads, rebuild=True)
        result = {**made, "files": {t: str(p) for t, p in made["files"].items()}}
    elif args.command == "run":
        result = run(
            args.gguf, PROMPT, args.new_tokens, args.threads, logits_path=args.logits, cold=args.cold, warm=args.warm
        )
    else:
        result = quantize(args.src, args.dst, args.type, args.threads)
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
