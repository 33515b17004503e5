"""Session.get_many (one pass over the committed packs of a layer or a model) and PackKey (``packcache.cache``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import committed, flip_bit
from packcache import HeapReason, PackKey, SessionError, WeightCache
from packcache import format as fmt

KEY = PackKey({"packer": "copy", "version": 1})


def arrays(count: int = 40) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(3)
    shapes = [(7,), (3, 5), (2, 3, 4), (), (0, 4)]
    return {
        f"layers.{i}.weight": rng.standard_normal(shapes[i % len(shapes)]).astype(np.float32 if i % 2 else np.int16)
        for i in range(count)
    }


def requests(packs: dict[str, np.ndarray[Any, Any]], key: Any = KEY, calls: list[str] | None = None) -> list[Any]:
    def pack(name: str, a: np.ndarray[Any, Any]) -> Any:
        def make() -> np.ndarray[Any, Any]:
            if calls is not None:
                calls.append(name)
            return a.copy()

        return make

    return [(name, pack(name, a), key) for name, a in packs.items()]


def built(path: Path, packs: dict[str, np.ndarray[Any, Any]]) -> None:
    with WeightCache(path) as cache, cache.session() as s:
        s.get_many(requests(packs))
        assert cache.stats().stored == len(packs)


def test_a_warm_batch_is_served_from_the_file_in_order_without_packing(tmp_path: Path) -> None:
    packs = arrays()
    built(tmp_path / "m.pcache", packs)
    calls: list[str] = []
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            served = s.get_many(requests(packs, calls=calls))
        stats = cache.stats()
        assert calls == []
        assert (stats.state, stats.hits, stats.stored, stats.heap_bytes) == ("mapped", len(packs), 0, 0)
        assert stats.mapped_bytes == sum(a.nbytes for a in packs.values())
        for (name, a), got in zip(packs.items(), served, strict=True):
            assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a), name
            assert not got.flags.writeable
            if got.size:
                with pytest.raises(ValueError, match="WRITEABLE"):
                    got.flags.writeable = True  # the buffer itself is read-only: a mapping of the file


def test_get_many_and_get_or_pack_serve_the_same_bytes_and_count_alike(tmp_path: Path) -> None:
    packs = arrays()
    built(tmp_path / "m.pcache", packs)
    with WeightCache(tmp_path / "m.pcache") as one, WeightCache(tmp_path / "m.pcache") as many:
        with one.session() as s:
            singly = [s.get_or_pack(name, lambda: np.zeros(1), KEY) for name in packs]
        with many.session() as s:
            batch = s.get_many(requests(packs))
        a, b = one.stats(), many.stats()
        assert (a.hits, a.mapped_bytes, a.mapped_bytes_total) == (b.hits, b.mapped_bytes, b.mapped_bytes_total)
        for x, y in zip(singly, batch, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def test_misses_in_a_batch_are_packed_and_stored_around_the_hits(tmp_path: Path) -> None:
    packs = arrays(20)
    built(tmp_path / "m.pcache", dict(list(packs.items())[::2]))  # every other pack
    calls: list[str] = []
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            served = s.get_many(requests(packs, calls=calls))
        stats = cache.stats()
    assert calls == list(packs)[1::2]
    assert (stats.hits, stats.stored) == (10, 10)
    for a, got in zip(packs.values(), served, strict=True):
        assert np.array_equal(got, a)


def test_another_key_is_a_miss_and_replaces_the_pack(tmp_path: Path) -> None:
    packs = arrays(20)
    built(tmp_path / "m.pcache", packs)
    calls: list[str] = []
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            s.get_many(requests(packs, key={"packer": "copy", "version": 2}, calls=calls))
        assert calls == list(packs)
        assert (cache.stats().hits, cache.stats().stored) == (0, 20)


def test_a_name_asked_twice_is_one_pack_served_and_counted_once(tmp_path: Path) -> None:
    packs = arrays(20)
    built(tmp_path / "m.pcache", packs)
    name = next(iter(packs))
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            served = s.get_many([*requests(packs), (name, lambda: np.zeros(1), KEY)])
        assert served[0] is served[-1]
        assert cache.stats().hits == 20 and cache.stats().mapped_bytes == sum(a.nbytes for a in packs.values())


def test_a_second_session_serves_what_the_cache_holds_already(tmp_path: Path) -> None:
    packs = arrays(20)
    built(tmp_path / "m.pcache", packs)
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            first = s.get_many(requests(packs))
        with cache.session() as s:
            again = s.get_many(requests(packs))
        assert all(x is y for x, y in zip(first, again, strict=True))
        assert cache.stats().hits == 20


def test_with_verify_a_corrupt_pack_in_a_batch_is_packed_again(tmp_path: Path) -> None:
    packs = {name: a for name, a in arrays(20).items() if a.size}
    path = tmp_path / "m.pcache"
    built(path, packs)
    victim = next(iter(packs))
    flip_bit(path, committed(path)[1][victim].offset)
    calls: list[str] = []
    with WeightCache(path, verify=True) as cache:
        with cache.session() as s:
            served = s.get_many(requests(packs, calls=calls))
        assert calls == [victim]
        assert np.array_equal(served[0], packs[victim])
        assert cache.stats().hits == len(packs) - 1


def test_caching_off_and_unnamed_requests_go_to_heap_with_their_reason(tmp_path: Path) -> None:
    packs = arrays(4)
    with WeightCache(None) as cache, cache.session() as s:
        s.get_many(requests(packs))
        assert cache.stats().heap_bytes_by_reason[HeapReason.DISABLED.value] == sum(a.nbytes for a in packs.values())
    with WeightCache(tmp_path / "m.pcache") as cache, cache.session() as s:
        out = s.get_many([(None, lambda: np.ones(3), KEY)])
        assert np.array_equal(out[0], np.ones(3))
        assert cache.stats().heap_bytes_by_reason[HeapReason.UNNAMED.value] == out[0].nbytes


def test_a_bad_request_raises_before_anything_is_served(tmp_path: Path) -> None:
    packs = arrays(20)
    built(tmp_path / "m.pcache", packs)
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            for bad, error in (
                ((b"bytes", lambda: np.ones(1), KEY), TypeError),
                (("", lambda: np.ones(1), KEY), TypeError),
                (("w" * 1025, lambda: np.ones(1), KEY), ValueError),
                (("w", lambda: np.ones(1), {"x": float("nan")}), TypeError),
                (("w", lambda: np.ones(1), {"x": "a" * fmt.MAX_KEY_BYTES}), ValueError),
            ):
                with pytest.raises(error):
                    s.get_many([*requests(packs), bad])
            assert cache.stats().hits == 0
        with pytest.raises(SessionError, match="outside an active session"):
            s.get_many(requests(packs))


def test_a_pack_key_is_the_canonical_json_of_its_mapping(tmp_path: Path) -> None:
    mapping = {"source": {"shape": [2, 3], "name": "w"}, "packer": "naïve", "version": 1}
    key = PackKey(mapping)
    assert key.canonical == fmt.canonical_key(mapping)
    assert key == PackKey(dict(reversed(mapping.items()))) and hash(key) == hash(PackKey(mapping))
    assert key != PackKey({"packer": "naïve", "version": 2}) and key != mapping
    assert PackKey.from_canonical(key.canonical) == key and "PackKey(" in repr(key)
    with pytest.raises(TypeError):
        PackKey.from_canonical("{}")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most"):
        PackKey.from_canonical(b"x" * (fmt.MAX_KEY_BYTES + 1))
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        PackKey({"x": object()})
    with WeightCache(tmp_path / "m.pcache") as cache, cache.session() as s:  # a mapping and its PackKey: one pack
        s.get_or_pack("w", lambda: np.ones(3), mapping)
    with WeightCache(tmp_path / "m.pcache") as cache:
        with cache.session() as s:
            assert np.array_equal(s.get_or_pack("w", lambda: np.zeros(3), key), np.ones(3))
        assert cache.stats().hits == 1
