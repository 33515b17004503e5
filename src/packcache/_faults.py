"""Faults: a cache problem on its way to the session, and the one point where an ``OSError`` becomes one.

The file layer (:mod:`packcache._store` and its roles) does the I/O. Whatever goes wrong there leaves it
as a :class:`Fault`, carrying the heap reason it causes, the errno and a message; the session ends it
(counted, logged once, answered with a heap pack). Translating is done here, in one context manager, in
the manner of httpx's ``map_httpcore_exceptions``::

    with translating(HeapReason.OPEN_FAILED, "cannot open", path):
        fd, st = open_checked(path)

turns an ``OSError`` raised in the body into ``Fault(reason, errno, "cannot open <path>: ENOENT (...)")``,
an :class:`~packcache.errors.UntrustedFileError` into an ``untrusted`` fault and a
:class:`~packcache.errors.LockTimeoutError` into a ``locked`` one, each raised ``from None`` (the fault is
the whole story). The reason may be a function of the errno instead (:func:`write_reason`: ``no_space``
for ENOSPC, ``write_failed`` otherwise). The fleet code translates ``OSError`` into its own
:class:`~packcache.errors.RemoteError` reasons with the same context manager
(:func:`translating_into`), and an object store client's own exception tree the same way (its ``types``), so
every translation in the package has this one shape.

Its counterpart, :func:`ending`, is where the session ends one: ``with ending(...) as end:`` around a
call into the store keeps the :class:`Fault` the body raised (or makes one of any other exception,
logged at DEBUG) in ``end.fault``, for the caller to route; nothing but an interrupt leaves it.

Imports only :mod:`packcache.errors` and :mod:`packcache.stats` (layer 0): the ledger, the store and
the fleet all take faults from here.
"""

from __future__ import annotations

import errno as errno_mod
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .errors import LockTimeoutError, UntrustedFileError
from .stats import HeapReason

__all__ = [
    "NO_SPACE_ERRNOS",
    "READ_ONLY_ERRNOS",
    "Fault",
    "describe",
    "ending",
    "errno_name",
    "fault_from_os",
    "open_failed_reason",
    "translating",
    "translating_into",
    "write_reason",
]

#: The errnos that mean "no room": no space, no quota, a file over its size limit (RLIMIT_FSIZE).
NO_SPACE_ERRNOS = frozenset({errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG})
#: The errnos that mean "you may only read": opening for writing is refused, reading is not.
READ_ONLY_ERRNOS = frozenset({errno_mod.EACCES, errno_mod.EROFS, errno_mod.EPERM, errno_mod.ETXTBSY})

logger = logging.getLogger("packcache")

#: What an ``OSError`` becomes: one heap reason, or a function of its errno.
Reason = HeapReason | Callable[[int | None], HeapReason]


