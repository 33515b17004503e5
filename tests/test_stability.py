"""Reduced run of stress/stability.py: reloads change nothing, caches converge, compaction reclaims."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_harness() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "stress" / "stability.py"
    spec = importlib.util.spec_from_file_location("stress_stability", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reloads_never_change_the_file_and_a_version_change_converges(tmp_path: Path) -> None:
    result = load_harness().run(str(tmp_path), cycles=30, packs=16)
    assert result["failures"] == []
    assert result["file_changes"] == 0
    assert result["stored_per_load_after_version_change"] == [16, 0, 0, 0, 0]
    # Two versions were stored; compaction keeps one copy (plus header, index and alignment).
    assert result["bytes_before_compaction"] > 2 * result["live_bytes"]
    assert result["live_bytes"] < result["bytes_after_compaction"] < result["live_bytes"] + 16 * 1024
