"""JSON from files packcache does not control, parsed with bounds: nesting, integer size, types.

``json.loads`` on hostile bytes fails in ways a caller does not expect of a
parser: ``RecursionError`` on deep nesting (and, below the recursion limit, a
tree so deep that ``repr`` or ``json.dumps`` of it fails later), a plain
``ValueError`` for an integer over Python's 4,300-digit conversion limit, and
``NaN``/``Infinity``, which are not JSON. :func:`loads` turns every one of them
into :class:`~packcache.errors.FormatError` naming the file and the byte offset.

Nesting is measured *before* parsing, on the raw bytes (string contents masked
out), so the parser never recurses deeper than ``max_depth``.

>>> loads(b'{"a": [1, 2]}')
{'a': [1, 2]}
>>> loads(b"[" * 100 + b"]" * 100, path="x.json", base_offset=8)
Traceback (most recent call last):
...
packcache.errors.FormatError: x.json: offset 72: JSON: nested deeper than 64 levels
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ._paths import read_bounded
from .errors import FormatError

__all__ = ["load_file", "loads"]

#: Deepest nesting accepted. safetensors headers are 3 levels deep, pack keys and
#: platform fingerprints a handful; 64 leaves room without letting ``repr`` recurse.
MAX_DEPTH = 64
#: Longest integer literal accepted: u64 values have 20 digits. Longer ones are no
#: size, offset or version anything reads, and Python refuses 4,301 digits anyway.
MAX_INT_DIGITS = 40

_CHUNK = 1 << 20  # depth is computed over 1 MiB slices: memory stays bounded on a 100 MB header
_BRACKET = np.zeros(256, np.int64)
_BRACKET[[ord("["), ord("{")]] = 1
_BRACKET[[ord("]"), ord("}")]] = -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


class _Refused(ValueError):
    """Raised inside the parser's hooks; turned into FormatError by :func:`loads`."""


def nesting_depth(data: bytes, limit: int = MAX_DEPTH) -> tuple[int, int]:
    r"""How deep ``[``/``{`` nest in ``data`` outside strings, up to the first point past ``limit``.

    Returns ``(depth, offset)``: the maximum depth and where it is first reached, or,
    once the depth passes ``limit``, ``limit + 1`` and where that happens (the scan stops).

    Vectorised (numpy) rather than a regex over strings: a regex that skips strings
    is quadratic on hostile input such as ``"\"\"\"...`` left unterminated. A quote
    counts when an even number of backslashes precedes it; brackets count outside
    strings. Exact for every prefix a JSON parser accepts, so the parser never
    recurses past what was measured.

    >>> nesting_depth(b'{"a[[[": [[1]]}')  # brackets inside a string do not count
    (3, 10)
    >>> nesting_depth(rb'["\\", [["\"]"]]]')  # an escaped backslash, then an escaped quote
    (3, 8)
    """
    raw = np.frombuffer(data, np.uint8)
    depth = best = best_at = 0
    inside = 0  # 1 while the previous chunk ended inside a string
    backslashes = 0  # length of the backslash run the previous chunk ended with
    for start in range(0, len(raw), _CHUNK):
        chunk = raw[start : start + _CHUNK]
        position = np.arange(len(chunk), dtype=np.int64)
        not_backslash = np.where(chunk != _BACKSLASH, position, -1)
        last_other = np.maximum.accumulate(not_backslash)  # last non-backslash at or before i
        before = np.concatenate(([-1], last_other[:-1]))  # ... strictly before i
        run = position - 1 - before + np.where(before < 0, backslashes, 0)  # backslashes right before i
        quote = (chunk == _QUOTE) & (run % 2 == 0)
        in_string = (np.cumsum(quote, dtype=np.int64) + inside) % 2 == 1  # an opening quote is "in"
        running = np.cumsum(np.where(in_string, 0, _BRACKET[chunk])) + depth
        peak = int(running.argmax())
        if int(running[peak]) > best:
            best, best_at = int(running[peak]), start + peak
            if best > limit:
                return limit + 1, start + int(np.argmax(running > limit))
        depth = int(running[-1])
        inside = int(in_string[-1])
        trailing = len(chunk) - 1 - int(last_other[-1])
        backslashes = trailing + (backslashes if trailing == len(chunk) else 0)
    return best, best_at


def _parse_int(text: str) -> int:
    # no size needs 41 digits, and int() of 4,301 is a plain ValueError; pinned by
    #   tests/test_safetensors.py::test_hostile_header_is_a_format_error_naming_file_and_offset,
    #   tests/test_maintenance.py::test_inspect_shows_placeholders_for_hostile_keys_and_platforms
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_constant(text: str) -> Any:
    raise _Refused(f"{text} is not JSON")


def _parse_finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} does not fit a float")
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {key!r}")
            seen.add(key)
    return result


