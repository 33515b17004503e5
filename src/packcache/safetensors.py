"""Read safetensors files lazily, without the ``safetensors`` package and without pickle.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of
JSON (``{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
"__metadata__": {..}}``), then the tensor bytes; offsets are relative to the end of
the header. :class:`SafetensorsFile` reads and validates only the header when it
opens the file; a tensor's bytes are read (``pread``) when :meth:`SafetensorsFile.read`
asks for them, which a warm packcache launch never does.

Everything in the header is untrusted: a malformed header (bad JSON, nesting past
64 levels, integers past 40 digits, wrong types, dimensions past 2**63 - 1, offsets
that overlap or leave the file, duplicate names) is a :class:`~packcache.errors.FormatError`
naming the file and the byte offset (the header JSON starts at offset 8), never another
exception. The file is opened without blocking and without following a symlink swapped
in after the check (:func:`packcache._paths.open_checked`): a FIFO at the path is refused,
not waited on. A source checkpoint may belong to anyone, so ownership is not checked.

The *identity* of a file (:attr:`SafetensorsFile.identity`) is the sha256 of its bytes
and its size (:mod:`packcache.identity`): the same bytes anywhere give the same pack keys,
and a warm launch finds the digest without reading the file (a hub blob's name, or the
per-user digest cache). It is found the first time a key needs it (:meth:`SafetensorsFile.meta`),
never for :meth:`~SafetensorsFile.names`. The bytes read afterwards must come from the very
version of the file that was named: a file changed since it was opened (another inode,
size, mtime or ctime) is refused rather than read.

>>> import json, os, struct, tempfile
>>> header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
>>> path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
>>> with open(path, "wb") as f:
...     _ = f.write(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.5, -2.0))
>>> st = SafetensorsFile(path)
>>> st.names(), st.meta("w").shape, st.meta("w").dtype
(['w'], (2,), 'F32')
>>> st.identity == st.meta("w").identity == f"sha256:{st.digest.sha256}:{st.size}"
True
>>> st.read("w").tolist()
[1.5, -2.0]
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _boundedjson as boundedjson
from ._paths import open_checked, pread_exact
from .errors import FormatError, UntrustedFileError
from .identity import FileDigest, file_digest, stat_key

__all__ = ["DTYPES", "MAX_DIM", "MAX_HEADER_BYTES", "MAX_NDIM", "SafetensorsFile", "TensorMeta"]

#: safetensors dtype code -> (numpy dtype that holds its bytes, item size). ``BF16`` has no
#: numpy dtype: its bytes are returned as ``uint16`` and the code says how to read them.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("i1", 1),
    "U64": ("<u8", 8), "U32": ("<u4", 4), "U16": ("<u2", 2), "U8": ("u1", 1), "BOOL": ("?", 1),
}  # fmt: skip

#: Headers larger than this are refused (the reference implementation caps them at 100 MB too).
MAX_HEADER_BYTES = 100_000_000
#: Largest dimension accepted: torch and numpy index with int64.
MAX_DIM = (1 << 63) - 1
#: Most dimensions accepted: numpy's limit (``NPY_MAXDIMS``), so :meth:`SafetensorsFile.read` can shape it.
MAX_NDIM = 64
_HEADER_AT = 8  # the header JSON starts after its 8-byte length


@dataclass(frozen=True)
class TensorMeta:
    """What a pack key needs to know about a source tensor, read from the header only.

    Attributes:
        name: the tensor's name in the file.
        shape: its shape.
        dtype: its safetensors dtype code (``"F32"``, ``"BF16"``, ...).
        identity: the identity of the file it lives in: its content digest and size
            (see :attr:`SafetensorsFile.identity`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    identity: str


@dataclass(frozen=True)
class _Span:
    name: str
    shape: tuple[int, ...]
    dtype: str
    begin: int  # absolute file offset
    nbytes: int


class SafetensorsFile:
    """One safetensors file: header parsed and validated now, tensor bytes read on demand.

    Args:
        path: the ``.safetensors`` file.

    Raises:
        FormatError: the header is malformed (the message names the file, the byte offset
            and the rule).
        UntrustedFileError: the path is not a regular file (a FIFO, a device, a directory),
            or a symlink in a world-writable directory without the sticky bit.
        OSError: the file cannot be opened or read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        fd, st = _open(self.path)
        try:
            # Only the header is read here: no readahead, so opening a checkpoint on a warm launch
            # brings none of its tensor pages into the page cache.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.size = st.st_size
            self._stat = st
            self._spans, self.metadata = _parse_header(fd, self.path, st.st_size)
        finally:
            os.close(fd)
        self._digest: FileDigest | None = None
        self._metas: dict[str, TensorMeta] = {}

    @property
    def digest(self) -> FileDigest:
        """The file's content digest (:func:`packcache.identity.file_digest`), found once, on first use.

        Raises:
            FormatError: the file changed since it was opened (open it again), or while it was hashed.
            UntrustedFileError: the path is no longer a regular file. OSError: it cannot be read.
        """
        digest = self._digest
        if digest is None:
            fd = self._reopen(offset=0, what="the file")
            try:
                digest = self._digest = file_digest(fd, self.path, self._stat)
            finally:
                os.close(fd)
        return digest

    @property
    def identity(self) -> str:
        """``sha256:<64 hex>:<size>`` of the file's bytes: what pack keys name it by (see :attr:`digest`)."""
        return self.digest.identity

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._spans)

    def __contains__(self, name: object) -> bool:
        return name in self._spans

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def meta(self, name: str) -> TensorMeta:
        """Name, shape, dtype and file identity of one tensor; reads no tensor byte (the first call
        finds the file's digest: see :attr:`digest`).

        Raises:
            KeyError: no tensor of that name.
            FormatError, UntrustedFileError, OSError: as :attr:`digest`.
        """
        meta = self._metas.get(name)
        if meta is None:
            span = self._spans.get(name)
            if span is None:
                raise KeyError(f"{self.path}: no tensor named {name!r}")
            meta = self._metas[name] = TensorMeta(span.name, span.shape, span.dtype, self.identity)
        return meta

    def read(self, name: str) -> np.ndarray[Any, Any]:
        """Read one tensor's bytes now (``pread``) into a new array (``BF16`` as ``uint16``).

        The bytes come from the version of the file whose header was parsed and whose digest
        names the packs: a file replaced or written since it was opened (another inode, size,
        mtime or ctime, before or during the read) is refused rather than read.

        Raises:
            KeyError: no tensor of that name.
            FormatError: the file is now shorter than its header says (truncated after it
                was opened), or was replaced or changed; the offset is where the bytes are.
            UntrustedFileError: the path is no longer a regular file.
            OSError: the read failed.
        """
        span = self._spans.get(name)
        if span is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        buffer = bytearray(span.nbytes)
        view = memoryview(buffer)
        done = 0
        fd = self._reopen(offset=span.begin, what=f"tensor {_short(name)}")
        try:
            while done < span.nbytes:
                got = os.preadv(fd, [view[done:]], span.begin + done)
                if got == 0:
                    raise FormatError(
                        f"tensor {_short(name)} needs bytes [{span.begin}, {span.begin + span.nbytes}) "
                        f"but the file ends at {span.begin + done} (truncated after it was opened?)",
                        path=self.path, offset=span.begin + done,
                    )  # fmt: skip
                done += got
            # A write during the read moves ctime: the bytes may be half old, half new.
            self._check_unchanged(os.fstat(fd), span.begin, f"tensor {_short(name)}")
        finally:
            os.close(fd)
        dtype = np.dtype(DTYPES[span.dtype][0])
        return np.frombuffer(buffer, dtype=dtype).reshape(span.shape)

    def _reopen(self, *, offset: int, what: str) -> int:
        """The file opened again, checked to be the version that was opened first."""
        fd, st = _open(self.path)
        try:
            self._check_unchanged(st, offset, what)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_unchanged(self, st: os.stat_result, offset: int, what: str) -> None:
        # pinned by
        #   tests/test_safetensors.py::test_reading_after_the_file_was_replaced_is_refused,
        #   tests/test_safetensors.py::test_a_same_size_write_after_open_with_mtime_restored_is_refused,
        #   tests/test_safetensors.py::test_reading_a_tensor_truncated_after_open_is_a_format_error_naming_the_offset
        if stat_key(st) != stat_key(self._stat):
            raise FormatError(
                f"{what}: the file was replaced or changed since its header was read; open it again",
                path=self.path, offset=offset,
            )  # fmt: skip


