"""The cache file layout of docs/FORMAT.md, byte by byte.

Hostile inputs are built field by field with ``struct`` from the offsets in
docs/FORMAT.md, not by the encoder under test, so the tests pin the layout
rather than whatever the encoder happens to emit. Index-level attacks come with
a matching index checksum and commit slot, so that the rule under test is the
one that fires; every rejection test checks the message to prove it.

Each ``test_reject_*`` test is named in the "Readers MUST reject" list of
docs/FORMAT.md next to its rule id; ``test_format_md_names_a_test_for_every_rule``
keeps the two in step.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import packcache
from harness import KEY
from packcache import WeightCache
from packcache import format as fmt
from packcache.errors import FormatError

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"

MAGIC = b"\x89PKC\r\n\x1a\n"
SLOT_MAGIC = b"PKCSLOT1"
INDEX_MAGIC = b"PKCINDEX"
PLATFORM = b'{"a":1}'
HEADER = fmt.Header(alignment=64, data_start=4096, platform=PLATFORM)
INDEX_AT = 8192  # where the hand-built indexes below pretend to live: data may use [4096, 8192)
ITEMSIZE = {b"b1": 1, b"i1": 1, b"u1": 1, b"i2": 2, b"u2": 2, b"f2": 2, b"i4": 4, b"u4": 4, b"f4": 4,
            b"i8": 8, b"u8": 8, b"f8": 8, b"c8": 8, b"c16": 16}  # fmt: skip

FUZZ = settings(max_examples=300, deadline=None, database=None)  # fast, and no example database to keep
PREAMBLE_OR_FINGERPRINT = st.one_of(st.integers(0, 127), st.integers(0, 2047))  # never the slots at 2048


def crc(data: bytes | bytearray) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def rejects(match: str, func: Callable[..., Any], *args: Any, offset: int | None = None, **kwargs: Any) -> FormatError:
    """Call ``func`` and require a FormatError (a ValueError) whose message matches ``match``."""
    with pytest.raises(FormatError, match=match) as info:
        func(*args, **kwargs)
    assert type(info.value) is FormatError
    assert isinstance(info.value, ValueError)
    if offset is not None:
        assert info.value.offset == offset
    return info.value


# --------------------------------------------------------------------------- hand-built bytes


def raw_header(
    *,
    magic: bytes = MAGIC,
    version: int = 2,
    alignment: int = 64,
    data_start: int = 4096,
    platform: bytes = PLATFORM,
    psize: int | None = None,
    pcrc: int | None = None,
    reserved: bytes = bytes(32),
    checksum: int | None = None,
) -> bytes:
    """A header region: the 64-byte preamble at 0, the fingerprint at 64, zeros."""
    head = magic  # 0: 8 bytes
    head += struct.pack("<I", version)  # 8
    head += struct.pack("<I", alignment)  # 12
    head += struct.pack("<I", data_start)  # 16
    head += struct.pack("<I", len(platform) if psize is None else psize)  # 20
    head += struct.pack("<I", crc(platform) if pcrc is None else pcrc)  # 24
    head += reserved  # 28: 32 bytes
    head += struct.pack("<I", crc(head) if checksum is None else checksum)  # 60
    assert len(head) == 64
    region = bytearray(4096)
    region[0:64] = head
    region[64 : 64 + len(platform)] = platform
    return bytes(region)


def raw_slot(
    *,
    magic: bytes = SLOT_MAGIC,
    generation: int = 1,
    index_offset: int = INDEX_AT,
    index_size: int = 16,
    count: int = 0,
    index_crc: int = 0,
    reserved: bytes = bytes(20),
    checksum: int | None = None,
) -> bytes:
    """A 64-byte commit slot."""
    body = magic + struct.pack("<QQQII", generation, index_offset, index_size, count, index_crc) + reserved
    body += struct.pack("<I", crc(body) if checksum is None else checksum)
    assert len(body) == 64
    return body


def with_slots(slot0: bytes = bytes(64), slot1: bytes = bytes(64)) -> bytes:
    """A valid header region with the given bytes in the two commit slots."""
    region = bytearray(raw_header())
    region[2048:2112] = slot0
    region[3072:3136] = slot1
    return bytes(region)


def raw_entry(
    *,
    name: bytes = b"w",
    key: bytes = b"{}",
    dtype: bytes = b"f4",
    shape: tuple[int, ...] = (2, 3),
    offset: int = 4096,
    nbytes: int | None = None,
    data_crc: int = 0,
    name_size: int | None = None,
    ndim: int | None = None,
    key_size: int | None = None,
    reserved: int = 0,
    digest: bytes | None = None,
    padding: bytes | None = None,
) -> bytes:
    """One index entry: 64-byte fixed part, dims, name, key, zero padding to 8 bytes."""
    if nbytes is None:
        nbytes = math.prod(shape) * ITEMSIZE.get(dtype.rstrip(b"\0"), 1)
    if digest is None:
        digest = hashlib.sha256(b"packcache-key\0" + name + b"\0" + key).digest()
    fixed = digest  # 0: 32 bytes
    fixed += struct.pack("<Q", offset)  # 32
    fixed += struct.pack("<Q", nbytes)  # 40
    fixed += struct.pack("<I", data_crc)  # 48
    fixed += struct.pack("<H", len(name) if name_size is None else name_size)  # 52
    fixed += struct.pack("<B", len(shape) if ndim is None else ndim)  # 54
    fixed += struct.pack("<B", reserved)  # 55
    fixed += dtype.ljust(4, b"\0")  # 56: 4 bytes
    fixed += struct.pack("<I", len(key) if key_size is None else key_size)  # 60
    assert len(fixed) == 64
    body = fixed + b"".join(struct.pack("<Q", d) for d in shape) + name + key
    if padding is None:
        padding = bytes(-len(body) % 8)
    return body + padding


def raw_index(*entries: bytes, count: int | None = None, magic: bytes = INDEX_MAGIC, reserved: int = 0) -> bytes:
    """A 16-byte index head followed by ``entries``."""
    return magic + struct.pack("<II", len(entries) if count is None else count, reserved) + b"".join(entries)


def slot_for(index: bytes, *, count: int | None = None, index_offset: int = INDEX_AT) -> fmt.Slot:
    """The commit slot that matches ``index``: its size, checksum and (by default) its own entry count."""
    if count is None:
        count = struct.unpack_from("<I", index, 8)[0] if len(index) >= 12 else 0
    return fmt.Slot(
        generation=1, index_offset=index_offset, index_size=len(index), entry_count=count, index_crc=crc(index)
    )


def decode(index: bytes, *, count: int | None = None, index_offset: int = INDEX_AT) -> dict[str, fmt.Entry]:
    return fmt.decode_index(index, slot_for(index, count=count, index_offset=index_offset), HEADER)


# --------------------------------------------------------------------------- golden bytes

GOLDEN_PREAMBLE = bytes.fromhex(
    "89504b430d0a1a0a" "02000000" "40000000" "00100000" "07000000" "afac1b56"
    "0000000000000000000000000000000000000000000000000000000000000000" "83a2c8d1"
    "7b2261223a317d"
)  # fmt: skip

GOLDEN_SLOT = bytes.fromhex(
    "504b43534c4f5431" "0700000000000000" "0020000000000000" "6800000000000000" "01000000" "78563412"
    "0000000000000000000000000000000000000000" "a02acbd6"
)  # fmt: skip

GOLDEN_INDEX = bytes.fromhex(
    "504b43494e444558" "01000000" "00000000"
    "4f172dfd299766ebc20e68aedc1032f0d2451214c87012d1661e56410c2afd70" "0010000000000000" "1800000000000000"
    "efbeadde" "0100" "02" "00" "66340000" "02000000"
    "0200000000000000" "0300000000000000" "77" "7b7d" "0000000000"
)  # fmt: skip


def test_golden_header_bytes() -> None:
    header = fmt.encode_header(64, PLATFORM)
    assert header == GOLDEN_PREAMBLE.ljust(4096, b"\0")
    assert header == raw_header()
    assert header[0:8] == MAGIC
    assert struct.unpack_from("<IIIII", header, 8) == (2, 64, 4096, 7, zlib.crc32(PLATFORM))
    assert header[28:60] == bytes(32)
    assert struct.unpack_from("<I", header, 60)[0] == zlib.crc32(header[:60])
    assert header[64:71] == PLATFORM


def test_golden_slot_bytes() -> None:
    slot = fmt.Slot(generation=7, index_offset=8192, index_size=104, entry_count=1, index_crc=0x12345678)
    raw = fmt.encode_slot(slot)
    assert raw == GOLDEN_SLOT
    assert raw[0:8] == SLOT_MAGIC
    assert struct.unpack_from("<QQQII", raw, 8) == (7, 8192, 104, 1, 0x12345678)
    assert raw[40:60] == bytes(20)
    assert struct.unpack_from("<I", raw, 60)[0] == zlib.crc32(raw[:60])


def test_golden_one_entry_index_bytes() -> None:
    digest = hashlib.sha256(b"packcache-key\0w\0{}").digest()
    entry = fmt.Entry("w", b"{}", digest, "f4", (2, 3), offset=4096, nbytes=24, crc32=0xDEADBEEF)
    raw = fmt.encode_index([entry])
    assert raw == GOLDEN_INDEX
    assert len(raw) == fmt.index_size([entry]) == 16 + 88
    assert raw[0:8] == INDEX_MAGIC and struct.unpack_from("<II", raw, 8) == (1, 0)
    e = raw[16:]
    assert e[0:32] == digest == fmt.key_digest("w", b"{}")
    assert struct.unpack_from("<QQIHBB", e, 32) == (4096, 24, 0xDEADBEEF, 1, 2, 0)
    assert e[56:60] == b"f4\0\0" and struct.unpack_from("<I", e, 60)[0] == 2
    assert struct.unpack_from("<2Q", e, 64) == (2, 3)
    assert e[80:81] == b"w" and e[81:83] == b"{}" and e[83:88] == bytes(5)
    assert raw == raw_index(raw_entry(data_crc=0xDEADBEEF))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("alignment", [64, 128, 4096, 8192, 1 << 16, 1 << 20])
@pytest.mark.parametrize("platform", [b"", PLATFORM, b"{" + b"x" * 1982 + b"}"])
def test_header_round_trip(alignment: int, platform: bytes) -> None:
    raw = fmt.encode_header(alignment, platform)
    assert len(raw) == max(4096, alignment)
    header = fmt.decode_header(raw[:4096])
    assert header == fmt.Header(alignment=alignment, data_start=max(4096, alignment), platform=platform)
    assert fmt.choose_slot(raw) == ([], False)


@pytest.mark.parametrize("alignment", [0, 32, 63, 96, 1 << 21])
def test_encode_header_refuses_bad_alignment(alignment: int) -> None:
    with pytest.raises(ValueError, match="alignment"):
        fmt.encode_header(alignment, b"{}")


def test_encode_header_refuses_platform_overrunning_slots() -> None:
    with pytest.raises(ValueError, match="at most 1984"):
        fmt.encode_header(64, b"x" * 1985)


@pytest.mark.parametrize("generation", [1, 2, 2**64 - 2])
def test_slot_round_trip(generation: int) -> None:
    slot = fmt.Slot(generation, index_offset=2**40, index_size=256 << 20, entry_count=10**6, index_crc=0xFFFFFFFF)
    raw = fmt.encode_slot(slot)
    assert len(raw) == 64
    assert fmt.decode_slot(raw) == slot
    assert slot.committed_end == 2**40 + (256 << 20)


def mixed_entries() -> list[fmt.Entry]:
    specs = [
        ("encoder.layers.0.attn.q_proj.weight", "f4", (3, 4)),
        ("scalar", "i8", ()),  # 0-d: one element
        ("empty", "u1", (0, 5)),  # zero-size
        ("层.0.权重", "c16", (2,)),
        ("naïve 🙂 name", "f2", (1, 1, 7)),
        ("mask", "b1", (5,)),
        ("also-empty", "f8", (4, 0)),
    ]
    entries, offset = [], 4096
    for number, (name, dtype, shape) in enumerate(specs):
        key = fmt.canonical_key({"packer": "identity", "version": number, "shape": list(shape), "note": name})
        nbytes = math.prod(shape) * int(dtype[1:])
        entries.append(fmt.Entry(name, key, fmt.key_digest(name, key), dtype, shape, offset, nbytes, number * 7919))
        offset = fmt.align_up(offset + nbytes, 64)
    return entries


def test_index_round_trip_mixed_dtypes_shapes_and_unicode_names() -> None:
    entries = mixed_entries()
    raw = fmt.encode_index(entries)
    assert len(raw) == fmt.index_size(entries)
    assert len(raw) % 8 == 0
    decoded = decode(raw)
    assert decoded == {e.name: e for e in entries}
    assert list(decoded) == [e.name for e in entries]
    assert decoded["scalar"].shape == () and decoded["scalar"].nbytes == 8
    assert decoded["empty"].nbytes == 0


def test_empty_index_round_trip() -> None:
    raw = fmt.encode_index([])
    assert raw == INDEX_MAGIC + bytes(8)
    assert decode(raw) == {}


def test_zero_size_entries_may_share_an_offset_with_data() -> None:
    index = raw_index(
        raw_entry(name=b"a", dtype=b"u1", shape=(64,), offset=4096),
        raw_entry(name=b"b", dtype=b"u1", shape=(0,), offset=4096),
        raw_entry(name=b"c", dtype=b"f4", shape=(0, 3), offset=4096),
        raw_entry(name=b"d", dtype=b"u1", shape=(0,), offset=INDEX_AT),  # ends exactly at the index
    )
    assert set(decode(index)) == {"a", "b", "c", "d"}


def test_adjacent_entries_do_not_overlap() -> None:
    index = raw_index(
        raw_entry(name=b"b", dtype=b"u1", shape=(64,), offset=4160),
        raw_entry(name=b"a", dtype=b"f8", shape=(8,), offset=4096),
        raw_entry(name=b"c", dtype=b"u1", shape=(4096 - 128,), offset=4224),
    )
    assert [(e.offset, e.nbytes) for e in decode(index).values()] == [(4160, 64), (4096, 64), (4224, 3968)]


def test_entry_data_may_end_exactly_at_the_index() -> None:
    index = raw_index(raw_entry(dtype=b"u1", shape=(4096,), offset=4096))
    assert decode(index)["w"].nbytes == 4096


def test_caps_are_inclusive() -> None:
    name, key, shape = b"n" * 1024, b"k" * 65536, (1,) * 32
    index = raw_index(raw_entry(name=name, key=key, dtype=b"u1", shape=shape))
    entry = decode(index)[name.decode()]
    assert entry.key == key and entry.shape == shape
    assert fmt.encode_index([entry]) == index
    widest = raw_index(raw_entry(dtype=b"u1", shape=(2**63 - 1, 0)))  # the largest dimension, zero bytes
    assert decode(widest)["w"].shape == (2**63 - 1, 0)


def test_encoder_refuses_what_readers_reject() -> None:
    base = fmt.Entry("w", b"{}", bytes(32), "f4", (1,), 4096, 4, 0)
    for bad, match in [
        (dict(name=""), "name"),
        (dict(name="é" * 513), "name"),
        (dict(key=b"k" * 65537), "key"),
        (dict(shape=(1,) * 33), "dimensions"),
        (dict(dtype="f16"), "dtype"),
        (dict(dtype=">f4"), "dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            fmt.encode_entry(base._replace(**bad))
    with pytest.raises(ValueError, match="at most 1000000 entries"):
        fmt.encode_index([base] * 1_000_001)  # refused before anything is encoded


def test_key_digest_is_sha256_of_prefixed_name_and_key() -> None:
    key = fmt.canonical_key({"packer": "q4", "v": 2})
    assert fmt.key_digest("层", key) == hashlib.sha256(b"packcache-key\x00\xe5\xb1\x82\x00" + key).digest()
    assert fmt.key_digest("a", b"{}") != fmt.key_digest("a", b"{ }")


def test_canonical_key_is_sorted_compact_ascii_json() -> None:
    assert fmt.canonical_key(None) == b"{}"
    assert fmt.canonical_key({"b": [1, 2.5, None, True], "a": {"z": "x", "y": "é🙂"}}) == (
        b'{"a":{"y":"\\u00e9\\ud83d\\ude42","z":"x"},"b":[1,2.5,null,true]}'
    )
    for bad in [{"x": float("nan")}, {"x": float("inf")}, {"x": object()}, [1, 2]]:
        with pytest.raises(TypeError):
            fmt.canonical_key(bad)


@pytest.mark.parametrize("code", fmt.DTYPE_CODES)
def test_dtype_codes_are_little_endian_numpy_dtypes(code: str) -> None:
    dtype = np.dtype(fmt.numpy_dtype_str(code))
    assert dtype.itemsize == int(code[1:]) == ITEMSIZE[code.encode()]
    assert dtype == dtype.newbyteorder("<")
    assert dtype.kind == code[0]


def test_fixed_offsets() -> None:
    assert fmt.MAGIC == MAGIC and fmt.FORMAT_VERSION == 2 and fmt.HEADER_READ_SIZE == 4096
    assert (fmt.slot_offset(0), fmt.slot_offset(1)) == (2048, 3072)
    assert [fmt.data_start_for(a) for a in (64, 4096, 8192, 1 << 20)] == [4096, 4096, 8192, 1 << 20]
    assert set(fmt.DTYPE_CODES) == {c.decode() for c in ITEMSIZE}


# --------------------------------------------------------------------------- R1-R9: header


def test_reject_file_shorter_than_header() -> None:
    for size in (0, 63, 64, 4095):
        rejects(f"file is {size} bytes, shorter than the 4096-byte header", fmt.decode_header, raw_header()[:size])


@pytest.mark.parametrize(
    "magic", [b"\x89PNG\r\n\x1a\n", b"\x89PKC\n\r\x1a\n", b"\x89pkc\r\n\x1a\n", bytes(8), b"GGUF\x03\0\0\0"]
)
def test_reject_preamble_bad_magic(magic: bytes) -> None:
    rejects("bad magic .*not a packcache file", fmt.decode_header, raw_header(magic=magic), offset=0)


def test_reject_preamble_crc_mismatch() -> None:
    good = raw_header()
    rejects("preamble checksum mismatch", fmt.decode_header, raw_header(checksum=crc(good[:60]) ^ 1), offset=60)
    # Any single changed field without a fresh checksum: the checksum rule fires first.
    rejects("preamble checksum mismatch", fmt.decode_header, good[:12] + b"\x80" + good[13:], offset=60)


@pytest.mark.parametrize("version", [0, 1, 3, 0xFFFFFFFF])
def test_reject_unsupported_format_version(version: int) -> None:
    rejects(f"format version {version} is not supported", fmt.decode_header, raw_header(version=version), offset=8)


@pytest.mark.parametrize("position", [0, 17, 31])
def test_reject_preamble_reserved_nonzero(position: int) -> None:
    reserved = bytearray(32)
    reserved[position] = 1
    raw = raw_header(reserved=bytes(reserved))
    rejects("reserved preamble bytes are not zero", fmt.decode_header, raw, offset=28)


@pytest.mark.parametrize("alignment", [0, 1, 32, 63, 96, 4097, 1 << 21, 0x80000000, 0xFFFFFFFF])
def test_reject_alignment_not_power_of_two_in_range(alignment: int) -> None:
    raw = raw_header(alignment=alignment, data_start=max(4096, alignment))
    rejects(f"alignment {alignment} is not a power of two", fmt.decode_header, raw, offset=12)


@pytest.mark.parametrize(("alignment", "data_start"), [(64, 0), (64, 64), (64, 8192), (8192, 4096), (1 << 20, 4096)])
def test_reject_data_start_not_max_4096_alignment(alignment: int, data_start: int) -> None:
    raw = raw_header(alignment=alignment, data_start=data_start)
    rejects(f"data start {data_start} != max", fmt.decode_header, raw, offset=16)


@pytest.mark.parametrize("psize", [1985, 4096, 0xFFFFFFFF])
def test_reject_platform_size_overrunning_slots(psize: int) -> None:
    raw = raw_header(psize=psize)
    rejects(f"platform fingerprint size {psize} exceeds 1984", fmt.decode_header, raw, offset=20)


def test_reject_platform_crc_mismatch() -> None:
    rejects("platform fingerprint checksum mismatch", fmt.decode_header, raw_header(pcrc=crc(PLATFORM) ^ 1), offset=64)
    # The size field claims one byte fewer than was written: the checksum covers the wrong span.
    rejects("platform fingerprint checksum mismatch", fmt.decode_header, raw_header(psize=6, pcrc=crc(PLATFORM)))


# --------------------------------------------------------------------------- R10-R14: commit slots


def assert_slot_ignored(raw: bytes) -> None:
    """An invalid slot is skipped (it may be a torn write), never an exception by itself."""
    assert fmt.decode_slot(raw) is None
    assert fmt.choose_slot(with_slots(slot0=raw)) == ([], True)
    good = fmt.decode_slot(raw_slot(generation=3))
    assert fmt.choose_slot(with_slots(slot0=raw, slot1=raw_slot(generation=3))) == ([good], True)


@pytest.mark.parametrize("magic", [b"PKCSLOT2", b"pkcslot1", bytes(8)])
def test_reject_slot_bad_magic(magic: bytes) -> None:
    assert_slot_ignored(raw_slot(magic=magic, generation=9))


def test_reject_slot_crc_mismatch_torn_write() -> None:
    new, old = raw_slot(generation=9, index_size=4096), raw_slot(generation=8)
    assert_slot_ignored(new[:30] + old[30:])  # half of the new record over the old one
    assert_slot_ignored(raw_slot(generation=9, checksum=crc(new[:60]) ^ 0x80000000))


def test_reject_slot_reserved_nonzero() -> None:
    assert_slot_ignored(raw_slot(generation=9, reserved=b"\x01" + bytes(19)))


def test_reject_slot_generation_zero() -> None:
    assert_slot_ignored(raw_slot(generation=0))


def test_reject_slot_generation_reserved_maximum() -> None:
    assert_slot_ignored(raw_slot(generation=2**64 - 1))
    assert fmt.decode_slot(raw_slot(generation=2**64 - 2)) is not None


def test_reject_garbage_in_both_slots() -> None:
    garbage = bytes(range(64))
    assert fmt.choose_slot(with_slots(garbage, garbage)) == ([], True)
    assert fmt.choose_slot(with_slots(slot1=b"\0" * 63 + b"\x01")) == ([], True)  # one stray byte is "written"


# --------------------------------------------------------------------------- choose_slot


def test_choose_slot_newest_valid_first() -> None:
    for older, newer in ((41, 42), (42, 43)):
        a = raw_slot(generation=older, index_offset=4096)
        b = raw_slot(generation=newer, index_offset=8192)
        region = with_slots(a, b) if older % 2 == 0 else with_slots(b, a)  # generation g sits in slot g % 2
        slots, written = fmt.choose_slot(region)
        assert written
        assert [(s.generation, s.index_offset) for s in slots] == [(newer, 8192), (older, 4096)]


def test_reject_slot_generation_in_wrong_position() -> None:
    even, odd = raw_slot(generation=42), raw_slot(generation=41)
    assert [s.generation for s in fmt.choose_slot(with_slots(even, odd))[0]] == [42, 41]
    swapped, written = fmt.choose_slot(with_slots(odd, even))
    assert written and swapped == [], "a generation in the other parity's slot must be ignored"
    only_wrong, written = fmt.choose_slot(with_slots(slot1=raw_slot(generation=2)))
    assert written and only_wrong == []


def test_choose_slot_torn_newest_falls_back_to_older() -> None:
    old, new = raw_slot(generation=41), raw_slot(generation=42)
    torn = new[:40] + bytes(24)  # the write stopped mid-record
    slots, written = fmt.choose_slot(with_slots(torn, old))  # 42 belongs in slot 0, 41 in slot 1
    assert written and [s.generation for s in slots] == [41]


def test_choose_slot_both_zero_is_empty_cache() -> None:
    assert fmt.choose_slot(with_slots()) == ([], False)
    assert fmt.choose_slot(fmt.encode_header(1 << 16, PLATFORM)[:4096]) == ([], False)


def test_choose_slot_one_zero_one_valid() -> None:
    slots, written = fmt.choose_slot(with_slots(slot1=raw_slot(generation=1)))
    assert written and [s.generation for s in slots] == [1]


def test_choose_slot_ignores_bytes_outside_the_slots() -> None:
    region = bytearray(with_slots())
    region[2112:3072] = b"\xff" * (3072 - 2112)
    region[3136:4096] = b"\xff" * (4096 - 3136)
    assert fmt.choose_slot(bytes(region)) == ([], False)


# --------------------------------------------------------------------------- R15-R19: slot bounds


def bounds(**fields: int) -> fmt.Slot:
    values = dict(generation=5, index_offset=INDEX_AT, index_size=16, entry_count=0, index_crc=0) | fields
    return fmt.Slot(**values)


def test_slot_bounds_accept_an_index_at_the_end_of_the_file() -> None:
    fmt.validate_slot_bounds(
        bounds(index_offset=4096, index_size=256 << 20, entry_count=10**6), HEADER, 4096 + (256 << 20)
    )


@pytest.mark.parametrize("index_offset", [0, 64, 2048, 4032])
def test_reject_index_offset_inside_header(index_offset: int) -> None:
    rejects("before the data start", fmt.validate_slot_bounds, bounds(index_offset=index_offset), HEADER, 1 << 20)


@pytest.mark.parametrize("index_offset", [4097, 4100, 8192 + 32])
def test_reject_index_offset_unaligned(index_offset: int) -> None:
    rejects("not aligned to 64", fmt.validate_slot_bounds, bounds(index_offset=index_offset), HEADER, 1 << 20)
    big = fmt.Header(alignment=1 << 16, data_start=1 << 16, platform=b"")
    rejects("not aligned to 65536", fmt.validate_slot_bounds, bounds(index_offset=(1 << 16) + 4096), big, 1 << 20)


@pytest.mark.parametrize("index_size", [0, 8, 15, (256 << 20) + 1, 2**64 - 1])
def test_reject_index_size_outside_caps(index_size: int) -> None:
    slot = bounds(index_size=index_size)
    rejects(rf"index size {index_size} outside \[16, 256 MiB\]", fmt.validate_slot_bounds, slot, HEADER, 2**65)


def test_reject_slot_entry_count_over_cap() -> None:
    slot = bounds(entry_count=1_000_001)
    rejects("1000001 entries, more than 1000000", fmt.validate_slot_bounds, slot, HEADER, 1 << 20)


def test_reject_index_past_end_of_file() -> None:
    slot = bounds(index_offset=INDEX_AT, index_size=104)
    fmt.validate_slot_bounds(slot, HEADER, INDEX_AT + 104)
    rejects("index ends at 8296, past the end of the 8295-byte file", fmt.validate_slot_bounds, slot, HEADER, 8295)
    # A huge offset is compared as a Python int, it does not wrap.
    slot = bounds(index_offset=2**64 - 64, index_size=128)
    rejects("past the end", fmt.validate_slot_bounds, slot, HEADER, 1 << 20)


# --------------------------------------------------------------------------- R20-R26: index head


def test_reject_index_length_not_matching_slot() -> None:
    index = raw_index(raw_entry())
    slot = slot_for(index)
    for buf in (index[:-8], index + bytes(8)):
        rejects(f"index is {len(buf)} bytes, slot says {len(index)}", fmt.decode_index, buf, slot, HEADER)


def test_reject_index_crc_mismatch() -> None:
    index = raw_index(raw_entry())
    slot = slot_for(index)
    flipped = index[:100] + bytes([index[100] ^ 1]) + index[101:]
    rejects("index checksum mismatch", fmt.decode_index, flipped, slot, HEADER, offset=INDEX_AT)
    stale = fmt.Slot(1, INDEX_AT, len(index), 1, crc(index) ^ 1)
    rejects("index checksum mismatch", fmt.decode_index, index, stale, HEADER)


@pytest.mark.parametrize("index", [b"", INDEX_MAGIC, INDEX_MAGIC + bytes(7)])
def test_reject_index_shorter_than_head(index: bytes) -> None:
    slot = fmt.Slot(1, INDEX_AT, len(index), 0, crc(index))
    rejects("index shorter than its 16-byte head", fmt.decode_index, index, slot, HEADER)


def test_reject_index_bad_magic() -> None:
    rejects("bad index magic b'PKCINDEY'", decode, raw_index(raw_entry(), magic=b"PKCINDEY"))
    rejects("bad index magic", decode, raw_index(magic=bytes(8)))


def test_reject_index_reserved_nonzero() -> None:
    rejects("reserved index bytes are not zero", decode, raw_index(raw_entry(), reserved=1), offset=INDEX_AT + 12)


def test_reject_entry_count_not_matching_slot() -> None:
    index = raw_index(raw_entry())
    rejects("index holds 1 entries, slot says 2", decode, index, count=2, offset=INDEX_AT + 8)
    rejects("index holds 1 entries, slot says 0", decode, index, count=0)


def test_reject_index_entry_count_over_cap() -> None:
    index = raw_index(count=1_000_001)
    rejects("index holds 1000001 entries, more than 1000000", decode, index, offset=INDEX_AT + 8)
    rejects("more than 1000000", decode, raw_index(count=0xFFFFFFFF))
    # Exactly at the cap is allowed: the walk over the (missing) entries fails instead.
    rejects("entry 0 runs past the end of the index", decode, raw_index(count=1_000_000))


# --------------------------------------------------------------------------- R27-R42: entries


@pytest.mark.parametrize("keep", [0, 8, 63])
def test_reject_entry_truncated_fixed_part(keep: int) -> None:
    index = raw_index(raw_entry()[:keep], count=1)
    rejects("entry 0 runs past the end of the index", decode, index, offset=INDEX_AT + 16)


def test_reject_entry_truncated_second_entry() -> None:
    index = raw_index(raw_entry(name=b"a"), raw_entry(name=b"b", offset=4160)[:40])
    rejects("entry 1 runs past the end of the index", decode, index, offset=INDEX_AT + 16 + 88)


def test_reject_entry_reserved_nonzero() -> None:
    rejects(
        "entry 0: reserved byte is not zero", decode, raw_index(raw_entry(reserved=0x80)), offset=INDEX_AT + 16 + 55
    )


def test_reject_name_size_zero_or_over_cap() -> None:
    rejects("entry 0: name size 0 outside 1..1024", decode, raw_index(raw_entry(name=b"")), offset=INDEX_AT + 16 + 52)
    long_name = raw_index(raw_entry(name=b"n" * 1025))
    rejects("entry 0: name size 1025 outside 1..1024", decode, long_name)
    # A size field of 65535 over a short name: the cap fires before any bounds arithmetic.
    rejects("name size 65535 outside", decode, raw_index(raw_entry(name_size=0xFFFF)))


def test_reject_ndim_over_cap() -> None:
    index = raw_index(raw_entry(dtype=b"u1", shape=(1,) * 33))
    rejects("entry 0: 33 dimensions, more than 32", decode, index, offset=INDEX_AT + 16 + 54)
    rejects("255 dimensions", decode, raw_index(raw_entry(ndim=255)))


def test_reject_key_size_over_cap() -> None:
    index = raw_index(raw_entry(key=b"k" * 65537))
    rejects("entry 0: key size 65537 exceeds 65536", decode, index, offset=INDEX_AT + 16 + 60)
    rejects("key size 4294967295 exceeds", decode, raw_index(raw_entry(key_size=0xFFFFFFFF)))


@pytest.mark.parametrize(
    "dtype",
    [
        b"f3",
        b"f16",
        b"F4",
        b"<f4",
        b">f4",
        b"=f4",
        b"f4\0x",
        b"f\x004",
        b"\0f4",
        b"",
        b"bf16",
        b"\xff\xfe\xfd\xfc",
        b"O8",
    ],
)
def test_reject_unknown_dtype_code(dtype: bytes) -> None:
    index = raw_index(raw_entry(dtype=dtype, shape=(4,), nbytes=16))
    rejects("entry 0: unknown dtype code", decode, index, offset=INDEX_AT + 16 + 56)


def test_reject_entry_name_runs_past_index_end() -> None:
    # The fixed part fits, but its sizes claim more bytes than the index holds.
    for attack in (dict(name_size=200), dict(key_size=60000), dict(ndim=32)):
        index = raw_index(raw_entry(**attack))
        rejects("entry 0 runs past the end of the index", decode, index, offset=INDEX_AT + 16)
    # Two entries whose sizes are each plausible but the first swallows the second.
    index = raw_index(raw_entry(name=b"a", key_size=2 + 88 + 8), raw_entry(name=b"b", offset=4160))
    rejects("entry 0 runs past the end of the index", decode, index)


@pytest.mark.parametrize("dim", [2**63, 2**64 - 1])
def test_reject_dimension_above_int64_max(dim: int) -> None:
    index = raw_index(raw_entry(dtype=b"u1", shape=(dim,), nbytes=dim))
    rejects(r"entry 0: dimension larger than 2\*\*63-1", decode, index, offset=INDEX_AT + 16 + 64)


@pytest.mark.parametrize("name", [b"\xff", b"w\xc3", b"\xed\xa0\x80", b"\xc0\xaf"])
def test_reject_name_invalid_utf8(name: bytes) -> None:
    rejects("entry 0: name is not valid UTF-8", decode, raw_index(raw_entry(name=name)), offset=INDEX_AT + 16 + 80)


@pytest.mark.parametrize("padding", [b"\0\0\0\0\x01", b"\x01\0\0\0\0", b"\xff" * 5])
def test_reject_entry_padding_nonzero(padding: bytes) -> None:
    index = raw_index(raw_entry(padding=padding))
    rejects("entry 0: padding bytes are not zero", decode, index, offset=INDEX_AT + 16 + 83)


def test_reject_duplicate_name() -> None:
    index = raw_index(raw_entry(name=b"w"), raw_entry(name=b"w", offset=4160))
    rejects("entry 1: duplicate name 'w'", decode, index, offset=INDEX_AT + 16 + 88)
    # Equal after decoding only, never byte-equal: no normalisation, so these are different names.
    nfc, nfd = "é".encode(), "e\u0301".encode()
    assert set(decode(raw_index(raw_entry(name=nfc), raw_entry(name=nfd, offset=4160)))) == {"é", "e\u0301"}


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [
        (b"f4", (2, 3), 25),
        (b"f4", (2, 3), 6),
        (b"i8", (), 0),
        (b"u1", (0, 5), 1),
        (b"c16", (2,), 16),
        (b"f4", (1,), 2**64 - 1),
    ],
)
def test_reject_size_not_matching_shape(dtype: bytes, shape: tuple[int, ...], nbytes: int) -> None:
    index = raw_index(raw_entry(dtype=dtype, shape=shape, nbytes=nbytes))
    rejects(f"entry 0 \\('w'\\): size {nbytes} != shape", decode, index, offset=INDEX_AT + 16 + 40)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (b"u1", (2**32, 2**32)),
        (b"f4", (2**62, 4)),
        (b"c16", (2**60,)),
        (b"u1", (2**16,) * 4),
        (b"f8", (2**61, 2**62, 2)),
    ],
)
def test_reject_huge_dimension_wraparound(dtype: bytes, shape: tuple[int, ...]) -> None:
    # Every dim fits in int64, but the byte count is a multiple of 2**64: in uint64 arithmetic
    # (numpy, C) it wraps to exactly the 0 stored here and a zero-size entry would pass.
    assert all(d < 2**63 for d in shape)
    assert math.prod(shape) * ITEMSIZE[dtype] % 2**64 == 0
    index = raw_index(raw_entry(dtype=dtype, shape=shape, nbytes=0))
    rejects(r"entry 0 \('w'\): size 0 != shape", decode, index)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(b"f8", (2**62, 0)), (b"i1", (2**40, 2**23, 0)), (b"u1", (0, 2**62, 2)), (b"f4", (2**31, 2**31, 0))],
)
def test_reject_empty_entry_whose_other_dimensions_overflow(dtype: bytes, shape: tuple[int, ...]) -> None:
    # Valid size (0 bytes), valid checksum: numpy still refuses the shape ("array is too big"),
    # so a hit would raise out of get_or_pack. Each dim alone is legal (R34).
    assert all(d < 2**63 for d in shape)
    index = raw_index(raw_entry(dtype=dtype, shape=shape, nbytes=0))
    message = r"entry 0 \('w'\): empty shape .* other dimensions over 2\*\*63-1"
    rejects(message, decode, index, offset=INDEX_AT + 16 + 64)


def test_largest_legal_empty_shape_is_accepted_and_numpy_can_make_it() -> None:
    shape = (2**62, 0, 1)
    entries = decode(raw_index(raw_entry(dtype=b"i1", shape=shape, nbytes=0)))
    assert entries["w"].shape == shape
    assert np.empty(shape, np.int8).size == 0


@pytest.mark.parametrize("offset", [4097, 4100, 4096 + 32, 8192 - 8])
def test_reject_entry_offset_unaligned(offset: int) -> None:
    index = raw_index(raw_entry(dtype=b"u1", shape=(0,), offset=offset))
    rejects(f"offset {offset} not aligned to 64", decode, index, offset=INDEX_AT + 16 + 32)


@pytest.mark.parametrize("offset", [0, 64, 2048, 4032])
def test_reject_entry_offset_inside_header(offset: int) -> None:
    index = raw_index(raw_entry(dtype=b"u1", shape=(64,), offset=offset))
    rejects(rf"data \[{offset}, {offset + 64}\) outside \[4096, 8192\)", decode, index, offset=INDEX_AT + 16 + 32)


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(8128, 128), (8192, 64), (1 << 30, 64), (2**64 - 64, 64), (4096, 2**63 - 64)],
)
def test_reject_entry_offset_past_index(offset: int, nbytes: int) -> None:
    # Data overlapping the index, after it, or whose end only looks small after a 64-bit wrap.
    index = raw_index(raw_entry(dtype=b"u1", shape=(nbytes,), offset=offset))
    rejects(rf"data \[{offset}, {offset + nbytes}\) outside \[4096, 8192\)", decode, index)


def test_reject_trailing_bytes_after_last_entry() -> None:
    rejects("8 bytes after the last entry", decode, raw_index(raw_entry()) + bytes(8), offset=INDEX_AT + 16 + 88)
    # The head claims fewer entries than are present.
    rejects("88 bytes after the last entry", decode, raw_index(raw_entry(name=b"a"), raw_entry(name=b"b"), count=1))
    rejects("88 bytes after the last entry", decode, raw_index(raw_entry(), count=0))


@pytest.mark.parametrize(
    "spans",
    [
        [(4096, 128), (4160, 64)],  # second starts inside the first
        [(4096, 64), (4096, 64)],  # same bytes twice
        [(4224, 64), (4096, 1024), (4480, 64)],  # one big entry covers two small ones, out of order
        [(4096, 64), (4160, 64), (4160, 128)],
    ],
)
def test_reject_overlapping_entries(spans: list[tuple[int, int]]) -> None:
    entries = [
        raw_entry(name=f"p{number}".encode(), dtype=b"u1", shape=(size,), offset=offset)
        for number, (offset, size) in enumerate(spans)
    ]
    rejects("entries 'p.' and 'p.' overlap at file offset", decode, raw_index(*entries), offset=INDEX_AT)


# --------------------------------------------------------------------------- the reading and commit procedures


def open_file(buf: bytes) -> dict[str, fmt.Entry]:
    """docs/FORMAT.md "Reading a file", composed from the format functions: newest usable generation."""
    header = fmt.decode_header(buf[: fmt.HEADER_READ_SIZE])
    slots, written = fmt.choose_slot(buf[: fmt.HEADER_READ_SIZE])
    if not slots:
        if written:
            raise FormatError("no valid commit slot")
        return {}
    failures = []
    for slot in slots:
        try:
            fmt.validate_slot_bounds(slot, header, len(buf))
            return fmt.decode_index(buf[slot.index_offset : slot.committed_end], slot, header)
        except FormatError as exc:
            failures.append(exc)
    raise failures[0]


def commit(buf: bytearray, entries: dict[str, fmt.Entry], packs: dict[str, bytes]) -> tuple[dict[str, fmt.Entry], int]:
    """docs/FORMAT.md W3 on an in-memory file: append data and index, then write a slot.

    Returns the new entries and the offset of the slot written.
    """
    header = fmt.decode_header(bytes(buf[:4096]))
    entries = dict(entries)
    for name, data in packs.items():
        offset = fmt.align_up(len(buf), header.alignment)
        buf += bytes(offset - len(buf)) + data
        key = fmt.canonical_key({"packer": "copy"})
        digest = fmt.key_digest(name, key)
        entries[name] = fmt.Entry(name, key, digest, "u1", (len(data),), offset, len(data), crc(data))
    index = fmt.encode_index(list(entries.values()))
    index_offset = fmt.align_up(len(buf), header.alignment)
    buf += bytes(index_offset - len(buf)) + index
    in_use = fmt.choose_slot(bytes(buf[:4096]))[0]
    generation = (in_use[0].generation if in_use else 0) + 1
    target = fmt.slot_offset(generation % 2)  # never the slot in use
    buf[target : target + 64] = fmt.encode_slot(
        fmt.Slot(generation, index_offset, len(index), len(entries), crc(index))
    )
    return entries, target


def two_generations(alignment: int = 64) -> tuple[bytearray, dict[str, fmt.Entry], dict[str, fmt.Entry], int]:
    buf = bytearray(fmt.encode_header(alignment, PLATFORM))
    assert open_file(bytes(buf)) == {}
    first, first_slot = commit(buf, {}, {"a": b"A" * 100, "z": b""})
    second, second_slot = commit(buf, first, {"b": b"B" * 10})
    assert (first_slot, second_slot) == (3072, 2048)  # generation g goes to slot g % 2
    return buf, first, second, second_slot


@pytest.mark.parametrize("alignment", [64, 4096, 1 << 16])
def test_commit_then_reopen_reads_newest_generation(alignment: int) -> None:
    buf, _, second, _ = two_generations(alignment)
    assert open_file(bytes(buf)) == second
    for entry in second.values():
        assert entry.offset % alignment == 0
        assert crc(buf[entry.offset : entry.offset + entry.nbytes]) == entry.crc32  # checksums are kept, not checked
    assert [s.generation for s in fmt.choose_slot(bytes(buf[:4096]))[0]] == [2, 1]


def test_torn_newest_slot_falls_back_to_previous_generation() -> None:
    buf, first, _, newest = two_generations()
    buf[newest + 20 : newest + 64] = bytes(44)
    assert open_file(bytes(buf)) == first


def test_corrupt_newest_index_falls_back_to_previous_generation() -> None:
    buf, first, _, _ = two_generations()
    buf[-3] ^= 0x10
    assert open_file(bytes(buf)) == first


def test_truncated_newest_index_falls_back_to_previous_generation() -> None:
    buf, first, _, _ = two_generations()
    assert open_file(bytes(buf[:-1])) == first


def test_uncommitted_tail_is_ignored() -> None:
    buf, _, second, _ = two_generations()
    buf += b"\xde\xad" * 5000  # a writer died after appending data, before writing a slot
    assert open_file(bytes(buf)) == second


def test_commit_after_fallback_overwrites_the_broken_slot_not_the_one_in_use() -> None:
    buf, first, _, newest = two_generations()
    buf[newest + 20 : newest + 64] = bytes(44)  # generation 2's slot torn: generation 1 (at 3072) is in use
    in_use = bytes(buf[3072:3136])
    third, target = commit(buf, first, {"c": b"C" * 3})
    assert target == newest and bytes(buf[3072:3136]) == in_use
    assert open_file(bytes(buf)) == third and set(third) == {"a", "z", "c"}
    buf[target + 20 : target + 64] = bytes(44)  # and if that write tears too, generation 1 is still there
    assert open_file(bytes(buf)) == first


def test_reject_file_when_every_generation_is_broken() -> None:
    buf, _, _, _ = two_generations()
    first_index = fmt.choose_slot(bytes(buf[:4096]))[0][1].index_offset
    buf[first_index + 20] ^= 1
    buf[-3] ^= 1
    rejects("index checksum mismatch", open_file, bytes(buf))
    buf[2048:2112] = bytes(range(64))
    buf[3072:3136] = bytes(range(64))
    rejects("no valid commit slot", open_file, bytes(buf))


# --------------------------------------------------------------------------- fuzz: only FormatError


def valid_index() -> bytes:
    return fmt.encode_index(mixed_entries()[:4])


def check_header(buf: bytes) -> None:
    try:
        header = fmt.decode_header(buf)
    except FormatError:
        return
    assert header.alignment & (header.alignment - 1) == 0 and 64 <= header.alignment <= 1 << 20
    assert header.data_start == max(4096, header.alignment)
    assert len(header.platform) <= 1984


def check_index(buf: bytes, slot: fmt.Slot) -> None:
    try:
        entries = fmt.decode_index(buf, slot, HEADER)
    except FormatError:
        return
    spans = []
    for name, entry in entries.items():
        assert entry.name == name and 1 <= len(name.encode()) <= 1024
        assert entry.nbytes == math.prod(entry.shape) * int(entry.dtype[1:])
        assert entry.offset % 64 == 0 and 4096 <= entry.offset <= entry.offset + entry.nbytes <= slot.index_offset
        if entry.nbytes:
            spans.append((entry.offset, entry.offset + entry.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


@FUZZ
@given(st.binary(max_size=5000))
def test_fuzz_header_random_bytes(data: bytes) -> None:
    check_header(data)


U32 = st.integers(0, 2**32 - 1)


@FUZZ
@given(
    st.one_of(st.just(1), U32),
    st.one_of(st.sampled_from([64, 4096, 1 << 16, 1 << 20]), U32),
    st.one_of(st.sampled_from([4096, 1 << 16, 1 << 20]), U32),
    st.binary(max_size=2000),
    st.one_of(st.none(), st.integers(0, 2000), U32),
    st.one_of(st.none(), U32),
    st.one_of(st.just(bytes(32)), st.binary(min_size=32, max_size=32)),
)
def test_fuzz_header_fields_with_valid_checksum(
    version: int, alignment: int, data_start: int, platform: bytes, psize: int | None, pcrc: int | None, reserved: bytes
) -> None:
    raw = raw_header(
        version=version,
        alignment=alignment,
        data_start=data_start,
        platform=platform,
        psize=psize,
        pcrc=pcrc,
        reserved=reserved,
    )
    check_header(raw)


@FUZZ
@given(
    st.lists(st.tuples(PREAMBLE_OR_FINGERPRINT, st.integers(0, 255)), min_size=1, max_size=4),
    st.booleans(),
    st.booleans(),
)
def test_fuzz_header_mutations(mutations: list[tuple[int, int]], fix_preamble: bool, fix_platform: bool) -> None:
    buf = bytearray(raw_header())
    for position, value in mutations:
        buf[position] = value  # the preamble and fingerprint, not the slots
    if fix_platform:
        psize = min(struct.unpack_from("<I", buf, 20)[0], 1984)
        struct.pack_into("<I", buf, 24, crc(buf[64 : 64 + psize]))
    if fix_preamble:
        struct.pack_into("<I", buf, 60, crc(buf[:60]))
    check_header(bytes(buf))
    assert fmt.choose_slot(bytes(buf)) == ([], False)


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=4),
    st.integers(-64, 64),
    st.booleans(),
)
def test_fuzz_index_mutations(mutations: list[tuple[int, int]], resize: int, fix_checksum: bool) -> None:
    original = valid_index()
    buf = bytearray(original)
    for position, value in mutations:
        buf[position % len(buf)] = value
    buf = buf[: len(buf) + resize] if resize < 0 else buf + bytes(resize)
    slot = fmt.Slot(1, INDEX_AT, len(buf), 4, crc(buf) if fix_checksum else crc(original))
    check_index(bytes(buf), slot)


@FUZZ
@given(st.binary(max_size=600), st.integers(0, 2**32 - 1))
def test_fuzz_index_random_bytes(data: bytes, count: int) -> None:
    buf = INDEX_MAGIC + struct.pack("<II", count % 8, 0) + data
    check_index(buf, fmt.Slot(1, INDEX_AT, len(buf), count % 8, crc(buf)))
    check_index(data, fmt.Slot(1, INDEX_AT, len(data), count, crc(data)))


U64 = st.integers(0, 2**64 - 1)
SLOT_BYTES = st.one_of(
    st.just(bytes(64)),
    st.binary(min_size=64, max_size=64),
    st.builds(
        lambda generation, index_offset, index_size, count, reserved: raw_slot(
            generation=generation, index_offset=index_offset, index_size=index_size, count=count, reserved=reserved
        ),
        st.one_of(st.integers(0, 3), U64),
        U64,
        U64,
        U32,
        st.one_of(st.just(bytes(20)), st.binary(min_size=20, max_size=20)),
    ),
)


def slot_is_valid(raw: bytes) -> bool:
    """Independent restatement of R10-R13 and R45."""
    return (
        raw[:8] == SLOT_MAGIC
        and struct.unpack_from("<I", raw, 60)[0] == crc(raw[:60])
        and raw[40:60] == bytes(20)
        and struct.unpack_from("<Q", raw, 8)[0] not in (0, 2**64 - 1)
    )


@FUZZ
@given(SLOT_BYTES, SLOT_BYTES, st.lists(st.tuples(st.integers(0, 63), st.integers(0, 255)), max_size=2))
def test_fuzz_choose_slot(slot0: bytes, slot1: bytes, mutations: list[tuple[int, int]]) -> None:
    torn = bytearray(slot0)
    for position, value in mutations:
        torn[position] = value
    slots, written = fmt.choose_slot(with_slots(bytes(torn), slot1))
    assert written == (any(torn) or any(slot1))
    expected = [
        generation
        for position, raw in enumerate((bytes(torn), slot1))
        if slot_is_valid(raw) and (generation := struct.unpack_from("<Q", raw, 8)[0]) % 2 == position
    ]
    assert [s.generation for s in slots] == sorted(expected, reverse=True)


# --------------------------------------------------------------------------- the spec names these tests


def test_format_md_names_a_test_for_every_rule() -> None:
    text = FORMAT_MD.read_text(encoding="utf-8")
    section = text.split("## Readers MUST reject", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (R\d+) \|.*\|\s*(`test_\w+`(?:,\s*`test_\w+`)*)\s*\|$", section, flags=re.M)
    ids = [rule for rule, _ in rows]
    assert ids == [f"R{n}" for n in range(1, len(ids) + 1)]
    named = {name for _, cell in rows for name in re.findall(r"`(test_\w+)`", cell)}
    here = {name for name in globals() if name.startswith("test_")}
    assert named <= here, f"FORMAT.md names tests that do not exist: {sorted(named - here)}"
    rejecting = {name for name in here if name.startswith("test_reject_")}
    assert rejecting <= named, f"rejection tests missing from FORMAT.md: {sorted(rejecting - named)}"


# --------------------------------------------------------------------------- the index checked at once

AT_ONCE_COUNT = 24  # above fmt._AT_ONCE_FROM: decode_index takes the array path first


def many_entries(count: int = AT_ONCE_COUNT) -> list[fmt.Entry]:
    """``count`` entries of every kind ``mixed_entries`` has (0-d, empty, unicode, every dtype width), laid
    out without gaps below INDEX_AT."""
    kinds = [(e.dtype, e.shape) for e in mixed_entries()] + [("u2", (3, 1, 2, 1)), ("i4", (1,) * 9)]
    entries, offset = [], 4096
    for number in range(count):
        dtype, shape = kinds[number % len(kinds)]
        name = f"layers.{number}.{'ü' if number % 3 else 'w'}"
        key = fmt.canonical_key({"packer": "p", "version": number % 4, "shape": list(shape)})
        nbytes = math.prod(shape) * int(dtype[1:])
        entries.append(fmt.Entry(name, key, fmt.key_digest(name, key), dtype, shape, offset, nbytes, number))
        offset = fmt.align_up(offset + nbytes, 64)
    assert offset <= INDEX_AT
    return entries


def at_once_and_one_by_one(index: bytes) -> tuple[dict[str, fmt.Entry] | None, dict[str, fmt.Entry] | FormatError]:
    """What both index decoders make of ``index`` (head checks passed): the array path's entries or None,
    and the loop's entries or its error."""
    count = struct.unpack_from("<I", index, 8)[0]
    data = bytes(index)
    fast = fmt._entries_at_once(data, count, HEADER, INDEX_AT)
    try:
        slow: dict[str, fmt.Entry] | FormatError = fmt._entries_one_by_one(
            data, count, HEADER, INDEX_AT, lambda message, at: FormatError(message, offset=INDEX_AT + at)
        )
    except FormatError as exc:
        slow = exc
    return fast, slow


