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
