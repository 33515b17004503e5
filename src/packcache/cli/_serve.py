"""``packcache serve``: the command line of the embedding service (:mod:`packcache.server`)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any

from .. import _defaults
from .._defaults import GROUP_SIZE
from ..errors import FormatError, RemoteError
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    Out,
    chosen_group_size,
    chosen_scheme,
    positive,
    sanitize,
    seconds,
)
from ._model import add_model_options, cache_file, fetch_named_model, kernel_path_arg

__all__ = ["add_parser"]


def _check_model(args: argparse.Namespace, scheme: str, loader: str) -> None:
    """Read and check every file of ``--model`` (or the bundled model) as a worker's load will, in the ``serve``
    master before any worker is forked: a bad checkpoint is one line here, not a boot failure in each worker.
    Builds the tokenizer and a ``meta`` skeleton, and throws both away; no weight is read.

    Raises:
        As :func:`packcache.models.minilm.load_tokenizer` and :func:`~packcache.models.minilm.pack_count` (the
        ``minilm`` loader), :func:`packcache.hf.pack_count` and :func:`packcache.hf.tokenizer` (``hf``).
    """
    if loader == "causal":
        hf_causal: Any = importlib.import_module("packcache.hf")
        from ..bundle import is_cache_file as is_model_file

        if not is_model_file(args.model):
            hf_causal.pack_count(args.model, scheme, auto_class="AutoModelForCausalLM",
                                 group_size=chosen_group_size(args) or GROUP_SIZE)  # fmt: skip
        hf_causal.tokenizer(args.model)
        return
    if loader == "minilm":
        minilm: Any = importlib.import_module("packcache.models.minilm")
        minilm.load_tokenizer(args.model)
        minilm.pack_count(scheme, model_path=args.model, group_size=chosen_group_size(args) or GROUP_SIZE)
        return
    hf: Any = importlib.import_module("packcache.hf")
    from ..bundle import is_cache_file
    from ..server.modelfiles import transformer_folder_of

    if is_cache_file(args.model):
        # a plain checkpoint's file serves mean pooling as its directory does; choose_loader refused one that cannot
        hf.tokenizer(args.model)
        return
    folder = transformer_folder_of(args.model)
    # pinned by tests/test_server_models.py::test_a_bad_checkpoint_is_refused_by_the_master_in_one_line
    hf.pack_count(args.model, scheme, sentence_transformers=folder, group_size=chosen_group_size(args) or GROUP_SIZE)
    hf.tokenizer(os.path.join(args.model, folder))


def _check_model_file(model: str | None) -> None:
    """``serve --verify`` of a cache file that holds its model: every pack's checksum, read once here in the master
    before any worker is forked. A damaged pack cannot be packed again (there is no checkpoint), so it stops the
    server with one line naming the entry, rather than every worker failing to boot on it. The workers still load
    with the check on (the file's pages are in the page cache by then); a checkpoint's cache is theirs to heal.

    Raises:
        FormatError: the file fails verification (the first problems named).
    """
    from ..bundle import is_cache_file

    if model is None or not is_cache_file(model):
        return
    from ..maintenance import verify

    # pinned by tests/test_cli_run.py::test_serve_verify_refuses_a_damaged_file_before_forking_a_worker
    report = verify(model)
    if not report.ok:
        named = "; ".join(str(p) for p in report.problems[:3])
        more = f" (and {len(report.problems) - 3} more)" if len(report.problems) > 3 else ""
        raise FormatError(
            f"--verify: {named}{more}: the file is damaged, and with no checkpoint nothing can pack it again; fetch or "
            "build the file again",
            path=model,
        )


def _tokens(text: str) -> int:
    """``--max-batch-tokens``: a non-negative integer."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of tokens (0 turns batching off), got {text[:40]!r}")
    return int(text)