def test_a_valid_index_is_decoded_at_once_with_the_entries_the_loop_decodes() -> None:
    entries = many_entries()
    fast, slow = at_once_and_one_by_one(fmt.encode_index(entries))
    assert fast is not None, "a valid index must not need the loop (the warm path's cost)"
    assert fast == slow == {e.name: e for e in entries}
    assert list(fast) == [e.name for e in entries]
    assert all(type(v) is int for e in fast.values() for v in (e.offset, e.nbytes, e.crc32, *e.shape))


def _field_at(index: bytes, number: int) -> int:
    """Offset of entry ``number``'s fixed part in ``index``."""
    pos = 16
    for _ in range(number):
        name_size, ndim, key_size = struct.unpack_from("<HB5xI", index, pos + 52)
        pos += fmt.align_up(64 + 8 * ndim + name_size + key_size, 8)
    return pos


#: One mutation per rule the entries must keep: (what it breaks, how, given the index and the entry's offset).
BREAKS: list[tuple[str, Callable[[bytearray, int], None]]] = [
    ("reserved byte", lambda b, at: b.__setitem__(at + 55, 1)),
    ("name size 0", lambda b, at: struct.pack_into("<H", b, at + 52, 0)),
    ("ndim 33", lambda b, at: struct.pack_into("<B", b, at + 54, 33)),
    ("key size past the cap", lambda b, at: struct.pack_into("<I", b, at + 60, fmt.MAX_KEY_BYTES + 1)),
    ("unknown dtype", lambda b, at: b.__setitem__(slice(at + 56, at + 60), b"f3\0\0")),
    ("big-endian dtype", lambda b, at: b.__setitem__(slice(at + 56, at + 60), b">f4\0")),
    ("offset unaligned", lambda b, at: struct.pack_into("<Q", b, at + 32, 4096 + 8)),
    ("offset in the header", lambda b, at: struct.pack_into("<Q", b, at + 32, 0)),
    ("offset past the index", lambda b, at: struct.pack_into("<Q", b, at + 32, INDEX_AT + 64)),
    ("offset near 2**64", lambda b, at: struct.pack_into("<Q", b, at + 32, (1 << 64) - 64)),
    ("nbytes near 2**64", lambda b, at: struct.pack_into("<Q", b, at + 40, (1 << 64) - 1)),
    (
        "nbytes off by one",
        lambda b, at: struct.pack_into("<Q", b, at + 40, 1 + struct.unpack_from("<Q", b, at + 40)[0]),
    ),
]


