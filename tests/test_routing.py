"""The routing table of docs/ROUTING.md, row by row, against ``packcache._routing.route``.

The table is read from the document (as tests/test_format.py keeps FORMAT.md in step): every row has
cases here, each case is facts that meet the row's situation (and, where it shows the order, facts of
later rows too), and ``route()`` must answer the row's route and reason. A row with no case, a case
with no row, or a route the function can return that no row names fails.
"""

from __future__ import annotations

import errno
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from packcache._faults import Fault
from packcache._routing import Entry, Facts, Holding, Lock, RouteKind, route
from packcache.stats import HeapReason

ROUTING_MD = Path(__file__).resolve().parents[1] / "docs" / "ROUTING.md"

UNTRUSTED = Fault(HeapReason.UNTRUSTED, 0, "m.pcache is writable by others")
OPEN_FAILED = Fault(HeapReason.OPEN_FAILED, errno.EISDIR, "cannot open m.pcache: EISDIR (Is a directory)")
READ_ONLY = Fault(HeapReason.READ_ONLY, errno.EROFS, "cannot open m.pcache: EROFS (Read-only file system)")
MAP_FAILED = Fault(HeapReason.MAP_FAILED, errno.ENOMEM, "cannot map m.pcache: ENOMEM (Cannot allocate memory)")
LOCKED = Fault(HeapReason.LOCKED, errno.EWOULDBLOCK, "build lock of m.pcache held by pid 7 past 30 s")
NO_SPACE = Fault(HeapReason.NO_SPACE, errno.ENOSPC, "cannot write to m.pcache: ENOSPC (No space left on device)")
WRITE_FAILED = Fault(HeapReason.WRITE_FAILED, errno.EIO, "cannot sync m.pcache: EIO (Input/output error)")

HELD = Lock.HELD  # rows past 9b: the session holds the build lock

#: Facts meeting each row's situation. Later variants add facts of later rows, to show the first row wins.
CASES: dict[str, list[Facts]] = {
    "1": [Facts(cached=False), Facts(cached=False, named=False, held=Holding.SERVABLE, entry=Entry.VALID)],
    "2": [Facts(named=False), Facts(named=False, entry=Entry.VALID, finalized=True)],
    "3": [Facts(held=Holding.SERVABLE), Facts(held=Holding.SERVABLE, blocking=UNTRUSTED, finalized=True)],
    "4": [Facts(blocking=UNTRUSTED), Facts(held=Holding.UNBACKED, blocking=UNTRUSTED, finalized=True)],
    "5": [Facts(blocking=OPEN_FAILED), Facts(held=Holding.RETRY, blocking=OPEN_FAILED, read_only=True)],
    "6": [Facts(entry=Entry.VALID), Facts(held=Holding.RETRY, entry=Entry.VALID, finalized=True, read_only=True)],
    "6a": [Facts(entry=Entry.UNMAPPABLE, entry_fault=MAP_FAILED), Facts(entry=Entry.UNMAPPABLE, finalized=True)],
    "7": [Facts(finalized=True), Facts(finalized=True, read_only=True, lock=Lock.FAILED, lock_fault=LOCKED)],
    "8": [
        Facts(read_only=True, path="m.pcache"),
        Facts(read_only_fault=READ_ONLY),
        Facts(read_only_fault=READ_ONLY, remote=True, lock=Lock.FAILED, lock_fault=LOCKED),
    ],
    "9": [Facts(lock=Lock.FAILED, lock_fault=LOCKED), Facts(lock=Lock.FAILED, lock_fault=LOCKED, remote=True)],
    "9a": [Facts(remote=True), Facts(held=Holding.UNBACKED, remote=True)],
    "9b": [Facts(), Facts(remote=True, remote_tried=True), Facts(held=Holding.RETRY)],
    "10": [
        Facts(lock=HELD, store_fault=NO_SPACE),
        Facts(lock=HELD, remote=True, remote_tried=True, store_fault=NO_SPACE),
    ],
    "11": [Facts(lock=HELD, store_fault=WRITE_FAILED)],
    "12": [Facts(lock=HELD, store_fault=MAP_FAILED)],
    "13": [Facts(lock=HELD), Facts(lock=HELD, remote=True, remote_tried=True, held=Holding.UNBACKED)],
}


