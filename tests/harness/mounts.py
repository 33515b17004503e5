"""Real faults from the machine: a tiny tmpfs (ENOSPC, inode exhaustion), a read-only bind mount (EROFS).

Mounting needs root. Tests that need it fail loudly (never skip) when not
root: mounts, chown and rlimits-as-root are the point of those tests, and CI
runs as root.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT_ONLY = "this test needs root (CI runs as root)"


def require_root() -> None:
    """Fail (never skip) when not root: mounts, chown and rlimits-as-root are the point of these tests."""
    assert os.geteuid() == 0, ROOT_ONLY


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _umount(directory: Path) -> None:
    gc.collect()  # arrays handed out keep their mappings (and so the mount) busy until collected
    done = subprocess.run(["umount", str(directory)], capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, text=True)
        raise AssertionError(f"umount {directory} failed (lazily unmounted instead): {done.stderr.strip()}")


@contextlib.contextmanager
def tmpfs(directory: Path, size: str = "1m") -> Iterator[Path]:
    """Mount a fresh tmpfs of ``size`` (more mount options may follow: ``"8m,nr_inodes=2"``) on ``directory``
    (created), unmounted on exit."""
    require_root()
    directory.mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)])
    try:
        yield directory
    finally:
        _umount(directory)


@contextlib.contextmanager
def read_only_bind(source: Path, target: Path) -> Iterator[Path]:
    """Bind-mount ``source`` on ``target`` (created) read-only, unmounted on exit."""
    require_root()
    target.mkdir(parents=True, exist_ok=True)
    _run(["mount", "--bind", str(source), str(target)])
    try:
        _run(["mount", "-o", "remount,bind,ro", str(target)])
        yield target
    finally:
        _umount(target)


def fill(directory: Path, leave_free: int) -> None:
    """Fill the file system of ``directory`` until at most ``leave_free`` bytes remain."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    filler = max(0, free - leave_free)
    with open(directory / "filler", "wb") as f:
        f.write(b"\xaa" * filler)