@pytest.mark.parametrize(("what", "mutate"), BREAKS, ids=[b[0] for b in BREAKS])
@pytest.mark.parametrize("number", [0, 7, AT_ONCE_COUNT - 1])
def test_an_entry_breaking_a_rule_is_left_to_the_loop_which_names_it(
    what: str, mutate: Callable[[bytearray, int], None], number: int
) -> None:
    index = bytearray(fmt.encode_index(many_entries()))
    mutate(index, _field_at(bytes(index), number))
    fast, slow = at_once_and_one_by_one(bytes(index))
    assert fast is None, what
    assert isinstance(slow, FormatError), what
    assert re.search(rf"entr(y|ies) .*{number}|{many_entries()[number].name}", str(slow)) or "past the end" in str(slow)


def test_dimensions_whose_product_wraps_a_u64_are_rejected_by_both() -> None:
    entries = many_entries()
    assert entries[7].shape == (3, 1, 2, 1) and entries[7].dtype == "u2"
    index = bytearray(fmt.encode_index(entries))
    at = _field_at(bytes(index), 7)
    # 2**32 * 2**32 elements of 2 bytes: 0 bytes once a u64 product wraps, which nbytes 0 would match.
    for n, d in enumerate((1 << 32, 1 << 32, 1, 1)):
        struct.pack_into("<Q", index, at + 64 + 8 * n, d)
    struct.pack_into("<Q", index, at + 40, 0)
    fast, slow = at_once_and_one_by_one(bytes(index))
    assert fast is None
    assert isinstance(slow, FormatError) and "size 0 != shape" in str(slow)


