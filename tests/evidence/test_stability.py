"""Reduced run of stress/stability.py: reloads change nothing, caches converge, the converging build compacts."""

from __future__ import annotations

from pathlib import Path

from harness import stability


def test_reloads_never_change_the_file_and_a_version_change_converges(tmp_path: Path) -> None:
    result = stability.run(str(tmp_path), cycles=30, packs=16)
    assert result["failures"] == []
    assert result["file_changes"] == 0
    assert result["stored_per_load_after_version_change"] == [16, 0, 0, 0, 0]
    # Two versions were stored; the build of the second compacted the file to one copy (plus header, index and
    # alignment), so an explicit compaction finds nothing more.
    assert result["live_bytes"] < result["bytes_before_compaction"] < result["live_bytes"] + 16 * 1024
    assert result["bytes_after_compaction"] == result["bytes_before_compaction"]
