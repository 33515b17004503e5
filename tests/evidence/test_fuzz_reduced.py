"""The hostile-file fuzzer of ``stress/fuzz.py``, reduced: 1,500 mutated and synthesised
cache files and 1,500 hostile safetensors files.

Each cache file is decoded with the pure format functions, checked with
``packcache.verify`` and opened with ``WeightCache`` in-process. The only
allowed outcomes are a valid open, a ``FormatError`` from the pure decoders, or
a rebuild; the cache and the pure decoders must agree on which files are
valid, every served array must lie inside its mapping and hold the file's
bytes, and no case may hang. The maintenance entry points see every file too:
``packcache.inspect``, ``packcache inspect`` (text and JSON) and ``compact`` of a
copy may only raise FormatError/UntrustedFileError/OSError, and compact must
reject exactly what the pure decoders reject. Every safetensors file either
parses (and reads back its exact bytes) or is a FormatError naming an offset.
The fuzzer is ``harness.fuzz``; the full run (100,000 of each) is ``python stress/fuzz.py``.
"""

from __future__ import annotations

from pathlib import Path

from harness import fuzz


def test_hostile_files_only_open_reject_or_rebuild() -> None:
    counts = fuzz.fuzz(1500, chunk=1500, case_seconds=10.0, seed_value=20260, safetensors_cases=1500)
    assert counts.cases >= 1500 and counts.safetensors_cases >= 1500
    assert counts.failures == [], counts.failures[:10]
    assert (counts.other_exceptions, counts.views_outside, counts.disagreements, counts.unexpected_heap) == (0, 0, 0, 0)
    # Both kinds of outcome are exercised, not just one.
    assert counts.valid_opens > 100 and counts.rebuilds > 100, counts
    # Every rebuild is of a rejected file, or of a valid one whose generations ran out.
    assert counts.format_errors + counts.exhausted_rebuilds == counts.rebuilds
    # The entry points saw both valid and rejected files, and so did the safetensors reader.
    assert counts.compacted > 100 and counts.compact_rejected > 100 and counts.inspected >= counts.compacted, counts
    assert counts.safetensors_valid > 100 and counts.safetensors_rejected > 100, counts


def test_valid_file_at_the_last_generation_never_fails_a_load(tmp_path: Path) -> None:
    """Found by the fuzzer: a valid file whose slot holds generation 2**64-1.

    Appending to it must not raise out of the session (a cache problem never
    fails a model load): the next generation does not fit the u64 field, so the
    cache has to rebuild the file (or refuse such a slot when reading).
    """
    import struct

    from packcache import format as fmt

    bases = fuzz.build_bases(str(tmp_path))
    buf = bytearray(bases[0])
    slots = fmt.choose_slot(bytes(buf[: fmt.HEADER_READ_SIZE]))[0]
    newest = slots[0]
    last = fmt.Slot(2**64 - 1, newest.index_offset, newest.index_size, newest.entry_count, newest.index_crc)
    body = fmt.SLOT.pack(fmt.SLOT_MAGIC, last.generation, last.index_offset, last.index_size, last.entry_count,
                         last.index_crc, bytes(20), 0)  # fmt: skip
    buf[fmt.SLOT_OFFSETS[0] : fmt.SLOT_OFFSETS[0] + 64] = bytes(64)
    buf[fmt.SLOT_OFFSETS[1] : fmt.SLOT_OFFSETS[1] + 64] = body[:-4] + struct.pack("<I", fuzz.crc(body[:-4]))
    counts = fuzz.Counts()
    names = fuzz._names(bytes(buf))
    assert names[-1] == "never-stored"
    fuzz.run_case(str(tmp_path / "last.pcache"), bytes(buf), [0, len(names) - 1], counts, 10.0)  # a hit and a miss
    assert counts.failures == []
    assert counts.valid_opens + counts.rebuilds == 1