def test_duplicate_names_overlaps_bad_utf8_and_dirty_padding_are_left_to_the_loop() -> None:
    entries = many_entries()
    cases = {
        "duplicate": [*entries[:-1], entries[-1]._replace(name=entries[0].name)],
        "overlap": [*entries[:-1], entries[-1]._replace(offset=entries[-2].offset)] if entries[-2].nbytes else None,
    }
    for what, changed in cases.items():
        if changed is None:
            continue
        fast, slow = at_once_and_one_by_one(fmt.encode_index(changed))
        assert fast is None and isinstance(slow, FormatError), what
    index = bytearray(fmt.encode_index(entries))
    at = _field_at(bytes(index), 3)
    name_size, ndim, key_size = struct.unpack_from("<HB5xI", index, at + 52)
    bad = bytearray(index)
    bad[at + 64 + 8 * ndim] = 0xFF  # no UTF-8 sequence starts with 0xff
    fast, slow = at_once_and_one_by_one(bytes(bad))
    assert fast is None and isinstance(slow, FormatError)
    end = at + 64 + 8 * ndim + name_size + key_size
    if end % 8:
        dirty = bytearray(index)
        dirty[end] = 1
        fast, slow = at_once_and_one_by_one(bytes(dirty))
        assert fast is None and isinstance(slow, FormatError)


