"""The hostile-file fuzzer: mutated and synthesised cache files, and hostile safetensors files, opened for real.

``stress/fuzz.py`` is its command line and describes the method, the allowed
outcomes and the figures. ``fuzz()`` runs both targets and returns the
``Counts`` (a violation is counted, never raised); ``run_case()`` is one cache
file, ``run_safetensors_case()`` one safetensors file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import logging
import math
import os
import shutil
import signal
import struct
import tempfile
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import packcache
import packcache._generations
from packcache import format as fmt
from packcache.cli import main as cli_main
from packcache.errors import FormatError, UntrustedFileError
from packcache.safetensors import DTYPES, SafetensorsFile

ALLOWED = (FormatError, UntrustedFileError, OSError)  # what a maintenance entry point may raise

PLATFORM = {"fuzz": 1}
PLATFORM_BYTES = fmt.canonical_key(PLATFORM)
INTERESTING = sorted(
    {0, 1, 2, 7, 8, 15, 16, 63, 64, 65, 127, 128, 255, 256, 1023, 1024, 1025, 2047, 2048, 3072, 4095, 4096, 4097,
     8192, 65535, 65536, 65537, 2**20, 2**20 + 1, 2**28, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
     2**64 - 1}
)  # fmt: skip
BAD_DTYPES = [b"", b"f16", b"bf16", b"<f4", b"F4", b"f\0", b"\0f4", b"i3", b"c32", b"\xff\xff\xff\xff"]
MAX_FILE = 1 << 20  # synthesised files are cut at 1 MiB: a layout claiming more is simply truncated


def base_packs() -> list[tuple[int, str, dict[str, Any] | None, np.ndarray[Any, Any]]]:
    """(generation, name, key, array) of the real files mutated."""
    return [
        (1, "w0", {"v": 1}, np.arange(64, dtype=np.float32).reshape(4, 16)),
        (1, "empty", None, np.zeros((0, 3), np.uint8)),
        (1, "scalar", None, np.array(2.5, np.float64)),
        (1, "ü/层.weight", {"packer": "x"}, np.arange(105, dtype=np.int16).reshape(3, 5, 7)),
        (2, "w4", None, np.array([1 + 2j, 3 - 4j], np.complex128)),
        # Enough entries that every generation's index is checked as arrays (format._AT_ONCE_FROM), as a real
        # model's is: mutations then reach that decoder, and its verdicts must be the loop's.
        *((1, f"layers.{i}.w", {"i": i}, np.full((i % 3 + 1, 2), i, np.int8)) for i in range(14)),
    ]


def returning(array: np.ndarray[Any, Any]) -> Callable[[], np.ndarray[Any, Any]]:
    """A pack function that returns ``array`` itself."""
    return lambda: array


PACKS = {name: (key, array) for _, name, key, array in base_packs()}
SMALL = np.arange(4, dtype=np.float32)


def _quiet() -> contextlib.AbstractContextManager[None]:
    """Rebuild warnings and errors are expected here by the thousand: keep them off stderr."""

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        logger = logging.getLogger("packcache")
        saved = logger.disabled
        logger.disabled = True
        try:
            yield
        finally:
            logger.disabled = saved

    return quiet()


def build_bases(directory: str) -> list[bytes]:
    bases = []
    for alignment in (64, 4096):
        path = os.path.join(directory, f"base{alignment}.pcache")
        for generation in (1, 2):
            with packcache.WeightCache(path, alignment=alignment, platform=PLATFORM) as cache, cache.session() as s:
                for gen, name, key, array in base_packs():
                    if gen == generation:
                        s.get_or_pack(name, returning(array), key=key)
        with open(path, "rb") as f:
            bases.append(f.read())
    bases.append(fmt.encode_header(64, PLATFORM_BYTES))  # created, never committed
    return bases


def field_offsets(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every integer field of a valid file: preamble, slots, index heads, entries."""
    fields = [(8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4), (60, 4)]
    for base in fmt.SLOT_OFFSETS:
        fields += [(base + o, w) for o, w in ((8, 8), (16, 8), (24, 8), (32, 4), (36, 4), (40, 4), (60, 4))]
    for slot in fmt.choose_slot(data[: fmt.HEADER_READ_SIZE])[0]:
        io = slot.index_offset
        fields += [(io + 8, 4), (io + 12, 4)]
        pos = io + 16
        for _ in range(slot.entry_count):
            name_size, ndim, _reserved, _dtype, key_size = struct.unpack_from("<HBB4sI", data, pos + 52)
            fields += [(pos + o, w) for o, w in ((32, 8), (40, 8), (48, 4), (52, 2), (54, 1), (55, 1), (56, 4))]
            fields += [(pos + 60, 4), *((pos + 64 + 8 * i, 8) for i in range(ndim))]
            pos += fmt.align_up(64 + 8 * ndim + name_size + key_size, 8)
    return fields


