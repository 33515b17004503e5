"""An interrupt (Ctrl-C, a signal handler raising) can land between any two lines of a ledger change;
the byte figures must still add up to what the ledger holds afterwards.

``stress/interrupts.py --trials 20000`` found 5 trials of the ``append`` scenario (at 5ec6302) where
they did not: the statistics' mapped + heap bytes differed from the packs held. Here every line of
every change is interrupted on purpose: a trace function raises KeyboardInterrupt as the line is
about to run (signals are handled between bytecodes, so line starts are a subset of the points a real
interrupt can hit, see _lines; a change is one statement per line, so none splits a line's effect in two).
"""

from __future__ import annotations

import ast
import dis
import inspect
import sys
import textwrap
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest

from packcache._ledger import Held, Ledger
from packcache.stats import HeapReason


def _mapped(n: int) -> Held:
    return Held(np.zeros(n, dtype=np.uint8), b"k", None, 1, (1, 2, 3))


def _heap(n: int, reason: HeapReason = HeapReason.READ_ONLY) -> Held:
    return Held(np.zeros(n, dtype=np.uint8), b"k", reason, 1)


def _ledger() -> Ledger:
    ledger = Ledger("x.pcache")
    ledger.hold("a", _mapped(100), outcome="hits")
    ledger.hold("b", _heap(30), outcome=None)
    ledger.hold(None, _heap(7, HeapReason.UNNAMED))
    return ledger


def _consistent(ledger: Ledger) -> bool:
    held = sum(h.nbytes for h in ledger.held.values()) + sum(h.nbytes for h in ledger.unnamed.values())
    stats = ledger.snapshot(True, "x.pcache")
    return ledger.seq % 2 == 0 and held == stats.mapped_bytes + stats.heap_bytes


CHANGES: dict[str, tuple[Callable[..., Any], Callable[[Ledger], None]]] = {
    "hold a new mapped pack": (Ledger.hold, lambda g: g.hold("c", _mapped(50), outcome="hits")),
    "hold a heap pack": (Ledger.hold, lambda g: g.hold("c", _heap(50))),
    "hold an unnamed pack": (Ledger.hold, lambda g: g.hold(None, _heap(5, HeapReason.UNNAMED))),
    "hold over a held name": (Ledger.hold, lambda g: g.hold("a", _mapped(60), outcome="stored")),
    "hold_hits": (
        Ledger.hold_hits,
        lambda g: g.hold_hits([("c", _mapped(11)), ("d", _mapped(13)), ("e", _mapped(17))], map_seconds=0.1),
    ),
    "drop a name": (Ledger.drop, lambda g: g.drop("a")),
    "drop an unnamed pack": (Ledger.drop, lambda g: g.drop(None, 1)),
    "drop_all": (Ledger.drop_all, lambda g: g.drop_all()),
    "reclassify": (Ledger.reclassify, lambda g: g.reclassify("a", HeapReason.MAP_FAILED, 2)),
}


def _lines(method: Callable[..., Any]) -> list[int]:
    """The lines of ``method`` an interrupt can stop before: all but those of its ``finally`` clause and
    ``except`` handlers. CPython handles a signal after a call, at a loop's back edge or at a function's
    entry (its eval breaker); an interrupt raised by the body's last call is raised inside the ``try``,
    and a clean-up clause runs no such point before it restores the sequence counter."""
    code = method.__code__
    source, first = inspect.getsourcelines(method)
    tree = ast.parse(textwrap.dedent("".join(source)))
    cleanup: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for part in (*node.finalbody, *node.handlers):
                end = part.end_lineno or part.lineno
                cleanup.update(range(part.lineno + first - 1, end + first))
    lines = {line for _, line in dis.findlinestarts(code) if line is not None and line > code.co_firstlineno}
    return sorted(lines - cleanup)


def _interrupted_at(code: CodeType, line: int, change: Callable[[], None]) -> bool:
    """Run ``change`` with a KeyboardInterrupt raised once, as ``line`` of ``code`` is about to run."""
    fired = False

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal fired
        if event == "line" and frame.f_lineno == line and not fired:
            fired = True
            raise KeyboardInterrupt
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        change()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return fired


@pytest.mark.parametrize("what", list(CHANGES))
def test_an_interrupt_at_any_line_of_a_change_leaves_the_figures_adding_up(what: str) -> None:
    method, change = CHANGES[what]
    code = method.__code__
    hit = []
    for line in _lines(method):
        ledger = _ledger()
        assert _consistent(ledger)
        if _interrupted_at(code, line, lambda: change(ledger)):  # noqa: B023  # run now, inside this iteration
            hit.append(line)
            assert _consistent(ledger), f"{what}: interrupted before line {line} of {method.__qualname__}"
    assert len(hit) >= 3, f"{what}: the interrupt fired at too few lines ({hit}): the test is not testing"