@FUZZ
@given(st.lists(st.tuples(st.integers(16, 4000), st.integers(0, 255)), min_size=1, max_size=6))
def test_both_index_decoders_agree_on_fuzzed_bytes(flips: list[tuple[int, int]]) -> None:
    index = bytearray(fmt.encode_index(many_entries()))
    for at, value in flips:
        index[at % len(index)] = value
    fast, slow = at_once_and_one_by_one(bytes(index))
    if fast is not None:  # accepted at once: the loop accepts it too, with the same entries
        assert fast == slow


def test_compacted_size_is_the_size_of_the_layout_compaction_writes() -> None:
    def laid_out(entries: list[fmt.Entry], header: fmt.Header, index_bytes: int | None) -> int:
        at = header.data_start  # compaction's own order: by offset, each pack aligned
        ordered = sorted(entries, key=lambda e: e.offset)
        for entry in ordered:
            at = fmt.align_up(at, header.alignment) + entry.nbytes
        return fmt.align_up(at, header.alignment) + (fmt.index_size(ordered) if index_bytes is None else index_bytes)

    rng = np.random.default_rng(5)
    for _ in range(500):
        alignment = 1 << int(rng.integers(6, 21))
        header = fmt.Header(alignment, fmt.data_start_for(alignment), b"{}")
        sizes = rng.choice([0, 1, 63, 64, 65, 4097, int(rng.integers(0, 1 << 22))], size=int(rng.integers(0, 12)))
        entries = [
            fmt.Entry(f"n{i}", b"{}", bytes(32), "u1", (int(n),), int(rng.integers(0, 1 << 30)), int(n), 0)
            for i, n in enumerate(sizes)
        ]
        for index_bytes in (None, 16, 1000):
            expected = laid_out(entries, header, index_bytes)
            assert fmt.compacted_size(entries, header, index_bytes) == expected
            assert fmt.compacted_size(iter(entries), header, index_bytes) == expected