def _open(path: str) -> tuple[int, os.stat_result]:
    """Open without blocking or following a swapped-in symlink; a source checkpoint may be anyone's."""
    try:
        # pinned by tests/test_safetensors.py::test_a_non_file_at_the_model_path_is_refused_without_hanging
        return open_checked(path, trust=False)
    except UntrustedFileError as exc:
        raise UntrustedFileError(path, exc.reason, what="safetensors file") from None


def _parse_header(fd: int, path: str, size: int) -> tuple[dict[str, _Span], dict[str, str]]:
    if size < _HEADER_AT:
        raise FormatError(f"file is {size} bytes, shorter than the 8-byte header length", path=path, offset=0)
    (header_len,) = struct.unpack("<Q", pread_exact(fd, _HEADER_AT, 0, path=path, what="header"))
    if header_len > MAX_HEADER_BYTES or _HEADER_AT + header_len > size:
        raise FormatError(
            f"header length {header_len} exceeds the file ({size} bytes) or the {MAX_HEADER_BYTES}-byte cap",
            path=path, offset=0,
        )  # fmt: skip
    raw = pread_exact(fd, header_len, _HEADER_AT, path=path, what="header")
    header = boundedjson.loads(raw, path=path, base_offset=_HEADER_AT, what="header", unique_keys=True)
    if not isinstance(header, dict):
        raise FormatError(f"header is a JSON {_json_type(header)}, not an object", path=path, offset=_HEADER_AT)
    data_start = _HEADER_AT + header_len
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(
            "__metadata__ must map strings to strings", path=path, offset=_where(raw, "__metadata__")
        )  # fmt: skip
    spans = [_span(name, info, raw, path, data_start, size) for name, info in header.items()]
    # Non-empty tensors must not share bytes: one byte read as two tensors is a file built to confuse.
    ordered = sorted(spans, key=lambda s: (s.begin, s.nbytes))
    end = data_start
    for span in ordered:
        if span.nbytes == 0:
            continue
        if span.begin < end:
            where = _where(raw, span.name)
            raise FormatError(f"tensor {_short(span.name)} overlaps the tensor before it", path=path, offset=where)
        end = span.begin + span.nbytes
    return {span.name: span for span in ordered}, dict(metadata)


