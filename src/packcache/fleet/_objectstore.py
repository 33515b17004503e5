"""The object store (S3, GCS, Azure, HTTP) through obstore: see :class:`ObjectStore` (private: import from
``stores``)."""

from __future__ import annotations

import contextlib
import errno as errno_mod
import functools
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from packcache import _faults as faults
from packcache.errors import RemoteError

from .. import _defaults
from ._storebase import (
    CHUNK_BYTES,
    ObjectInfo,
    Store,
    StoreURL,
    T,
    check_key,
    check_range,
    parse_store_url,
    read_all,
    remaining,
)

__all__ = ["ObjectStore"]

_FLEET_EXTRA = "pip install 'packcache[fleet]'"


def _import_obstore() -> Any:
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"object store URLs (s3://, gs://, az://, http(s)://) need obstore, from the fleet extra: {_FLEET_EXTRA}",
            name="obstore",
        ) from exc
    return obstore


# obstore's runtime threads do not survive fork: in a child forked after its parent used obstore every
# request hangs (test_a_child_forked_after_obstore_was_used_gets_an_error_not_a_hang). Such a child
# gets a clear error at once instead of a timeout on every call.
_obstore_used = False
_inherited_obstore = False


def _after_fork_in_child() -> None:
    global _inherited_obstore
    _inherited_obstore = _inherited_obstore or _obstore_used


os.register_at_fork(after_in_child=_after_fork_in_child)

# obstore's exception types say what failed (a missing object, a lost condition, a refused credential) but
# carry nothing else: the HTTP status, the operating system's errno, a timeout's kind and the protocol's own
# error code exist only in the text (with a Debug print of the request). Each rule below reads the one fact
# no type gives, and only for the types the table in _error sends to it.
#: An HTTP status in obstore's text ("status: 403", "status code: 416"): shown in messages; 416 on a range read.
_STATUS = re.compile(r"status(?: code)?: (\d{3})")
#: The error a 404 carries when the bucket or container itself does not exist: the S3 (and GCS XML) and Azure
#: error codes, and GCS's JSON message. obstore raises one FileNotFoundError for a missing key and a missing
#: bucket alike: the protocol's own error code in the body is what tells them apart.
_MISSING_ROOT = re.compile(
    r"<Code>(NoSuchBucket|ContainerNotFound)</Code>|The specified (bucket|container) does not exist", re.IGNORECASE
)
#: Whether the 404 had a body at all (a HEAD's has none: then a GET asks, see _root_missing).
_ERROR_BODY = re.compile(r"<Code>|\"error\"\s*:")
#: The errno of a failed connection or read (a GenericError's Debug text: "Os { code: 111, ... }").
_OS_CODE = re.compile(r"Os \{\s*code: (\d+)")
#: obstore's stall or overall bound fired (a GenericError's Debug text: reqwest's "kind: Timeout", "TimedOut").
_TIMED_OUT = re.compile(r"kind: Timeout|TimedOut")
#: The chunks a range read hands over (memory in flight per stream). obstore joins the network's pieces up to
#: this size by copying them: at 2 MiB a 400 MB download cost the client 0.95 CPU s, at 256 KiB 0.72 (64 KiB
#: no less), the hash included (measured over loopback).
_RANGE_CHUNK_BYTES = 256 << 10
#: obstore's own check of a ranged answer against the range asked for (object_store's "Requested a..b, got c..d",
#: a GenericError like any other).
_WRONG_RANGE = re.compile(r"Requested \d+\.\.\d+, got \d+\.\.\d+")
_SINGLE_PUT_MAX = 1 << 30  # a create-only PUT holds the whole file in memory (obstore sends it in one request)
_S3_ENDPOINTS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_AZURE_ENDPOINTS = ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")
#: The variables naming each scheme's endpoint: plain http is allowed exactly when that endpoint is http://.
_ENDPOINT_ENV = {
    "s3": _S3_ENDPOINTS,
    "s3a": _S3_ENDPOINTS,
    "gs": ("GOOGLE_BASE_URL",),
    **{scheme: _AZURE_ENDPOINTS for scheme in ("az", "adl", "azure", "abfs", "abfss")},
}


