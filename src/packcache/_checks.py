"""Checks at the session's edges: a request's name and key, a ``WeightCache``'s arguments, and what ``pack()`` returned.

Each check either returns the value in the one form the session uses (canonical key bytes, a plain
C-contiguous array, a parsed store URL) or raises an error naming what is wrong; none does I/O. The
request checks run on every request, so they are written for the warm path (a ``PackKey`` is encoded once).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import format as fmt
from ._storeurl import StoreURL, parse_store_url
from .errors import PackResultError

__all__ = [
    "PackFn",
    "PackKey",
    "Request",
    "check_embedded_pack",
    "check_mode",
    "check_remote",
    "check_remote_timeout",
    "check_timeout",
    "owns_memory",
    "read_only_view",
    "request_key",
    "validated",
]

PackFn = Callable[[], "np.ndarray[Any, Any]"]


class PackKey:
    """A pack key encoded once: its canonical JSON (docs/FORMAT.md), to pass to
    :meth:`Session.get_or_pack` and :meth:`Session.get_many` any number of times.

    A mapping given as ``key`` is encoded on every request (about a microsecond); a loader
    that asks for many packs under one key, or asks again, encodes it once here.

    Raises:
        TypeError: the mapping is not JSON-serialisable. ValueError: it encodes to more than
        :data:`packcache.format.MAX_KEY_BYTES` bytes.

    >>> PackKey({"packer": "int8", "version": 1}).canonical
    b'{"packer":"int8","version":1}'
    >>> PackKey({"b": 1, "a": 2}) == PackKey({"a": 2, "b": 1})
    True
    """

    __slots__ = ("canonical",)

    def __init__(self, key: Mapping[str, Any] | None = None) -> None:
        self.canonical: bytes = _encoded(key)

    @classmethod
    def from_canonical(cls, canonical: bytes) -> PackKey:
        """A key from bytes its caller made canonical JSON itself (an adapter that assembles keys from
        pieces encoded once); nothing is checked but the type and the size cap, so the bytes must be
        exactly what :func:`packcache.format.canonical_key` gives for the mapping they stand for."""
        if type(canonical) is not bytes:
            raise TypeError(f"canonical key must be bytes, got {type(canonical).__name__}")
        if len(canonical) > fmt.MAX_KEY_BYTES:
            raise ValueError(f"key is {len(canonical)} bytes of JSON, at most {fmt.MAX_KEY_BYTES} allowed")
        made = cls.__new__(cls)
        made.canonical = canonical
        return made

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackKey) and other.canonical == self.canonical

    def __hash__(self) -> int:
        return hash(self.canonical)

    def __repr__(self) -> str:
        text = self.canonical.decode("ascii")
        return f"PackKey({text if len(text) <= 80 else text[:77] + '...'})"


def _encoded(key: Mapping[str, Any] | PackKey | None) -> bytes:
    """The canonical key bytes of a request's ``key``.

    Raises:
        TypeError, ValueError: as :class:`PackKey`.
    """
    if type(key) is PackKey:
        return key.canonical
    canonical = fmt.canonical_key(key)  # type: ignore[arg-type]  # a Mapping or None here
    if len(canonical) > fmt.MAX_KEY_BYTES:
        raise ValueError(f"key is {len(canonical)} bytes of JSON, at most {fmt.MAX_KEY_BYTES} allowed")
    return canonical


_SHORT_NAME = fmt.MAX_NAME_BYTES // 4  # characters: a str this long or shorter fits the cap, whatever it holds


def request_key(name: object, key: Mapping[str, Any] | PackKey | None) -> bytes:
    """Check a request's name and return its canonical key bytes (what :meth:`Session.get_or_pack` and
    :meth:`Session.get_many` check of every request, before anything is served).

    Raises:
        TypeError: ``name`` is not a non-empty str or None; ``key`` as :class:`PackKey`.
        ValueError: ``name`` longer than the cap in UTF-8; ``key`` as :class:`PackKey`.
    """
    if name is not None and (type(name) is not str or not 0 < len(name) <= _SHORT_NAME):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        if len(name.encode("utf-8")) > fmt.MAX_NAME_BYTES:
            raise ValueError(f"name is longer than {fmt.MAX_NAME_BYTES} UTF-8 bytes: {name[:40]!r}...")
    canonical = key.canonical if type(key) is PackKey else _encoded(key)
    if name is not None and name.startswith("packcache.") and fmt.embedded_kind(name):
        # pinned by tests/test_bundle.py::test_a_session_refuses_an_embedded_entry_readers_would_reject
        problem = fmt.embedded_problem(fmt.Entry(name, canonical, b"", "u1", (0,), 0, 0, 0))
        if problem:
            raise ValueError(problem)
    return canonical


#: One request of :meth:`Session.get_many`: ``(name, pack, key)`` as :meth:`Session.get_or_pack` takes them.
Request = tuple["str | None", PackFn, "Mapping[str, Any] | PackKey | None"]


def check_remote(remote: object) -> StoreURL | None:
    """``remote=`` parsed (:func:`packcache._storeurl.parse_store_url`), or ``None``.

    Raises:
        ValueError: it is no store URL (the message shows it redacted).
    """
    if remote is None or isinstance(remote, StoreURL):
        return remote
    value = os.fspath(remote) if isinstance(remote, (str, os.PathLike)) else remote
    if not isinstance(value, str) or not value:
        raise ValueError(f"remote must be a store URL or directory, got {type(remote).__name__}")
    try:
        return parse_store_url(value)
    except ValueError as exc:
        raise ValueError(f"remote must be a store URL or directory: {exc}") from None


def check_timeout(value: float) -> float:
    """``lock_timeout=`` as seconds.

    Raises:
        ValueError: it is not a finite number of seconds >= 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"lock_timeout must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_mode(value: int, what: str) -> int:
    """``file_mode=`` or ``dir_mode=`` (``what``) as permission bits.

    Raises:
        ValueError: not permission bits, or bits that let other users write.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o7777:
        raise ValueError(f"{what} must be permission bits (an int in [0, 0o7777]), got {value!r}")
    # pinned by tests/test_cache.py::test_a_file_mode_the_trust_check_would_refuse_is_refused_at_construction,
    # ::test_a_dir_mode_other_users_may_write_is_refused
    if value & 0o022:
        # The trust check refuses group/world-writable files and unsafe directories:
        # a mode that makes the cache refuse its own file on the next launch is a mistake.
        raise ValueError(
            f"{what} {value:04o} lets other users write; packcache refuses such files as untrusted "
            f"(use e.g. {value & ~0o022:04o})"
        )
    return value


def validated(result: object) -> tuple[np.ndarray[Any, Any], bool]:
    """What ``pack()`` returned, as a plain C-contiguous array; and whether it is a new copy.

    Raises:
        PackResultError: it is no ndarray, a masked array, of a dtype or shape the format cannot hold.
    """
    if not isinstance(result, np.ndarray):
        raise PackResultError(f"pack() must return a numpy.ndarray, got {type(result).__name__}")
    masked = sys.modules.get("numpy.ma")  # imported if a MaskedArray exists; never import it here (EMFILE)
    # pinned by tests/test_cache.py::test_a_masked_array_is_a_pack_result_error_not_a_write_failure
    if masked is not None and isinstance(result, masked.MaskedArray):
        raise PackResultError(
            "pack() returned a numpy.ma.MaskedArray: its mask cannot be cached; return .filled(...) or .data"
        )
    array = result if type(result) is np.ndarray else result.view(np.ndarray)  # np.memmap, np.matrix: the bytes
    dtype = array.dtype
    if dtype.str[1:] not in fmt.DTYPE_CODES or dtype.str[0] == ">":
        raise PackResultError(
            f"pack() returned dtype {dtype}; cacheable dtypes are little-endian {', '.join(fmt.DTYPE_CODES)}"
        )
    if len(array.shape) > fmt.MAX_NDIM:
        raise PackResultError(f"pack() returned {array.ndim} dimensions, at most {fmt.MAX_NDIM} are supported")
    if not fmt.shape_fits(array.shape, array.dtype.itemsize):
        raise PackResultError(f"pack() returned shape {array.shape}, whose size does not fit 2**63-1 bytes")
    if array.flags.c_contiguous:
        return array, False
    return array.copy(order="C"), True  # not np.ascontiguousarray: it turns a 0-d array into a 1-d one


def check_embedded_pack(name: str, key: bytes, array: np.ndarray[Any, Any]) -> None:
    """An embedded entry's pack (docs/FORMAT.md R47-R50) before it is stored: ``u1`` bytes within the cap, the
    sha256 its key names. A file readers would reject is never written (W6).

    Raises:
        PackResultError: it is not.
    """
    if not fmt.embedded_kind(name):
        return
    entry = fmt.Entry(name, key, b"", array.dtype.str[1:], array.shape, 0, array.nbytes, 0)
    problem = fmt.embedded_problem(entry)
    if problem is None and fmt.embedded_key(fmt.embedded_kind(name) or "file", array.data) != key:
        problem = f"embedded entry {name!r}: pack() returned bytes other than the sha256 its key names (R50)"
    if problem:
        raise PackResultError(problem)


def owns_memory(array: np.ndarray[Any, Any]) -> bool:
    """Whether ``array``'s memory can be reached only through it: it owns it, or each base up to
    the owner is a plain ndarray referenced by nothing but the view above it."""
    while not array.flags.owndata:
        if type(array.base) is not np.ndarray or sys.getrefcount(array.base) > 2:
            return False  # a foreign buffer, or a base someone else still holds
        array = array.base
    return True


def read_only_view(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A view whose buffer is read-only, so ``flags.writeable = True`` cannot undo it."""
    if array.size == 0:
        empty = np.empty(array.shape, dtype=array.dtype)
        empty.flags.writeable = False
        return empty
    frozen = array.reshape(-1).view(np.uint8).data.toreadonly()
    return np.frombuffer(frozen, dtype=array.dtype).reshape(array.shape)


def check_remote_timeout(value: object) -> float:
    """``remote_timeout=`` as seconds.

    Raises:
        ValueError: it is not a finite number of seconds > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"remote_timeout must be a finite number of seconds > 0, got {value!r}")
    return float(value)
