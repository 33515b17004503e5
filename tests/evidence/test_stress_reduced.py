"""Reduced runs of the crash, stampede and interrupts harnesses (stress/crash.py, stress/stampede.py,
stress/interrupts.py): real processes, real SIGKILL, small numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness import crash, interrupts, stampede


def assert_clean(result: dict[str, Any], must_be_zero: tuple[str, ...], trials: int) -> None:
    """No failure listed, every must-be-zero figure zero, every trial run."""
    assert result["failures"] == []
    for figure in must_be_zero:
        assert result[figure] == 0, (figure, result)
    assert result["trials"] == trials


def test_random_sigkill_of_build_append_and_compaction_never_serves_wrong_bytes_or_loses_a_cache(
    tmp_path: Path,
) -> None:
    result = crash.run(tmp_path, trials=30, seed=7, workers=2, calibration_runs=2)
    assert_clean(result, crash.MUST_BE_ZERO, trials=30)
    # A harness whose kills all land after the writer finished proves nothing.
    assert result["killed_mid_write"] >= 10, result
    assert result["uncommitted_on_disk"] >= 3, result
    for scenario, figures in result["by_scenario"].items():
        assert figures.get("killed_mid_write", 0) >= 1, (scenario, figures)


def test_eight_processes_on_an_empty_cache_one_builds_the_others_map(tmp_path: Path) -> None:
    result = stampede.stampede(tmp_path, rounds=3, processes=8, lock_timeout=60.0)
    assert result["failures"] == []
    assert (result["builders_per_round"], result["waiters_mapped"], result["files_one_copy"]) == ("1", 21, "3/3")
    assert (result["mismatches"], result["errors"], result["heap_locked_packs"]) == (0, 0, 0)
    assert stampede.passed("wait", result)


def test_eight_processes_with_zero_lock_timeout_one_builds_the_others_pack_to_heap_locked(tmp_path: Path) -> None:
    result = stampede.stampede(tmp_path, rounds=3, processes=8, lock_timeout=0.0)
    assert result["failures"] == []
    assert (result["builders_per_round"], result["files_one_copy"], result["mismatches"], result["errors"]) == (
        "1", "3/3", 0, 0)  # fmt: skip
    assert result["locked_processes"] + result["late_mapped"] == 21
    assert result["heap_locked_packs"] == result["locked_processes"] * len(stampede.PACKS) > 0
    assert stampede.passed("zero-timeout", result)


def test_readers_mapping_while_a_writer_appends_never_see_wrong_bytes(tmp_path: Path) -> None:
    result = stampede.mixed(tmp_path, rounds=2, processes=8)
    assert result["failures"] == []
    assert (result["mismatches"], result["errors"], result["regressions"]) == (0, 0, 0)
    every_pack = 2 * (len(stampede.WARM) + len(stampede.APPENDED))
    assert result["final_hits"] == f"{every_pack}/{every_pack}"  # after the writer, a fresh reader maps every pack
    assert result["opens_mid_append"] > 0  # the readers really opened the cache between the writer's sessions
    assert stampede.passed("mixed", result)


@pytest.mark.serial  # timers calibrated at its start: tests beside it change the load (53 of 120 landed mid-load)
def test_interrupts_at_random_instants_leave_the_cache_usable_and_the_file_valid(tmp_path: Path) -> None:
    result = interrupts.run(tmp_path, trials=120, seed=3, workers=2, calibration_runs=2)
    assert_clean(result, interrupts.MUST_BE_ZERO, trials=120)
    # Most timers must fire mid-load, or the run proves nothing about interrupts.
    assert result["interrupted"] >= 60, result