def ints(width: int) -> st.SearchStrategy[int]:
    top = (1 << (8 * width)) - 1
    return st.one_of(st.sampled_from([v for v in INTERESTING if v <= top]), st.integers(0, top))


def crc(data: bytes | bytearray) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def reseal(buf: bytearray, *, index: bool, slots: bool, header: bool) -> None:
    """Recompute checksums after a mutation, so it reaches the rules behind them."""
    if len(buf) < fmt.HEADER_READ_SIZE:
        return
    for base in fmt.SLOT_OFFSETS:
        if not any(buf[base : base + 64]):
            continue
        if index:
            ioff, isize = struct.unpack_from("<QQ", buf, base + 16)
            if ioff + isize <= len(buf):
                struct.pack_into("<I", buf, base + 36, crc(buf[ioff : ioff + isize]))
        if slots:
            struct.pack_into("<I", buf, base + 60, crc(buf[base : base + 60]))
    if header:
        psize = struct.unpack_from("<I", buf, 20)[0]
        if psize <= fmt.PLATFORM_MAX:
            struct.pack_into("<I", buf, 24, crc(buf[64 : 64 + psize]))
        struct.pack_into("<I", buf, 60, crc(buf[:60]))


@st.composite
def mutated(draw: st.DrawFn, bases: list[bytes]) -> bytes:
    buf = bytearray(draw(st.sampled_from(bases)))
    fields = field_offsets(bytes(buf))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "byte", "field", "field", "field", "truncate", "extend", "copy_slot"]))
        if kind == "flip" and buf:
            pos = draw(st.integers(0, len(buf) - 1))
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and buf:
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        elif kind == "field":
            offset, width = draw(st.sampled_from(fields))
            if offset + width <= len(buf):
                buf[offset : offset + width] = draw(ints(width)).to_bytes(width, "little")
        elif kind == "truncate":  # mostly past the header: a file cut short of its index is the common case
            low = 0 if not draw(st.integers(0, 4)) else min(len(buf), fmt.HEADER_READ_SIZE)
            del buf[draw(st.integers(low, len(buf))) :]
        elif kind == "extend":
            buf += draw(st.binary(max_size=64)) if draw(st.booleans()) else bytes(draw(st.integers(0, 8192)))
        elif kind == "copy_slot" and len(buf) >= fmt.HEADER_READ_SIZE:
            src, dst = draw(st.permutations(fmt.SLOT_OFFSETS))
            buf[dst : dst + 64] = buf[src : src + 64]
    reseal(buf, index=draw(st.booleans()), slots=draw(st.booleans()), header=draw(st.booleans()))
    return bytes(buf)


def raw_entry(
    name: bytes, key: bytes, dtype: bytes, dims: list[int], offset: int, nbytes: int, digest: bytes, data_crc: int
) -> bytes:
    fixed = digest + struct.pack("<QQIHBB4sI", offset, nbytes, data_crc, len(name) & 0xFFFF, len(dims), 0,
                                 dtype[:4].ljust(4, b"\0"), len(key))  # fmt: skip
    body = fixed + b"".join(struct.pack("<Q", d) for d in dims) + name + key
    return body + bytes(-len(body) % 8)