_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')  # every byte but quotes and brackets
_DIGIT_MAP = bytes(0x31 if 0x30 <= b <= 0x39 else 0x30 for b in range(256))  # digits -> "1", the rest -> "0"
_LONG_DIGITS = b"1" * (MAX_INT_DIGITS + 1)


_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_FAST_STRUCTURE = 1 << 20  # above this much structure, measure exactly (vectorised) instead


def _shallow(data: bytes, limit: int) -> bool:
    """Whether ``data`` surely nests no deeper than ``limit`` (fast; False means: measure exactly).

    Without a backslash no quote is escaped, so the text between quote pairs is
    strings and the rest is structure: a 100 KB safetensors header shrinks to a
    few KB of brackets. Each pass of ``replace`` then removes the innermost level
    (braces mapped to brackets first, so two kinds of pair never vanish in one pass).
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return True  # most pack keys: too few brackets to nest past the limit at all
    if b"\\" in data:
        return nesting_depth(data, limit)[0] <= limit
    brackets = b"".join(data.translate(None, _STRUCTURE).split(b'"')[::2]).translate(_ONE_KIND)
    if len(brackets) > _FAST_STRUCTURE:
        return nesting_depth(data, limit)[0] <= limit
    for _ in range(limit):
        if not brackets:
            break
        brackets = brackets.replace(b"[]", b"")
    return not brackets  # else deeper than the limit, or unbalanced (not JSON): measure exactly


def loads(
    data: bytes,
    *,
    path: str | None = None,
    base_offset: int = 0,
    what: str = "JSON",
    max_depth: int = MAX_DEPTH,
    unique_keys: bool = False,
    finite: bool = False,
) -> Any:
    """Parse untrusted JSON ``data`` (UTF-8 bytes) within bounds.

    Args:
        data: the JSON text.
        path: the file it came from, for the error message.
        base_offset: file offset of ``data[0]``: error offsets are file offsets.
        what: what the JSON is, for the error message (``"header"``, ``"pack key"``).
        max_depth: deepest nesting of arrays and objects accepted.
        unique_keys: refuse an object that names a key twice (``json`` keeps the last,
            another reader may keep the first: the two would see different files).
        finite: refuse a number too large for a float (``1e400``, which ``json`` reads as infinity).

    Returns:
        The parsed value (dicts, lists, str, int, float, bool, None).

    Raises:
        FormatError: not UTF-8, not JSON, nested deeper than ``max_depth``, an integer
            over :data:`MAX_INT_DIGITS` digits, ``NaN``/``Infinity`` (with ``finite``, a number
            that overflows a float), or a duplicate key;
            its ``offset`` is ``base_offset`` plus the byte position (the start of ``data``
            when the parser does not say where).
    """
    # measured before parsing: 100,000 brackets were a RecursionError out of the parser; pinned by
    #   tests/test_safetensors.py::test_hostile_header_is_a_format_error_naming_file_and_offset
    if not _shallow(data, max_depth):
        at = nesting_depth(data, max_depth)[1]
        raise FormatError(f"{what}: nested deeper than {max_depth} levels", path=path, offset=base_offset + at)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = base_offset + exc.start
        raise FormatError(f"{what}: not UTF-8 JSON: {exc.reason}", path=path, offset=where) from None
    # The integer hook costs a Python call per number: only pay it when a long digit run exists.
    parse_int = _parse_int if _LONG_DIGITS in data.translate(_DIGIT_MAP) else None
    hook = _unique_object if unique_keys else None
    # finite: 1e400 in a config was read as infinity; pinned by
    #   tests/test_minilm.py::test_malformed_model_files_end_in_one_line_naming_the_file_and_the_field
    try:
        return json.loads(
            text, parse_int=parse_int, parse_float=_parse_finite if finite else None,
            parse_constant=_parse_constant, object_pairs_hook=hook,
        )  # fmt: skip
    except json.JSONDecodeError as exc:
        where = base_offset + len(text[: exc.pos].encode("utf-8", "surrogatepass"))
        raise FormatError(f"{what}: not UTF-8 JSON: {exc.msg}", path=path, offset=where) from None
    except (ValueError, RecursionError) as exc:
        # _Refused from a hook (or int()'s own digit limit): the hooks do not know where they
        # are, so the start of the JSON is the honest offset.
        raise FormatError(f"{what}: refused: {exc}", path=path, offset=base_offset) from None


def load_file(path: str, *, what: str, max_bytes: int) -> Any:
    """Parse the small JSON file at ``path`` (a checkpoint's ``config.json``, say) within bounds: read by
    :func:`packcache._paths.read_bounded` (no FIFO hang, no swapped symlink, a regular file of at most
    ``max_bytes``), then :func:`loads` with ``finite`` on (a config value never needs infinity).

    Raises:
        FormatError: too large, or not bounded JSON (naming the file and the offset).
        UntrustedFileError: not a regular file. OSError: it cannot be opened or read.
    """
    return loads(read_bounded(path, what=what, max_bytes=max_bytes), path=path, what=what, finite=True)
