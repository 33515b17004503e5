"""The exceptions packcache raises.

Every exception the library raises on purpose derives from
:class:`PackCacheError`, and also from the builtin it refines, so callers may
catch either::

    PackCacheError
    ├── FormatError(ValueError)           a cache file breaks docs/FORMAT.md
    ├── LockTimeoutError(TimeoutError)    another process held the build lock too long
    ├── OptionError(KeyError)             an unknown option key
    │   └── ReadOnlyOptionError           writing a key that can only be read
    ├── OptionValueError(ValueError)      an option value out of range
    │   └── OptionTypeError(TypeError)    an option value of the wrong type
    ├── PackResultError(TypeError)        ``pack()`` returned something uncacheable
    ├── SessionError(RuntimeError)        a session used wrongly (nested, closed)
    └── UntrustedFileError(PermissionError)  a file fails the trust check (owner, mode, kind)

A cache *problem* (full disk, read-only file, lock timeout, …) is never raised:
it is counted and reported through :meth:`packcache.WeightCache.stats`. Inside
the package such a problem travels as a ``Fault`` (``packcache._store``) from
the file layer to the session, which is the one place it ends: counted under its
reason, logged once, answered with a heap pack. It never leaves the package.
"""

from __future__ import annotations

__all__ = [
    "FormatError",
    "LockTimeoutError",
    "OptionError",
    "OptionTypeError",
    "OptionValueError",
    "PackCacheError",
    "PackResultError",
    "ReadOnlyOptionError",
    "SessionError",
    "UntrustedFileError",
]


class PackCacheError(Exception):
    """Root of every exception packcache raises on purpose."""


class FormatError(PackCacheError, ValueError):
    """A cache file violates the format in ``docs/FORMAT.md``.

    The message names the file (when known), the byte offset and the rule.
    The cache never serves bytes from such a file: it rebuilds it as a new
    file instead.
    """

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None) -> None:
        self.path = path
        self.offset = offset
        where = []
        if path is not None:
            where.append(path)
        if offset is not None:
            where.append(f"offset {offset}")
        prefix = f"{': '.join(where)}: " if where else ""
        super().__init__(prefix + message)


class LockTimeoutError(PackCacheError, TimeoutError):
    """Another process held a cache file's build lock longer than the timeout.

    Raised by the maintenance entry points (``compact``); a model load never raises
    it: its packs go to heap with reason ``locked``.
    """


class OptionError(PackCacheError, KeyError):
    """An option key that does not exist; the message names close matches."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument; show the sentence as written.
        return str(self.args[0]) if self.args else ""


class ReadOnlyOptionError(OptionError):
    """An attempt to write an option key that can only be read."""


class OptionValueError(PackCacheError, ValueError):
    """An option value outside the allowed range."""


class OptionTypeError(OptionValueError, TypeError):
    """An option value of the wrong type."""


class PackResultError(PackCacheError, TypeError):
    """``pack()`` returned something that is not a cacheable numpy array."""


class SessionError(PackCacheError, RuntimeError):
    """A session was used wrongly: nested in one thread, or used after it ended."""


class UntrustedFileError(PackCacheError, PermissionError):
    """A cache, lock or temp file that packcache refuses to use: not a regular file, owned by
    another user than the effective one or root, group/world-writable, or reached through a
    symlink in an unsafe directory (docs/RELIABILITY.md "Trust").

    :class:`~packcache.WeightCache` never raises it (the file is reported ``untrusted``
    and packs go to heap); the maintenance entry points (``verify``, ``compact``, the CLI) do.
    """

    def __init__(self, path: str, reason: str, *, what: str = "cache file") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"untrusted {what} {path}: {reason}")

    def __str__(self) -> str:
        return str(self.args[0])
