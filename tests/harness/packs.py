"""Deterministic packs and the caches built from them: the bytes every test, harness and child agrees on.

``packed(seed, nbytes)`` gives the same bits in any process, so a child process
packs exactly what its parent expects, and "served the right bytes" is one
comparison. ``build()`` is the one way a test or a harness writes a valid cache
holding given packs (``build_keyed`` and ``load_all``: the regression tests' build
and full load, every pack under ``KEY``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from packcache import CacheStats, Session, WeightCache
from packcache._store import FileStore

KIB = 1024
MIB = 1024 * KIB

Spec = dict[str, tuple[int, int]]  # name -> (seed, nbytes) of packed()
Request = tuple[str, int, int, dict[str, int]]  # name, seed, nbytes, key: one get_or_pack of packed(seed, nbytes)
Pack = np.ndarray[Any, Any] | tuple[int, int]  # an array, or the (seed, nbytes) of packed()


def packed(seed: int, nbytes: int = 4 * KIB) -> np.ndarray[Any, Any]:
    """A deterministic float32 pack of ``nbytes`` bytes: same seed, same bits, in any process."""
    rng = np.random.default_rng(seed)
    count = nbytes // 4
    cols = 16 if count % 16 == 0 else 1
    return rng.standard_normal(count, dtype=np.float32).reshape(count // cols, cols)


def same_pack(served: np.ndarray[Any, Any], seed: int, nbytes: int) -> bool:
    """Whether ``served`` is bit-identical to ``packed(seed, nbytes)``: dtype, shape and every byte."""
    fresh = packed(seed, nbytes)
    return served.dtype == fresh.dtype and served.shape == fresh.shape and served.tobytes() == fresh.tobytes()


class Packer:
    """Pack functions that count their calls, so a test can tell a hit (not called) from a pack."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, name: str, seed: int, nbytes: int = 4 * KIB) -> Callable[[], np.ndarray[Any, Any]]:
        def pack() -> np.ndarray[Any, Any]:
            self.calls[name] = self.calls.get(name, 0) + 1
            return packed(seed, nbytes)

        return pack


def assert_same(served: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> None:
    """Bit-identical: dtype, shape and every byte."""
    assert served.dtype == expected.dtype
    assert served.shape == expected.shape
    assert served.tobytes() == expected.tobytes()


def request_all(session: Session, requests: Iterable[Request]) -> dict[str, np.ndarray[Any, Any]]:
    """Request every ``(name, seed, nbytes, key)`` in ``session`` (a miss packs ``packed(seed, nbytes)``).

    Returns the served arrays by name.
    """
    return {
        name: session.get_or_pack(name, functools.partial(packed, seed, nbytes), key=key)
        for name, seed, nbytes, key in requests
    }


def _array(pack: Pack) -> np.ndarray[Any, Any]:
    return packed(*pack) if isinstance(pack, tuple) else pack


def build(path: str | os.PathLike[str], packs: Mapping[str, Pack], *, key: Any = None, **options: Any) -> CacheStats:
    """Write a valid cache at ``path`` holding ``packs``: one session of a new ``WeightCache(path, **options)``.

    Each pack is an array, or the ``(seed, nbytes)`` of ``packed()``; every one is
    requested under ``key``. On an existing valid file the packs it already holds
    are hits and the rest are appended as a new generation. Every pack must end up
    in the file (stored or a hit, none on heap); returns the instance's statistics,
    so a caller can insist on more (``build(...).stored == len(packs)``).
    """
    with WeightCache(path, **options) as cache:
        with cache.session() as s:
            for name, pack in packs.items():
                s.get_or_pack(name, functools.partial(_array, pack), key=key)
        stats = cache.stats()
    assert (stats.hits + stats.stored, stats.heap_packs) == (len(packs), 0), f"build {path}: {stats}"
    return stats


#: The key the regression tests store and ask for their packs under (``build_keyed``, ``load_all``).
KEY = {"packer": "test", "version": 1}


def build_keyed(path: str | os.PathLike[str], names: dict[str, int]) -> None:
    """A valid cache holding ``packed(seed, 4 KiB)`` per name under ``KEY``, as ``load_all`` requests them."""
    build(path, {name: (seed, 4 * KIB) for name, seed in names.items()}, key=KEY)


def load_all(path: str | os.PathLike[str], names: dict[str, int], nbytes: int = 4 * KIB) -> CacheStats:
    """A fresh instance requests every pack; each must be bit-identical to pack()."""
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name, seed in names.items():
                assert_same(s.get_or_pack(name, functools.partial(packed, seed, nbytes), KEY), packed(seed, nbytes))
        return cache.stats()


@contextlib.contextmanager
def without_build_compaction() -> Iterator[None]:
    """Builds in the block leave superseded bytes in place, as packcache did before a build compacted a
    file whose superseded bytes outweigh the live ones: the files it left, which ``compact``,
    ``inspect`` and ``run``'s warning must still handle."""
    original = FileStore.compact_if_superseded
    FileStore.compact_if_superseded = lambda self: 0  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileStore.compact_if_superseded = original  # type: ignore[method-assign]


def build_generations(path: str | os.PathLike[str], generations: list[list[Request]]) -> None:
    """Write a valid cache holding ``generations``: one ``build()`` (one commit) each, every pack stored.

    A generation's requests share one key (a build has one): the templates of the
    crash harnesses, whose next commit must overwrite a used slot.
    """
    for requests in generations:
        keys = [key for *_, key in requests]
        assert all(k == keys[0] for k in keys), f"one key per generation: {keys}"
        stats = build(path, {name: (seed, nbytes) for name, seed, nbytes, _ in requests}, key=keys[0])
        assert stats.stored == len(requests), f"template {path}: stored {stats.stored} of {len(requests)}"


@contextlib.contextmanager
def stuck_in_pack(cache: WeightCache, name: str = "slow", timeout: float = 10.0) -> Iterator[threading.Thread]:
    """A thread whose session of ``cache`` sits inside ``pack()`` of ``name`` for the whole block.

    Yields the thread once its ``pack()`` has started; on exit the pack returns
    (``np.ones(8)``) and the thread is joined.
    """
    inside, release = threading.Event(), threading.Event()

    def slow() -> np.ndarray[Any, Any]:
        inside.set()
        assert release.wait(timeout)
        return np.ones(8)

    def load() -> None:
        with cache.session() as s:
            s.get_or_pack(name, slow)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert inside.wait(timeout)
        yield thread
    finally:
        release.set()
        thread.join(timeout)
