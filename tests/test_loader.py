"""``packcache.loader``: scheme -> packers -> platform -> the cache, the steps every model loader shares.

Real packers, real files, no mocks: the platform of each scheme is compared with what its packers
describe, and each kind of ``cache=`` argument is opened for real.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

import packcache.torch
from packcache import WeightCache, _defaults, loader
from packcache.format import canonical_key
from packcache.native import default_scheme
from packcache.packers import SCHEMES, Float32, platform_for
from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_scheme_name_resolves_to_itself(scheme: str) -> None:
    assert loader.resolve_scheme(scheme) == scheme


@pytest.mark.parametrize("given", [None, "auto"])
def test_none_and_auto_resolve_to_the_scheme_fast_on_this_machine(given: str | None) -> None:
    assert loader.resolve_scheme(given) == default_scheme()
    assert loader.resolve(given).scheme == default_scheme()
    assert default_scheme() in SCHEMES


@pytest.mark.parametrize("bad", ["int3", "", "AUTO", "Int8", "fp16"])
def test_an_unknown_scheme_is_a_value_error_naming_the_schemes(bad: str) -> None:
    for call in (loader.resolve_scheme, loader.resolve, loader.scheme_packer):
        with pytest.raises(ValueError, match=f"unknown scheme {bad!r}: expected one of {', '.join(SCHEMES)}, or auto"):
            call(bad)


@pytest.mark.parametrize("group_size", [0, 16, 33, 48, 256])
def test_an_int4_group_size_that_is_not_offered_is_a_value_error(group_size: int) -> None:
    with pytest.raises(ValueError, match=f"group_size must be one of \\(32, 64, 128\\), got {group_size}"):
        loader.resolve("int4", group_size)
    with pytest.raises(ValueError, match="group_size must be one of"):
        loader.scheme_packer("int4", group_size)


def test_the_other_schemes_ignore_the_group_size() -> None:
    for scheme in ("fp32", "bf16", "int8"):
        assert loader.resolve(scheme, 48).platform() == loader.resolve(scheme).platform()


@pytest.mark.parametrize(
    ("scheme", "packer"),
    [("fp32", LinearFloat32), ("bf16", LinearBFloat16), ("int8", Int8WeightOnly), ("int4", Int4WeightOnly)],
)
def test_each_scheme_packs_its_linear_layers_with_its_packer_and_the_rest_as_float32(scheme: str, packer: type) -> None:
    recipe = loader.resolve(scheme)
    assert type(recipe.linear) is packer and type(recipe.other) is Float32
    # Issue 32: embedding tables in the scheme's form (bf16; int8 rows with per-row scales for int8 and int4).
    embedding = {"fp32": None, "bf16": LinearBFloat16, "int8": Int8WeightOnly, "int4": Int8WeightOnly}[scheme]
    assert (type(recipe.embedding) if recipe.embedding is not None else None) is embedding
    expected = (recipe.linear, recipe.other) if embedding is None else (recipe.linear, recipe.embedding, recipe.other)
    assert recipe.packers == expected
    assert (recipe.scheme, recipe.group_size) == (scheme, _defaults.GROUP_SIZE)
    assert type(loader.scheme_packer(scheme)) is packer


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_platform_of_each_scheme_lists_its_packers_and_which_packs_the_embeddings(scheme: str) -> None:
    recipe = loader.resolve(scheme)
    platform = recipe.platform()
    embeddings = platform.pop("embeddings", None)
    assert platform == platform_for(recipe.packers)
    ids = sorted(p["id"] for p in platform["packers"])
    assert ids == sorted({p.id for p in recipe.packers})
    # int8 packs its linear layers and its embeddings with one packer: the platform says which role is which.
    assert embeddings == (
        None
        if recipe.embedding is None
        else {"id": recipe.embedding.id, "version": recipe.embedding.version, "params": {}}
    )
    assert (embeddings is None) == (scheme == "fp32")
    assert all("fingerprint" in p for p in platform["packers"]), "a behavioural fingerprint of every packer"


def test_the_four_schemes_have_four_platforms_and_int4_one_per_group_size() -> None:
    keys = {canonical_key(loader.resolve(scheme).platform()) for scheme in SCHEMES}
    assert len(keys) == len(SCHEMES)
    by_group = {g: loader.resolve("int4", g).platform() for g in _defaults.GROUP_SIZES}
    assert len({canonical_key(p) for p in by_group.values()}) == len(_defaults.GROUP_SIZES)
    for group_size, platform in by_group.items():
        int4 = next(p for p in platform["packers"] if p["id"] == Int4WeightOnly.id)
        assert int4["params"]["group_size"] == group_size


def test_the_loaders_platform_functions_are_the_loaders() -> None:
    from packcache import hf
    from packcache.models import minilm

    for scheme in SCHEMES:
        assert hf.platform(scheme) == minilm.platform(scheme) == loader.resolve(scheme).platform()
    assert hf.platform("int4", 128) == minilm.platform("int4", 128) == loader.resolve("int4", 128).platform()
    assert minilm.default_scheme() == loader.resolve_scheme(None)


def test_the_torch_adapter_offers_the_loaders_functions_themselves() -> None:
    assert packcache.torch.open_cache is loader.open_cache
    assert packcache.torch.scheme_packer is loader.scheme_packer
    assert {"open_cache", "scheme_packer"} <= set(packcache.torch.__all__)


def test_the_remedy_names_the_platform_function_to_call() -> None:
    assert loader.resolve("int4", 64).remedy("packcache.hf") == (
        "make it with WeightCache(path, platform=packcache.hf.platform('int4', 64))"
    )


# --------------------------------------------------------------------------- open_cache

PLATFORM = loader.resolve("int8").platform()


def _open(cache: WeightCache | str | os.PathLike[str] | bool | None) -> tuple[WeightCache, bool]:
    return loader.open_cache(cache, PLATFORM, remedy="make it right", suggested_name=lambda: "model-int8.pcache")


def _store_one(cache: WeightCache) -> np.ndarray:
    with cache.session() as s:
        return s.get_or_pack("w", lambda: np.arange(16, dtype=np.float32))


def test_cache_false_is_caching_off_and_the_loaders_to_close() -> None:
    cache, opened = _open(False)
    try:
        assert opened and cache.path is None
        _store_one(cache)
        assert cache.stats().state == "off"
    finally:
        cache.close()


def test_cache_none_is_the_suggested_file_in_the_default_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As transformers' ``cache_dir=None``: the default, not off (``$PACKCACHE_DIR``, the file the loader names)."""
    monkeypatch.setenv("PACKCACHE_DIR", str(tmp_path / "caches"))
    cache, opened = _open(None)
    try:
        assert opened and cache.path == str(tmp_path / "caches" / "model-int8.pcache")
        _store_one(cache)
        assert cache.stats().state == "stored"
    finally:
        cache.close()


