"""What the master reads of a model's files before any worker starts: its served name, where its Transformer
module is, and which loader takes it (no weight is read): one rule for a checkpoint directory and for the cache file
built from it, which also decides what a causal LM is for every command (:func:`causal_lm_class`).

A worker then loads the model as :mod:`.engines` says, with the loader chosen here.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "BUNDLED_MODEL_ID",
    "CAUSAL_AUTO_CLASS",
    "EMBEDDING_AUTO_CLASS",
    "causal_lm_class",
    "choose_loader",
    "default_auto_class",
    "is_causal_lm",
    "model_id_of",
    "transformer_folder_of",
]

#: What ``model_id`` is for the bundled model (no ``--model``).
BUNDLED_MODEL_ID = "all-MiniLM-L6-v2"


def model_id_of(model: str | None, *, remote: bool = False) -> str:
    """The name a model is served under by default (``GET /v1/models``, each response's ``model``): a directory's
    or cache file's base name (without ``.pcache``), a name that is no local path as given (a hub id, a published
    name: with ``remote``, whatever lies at that path, as :func:`packcache.hub.model_argument` reads it), the
    bundled model's own name without ``--model``.

    >>> model_id_of(None), model_id_of("/srv/models/e5-small/"), model_id_of("/c/bert-int8-0123.pcache")
    ('all-MiniLM-L6-v2', 'e5-small', 'bert-int8-0123')
    >>> model_id_of("intfloat/multilingual-e5-small")
    'intfloat/multilingual-e5-small'
    """
    from ..hub import is_local_path

    if model is None:
        return BUNDLED_MODEL_ID
    if not is_local_path(model, remote=remote):
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


#: The auto class of a causal LM's file: what ``serve`` generates with, what ``build`` builds for one.
CAUSAL_AUTO_CLASS = "AutoModelForCausalLM"
#: The auto class of every other model's file: the one sentence-transformers embeds with.
EMBEDDING_AUTO_CLASS = "AutoModel"


def causal_lm_class(config: Any) -> str | None:
    """The class ``AutoModelForCausalLM`` builds for a checkpoint whose ``config.json`` (parsed) is a causal LM, else
    ``None``: the one rule of "causal LM" that ``build`` (its default auto class), ``run`` (which refuses one),
    ``serve`` (which generates with one) and ``fetch`` (the file it names) follow, through :func:`choose_loader`.

    It reads transformers' own causal-LM mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: model type -> class),
    never a suffix of a class name. A config is a causal LM when its ``model_type`` has a causal-LM class and:

    - ``architectures`` (the classes the checkpoint was saved from) names that class: ``GPT2LMHeadModel``,
      ``LlamaForCausalLM``; a base model (``LlamaModel``, ``BertModel``) or another head (``BertForMaskedLM``) is not;
    - or it names none, and the model type is no encoder family (transformers has no masked-LM class for it), or the
      config says ``is_decoder``. BERT and RoBERTa are in the mapping (``BertLMHeadModel``: a BERT made a decoder),
      yet a config of theirs with neither ``architectures`` nor ``is_decoder`` is an encoder's.

    Without transformers installed nothing is a causal LM (packcache builds and serves one through transformers).
    Never raises: a config of another shape is not a causal LM's.

    >>> causal_lm_class({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    'GPT2LMHeadModel'
    >>> causal_lm_class({"model_type": "bert", "architectures": ["BertModel"]}) is None
    True
    >>> causal_lm_class({"model_type": "bert"}), causal_lm_class({"model_type": "bert", "is_decoder": True})
    (None, 'BertLMHeadModel')
    """
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return None
    tables = _auto_tables()
    if tables is None:
        return None
    causal, masked = tables
    model_type = config["model_type"]
    name = causal.get(model_type)
    if not isinstance(name, str):
        return None
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return name if name in architectures else None
    encoder = model_type in masked
    return name if not encoder or config.get("is_decoder") is True else None


#: The two tables of transformers' ``models/auto/modeling_auto.py`` the causal-LM rule reads.
_TABLES = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES")


@functools.lru_cache(maxsize=1)
def _auto_tables() -> tuple[dict[str, str], frozenset[str]] | None:
    """transformers' causal-LM mapping (model type -> class name) and the model types that have a masked-LM class;
    ``None`` without transformers.

    Read as data from transformers' own ``modeling_auto.py`` (two literal tables, parsed, nothing executed) rather
    than by importing it: the import brings torch and transformers' import structure of every model, 1.6-4 s at
    every ``serve`` start of a plain checkpoint, against 0.03 s. A module whose tables are not plain literals (another
    transformers) is imported instead. pinned by
    tests/test_server_models.py::test_the_causal_lm_rule_reads_the_tables_transformers_itself_holds
    """
    try:
        spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    source = os.path.join(os.path.dirname(spec.origin), "models", "auto", "modeling_auto.py")
    found: dict[str, dict[str, str]] = {}
    try:
        with open(source, encoding="utf-8") as file:
            tree = ast.parse(file.read(), source)
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
                if target in _TABLES and isinstance(value, ast.Call) and len(value.args) == 1:
                    found[target] = dict(ast.literal_eval(value.args[0]))
    except (OSError, SyntaxError, ValueError, TypeError):
        found = {}
    if set(found) != set(_TABLES):
        try:
            import transformers.models.auto.modeling_auto as imported
        except ImportError:
            return None
        found = {name: dict(getattr(imported, name)) for name in _TABLES}
    causal, masked = (found[name] for name in _TABLES)
    return causal, frozenset(masked)


def default_auto_class(model: str) -> str:
    """The auto class ``build`` and ``fetch`` use for checkpoint ``model`` when none is given:
    :data:`CAUSAL_AUTO_CLASS` for a causal LM (:func:`is_causal_lm`: the file ``serve`` generates with), else
    :data:`EMBEDDING_AUTO_CLASS`. Never raises: the loaders say what is wrong with a checkpoint this cannot read."""
    return CAUSAL_AUTO_CLASS if is_causal_lm(model) else EMBEDDING_AUTO_CLASS


def is_causal_lm(model: str | None) -> bool:
    """Whether ``serve`` generates with ``model`` (:func:`choose_loader` says ``causal``); a hub id is looked up in the
    local hub cache. A cache file answers from its record alone (what it was built as), without importing
    transformers. Never raises: anything unreadable is ``False``."""
    try:
        from ..bundle import is_cache_file, open_bundle
        from ..hub import is_local_path, resolve_model

        if model is not None and not is_local_path(model):
            model = os.fspath(resolve_model(model))
        if model is not None and is_cache_file(model):
            with open_bundle(model) as bundle:
                return _built_causal(bundle.record.loader, bundle.record.auto_class, bundle.has_file)
        return choose_loader(model) == "causal"
    except Exception:  # never raises: a model this cannot read is not one it serves as a causal LM
        return False


def _built_causal(loader: str, auto_class: str | None, has: Callable[[str], bool]) -> bool:
    """Whether a cache file holds a causal LM ``serve`` generates with: built by ``packcache.hf`` as
    :data:`CAUSAL_AUTO_CLASS`, and no sentence-transformers model (which embeds, whatever its backbone)."""
    return loader == "hf" and auto_class == CAUSAL_AUTO_CLASS and not has("modules.json")


def choose_loader(model: str | None) -> str:
    """Which loader ``serve`` loads ``model`` with, decided from its files alone (no weight read), by one rule for a
    checkpoint directory and for a cache file: the rule reads the directory's files, or the same files as the cache
    file embeds them (its model record says which loader and auto class built it), so a file is served exactly as
    the directory it was built from.

    - ``causal`` (:func:`packcache.server.llm.load_llm`: OpenAI's completions): a causal LM by
      :func:`causal_lm_class` that is no sentence-transformers save (no ``modules.json``); a cache file built with
      :data:`CAUSAL_AUTO_CLASS`.
    - ``minilm`` (the fast path, :mod:`packcache.models.minilm`) for the bundled model (``None``), a path to a
      safetensors file, a cache file of calibrated int4 packs (that loader's alone), and a model that
      sentence-transformers runs exactly as the MiniLM encoder does: ``config.json``'s ``model_type`` ``bert`` with
      ``hidden_act`` ``gelu``, absolute positions and no ``is_decoder``, one ``model.safetensors`` (a directory's:
      a file holds packs) and a ``tokenizer.json`` at the root; ``modules.json`` absent (a plain checkpoint: mean
      pooling) or the Transformer module at the root, mean pooling alone, then at most a Normalize; no prompt, no
      ``do_lower_case``; and the truncation the MiniLM loader computes (``sentence_bert_config.json``'s
      ``max_seq_length``, else the position limit) is sentence-transformers'. A checkpoint of that shape that is
      malformed is the MiniLM loader's to refuse.
    - ``hf`` for everything else: any model :func:`packcache.hf.sentence_transformer` loads.

    Raises:
        FormatError: a malformed ``config.json``, ``modules.json`` or module config, or a cache file that is not
            one. ValueError: a cache file that cannot serve what its directory serves: a causal LM's built without
            :data:`CAUSAL_AUTO_CLASS`, or a plain checkpoint's built with another auto class than
            :data:`EMBEDDING_AUTO_CLASS`. UntrustedFileError, OSError: a file cannot be read.
    """
    from ..bundle import is_cache_file, open_bundle

    if model is None:
        return "minilm"
    if is_cache_file(model):
        with open_bundle(model) as bundle:
            record = bundle.record
            if record.loader == "minilm":
                return "minilm"  # calibrated int4: this loader's alone
            if _built_causal(record.loader, record.auto_class, bundle.has_file):
                return "causal"

            def embedded(name: str) -> Any:
                return bundle.read_json(name) if bundle.has_file(name) else None

            return _loader_of(embedded, bundle.has_file, built=record.auto_class or EMBEDDING_AUTO_CLASS, where=model)
    if not os.path.isdir(model):
        return "minilm"  # a safetensors file, or nothing there: the MiniLM loader says what is wrong

    def read(name: str) -> Any:
        return _json_or_none(os.path.join(model, name))

    return _loader_of(read, lambda name: os.path.lexists(os.path.join(model, name)), built=None, where=model)


def _loader_of(read: Callable[[str], Any], has: Callable[[str], bool], *, built: str | None, where: str) -> str:
    """:func:`choose_loader`'s rule over a model's files, from a directory or a cache file alike: ``read(name)``
    parses one (``None``: absent), ``has(name)`` says whether it is there; ``built``: the auto class a cache file was
    built with (``None``: a directory, whose auto class the rule decides)."""
    if not has("modules.json"):  # a sentence-transformers save embeds, whatever its backbone
        causal = causal_lm_class(read("config.json"))
        if built is None and causal is not None:
            return "causal"
        if built is not None and causal is not None:
            raise ValueError(
                f"{where} holds a causal LM ({causal}) built with {built}, so it cannot generate, and serve generates "
                f"with a causal LM: build the file again from its checkpoint (packcache build DIR builds "
                f"{CAUSAL_AUTO_CLASS} for a causal LM)"
            )
        if built is not None and built != EMBEDDING_AUTO_CLASS:
            raise ValueError(
                f"{where} holds a model built with {built}, and serve embeds with {EMBEDDING_AUTO_CLASS} "
                "(sentence-transformers' class for a plain checkpoint): build the file without --auto-class"
            )
    return "minilm" if _minilm_shaped(read, has, weights=built is None) else "hf"


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
    if config.get("is_decoder") not in (None, False):
        return False  # nor a decoder's causal attention
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
