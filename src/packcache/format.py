"""The cache file layout: encoding and validating bytes, no I/O.

``docs/FORMAT.md`` is the specification; this module is its executable form.
Every function here takes and returns bytes and plain Python values, so the
layout can be tested byte by byte without touching a file system.

A file is a fixed header region (preamble, platform fingerprint, two commit
slots), then aligned pack data, then an index describing the packs. A commit
writes data and index first and a commit slot last; readers take the newest
slot whose checksum and index both validate.

Sizes and offsets read from a file are converted to Python ints before any
arithmetic, so a hostile value cannot wrap around.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
import struct
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .errors import FormatError

__all__ = [
    "DTYPE_CODES",
    "FILE_PREFIX",
    "FORMAT_VERSION",
    "HEADER_READ_SIZE",
    "MAGIC",
    "MAX_ALIGNMENT",
    "MAX_DIM",
    "MAX_ENTRIES",
    "MAX_FILE_BYTES",
    "MAX_GENERATION",
    "MAX_INDEX_BYTES",
    "MAX_KEY_BYTES",
    "MAX_MODEL_BYTES",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "MIN_ALIGNMENT",
    "MODEL_ENTRY",
    "PLATFORM_MAX",
    "SLOT",
    "Entry",
    "Header",
    "Slot",
    "align_up",
    "canonical_key",
    "canonical_value",
    "check_embedded",
    "check_new_file",
    "choose_slot",
    "compacted_size",
    "crc32",
    "data_start_for",
    "decode_header",
    "decode_index",
    "decode_slot",
    "embedded_key",
    "embedded_kind",
    "embedded_problem",
    "encode_entry",
    "encode_header",
    "encode_index",
    "encode_slot",
    "entry_record_size",
    "file_entry_name",
    "index_size",
    "key_digest",
    "numpy_dtype_str",
    "shape_fits",
    "slot_offset",
    "valid_alignment",
    "validate_slot_bounds",
]

MAGIC = b"\x89PKC\r\n\x1a\n"
FORMAT_VERSION = 2  # 2: a file may hold the model itself (docs/FORMAT.md "Embedded entries")

PREAMBLE = struct.Struct(
    "<8sIIIII32sI"
)  # magic, version, alignment, data_start, platform size, platform crc, reserved, crc
PLATFORM_OFFSET = 64
PLATFORM_MAX = 1984  # the fingerprint must end before the first slot
SLOT_OFFSETS = (2048, 3072)  # in different 512-byte sectors: a torn slot write cannot hit both
SLOT = struct.Struct("<8sQQQII20sI")  # magic, generation, index offset, index size, count, index crc, reserved, crc
SLOT_MAGIC = b"PKCSLOT1"
HEADER_READ_SIZE = 4096  # preamble, fingerprint and both slots lie in the first 4 KiB

INDEX_HEAD = struct.Struct("<8sII")  # magic, entry count, reserved
INDEX_MAGIC = b"PKCINDEX"
ENTRY_FIXED = struct.Struct("<32sQQIHBB4sI")  # digest, offset, nbytes, crc, name size, ndim, reserved, dtype, key size

MIN_ALIGNMENT = 64
MAX_ALIGNMENT = 1 << 20
MAX_NAME_BYTES = 1024
MAX_KEY_BYTES = 65536
MAX_NDIM = 32
MAX_ENTRIES = 1_000_000
MAX_INDEX_BYTES = 256 << 20
MAX_DIM = (1 << 63) - 1
MAX_GENERATION = (1 << 64) - 1  # reserved, never valid: see decode_slot
#: The entry holding the model record (docs/FORMAT.md "Embedded entries"), and the prefix of embedded files' entries.
MODEL_ENTRY = "packcache.model"
FILE_PREFIX = "packcache.file/"
MAX_MODEL_BYTES = 16 << 20  # a record lists every source tensor: a 1 T-parameter model's is a few MiB
MAX_FILE_BYTES = 64 << 20  # the largest tokenizer.json known is ~35 MB
MAX_FILE_COMPONENT = 255
_EMBEDDED_KEY = re.compile(rb'\{"kind":"packcache\.(model|file)","sha256":"[0-9a-f]{64}"\}')

#: dtype codes the format can hold: kind letter and item size, always little-endian.
DTYPE_CODES = (
    "b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16",
)  # fmt: skip
_ITEMSIZE = {code: int(code[1:]) for code in DTYPE_CODES}
_DTYPE_FIELDS = {code.encode("ascii").ljust(4, b"\0"): code for code in DTYPE_CODES}  # raw field -> code
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
_ZEROS = bytes(8)


@dataclass(frozen=True)
class Header:
    """The immutable part of a file: layout parameters and platform fingerprint."""

    alignment: int
    data_start: int
    platform: bytes  # canonical JSON, see :func:`canonical_key`
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True)
class Slot:
    """One commit record: which index is current, and its generation."""

    generation: int
    index_offset: int
    index_size: int
    entry_count: int
    index_crc: int

    @property
    def committed_end(self) -> int:
        """File offset just past this generation's index."""
        return self.index_offset + self.index_size


