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
exactly as transformers' ``from_pretrained`` ties them for that checkpoint (:mod:`packcache._hf_model`): what the
config ties, unless the checkpoint holds both tensors of a pair with different values. A head tied
to the input embeddings comes from the tie's one source tensor: the head and the embedding read one pack of
it (one stored tensor: bf16, or int8 rows for int8 and int4); with fp32 both are the one float32 tensor.

Saving such a model (``save_pretrained``, ``SentenceTransformer.save``, ``state_dict``) writes a
complete float32 checkpoint that plain transformers and sentence-transformers load: each packed
layer's weight as the layer computes it (:meth:`~packcache.torch.PackedLinear.float_weight`), under
the source's names and layouts. ``load_state_dict`` into it raises ``RuntimeError`` (its tensors
are read-only). See ``docs/HF.md``, "Saving a packed model".

This module is the public face and the entry points: what ``path`` names (a checkpoint directory, a hub id, a
cache file, a published name), the sentence-transformers model and the tokenizer around a model. Reading a
checkpoint is :mod:`packcache._hf_checkpoint`'s (:class:`Checkpoint` is importable from here); assembling the
model from it, skeleton, ties and conversion, :mod:`packcache._hf_model`'s.

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

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers

from ._defaults import FETCH_DEADLINE, GROUP_SIZE, REMOTE_TIMEOUT
from ._hf_checkpoint import Checkpoint, _clip, _read_json, _short
from ._hf_model import TRANSPOSED_LINEARS, _cache_name, _load, _Loaded, pack_count
from ._paths import default_cache_dir
from .bundle import (
    ST_MODULE_PREFIX,
    ST_TRANSFORMER_REFS,
    TOKENIZER_FILES,
    Bundle,
    is_cache_file,
    open_bundle,
    transformer_folder,
)
from .cache import WeightCache
from .errors import FormatError
from .hub import model_argument, resolve_model
from .loader import resolve
from .packers import SCHEMES
from .torch import ConversionReport

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


def platform(scheme: str | None = None, group_size: int = GROUP_SIZE) -> dict[str, Any]:
    """The ``platform=`` mapping of a cache of ``scheme`` (``None``/``"auto"``: this machine's default):
    its packers' identities and fingerprints, the torch version and the CPU capability.
    :func:`from_pretrained` opens cache paths with it (:meth:`packcache.loader.Recipe.platform`)."""
    return resolve(scheme, group_size).platform()


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
    """What ``path`` names, by the one rule of every model argument (:func:`packcache.hub.model_argument`), as a local
    path and the fetch's report (``None`` unless fetched): a local path; without ``remote=``, an existing relative path
    no other user could have planted, or a hub id's snapshot directory in the local hub cache; with ``remote=``, a
    published name, fetched (:func:`packcache.fleet.names.fetch_name`) to its local cache file. ``options``: the
    remote keywords as given (``None``, ``()`` and ``False`` are "not given").

    Raises:
        ValueError: remote options with a local path or without ``remote=``, or a malformed name, hub id or URL.
        FileNotFoundError: no such model (nothing at a path, a hub id the local hub cache does not hold: one line
            naming where it looked).
        UntrustedFileError: a relative path another user could have planted, given without ``./``.
        RemoteError: the fetch failed.
    """
    options = {k: v for k, v in options.items() if v not in (None, (), [], False)}
    remote = options.get("remote")
    if remote is None and options:
        raise ValueError(f"{sorted(options)} given without remote=URL: they are for a published name's store")
    # pinned by tests/test_hub.py::test_a_directory_nobody_plants_never_stands_in_for_a_signed_name
    found = model_argument(path, remote=remote is not None)
    if found.kind != "name":
        if options:
            raise ValueError(
                f"{os.fspath(path)!r} is a local path: remote options are for a published name (for a cache that "
                "fetches on a miss, pass cache=WeightCache(path, remote=URL, ...))"
            )
        assert found.path is not None
        # pinned by tests/test_hub.py::test_a_hub_id_loads_from_the_local_hub_cache_offline
        return found.path, None
    assert remote is not None  # only a store makes a name a published one
    from .fleet.names import fetch_name  # here: a load from a local path imports nothing of the fleet layer

    report = fetch_name(
        remote, found.given, cache_dir=options.get("cache_dir"),
        trusted_keys=options.get("trusted_keys", ()), allow_unsigned=bool(options.get("allow_unsigned", False)),
        timeout=options.get("remote_timeout") or REMOTE_TIMEOUT,
        total_timeout=options.get("fetch_timeout") or FETCH_DEADLINE, scheme=scheme, group_size=group_size,
    )  # fmt: skip
    return report.path, report


