"""The hostile-file fuzzer of ``stress/fuzz.py``, reduced: 1,500 mutated and synthesised files.

Each file is decoded with the pure format functions, checked with
``packcache.verify`` and opened with ``WeightCache`` in-process. The only
allowed outcomes are a valid open, a ``FormatError`` from the pure decoders, or
a rebuild; the cache and the pure decoders must agree on which files are
valid, every served array must lie inside its mapping and hold the file's
bytes, and no case may hang. The full run (100,000 cases) is ``python stress/fuzz.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stress"))

import fuzz


def test_hostile_files_only_open_reject_or_rebuild() -> None:
    counts = fuzz.fuzz(1500, chunk=1500, case_seconds=10.0, seed_value=20260)
    assert counts.cases >= 1500
    assert counts.failures == [], counts.failures[:10]
    assert (counts.other_exceptions, counts.views_outside, counts.disagreements, counts.unexpected_heap) == (0, 0, 0, 0)
    # Both kinds of outcome are exercised, not just one.
    assert counts.valid_opens > 100 and counts.rebuilds > 100, counts
    assert counts.format_errors == counts.rebuilds