class Entry(NamedTuple):
    """One pack stored in the file (a tuple: an index may hold a million, built fast)."""

    name: str
    key: bytes  # canonical JSON of the caller's key
    digest: bytes  # sha256 over name and key, see :func:`key_digest`
    dtype: str  # one of DTYPE_CODES
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (a power of two).

    >>> align_up(65, 64)
    128
    """
    return (value + alignment - 1) & ~(alignment - 1)


def data_start_for(alignment: int) -> int:
    """Offset of the first data byte for a given alignment.

    >>> data_start_for(64), data_start_for(1 << 16)
    (4096, 65536)
    """
    return max(HEADER_READ_SIZE, alignment)


def slot_offset(index: int) -> int:
    """File offset of commit slot ``index`` (0 or 1)."""
    return SLOT_OFFSETS[index]


def canonical_key(key: Mapping[str, Any] | None) -> bytes:
    """Serialise a pack key (or platform mapping) to canonical JSON bytes.

    Keys are sorted and no whitespace is emitted, so the same mapping always
    gives the same bytes. Values keep their JSON type: ``1`` and ``1.0`` differ,
    and non-string mapping keys are turned into strings as ``json`` does. NaN
    and infinities are refused (they are not JSON).

    >>> canonical_key({"b": 1, "a": [2, 3]})
    b'{"a":[2,3],"b":1}'
    """
    if key is None:
        return b"{}"
    if not isinstance(key, Mapping):
        raise TypeError(f"key must be a mapping or None, not {type(key).__name__}")
    try:
        text = _CANONICAL(key)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"key is not JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise TypeError("key is not JSON-serialisable: it is circular or nested too deeply") from None
    return text.encode("ascii")


def canonical_value(value: Any) -> bytes:
    """Canonical JSON of any JSON value (a mapping's member, say), as :func:`canonical_key` writes it inside
    a key: for callers that assemble a key's bytes from members encoded once.

    Raises:
        TypeError: the value is not JSON-serialisable (or NaN/Inf, circular).

    >>> canonical_value({"b": 1, "a": "x"}), canonical_value([1, 2.0])
    (b'{"a":"x","b":1}', b'[1,2.0]')
    """
    try:
        return _CANONICAL(value).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"value is not JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise TypeError("value is not JSON-serialisable: it is circular or nested too deeply") from None


def _canonical_encoder() -> Callable[[Any], str]:
    """One JSON encoder for every key, built once: ``json.dumps`` with these arguments builds a
    new encoder per call, which was most of the cost of a cache hit. Without a circular-reference
    table (a shared one is not thread-safe): a circular key ends in RecursionError instead."""
    default = json.JSONEncoder().default  # raises TypeError for what JSON cannot hold
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator (another Python implementation)
        return json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode
    encode = make(None, default, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, False)

    def canonical(key: Any) -> str:
        return "".join(encode(key, 0))

    return canonical


_CANONICAL = _canonical_encoder()
_DIGEST_PREFIX = hashlib.sha256(b"packcache-key\0")


def key_digest(name: str, key: bytes) -> bytes:
    """The 32-byte digest that identifies a pack: sha256 over its name and key.

    >>> len(key_digest("w", b"{}"))
    32
    """
    h = _DIGEST_PREFIX.copy()
    h.update(name.encode("utf-8") + b"\0" + key)
    return h.digest()


def shape_fits(shape: Sequence[int], itemsize: int) -> bool:
    """Whether an array of ``shape`` can exist: its non-zero dimensions times the item size
    fit in 2**63 - 1 bytes (numpy refuses more even when a zero dimension makes it empty; R46).

    >>> shape_fits((2**62, 0), 1), shape_fits((2**62, 0), 8)
    (True, False)
    """
    size = itemsize
    for d in shape:
        if d:
            size *= d
    return size <= MAX_DIM


def crc32(data: Any, crc: int = 0) -> int:
    """The file's checksum: zlib's crc32 of ``data`` (any buffer), continuing from ``crc``, as an unsigned 32-bit int.

    >>> crc32(b"packcache") == crc32(b"cache", crc32(b"pack"))
    True
    """
    return zlib.crc32(data, crc) & 0xFFFFFFFF


# --------------------------------------------------------------------------- header


def valid_alignment(alignment: int) -> bool:
    """The alignment rule: a power of two in [``MIN_ALIGNMENT``, ``MAX_ALIGNMENT``] (FORMAT.md R6)."""
    return MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT and not alignment & (alignment - 1)


def check_new_file(alignment: int, platform: bytes) -> None:
    """Refuse what no file may be made with: a bad alignment, or a fingerprint too long to fit.

    Raises:
        ValueError: naming the value and the rule.
    """
    if not valid_alignment(alignment):
        raise ValueError(f"alignment must be a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}], got {alignment}")
    if len(platform) > PLATFORM_MAX:
        raise ValueError(f"platform fingerprint is {len(platform)} bytes of JSON, at most {PLATFORM_MAX} fit")


def encode_header(alignment: int, platform: bytes) -> bytes:
    """Bytes of a new file's header region, both commit slots empty.

    Returns ``data_start_for(alignment)`` bytes: preamble, fingerprint, zeros.
    """
    check_new_file(alignment, platform)
    data_start = data_start_for(alignment)
    head = PREAMBLE.pack(MAGIC, FORMAT_VERSION, alignment, data_start, len(platform), crc32(platform), bytes(32), 0)
    head = head[:-4] + struct.pack("<I", crc32(head[:-4]))
    region = bytearray(data_start)
    region[: PREAMBLE.size] = head
    region[PLATFORM_OFFSET : PLATFORM_OFFSET + len(platform)] = platform
    return bytes(region)


def decode_header(buf: bytes, *, path: str | None = None) -> Header:
    """Validate and decode the preamble and fingerprint from a file's first bytes.

    Raises:
        FormatError: on any rule of docs/FORMAT.md "Preamble" being broken.
    """
    if len(buf) < HEADER_READ_SIZE:
        raise FormatError(f"file is {len(buf)} bytes, shorter than the {HEADER_READ_SIZE}-byte header", path=path)
    magic, version, alignment, data_start, psize, pcrc, reserved, crc = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}; not a packcache file", path=path, offset=0)
    if crc32(buf[: PREAMBLE.size - 4]) != crc:
        raise FormatError("preamble checksum mismatch", path=path, offset=60)
    if version != FORMAT_VERSION:
        raise FormatError(
            f"format version {version} is not supported (this reader: {FORMAT_VERSION})", path=path, offset=8
        )
    if reserved != bytes(32):
        raise FormatError("reserved preamble bytes are not zero", path=path, offset=28)
    alignment, data_start, psize = int(alignment), int(data_start), int(psize)
    if not valid_alignment(alignment):
        raise FormatError(f"alignment {alignment} is not a power of two in [64, 1 MiB]", path=path, offset=12)
    if data_start != data_start_for(alignment):
        raise FormatError(f"data start {data_start} != max(4096, alignment)", path=path, offset=16)
    if psize > PLATFORM_MAX:
        raise FormatError(f"platform fingerprint size {psize} exceeds {PLATFORM_MAX}", path=path, offset=20)
    platform = bytes(buf[PLATFORM_OFFSET : PLATFORM_OFFSET + psize])
    if crc32(platform) != pcrc:
        raise FormatError("platform fingerprint checksum mismatch", path=path, offset=PLATFORM_OFFSET)
    return Header(alignment=alignment, data_start=data_start, platform=platform, format_version=int(version))


# --------------------------------------------------------------------------- slots


def encode_slot(slot: Slot) -> bytes:
    """The 64 bytes of a commit slot (write them at ``slot_offset(slot.generation % 2)``)."""
    if not 1 <= slot.generation < MAX_GENERATION:
        raise ValueError(f"generation must be in [1, 2**64-2], got {slot.generation}")
    body = SLOT.pack(
        SLOT_MAGIC, slot.generation, slot.index_offset, slot.index_size, slot.entry_count, slot.index_crc, bytes(20), 0
    )
    return body[:-4] + struct.pack("<I", crc32(body[:-4]))


def decode_slot(buf: bytes) -> Slot | None:
    """Decode a commit slot; ``None`` if it is empty or fails its checksum.

    An invalid slot is not an error by itself: it may be a torn write, and the
    other slot then holds the previous generation.
    Raises:
        FormatError: if ``buf`` is shorter than a slot (64 bytes).
    """
    if len(buf) < SLOT.size:
        raise FormatError(f"a commit slot is {SLOT.size} bytes, got {len(buf)}")
    magic, generation, ioff, isize, count, icrc, reserved, crc = SLOT.unpack_from(buf, 0)
    if magic != SLOT_MAGIC or crc32(buf[: SLOT.size - 4]) != crc or reserved != bytes(20):
        return None
    if generation == 0 or generation == MAX_GENERATION:  # 2**64-1 is reserved: no successor fits in a u64
        return None
    return Slot(int(generation), int(ioff), int(isize), int(count), int(icrc))


def choose_slot(header_buf: bytes) -> tuple[list[Slot], bool]:
    """Valid commit slots, newest first, and whether any slot holds bytes at all.

    A file whose slots are both all-zero has never been committed (it is an
    empty cache); a file with non-zero slots none of which is valid is corrupt.
    Generation ``g`` lives in slot ``g % 2``; a slot holding a generation of the
    other parity is invalid, so a writer can always tell which slot is in use.

    Raises:
        FormatError: if ``header_buf`` is shorter than the 4096-byte header.
    """
    if len(header_buf) < HEADER_READ_SIZE:
        raise FormatError(f"the header is {HEADER_READ_SIZE} bytes, got {len(header_buf)}")
    slots: list[Slot] = []
    written = False
    for position, off in enumerate(SLOT_OFFSETS):
        raw = header_buf[off : off + SLOT.size]
        if any(raw):
            written = True
        slot = decode_slot(raw)
        if slot is not None and slot.generation % 2 == position:
            slots.append(slot)
    slots.sort(key=lambda s: s.generation, reverse=True)
    return slots, written


# --------------------------------------------------------------------------- index


def entry_record_size(name: str, key: bytes, ndim: int) -> int:
    """Encoded size of one index entry, padded to 8 bytes."""
    return align_up(ENTRY_FIXED.size + 8 * ndim + len(name.encode("utf-8")) + len(key), 8)


def index_size(entries: Iterable[Entry]) -> int:
    """Encoded size of an index holding ``entries``."""
    return INDEX_HEAD.size + sum(entry_record_size(e.name, e.key, len(e.shape)) for e in entries)


def encode_entry(entry: Entry) -> bytes:
    """The bytes of one index entry."""
    name = entry.name.encode("utf-8")
    if not 1 <= len(name) <= MAX_NAME_BYTES:
        raise ValueError(f"pack name must be 1..{MAX_NAME_BYTES} UTF-8 bytes, got {len(name)}")
    if len(entry.key) > MAX_KEY_BYTES:
        raise ValueError(f"pack key is {len(entry.key)} bytes of JSON, at most {MAX_KEY_BYTES} allowed")
    if len(entry.shape) > MAX_NDIM:
        raise ValueError(f"pack has {len(entry.shape)} dimensions, at most {MAX_NDIM} allowed")
    if entry.dtype not in _ITEMSIZE:
        raise ValueError(f"dtype code {entry.dtype!r} is not one of {DTYPE_CODES}")
    if len(entry.digest) != 32:
        raise ValueError(f"digest must be 32 bytes, got {len(entry.digest)}")
    if any(d < 0 or d > MAX_DIM for d in entry.shape):
        raise ValueError(f"dimensions must be in [0, 2**63-1], got {entry.shape}")
    if not shape_fits(entry.shape, _ITEMSIZE[entry.dtype]):
        raise ValueError(f"shape {entry.shape} of {entry.dtype} does not fit 2**63-1 bytes (R46)")
    elements = 1
    for d in entry.shape:
        elements *= d
    if elements * _ITEMSIZE[entry.dtype] != entry.nbytes:
        raise ValueError(f"nbytes {entry.nbytes} != shape {entry.shape} x itemsize of {entry.dtype}")
    fixed = ENTRY_FIXED.pack(
        entry.digest, entry.offset, entry.nbytes, entry.crc32, len(name), len(entry.shape), 0,
        entry.dtype.encode("ascii").ljust(4, b"\0"), len(entry.key),
    )  # fmt: skip
    body = fixed + struct.pack(f"<{len(entry.shape)}Q", *entry.shape) + name + entry.key
    return body + bytes(align_up(len(body), 8) - len(body))


def encode_index(entries: Sequence[Entry]) -> bytes:
    """The bytes of an index listing ``entries`` in the given order."""
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"an index holds at most {MAX_ENTRIES} entries")
    return INDEX_HEAD.pack(INDEX_MAGIC, len(entries), 0) + b"".join(encode_entry(e) for e in entries)


def decode_index(buf: bytes | memoryview, slot: Slot, header: Header, *, path: str | None = None) -> dict[str, Entry]:
    """Validate an index against its slot and header; return entries by name.

    ``buf`` must be exactly the ``slot.index_size`` bytes at ``slot.index_offset``.

    The entries are checked all at once, as numpy arrays (:func:`_entries_at_once`); an index that
    fails any rule there is decoded again entry by entry (:func:`_entries_one_by_one`), which names
    the first rule that fails. Both apply the same rules; ``tests/test_format.py`` compares them on
    fuzzed indexes.

    Raises:
        FormatError: naming the first rule of docs/FORMAT.md "Index" that fails.
    """
    base = slot.index_offset

    def fail(message: str, at: int) -> FormatError:
        return FormatError(message, path=path, offset=base + at)

    if len(buf) != slot.index_size:
        raise fail(f"index is {len(buf)} bytes, slot says {slot.index_size}", 0)
    if crc32(buf) != slot.index_crc:
        raise fail("index checksum mismatch", 0)
    if len(buf) < INDEX_HEAD.size:
        raise fail("index shorter than its 16-byte head", 0)
    magic, count, reserved = INDEX_HEAD.unpack_from(buf, 0)
    if magic != INDEX_MAGIC:
        raise fail(f"bad index magic {bytes(magic)!r}", 0)
    if reserved != 0:
        raise fail("reserved index bytes are not zero", 12)
    count = int(count)
    if count != slot.entry_count:
        raise fail(f"index holds {count} entries, slot says {slot.entry_count}", 8)
    if count > MAX_ENTRIES:
        raise fail(f"index holds {count} entries, more than {MAX_ENTRIES}", 8)
    data = bytes(buf)  # slices of bytes are cheap to decode; a memoryview would copy per field
    if count >= _AT_ONCE_FROM:
        entries = _entries_at_once(data, count, header, slot.index_offset)
        if entries is not None:
            return _check_embedded_entries(entries, fail)
    return _check_embedded_entries(_entries_one_by_one(data, count, header, slot.index_offset, fail), fail)


#: From this many entries an index is checked as arrays: below it, numpy's per-call cost outweighs the loop's.
_AT_ONCE_FROM = 16
_FIXED = np.dtype(
    [("digest", "V32"), ("offset", "<u8"), ("nbytes", "<u8"), ("crc", "<u4"), ("name_size", "<u2"),
     ("ndim", "u1"), ("reserved", "u1"), ("dtype", "<u4"), ("key_size", "<u4")]
)  # fmt: skip
assert _FIXED.itemsize == ENTRY_FIXED.size
_SIZES_AT_52 = struct.Struct("<HB5xI")  # name size, ndim, (reserved, dtype), key size: what an entry's length needs
_DTYPE_WORDS = np.array(sorted(int.from_bytes(raw, "little") for raw in _DTYPE_FIELDS), dtype=np.uint32)
_DTYPE_OF_WORD = np.array([_DTYPE_FIELDS[int(w).to_bytes(4, "little")] for w in _DTYPE_WORDS], dtype=object)
_ITEMSIZE_OF_WORD = np.array([_ITEMSIZE[str(code)] for code in _DTYPE_OF_WORD], dtype=np.float64)
_EXACT = float(1 << 53)  # below it, a float64 product of integers is exact when every partial product is


def _entries_at_once(data: bytes, count: int, header: Header, index_offset: int) -> dict[str, Entry] | None:
    """The entries of an index whose every rule holds, checked as arrays; None if any rule fails (or might:
    then :func:`_entries_one_by_one` decides, and names it).

    Only an entry's length is read in a Python loop (it says where the next entry starts). Every check
    is a comparison of arrays that cannot wrap: a sum is formed only where its terms are known to be small,
    and sizes are multiplied in float64 only below 2**53, where the result is exact. What the entries
    hold is converted to Python ints (``tolist``) before anyone computes with it.
    """
    end = len(data)
    if end % 8:
        return None
    positions = [0] * count
    sizes = _SIZES_AT_52.unpack_from
    pos, last = INDEX_HEAD.size, end - ENTRY_FIXED.size
    for number in range(count):
        if pos > last:
            return None
        name_size, ndim, key_size = sizes(data, pos + 52)
        positions[number] = pos
        pos += (ENTRY_FIXED.size + 7 + 8 * ndim + name_size + key_size) & ~7
    if pos != end:
        return None
    at = np.array(positions, dtype=np.intp)
    raw = np.frombuffer(data, np.uint8)
    fixed = raw[at[:, None] + np.arange(ENTRY_FIXED.size)].view(_FIXED)[:, 0]
    offset, nbytes, ndim = fixed["offset"], fixed["nbytes"], fixed["ndim"]
    name_size, key_size = fixed["name_size"].astype(np.intp), fixed["key_size"].astype(np.intp)
    word = np.searchsorted(_DTYPE_WORDS, fixed["dtype"]).clip(0, len(_DTYPE_WORDS) - 1)
    inside = offset <= index_offset
    room = np.where(inside, np.uint64(index_offset) - np.where(inside, offset, 0), 0)
    if not (
        (fixed["reserved"] == 0).all()
        and ((name_size >= 1) & (name_size <= MAX_NAME_BYTES)).all()
        and (ndim <= MAX_NDIM).all()
        and (key_size <= MAX_KEY_BYTES).all()
        and (_DTYPE_WORDS[word] == fixed["dtype"]).all()
        and not (offset & np.uint64(header.alignment - 1)).any()
        and (offset >= header.data_start).all()
        and inside.all()
        and (nbytes <= room).all()
    ):
        return None
    # Shapes: dimension words are 8-aligned (entries are, and the head is 16 bytes).
    ndims = ndim.tolist()
    deepest = max(ndims)
    elements = np.ones(count, np.float64)
    if deepest:
        words = np.frombuffer(data, "<u8")
        columns = np.arange(deepest)
        present = columns < ndim[:, None]
        dims = np.where(present, words[(at[:, None] + ENTRY_FIXED.size) // 8 + np.where(present, columns, 0)], 1)
        if (dims > np.uint64(MAX_DIM)).any():
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            elements = dims.astype(np.float64).prod(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = elements * _ITEMSIZE_OF_WORD[word]
    exact = (expected < _EXACT) & (nbytes < np.uint64(1 << 53))
    if not (exact & (expected == nbytes.astype(np.float64))).all():
        return None
    # Names, keys and padding.
    name_at = at + ENTRY_FIXED.size + 8 * ndim.astype(np.intp)
    key_at = name_at + name_size
    stop = key_at + key_size
    padding = (np.append(at[1:], end) - stop)[:, None]
    spill = np.arange(7)
    pad = raw[np.minimum(stop[:, None] + spill, end - 1)]
    if (np.where(spill < padding, pad, 0) != 0).any():
        return None
    name_starts, key_starts, key_stops = name_at.tolist(), key_at.tolist(), stop.tolist()
    try:
        names = [data[a:b].decode("utf-8") for a, b in zip(name_starts, key_starts, strict=True)]
    except UnicodeDecodeError:
        return None
    # Overlaps: the spans of non-empty packs, in offset order, must not cross.
    full = np.flatnonzero(nbytes)
    if full.size > 1:
        order = full[np.argsort(offset[full], kind="stable")]
        if (offset[order[1:]] < offset[order[:-1]] + nbytes[order[:-1]]).any():
            return None
    offsets, sizes_, crcs = offset.tolist(), nbytes.tolist(), fixed["crc"].tolist()
    dims_of = _DIMS
    shapes = [dims_of[n].unpack_from(data, p + ENTRY_FIXED.size) for p, n in zip(positions, ndims, strict=True)]
    for number in np.flatnonzero(nbytes == 0).tolist():  # R46, rare: the rule an empty pack's shape must keep
        if not shape_fits(shapes[number], _ITEMSIZE[str(_DTYPE_OF_WORD[word[number]])]):
            return None
    keys = [data[a:b] for a, b in zip(key_starts, key_stops, strict=True)]
    codes = _DTYPE_OF_WORD[word].tolist()
    made = map(
        functools.partial(tuple.__new__, Entry),
        zip(names, keys, fixed["digest"].tolist(), codes, shapes, offsets, sizes_, crcs, strict=True),
    )
    entries: dict[str, Entry] = dict(zip(names, made, strict=True))
    if len(entries) != count:
        return None  # a duplicate name
    return entries


def _entries_one_by_one(
    data: bytes, count: int, header: Header, index_offset: int, fail: Callable[[str, int], FormatError]
) -> dict[str, Entry]:
    """The entries of an index, decoded and checked one after the other; raises at the first rule that fails."""
    entries: dict[str, Entry] = {}
    pos = INDEX_HEAD.size
    end = len(data)
    alignment, data_start = header.alignment, header.data_start
    # Hoisted: this loop runs once per pack on every warm open.
    fixed_size, unpack_fixed, dims, itemsizes, codes = (
        ENTRY_FIXED.size,
        ENTRY_FIXED.unpack_from,
        _DIMS,
        _ITEMSIZE,
        _DTYPE_FIELDS,
    )
    new_entry, prod = tuple.__new__, math.prod
    spans: list[tuple[int, int, str]] = []
    # struct hands back Python ints, so the arithmetic below cannot wrap.
    for number in range(count):
        if pos + fixed_size > end:
            raise fail(f"entry {number} runs past the end of the index", pos)
        digest, offset, nbytes, crc, name_size, ndim, reserved, dtype_raw, key_size = unpack_fixed(data, pos)
        if reserved != 0:
            raise fail(f"entry {number}: reserved byte is not zero", pos + 55)
        if not 1 <= name_size <= MAX_NAME_BYTES:
            raise fail(f"entry {number}: name size {name_size} outside 1..{MAX_NAME_BYTES}", pos + 52)
        if ndim > MAX_NDIM:
            raise fail(f"entry {number}: {ndim} dimensions, more than {MAX_NDIM}", pos + 54)
        if key_size > MAX_KEY_BYTES:
            raise fail(f"entry {number}: key size {key_size} exceeds {MAX_KEY_BYTES}", pos + 60)
        code = codes.get(dtype_raw)
        if code is None:
            raise fail(f"entry {number}: unknown dtype code {bytes(dtype_raw)!r}", pos + 56)
        stop = pos + ((fixed_size + 8 * ndim + name_size + key_size + 7) & ~7)
        if stop > end:
            raise fail(f"entry {number} runs past the end of the index", pos)
        cur = pos + fixed_size
        shape = dims[ndim].unpack_from(data, cur)
        cur += 8 * ndim
        if shape and max(shape) > MAX_DIM:
            raise fail(f"entry {number}: dimension larger than 2**63-1", pos + fixed_size)
        try:
            name = data[cur : cur + name_size].decode("utf-8")
        except UnicodeDecodeError:
            raise fail(f"entry {number}: name is not valid UTF-8", cur) from None
        cur += name_size
        key = data[cur : cur + key_size]
        cur += key_size
        if cur != stop and data[cur:stop] != _ZEROS[: stop - cur]:
            raise fail(f"entry {number}: padding bytes are not zero", cur)
        if name in entries:
            raise fail(f"entry {number}: duplicate name {name!r}", pos)
        itemsize = itemsizes[code]
        if prod(shape) * itemsize != nbytes:
            raise fail(f"entry {number} ({name!r}): size {nbytes} != shape {shape} x itemsize", pos + 40)
        # R46: an empty pack whose other dimensions overflow has a valid checksum, yet no array of it can exist
        # (a hit would raise); pinned by
        #   tests/test_format.py::test_reject_empty_entry_whose_other_dimensions_overflow,
        #   tests/test_format.py::test_an_empty_entry_with_an_absurd_shape_is_rejected_never_raised_by_a_load
        if not nbytes and not shape_fits(shape, itemsize):
            raise fail(f"entry {number} ({name!r}): empty shape {shape}, other dimensions over 2**63-1", pos + 64)
        if offset % alignment:
            raise fail(f"entry {number} ({name!r}): offset {offset} not aligned to {alignment}", pos + 32)
        if offset < data_start or offset + nbytes > index_offset:
            raise fail(
                f"entry {number} ({name!r}): data [{offset}, {offset + nbytes}) outside [{data_start}, {index_offset})",
                pos + 32,
            )
        # tuple.__new__: the NamedTuple's own __new__ is a Python call, most of this loop's cost.
        entries[name] = new_entry(Entry, (name, key, digest, code, shape, offset, nbytes, crc))
        if nbytes:
            spans.append((offset, offset + nbytes, name))
        pos = stop
    if pos != end:
        raise fail(f"{end - pos} bytes after the last entry", pos)
    spans.sort()
    for (_, prev_end, prev_name), (start, _, name) in itertools.pairwise(spans):
        if start < prev_end:
            raise fail(f"entries {prev_name!r} and {name!r} overlap at file offset {start}", 0)
    return entries


# --------------------------------------------------------------------------- embedded entries


def embedded_kind(name: str) -> str | None:
    """``"model"`` for the model record's entry, ``"file"`` for an embedded file's, else ``None`` (a pack).

    >>> embedded_kind("packcache.model"), embedded_kind("packcache.file/config.json"), embedded_kind("w")
    ('model', 'file', None)
    """
    if name == MODEL_ENTRY:
        return "model"
    if name.startswith(FILE_PREFIX):
        return "file"
    return None


def file_entry_name(path: str) -> str:
    """The entry name of an embedded file at relative POSIX ``path`` (``1_Pooling/config.json``).

    >>> file_entry_name("1_Pooling/config.json")
    'packcache.file/1_Pooling/config.json'

    Raises:
        ValueError: ``path`` breaks R48 (not a relative path of plain components) or makes a name over R29's cap.
    """
    problem = _file_path_problem(path)
    if problem:
        raise ValueError(f"cannot embed {path!r}: {problem}")
    name = FILE_PREFIX + path
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValueError(f"cannot embed {path[:60]!r}...: the entry name would be over {MAX_NAME_BYTES} bytes")
    return name


def _file_path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path of plain components (R48), or ``None``."""
    if not path:
        return "an empty path"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "not a relative path of plain components (empty, '.' or '..' component, or a leading '/')"
        if "\\" in part or "\0" in part or any(ord(c) < 32 for c in part):
            return "a component holds a backslash, NUL or control character"
        if len(part.encode("utf-8")) > MAX_FILE_COMPONENT:
            return f"a component is over {MAX_FILE_COMPONENT} bytes"
    return None


def embedded_key(kind: str, data: bytes | memoryview | None = None, *, sha256: str | None = None) -> bytes:
    """The canonical key of an embedded entry of ``kind`` (``"model"`` or ``"file"``) holding ``data``: its kind
    and the sha256 of its bytes (R49), so an entry of other bytes is another key. Give the bytes, or their
    ``sha256`` (hex) when it is known without them (a file named by its digest).

    >>> embedded_key("file", b"{}")[:40]
    b'{"kind":"packcache.file","sha256":"44136'
    >>> embedded_key("file", sha256=hashlib.sha256(b"{}").hexdigest()) == embedded_key("file", b"{}")
    True
    """
    if kind not in ("model", "file"):
        raise ValueError(f"no embedded entry kind {kind!r}")
    if (data is None) == (sha256 is None):
        raise TypeError("give the entry's bytes or their sha256, one of them")
    digest = sha256 if sha256 is not None else hashlib.sha256(data or b"").hexdigest()
    return canonical_key({"kind": f"packcache.{kind}", "sha256": digest})


def embedded_problem(entry: Entry) -> str | None:
    """Why an embedded entry breaks R47-R49 (checked from the index alone), or ``None`` (also for a pack).
    Writers check what they are about to store with it (W6)."""
    kind = embedded_kind(entry.name)
    if kind is None:
        return None
    cap = MAX_MODEL_BYTES if kind == "model" else MAX_FILE_BYTES
    if entry.dtype != "u1" or len(entry.shape) != 1:
        return f"embedded entry {entry.name!r} is {entry.dtype} of shape {entry.shape}, not u1 bytes (R47)"
    if entry.nbytes > cap:
        return f"embedded entry {entry.name!r} is {entry.nbytes} bytes, over its cap of {cap} (R47)"
    if kind == "file":
        problem = _file_path_problem(entry.name[len(FILE_PREFIX) :])
        if problem:
            return f"embedded file {entry.name!r}: {problem} (R48)"
    match = _EMBEDDED_KEY.fullmatch(entry.key)
    if match is None or match.group(1).decode() != kind:
        return f"embedded entry {entry.name!r}: its key is not {{kind: packcache.{kind}, sha256}} (R49)"
    return None


def check_embedded(entry: Entry, data: bytes | memoryview, *, path: str | None = None) -> None:
    """Check the bytes read for an embedded entry (R50): its ``data_crc`` and the sha256 its key names.

    Raises:
        FormatError: the bytes are not the ones the index describes.
    """
    if len(data) != entry.nbytes or crc32(data) != entry.crc32:
        raise FormatError(f"embedded entry {entry.name!r}: checksum mismatch (R50)", path=path, offset=entry.offset)
    if embedded_key(embedded_kind(entry.name) or "file", data) != entry.key:
        raise FormatError(
            f"embedded entry {entry.name!r}: its bytes are not the sha256 its key names (R50)",
            path=path, offset=entry.offset,
        )  # fmt: skip


def _check_embedded_entries(entries: dict[str, Entry], fail: Callable[[str, int], FormatError]) -> dict[str, Entry]:
    """R47-R49 over a decoded index (a prefix test per name; the rest only for the few embedded entries)."""
    for name, entry in entries.items():
        if name.startswith("packcache."):
            problem = embedded_problem(entry)
            if problem:
                raise fail(problem, 0)
    return entries


def validate_slot_bounds(slot: Slot, header: Header, file_size: int, *, path: str | None = None) -> None:
    """Check a slot's index lies inside the file and within the caps.

    Raises:
        FormatError: if the index is misplaced, too large, or past the end of the file.
    """
    if slot.index_offset < header.data_start or slot.index_offset % header.alignment:
        raise FormatError(
            f"generation {slot.generation}: index offset {slot.index_offset} is before the data start "
            f"or not aligned to {header.alignment}",
            path=path,
        )
    if not INDEX_HEAD.size <= slot.index_size <= MAX_INDEX_BYTES:
        raise FormatError(
            f"generation {slot.generation}: index size {slot.index_size} outside [16, 256 MiB]", path=path
        )
    if slot.entry_count > MAX_ENTRIES:
        raise FormatError(
            f"generation {slot.generation}: {slot.entry_count} entries, more than {MAX_ENTRIES}", path=path
        )
    if slot.committed_end > file_size:
        raise FormatError(
            f"generation {slot.generation}: index ends at {slot.committed_end}, past the end of the "
            f"{file_size}-byte file (truncated?)",
            path=path,
        )


def numpy_dtype_str(code: str) -> str:
    """The numpy dtype string for a format dtype code (always little-endian).

    >>> numpy_dtype_str("f4"), numpy_dtype_str("u1")
    ('<f4', '|u1')
    """
    return ("|" if _ITEMSIZE[code] == 1 else "<") + code


def compacted_size(entries: Iterable[Entry], header: Header, index_bytes: int | None = None) -> int:
    """Size of a file holding exactly ``entries``, laid out in offset order as compaction does.

    The difference to a file's size is what compaction would reclaim. ``index_bytes``: the
    encoded size of an index listing exactly ``entries``, when the caller knows it already
    (a committed slot's ``index_size``).

    Compaction starts every pack at an aligned offset from the aligned ``data_start``, so each pack
    takes its size rounded up to the alignment whatever the order: a sum, no sort (this runs on
    every session's open).

    >>> header = Header(alignment=64, data_start=4096, platform=b"{}")
    >>> e = Entry("w", b"{}", bytes(32), "u1", (100,), 8192, 100, 0)
    >>> compacted_size([e, e._replace(name="v", offset=4096)], header, 16)
    4368
    """
    if not isinstance(entries, Collection):
        entries = list(entries)  # read twice below
    mask = header.alignment - 1
    data = sum((entry.nbytes + mask) & ~mask for entry in entries)
    return header.data_start + data + (index_size(entries) if index_bytes is None else index_bytes)
