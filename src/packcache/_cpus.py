"""The CPUs this process may use: what a pool of threads or processes is sized by.

The affinity mask, not the machine's count: in a container or under ``taskset`` a process may run on
fewer CPUs than the machine has, and threads past those only queue for them.

>>> usable_cpus() >= 1
True
"""

from __future__ import annotations

import os

__all__ = ["usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the OS has one, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