@st.composite
def synthesised(draw: st.DrawFn) -> bytes:
    alignment = draw(st.sampled_from([64, 128, 4096, 1 << 16])) if draw(st.integers(0, 5)) else draw(ints(4))
    proper = 4096 if alignment <= 4096 else alignment
    data_start = draw(st.one_of(st.just(proper), ints(4))) if draw(st.integers(0, 9)) == 0 else proper
    platform = PLATFORM_BYTES if draw(st.integers(0, 9)) else draw(st.binary(max_size=40))
    preamble = fmt.MAGIC + struct.pack("<IIIII", 1, alignment & 0xFFFFFFFF, data_start, len(platform), crc(platform))
    preamble += bytes(32)
    preamble += struct.pack("<I", crc(preamble))
    step = alignment if 0 < alignment <= 1 << 20 and not alignment & (alignment - 1) else 64
    cursor = max(data_start, 4096)
    entries = []
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            name = draw(st.text(min_size=1, max_size=10)).encode("utf-8")
        else:
            name = draw(st.binary(max_size=12))
        dtype = draw(st.one_of(st.sampled_from([c.encode() for c in fmt.DTYPE_CODES]), st.sampled_from(BAD_DTYPES)))
        dims = draw(st.lists(st.one_of(st.integers(0, 9), ints(8)), max_size=4))
        itemsize = int(dtype[1:]) if dtype.decode("latin-1") in fmt.DTYPE_CODES else 1
        consistent = math.prod(dims) * itemsize
        nbytes = consistent if draw(st.integers(0, 4)) and consistent < 1 << 64 else draw(ints(8))
        offset = fmt.align_up(cursor, step) if draw(st.integers(0, 4)) else draw(ints(8))
        if offset < 1 << 40 and nbytes < 1 << 40:
            cursor = max(cursor, offset + nbytes)
        key = b"{}" if draw(st.integers(0, 4)) else draw(st.binary(max_size=16))
        digest = hashlib.sha256(b"packcache-key\0" + name + b"\0" + key).digest()
        if not draw(st.integers(0, 9)):
            digest = draw(st.binary(min_size=32, max_size=32))
        entries.append(raw_entry(name, key, dtype, dims, offset, nbytes & (2**64 - 1), digest, 0))
    index_offset = fmt.align_up(cursor, step) if draw(st.integers(0, 5)) else draw(ints(8))
    count = len(entries) if draw(st.integers(0, 5)) else draw(ints(4))
    index = fmt.INDEX_MAGIC + struct.pack("<II", count, 0) + b"".join(entries)
    generation = draw(st.one_of(st.integers(1, 4), ints(8)))
    slot_body = fmt.SLOT_MAGIC + struct.pack(
        "<QQQII", generation, index_offset, len(index), count if draw(st.integers(0, 5)) else draw(ints(4)), crc(index)
    )
    slot_body += bytes(20)
    slot = slot_body + struct.pack("<I", crc(slot_body))
    region = bytearray(4096)
    region[:64] = preamble
    region[64 : 64 + len(platform)] = platform
    where = fmt.slot_offset(generation % 2) if draw(st.integers(0, 5)) else draw(st.sampled_from(fmt.SLOT_OFFSETS))
    region[where : where + 64] = slot
    body = bytearray(region)
    if index_offset <= MAX_FILE:
        body += bytes(max(0, index_offset - len(body)))
        body[index_offset : index_offset + len(index)] = index
    body += draw(st.binary(max_size=32)) if not draw(st.integers(0, 5)) else b""
    cut = draw(st.integers(0, len(body))) if not draw(st.integers(0, 5)) else len(body)
    return bytes(body[:cut])


# --------------------------------------------------------------------------- one case