# --------------------------------------------------------------------------- R47-R50: embedded entries

FILE_KEY = fmt.embedded_key("file", b"{}")
MODEL_KEY = fmt.embedded_key("model", b"{}")


def embedded(name: bytes, key: bytes, *, dtype: bytes = b"u1", shape: tuple[int, ...] = (2,)) -> bytes:
    return raw_index(raw_entry(name=name, key=key, dtype=dtype, shape=shape))


def test_embedded_entries_of_every_kind_are_accepted() -> None:
    index = raw_index(
        raw_entry(name=b"packcache.model", key=MODEL_KEY, dtype=b"u1", shape=(2,)),
        raw_entry(name=b"packcache.file/1_Pooling/config.json", key=FILE_KEY, dtype=b"u1", shape=(2,), offset=4160),
        raw_entry(name=b"packcache.other", key=b"{}", offset=4224),  # only the two kinds are reserved
    )
    assert set(decode(index)) == {"packcache.model", "packcache.file/1_Pooling/config.json", "packcache.other"}


@pytest.mark.parametrize(
    ("name", "key", "dtype", "shape"),
    [
        (b"packcache.model", MODEL_KEY, b"f4", (2,)),
        (b"packcache.file/a.json", FILE_KEY, b"u1", (1, 2)),
        (b"packcache.file/a.json", FILE_KEY, b"u1", ()),
    ],
)
def test_reject_embedded_entry_that_is_not_bytes(name: bytes, key: bytes, dtype: bytes, shape: tuple[int, ...]) -> None:
    rejects(r"not u1 bytes \(R47\)", decode, embedded(name, key, dtype=dtype, shape=shape), offset=INDEX_AT)


