"""The kernel's own memory figures, to check packcache's accounting against (Linux).

``/proc/<pid>/smaps_rollup`` gives a process's anonymous and file-backed memory;
``/proc/<pid>/smaps`` broken down per mapping gives what one cache file costs a
process (its resident and proportional set sizes).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["MappingUsage", "file_mapping_usage", "release_free_heap", "smaps_rollup"]


def release_free_heap() -> bool:
    """Ask glibc to return freed heap memory to the kernel (``malloc_trim(0)``).

    glibc keeps freed memory for reuse, so right after packing, ``Anonymous``
    still counts temporaries that are already free. Trimming first makes the
    kernel's figure comparable with what the cache holds. Returns False where
    there is no glibc.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """``malloc_trim`` of the C library this process runs on, found once; None without glibc. Looked up in the
    process's own symbols (``CDLL(None)``, as ``_mapping`` does), not by ``ctypes.util.find_library``, which runs
    ``ldconfig`` in a child process on every call (about 1 ms each, in every serve worker's start and every reading
    of ``packcache run``)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Fields of ``/proc/<pid>/smaps_rollup`` in bytes (``Rss``, ``Pss``, ``Anonymous``, ``Pss_File``, ...).

    Raises:
        OSError: on a system without ``/proc`` (not Linux) or a vanished process.

    >>> smaps_rollup()["Rss"] > 0
    True
    """
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB" and parts[0].endswith(":"):
                fields[parts[0][:-1]] = int(parts[1]) * 1024
    return fields


@dataclass(frozen=True)
class MappingUsage:
    """What the mappings of one file cost a process, in bytes."""

    mappings: int  # number of VMAs mapping the file
    size: int  # virtual size mapped
    rss: int  # resident
    pss: int  # proportional: shared pages divided among the processes mapping them
    anonymous: int  # private copies (should be 0 for read-only maps)
    deleted: int = 0  # of ``mappings``, those of a file since deleted or replaced (an old inode still served)


def file_mapping_usage(path: str | os.PathLike[str], pid: int | str = "self") -> MappingUsage:
    """Sum the ``/proc/<pid>/smaps`` entries whose mapped file is ``path``.

    A file replaced or deleted since it was mapped still counts (the kernel shows
    it with a `` (deleted)`` suffix).

    Raises:
        OSError: on a system without ``/proc``.
    """
    target = os.path.realpath(path)
    totals = {"Size": 0, "Rss": 0, "Pss": 0, "Anonymous": 0}
    count = deleted = 0
    current = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping header: "start-end perms offset dev inode [path]"
                parts = line.rstrip("\n").split(maxsplit=5)
                name = parts[5] if len(parts) == 6 else ""
                current = name == target or name == target + " (deleted)"
                count += current
                deleted += current and name.endswith(" (deleted)")
            elif current and head[:-1] in totals:
                totals[head[:-1]] += int(line.split()[1]) * 1024
    return MappingUsage(count, totals["Size"], totals["Rss"], totals["Pss"], totals["Anonymous"], deleted)