#: Files a tokenizer may read: the tokenizer files, and the config (``AutoTokenizer`` reads the model type from it).
_TOKENIZER_FILES = frozenset({"config.json", *TOKENIZER_FILES})


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
        with _from_the_file(files, bundle.path):
            return transformers.AutoTokenizer.from_pretrained(os.path.join(files, folder), **kwargs)


@contextlib.contextmanager
def _from_the_file(directory: str, path: str) -> Iterator[None]:
    """Errors of a load from a cache file's files written out to ``directory`` name the file's entries instead
    (``FILE::2_Dense``): the directory is gone once the load ends, and what a load misses there the file lacks.

    Raises:
        FormatError: an error naming ``directory``, so named (from the error); any other error as it is.
    """
    # pinned by tests/test_bundle.py::test_build_of_a_file_loads_every_module_its_record_names
    try:
        yield
    except Exception as exc:
        text = str(exc)
        if directory not in text:
            raise
        named = " ".join(text.replace(directory + os.sep, f"{path}::").replace(directory, path).split())
        raise FormatError(f"cannot load the model it holds: {named[:600]}", path=path) from exc


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
    tokenizer and the packs; a plain checkpoint's file loads as its directory does (mean pooling, last-token
    pooling for a causal LM). sentence-transformers loads
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
            than torch, or a PEFT adapter; a cache file of a plain checkpoint built with another auto class than
            ``AutoModel``. FormatError: a cache file that lacks what a module needs (naming it as ``FILE::FOLDER``).
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
        record = bundle.record
        built = record.auto_class or "AutoModel"
        if record.sentence_transformers is None and built != "AutoModel":
            # a plain checkpoint: sentence-transformers embeds it with AutoModel, whose packs the file lacks
            raise ValueError(
                f"{os.fspath(path)} holds a {record.model_type} model built with {built}; sentence-transformers "
                "embeds a plain checkpoint with AutoModel: load it with packcache.hf.from_pretrained"
            )
        bundle.extract(files)
        with _from_the_file(files, bundle.path):
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
    classes: dict[str, type[Any]] = dict.fromkeys(ST_TRANSFORMER_REFS, PackedTransformer)
    try:
        if os.path.lexists(os.path.join(base, "modules.json")):
            if bundle is not None:
                classes = {**_module_classes(base), **classes}
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


def _module_classes(base: str) -> dict[str, type[Any]]:
    """sentence-transformers' own class of every module ``modules.json`` (in ``base``: a cache file's files written
    out) names besides the Transformer, each made to name its module when it cannot load: what that module's folder
    lacks, the cache file lacks."""
    from sentence_transformers.util.misc import import_from_string

    modules = _read_json(Path(base) / "modules.json", "modules.json")
    classes: dict[str, type[Any]] = {}
    for module in modules if isinstance(modules, list) else []:
        ref = module.get("type") if isinstance(module, dict) else None
        # only sentence-transformers' own classes: anything else was refused when the file was read (no remote code)
        if isinstance(ref, str) and ref.startswith(ST_MODULE_PREFIX) and ref not in ST_TRANSFORMER_REFS:
            classes.setdefault(ref, _naming_failures(import_from_string(ref), ref))
    return classes


def _naming_failures(module_class: type[Any], ref: str) -> type[Any]:
    """A subclass of ``module_class`` whose ``load`` (what sentence-transformers calls, with the same signature) names
    the module's folder when it fails; the module it loads is of ``module_class`` itself."""
    original = module_class.load

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            folder = kwargs.get("subfolder") or (os.path.basename(str(args[0])) if args else "")
            raise ValueError(f"module {folder!r} ({ref}): {_clip(exc)}") from exc

    return type(module_class.__name__, (module_class,), {"load": staticmethod(load), "__module__": __name__})


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