class Hang(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang("case ran over its time bound")


@dataclass
class Counts:
    cases: int = 0
    valid_opens: int = 0
    format_errors: int = 0
    rebuilds: int = 0
    exhausted_rebuilds: int = 0  # valid files at the last usable generation, rebuilt to take a new pack
    # valid files appended to, then compacted by the same build (their superseded bytes outweighed the live ones)
    build_compactions: int = 0
    other_exceptions: int = 0
    views_outside: int = 0
    disagreements: int = 0
    unexpected_heap: int = 0
    inspected: int = 0  # files packcache.inspect read (the rest: FormatError)
    compacted: int = 0  # files packcache.compact rewrote
    compact_rejected: int = 0  # files it refused with FormatError (exactly those the pure decoders reject)
    safetensors_cases: int = 0
    safetensors_valid: int = 0
    safetensors_rejected: int = 0  # FormatError, each naming an offset
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.other_exceptions or self.views_outside or self.disagreements or self.unexpected_heap)

    def summary(self, seconds: float) -> str:
        return (
            f"fuzz: cases={self.cases} valid_opens={self.valid_opens} format_errors={self.format_errors} "
            f"exhausted_rebuilds={self.exhausted_rebuilds} build_compactions={self.build_compactions} "
            f"rebuilds={self.rebuilds} other_exceptions={self.other_exceptions} views_outside={self.views_outside} "
            f"disagreements={self.disagreements} unexpected_heap={self.unexpected_heap} "
            f"inspected={self.inspected} compacted={self.compacted} compact_rejected={self.compact_rejected} "
            f"safetensors_cases={self.safetensors_cases} safetensors_valid={self.safetensors_valid} "
            f"safetensors_rejected={self.safetensors_rejected} seconds={seconds:.1f}"
        )

    def other(self, exc: BaseException, what: str, size: int) -> None:
        self.other_exceptions += 1
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {where.filename}:{where.lineno}" if where else ""
        self.failures.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}{at} ({size}-byte file)")


def pure_read(data: bytes, *, platform: bool = True) -> dict[str, fmt.Entry]:
    """docs/FORMAT.md "Reading a file" with the pure decoders; raises FormatError only.

    ``platform``: also reject a fingerprint other than the fuzzer's (the cache rebuilds
    such a file; compaction, which keeps any fingerprint, does not care).
    """
    head = data[: fmt.HEADER_READ_SIZE]
    header = fmt.decode_header(head)
    if platform and header.platform != PLATFORM_BYTES:
        raise FormatError("platform differs")  # not a format error, but the cache must rebuild it too
    slots, written = fmt.choose_slot(head)
    if not slots:
        if written:
            raise FormatError("no valid slot")
        return {}
    first: FormatError | None = None
    for slot in slots:
        try:
            fmt.validate_slot_bounds(slot, header, len(data))
            return fmt.decode_index(data[slot.index_offset : slot.committed_end], slot, header)
        except FormatError as exc:
            first = first or exc
    assert first is not None
    raise first


def file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file-backed mapping of this process, from /proc/self/maps."""
    found = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith("/"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                found.append((low, high, fields[5].strip()))
    return found


def inside_mapping(array: np.ndarray[Any, Any], path: str) -> bool:
    """The array's memory lies inside one live mapping of the cache file (zero-size arrays need no memory).

    The kernel's own table is the judge, not the library's bookkeeping: the view must
    end in a buffer of packcache's mapping windows, and its bytes must lie inside a
    mapping of ``path`` (or of a temp file beside it, renamed or deleted since).
    """
    if array.nbytes == 0:
        return True
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, ctypes.Array):
        return False
    address = array.ctypes.data
    if not (
        ctypes.addressof(base) <= address and address + array.nbytes <= ctypes.addressof(base) + ctypes.sizeof(base)
    ):
        return False
    name = os.path.basename(path)
    return any(
        low <= address and address + array.nbytes <= high and os.path.basename(mapped).lstrip(".").startswith(name)
        for low, high, mapped in file_mappings()
    )


def _names(data: bytes) -> list[str]:
    """Names worth requesting: the base packs', the decodable names in the file, and one never stored."""
    found = [name for name in PACKS]
    with contextlib.suppress(FormatError, ValueError, struct.error):
        found += list(pure_read(data))
    return [*dict.fromkeys(found), "never-stored"]