class ObjectStore(Store):
    """A store in an object store (S3, GCS, Azure, HTTP) through ``obstore`` (the ``fleet`` extra).

    Credentials and endpoints come from each store's standard environment (S3: ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``; plain
    ``http://`` is allowed when the endpoint is an ``http://`` URL). Create-only puts send
    ``If-None-Match: *`` and compare-and-swap sends ``If-Match: <etag>``: the server must honour them
    (AWS S3, moto and SeaweedFS do; see docs/FLEET.md).

    Each call builds its own client whose overall timeout is the time left to the call's deadline, so
    obstore itself cuts a silent or stalled server at the deadline and no request outlives its call.
    (obstore's async API would allow cancelling instead, but its runtime can abort the interpreter at
    exit after an async call: the synchronous API does not.) Requests are retried at most twice
    (5xx, dropped connections) within the deadline.
    """

    def __init__(self, url: str | StoreURL, *, timeout: float = _defaults.REMOTE_TIMEOUT) -> None:
        """``timeout`` (seconds) bounds connecting and a stalled read; each call's deadline bounds the whole call.

        Raises:
            ValueError: not an object store's URL (:func:`packcache._storeurl.parse_store_url`).
            ModuleNotFoundError: obstore is not installed.
            RemoteError: obstore cannot make a store of ``url`` (``remote_error``).
        """
        location = parse_store_url(url)
        if location.root is not None:
            raise ValueError(f"store URL {location.display!r}: a directory, not an object store")
        self._obstore = _import_obstore()
        # What obstore raises for a store's answer: its own tree, the builtin FileNotFoundError for a missing
        # object and TimeoutError (OSError), ValueError for a configuration it refuses, NotImplementedError (a
        # RuntimeError) for what a store cannot do (a conditional PUT over plain HTTP). A TypeError or a
        # MemoryError is no store's answer: it is not dressed as one.
        self._errors: tuple[type[BaseException], ...] = (
            self._obstore.exceptions.BaseError,
            OSError,
            ValueError,
            RuntimeError,
        )
        self.location = location
        self.url = location.display
        self._raw_url = location.raw  # only obstore gets it: secrets stay out of every message
        self._stall = max(float(timeout), 0.001)
        scheme = location.scheme
        self._allow_http = (
            scheme == "http"
            or any(os.environ.get(name, "").lower().startswith("http://") for name in _ENDPOINT_ENV.get(scheme, ()))
            or (scheme in _ENDPOINT_ENV["az"] and os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() == "true")
        )
        self._closed = False
        # A bad URL or configuration fails here. Building a client makes no request, and only a request
        # starts obstore's runtime (what fork breaks), so a pre-fork master may open stores.
        self._client(time.monotonic() + self._stall, "configure", "", request=False)

    def _client(self, deadline: float, doing: str, key: str, *, request: bool = True) -> Any:
        """An obstore store whose requests end by ``deadline`` (connect and stall bounded by ``timeout`` too)."""
        global _obstore_used
        if self._closed:
            raise RemoteError("remote_error", f"{doing} {key!r}: the store is closed", url=self.url)
        if _inherited_obstore:
            raise RemoteError(
                "remote_error",
                f"{doing} {key!r}: obstore was used before this process was forked and its runtime does not "
                "survive fork; use object stores only in processes that did not inherit them",
                url=self.url,
            )
        left = remaining(deadline)
        if left <= 0:
            raise RemoteError("remote_timeout", f"{doing} {key!r}: the deadline passed", url=self.url)
        whole = timedelta(seconds=left)
        stall = timedelta(seconds=min(left, self._stall))
        client_options = {
            "allow_http": self._allow_http,
            "connect_timeout": stall,
            "read_timeout": stall,
            "timeout": whole,
        }
        retry_config = {
            "max_retries": 2,
            "retry_timeout": whole,
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=1), "base": 2},
        }
        with self._translating(key, doing, deadline):
            client = self._obstore.store.from_url(
                self._raw_url, client_options=client_options, retry_config=retry_config
            )
        _obstore_used = _obstore_used or request
        return client

    def _translating(
        self, key: str, doing: str, deadline: float, *, past_end: Callable[[], BaseException] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Every obstore error of the body raised as its :class:`RemoteError` (:meth:`_error`), ``from None``:
        obstore's text holds the raw URL. What else the body raises (a sink's error, a bug) passes as it is."""
        make = functools.partial(self._error, key=key, doing=doing, deadline=deadline, past_end=past_end)
        return faults.translating_into(make, types=self._errors)

    def _error(
        self, exc: BaseException, key: str, doing: str, deadline: float,
        past_end: Callable[[], BaseException] | None = None,
    ) -> BaseException:  # fmt: skip
        """The one translation of an obstore error into a :class:`RemoteError`, by its type:

        - ``FileNotFoundError`` (obstore's missing object; its deprecated ``NotFoundError`` too), and a
          ``PreconditionError`` with HTTP 404 (moto: a conditional PUT into a missing bucket): ``remote_absent``,
          or ``remote_error`` when the bucket or container itself is missing (the protocol's error code);
        - ``AlreadyExistsError``, ``PreconditionError``: ``remote_conflict`` (a create-only or ``If-Match`` PUT lost);
        - ``TimeoutError``, and a ``GenericError`` with no HTTP status when obstore's bound fired or the deadline
          passed (its text says which): ``remote_timeout``;
        - ``GenericError`` with HTTP 416 on a range read: ``past_end()`` (the range starts at or past the end);
        - anything else obstore raises (``PermissionDeniedError``, ``UnauthenticatedError``, ``NotModifiedError``,
          any other ``BaseError``, ``ValueError`` for a configuration refused, ``NotImplementedError`` for a
          conditional PUT over plain HTTP, another ``OSError``): ``remote_error``, with the HTTP status and the
          errno where the text has them.
        """
        # obstore's text may spell the URL its own way (a Debug print): every secret of ours is scrubbed.
        # pinned by tests/test_fleet_redaction.py::test_no_library_output_shows_a_store_secret
        text = self.location.scrub(str(exc))
        first = text.split("\n", 1)[0].strip()[:400]
        exceptions = self._obstore.exceptions
        status_match = _STATUS.search(text)
        http = int(status_match.group(1)) if status_match else None
        status = f" (HTTP {http})" if http else ""
        where = f"{doing} {key!r}" if key else doing
        # FileNotFoundError is what obstore raises for a missing object (its NotFoundError is deprecated for it).
        not_found = isinstance(exc, FileNotFoundError | exceptions.NotFoundError) or (
            isinstance(exc, exceptions.PreconditionError) and http == 404
        )  # a conditional PUT into a missing bucket is a "precondition" 404 (moto)
        # pinned by tests/test_fleet_stores.py::test_a_missing_bucket_or_store_directory_is_a_remote_error_on_every_call
        if not_found and self._root_missing(text, key, deadline):
            return RemoteError(
                "remote_error", f"{where} (HTTP 404): the bucket or container of {self.url} does not exist (a typo, "
                "another account, region or endpoint): a configuration problem, not \"nothing published\"",
                url=self.url,
            )  # fmt: skip
        if not_found and not isinstance(exc, exceptions.PreconditionError):
            return RemoteError("remote_absent", f"no object at {key!r}", url=self.url)
        if isinstance(exc, exceptions.AlreadyExistsError):
            return RemoteError("remote_conflict", f"{where}: an object already exists{status}", url=self.url)
        if isinstance(exc, exceptions.PreconditionError):
            return RemoteError(
                "remote_conflict", f"{where}: the object changed (its ETag no longer matches)", url=self.url
            )
        code_match = _OS_CODE.search(text)
        code = int(code_match.group(1)) if code_match else 0
        # Past the deadline an error that names no cause is taken for obstore's bound firing; one that names its
        # errno (a refused connection, a reset) is that error, however late it came: a timeout never hides it.
        # pinned by tests/test_fleet_stores.py::test_obstore_errors_are_mapped_by_their_type
        timed_out = _TIMED_OUT.search(text) is not None or (code == 0 and time.monotonic() >= deadline - 0.05)
        if isinstance(exc, TimeoutError) or (isinstance(exc, exceptions.GenericError) and http is None and timed_out):
            return RemoteError("remote_timeout", f"{where}: no answer before the deadline ({first})", url=self.url)
        if http == 416 and past_end is not None:
            return past_end()
        os_error = f" ({faults.errno_name(code, str(code))}: {os.strerror(code)})" if code else ""
        return RemoteError(
            "remote_error", f"{where}{status}{os_error}: {type(exc).__name__}: {first}", url=self.url, errno=code
        )

    def _root_missing(self, text: str, key: str, deadline: float) -> bool:
        """Whether a 404 (``text``, obstore's message) says the bucket or container is missing, not the key.
        A HEAD's 404 has no body to say which: then a GET of the same key asks (a missing key costs one more
        request; a bucket that does not exist is never taken for an empty one)."""
        if _MISSING_ROOT.search(text):
            return True
        if _ERROR_BODY.search(text) or not key:
            return False
        try:
            client = self._client(deadline, "get", key)
            self._obstore.get(client, key)  # the object appeared meanwhile: neither is missing
        except RemoteError:
            return False
        except self._errors as exc:
            return bool(_MISSING_ROOT.search(str(exc)))
        return False

    def _call(self, key: str, doing: str, deadline: float, call: Callable[[Any], T]) -> T:
        client = self._client(deadline, doing, key)
        with self._translating(key, doing, deadline):
            return call(client)

    # -- reads

    def head(self, key: str, *, deadline: float) -> ObjectInfo:
        """See :meth:`Store.head`."""
        check_key(key)
        meta = self._call(key, "head", deadline, lambda client: self._obstore.head(client, key))
        return ObjectInfo(int(meta["size"]), meta.get("e_tag"))

    def get(self, key: str, *, deadline: float, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """See :meth:`Store.get`: streamed and counted, so a body longer than announced is caught."""
        parts: list[bytes] = []
        info = self.download(key, lambda chunk: parts.append(bytes(chunk)), deadline=deadline, max_bytes=max_bytes)
        return b"".join(parts), info

    def get_range(self, key: str, start: int, end: int, *, deadline: float) -> bytes:
        """See :meth:`Store.get_range`."""
        check_key(key)
        check_range(start, end)
        if start == end:
            self.head(key, deadline=deadline)  # an absent key is absent, whatever the range
            return b""
        client = self._client(deadline, "get_range", key)
        try:
            with self._translating(key, "get_range", deadline, past_end=_PastEnd):
                data = bytes(self._obstore.get_range(client, key, start=start, end=end))
        except _PastEnd:
            return b""  # the range starts at or past the object's end
        if len(data) > end - start:
            raise RemoteError(
                "remote_error", f"get_range {key!r}: {len(data)} bytes for a range of {end - start}", url=self.url
            )
        return data

    def download(self, key: str, sink: Callable[[memoryview], None], *, deadline: float, max_bytes: int) -> ObjectInfo:
        """See :meth:`Store.download`."""
        check_key(key)
        client = self._client(deadline, "download", key)
        with self._translating(key, "download", deadline):
            result = self._obstore.get(client, key)
            meta = result.meta
            stream = iter(result.stream(min_chunk_size=CHUNK_BYTES // 2))
        size, etag = int(meta["size"]), meta.get("e_tag")
        if size > max_bytes:
            raise RemoteError("remote_corrupt", f"{key!r} holds {size} bytes (at most {max_bytes})", url=self.url)
        received = 0
        for view in self._chunks(stream, key, "download", deadline):
            received += len(view)
            if received > size:
                raise RemoteError("remote_corrupt", f"{key!r}: more than the {size} bytes announced", url=self.url)
            for at in range(0, len(view), CHUNK_BYTES):
                sink(view[at : at + CHUNK_BYTES])  # what the sink raises is the caller's: it propagates as is
        if received != size:
            raise RemoteError("remote_error", f"download {key!r}: ended after {received} of {size} bytes", url=self.url)
        return ObjectInfo(size, etag)

    def _chunks(self, stream: Iterator[Any], key: str, doing: str, deadline: float) -> Iterator[memoryview]:
        """The chunks of an obstore body stream, each error it raises translated (:meth:`_error`); only the
        stream is inside the translation, so what the caller's sink raises between chunks propagates as is."""
        while True:
            with self._translating(key, doing, deadline):
                chunk = next(stream, None)
            if chunk is None:
                return
            yield memoryview(chunk)

    def download_range(
        self, key: str, start: int, end: int, sink: Callable[[int, memoryview], None], *, deadline: float
    ) -> int:
        """See :meth:`Store.download_range`: one ranged GET, streamed (a chunk at a time in memory)."""
        check_key(key)
        check_range(start, end)
        if start == end:
            return self.head(key, deadline=deadline).size
        client = self._client(deadline, "download_range", key)
        try:
            with self._translating(key, "download_range", deadline, past_end=_PastEnd):
                result = self._obstore.get(client, key, options={"range": (start, end)})
                size, got = int(result.meta["size"]), tuple(result.range)
                stream = iter(result.stream(min_chunk_size=_RANGE_CHUNK_BYTES))
        except _PastEnd:  # the range starts at or past the object's end
            raise RemoteError("remote_corrupt", f"{key!r} ends before byte {start}", url=self.url) from None
        except RemoteError as error:
            if error.reason == "remote_error" and _WRONG_RANGE.search(str(error)):  # another range: a store that lies
                raise RemoteError("remote_corrupt", str(error).split(": ", 1)[-1], url=self.url) from None
            raise
        # pinned by tests/test_fleet_download.py::test_a_store_that_sends_a_short_or_wrong_range_is_remote_corrupt
        if size < end or got != (start, end):
            raise RemoteError(
                "remote_corrupt", f"{key!r} ({size} bytes) answered bytes [{got[0]}, {got[1]}) for [{start}, {end})",
                url=self.url,
            )  # fmt: skip
        offset = start
        for view in self._chunks(stream, key, "download_range", deadline):
            if offset + len(view) > end:
                raise RemoteError(
                    "remote_corrupt", f"{key!r}: more bytes than the range [{start}, {end})", url=self.url
                )
            for at in range(0, len(view), CHUNK_BYTES):
                sink(offset + at, view[at : at + CHUNK_BYTES])  # what the sink raises propagates as is
            offset += len(view)
        if offset != end:
            raise RemoteError(
                "remote_error", f"download_range {key!r}: ended after {offset - start} of {end - start} bytes",
                url=self.url,
            )  # fmt: skip
        return size

    # -- writes

    def put_file(
        self, key: str, path: str, *, deadline: float, progress: Callable[[int], object] | None = None
    ) -> bool:
        """See :meth:`Store.put_file`. Up to 1 GiB: one create-only PUT (the file is held in memory while it
        is sent). Larger: a multipart upload after a HEAD finds no object; two publishers racing on the
        same key may then both write (blob keys are content hashes: the same bytes)."""
        check_key(key)
        fd, size = _open_source(path)
        try:
            try:
                self.head(key, deadline=deadline)
                return False
            except RemoteError as exc:
                if exc.reason != "remote_absent":
                    raise
            try:
                self._upload(key, fd, size, path, "put_file", deadline, "create")
            except RemoteError as exc:
                if exc.reason == "remote_conflict":
                    return False
                raise
            if progress is not None:  # obstore reports no bytes while it sends: the whole file, once sent
                progress(size)
            return True
        finally:
            os.close(fd)

    def replace_file(self, key: str, path: str, *, deadline: float, if_match: str | None) -> None:
        """See :meth:`Store.replace_file`. Up to 1 GiB: one PUT with ``If-Match`` (or none when ``if_match`` is
        None). Larger: a multipart upload, which carries no condition (obstore sends conditional headers only
        on single PUTs): the object is replaced whatever it holds then."""
        check_key(key)
        fd, size = _open_source(path)
        try:
            mode = "overwrite" if if_match is None else {"e_tag": if_match}
            self._upload(key, fd, size, path, "replace_file", deadline, mode)
        finally:
            os.close(fd)

    def _upload(self, key: str, fd: int, size: int, path: str, what: str, deadline: float, mode: Any) -> None:
        """PUT the ``size`` bytes of the file open at ``fd`` to ``key``: up to 1 GiB in one PUT under ``mode``
        (held in memory while it is sent), larger as a multipart upload (no condition: obstore sends none on those)."""
        obs = self._obstore
        if size <= _SINGLE_PUT_MAX:
            data = read_all(fd, size)
            if len(data) != size:
                raise OSError(errno_mod.EIO, f"{path} changed while it was read")
            self._call(key, what, deadline, lambda c: obs.put(c, key, data, mode=mode, use_multipart=False))
            return
        with open(os.dup(fd), "rb", closefd=True) as source:
            self._call(key, what, deadline, lambda c: obs.put(c, key, source, use_multipart=True, max_concurrency=4))

    def put_bytes(self, key: str, data: bytes, *, deadline: float, if_match: str | None) -> str:
        """See :meth:`Store.put_bytes`."""
        check_key(key)
        payload = bytes(data)
        mode: Any = "create" if if_match is None else {"e_tag": if_match}
        try:
            result = self._call(
                key, "put_bytes", deadline, lambda c: self._obstore.put(c, key, payload, mode=mode, use_multipart=False)
            )
        except RemoteError as exc:
            if if_match is not None and exc.reason == "remote_absent":  # deleted since: it no longer matches
                raise RemoteError("remote_conflict", f"put_bytes {key!r}: the object is gone", url=self.url) from exc
            raise
        return str(result.get("e_tag") or "")

    def close(self) -> None:
        """See :meth:`Store.close`: every call has its own client, so nothing stays open."""
        self._closed = True


class _PastEnd(Exception):
    """A range read's HTTP 416 (the range starts at or past the object's end): an answer, not a store error;
    each range read says what it means (:meth:`ObjectStore.get_range`: no bytes)."""


def _open_source(path: str) -> tuple[int, int]:
    """The local file an upload sends, opened (never blocking on a FIFO): (descriptor, size).

    Raises:
        OSError: it cannot be opened, or is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno_mod.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size
