"""The store's condition as one value: :class:`StoreState`, and :class:`StoreStatus` around it.

A :class:`~packcache._store.FileStore` knows one thing about its path at a time: nothing yet, no file,
a file it must not use, a file it will replace, or a committed file it serves from. That is one
:class:`StoreStatus`, made whole by each transition (a refresh, a commit, a compaction, a close) and
swapped in by one assignment, never patched field by field; a reader holding the old one still sees a
consistent picture. Its "why not" fields each hold one idea:

* ``blocking``: why every request goes to heap (an untrusted file, a path that cannot be opened, a
  missing file of a read-only cache). The ledger keeps the same fault as ``Ledger.blocking``;
  ``CacheStats.failing`` is true while there is one (or while the last commit failed).
* ``read_only_fault``: why misses cannot be stored (the file was opened read-only).
* ``rebuild``: why the next store writes a new file instead of appending.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from . import format as fmt
from ._faults import Fault
from ._mapping import FileMap

__all__ = ["Committed", "OpenFile", "StoreState", "StoreStateError", "StoreStatus"]


class StoreStateError(RuntimeError):
    """An operation the store's state does not allow: a bug in the caller, never a cache problem
    (those are :class:`~packcache._faults.Fault`). The message names the operation and the state."""


class StoreState(enum.Enum):
    """What a :class:`~packcache._store.FileStore` knows of its path.

    Transitions (the method that makes each)::

        UNREAD ──refresh──▶ MISSING | BLOCKED | REBUILD | READY
        MISSING | BLOCKED | REBUILD | READY ──refresh──▶ any of these four (the file changed, or not)
        MISSING | REBUILD | READY ──store──▶ a write pending: appended to a READY writable file (read
            again under its inode lock first, which may change the state), else to a new file
        (a write pending) ──commit──▶ READY (the new generation; the file built, for a new one)
        (a write pending) ──abort──▶ the state it was in
        READY ──compact_if_superseded──▶ READY (the compacted copy; REBUILD if it does not read back)
        any ──close──▶ CLOSED, for good (closing again does nothing)

    While a write is pending, refresh changes nothing: the session's own writes are newer than the disk.

    Illegal, each a :class:`StoreStateError` with its own message: anything but ``close``, ``abort``
    and ``release_lock`` on a CLOSED store; ``store`` before the first refresh (UNREAD), or starting a
    write while BLOCKED or with a ``read_only_fault`` (the session routes those misses to heap);
    ``commit`` with nothing pending; ``take_lock`` while the build lock is held, ``hold_lock`` with
    nothing taken.
    """

    UNREAD = "unread"  # made, never refreshed: nothing known, nothing open
    MISSING = "missing"  # no file at the path: the next store builds one (a read-only cache: blocking instead)
    BLOCKED = "blocked"  # something at the path that must not be used: every request goes to heap
    REBUILD = "rebuild"  # a file is open but invalid, of another platform or unreadable: the next store replaces it
    READY = "ready"  # a valid file is open and mapped: its committed packs are served
    CLOSED = "closed"  # closed: descriptors released, every operation refused


@dataclass(frozen=True, eq=False, slots=True)
class OpenFile:
    """The cache file the store holds open: its descriptor, (st_dev, st_ino), mapping, and open mode."""

    fd: int
    identity: tuple[int, int]
    map: FileMap
    writable: bool  # opened read-write (else read-only: by configuration, or because writing was refused)


@dataclass(frozen=True, eq=False, slots=True)
class Committed:
    """The newest valid generation of the open file, as last read (or as this process committed it).

    ``corrupt`` is what the store learns about these bytes after reading them: the committed entries
    whose bytes failed their checksum (``verify``), never served again from this generation.
    """

    header: fmt.Header
    slot: fmt.Slot | None  # None: a file never committed (a header only)
    entries: dict[str, fmt.Entry]
    corrupt: set[str] = field(default_factory=set)


@dataclass(frozen=True, eq=False, slots=True)
class Serving:
    """What serving a committed pack of a READY store reads, gathered from the status's parts once, as the
    status is made: the per-request path reads these slots instead of following the status's attributes
    into its file and committed generation."""

    entries: dict[str, fmt.Entry]  # the committed index, by name
    corrupt: set[str]  # committed entries whose bytes failed their checksum (never served again)
    size: int  # bytes of the file as last read
    map: FileMap
    data_start: int
    dev: int  # the open file's st_dev and st_ino: the origin of every pack served from it
    ino: int


@dataclass(frozen=True, eq=False)
class StoreStatus:
    """The store's condition (module docstring): its state, the file it holds and what the file holds.

    Which fields a state has is checked when a status is made: a status that mixes two states'
    fields is a bug, caught where it is made rather than where it is misread.
    """

    state: StoreState
    file: OpenFile | None = None  # BLOCKED may keep the file it found untrusted: trust is checked again
    size: int = 0  # bytes of the file as last read (0: none read)
    committed: Committed | None = None  # READY only
    blocking: Fault | None = None  # BLOCKED; MISSING in a read-only cache
    read_only_fault: Fault | None = None  # REBUILD, READY (and MISSING): the file was opened read-only
    rebuild: str | None = None  # MISSING, REBUILD
    #: READY: what serving a committed pack reads (:class:`Serving`). None in any other state.
    serving: Serving | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        state = self.state
        problem = None
        if state in (StoreState.UNREAD, StoreState.CLOSED):
            if any((self.file, self.size, self.committed, self.blocking, self.read_only_fault, self.rebuild)):
                problem = "holds nothing"
        elif state is StoreState.MISSING:
            if self.file is not None or self.committed is not None or self.rebuild is None:
                problem = "has no file and a rebuild reason"
        elif state is StoreState.BLOCKED:
            if self.blocking is None or self.committed is not None or self.rebuild is not None:
                problem = "has a blocking fault, nothing committed and no rebuild reason"
        elif state is StoreState.REBUILD:
            if self.file is None or self.committed is not None or self.rebuild is None or self.blocking is not None:
                problem = "has a file, a rebuild reason and nothing committed"
        elif self.file is None or self.committed is None or self.rebuild is not None or self.blocking is not None:
            problem = "has a file and what it commits, and nothing blocking"
        if problem is not None:
            raise AssertionError(f"a {state.name} store status {problem}: {self!r}")
        if state is StoreState.READY:
            file, committed = self.file, self.committed
            assert file is not None and committed is not None
            dev, ino = file.identity
            serving = Serving(
                committed.entries, committed.corrupt, self.size, file.map, committed.header.data_start, dev, ino
            )
            object.__setattr__(self, "serving", serving)  # frozen: set once, here, as the status is made

    @property
    def replacing(self) -> str | None:
        """Why the file open now will be replaced by a new one at the next store (None: it will not)."""
        return self.rebuild if self.state is StoreState.REBUILD else None

    @property
    def reclaimable_bytes(self) -> int:
        """Bytes of the committed file that compaction would reclaim: superseded packs, older indexes,
        the bytes of failed writes (0 for a file that is missing, invalid or about to be rebuilt)."""
        return self.figures[1]

    @cached_property
    def figures(self) -> tuple[int, int]:
        """(live, reclaimable) bytes of a READY file's newest generation; (0, 0) for anything else
        (a file that is missing, invalid, about to be rebuilt, or never committed)."""
        committed = self.committed
        if committed is None or committed.slot is None:
            return 0, 0
        entries = committed.entries.values()
        compacted = fmt.compacted_size(entries, committed.header, committed.slot.index_size)
        return sum(e.nbytes for e in entries), max(0, self.size - compacted)