@pytest.mark.parametrize("kind", [str, Path])
def test_a_path_is_opened_with_the_platform_and_the_loaders_to_close(tmp_path: Path, kind: type) -> None:
    path = tmp_path / "sub" / "model.pcache"
    cache, opened = _open(kind(path))
    try:
        assert opened and cache.path == str(path) and cache.platform == canonical_key(PLATFORM)
        _store_one(cache)
        assert cache.stats().state == "stored"
    finally:
        cache.close()
    again = WeightCache(path, platform=PLATFORM)  # the same platform maps what was stored
    try:
        _store_one(again)
        assert again.stats().hits == 1
    finally:
        again.close()


def test_a_weight_cache_made_with_the_platform_is_used_as_it_is_and_left_open(tmp_path: Path) -> None:
    mine = WeightCache(tmp_path / "model.pcache", platform=PLATFORM)
    try:
        cache, opened = _open(mine)
        assert cache is mine and not opened
    finally:
        mine.close()


def test_a_weight_cache_made_for_another_platform_is_a_value_error_saying_the_remedy(tmp_path: Path) -> None:
    other = WeightCache(tmp_path / "model.pcache", platform=loader.resolve("fp32").platform())
    try:
        with pytest.raises(ValueError, match="made with another platform mapping; make it right"):
            _open(other)
    finally:
        other.close()
    off = WeightCache(None)  # caching off holds no pack of any platform: nothing to refuse
    assert _open(off) == (off, False)


def test_a_directory_is_a_value_error_suggesting_the_file_in_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory; give a file path such as") as raised:
        _open(tmp_path)
    assert repr(str(tmp_path / "model-int8.pcache")) in str(raised.value)


def test_a_directory_named_like_a_cache_file_is_a_cache_problem_counted_with_eisdir(tmp_path: Path) -> None:
    mount = tmp_path / "model.pcache"
    mount.mkdir()  # what a bind mount of a missing host path leaves
    cache, opened = _open(mount)
    try:
        assert opened
        served = _store_one(cache)
        stats = cache.stats()
        assert np.array_equal(served, np.arange(16, dtype=np.float32))
        assert (stats.state, stats.heap_reason, stats.errno) == ("heap", "open_failed", errno.EISDIR)
    finally:
        cache.close()
