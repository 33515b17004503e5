"""Bounded JSON parsing of untrusted bytes: safetensors headers, pack keys, platform fingerprints."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packcache import _boundedjson as boundedjson
from packcache.errors import FormatError

# Strings full of what confuses a bracket counter: brackets, quotes, backslashes, escapes.
TRICKY_TEXT = st.text(alphabet=st.sampled_from('[]{}"\\/:,ab\x00\u00e9\U0001f600'), max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY_TEXT, inner, max_size=3),
    max_leaves=30,
)


# Generating nested JSON is slow on a loaded machine; slowness is not what these tests are about.
RELAXED = [HealthCheck.too_slow]


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None, suppress_health_check=RELAXED)
@given(value=JSON_VALUES, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 1]))
def test_nesting_depth_is_exact_on_any_json_text(value: Any, ensure_ascii: bool, indent: int | None) -> None:
    data = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent).encode("utf-8", "surrogatepass")
    assert boundedjson.nesting_depth(data, 1000)[0] == depth_of(value)


@settings(max_examples=150, deadline=None, suppress_health_check=RELAXED)
@given(value=JSON_VALUES, chunk=st.integers(1, 5))
def test_nesting_depth_carries_its_state_across_chunk_boundaries(value: Any, chunk: int) -> None:
    """With chunks of a few bytes every string, escape and bracket run straddles a boundary somewhere."""
    data = json.dumps(value).encode()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(boundedjson, "_CHUNK", chunk)
        assert boundedjson.nesting_depth(data, 1000)[0] == depth_of(value)


@settings(max_examples=150, deadline=None, suppress_health_check=RELAXED)
@given(value=JSON_VALUES, limit=st.integers(0, 6), cut=st.integers(0, 40))
@example(value="[", limit=0, cut=0)  # found by CI: only a string holds a bracket, limit 0
def test_the_fast_depth_check_agrees_with_the_exact_one(value: Any, limit: int, cut: int) -> None:
    """The no-backslash fast path is exact on JSON, and never says 'shallow' for anything deeper."""
    data = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    assert boundedjson._shallow(data, limit) == (depth_of(value) <= limit)
    truncated = data[: len(data) - cut]  # not JSON any more: may say "measure", never a wrong "shallow"
    if boundedjson._shallow(truncated, limit):
        assert boundedjson.nesting_depth(truncated, 1000)[0] <= limit


@settings(max_examples=300, deadline=None, suppress_health_check=RELAXED)
@given(data=st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()[:-1]))
def test_loads_raises_only_format_error(data: bytes) -> None:
    try:
        boundedjson.loads(data, unique_keys=True)
    except FormatError as exc:
        assert exc.offset is not None and 0 <= exc.offset <= len(data)


@pytest.mark.parametrize(
    ("data", "message", "offset"),
    [
        (b"[" * 65 + b"]" * 65, "nested deeper than 64 levels", 64),
        (b'{"a": ' + b"[" * 100_000, "nested deeper than 64 levels", 69),
        (b'["x", ' + b"1" * 5000 + b"]", "an integer of 5000 digits", 0),
        (b"[" + b"9" * 41 + b"]", "an integer of 41 digits", 0),
        (b"[NaN]", "NaN is not JSON", 0),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'", 0),
        (b'{"a": \xff}', "not UTF-8 JSON", 6),
        (b'{"a": [1, 2}', "not UTF-8 JSON", 11),
        (b'"\xc3\xa9" x', "not UTF-8 JSON", 5),
    ],
)
def test_loads_names_what_is_wrong_and_where(data: bytes, message: str, offset: int) -> None:
    with pytest.raises(FormatError, match=message) as raised:
        boundedjson.loads(data, path="h.json", base_offset=100, unique_keys=True)
    assert raised.value.offset == 100 + offset and "h.json: offset" in str(raised.value)


def test_loads_accepts_what_headers_and_keys_hold() -> None:
    text = b'{"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 18446744073709551615]}, "n": "\\u00e9[{"}'
    assert boundedjson.loads(text, unique_keys=True) == {
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 2**64 - 1]},
        "n": "\u00e9[{",
    }
    assert depth_of(boundedjson.loads(b"[" * 64 + b"]" * 64)) == 64, "64 levels are accepted"
    assert boundedjson.nesting_depth(b"[" * 64 + b"]" * 64) == (64, 63)


def test_depth_scan_is_linear_on_unterminated_escaped_quotes() -> None:
    """A regex that skips JSON strings backtracks quadratically on this; the scan must not."""
    hostile = b'"' + b'\\"' * 4_000_000  # 8 MB, never closed
    started = time.monotonic()
    with pytest.raises(FormatError):
        boundedjson.loads(hostile)
    assert time.monotonic() - started < 20.0  # about 0.3 s here; a quadratic scan takes hours
