"""What the master reads of a model's files before any worker starts: its served name, where its Transformer
module is, and which loader takes it (no weight is read).

A worker then loads the model as :mod:`.engines` says, with the loader chosen here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["BUNDLED_MODEL_ID", "choose_loader", "model_id_of", "transformer_folder_of"]

#: What ``model_id`` is for the bundled model (no ``--model``).
BUNDLED_MODEL_ID = "all-MiniLM-L6-v2"


def model_id_of(model: str | None) -> str:
    """The name a model is served under by default (``GET /v1/models``, each response's ``model``): a directory's
    or cache file's base name (without ``.pcache``), a name that is no local path as given (a hub id, a published
    name), the bundled model's own name without ``--model``.

    >>> model_id_of(None), model_id_of("/srv/models/e5-small/"), model_id_of("/c/bert-int8-0123.pcache")
    ('all-MiniLM-L6-v2', 'e5-small', 'bert-int8-0123')
    >>> model_id_of("intfloat/multilingual-e5-small")
    'intfloat/multilingual-e5-small'
    """
    from ..hub import is_local_path

    if model is None:
        return BUNDLED_MODEL_ID
    if not is_local_path(model):
        return model
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".pcache") or base


def transformer_folder_of(path: str | os.PathLike[str]) -> str:
    """The folder of a sentence-transformers model's Transformer module, relative to ``path`` (``""``: the root, as
    every save of sentence-transformers 3 and later has it, and a plain transformers checkpoint, which has no
    ``modules.json``). What :func:`packcache.hf.pack_count` and :func:`packcache.hf.default_cache_path` take.

    Raises:
        FormatError: a malformed ``modules.json``, one with no Transformer module or more than one, or a folder
            outside the model. UntrustedFileError, OSError: it cannot be read.
    """
    from .._boundedjson import load_file
    from ..bundle import ST_TRANSFORMER_REFS
    from ..errors import FormatError

    listing = os.path.join(os.fspath(path), "modules.json")
    if not os.path.lexists(listing):
        return ""
    modules = load_file(listing, what="modules.json", max_bytes=_MAX_JSON_BYTES)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise FormatError("not a JSON list of modules", path=listing)
    folders = [m.get("path") for m in modules if m.get("type") in ST_TRANSFORMER_REFS]
    if len(folders) != 1:
        raise FormatError(f"{len(folders)} Transformer modules: packcache serves models with exactly one", path=listing)
    folder = folders[0]
    if not isinstance(folder, str) or os.path.isabs(folder) or ".." in folder.replace("\\", "/").split("/"):
        raise FormatError(f"the Transformer module's path {folder!r} is not a folder inside the model", path=listing)
    return folder.strip("/")


def choose_loader(model: str | None) -> str:
    """Which loader of :data:`~packcache.server.engines.LOADERS` ``serve`` loads ``model`` with, decided from its
    files alone (no weight read).

    ``minilm`` (the fast path) for the bundled model (``None``), a path to a safetensors file, a cache file of
    calibrated int4 packs (``packcache.models.minilm``'s alone), of a plain BERT checkpoint, or whose embedded files
    have the shape below (a file either loader built serves both), and a checkpoint directory that
    sentence-transformers runs exactly as the MiniLM
    encoder does: ``config.json``'s ``model_type`` ``bert`` with ``hidden_act`` ``gelu`` and absolute positions,
    one ``model.safetensors`` and a ``tokenizer.json`` at the root; ``modules.json`` absent (a plain checkpoint:
    mean pooling) or the Transformer module at the root, mean pooling alone, then at most a Normalize; no prompt,
    no ``do_lower_case``; and the truncation the MiniLM loader computes (``sentence_bert_config.json``'s
    ``max_seq_length``, else the position limit) is sentence-transformers'. A checkpoint of that shape that is
    malformed is the MiniLM loader's to refuse. Everything else is ``hf``: any model
    :func:`packcache.hf.sentence_transformer` loads.

    Raises:
        FormatError: a malformed ``config.json``, ``modules.json`` or module config, or a cache file that is not
            one. UntrustedFileError, OSError: a file cannot be read.
    """
    from ..bundle import is_cache_file, open_bundle

    if model is None:
        return "minilm"
    if is_cache_file(model):
        with open_bundle(model) as bundle:
            record = bundle.record
            if record.loader == "minilm":
                return "minilm"  # calibrated int4: this loader's alone
            if record.sentence_transformers is None:
                # a plain checkpoint's file: MiniLM's loader reads a BERT's; packcache.hf refuses the others clearly
                return "minilm" if record.model_type == "bert" else "hf"

            def embedded(name: str) -> Any:
                return bundle.read_json(name) if bundle.has_file(name) else None

            shaped = _minilm_shaped(embedded, bundle.has_file, weights=False)
        return "minilm" if shaped else "hf"
    if not os.path.isdir(model):
        return "minilm"  # a safetensors file, or nothing there: the MiniLM loader says what is wrong

    def read(name: str) -> Any:
        return _json_or_none(os.path.join(model, name))

    return "minilm" if _minilm_shaped(read, lambda name: os.path.lexists(os.path.join(model, name))) else "hf"


_MAX_JSON_BYTES = 1 << 20
_MEAN_ONLY = {"pooling_mode_cls_token": False, "pooling_mode_max_tokens": False,
              "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
              "pooling_mode_lasttoken": False}  # fmt: skip


def _json_or_none(path: str) -> Any:
    from .._boundedjson import load_file

    if not os.path.lexists(path):
        return None
    return load_file(path, what=os.path.basename(path), max_bytes=_MAX_JSON_BYTES)


def _minilm_shaped(read: Callable[[str], Any], has: Callable[[str], bool], *, weights: bool = True) -> bool:
    """:func:`choose_loader`'s rule for a model's files (see there): ``read(name)`` parses one (``None``: absent),
    ``has(name)`` says whether it is there; ``weights``: ``model.safetensors`` must be (a cache file holds packs)."""
    from ..bundle import ST_TRANSFORMER_REFS

    config = read("config.json")
    if not isinstance(config, dict) or config.get("model_type") != "bert":
        return False
    if config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        return False  # the MiniLM encoder computes neither; packcache.hf runs the model's own code
    if (weights and not has("model.safetensors")) or not has("tokenizer.json"):
        return False
    modules = read("modules.json")
    if modules is not None:
        if not isinstance(modules, list) or not 2 <= len(modules) <= 3 or not all(isinstance(m, dict) for m in modules):
            return False
        types = [str(m.get("type", "")) for m in modules]
        if types[0] not in ST_TRANSFORMER_REFS or modules[0].get("path") != "":
            return False
        if not (types[1].startswith("sentence_transformers.") and types[1].endswith(".Pooling")):
            return False
        if len(types) == 3 and not (types[2].startswith("sentence_transformers.") and types[2].endswith(".Normalize")):
            return False
        folder = str(modules[1].get("path") or "")
        pooling = read(f"{folder}/config.json" if folder else "config.json")
        if not isinstance(pooling, dict):
            return False
        if "pooling_mode" in pooling:
            if pooling["pooling_mode"] not in ("mean", ["mean"]):
                return False
        elif pooling.get("pooling_mode_mean_tokens") is not True or any(pooling.get(k) for k in _MEAN_ONLY):
            return False
    settings = read("config_sentence_transformers.json")
    if isinstance(settings, dict) and isinstance(settings.get("prompts"), dict) and any(settings["prompts"].values()):
        return False  # the MiniLM engine has no prompts
    bert_settings = read("sentence_bert_config.json")
    bert_settings = bert_settings if isinstance(bert_settings, dict) else {}
    if bert_settings.get("do_lower_case"):
        return False
    positions = config.get("max_position_embeddings", 512)
    limit = bert_settings.get("max_seq_length")
    if limit is None:
        # sentence-transformers truncates to the tokenizer's model_max_length when it is under the position limit
        tokenizer = read("tokenizer_config.json")
        given = tokenizer.get("model_max_length") if isinstance(tokenizer, dict) else None
        if isinstance(given, (int, float)) and isinstance(positions, int) and given < positions:
            return False
    return True