def _wait(text: str) -> float:
    """``--batch-wait``: seconds in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 1, got {text[:40]!r}")
    return value


def cmd_serve(args: argparse.Namespace, out: Out) -> int:
    kernel_path = kernel_path_arg(args)  # in the master, at startup: not once per worker that fails to boot
    # Checked by name, without importing: prometheus_client must not be imported before serve() sets
    # PROMETHEUS_MULTIPROC_DIR, and the model's modules load in serve() too.
    needed = [("gunicorn", "serve"), ("prometheus_client", "serve"), ("pydantic", "serve"), ("torch", "models"),
              ("tokenizers", "models")]  # fmt: skip
    if args.engine == "sentence-transformers":
        needed.append(("sentence_transformers", "hf"))
    for module, extra in needed:
        if importlib.util.find_spec(module) is None:
            print(f"packcache serve needs the {extra} extra ({module} is missing): "
                  f"pip install 'packcache[{extra}]' (bash scripts/setup.sh installs it)", file=sys.stderr)  # fmt: skip
            return EXIT_FAILED
    from ..server import Batching, EngineSpec, Limits, ServeOptions, serve, worker_threads
    from ..server.completions import Generation
    from ..server.master import check_address
    from ..server.modelfiles import choose_loader, model_id_of

    try:
        check_address(args.host, args.port)  # first: a busy port fails at once, before any model is read
    except ValueError as exc:
        print(f"packcache serve: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    scheme, path, loader = "fp32", None, _defaults.SERVE_LOADER
    # the name as given, before a fetch replaces it; read as every command reads it (a published name with --remote)
    model_id = args.served_model_name or model_id_of(args.model, remote=args.remote is not None)
    try:
        if args.engine == "packcache":
            # in the master, once: the workers map the file it fetched
            fetched = fetch_named_model(args, "packcache serve")
            if fetched:
                print(fetched, file=sys.stderr)
            loader = choose_loader(args.model)  # one rule: a causal LM, the MiniLM fast path, or packcache.hf
            if loader == "causal" and importlib.util.find_spec("transformers") is None:
                raise ModuleNotFoundError(
                    f"{args.model} is a causal LM: serving it needs the hf extra (transformers is missing): "
                    "pip install 'packcache[hf]'"
                )
            if loader == "hf" and importlib.util.find_spec("sentence_transformers") is None:
                raise ModuleNotFoundError(
                    f"{args.model} is not a MiniLM-shaped BERT: serving it needs the hf extra (sentence_transformers "
                    "is missing): pip install 'packcache[hf]'"
                )
            scheme = chosen_scheme(args)
            # Named here, in the master, by content: the workers open one file (and find the digest it took).
            path = cache_file(args, scheme, loader)
            _check_model(args, scheme, loader)
            if args.verify:
                _check_model_file(args.model)
        elif args.model is not None and args.model.endswith(".pcache"):
            raise ValueError(
                f"{args.model} is a cache file of packed weights: --engine sentence-transformers loads a checkpoint "
                "directory (the unpacked float32 baseline)"
            )
    except (ValueError, ModuleNotFoundError, FormatError, OSError, RemoteError) as exc:
        print(f"packcache serve: cannot load the model: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    engine = EngineSpec(
        engine=args.engine, scheme=scheme, cache=path, model=args.model, kernel_path=kernel_path, loader=loader,
        model_id=model_id, group_size=chosen_group_size(args),
        torch_threads=args.torch_threads or worker_threads(args.workers), prefault=args.prefault,
        cache_dir=os.path.dirname(path) if path is not None else None,
        remote=args.remote if path is not None else None,  # parsed once: the worker's cache takes the value
        remote_timeout=args.remote_timeout,
        trusted_keys=tuple(args.trusted_key), allow_unsigned=args.allow_unsigned,
        max_seqs=args.max_seqs, max_model_len=args.max_model_len, verify=args.verify,
    )  # fmt: skip
    limits = Limits(
        max_texts=args.max_texts, max_text_chars=args.max_text_chars, max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout, send_timeout=args.send_timeout,
        auto_truncate=args.auto_truncate,
    )  # fmt: skip
    batching = Batching(max_batch_tokens=args.max_batch_tokens, batch_wait=args.batch_wait)
    options = ServeOptions(
        engine=engine, workers=args.workers, host=args.host, port=args.port, timeout=args.timeout,
        limits=limits, batching=batching, metrics_dir=args.metrics_dir, log_level=args.log_level,
        generation=Generation(max_tokens=args.max_tokens), graceful_timeout=args.graceful_timeout,
    )  # fmt: skip
    try:
        code = serve(options)
    except (ValueError, RuntimeError) as exc:
        print(f"packcache serve: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    if code != EXIT_OK:
        print("packcache serve: the server stopped with an error (a worker could not load the model, or the "
              "address could not be bound; see the log above)", file=sys.stderr)  # fmt: skip
    from ..server.master import exit_now

    exit_now(code)  # the master is done: its teardown (torch's modules) took 0.5 s of a stop


def add_parser(sub: Any) -> None:
    """``serve``."""
    serve = sub.add_parser(
        "serve",
        help="an embedding service of several gunicorn workers on one shared cache file, with Prometheus metrics",
        description="POST /v1/embeddings (OpenAI's API), POST /embed (TEI's {\"inputs\": ...}, or "
        '{"texts": [...]} -> {"embeddings": [[...], ...]}), GET /v1/models, GET /info; GET /metrics (every '
        "worker's cache state, heap bytes per reason, mapped bytes and errno, request counts and latency, by pid); "
        "GET /healthz. Concurrent requests in a worker share one forward of the model (--max-batch-tokens). "
        "Each worker loads the model (all-MiniLM-L6-v2 by default; --model: any sentence-transformers model) through "
        "the cache file after the fork: on an empty cache one builds and the others map, and each logs one line "
        "when ready (state, load seconds, where the weights came from). A cache problem never stops a worker: it "
        "shows in /metrics. SIGTERM stops gracefully, SIGHUP replaces the workers (rolling restart). Needs the serve "
        "extra (and the hf extra for models other than MiniLM-shaped BERTs). See docs/DEPLOY.md.",
    )
    from .._cpus import usable_cpus

    cpus = usable_cpus()
    serve.add_argument("--workers", type=positive, default=cpus, help=f"worker processes (default: the CPUs, {cpus})")
    serve.add_argument("--host", default=_defaults.SERVE_HOST, help="address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=_defaults.SERVE_PORT, help="port (default 8000; 0 picks a free one, printed)"
    )
    add_model_options(serve, no_cache="caching off: every worker packs to its own heap")
    for action in serve._actions:
        if action.dest == "model":
            action.help = (
                "the model (default: the bundled all-MiniLM-L6-v2): a sentence-transformers save or a plain "
                "transformers checkpoint directory (BERT, XLM-R, MPNet, ...: its pooling, normalisation and "
                "prompts as its config says; a BERT of MiniLM's shape takes the MiniLM fast path), a cache file "
                "(*.pcache) that holds one (the file alone is the model), or with --remote a published name"
            )
    serve.add_argument(
        "--engine", choices=("packcache", "sentence-transformers"), default=_defaults.SERVE_ENGINE,
        help="packcache (default), or sentence-transformers' float32 model with no cache: the baseline of "
        "benchmarks/serve.py (--scheme and the cache options do not apply to it)",
    )  # fmt: skip
    serve.add_argument(
        "--served-model-name", metavar="NAME",
        help="the model's name in GET /v1/models and in every response's \"model\" (default: the directory's or "
        "cache file's base name, the published name, or all-MiniLM-L6-v2)",
    )  # fmt: skip
    serve.add_argument(
        "--torch-threads", type=positive,
        help="torch threads per worker (default: the CPUs divided among the workers, at least 1)",
    )  # fmt: skip
    serve.add_argument(
        "--prefault", action="store_true",
        help="after loading, touch every page of the weights, so the first requests do not fault them in",
    )  # fmt: skip
    serve.add_argument(
        "--timeout", type=float, default=_defaults.SERVE_TIMEOUT,
        help="seconds a worker may spend on one request or on loading before it is replaced (default 60; keep it "
        "above the cache's 30 s lock timeout)",
    )  # fmt: skip
    serve.add_argument(
        "--max-texts", type=positive, default=_defaults.MAX_TEXTS, help="texts per request (default 256)"
    )
    serve.add_argument(
        "--max-text-chars", type=positive, default=_defaults.MAX_TEXT_CHARS, help="characters per text (default 10000)"
    )
    serve.add_argument(
        "--max-body-bytes", type=positive, default=_defaults.MAX_BODY_BYTES,
        help="request body bytes (default 4 MiB); a worker keeps at most 16 times this of bodies in memory, "
        "counted as their bytes arrive, then refuses the biggest body still arriving (503, Retry-After: 1)",
    )  # fmt: skip
    serve.add_argument(
        "--body-timeout", type=seconds, default=_defaults.BODY_TIMEOUT,
        help="seconds a client gets to send a request's whole body, from the end of its headers; then 408 "
        "(default 10). A slow client holds a buffer, never a worker",
    )  # fmt: skip
    serve.add_argument(
        "--header-timeout", type=seconds, default=_defaults.HEADER_TIMEOUT,
        help="seconds a client gets to send the request line and headers, from connecting (or from its "
        "previous response: the idle time of a kept-alive connection); then 408 (default 10)",
    )  # fmt: skip
    serve.add_argument(
        "--send-timeout", type=seconds, default=_defaults.SEND_TIMEOUT,
        help="seconds a client gets to take a whole response; then the connection is closed (default 10)",
    )  # fmt: skip
    from ..server.app import Batching

    serve.add_argument(
        "--max-batch-tokens", type=_tokens, default=Batching.max_batch_tokens,
        help="tokens per forward: concurrent requests in a worker are merged into one forward up to this many "
        f"tokens (TEI's option and default, {Batching.max_batch_tokens}); 0 turns batching off (one forward per "
        "request)",
    )  # fmt: skip
    serve.add_argument(
        "--batch-wait", type=_wait, default=Batching.batch_wait,
        help="seconds a forward with room left may wait for more requests, only while another connection of the "
        f"worker is sending one (default {Batching.batch_wait:g}; a lone client never waits; 0: never)",
    )  # fmt: skip
    serve.add_argument(
        "--auto-truncate", action="store_true",
        help="truncate texts longer than the model reads on /v1/embeddings and TEI's /embed instead of refusing "
        'them (TEI\'s option; a TEI request\'s "truncate" still wins; {"texts": [...]} always truncates)',
    )  # fmt: skip
    from .._defaults import LLM_MAX_SEQS as MAX_SEQS
    from ..server.completions import Generation

    serve.add_argument(
        "--max-seqs", type=positive, default=MAX_SEQS,
        help=f"causal LMs: sequences a worker generates at once (continuous batching; default {MAX_SEQS}); the KV "
        "cache is sized for this many sequences of --max-model-len tokens",
    )  # fmt: skip
    serve.add_argument(
        "--max-model-len", type=positive, default=None,
        help="causal LMs: prompt plus completion tokens of one sequence (default: the model's context, at most "
        "4096); a longer request is refused (400 context_length_exceeded)",
    )  # fmt: skip
    serve.add_argument(
        "--max-tokens", type=positive, default=Generation.max_tokens,
        help="causal LMs: the most tokens one request may generate, and a chat request's default "
        f"(default {Generation.max_tokens})",
    )  # fmt: skip
    serve.add_argument(
        "--graceful-timeout", type=seconds, default=_defaults.GRACEFUL_TIMEOUT,
        help="seconds the workers get after SIGTERM (or SIGHUP's rolling restart) to finish their requests and "
        "generations (default 30); a generation still running 2 s before the end is ended with an error event",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-dir",
        help="prometheus_client's multiprocess directory (default: $PROMETHEUS_MULTIPROC_DIR, else a private "
        "temporary one); its *.db files are removed at start; it must be yours and writable by no other user",
    )
    serve.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error", "critical"), default=_defaults.SERVE_LOG_LEVEL,
        help="gunicorn's log level (default info)",
    )  # fmt: skip
    serve.set_defaults(func=cmd_serve)