def _where(raw: bytes, name: str) -> int:
    """File offset of ``name``'s member in the header (its first spelling found), else the header start."""
    for spelling in (json.dumps(name), json.dumps(name, ensure_ascii=False)):
        at = raw.find(spelling.encode("utf-8", "surrogatepass"))
        if at >= 0:
            return _HEADER_AT + at
    return _HEADER_AT


def _span(name: str, info: Any, raw: bytes, path: str, data_start: int, size: int) -> _Span:
    def fail(message: str) -> FormatError:
        return FormatError(f"tensor {_short(name)} {message}", path=path, offset=_where(raw, name))

    # Plain loops and ``type(x) is int`` (bool is an int to isinstance): a 1 B-parameter
    # model has ~1,000 entries, and this runs on every launch, warm ones included.
    if type(info) is not dict:
        raise fail(f"is a JSON {_json_type(info)}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    # a list or a dict for a dtype must be a FormatError, not a TypeError out of the reader; pinned by
    #   tests/test_safetensors.py::test_hostile_header_is_a_format_error_naming_file_and_offset
    if type(dtype) is not str or dtype not in DTYPES:
        raise fail(f"has unsupported dtype {_short(dtype)}")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise fail(f"has an invalid shape {_short(shape)} (a list of at most {MAX_NDIM} dimensions)")
    for dim in shape:
        # past 2**63-1 an empty tensor's byte count still matches, and numpy fails later; pinned by
        #   tests/test_safetensors.py::test_a_dimension_over_int64_is_refused_at_parse_not_later
        if type(dim) is not int or dim < 0 or dim > MAX_DIM:
            raise fail(f"has an invalid shape {_short(shape)} (each dimension an integer in [0, 2**63-1])")
    if type(offsets) is not list or len(offsets) != 2:
        raise fail(f"has invalid data_offsets {_short(offsets)}")
    begin, stop = offsets
    if type(begin) is not int or type(stop) is not int or not 0 <= begin <= stop:
        raise fail(f"has invalid data_offsets {_short(offsets)}")
    # Python ints: no overflow however large the claimed shape.
    expected = math.prod(shape) * DTYPES[dtype][1]
    if stop - begin != expected:
        raise fail(f"spans {stop - begin} bytes, its dtype and shape need {expected}")
    if data_start + stop > size:
        raise fail(f"ends at byte {data_start + stop}, past the end of the file ({size} bytes)")
    return _Span(name, tuple(shape), dtype, data_start + begin, expected)


def _json_type(value: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _short(value: object) -> str:
    """A bounded repr of a hostile value (a 100 MB name or list must not become a 100 MB message)."""
    return _REPR.repr(value)
