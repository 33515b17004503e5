"""What every model loader does before it converts a model: scheme -> packers -> platform -> the cache.

:mod:`packcache.hf`, :mod:`packcache.models.minilm`, the ``packcache`` command and ``packcache serve``
all take it from here, so they cannot disagree (on the default scheme, say):

1. :func:`resolve_scheme`: a scheme name, or ``None``/``"auto"`` (the default,
   :data:`packcache._defaults.SCHEME`) for the one fast on this CPU (:func:`packcache.native.default_scheme`).
   A cache file named after its scheme is named after this resolved scheme, never ``auto``.
2. :func:`resolve`: the :class:`Recipe` of a scheme: the packer of its linear layers (:func:`scheme_packer`),
   of its embedding tables (:data:`EMBEDDING_PACKERS`: the scheme's form, ``None`` for fp32) and of every other
   parameter (float32), the int4 group size, and the cache's ``platform=`` mapping.
3. :func:`open_cache`: the :class:`~packcache.WeightCache` a load uses, from what the caller gave as ``cache=``:
   ``None`` (the default) is the content-named file in the default cache directory, ``False`` is caching off.

Imports torch (the packers' kernels); ``import packcache`` does not import this module.

>>> recipe = resolve("int4", 64)
>>> recipe.scheme, recipe.group_size, recipe.linear.params["group_size"], recipe.embedding.id, recipe.other.id
('int4', 64, 64, 'torch.int8wo', 'np.f32')
>>> resolve().scheme == resolve_scheme("auto") == resolve_scheme(None)
True
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _defaults
from . import format as fmt
from ._paths import default_cache_dir
from .bundle import Bundle, is_cache_file
from .cache import WeightCache
from .native import default_scheme
from .packers import SCHEMES, Float32, Packer, platform_for
from .packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32, TorchPacker

__all__ = [
    "EMBEDDING_PACKERS", "Recipe", "cache_for", "open_cache", "open_model_file", "resolve", "resolve_scheme",
    "scheme_packer",
]  # fmt: skip


def resolve_scheme(scheme: str | None = None) -> str:
    """The scheme a load packs with: ``scheme`` itself (one of :data:`packcache.packers.SCHEMES`), or for
    ``None`` and ``"auto"`` the one fast on this machine: ``int8`` where packcache's compiled kernels run, else
    ``fp32`` (:func:`packcache.native.default_scheme`).

    >>> resolve_scheme("bf16"), resolve_scheme() in SCHEMES
    ('bf16', True)

    Raises:
        ValueError: a name that is not a scheme nor ``auto``.
    """
    if scheme is None:
        scheme = _defaults.SCHEME
    if scheme == "auto":
        return default_scheme()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}, or auto")
    return scheme


def scheme_packer(scheme: str | None, group_size: int = _defaults.GROUP_SIZE) -> TorchPacker:
    """The linear packer of a scheme (:func:`resolve_scheme`'s names): ``fp32``, ``bf16``, ``int8``
    or ``int4`` (with ``group_size`` input features per scale; ignored by the others).

    >>> scheme_packer("int4", 64).params["group_size"]
    64
    >>> tuple(_SCHEME_PACKERS) == SCHEMES
    True

    Raises:
        ValueError: an unknown scheme, or an int4 group size that is not one of 32, 64, 128.
    """
    return _SCHEME_PACKERS[resolve_scheme(scheme)](group_size)


#: Scheme name -> its packer, given the int4 group size.
_SCHEME_PACKERS: Mapping[str, Callable[[int], TorchPacker]] = {
    "fp32": lambda _: LinearFloat32(),
    "bf16": lambda _: LinearBFloat16(),
    "int8": lambda _: Int8WeightOnly(),
    "int4": Int4WeightOnly,
}


#: Scheme name -> the packer of its embedding tables (``nn.Embedding`` weights), or ``None``: float32, as every
#: other parameter. bf16 stores them as bf16; int8 and int4 as int8 rows with a scale per block of 32, which *is*
#: the int8 linear layers' pack (:class:`~packcache.packers_torch.Int8WeightOnly`), so a head tied to the embeddings
#: is packed once and both read that one pack (int4 too: its tied head runs the int8 kernel, ``docs/TORCH.md``).
EMBEDDING_PACKERS: Mapping[str, Callable[[], TorchPacker] | None] = {
    "fp32": None,
    "bf16": LinearBFloat16,
    "int8": Int8WeightOnly,
    "int4": Int8WeightOnly,
}


@dataclass(frozen=True)
class Recipe:
    """A resolved scheme and the packers a model loader packs with: :attr:`linear` for the linear
    layers, :attr:`embedding` for the embedding tables (``None``: float32, like the rest) and
    :attr:`other` (float32) for every other parameter. Make it with :func:`resolve`."""

    scheme: str
    group_size: int
    linear: TorchPacker
    other: Packer
    embedding: TorchPacker | None = None

    @property
    def packers(self) -> tuple[Packer, ...]:
        """The packer of each role, ``(linear, embedding, other)`` (``(linear, other)`` without an embedding
        packer): what a cache file of this recipe holds packs of (its name counts them)."""
        if self.embedding is None:
            return self.linear, self.other
        return self.linear, self.embedding, self.other

    def platform(self) -> dict[str, Any]:
        """The ``platform=`` mapping of a cache of this recipe: its packers' identities and fingerprints,
        the torch version and the CPU capability (:func:`packcache.packers.platform_for`), and with an
        embedding packer, which packer that is (``"embeddings"``: its id, version and params), since
        the int8 scheme packs its linear layers and its embeddings with one packer."""
        mapping = platform_for(self.packers)
        if self.embedding is not None:
            embedding = self.embedding
            mapping["embeddings"] = {"id": embedding.id, "version": embedding.version, "params": embedding.params}
        return mapping

    def remedy(self, module: str) -> str:
        """What to tell the caller who passed a ``WeightCache`` made for another platform: the
        ``platform`` function of ``module`` (the loader's public module) that makes the right one."""
        return f"make it with WeightCache(path, platform={module}.platform({self.scheme!r}, {self.group_size}))"


def resolve(scheme: str | None = None, group_size: int = _defaults.GROUP_SIZE) -> Recipe:
    """The :class:`Recipe` of ``scheme`` (``None``/``"auto"``: this machine's, :func:`resolve_scheme`).

    Raises:
        ValueError: an unknown scheme, or an int4 group size that is not one of 32, 64, 128.
    """
    name = resolve_scheme(scheme)
    embedding = EMBEDDING_PACKERS[name]
    return Recipe(
        name, group_size, _SCHEME_PACKERS[name](group_size), Float32(), embedding() if embedding is not None else None
    )


def cache_for(
    path: str | None,
    platform: Mapping[str, Any],
    *,
    remote: Any = None,
    remote_timeout: float = _defaults.REMOTE_TIMEOUT,
    trusted_keys: Any = (),
    allow_unsigned: bool = False,
) -> WeightCache | str | bool:
    """What a loader's ``cache=`` gets for the cache file a command or a server worker chose: ``False`` for none
    (caching off: ``None`` would be the loader's default file), the path itself, or with ``remote`` a
    :class:`~packcache.WeightCache` that fetches on a miss, made with the loader's own ``platform`` mapping as the
    loader would make it. The caller passes ``remote=None`` for a cache file that is itself the model."""
    if path is None:
        return False
    if remote is None:
        return path
    return WeightCache(
        path, platform=platform, remote=remote, remote_timeout=remote_timeout, trusted_keys=trusted_keys,
        allow_unsigned=allow_unsigned,
    )  # fmt: skip


def open_cache(
    cache: WeightCache | str | os.PathLike[str] | bool | None,
    platform: Mapping[str, Any],
    *,
    remedy: str,
    suggested_name: Callable[[], str],
) -> tuple[WeightCache, bool]:
    """The :class:`~packcache.WeightCache` a model loader uses, and whether the loader opened it (and closes it).

    ``cache`` is ``None`` (the default, as transformers' ``cache_dir=None`` is; ``True`` says the same): the
    content-named file ``suggested_name()`` in :func:`packcache._paths.default_cache_dir` (``$PACKCACHE_DIR``,
    else ``$XDG_CACHE_HOME/packcache``), the file the CLI opens; ``False`` (caching off: packed to heap, state
    ``off``); a path to a cache *file* (opened with ``platform``); or a ``WeightCache`` (which must have been
    made with ``platform``: packs of other packers would be refused at every launch).

    A directory at a path named like a cache file (``*.pcache``, as every default name is) is a cache
    problem, not a mistake of argument: it is what a container runtime leaves when it bind-mounts a
    host path that did not exist. The cache then counts it (``open_failed``, ``EISDIR``) and the
    model loads from heap, like any file that cannot be opened. A directory under any other name
    was meant as the place to put the file: that raises, naming the file to give.

    Raises:
        ValueError: the path is a directory not named ``*.pcache`` (the message suggests the file
            ``suggested_name()`` names in it: the loader's default name), or the ``WeightCache``
            was made with another platform mapping (the message says ``remedy``).
    """
    # pinned by tests/test_defaults_loaders.py::test_cache_none_is_the_content_named_file_and_false_is_off
    if cache is False:
        return WeightCache(None), True
    if cache is None or cache is True:
        cache = os.path.join(default_cache_dir(), suggested_name())
    if isinstance(cache, WeightCache):
        if cache.path is not None and cache.platform != fmt.canonical_key(platform):
            raise ValueError(f"the WeightCache for {cache.path} was made with another platform mapping; {remedy}")
        return cache, False
    # ".pcache": how every default name ends (packcache.identity.model_cache_name).
    # pinned by tests/test_torch.py::test_the_loaders_take_any_kind_of_file_at_a_cache_file_path
    if os.path.isdir(cache) and not is_cache_file(cache):
        raise ValueError(
            f"cache {os.fspath(cache)!r} is a directory; give a file path such as "
            f"{os.path.join(os.fspath(cache), suggested_name())!r}"
        )
    return WeightCache(cache, platform=platform), True


def open_model_file(
    bundle: Bundle, cache: object, scheme: str | None, group_size: int | None
) -> tuple[Recipe, WeightCache]:
    """The recipe a cache file that holds its model (:func:`packcache.bundle.open_bundle`) was built with, and the
    cache that maps it: read-only (a load never changes the file it runs from), opened once its platform is checked
    to be this machine's. A file another machine packs differently is refused, naming what differs, never rebuilt:
    with no checkpoint there is nothing to rebuild it from.

    Raises:
        ValueError: ``cache`` given (the file is its own cache: ``None`` or its own path only), a scheme or group
            size other than the file's, or a file packed for another platform.
    """
    record = bundle.record
    if cache is not None and not (isinstance(cache, (str, os.PathLike)) and _same_file(cache, bundle)):
        raise ValueError(f"{bundle.path} is a cache file: it is its own cache, so pass cache=None")
    if scheme not in (None, "auto", record.scheme) or group_size not in (None, record.group_size):
        raise ValueError(
            f"{bundle.path} holds the {record.scheme} scheme (group size {record.group_size}); "
            f"it cannot be loaded as {scheme} (group size {group_size})"
        )
    recipe = resolve(record.scheme, record.group_size)
    here = fmt.canonical_key(recipe.platform())
    if bundle.platform != here:
        from .fleet.platform import differences  # only to word the refusal: a local load imports no fleet module

        found = differences(bundle.platform, here)
        shown = "; ".join(f"{d.field}: file {d.file!r}, here {d.here!r}" for d in found[:4]) or "the fingerprint"
        raise ValueError(
            f"{bundle.path} was packed for another platform ({shown}): this machine would pack those weights "
            "differently; fetch or build the file of this machine's platform class (`packcache platform`)"
        )
    return recipe, WeightCache(bundle.path, platform=recipe.platform(), read_only=True)


def _same_file(path: str | os.PathLike[str], bundle: Bundle) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == bundle.identity
