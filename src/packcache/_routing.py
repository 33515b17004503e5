"""Routing: where one request goes, as a pure function of what the session knows (docs/ROUTING.md's table).

The session gathers :class:`Facts` (what the cache holds for the name and key, what the file holds,
the store's faults, the options, the build lock, the remote) and :func:`route` answers with one
:class:`Route`: ``hit``, ``store``, ``fetch first``, ``lock first``, or ``heap`` with a reason and its
fault. The first row of the table that applies wins, in the table's order. No I/O, no lock, no ledger
here: the session does what the route says, and ``tests/test_routing.py`` checks every row of the
table against this function.

>>> route(Facts(entry=Entry.VALID)).kind.value
'hit'
>>> route(Facts(finalized=True))
Route(kind=<RouteKind.HEAP: 'heap'>, reason=<HeapReason.FINALIZED: 'finalized'>, fault=None)
>>> route(Facts(lock=Lock.HELD)).kind.value, route(Facts(remote=True)).kind.value
('store', 'fetch first')
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from ._faults import Fault
from .stats import HeapReason

__all__ = ["Entry", "Facts", "Holding", "Lock", "Route", "RouteKind", "route"]


class RouteKind(enum.Enum):
    """What the session does with a request (the ``route`` column of docs/ROUTING.md)."""

    HIT = "hit"  # serve the pack the cache holds, or the file's entry, mapped
    STORE = "store"  # pack it, append it to the file, serve it mapped
    FETCH_FIRST = "fetch first"  # fetch the published file (remote=), then take the build lock, then route again
    LOCK_FIRST = "lock first"  # take the build lock (re-reading the file), then route again
    HEAP = "heap"  # pack it, serve it from heap, counted under the route's reason


class Holding(enum.Enum):
    """What the cache holds for the request's name and key."""

    NOTHING = "nothing"  # no pack of this name and key
    SERVABLE = "servable"  # served before, and (if mapped) the file still holds its bytes
    UNBACKED = "unbacked"  # served mapped before, but the file no longer holds those bytes
    RETRY = "retry"  # served from heap for a failure in an earlier session: the failure may be gone


class Entry(enum.Enum):
    """What the file holds for the request's name and key."""

    UNKNOWN = "unknown"  # not looked up: no file to look in (the store's blocking fault)
    ABSENT = "absent"  # no valid entry of that name and key
    VALID = "valid"  # a valid entry, mapped
    UNMAPPABLE = "unmappable"  # a valid entry that could not be mapped (``entry_fault`` says why)


class Lock(enum.Enum):
    """The session's cross-process build lock."""

    NOT_TAKEN = "not taken"
    HELD = "held"
    FAILED = "failed"  # ``lock_fault`` says why (another process held it past lock_timeout, ...)


# The members route() compares, as module names: a member read through its class costs ~0.2 us on
# Python 3.11, several times what the rest of a warm hit costs.
_SERVABLE, _VALID, _UNMAPPABLE = Holding.SERVABLE, Entry.VALID, Entry.UNMAPPABLE
_FAILED, _NOT_TAKEN = Lock.FAILED, Lock.NOT_TAKEN


class Facts(NamedTuple):
    """What the session knows about one request; every field defaults to the plain case (a named
    request on a usable, writable file holding nothing for it, the build lock not taken, no remote)."""

    cached: bool = True  # caching on: a path, enabled
    named: bool = True  # the request has a name
    held: Holding = Holding.NOTHING
    entry: Entry = Entry.ABSENT
    entry_fault: Fault | None = None  # why an UNMAPPABLE entry could not be mapped
    blocking: Fault | None = None  # the store's blocking fault: the file cannot be used at all
    finalized: bool = False
    read_only: bool = False  # the cache option
    read_only_fault: Fault | None = None  # the file may only be read (the store found out)
    path: str = ""  # the cache file, for the read-only fault's message
    lock: Lock = Lock.NOT_TAKEN
    lock_fault: Fault | None = None  # why the lock FAILED
    remote: bool = False  # remote= configured
    remote_tried: bool = False  # this cache has fetched (or tried to) already
    store_fault: Fault | None = None  # storing the pack failed (or stored it but could not map it)


class Route(NamedTuple):
    """Where a request goes: ``kind``, and for ``heap`` the reason it is counted under and the fault (None
    for a reason that is no failure)."""

    kind: RouteKind
    reason: HeapReason | None = None
    fault: Fault | None = None


_HIT = Route(RouteKind.HIT)
_STORE = Route(RouteKind.STORE)
_FETCH_FIRST = Route(RouteKind.FETCH_FIRST)
_LOCK_FIRST = Route(RouteKind.LOCK_FIRST)
_DISABLED = Route(RouteKind.HEAP, HeapReason.DISABLED)
_UNNAMED = Route(RouteKind.HEAP, HeapReason.UNNAMED)
_FINALIZED = Route(RouteKind.HEAP, HeapReason.FINALIZED)


def _heap(fault: Fault) -> Route:
    return Route(RouteKind.HEAP, fault.reason, fault)


def route(facts: Facts) -> Route:
    """The route of one request: the first row of docs/ROUTING.md that ``facts`` meet (the comments name them).

    Faults keep their own reason (a blocking fault may be ``untrusted``, ``open_failed`` or ``read_only``;
    a lock fault ``locked`` or whatever opening the lock file met; a store fault ``no_space``,
    ``write_failed`` or ``map_failed``). Raises nothing.
    """
    if not facts.cached:
        return _DISABLED  # 1
    if not facts.named:
        return _UNNAMED  # 2
    if facts.held is _SERVABLE:
        return _HIT  # 3
    if facts.blocking is not None:
        return _heap(facts.blocking)  # 4, 5
    if facts.entry is _VALID:
        return _HIT  # 6
    if facts.entry is _UNMAPPABLE:
        fault = facts.entry_fault or Fault(HeapReason.MAP_FAILED, 0, f"cannot map an entry of {facts.path}")
        return Route(RouteKind.HEAP, HeapReason.MAP_FAILED, fault)  # 6a
    if facts.finalized:
        return _FINALIZED  # 7
    if facts.read_only or facts.read_only_fault is not None:
        fault = facts.read_only_fault or Fault(HeapReason.READ_ONLY, 0, f"cache {facts.path} is read-only")
        return Route(RouteKind.HEAP, HeapReason.READ_ONLY, fault)  # 8
    if facts.lock is _FAILED:
        assert facts.lock_fault is not None, "a failed lock carries its fault"
        return _heap(facts.lock_fault)  # 9
    if facts.lock is _NOT_TAKEN:
        return _FETCH_FIRST if facts.remote and not facts.remote_tried else _LOCK_FIRST  # 9a, 9b
    if facts.store_fault is not None:
        return _heap(facts.store_fault)  # 10, 11, 12
    return _STORE  # 13
