"""The exceptions packcache raises.

Every exception the library raises on purpose derives from
:class:`PackCacheError`, and also from the builtin it refines, so callers may
catch either::

    PackCacheError
    ├── FormatError(ValueError)           a cache file breaks docs/FORMAT.md
    ├── LockTimeoutError(TimeoutError)    another process held the build lock too long
    ├── NonFiniteWeightError(ValueError)  a source weight holds NaN or ±Inf (or would become one)
    ├── OptionError(KeyError)             an unknown option key
    │   └── ReadOnlyOptionError           writing a key that can only be read
    ├── OptionValueError(ValueError)      an option value out of range
    │   └── OptionTypeError(TypeError)    an option value of the wrong type
    ├── PackResultError(TypeError)        ``pack()`` returned something uncacheable
    ├── RemoteError(OSError)              a store, manifest or published file could not be used
    ├── SessionError(RuntimeError)        a session used wrongly (nested, closed)
    └── UntrustedFileError(PermissionError)  a file fails the trust check (owner, mode, kind)

A cache *problem* (full disk, read-only file, lock timeout, …) is never raised:
it is counted and reported through :meth:`packcache.WeightCache.stats`. Inside
the package such a problem travels as a ``Fault`` (``packcache._faults``) from
the file layer to the session, which is the one place it ends: counted under its
reason, logged once, answered with a heap pack. It never leaves the package.
"""

from __future__ import annotations

from typing import Any

from ._storeurl import redact_text

__all__ = [
    "FormatError",
    "LockTimeoutError",
    "NonFiniteWeightError",
    "OptionError",
    "OptionTypeError",
    "OptionValueError",
    "PackCacheError",
    "PackResultError",
    "ReadOnlyOptionError",
    "RemoteError",
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


class NonFiniteWeightError(PackCacheError, ValueError):
    """A source tensor holds NaN, +Inf or -Inf, or a finite value the scheme would turn into one
    (float64 beyond float32's range, a float32 that bfloat16 rounds to Inf, an int4 group whose
    range overflows float32), or a packer made a non-finite pack of it. Every packer refuses to
    pack it, with every scheme: no quantized scheme can compute what the float model does with
    such a weight, so none is allowed to pretend it does (``docs/TORCH.md``).

    A broken checkpoint, not a cache problem: it fails the load. The message names the tensor
    (when known: :meth:`packcache.packers.Packer.checked_pack` adds it), the first position and
    how many values are non-finite.

    Attributes:
        tensor: the source tensor's name, or ``None`` when the packer was called directly.
        index: the position of the first offending value (for an int4 group: ``(row, group)``).
    """

    def __init__(self, problem: str, *, tensor: str | None = None, index: tuple[int, ...] | None = None) -> None:
        self.problem = problem
        self.tensor = tensor
        self.index = index
        where = f"tensor {tensor!r}" if tensor is not None else "the source tensor"
        super().__init__(
            f"{where} {problem}; packcache packs no NaN or infinite weight, with any scheme: "
            "fix the checkpoint (this is not a cache problem)"
        )

    def naming(self, tensor: str) -> NonFiniteWeightError:
        """The same error, naming ``tensor`` (the packer that raised it did not know the name)."""
        return NonFiniteWeightError(self.problem, tensor=tensor, index=self.index)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild from them, not from the formatted message (pickling, workers).
        return (_rebuild_non_finite, (self.problem, self.tensor, self.index))


def _rebuild_non_finite(problem: str, tensor: str | None, index: tuple[int, ...] | None) -> NonFiniteWeightError:
    return NonFiniteWeightError(problem, tensor=tensor, index=index)


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


class RemoteError(PackCacheError, OSError):
    """A fleet store, a manifest or a published cache file could not be used (docs/FLEET.md).

    ``reason`` is one of :data:`packcache.stats.REMOTE_REASONS` (``remote_absent``,
    ``remote_error``, ``remote_timeout``, ...). A model load never raises it: a cache with
    ``remote=`` counts it as a remote miss and packs locally. ``publish``, ``fetch`` and
    ``probe`` (the command line and the library calls behind them) raise it.

    Attributes:
        reason: the remote miss reason.
        url: the store URL or key the problem is about, when known.
        errno: the OS error number (``0`` when there is none, e.g. an HTTP status).
    """

    def __init__(self, reason: str, message: str, *, url: str | None = None, errno: int = 0) -> None:
        self.reason = reason
        # Every URL in what it is given is shown redacted: no place that raises one can leak a secret.
        # pinned by tests/test_fleet_redaction.py::test_no_library_output_shows_a_store_secret
        url = redact_text(str(url)) if url is not None else None
        self.url = url
        super().__init__(f"{reason}: {url + ': ' if url else ''}{redact_text(message)}")
        # After super().__init__: OSError's constructor sets errno from its arguments (to None here).
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_remote, (self.reason, str(self.args[0]), self.url, self.errno))


def _rebuild_remote(reason: str, text: str, url: str | None, errno: int) -> RemoteError:
    error = RemoteError(reason, "", url=url, errno=errno)
    error.args = (text,)
    return error


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