def run_case(path: str, data: bytes, picks: list[int], counts: Counts, case_seconds: float) -> None:
    counts.cases += 1
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a new inode each case: old mappings stay valid
    with open(path, "wb") as f:
        f.write(data)
    inode = os.stat(path).st_ino
    signal.setitimer(signal.ITIMER_REAL, case_seconds)
    try:
        try:
            expected: dict[str, fmt.Entry] | None = pure_read(data)
        except FormatError:
            counts.format_errors += 1
            expected = None
        packcache.verify(path)
        names = _names(data)
        requested = list(dict.fromkeys(names[i % len(names)] for i in picks))
        served = {}
        with _quiet(), packcache.WeightCache(path, platform=PLATFORM, lock_timeout=0) as cache:
            with cache.session() as s:
                for name in requested:
                    key, array = PACKS.get(name, (None, SMALL))
                    served[name] = s.get_or_pack(name, returning(array), key=key)
            stats = cache.stats()
            rebuilt = os.stat(path).st_ino != inode
            check(data, expected, served, stats, rebuilt, counts, path)
        entry_points(path + ".copy", data, counts)
    except Hang as exc:
        counts.other_exceptions += 1
        counts.failures.append(f"hang: {exc} ({len(data)}-byte file)")
    except Exception as exc:
        counts.other_exceptions += 1
        where = traceback.extract_tb(exc.__traceback__)[-1]
        counts.failures.append(
            f"{type(exc).__name__}: {exc} at {where.filename}:{where.lineno} ({len(data)}-byte file)"
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def check(
    data: bytes,
    expected: dict[str, fmt.Entry] | None,
    served: dict[str, np.ndarray[Any, Any]],
    stats: packcache.CacheStats,
    rebuilt: bool,
    counts: Counts,
    path: str,
) -> None:
    if stats.heap_packs:
        counts.unexpected_heap += 1
        counts.failures.append(f"heap packs {stats.heap_bytes_by_reason} error={stats.error}")
    if expected is not None and rebuilt and stats.stored > 0 and _committed_generation(path) >= 2:
        # Appended to (the generation went on; a rebuild starts at 1), then compacted in the same build: the
        # file was valid and its hits were served from it, as an append's are.
        counts.build_compactions += 1
        rebuilt = False
    elif expected is not None and not rebuilt and stats.stored > 0 and _outweighed(path):
        counts.disagreements += 1
        counts.failures.append("a build left superseded bytes outweighing the live ones (it must compact)")
    if rebuilt:
        counts.rebuilds += 1
    elif stats.hits or stats.stored:
        counts.valid_opens += 1
    # A valid file at the last usable generation cannot take another commit: rebuilding is right.
    exhausted = (
        expected is not None
        and stats.stored > 0
        and len(data) >= fmt.HEADER_READ_SIZE
        and any(slot.generation + 1 >= fmt.MAX_GENERATION for slot in fmt.choose_slot(data[: fmt.HEADER_READ_SIZE])[0])
    )
    if exhausted and rebuilt:
        counts.exhausted_rebuilds += 1
    if (expected is None) != rebuilt and not (exhausted and rebuilt):
        # A file the pure decoders reject must be rebuilt; a valid file must be appended to, not rebuilt.
        counts.disagreements += 1
        counts.failures.append(f"pure decoders {'rejected' if expected is None else 'accepted'}, rebuilt={rebuilt}")
    for name, array in served.items():
        if not inside_mapping(array, path):
            counts.views_outside += 1
            counts.failures.append(f"view of {name!r} outside its mapping")
            continue
        entry = (expected or {}).get(name)
        key = fmt.canonical_key(PACKS.get(name, (None, SMALL))[0])
        hit = not rebuilt and entry is not None and entry.key == key  # a reader matches name and key bytes
        if hit and entry is not None and array.tobytes() != data[entry.offset : entry.offset + entry.nbytes]:
            counts.views_outside += 1
            counts.failures.append(f"view of {name!r} does not hold the file's bytes at {entry.offset}")


def _committed_generation(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        _, slot, _ = packcache._generations.read_committed(fd, path=path)
    finally:
        os.close(fd)
    return slot.generation if slot else 0


def _outweighed(path: str) -> bool:
    report = packcache.inspect(path)
    return report.reclaimable_bytes > report.live_bytes


def entry_points(path: str, data: bytes, counts: Counts) -> None:
    """inspect (library and CLI) and compact on a fresh copy of the case's file."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)
    try:
        packcache.inspect(path)
        counts.inspected += 1
    except ALLOWED:
        pass
    except Exception as exc:
        counts.other(exc, "inspect", len(data))
    for argv in (["inspect", path], ["inspect", path, "--json"]):
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(argv)
            if code not in (0, 1) or (code == 1 and err.getvalue().count("\n") != 1):
                counts.other_exceptions += 1
                counts.failures.append(f"packcache {' '.join(argv[:1])}: exit {code}, stderr {err.getvalue()[:200]!r}")
            elif code == 0 and "--json" in argv:
                json.loads(out.getvalue())
        except Exception as exc:
            counts.other(exc, f"packcache {' '.join(argv)}", len(data))
    try:
        expected: dict[str, fmt.Entry] | None = pure_read(data, platform=False)
    except FormatError:
        expected = None
    try:
        report = packcache.compact(path, lock_timeout=0)
    except FormatError:
        counts.compact_rejected += 1
        if expected is not None:
            counts.disagreements += 1
            counts.failures.append("compact rejected a file the pure decoders accept")
        return
    except ALLOWED as exc:
        counts.other(exc, "compact (not a format error on a plain file)", len(data))
        return
    except Exception as exc:
        counts.other(exc, "compact", len(data))
        return
    counts.compacted += 1
    check_compacted(path, data, expected, report, counts)


def check_compacted(
    path: str, data: bytes, expected: dict[str, fmt.Entry] | None, report: packcache.CompactReport, counts: Counts
) -> None:
    """A compacted file verifies, and holds every kept pack's bytes as the original did."""
    if expected is None:
        counts.disagreements += 1
        counts.failures.append("compact accepted a file the pure decoders reject")
        return
    with open(path, "rb") as f:
        after = f.read()
    try:
        entries = pure_read(after, platform=False)
    except FormatError as exc:
        counts.disagreements += 1
        counts.failures.append(f"compact wrote a file the pure decoders reject: {exc}")
        return
    problems = packcache.verify(path).problems
    if problems or set(entries) != set(expected) - set(report.dropped):
        counts.disagreements += 1
        counts.failures.append(f"compacted file: problems {problems[:2]}, entries {sorted(entries)[:5]}")
        return
    for name, entry in entries.items():
        old = expected[name]
        if after[entry.offset : entry.offset + entry.nbytes] != data[old.offset : old.offset + old.nbytes]:
            counts.disagreements += 1
            counts.failures.append(f"compaction changed the bytes of {name!r}")


# --------------------------------------------------------------------------- safetensors files

SAFETENSORS_DTYPES = sorted(DTYPES)
DEEP = st.integers(65, 20_000).map(lambda n: "[" * n + "]" * n)
HUGE_INT = st.integers(41, 5000).map(lambda n: "9" * n)
HOSTILE_JSON = st.one_of(
    DEEP,
    HUGE_INT,
    st.integers(65, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.sampled_from(['["F32"]', '{"F32": 1}', "null", "true", "1.5", '"F32"', "NaN", "-Infinity", "[]", "{}",
                     "[1, 2, 3]", f"[{2**63}]", f"[{2**64 + 5}, 0]", "[-1]", '[0, "8"]', "[true, 2]",
                     "[" + ", ".join(["1"] * 65) + "]"]),
)  # fmt: skip


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    """A valid safetensors file, then (mostly) something hostile done to its header or its length."""
    tensors: dict[str, Any] = {}
    data = bytearray()
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(SAFETENSORS_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        tensors[f"t{i}.{draw(st.text(max_size=4))}"] = {
            "dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes],
        }  # fmt: skip
        data += draw(st.binary(min_size=nbytes, max_size=nbytes))
    if draw(st.booleans()):
        tensors["__metadata__"] = {"format": "pt"}
    text = json.dumps(tensors, ensure_ascii=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["splice", "splice", "overlap", "duplicate", "edit"]))
        names = [n for n in tensors if n != "__metadata__"]
        if kind == "splice" and names:  # a field of one tensor becomes hostile JSON
            victim = json.dumps(draw(st.sampled_from(names)))
            field_name = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            at = text.find(f'"{field_name}": ', text.find(victim))
            if at >= 0:
                start = at + len(field_name) + 4
                end = _value_end(text, start)
                text = text[:start] + draw(HOSTILE_JSON) + text[end:]
        elif kind == "splice":
            text = draw(HOSTILE_JSON)
        elif kind == "overlap" and len(names) >= 2:
            text = text.replace('"data_offsets": [0, ', '"data_offsets": [1, ', 1)
        elif kind == "duplicate" and names:
            victim = json.dumps(names[0])
            text = text.replace("{", "{" + victim + ': {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, ', 1)
        elif kind == "edit" and text:
            pos = draw(st.integers(0, len(text) - 1))
            text = text[:pos] + draw(st.sampled_from(list('[]{}",:\\0-9e'))) + text[pos + 1 :]
    raw = text.encode("utf-8", "surrogatepass")
    header_len = len(raw) if draw(st.integers(0, 9)) else draw(ints(8))
    body = struct.pack("<Q", header_len) + raw + bytes(data)
    if not draw(st.integers(0, 5)):
        body = body[: draw(st.integers(0, len(body)))]
    return body


def _value_end(text: str, start: int) -> int:
    """Where the JSON value starting at ``start`` ends (a list or a string, as the generator writes them);
    ``start`` itself (an insertion) when an earlier edit broke it."""
    closing = {"[": "]", '"': '"'}.get(text[start : start + 1])
    end = text.find(closing, start + 1) if closing else -1
    return end + 1 if end >= 0 else start


def run_safetensors_case(path: str, data: bytes, counts: Counts) -> None:
    counts.safetensors_cases += 1
    with open(path, "wb") as f:
        f.write(data)
    try:
        source = SafetensorsFile(path)
    except FormatError as exc:
        counts.safetensors_rejected += 1
        if exc.offset is None or not 0 <= exc.offset <= len(data):
            counts.other_exceptions += 1
            counts.failures.append(f"safetensors FormatError without a file offset: {exc}")
        return
    except Exception as exc:
        counts.other(exc, "SafetensorsFile", len(data))
        return
    counts.safetensors_valid += 1
    header_len = struct.unpack_from("<Q", data)[0]
    try:
        for name in source.names():
            array = source.read(name)
            span = source._spans[name]
            if array.tobytes() != data[span.begin : span.begin + span.nbytes] or array.nbytes != span.nbytes:
                counts.disagreements += 1
                counts.failures.append(f"safetensors tensor {name!r} read other bytes than the file's")
            if span.begin < 8 + header_len:
                counts.disagreements += 1
                counts.failures.append(f"safetensors tensor {name!r} starts inside the header")
    except Exception as exc:
        counts.other(exc, "SafetensorsFile.read", len(data))


def fuzz_safetensors(cases: int, counts: Counts, *, seed_value: int | None = None, chunk: int = 5000) -> None:
    directory = tempfile.mkdtemp(prefix="packcache-fuzz-st-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        path = os.path.join(directory, "model.safetensors")
        done, round_number = 0, 0
        while done < cases:
            todo = min(chunk, cases - done)

            @settings(
                max_examples=todo, database=None, deadline=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            @given(data=safetensors_files())
            def one(data: bytes) -> None:
                run_safetensors_case(path, data, counts)

            if seed_value is not None:
                one = seed(seed_value + 7919 * (round_number + 1))(one)
            before = counts.safetensors_cases
            one()
            done += counts.safetensors_cases - before
            round_number += 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------- driver


def fuzz(
    cases: int,
    *,
    chunk: int = 2000,
    case_seconds: float = 10.0,
    seed_value: int | None = None,
    safetensors_cases: int = 0,
) -> Counts:
    """Run at least ``cases`` cache-file cases and ``safetensors_cases`` safetensors cases;
    returns the counts (never raises for a violation: it is counted)."""
    counts = Counts()
    fuzz_safetensors(safetensors_cases, counts, seed_value=seed_value)
    directory = tempfile.mkdtemp(prefix="packcache-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        bases = build_bases(directory)
        path = os.path.join(directory, "fuzz.pcache")
        files = st.one_of(mutated(bases), mutated(bases), synthesised())
        round_number = 0
        while counts.cases < cases:
            todo = min(chunk, cases - counts.cases)

            @settings(
                max_examples=todo, database=None, deadline=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            @given(data=files, picks=st.lists(st.integers(0, 63), min_size=1, max_size=4))
            def one(data: bytes, picks: list[int]) -> None:
                run_case(path, data, picks, counts, case_seconds)

            if seed_value is not None:
                one = seed(seed_value + round_number)(one)
            one()
            round_number += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
        shutil.rmtree(directory, ignore_errors=True)
    return counts