class Fault(Exception):
    """A cache problem on its way to the session: the heap reason it causes, the errno and a
    message. Made by the file layer, ended by :class:`packcache.Session` (counted, logged once,
    answered with a heap pack); never raised out of the package (see :mod:`packcache.errors`).

    >>> fault = Fault(HeapReason.NO_SPACE, errno_mod.ENOSPC, "cannot write to m.pcache: ENOSPC (No space left)")
    >>> fault.reason.value, str(fault) == fault.message
    ('no_space', True)
    """

    def __init__(self, reason: HeapReason, err: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.errno = err
        self.message = message


def write_reason(err: int | None) -> HeapReason:
    """``no_space`` for ENOSPC/EDQUOT/EFBIG, ``write_failed`` for anything else.

    >>> write_reason(errno_mod.EDQUOT).value, write_reason(errno_mod.EIO).value
    ('no_space', 'write_failed')
    """
    return HeapReason.NO_SPACE if err in NO_SPACE_ERRNOS else HeapReason.WRITE_FAILED


def open_failed_reason(err: int | None) -> HeapReason:
    """``read_only`` when the errno says "you may only read", else ``open_failed``.

    >>> open_failed_reason(errno_mod.EROFS).value, open_failed_reason(errno_mod.ENOENT).value
    ('read_only', 'open_failed')
    """
    return HeapReason.READ_ONLY if err in READ_ONLY_ERRNOS else HeapReason.OPEN_FAILED


def errno_name(err: int | None, unknown: str = "E?") -> str:
    """The symbolic name of ``err`` (``"ENOSPC"``), or ``unknown`` for 0, None or a number without one.

    >>> errno_name(errno_mod.ENOSPC), errno_name(0), errno_name(None, "no errno")
    ('ENOSPC', 'E?', 'no errno')
    """
    return errno_mod.errorcode.get(err or 0, unknown)


def describe(exc: OSError, what: str, path: str) -> str:
    """``"<what> <path>: <ERRNO> (<strerror>)"``: how every fault made of an ``OSError`` reads.

    >>> describe(FileNotFoundError(errno_mod.ENOENT, "No such file or directory"), "cannot open", "m.pcache")
    'cannot open m.pcache: ENOENT (No such file or directory)'
    """
    return f"{what} {path}: {errno_name(exc.errno)} ({exc.strerror or exc})"


def fault_from_os(exc: OSError, reason: Reason, what: str, path: str) -> Fault:
    """The fault an ``OSError`` is: ``reason`` (or ``reason(errno)``), its errno (0 if none) and
    :func:`describe`'s message.

    An :class:`UntrustedFileError` is ``untrusted`` and a :class:`LockTimeoutError` ``locked``, whatever
    ``reason`` says: the file or its lock, not the operation, is what failed.
    """
    if isinstance(exc, UntrustedFileError):
        return Fault(HeapReason.UNTRUSTED, 0, str(exc))
    if isinstance(exc, LockTimeoutError):
        return Fault(HeapReason.LOCKED, errno_mod.EWOULDBLOCK, str(exc))
    heap_reason = reason if isinstance(reason, HeapReason) else reason(exc.errno)
    return Fault(heap_reason, exc.errno or 0, describe(exc, what, path))


class _Translating:
    """The context manager behind :func:`translating` and :func:`translating_into`: an ``OSError`` that
    leaves the body is raised as what ``make`` turns it into (``None``: it leaves unchanged). Anything
    else passes through untouched. A class, not a generator: entering it costs two attribute stores."""

    __slots__ = ("_cause", "_make")

    def __init__(self, make: Callable[[Any], BaseException | None], cause: bool) -> None:
        self._make = make
        self._cause = cause

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, OSError):
            translated = self._make(exc)
            if translated is not None:
                raise translated from (exc if self._cause else None)


class _TranslatingTypes(_Translating):
    """:class:`_Translating` for the exception types given instead of ``OSError`` alone (a store client's own
    tree): a subclass, so the file layer's :func:`translating` keeps its two attribute stores."""

    __slots__ = ("_types",)

    def __init__(
        self, make: Callable[[Any], BaseException | None], cause: bool, types: tuple[type[BaseException], ...]
    ) -> None:
        super().__init__(make, cause)
        self._types = types

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, self._types):
            translated = self._make(exc)
            if translated is not None:
                raise translated from (exc if self._cause else None)


class _ToFault:
    """``make`` for :func:`translating`: the :class:`Fault` an ``OSError`` is (:func:`fault_from_os`)."""

    __slots__ = ("path", "reason", "what")

    def __init__(self, reason: Reason, what: str, path: str) -> None:
        self.reason = reason
        self.what = what
        self.path = path

    def __call__(self, exc: OSError) -> Fault:
        return fault_from_os(exc, self.reason, self.what, self.path)


def translating(reason: Reason, what: str, path: str) -> _Translating:
    """A context manager raising every ``OSError`` of its body as its :class:`Fault` (:func:`fault_from_os`),
    ``from None``: the one translation of the file layer.

    Enter it around a batch, never per pack: the warm path serves a thousand hits inside one.

    >>> try:
    ...     with translating(write_reason, "cannot write to", "m.pcache"):
    ...         raise OSError(errno_mod.ENOSPC, "No space left on device")
    ... except Fault as fault:
    ...     print(fault.reason.value, fault.errno == errno_mod.ENOSPC, fault.message)
    no_space True cannot write to m.pcache: ENOSPC (No space left on device)
    """
    return _Translating(_ToFault(reason, what, path), cause=False)