def _rows() -> dict[str, tuple[str, str | None]]:
    """``{row: (route, reason or None)}`` from the table of docs/ROUTING.md."""
    rows: dict[str, tuple[str, str | None]] = {}
    for line in ROUTING_MD.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d+[a-z]?", cells[0]):
            route_cell, reason_cell = cells[2], cells[4]
            assert re.fullmatch(r"`[a-z ]+`", route_cell), f"row {cells[0]}: route {route_cell!r} is not one `name`"
            reason = None if reason_cell == "\u2013" else reason_cell.strip("`")
            rows[cells[0]] = (route_cell.strip("`"), reason)
    return rows


ROWS = _rows()


def test_the_table_is_read_and_every_row_has_cases() -> None:
    assert len(ROWS) >= 16, "docs/ROUTING.md's table was not found"
    assert sorted(ROWS) == sorted(CASES), "rows of docs/ROUTING.md without cases here (or cases without a row)"
    assert {route for route, _ in ROWS.values()} == {kind.value for kind in RouteKind}


def _row_order(row: str) -> tuple[int, str]:
    return int(re.sub(r"\D", "", row)), row


ROW_IDS = sorted(CASES, key=_row_order)


@pytest.mark.parametrize("row", ROW_IDS)
def test_route_answers_each_row_of_the_routing_table(row: str) -> None:
    expected_route, expected_reason = ROWS[row]
    for facts in CASES[row]:
        decided = route(facts)
        assert (decided.kind.value, decided.reason.value if decided.reason else None) == (
            expected_route,
            expected_reason,
        ), f"row {row}: {facts}"
        if decided.kind is RouteKind.HEAP and expected_reason not in ("disabled", "unnamed", "finalized"):
            assert decided.fault is not None and decided.fault.reason.value in (expected_reason, "map_failed")
        else:
            assert decided.fault is None


def test_every_route_the_function_can_return_is_a_row() -> None:
    """Every combination of facts (a fault of each reason the table names) ends in a (route, reason) of a row."""
    named = set(ROWS.values())
    choices: dict[str, list[Any]] = {
        "cached": [True, False],
        "named": [True, False],
        "held": list(Holding),
        "entry": [(Entry.UNKNOWN, None), (Entry.ABSENT, None), (Entry.VALID, None), (Entry.UNMAPPABLE, MAP_FAILED)],
        "blocking": [None, UNTRUSTED, OPEN_FAILED],
        "finalized": [False, True],
        "read_only": [False, True],
        "read_only_fault": [None, READ_ONLY],
        "lock": [(Lock.NOT_TAKEN, None), (Lock.HELD, None), (Lock.FAILED, LOCKED)],
        "remote": [False, True],
        "remote_tried": [False, True],
        "store_fault": [None, NO_SPACE, WRITE_FAILED, MAP_FAILED],
    }
    seen = set()
    for values in itertools.product(*choices.values()):
        given = dict(zip(choices, values, strict=True))
        given["entry"], given["entry_fault"] = given["entry"]
        given["lock"], given["lock_fault"] = given["lock"]
        facts = Facts()._replace(**given)
        decided = route(facts)
        seen.add((decided.kind.value, decided.reason.value if decided.reason else None))
    assert seen - named == set(), "routes no row of docs/ROUTING.md names"
    assert named - seen == set(), "rows no facts reach"


def test_a_read_only_route_names_the_file_when_the_store_gave_no_fault() -> None:
    decided = route(Facts(read_only=True, path="/var/cache/m.pcache"))
    assert decided.fault is not None and decided.fault.message == "cache /var/cache/m.pcache is read-only"
    assert route(Facts(read_only=True, read_only_fault=READ_ONLY)).fault is READ_ONLY


def test_the_facts_a_session_serves_a_repeat_on_route_to_a_hit() -> None:
    """The session answers a repeat without calling route() (the warm path): its facts must route to a hit."""
    from packcache import _session

    assert route(_session._SERVABLE).kind is RouteKind.HIT