@pytest.mark.parametrize(
    ("name", "key", "cap"),
    [(b"packcache.model", MODEL_KEY, fmt.MAX_MODEL_BYTES), (b"packcache.file/t.json", FILE_KEY, fmt.MAX_FILE_BYTES)],
)
def test_reject_embedded_entry_over_its_cap(name: bytes, key: bytes, cap: int) -> None:
    index = embedded(name, key, shape=(cap + 1,))
    rejects(r"over its cap .* \(R47\)", decode, index, index_offset=1 << 30)
    index = embedded(name, key, shape=(cap,))
    assert decode(index, index_offset=1 << 30)[name.decode()].nbytes == cap


@pytest.mark.parametrize(
    "path", [b"", b"/etc/passwd", b"../x", b"a/../b", b"a//b", b"./a", b"a/", b"a\\b", b"a\x01b", b"x" * 256]
)
def test_reject_embedded_file_path_that_is_not_plain(path: bytes) -> None:
    rejects(r"\(R48\)", decode, embedded(b"packcache.file/" + path, FILE_KEY), offset=INDEX_AT)
    with pytest.raises(ValueError, match="cannot embed"):
        fmt.file_entry_name(path.decode())


@pytest.mark.parametrize(
    ("name", "key"),
    [
        (b"packcache.model", b"{}"),
        (b"packcache.model", FILE_KEY),  # another kind's key
        (b"packcache.file/a", MODEL_KEY),
        (b"packcache.file/a", FILE_KEY.replace(b'"sha256":"', b'"sha256":"A')[:-2] + b'"}'),  # upper-case hex
        (b"packcache.file/a", FILE_KEY[:-1] + b',"x":1}'),  # another member
        (b"packcache.file/a", FILE_KEY.replace(b":", b": ")),  # not canonical
    ],
)
def test_reject_embedded_entry_whose_key_is_not_kind_and_sha256(name: bytes, key: bytes) -> None:
    rejects(r"\(R49\)", decode, embedded(name, key), offset=INDEX_AT)