def translating_into(
    make: Callable[[Any], BaseException | None],
    *,
    cause: bool = False,
    types: tuple[type[BaseException], ...] = (OSError,),
) -> _Translating:
    """A context manager raising every ``OSError`` of its body as ``make(exc)`` (left as it is when
    ``make`` returns None): :func:`translating` for errors other than faults, e.g. the fleet's
    :class:`~packcache.errors.RemoteError` reasons. ``cause=True`` keeps the ``OSError`` as ``__cause__``.
    ``types``: the exceptions translated instead of ``OSError`` alone (an object store client's, whose
    types say what went wrong: :mod:`packcache.fleet._objectstore`); anything else passes through.

    >>> try:
    ...     with translating_into(lambda exc: ValueError(errno_name(exc.errno))):
    ...         raise OSError(errno_mod.EIO, "I/O error")
    ... except ValueError as exc:
    ...     print(exc)
    EIO
    >>> try:
    ...     with translating_into(lambda exc: ValueError(f"refused: {exc}"), types=(KeyError, OSError)):
    ...         raise KeyError("k")
    ... except ValueError as exc:
    ...     print(exc)
    refused: 'k'
    """
    if types == (OSError,):
        return _Translating(make, cause)
    return _TranslatingTypes(make, cause, types)


class Ending:
    """What :func:`ending` yields: after the body, ``fault`` is the :class:`Fault` it ended in (None: it
    finished), ``exc`` what it raised, and ``unexpected`` whether that was no ``Fault`` (a bug or a
    library's own exception, made a fault of ``reason``). Leaves no exception but an interrupt.

    ``reason`` None ends faults only: any other exception leaves the body unchanged (a caller whose
    unexpected errors are bugs to raise, not cache problems to count). ``expected``: exception types the
    caller maps itself (kept in ``exc``, ``fault`` None, not logged). ``scrub``: what the DEBUG line
    shows of the exception (text that may hold a secret), instead of its traceback.
    """

    __slots__ = ("exc", "expected", "fault", "reason", "scrub", "unexpected", "what")

    def __init__(
        self,
        reason: HeapReason | None,
        what: str,
        expected: tuple[type[BaseException], ...],
        scrub: Callable[[str], str] | None,
    ) -> None:
        self.reason = reason
        self.what = what
        self.expected = expected
        self.scrub = scrub
        self.fault: Fault | None = None
        self.exc: BaseException | None = None
        self.unexpected = False

    def __enter__(self) -> Ending:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            return False
        if isinstance(exc, Fault):
            self.exc, self.fault = exc, exc
            return True
        if not isinstance(exc, Exception):
            return False  # an interrupt: the caller's clean-up decides
        if isinstance(exc, self.expected):
            self.exc = exc
            return True
        if self.reason is None:
            return False
        # A cache problem must never fail a model load: whatever the store or a library raised is a fault.
        if self.scrub is not None:
            logger.debug("packcache: unexpected error: %s: %s", self.what, self.scrub(f"{type(exc).__name__}: {exc}"))
        else:
            logger.debug("packcache: unexpected error: %s", self.what, exc_info=(exc_type, exc, tb))  # type: ignore[arg-type]
        self.exc, self.unexpected = exc, True
        self.fault = Fault(self.reason, 0, f"{self.what}: {exc!r}")
        return True


def ending(
    reason: HeapReason | None = None,
    what: str = "",
    *,
    expected: tuple[type[BaseException], ...] = (),
    scrub: Callable[[str], str] | None = None,
) -> Ending:
    """A context manager ending the :class:`Fault` its body raises: kept in the :class:`Ending` it yields, for
    the caller to route (count, log once, serve from heap). With a ``reason``, any other ``Exception`` is
    logged at DEBUG and ends as ``Fault(reason, 0, "<what>: <repr>")``. The counterpart of
    :func:`translating`, which makes faults: this is the one place they stop.

    >>> with ending(HeapReason.WRITE_FAILED, "cannot store 'w' in m.pcache") as end:
    ...     raise RuntimeError("boom")
    >>> end.fault.reason.value, end.unexpected, end.fault.message
    ('write_failed', True, "cannot store 'w' in m.pcache: RuntimeError('boom')")
    >>> with ending() as end:
    ...     raise Fault(HeapReason.LOCKED, errno_mod.EWOULDBLOCK, "locked by pid 7")
    >>> end.fault.reason.value, end.unexpected
    ('locked', False)
    """
    return Ending(reason, what, expected, scrub)
