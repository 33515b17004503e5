"""Read safetensors files lazily, without the ``safetensors`` package and without pickle.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of
JSON (``{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
"__metadata__": {..}}``), then the tensor bytes; offsets are relative to the end of
the header. :class:`SafetensorsFile` reads and validates only the header when it
opens the file; a tensor's bytes are read (``pread``) when :meth:`SafetensorsFile.read`
asks for them, which a warm packcache launch never does.

The *identity* of a file (:attr:`SafetensorsFile.identity`) is its size, mtime and
inode: a pack key built from it changes when the file is replaced or rewritten,
without reading the content.

>>> import json, os, struct, tempfile
>>> header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
>>> path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
>>> with open(path, "wb") as f:
...     _ = f.write(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.5, -2.0))
>>> st = SafetensorsFile(path)
>>> st.names(), st.meta("w").shape, st.meta("w").dtype
(['w'], (2,), 'F32')
>>> st.read("w").tolist()
[1.5, -2.0]
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FormatError

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "SafetensorsFile", "TensorMeta"]

#: safetensors dtype code -> (numpy dtype that holds its bytes, item size). ``BF16`` has no
#: numpy dtype: its bytes are returned as ``uint16`` and the code says how to read them.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("i1", 1),
    "U64": ("<u8", 8), "U32": ("<u4", 4), "U16": ("<u2", 2), "U8": ("u1", 1), "BOOL": ("?", 1),
}  # fmt: skip

#: Headers larger than this are refused (the reference implementation caps them at 100 MB too).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorMeta:
    """What a pack key needs to know about a source tensor, read from the header only.

    Attributes:
        name: the tensor's name in the file.
        shape: its shape.
        dtype: its safetensors dtype code (``"F32"``, ``"BF16"``, ...).
        identity: the identity of the file it lives in (see :attr:`SafetensorsFile.identity`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    identity: str


@dataclass(frozen=True)
class _Span:
    meta: TensorMeta
    begin: int  # absolute file offset
    nbytes: int


class SafetensorsFile:
    """One safetensors file: header parsed and validated now, tensor bytes read on demand.

    Args:
        path: the ``.safetensors`` file.

    Raises:
        FormatError: the header is malformed (the message names the file and the rule).
        OSError: the file cannot be opened or read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            self.size = st.st_size
            #: size, mtime and inode: changes when the file is replaced or rewritten.
            self.identity = f"{os.path.basename(self.path)}:size={st.st_size}:mtime_ns={st.st_mtime_ns}:ino={st.st_ino}"
            self._spans, self.metadata = _parse_header(f, self.path, st.st_size, self.identity)

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._spans)

    def __contains__(self, name: object) -> bool:
        return name in self._spans

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def meta(self, name: str) -> TensorMeta:
        """Name, shape, dtype and file identity of one tensor; reads nothing.

        Raises:
            KeyError: no tensor of that name.
        """
        try:
            return self._spans[name].meta
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def read(self, name: str) -> np.ndarray[Any, Any]:
        """Read one tensor's bytes now (``pread``) into a new array (``BF16`` as ``uint16``).

        Raises:
            KeyError: no tensor of that name.
            OSError: the read failed; FormatError: the file is shorter than its header says.
        """
        span = self._spans.get(name)
        if span is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        buffer = bytearray(span.nbytes)
        view = memoryview(buffer)
        done = 0
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while done < span.nbytes:
                got = os.preadv(fd, [view[done:]], span.begin + done)
                if got == 0:
                    raise FormatError(f"tensor {name!r} ends past the end of the file", path=self.path)
                done += got
        finally:
            os.close(fd)
        dtype = np.dtype(DTYPES[span.meta.dtype][0])
        return np.frombuffer(buffer, dtype=dtype).reshape(span.meta.shape)


def _parse_header(f: Any, path: str, size: int, identity: str) -> tuple[dict[str, _Span], dict[str, str]]:
    if size < 8:
        raise FormatError(f"file is {size} bytes, shorter than the 8-byte header length", path=path)
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise FormatError(f"header length {header_len} exceeds the file ({size} bytes) or the cap", path=path)
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise FormatError("file is shorter than its header length", path=path, offset=8)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"header is not UTF-8 JSON: {exc}", path=path, offset=8) from None
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object", path=path, offset=8)
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("__metadata__ must map strings to strings", path=path, offset=8)
    spans: list[tuple[int, int, str, _Span]] = []
    for name, info in header.items():
        spans.append(_span(name, info, path, data_start, size, identity))
    spans.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, name, _ in spans:
        if begin < end:
            raise FormatError(f"tensor {name!r} overlaps the tensor before it", path=path)
        end = max(end, stop)
    ordered = sorted(spans, key=lambda s: s[0])
    return {name: span for _, _, name, span in ordered}, dict(metadata)


def _span(name: str, info: Any, path: str, data_start: int, size: int, identity: str) -> tuple[int, int, str, _Span]:
    if not isinstance(info, dict):
        raise FormatError(f"entry {name!r} is not an object", path=path)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise FormatError(f"tensor {name!r} has unsupported dtype {dtype!r}", path=path)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FormatError(f"tensor {name!r} has an invalid shape {shape!r}", path=path)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise FormatError(f"tensor {name!r} has invalid data_offsets {offsets!r}", path=path)
    begin, stop = offsets
    # Python ints: no overflow however large the claimed shape.
    expected = math.prod(shape) * DTYPES[dtype][1]
    if stop - begin != expected:
        raise FormatError(f"tensor {name!r} spans {stop - begin} bytes, its dtype and shape need {expected}", path=path)
    if data_start + stop > size:
        raise FormatError(f"tensor {name!r} ends at byte {data_start + stop}, past the end of the file", path=path)
    meta = TensorMeta(name=name, shape=tuple(shape), dtype=dtype, identity=identity)
    return begin, stop, name, _Span(meta, data_start + begin, expected)
