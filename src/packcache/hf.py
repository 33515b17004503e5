"""Hugging Face models whose weights come packed from the cache: change one line, keep the model.

:func:`from_pretrained` returns exactly the ``transformers`` class that
``AutoModel*.from_pretrained`` returns for a local checkpoint, with every eligible
linear layer (``nn.Linear``, and GPT-2's ``Conv1D``, whose weight is stored transposed)
replaced by a :class:`~packcache.torch.PackedLinear`, every ``nn.Embedding`` by a
:class:`~packcache.torch.PackedEmbedding` in the scheme's form (bf16; int8 rows with per-row scales for int8 and
int4; float32 for fp32), and every other parameter a zero-copy float32 tensor over the cache's mapping.
:func:`sentence_transformer` returns a real ``sentence_transformers.SentenceTransformer`` whose Transformer
module holds such a model.

The model is built on the ``meta`` device the way ``transformers`` builds it before
loading (its own init contexts; non-persistent buffers such as rotary frequencies or
position ids recomputed by the model's own ``_init_weights``), so no weight is
materialised. The checkpoint is read for its config and safetensors headers only;
tensor bytes are read only to pack a miss, which a warm launch never has. Weights are tied
exactly as transformers' ``from_pretrained`` ties them for that checkpoint (:func:`_tie`): what the
config ties, unless the checkpoint holds both tensors of a pair with different values. A head tied
to the input embeddings comes from the tie's one source tensor: the head and the embedding read one pack of
it (one stored tensor: bf16, or int8 rows for int8 and int4); with fp32 both are the one float32 tensor.

Saving such a model (``save_pretrained``, ``SentenceTransformer.save``, ``state_dict``) writes a
complete float32 checkpoint that plain transformers and sentence-transformers load: each packed
layer's weight as the layer computes it (:meth:`~packcache.torch.PackedLinear.float_weight`), under
the source's names and layouts. ``load_state_dict`` into it raises ``RuntimeError`` (its tensors
are read-only). See ``docs/HF.md``, "Saving a packed model".

This module imports ``transformers`` (and, for :func:`sentence_transformer`,
``sentence_transformers``); ``import packcache`` and ``import packcache.torch`` do not.
Nothing is fetched from a model hub: ``path`` is a local directory as ``save_pretrained``
writes it, or a hub id the local hub cache already holds (:mod:`packcache.hub`). Without
``cache=`` a load uses the content-named file in the default cache directory, as the CLI does;
``cache=False`` turns caching off. See ``docs/HF.md``.

Example (run by ``tests/test_hf.py``, not as a doctest: it needs a checkpoint)::

    from packcache import hf
    model = hf.from_pretrained("ckpt/", scheme="int8", cache="/var/cache/app/m.pcache",
                               auto_class="AutoModelForCausalLM")
    model.packcache.stats().state      # 'stored' on the first launch, 'mapped' afterwards
"""

from __future__ import annotations

