"""Assembling a ``transformers`` model from a checkpoint: its class from the auto class, its skeleton on ``meta``
(bounded by the checkpoint), its ties as ``transformers`` makes them for that checkpoint, and its weights converted
from the cache in one session (:func:`~packcache.torch.convert`), with the model record that lets the cache file
alone be the model. What ``path`` names, and the sentence-transformers and tokenizer entry points around this, are
:mod:`packcache.hf`'s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from ._attention import per_sequence
from ._defaults import GROUP_SIZE
from ._hf_checkpoint import Checkpoint, _Bundled, _clip, _Renamed, _renaming, _Source
from ._progress import bar as progress_bar
from .bundle import Bundle, ModelRecord, SourceFile, collect_files, record_requests, tensor_table
from .cache import PackKey, Request, WeightCache
from .errors import FormatError
from .hub import resolve_model
from .identity import model_cache_name
from .loader import Recipe, open_cache, open_model_file, resolve
from .packers import to_float32
from .torch import ConversionReport, convert, count_packs, parameter_groups

__all__ = ["TRANSPOSED_LINEARS", "_Loaded", "_cache_name", "_load", "pack_count"]


#: Module classes computing ``x @ weight + bias`` with ``weight`` stored ``[in, out]``: packed transposed.
TRANSPOSED_LINEARS: tuple[type[nn.Module], ...] = (Conv1D,)

#: Serialises :func:`_skeleton` (see there).
_SKELETON_LOCK = threading.Lock()

#: Config fields that count modules the model builds (layers, experts): each must be at most the number of
#: tensors in the checkpoint (every layer or expert has one at least), checked before the skeleton is built.
COUNT_FIELDS = (
    "num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers", "num_encoder_layers",
    "num_decoder_layers", "num_experts", "num_local_experts", "n_routed_experts",
)  # fmt: skip
#: Non-persistent buffers (position ids, rotary tables, masks) the skeleton may materialise, at least: a
#: config's sizes may ask for more only when the checkpoint's own tensors are that large.
MIN_BUFFER_CAP = 256 << 20


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
        embedded = None
        if embed is not None and isinstance(checkpoint, Checkpoint) and weight_cache.path is not None:
            # before anything is packed: a model the file could not hold whole is refused with nothing written
            embedded = collect_files(embed[0], sentence_transformers=embed[1])
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
            if embedded is not None and embed is not None and isinstance(checkpoint, Checkpoint):
                session.get_many(_model_requests(checkpoint, recipe, model, _auto_name(auto_class), embed[1], embedded))
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
    per_sequence(model)  # an encoder's texts attend over their own tokens: one answer per text, whatever the batch
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
    sentence_transformers: str | None,
    files: dict[str, SourceFile],
) -> list[Request]:
    """The requests that store the model record and the checkpoint's files (``files``:
    :func:`packcache.bundle.collect_files` of the model's root), so the cache file alone is the model (docs/FORMAT.md
    "Embedded entries"); a warm launch finds them.

    Raises:
        FormatError: a file to embed names remote code, or is malformed. UntrustedFileError, OSError: as the reader.
    """
    sources, tensors = tensor_table(checkpoint, checkpoint.names())
    record = ModelRecord(
        loader="hf", scheme=recipe.scheme, group_size=recipe.group_size, model_type=str(model.config.model_type),
        auto_class=auto_class, sentence_transformers=sentence_transformers, sources=sources, tensors=tensors,
        files={},
    )  # fmt: skip
    return record_requests(record, files)


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


def pack_count(
    path: str | os.PathLike[str],
    scheme: str | None = None,
    *,
    auto_class: str | type = "AutoModel",
    group_size: int = GROUP_SIZE,
    sentence_transformers: str | None = None,
) -> int:
    """How many cache entries :func:`~packcache.hf.from_pretrained` requests for this checkpoint: a progress total
    (the packs, and the model record and embedded files; for a sentence-transformers model, give its Transformer
    module's folder as ``sentence_transformers`` and its root as ``path``).

    Reads ``config.json`` and the safetensors headers and builds the model on ``meta``; no tensor is read, but
    the two of a tie the checkpoint holds both of (rare: transformers saves one), compared as a load compares them.

    Raises:
        As :func:`~packcache.hf.from_pretrained` for a missing or malformed checkpoint, scheme or auto class.
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
