"""Progress bars on long work (a cold build, a fetch, a publish), drawn by ``tqdm`` as transformers and the hub
client draw theirs (private: the loaders', :mod:`packcache.fleet.fetch`'s and :mod:`packcache.fleet.publish`'s).

A bar is shown only when all of these hold, so a log file, a pipe or a service's journal never gets one:

* ``tqdm`` is importable (it comes with the ``models``, ``hf`` and ``fleet`` extras; the core does not need it);
* stderr is a terminal;
* the switch :data:`PROGRESS_ENV` (``PACKCACHE_PROGRESS``) is not ``0`` (``off``, ``false``, ``no``), and tqdm's own
  global switch ``TQDM_DISABLE`` is not set true;
* the work has run :data:`DELAY` seconds (tqdm's ``delay``): a warm launch that maps its packs draws nothing.

``HF_HUB_DISABLE_PROGRESS_BARS`` is not read: it is the hub client's switch for its downloads, and packcache
downloads nothing from a hub. A disabled bar is ``None`` for the caller, so the work pays one ``is not None`` test
per update and nothing else; an enabled one costs tqdm's ``update`` (a counter, and a redraw at most every
0.1 s), never a lock of the work's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["bar"]

#: The one switch: ``PACKCACHE_PROGRESS=0`` turns every bar off (any other value, or none: bars on a terminal).
PROGRESS_ENV = "PACKCACHE_PROGRESS"

#: Seconds of work before a bar is drawn (tqdm's ``delay``).
DELAY = 1.0

#: What a bar hands the work: called with the units just done (packs, bytes).
Tick = Callable[[int], object]

_OFF = frozenset({"0", "off", "false", "no"})
_TRUE = frozenset({"1", "true", "yes", "on"})


def enabled(stream: TextIO | None = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (stderr by default): the switches, the terminal, tqdm."""
    if os.environ.get(PROGRESS_ENV, "").strip().lower() in _OFF:
        return False
    if os.environ.get("TQDM_DISABLE", "").strip().lower() in _TRUE:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        if stream is None or not stream.isatty():
            return False
    except (AttributeError, ValueError, OSError):  # a replaced stream without isatty, or a closed one
        return False
    try:
        import tqdm  # type: ignore[import-untyped]  # noqa: F401  # the extras' dependency, not the core's
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def bar(
    total: int | Callable[[], int] | None, desc: str, *, unit: str = "pack", nbytes: bool = False
) -> Iterator[Tick | None]:
    """A tqdm bar on stderr for the work inside the block, or ``None`` when none is drawn (:func:`enabled`).

    Args:
        total: the units the work will do, or a function computing it, called only when a bar is drawn (a
            count that reads a checkpoint's header is not paid for by a load nobody watches); ``None``: unknown.
        desc: what the work is, as the bar's label.
        unit: the unit's name; ``nbytes``: the units are bytes (shown scaled, in KiB/MiB/GiB).

    The bar is cleared when the block ends: what the work reports follows it.
    """
    if not enabled():
        yield None
        return
    from tqdm import tqdm

    try:
        count = total() if callable(total) else total
    except Exception:  # the bar's total must never fail the work it reports on; that work meets the same problem
        count = None
    try:
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    # A terminal that reports no size (a pty nobody sized) would get no bar from tqdm: 80 x 24 instead.
    progress = tqdm(
        total=count, desc=desc, unit="B" if nbytes else unit, unit_scale=nbytes, unit_divisor=1024 if nbytes else 1000,
        delay=DELAY, leave=False, file=sys.stderr, dynamic_ncols=sized, ncols=None if sized else 80,
        nrows=None if sized else 24, disable=False,
    )  # fmt: skip
    try:
        yield progress.update
    finally:
        progress.close()