import os
import reprlib
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import _boundedjson as boundedjson
from ._defaults import FETCH_DEADLINE, GROUP_SIZE, REMOTE_TIMEOUT
from ._paths import default_cache_dir
from ._progress import bar as progress_bar
from .bundle import (
    ST_TRANSFORMER_REFS,
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
from .cache import PackKey, Request, WeightCache
from .errors import FormatError
from .hub import resolve_model
from .identity import model_cache_name
from .loader import Recipe, open_cache, open_model_file, resolve
from .packers import SCHEMES, to_float32
from .safetensors import SafetensorsFile, TensorMeta
from .torch import ConversionReport, convert, count_packs, parameter_groups

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = [
    "SCHEMES",
    "TRANSPOSED_LINEARS",
    "Checkpoint",
    "default_cache_path",
    "from_pretrained",
    "load_report",
    "pack_count",
    "platform",
    "sentence_transformer",
    "tokenizer",
]

#: Module classes computing ``x @ weight + bias`` with ``weight`` stored ``[in, out]``: packed transposed.
TRANSPOSED_LINEARS: tuple[type[nn.Module], ...] = (Conv1D,)

#: Serialises :func:`_skeleton` (see there).
_SKELETON_LOCK = threading.Lock()

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # a 1 T-parameter model's index is a few MiB; a config, a few KiB
#: Config fields that count modules the model builds (layers, experts): each must be at most the number of
#: tensors in the checkpoint (every layer or expert has one at least), checked before the skeleton is built.
COUNT_FIELDS = (
    "num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers", "num_encoder_layers",
    "num_decoder_layers", "num_experts", "num_local_experts", "n_routed_experts",
)  # fmt: skip
#: Non-persistent buffers (position ids, rotary tables, masks) the skeleton may materialise, at least: a
#: config's sizes may ask for more only when the checkpoint's own tensors are that large.
MIN_BUFFER_CAP = 256 << 20


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _short(value: object) -> str:
    """A bounded repr of a value from a checkpoint file (a 60 MB name must not become a 60 MB message)."""
    return _REPR.repr(value)


def _clip(exc: BaseException, limit: int = 300) -> str:
    """An error from a library, as one line of at most ``limit`` characters (its text may quote the hostile value)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def platform(scheme: str | None = None, group_size: int = GROUP_SIZE) -> dict[str, Any]:
    """The ``platform=`` mapping of a cache of ``scheme`` (``None``/``"auto"``: this machine's default):
    its packers' identities and fingerprints, the torch version and the CPU capability.
    :func:`from_pretrained` opens cache paths with it (:meth:`packcache.loader.Recipe.platform`)."""
    return resolve(scheme, group_size).platform()


class Checkpoint:
    """A local checkpoint directory as ``save_pretrained`` writes it: headers read now, tensors on demand.

    It holds ``config.json`` and either ``model.safetensors`` or ``model.safetensors.index.json``
    with the shards it names (plain file names in the same directory). It is a
    :class:`~packcache.torch.TensorSource` over the checkpoint's own tensor names.

    Raises:
        FileNotFoundError: no such directory, no ``config.json``, or no safetensors weights
            (the message names what is missing; pickle checkpoints are never loaded).
        FormatError: a malformed index or safetensors header (naming the file and offset),
            a shard named with a path, or a tensor found in two shards.
        UntrustedFileError, OSError: a file cannot be opened as a regular file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {os.fspath(path)!r} does not exist or is not a directory")
        self.directory = directory
        self.config_path = directory / "config.json"
        if not os.path.lexists(self.config_path):
            raise FileNotFoundError(f"{self.config_path}: no config.json, so this is not a save_pretrained checkpoint")
        self.files = [SafetensorsFile(directory / name) for name in self._shard_names()]
        self._where: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file:
                if name in self._where:
                    raise FormatError(
                        f"tensor {_short(name)} is in two shards ({os.path.basename(self._where[name].path)} too)",
                        path=file.path, offset=8,
                    )  # fmt: skip
                self._where[name] = file

    def config(self) -> Any:
        """The model's ``transformers`` config, from ``config.json`` read as :func:`_read_json` reads
        (what ``AutoConfig.from_pretrained`` builds for a local directory; remote code is never run).

        Raises:
            FormatError: not a JSON object, or no known ``model_type``. UntrustedFileError, OSError: as the reader.
        """
        return _config_from(_read_json(self.config_path, "config"), str(self.config_path), os.fspath(self.directory))

    def generation_settings(self) -> Any:
        """``generation_config.json`` read as :func:`_read_json` reads, or ``None`` when there is none."""
        generation = self.directory / "generation_config.json"
        return _read_json(generation, "generation config") if os.path.lexists(generation) else None

    def source_bytes(self) -> int:
        """The size of every weights file: what the model's own buffers may take at most (:data:`MIN_BUFFER_CAP`)."""
        return sum(file.size for file in self.files)

    def _shard_names(self) -> list[str]:
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        if index.exists():
            return _read_index(index)
        if single.exists():
            return [SINGLE_FILE]
        found = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(found)}: pickle checkpoints are not loaded; save with safetensors)" if found else ""
        raise FileNotFoundError(f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def meta(self, name: str) -> TensorMeta:
        """Shape, dtype and file identity of one tensor; reads nothing.

        Raises:
            KeyError: no tensor of that name (the message names the directory).
        """
        return self._file(name).meta(name)

    def read(self, name: str) -> np.ndarray[Any, Any]:
        """One tensor's bytes, read now (see :meth:`packcache.safetensors.SafetensorsFile.read`)."""
        return self._file(name).read(name)

    def _file(self, name: str) -> SafetensorsFile:
        file = self._where.get(name)
        if file is None:
            raise KeyError(f"{self.directory}: no tensor named {_short(name)} in the checkpoint")
        return file


def _read_json(path: Path, what: str) -> Any:
    """A small JSON file of the checkpoint, read as every checkpoint file is (:func:`packcache._boundedjson.load_file`:
    no blocking on a FIFO, no symlink swapped in after the check, a regular file of at most :data:`MAX_JSON_BYTES`,
    bounded JSON, no number past a float).

    Raises:
        FormatError: too large, or not bounded JSON (naming the file and offset).
        UntrustedFileError: not a regular file. OSError: it cannot be read.
    """
    return boundedjson.load_file(os.fspath(path), what=what, max_bytes=MAX_JSON_BYTES)


def _read_index(index: Path) -> list[str]:
    """The shard file names of a ``model.safetensors.index.json``, each checked to be a plain name."""
    data = _read_json(index, "index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError('the index has no "weight_map" object of tensor name -> shard file', path=str(index))
    shards: list[str] = []
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard or "\0" in shard:
            where = f"tensor {_short(tensor)} names the shard {_short(shard)}"
            raise FormatError(f"{where}: not a file name in this directory", path=str(index))
        if shard not in shards:
            shards.append(shard)
    return shards


def _config_from(settings: Any, where: str, name_or_path: str) -> Any:
    """A ``transformers`` config from the mapping ``config.json`` holds: the class its ``model_type`` names, never
    remote code.

    Raises:
        FormatError: not a JSON object, no known ``model_type``, or fields transformers refuses (naming ``where``).
    """
    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise FormatError(
            f"model_type {_short(model_type)} is not one transformers {transformers.__version__} knows", path=where
        )  # fmt: skip
    try:
        config = CONFIG_MAPPING[model_type].from_dict(settings)
    except Exception as exc:  # transformers checks fields its own ways (TypeError, ValueError, ...)
        raise FormatError(
            f"transformers {transformers.__version__} cannot read it as a {model_type} config: {_clip(exc)}",
            path=where,
        ) from exc
    config._name_or_path = name_or_path
    return config


class _Bundled(RecordSource):
    """A cache file seen as the checkpoint it was built from (:class:`Checkpoint`'s interface): tensor names,
    shapes, dtypes and content identities from its model record, config and generation config from its embedded
    files. It holds no tensor bytes: every pack must be in the file already (:meth:`read` raises)."""

    def __init__(self, bundle: Bundle, folder: str = "") -> None:
        super().__init__(bundle)
        self.directory = Path(bundle.path)
        self.prefix = f"{folder}/" if folder else ""
        self.config_path = Path(f"{bundle.path}::{self.prefix}config.json")

    def config(self) -> Any:
        """The config embedded in the file (see :meth:`Checkpoint.config`)."""
        settings = self.bundle.read_json(f"{self.prefix}config.json")
        return _config_from(settings, str(self.config_path), self.bundle.path)

    def generation_settings(self) -> Any:
        """The embedded ``generation_config.json``, or ``None``."""
        name = f"{self.prefix}generation_config.json"
        return self.bundle.read_json(name) if self.bundle.has_file(name) else None

    def source_bytes(self) -> int:
        return sum(int(source.rpartition(":")[2]) for source in self.record.sources)


#: Where a load's tensors and config come from: a checkpoint directory, or a cache file that holds the model.
_Source = Checkpoint | _Bundled


class _Renamed:
    """A checkpoint seen under the model's parameter names (a base model's checkpoint in a head
    model, or the reverse: ``transformers`` adds or strips ``base_model_prefix`` the same way)."""

    def __init__(self, checkpoint: _Source, add: str, strip: str) -> None:
        self.checkpoint, self.add, self.strip = checkpoint, add, strip

    def name(self, model_name: str) -> str:
        if self.strip and model_name.startswith(self.strip):
            model_name = model_name[len(self.strip) :]
        return self.add + model_name

    def meta(self, name: str) -> TensorMeta:
        return self.checkpoint.meta(self.name(name))

    def read(self, name: str) -> np.ndarray[Any, Any]:
        return self.checkpoint.read(self.name(name))


def _renaming(model: nn.Module, groups: list[list[str]], checkpoint: _Source) -> _Renamed:
    """The prefix mapping under which the checkpoint holds the most of the model's parameters (``groups``)."""
    names = [name for group in groups for name in group]
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [_Renamed(checkpoint, "", "")]
    if prefix:
        candidates += [_Renamed(checkpoint, f"{prefix}.", ""), _Renamed(checkpoint, "", f"{prefix}.")]
    return max(candidates, key=lambda c: sum(c.name(n) in checkpoint for n in names))


def _model_class(auto_class: str | type, config: Any) -> type[Any]:
    auto = getattr(transformers, auto_class, None) if isinstance(auto_class, str) else auto_class
    mapping = getattr(auto, "_model_mapping", None)
    if not isinstance(auto, type) or mapping is None:
        raise ValueError(f"auto_class {auto_class!r} is not a transformers AutoModel* class")
    from transformers.models.auto.auto_factory import _get_model_class

    if type(config) not in mapping:
        raise ValueError(f"{auto.__name__} has no model class for a {type(config).__name__} checkpoint")
    model_class: type[Any] = _get_model_class(config, mapping)  # type: ignore[no-untyped-call]
    return model_class


def _checked_skeleton(checkpoint: _Source, model_class: type[Any], config: Any) -> Any:
    """:func:`_skeleton`, bounded by the checkpoint and with one kind of error: no field of :data:`COUNT_FIELDS`
    (in the config or a sub-config) counts more modules than the checkpoint has tensors, the non-persistent
    buffers take at most the checkpoint's size (or :data:`MIN_BUFFER_CAP`), and whatever transformers raises
    building the model from the config (``ZeroDivisionError`` for zero heads, ``OverflowError`` for a size
    past int64, ...) becomes a :class:`~packcache.errors.FormatError` naming ``config.json``.

    Raises:
        FormatError: as above.
    """
    where = str(checkpoint.config_path)
    tensors = len(checkpoint.names())
    for field, value in _counts(config):
        # pinned by tests/test_hf.py::test_hostile_config_values_end_in_one_line_naming_config_json
        if not 0 <= value <= tensors:
            raise FormatError(
                f"{field} is {value}, but the checkpoint holds {tensors} tensors: not that many modules", path=where
            )
    cap = max(MIN_BUFFER_CAP, checkpoint.source_bytes())
    try:
        return _skeleton(model_class, config, max_buffer_bytes=cap)
    except Exception as exc:
        raise FormatError(
            f"transformers cannot build {model_class.__name__} from it: {_clip(exc)}", path=where
        ) from exc


def _counts(config: Any, depth: int = 0) -> Iterator[tuple[str, int]]:
    """``(field, value)`` of every integer :data:`COUNT_FIELDS` field of ``config`` and of its sub-configs
    (a multimodal model's text and vision configs), with the sub-config's name in front."""
    for field in COUNT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            yield field, value
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, transformers.PretrainedConfig) and depth < 8:
            yield from ((f"{name}.{field}", value) for field, value in _counts(sub, depth + 1))


def _skeleton(model_class: type[Any], config: Any, *, max_buffer_bytes: int) -> Any:
    """The model without its weights: built on ``meta`` under transformers' own init contexts, float32,
    non-persistent buffers recomputed by the model's ``_init_weights`` (as ``from_pretrained`` does), not tied
    yet: which of its ties hold depends on the checkpoint (:func:`_tie`).

    Raises:
        ValueError: the non-persistent buffers would take more than ``max_buffer_bytes``.
    """
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils.generic import ContextManagers

    config.dtype = torch.float32
    # no_init_weights: the meta tensors need no initialisation (torch's own reset_parameters is most of the time
    # a meta build takes); buffers are set below. These contexts swap process-wide functions (torch.nn.init's,
    # PreTrainedModel.tie_weights) and put back what they saw on entry: two threads interleaving them could leave
    # the no-op versions installed for good, so skeletons are built one at a time.
    with (
        _SKELETON_LOCK,
        ContextManagers([*model_class.get_init_context(torch.float32, False, False, None), no_init_weights()]),
    ):
        model = model_class(config)
    buffers = list(model.named_non_persistent_buffers())
    total = sum(buffer.numel() * buffer.element_size() for _, buffer in buffers)
    if total > max_buffer_bytes:  # sized by the config alone: checked before any of it is allocated
        largest = max(buffers, key=lambda item: item[1].numel() * item[1].element_size())[0]
        raise ValueError(
            f"its non-persistent buffers would take {total} bytes (the largest: {largest}), past {max_buffer_bytes}"
        )
    owners: dict[str, nn.Module] = {}
    for name, buffer in buffers:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._buffers[attr] = torch.empty_like(buffer, device="cpu")
        owners[owner_name] = owner
    for owner_name, owner in owners.items():
        # The innermost PreTrainedModel holding the module initialises it (composite models nest them).
        parts = owner_name.split(".") if owner_name else []
        initialiser = model
        for depth in range(len(parts), 0, -1):
            candidate = model.get_submodule(".".join(parts[:depth]))
            if isinstance(candidate, PreTrainedModel):
                initialiser = candidate
                break
        initialiser._init_weights(owner)
    return model


#: Names and version of the cache entry that records whether two tensors of a checkpoint are equal (:func:`_tie`).
TIE_CHECK = "packcache.hf.tie-check"
TIE_CHECK_VERSION = 1


def _tie(model: Any, source: _Renamed, equal: Callable[[str, str], bool]) -> int:
    """Tie the skeleton's parameters as transformers 5.23's ``from_pretrained`` ties them for this checkpoint
    (``PreTrainedModel.tie_weights(missing_keys=...)`` over ``model.all_tied_weights_keys``, which the config
    fills: ``tie_word_embeddings``), pair by pair in its order:

    - the checkpoint holds both tensors: tied if their values are equal (``equal``, given the names of the
      tensors the two parameters hold), else kept apart and the pair dropped from ``all_tied_weights_keys``
      (a config that says tied over a checkpoint with its own head: the head is the checkpoint's);
    - only the target (the head): the source (the embeddings) is tied to it;
    - only the source, or neither (a later pair with the same source may hold it): the target is tied to the source.

    A pair the config does not tie is never tied, however equal the tensors. Returns how many times ``equal``
    was asked.
    """
    # pinned by tests/test_hf_ties.py::test_every_config_and_checkpoint_combination_builds_transformers_model
    tied_keys = list(getattr(model, "all_tied_weights_keys", {}).items())  # set by post_init
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    missing = {name for name in names if source.name(name) not in source.checkpoint}
    holds = {name: name for name in names if name not in missing}  # parameter -> the tensor it holds now
    asked = 0
    for i, (target, origin) in enumerate(tied_keys):
        keep_missing = False
        origin_there, target_there = origin not in missing, target not in missing
        if origin_there and target_there:
            if holds.get(origin) != holds.get(target):
                asked += 1
                if not equal(holds[origin], holds[target]):
                    model.all_tied_weights_keys.pop(target)
                    continue
        elif target_there:
            target, origin = origin, target
        elif not origin_there:
            for later_target, later_origin in tied_keys[i + 1 :]:
                if later_origin == origin and later_target not in missing:
                    origin = later_target
                    break
            else:
                keep_missing = True  # transformers warns and leaves it random; packcache's missing check refuses it
        param = model.get_parameter_or_buffer(origin)
        owner_name, _, attr = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(owner, attr, param)
        model._adjust_bias(owner, param)
        if origin in holds:
            holds[target] = holds[origin]
        if not keep_missing:
            missing.discard(target)
    return asked


def _same_values(source: _Renamed, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of the checkpoint (model names) load as the same float32 values:
    transformers' test (``torch.equal`` of the loaded parameters; the model is float32)."""
    meta_a, meta_b = source.meta(a), source.meta(b)
    if tuple(meta_a.shape) != tuple(meta_b.shape):
        return False
    return bool(np.array_equal(to_float32(source.read(a), meta_a.dtype), to_float32(source.read(b), meta_b.dtype)))


def _tie_check(source: _Renamed, a: str, b: str) -> Request:
    """The cache request whose entry records :func:`_same_values` of ``a`` and ``b`` (``uint8`` 1 or 0): a warm
    launch ties from it without reading either tensor. Its key names both tensors (name, shape, dtype, file
    identity), so a changed checkpoint is compared again."""
    metas = [source.meta(a), source.meta(b)]
    tensors = [{"name": m.name, "shape": list(m.shape), "dtype": m.dtype, "identity": m.identity} for m in metas]
    key = PackKey({"packer": TIE_CHECK, "version": TIE_CHECK_VERSION, "tensors": tensors})
    name = f"{metas[0].name}={metas[1].name}:{TIE_CHECK}:equal"
    return name, lambda: np.array([_same_values(source, a, b)], dtype=np.uint8), key


@dataclass
class _Loaded:
    model: Any
    cache: WeightCache
    owns_cache: bool
    report: ConversionReport


def _auto_name(auto_class: str | type) -> str:
    return auto_class if isinstance(auto_class, str) else auto_class.__name__


def _load(
    directory: str | os.PathLike[str],
    scheme: str | None,
    cache: WeightCache | str | os.PathLike[str] | bool | None,
    *,
    auto_class: str | type,
    config: Any,
    group_size: int | None,
    kernel_path: str | None,
    bundle: Bundle | None = None,
    folder: str = "",
    embed: tuple[str | os.PathLike[str], str | None] | None = None,
) -> _Loaded:
    """Load a model from a checkpoint directory, or (``bundle``) from the cache file that holds it. ``embed``:
    ``(root, sentence-transformers folder)`` of the files to store in the cache with the model record
    (:func:`_model_requests`), in the session that packs the model."""
    checkpoint: _Source
    if bundle is not None:
        if bundle.record.loader != "hf":
            raise ValueError(
                f"{bundle.path} holds {bundle.record.scheme} packs calibrated by packcache.models.minilm: "
                "load it with minilm.load(model_path=...), or build a file for this loader (packcache build)"
            )
        recipe, weight_cache = open_model_file(bundle, cache, scheme, group_size)
        owns_cache = True
        checkpoint = _Bundled(bundle, folder)
    else:
        recipe = resolve(scheme, GROUP_SIZE if group_size is None else group_size)
        checkpoint = Checkpoint(directory)
    linear_packer = recipe.linear
    try:
        path = linear_packer.kernel_path(kernel_path)
        if config is None:
            config = checkpoint.config()
        model_class = _model_class(auto_class, config)
    except BaseException:
        if bundle is not None:
            weight_cache.close()
        raise
    if bundle is None:
        assert isinstance(checkpoint, Checkpoint)
        local = checkpoint
        weight_cache, owns_cache = open_cache(
            cache, recipe.platform(),
            suggested_name=lambda: _cache_name(local, str(config.model_type), recipe, auto_class),
            remedy=recipe.remedy("packcache.hf"),
        )  # fmt: skip
    try:
        model = _checked_skeleton(checkpoint, model_class, config)
        source = _renaming(model, parameter_groups(model), checkpoint)
        with (
            weight_cache.session() as session,  # one session, one generation: a fresh file has nothing superseded
            progress_bar(lambda: _count(recipe, auto_class, bundle, embed), f"packing {recipe.scheme}") as tick,
        ):
            session.progress = tick

            def equal(a: str, b: str) -> bool:
                return bool(session.get_many([_tie_check(source, a, b)])[0][0])

            _tie(model, source, equal)
            _refuse_missing(checkpoint.directory, model_class, parameter_groups(model), source)
            report = convert(
                model, weight_cache, linear_packer, source=source, other=recipe.other, embedding=recipe.embedding,
                kernel_path=path, transposed=TRANSPOSED_LINEARS, session=session,
            )  # fmt: skip
            left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
            if left:
                raise ValueError(
                    f"{model_class.__name__}: packcache cannot serve {', '.join(left)} (persistent buffers)"
                )
            if embed is not None and isinstance(checkpoint, Checkpoint) and weight_cache.path is not None:
                session.get_many(_model_requests(checkpoint, recipe, model, _auto_name(auto_class), *embed))
        settings = checkpoint.generation_settings() if model.can_generate() else None
        if settings is not None:
            where = f"{checkpoint.directory}/generation_config.json"
            if not isinstance(settings, dict):
                raise FormatError("the generation config is not a JSON object", path=where)
            try:
                model.generation_config = transformers.GenerationConfig.from_dict(settings)
            except Exception as exc:  # transformers validates generation settings with ValueError, TypeError, ...
                raise FormatError(f"not a generation config: {_clip(exc)}", path=where) from exc
    except BaseException:
        if owns_cache:
            weight_cache.close()
        raise
    model.eval()
    model.config._name_or_path = os.fspath(directory)
    return _Loaded(model, weight_cache, owns_cache, report)


def _count(
    recipe: Recipe,
    auto_class: str | type,
    bundle: Bundle | None,
    embed: tuple[str | os.PathLike[str], str | None] | None,
) -> int:
    """:func:`pack_count` of a load: the progress bar's total (counted only when a bar is drawn)."""
    if bundle is not None or embed is None:
        return bundle.entries if bundle is not None else 0
    root, folder = embed
    return pack_count(
        root, recipe.scheme, auto_class=auto_class, group_size=recipe.group_size, sentence_transformers=folder
    )


def _model_requests(
    checkpoint: Checkpoint,
    recipe: Recipe,
    model: Any,
    auto_class: str,
    root: str | os.PathLike[str],
    sentence_transformers: str | None,
) -> list[Request]:
    """The requests that store the model record and the checkpoint's files (:func:`packcache.bundle.collect_files`
    of ``root``), so the cache file alone is the model (docs/FORMAT.md "Embedded entries"); a warm launch finds them.

    Raises:
        FormatError: a file to embed names remote code, or is malformed. UntrustedFileError, OSError: as the reader.
    """
    files = collect_files(root, sentence_transformers=sentence_transformers)
    sources, tensors = tensor_table(checkpoint, checkpoint.names())
    record = ModelRecord(
        loader="hf", scheme=recipe.scheme, group_size=recipe.group_size, model_type=str(model.config.model_type),
        auto_class=auto_class, sentence_transformers=sentence_transformers, sources=sources, tensors=tensors,
        files={},
    )  # fmt: skip
    return record_requests(record, files)


def default_cache_path(
    path: str | os.PathLike[str],
    scheme: str | None = None,
    *,
    group_size: int = GROUP_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
    auto_class: str | type = "AutoModel",
) -> Path:
    """The cache file of this checkpoint, scheme and auto class by default (what :func:`from_pretrained` and
    :func:`sentence_transformer` open without ``cache=``, and ``packcache build``):
    ``<model type>-<scheme>-<16 hex>.pcache`` in ``cache_dir``, else :func:`packcache._paths.default_cache_dir`.
    ``scheme`` ``None``/``"auto"`` is this machine's default, and the name says which it resolved to. ``path``
    may be a hub id (:func:`packcache.hub.resolve_model`: the local hub cache's snapshot).

    The hex digits name the shards' content digests, the packers and an auto class other than ``AutoModel``
    (:func:`packcache.identity.model_cache_name`), never the directory: every copy of the
    checkpoint opens the same file, another scheme, group size or auto class another. For int8, bf16 and fp32
    and ``AutoModel`` it is the file :func:`packcache.models.minilm.default_cache_path` names for the same
    checkpoint: both loaders pack those entries alike. Reads ``config.json`` and the safetensors headers, and
    finds the shards' digests (hashed once per version of a file, looked up afterwards).

    Raises:
        As :func:`from_pretrained` for an unknown scheme or a missing or malformed checkpoint or hub id.
    """
    recipe = resolve(scheme, group_size)  # an unknown scheme fails here
    checkpoint = Checkpoint(resolve_model(path))
    settings = _read_json(checkpoint.config_path, "config")
    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    if not isinstance(model_type, str):
        raise FormatError(f"model_type {_short(model_type)} is not a string", path=str(checkpoint.config_path))
    name = _cache_name(checkpoint, model_type, recipe, auto_class)
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / name


def _cache_name(checkpoint: Checkpoint, model_type: str, recipe: Recipe, auto_class: str | type) -> str:
    """The one naming rule of this loader's cache files: content, packers, no calibration, and the auto class
    (its model record is the class's: an ``AutoModelForCausalLM`` load must not open, and rewrite the record of,
    the file an ``AutoModel`` load built). ``AutoModel`` adds nothing, so that file stays the one
    :func:`packcache.models.minilm.default_cache_path` names for int8, bf16 and fp32."""
    # pinned by tests/test_defaults_loaders.py::test_the_cache_name_includes_the_auto_class
    sources = [file.identity for file in checkpoint.files]
    name = _auto_name(auto_class)
    recipe_of = None if name == "AutoModel" else {"auto_class": name}
    return model_cache_name(model_type, recipe.scheme, sources, recipe.packers, recipe_of)


def _missing(groups: list[list[str]], source: _Renamed) -> list[str]:
    """Parameters (each tied group once) of which the checkpoint holds none of the names."""
    return [names[0] for names in groups if not any(source.name(n) in source.checkpoint for n in names)]


def _refuse_missing(directory: object, model_class: type[Any], groups: list[list[str]], source: _Renamed) -> None:
    """Raise ValueError naming the tensors ``model_class`` needs that the checkpoint lacks (:func:`_missing`)."""
    missing = _missing(groups, source)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(
            f"{directory}: the checkpoint lacks {len(missing)} tensor(s) that {model_class.__name__} needs: {shown} "
            "(packcache does not initialise missing weights or rename legacy keys)"
        )


def from_pretrained(
    path: str | os.PathLike[str],
    scheme: str | None = None,
    cache: WeightCache | str | os.PathLike[str] | bool | None = None,
    *,
    auto_class: str | type | None = None,
    group_size: int | None = None,
    kernel_path: str | None = None,
    remote: str | None = None,
    trusted_keys: Any = (),
    allow_unsigned: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    remote_timeout: float | None = None,
    fetch_timeout: float | None = None,
) -> Any:
    """Load a ``transformers`` model with its linear layers packed by ``scheme``, weights from ``cache``; or load
    the model a cache file holds, or a published name names, with no checkpoint.

    Args:
        path: a directory written by ``save_pretrained`` (``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``); a hub id (``org/name``, ``org/name@revision``) already in the local
            Hugging Face hub cache, resolved offline to its snapshot (:func:`packcache.hub.resolve_model`: nothing
            is fetched from a hub); or a cache file (``*.pcache``) that ``packcache build`` or a load made: it
            holds the config and every pack, so no checkpoint is read (docs/HF.md, "A cache file is the model").
        scheme: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"``, the packer of the linear layers
            (:func:`packcache.loader.scheme_packer`) and of the embedding tables
            (:data:`packcache.loader.EMBEDDING_PACKERS`); every other parameter is float32. ``None`` or ``"auto"``
            (the default): for a checkpoint the scheme fast on this CPU (:func:`packcache.loader.resolve_scheme`),
            as ``packcache build`` chooses it; for a cache file the one it holds (another scheme raises).
        cache: for a checkpoint, ``None`` (the default, as transformers' ``cache_dir=None``): the content-named
            file :func:`default_cache_path` names (in ``$PACKCACHE_DIR``, else ``$XDG_CACHE_HOME/packcache``), the
            one ``packcache build`` makes; a cache file path (created if missing); a :class:`~packcache.WeightCache`
            made with ``platform=packcache.hf.platform(scheme, group_size)``; or ``False`` (caching off: packed to
            heap, state ``off``). The cache file also holds the model's config, generation config and tokenizer
            files, so it can be loaded alone. For a cache file ``path``: ``None`` (the file is its own cache, opened
            read-only).
        auto_class: the ``transformers`` auto class (name or class) that picks the model class, e.g.
            ``"AutoModelForCausalLM"``. ``None``: ``"AutoModel"`` for a checkpoint, the one a cache file was built
            with.
        group_size: int4 group size (32, 64 or 128; ``None``: 32, or a cache file's); ignored by the other schemes.
        kernel_path: ``"bf16"``, ``"fp32"`` or ``None``/``"auto"`` (:mod:`packcache.kernels`).
        remote: for a published name as ``path`` (``org/model-int8``, optionally ``@GENERATION``; anything that is
            not a local path, :func:`packcache.hub.is_local_path`; without ``remote=`` it is a hub id): ``remote=URL``
            (the store),
            ``trusted_keys=[PUB, ...]`` (PEM bytes or ``.pub.pem`` paths), ``allow_unsigned=False``,
            ``cache_dir=`` (where the file lands; default :func:`packcache._paths.default_cache_dir`),
            ``remote_timeout=`` (seconds the store may make no progress) and ``fetch_timeout=`` (the whole fetch).
            The file is fetched and checked (:func:`packcache.fleet.names.fetch_name`: signature, generation,
            sha256, every pack) unless the one there already is the published one, then loaded as a cache file;
            ``model.packcache_fetch`` is the fetch's report.

    Returns:
        The model, of exactly the class ``auto_class.from_pretrained`` returns, in eval mode, with
        ``model.packcache`` (the :class:`~packcache.WeightCache`; ``stats()``, ``close()``) and
        ``model.packcache_report`` (the :class:`~packcache.torch.ConversionReport`).

    Raises:
        FileNotFoundError: no checkpoint directory, ``config.json`` or safetensors weights; no cache file; a hub id
            the local hub cache has no snapshot of (one line naming where it looked).
        FormatError: a malformed safetensors header or index (naming file and offset); a cache file that is not
            one, holds no model record, or whose record or embedded files are malformed; a config naming remote
            code (``auto_map``), which is never stored nor run.
        UntrustedFileError: a cache file another user could have written.
        ValueError: unknown scheme or auto class, no model of that class for the checkpoint's
            config, a tensor the model needs missing from the checkpoint (all named), or a shape
            mismatch; a cache file packed for another platform, or asked for another scheme; ``remote`` options
            with a local path, or a name that is malformed. Cache problems of a
            checkpoint load never raise: they are reported in ``model.packcache.stats()``.
        RemoteError: a published name could not be fetched (its reason says why: ``remote_untrusted``,
            ``remote_corrupt``, ``remote_absent``, ...); nothing was loaded.
    """
    given = {"remote": remote, "trusted_keys": trusted_keys, "allow_unsigned": allow_unsigned, "cache_dir": cache_dir,
             "remote_timeout": remote_timeout, "fetch_timeout": fetch_timeout}  # fmt: skip
    path, fetched = _named(path, scheme, group_size, given)
    if fetched is not None:
        scheme = group_size = None  # the file's
    if is_cache_file(path):
        with open_bundle(path) as bundle:
            loaded = _load(
                path, scheme, cache, auto_class=auto_class or bundle.record.auto_class or "AutoModel",
                config=None, group_size=group_size, kernel_path=kernel_path, bundle=bundle,
                folder=bundle.record.sentence_transformers or "",
            )  # fmt: skip
    else:
        folder = transformer_folder(path) if os.path.isdir(path) else None
        loaded = _load(
            path, scheme, cache, auto_class=auto_class or "AutoModel", config=None, group_size=group_size,
            kernel_path=kernel_path, embed=(path, folder),
        )  # fmt: skip
    _attach(loaded.model, loaded)
    if fetched is not None:
        loaded.model.packcache_fetch = fetched
    return loaded.model


def _named(
    path: str | os.PathLike[str], scheme: str | None, group_size: int | None, options: dict[str, Any]
) -> tuple[str | os.PathLike[str], Any]:
    """``(path, None)`` for a local path; for a hub id without ``remote=``, its snapshot directory in the local hub
    cache (:func:`packcache.hub.resolve_model`) and ``None``; for a published name with ``remote=``, the local cache
    file it names once fetched (:func:`packcache.fleet.names.fetch_name`) and the fetch's report. ``options``: the
    remote keywords as given (``None``, ``()`` and ``False`` are "not given").

    Raises:
        ValueError: remote options with a local path or without ``remote=``, or a malformed name, hub id or URL.
        FileNotFoundError: a hub id the local hub cache does not hold (one line naming where it looked).
        RemoteError: the fetch failed.
    """
    options = {k: v for k, v in options.items() if v not in (None, (), [], False)}
    from .fleet.names import fetch_name, is_local_path

    if is_local_path(path):
        if options:
            raise ValueError(
                f"{os.fspath(path)!r} is a local path: remote options are for a published name (for a cache that "
                "fetches on a miss, pass cache=WeightCache(path, remote=URL, ...))"
            )
        return path, None
    if options.get("remote") is None:
        if options:
            raise ValueError(f"{sorted(options)} given without remote=URL: they are for a published name's store")
        # pinned by tests/test_hub.py::test_a_hub_id_loads_from_the_local_hub_cache_offline
        return resolve_model(path), None
    report = fetch_name(
        options["remote"], os.fspath(path), cache_dir=options.get("cache_dir"),
        trusted_keys=options.get("trusted_keys", ()), allow_unsigned=bool(options.get("allow_unsigned", False)),
        timeout=options.get("remote_timeout") or REMOTE_TIMEOUT,
        total_timeout=options.get("fetch_timeout") or FETCH_DEADLINE, scheme=scheme, group_size=group_size,
    )  # fmt: skip
    return report.path, report


#: Files a tokenizer may read: the tokenizer files, and the config (``AutoTokenizer`` reads the model type from it).
_TOKENIZER_FILES = frozenset({
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json",
})  # fmt: skip


def tokenizer(
    path: str | os.PathLike[str],
    *,
    remote: str | None = None,
    trusted_keys: Any = (),
    allow_unsigned: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    remote_timeout: float | None = None,
    fetch_timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """The model's ``transformers`` tokenizer (``AutoTokenizer``, loaded into memory) from a checkpoint directory (or
    a hub id in the local hub cache, :func:`packcache.hub.resolve_model`), a cache file (``*.pcache``: the tokenizer
    files it holds, checked, written to a private temporary directory for the load and removed after it), or a
    published name with ``remote=`` (as :func:`from_pretrained`; the file is fetched once, a later call finds it
    there). ``kwargs`` go to ``AutoTokenizer.from_pretrained`` (``local_files_only`` is always on;
    ``trust_remote_code`` is never).

    Raises:
        FormatError: a cache file with no model record, or whose tokenizer files fail their checks or name remote
            code. ValueError, RemoteError: as :func:`from_pretrained` for a name. FileNotFoundError: a hub id the
            local hub cache does not hold.
    """
    given = {"remote": remote, "trusted_keys": trusted_keys, "allow_unsigned": allow_unsigned, "cache_dir": cache_dir,
             "remote_timeout": remote_timeout, "fetch_timeout": fetch_timeout}  # fmt: skip
    path, _ = _named(path, None, None, given)
    kwargs["local_files_only"] = True
    kwargs.pop("trust_remote_code", None)
    if not is_cache_file(path):
        return transformers.AutoTokenizer.from_pretrained(os.fspath(path), **kwargs)
    with open_bundle(path) as bundle, tempfile.TemporaryDirectory(prefix="packcache-tokenizer-") as files:
        folder = bundle.record.sentence_transformers or ""
        prefix = f"{folder}/" if folder else ""
        wanted = [name for name in bundle.record.files if name.startswith(prefix)]
        wanted = [name for name in wanted if name[len(prefix) :] in _TOKENIZER_FILES]
        bundle.extract(files, only=wanted)
        return transformers.AutoTokenizer.from_pretrained(os.path.join(files, folder), **kwargs)


def _attach(target: Any, loaded: _Loaded) -> None:
    # Plain attributes (nn.Module.__setattr__ stores non-module values in the instance dict).
    target.packcache = loaded.cache
    target.packcache_report = loaded.report


def load_report(model: Any) -> ConversionReport:
    """The :class:`~packcache.torch.ConversionReport` of a model loaded here (or of a SentenceTransformer's)."""
    report = getattr(model, "packcache_report", None)
    if not isinstance(report, ConversionReport):
        raise ValueError("this model was not loaded by packcache.hf")
    return report


def pack_count(
    path: str | os.PathLike[str],
    scheme: str | None = None,
    *,
    auto_class: str | type = "AutoModel",
    group_size: int = GROUP_SIZE,
    sentence_transformers: str | None = None,
) -> int:
    """How many cache entries :func:`from_pretrained` requests for this checkpoint: a progress total (the packs, and
    the model record and embedded files; for a sentence-transformers model, give its Transformer module's folder
    as ``sentence_transformers`` and its root as ``path``).

    Reads ``config.json`` and the safetensors headers and builds the model on ``meta``; no tensor is read, but
    the two of a tie the checkpoint holds both of (rare: transformers saves one), compared as a load compares them.

    Raises:
        As :func:`from_pretrained` for a missing or malformed checkpoint, scheme or auto class.
    """
    recipe = resolve(scheme, group_size)
    path = resolve_model(path)
    folder = os.path.join(path, sentence_transformers or "")
    checkpoint = Checkpoint(folder)
    config = checkpoint.config()  # a missing or malformed checkpoint fails here, naming the file
    model_class = _model_class(auto_class, config)
    model = _checked_skeleton(checkpoint, model_class, config)
    source = _renaming(model, parameter_groups(model), checkpoint)
    checks = _tie(model, source, lambda a, b: _same_values(source, a, b))
    # as the load refuses it: `serve` checks a model in its master with this, before any worker loads it;
    # pinned by tests/test_server_models.py::test_a_bad_checkpoint_is_refused_by_the_master_in_one_line
    _refuse_missing(checkpoint.directory, model_class, parameter_groups(model), source)
    embedded = len(collect_files(path, sentence_transformers=sentence_transformers)) + 1
    packs = count_packs(model, recipe.linear, transposed=TRANSPOSED_LINEARS, embedding=recipe.embedding)
    return checks + packs + embedded


def sentence_transformer(
    path: str | os.PathLike[str],
    scheme: str | None = None,
    cache: WeightCache | str | os.PathLike[str] | bool | None = None,
    *,
    group_size: int | None = None,
    kernel_path: str | None = None,
    remote: str | None = None,
    trusted_keys: Any = (),
    allow_unsigned: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    remote_timeout: float | None = None,
    fetch_timeout: float | None = None,
    **kwargs: Any,
) -> SentenceTransformer:
    """Load a sentence-transformers model with its Transformer module's weights packed from ``cache``; or the one a
    cache file holds, with no checkpoint.

    ``path`` is a directory written by ``SentenceTransformer.save`` (``modules.json``, the
    Transformer module's checkpoint, pooling and normalisation), a plain transformers checkpoint (no
    ``modules.json``: its model and mean pooling, last-token pooling for a causal LM, as sentence-transformers
    loads one), a hub id in the local hub cache (as :func:`from_pretrained`), or a cache file (``*.pcache``) a
    load of one with
    ``cache=`` (or ``packcache build``) made: it holds every module's configuration and small weights, the
    tokenizer and the packs. sentence-transformers loads
    every module itself (tokenizer, pooling, its configuration files), except that the
    Transformer module's model comes from :func:`from_pretrained`'s loader; modules with
    weights of their own (``Dense``) are loaded by sentence-transformers, unpacked (from a cache file: from the
    copies it holds, written to a private temporary directory for the load and removed after it).
    ``kwargs`` go to ``SentenceTransformer`` (``device`` defaults to ``"cpu"``;
    ``local_files_only`` is always on). A published name with ``remote=`` and its options is fetched and loaded as
    its cache file, as :func:`from_pretrained` does (``st.packcache_fetch``: the fetch's report). ``cache`` as
    :func:`from_pretrained`'s: ``None`` (the default) is the content-named file of the Transformer module's
    checkpoint in the default cache directory, ``False`` caching off.

    Returns:
        A ``sentence_transformers.SentenceTransformer`` (its Transformer module is exactly
        sentence-transformers' class) with ``st.packcache`` and ``st.packcache_report``.

    Raises:
        ValueError: the model has no Transformer module, or more than one; a backend other
            than torch, or a PEFT adapter; a cache file of a model that is not a sentence-transformers one.
            Otherwise as :func:`from_pretrained`.
    """
    given = {"remote": remote, "trusted_keys": trusted_keys, "allow_unsigned": allow_unsigned, "cache_dir": cache_dir,
             "remote_timeout": remote_timeout, "fetch_timeout": fetch_timeout}  # fmt: skip
    path, fetched = _named(path, scheme, group_size, given)
    if fetched is not None:
        st = sentence_transformer(path, kernel_path=kernel_path, **kwargs)
        st.packcache_fetch = fetched
        return st
    if not is_cache_file(path):
        return _sentence_transformer(os.fspath(path), scheme, cache, group_size, kernel_path, None, kwargs)
    with open_bundle(path) as bundle, tempfile.TemporaryDirectory(prefix="packcache-st-") as files:
        if bundle.record.sentence_transformers is None:
            raise ValueError(
                f"{os.fspath(path)} holds a {bundle.record.model_type} model, not a sentence-transformers one: "
                "load it with packcache.hf.from_pretrained"
            )
        bundle.extract(files)
        return _sentence_transformer(files, scheme, cache, group_size, kernel_path, bundle, kwargs)


def _sentence_transformer(
    base: str,
    scheme: str | None,
    cache: WeightCache | str | os.PathLike[str] | bool | None,
    group_size: int | None,
    kernel_path: str | None,
    bundle: Bundle | None,
    kwargs: dict[str, Any],
) -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import TRANSFORMER_TASK_TO_AUTO_MODEL, Transformer

    loads: list[_Loaded] = []

    class PackedTransformer(Transformer):
        """sentence-transformers' Transformer whose model comes from the cache (its class is reset after loading)."""

        def _load_model(
            self, model_name_or_path: str, transformer_task: Any, config: Any, backend: str, is_peft_model: bool,
            **model_kwargs: Any,
        ) -> Any:  # fmt: skip
            if backend != "torch" or is_peft_model:
                raise ValueError(f"packcache packs torch models only (backend {backend!r}, PEFT {is_peft_model})")
            if loads:
                raise ValueError(f"{base}: more than one Transformer module; packcache packs one per model")
            directory = os.path.join(model_name_or_path, model_kwargs.get("subfolder") or "")
            folder = os.path.relpath(directory, base)
            folder = "" if folder == "." else folder.replace(os.sep, "/")
            loaded = _load(
                directory, scheme, cache, config=config, group_size=group_size,
                kernel_path=kernel_path, auto_class=TRANSFORMER_TASK_TO_AUTO_MODEL[transformer_task],
                bundle=bundle, folder=folder, embed=(base, folder),
            )  # fmt: skip
            loads.append(loaded)
            return loaded.model

    kwargs.setdefault("device", "cpu")
    kwargs["local_files_only"] = True
    classes = dict.fromkeys(ST_TRANSFORMER_REFS, PackedTransformer)
    try:
        if os.path.lexists(os.path.join(base, "modules.json")):
            st = SentenceTransformer._load_with_module_classes(base, classes, **kwargs)
        else:
            st = _default_modules(SentenceTransformer, PackedTransformer, base, kwargs)
        if not loads:
            raise ValueError(f"{base}: modules.json has no sentence-transformers Transformer module to pack")
    except BaseException:
        for loaded in loads:
            if loaded.owns_cache:
                loaded.cache.close()
        raise
    for module in st.modules():
        if type(module) is PackedTransformer:
            module.__class__ = Transformer  # exactly sentence-transformers' class from here on
    _attach(st, loads[0])
    return st


def _default_modules(
    model_class: type[SentenceTransformer], transformer_class: type[Any], base: str, kwargs: dict[str, Any]
) -> SentenceTransformer:
    """A plain transformers checkpoint (no ``modules.json``) as sentence-transformers loads one: its Transformer
    module (here ``transformer_class``, packed) and mean pooling, or last-token pooling for a causal LM
    (``SentenceTransformer._load_default_modules``, which builds an unpacked Transformer itself).

    Raises:
        As :func:`from_pretrained` for the checkpoint.
    """
    from sentence_transformers.sentence_transformer.modules import Pooling

    # pinned by tests/test_server_models.py::test_a_plain_transformers_checkpoint_serves_mean_pooling
    local = {"local_files_only": True}
    transformer = transformer_class(base, model_kwargs=dict(local), processor_kwargs=dict(local),
                                    config_kwargs=dict(local))  # fmt: skip
    config = transformer.config
    architectures = getattr(config, "architectures", None) or [""]
    causal = architectures[0].endswith("ForCausalLM") and getattr(config, "is_causal", True)
    pooling = Pooling(transformer.get_embedding_dimension(), "lasttoken" if causal else "mean")
    return model_class(modules=[transformer, pooling], **{k: v for k, v in kwargs.items() if k != "local_files_only"})