def test_reject_embedded_bytes_other_than_the_key_names() -> None:
    data = b'{"a":1}'
    entry = fmt.Entry("packcache.file/c.json", fmt.embedded_key("file", data), bytes(32), "u1", (7,), 4096, 7,
                      fmt.crc32(data))  # fmt: skip
    fmt.check_embedded(entry, data)
    rejects(r"checksum mismatch \(R50\)", fmt.check_embedded, entry, b'{"a":2}', offset=4096)
    rejects(r"checksum mismatch \(R50\)", fmt.check_embedded, entry, data[:-1], offset=4096)
    forged = entry._replace(crc32=fmt.crc32(b'{"a":2}'))  # a crc made for the other bytes: the sha256 still differs
    rejects(r"not the sha256 its key names \(R50\)", fmt.check_embedded, forged, b'{"a":2}', offset=4096)


# --------------------------------------------------------------------------- R46 end to end


def test_an_empty_entry_with_an_absurd_shape_is_rejected_never_raised_by_a_load(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    header = fmt.encode_header(64, b"{}")
    entry = fmt.Entry("w", b"{}", fmt.key_digest("w", b"{}"), "f8", (2**62, 0), fmt.data_start_for(64), 0, 0)
    record = fmt.ENTRY_FIXED.pack(entry.digest, entry.offset, 0, 0, 1, 2, 0, b"f8\0\0", 2)
    index_body = record + np.array(entry.shape, "<u8").tobytes() + b"w" + b"{}"
    index_body += bytes(fmt.align_up(len(index_body), 8) - len(index_body))
    index = fmt.INDEX_HEAD.pack(fmt.INDEX_MAGIC, 1, 0) + index_body
    at = fmt.data_start_for(64)
    slot = fmt.Slot(1, at, len(index), 1, fmt.zlib.crc32(index) & 0xFFFFFFFF)
    data = bytearray(header) + index
    data[fmt.slot_offset(1) : fmt.slot_offset(1) + 64] = fmt.encode_slot(slot)
    path.write_bytes(bytes(data))
    os.chmod(path, 0o600)
    assert not packcache.verify(path).ok
    with WeightCache(path) as cache:
        with cache.session() as s:
            w = s.get_or_pack("w", lambda: np.zeros(3), KEY)  # rebuilt, never "array is too big"
        assert cache.stats().stored == 1
    assert w.shape == (3,)
