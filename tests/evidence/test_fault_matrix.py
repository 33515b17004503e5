"""The fault matrix of ``stress/faults.py``, reduced to the rows tests/evidence/test_fault_injection.py does not cover.

Each case runs its load in a child process (as root, as root without
``CAP_DAC_OVERRIDE``, or as the real user ``nobody``) and checks what the
design promises: the load succeeds, every served array is bit-identical to
``pack()``, the reason and errno are the right ones, one ERROR record per
failing reason, no SIGBUS. The case code is the harness's own (``harness.faults``, run by ``stress/faults.py``),
so the default suite and the full run check the same thing. Inode exhaustion
stands in for EDQUOT: this kernel has no tmpfs quota support (CONFIG_TMPFS_QUOTA).
"""

from __future__ import annotations

import pytest

from harness import faults
from harness.driver import Case, Env, run_case

REDUCED = [
    "emfile/open",
    "emfile/open-existing",
    "emfile/append",
    "emfile/rebuild",
    "eacces-nobody/open",
    "eacces-nodac/open",
    "eacces-nobody/append",
    "eacces-nodac/append",
    "eacces-nobody/rebuild",
    "erofs/open",
    "erofs/rebuild",
    "inodes/open",
    "inodes/build",
    "inodes/append",
    "inodes/rebuild",
    "efbig/open",
    "efbig/append",
    "efbig/rebuild",
    "enospc/open",
    "map/build",
    "replace/mapped",
    "replace-corrupt/mapped",
    "delete/mapped",
    "truncate/next-open",
    "truncate/next-session-released",
    "truncate/next-session-held",
    "lock/fifo",
    "lock/symlink",
    "lock/foreign-owner",
    "emfile/many-packs",
]
BY_NAME = {c.name: c for c in faults.CASES}
FLIPS = [faults.flip_case(region, seed) for region in ("header", "index", "data") for seed in range(2)]


def test_reduced_matrix_names_existing_cases() -> None:
    assert set(REDUCED) <= set(BY_NAME), set(REDUCED) - set(BY_NAME)


@pytest.mark.root
@pytest.mark.parametrize("name", REDUCED)
def test_fault_matrix_case(env: Env, name: str) -> None:
    assert run_case(env, BY_NAME[name]) == []


@pytest.mark.root
@pytest.mark.parametrize("case", FLIPS, ids=[c.name for c in FLIPS])
def test_bit_flip_never_serves_a_wrong_byte(env: Env, case: Case) -> None:
    """Header/index flips: a valid open or a rebuild; data flips: found by verify(), repacked with verify=True."""
    assert run_case(env, case) == []


@pytest.mark.root
def test_touching_a_view_after_external_truncation_is_sigbus_documented_limit(env: Env) -> None:
    """Not a guarantee but a documented limit: any mmap user dies touching truncated pages.

    packcache never truncates; this pins what happens when someone else does,
    so docs/RELIABILITY.md can say it plainly.
    """
    assert faults.truncate_while_mapped_limit(env) == "child killed by SIGBUS"
