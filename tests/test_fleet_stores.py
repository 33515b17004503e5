"""The fleet store interface (packcache.fleet.stores): one contract, run against a directory and against
real S3-protocol servers on 127.0.0.1 (moto's standalone server; a ``weed mini`` smoke), then the faults
with real parts: a TCP server that accepts and never answers, one that stalls mid-body, a server killed
mid-download, refused connections, 403s, FIFOs and symlinks planted at keys, a full tmpfs, a read-only
mount, another user, a lock held by another process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from harness.mounts import read_only_bind, tmpfs
from harness.s3server import S3Server, free_port, moto_server, s3_env, weed_server
from packcache.errors import RemoteError
from packcache.fleet import _dirstore, _objectstore, stores
from packcache.fleet.stores import CHUNK_BYTES, DirectoryStore, ObjectStore, Store, check_key, open_store

GRACE = 1.0  # the interface's promise: no call returns later than deadline + 1 s
NOBODY = 65534


def soon(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


# =========================================================================== servers and stores


@pytest.fixture(params=["directory", "moto"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The same contract against each implementation; every test gets a fresh root or prefix."""
    if request.param == "directory":
        root = tmp_path / "store"
        root.mkdir()
        with open_store(str(root)) as s:
            assert isinstance(s, DirectoryStore)
            yield s
    else:
        server = request.getfixturevalue("moto_env")
        with open_store(f"{server.url}/{uuid.uuid4().hex}") as s:
            assert isinstance(s, ObjectStore)
            yield s


def reason_of(call: Callable[[], object]) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        call()
    return caught.value


def write_file(path: Path, size: int, seed: int = 0) -> bytes:
    data = hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1)
    data = data[:size]
    path.write_bytes(data)
    return data


def every_call(store: Store, key: str, upload: str | None) -> list[Callable[[], object]]:
    """Each method of ``store`` on ``key`` (reads only when ``upload``, a local file, is ``None``)."""
    calls: list[Callable[[], object]] = [
        lambda: store.head(key, deadline=soon(5)),
        lambda: store.get(key, deadline=soon(5), max_bytes=100),
        lambda: store.get_range(key, 0, 10, deadline=soon(5)),
        lambda: store.download(key, lambda c: None, deadline=soon(5), max_bytes=100),
    ]
    if upload is not None:
        calls.append(lambda: store.put_file(key, upload, deadline=soon(5)))
        calls.append(lambda: store.put_bytes(key, b"x", deadline=soon(5), if_match=None))
        calls.append(lambda: store.replace_file(key, upload, deadline=soon(5), if_match=None))
    return calls


# =========================================================================== the contract, on every store


def test_put_bytes_round_trips_with_size_and_etag(store: Store) -> None:
    etag = store.put_bytes("manifests/m/c.json", b'{"a": 1}', deadline=soon(), if_match=None)
    data, info = store.get("manifests/m/c.json", deadline=soon(), max_bytes=1024)
    assert data == b'{"a": 1}' and info.size == 8 and info.etag == etag and etag
    head = store.head("manifests/m/c.json", deadline=soon())
    assert (head.size, head.etag) == (8, etag)


def test_get_range_returns_fewer_bytes_only_at_the_end(store: Store) -> None:
    data = bytes(range(256)) * 4
    store.put_bytes("blob", data, deadline=soon(), if_match=None)
    assert store.get_range("blob", 0, 16, deadline=soon()) == data[:16]
    assert store.get_range("blob", 100, 300, deadline=soon()) == data[100:300]
    assert store.get_range("blob", 1000, 2000, deadline=soon()) == data[1000:]
    assert store.get_range("blob", 1024, 2000, deadline=soon()) == b""
    assert store.get_range("blob", 5000, 6000, deadline=soon()) == b""
    assert store.get_range("blob", 10, 10, deadline=soon()) == b""
    assert store.get_range("blob", 0, 1024, deadline=soon()) == data
    with pytest.raises(ValueError):
        store.get_range("blob", 10, 5, deadline=soon())


def test_put_file_is_create_only_and_never_overwrites(store: Store, tmp_path: Path) -> None:
    first = write_file(tmp_path / "a.pcache", 100_000, seed=1)
    write_file(tmp_path / "b.pcache", 100_000, seed=2)
    assert store.put_file("blobs/sha256/x.pcache", str(tmp_path / "a.pcache"), deadline=soon()) is True
    assert store.put_file("blobs/sha256/x.pcache", str(tmp_path / "b.pcache"), deadline=soon()) is False
    assert store.get("blobs/sha256/x.pcache", deadline=soon(), max_bytes=1 << 20)[0] == first


def test_replace_file_overwrites_on_the_current_etag_or_unconditionally_and_conflicts_on_a_stale_one(
    store: Store, tmp_path: Path
) -> None:
    """What publish repairs a damaged blob with: a whole object replaced, never a mix."""
    damaged = write_file(tmp_path / "a.pcache", 100_000, seed=1)
    good = write_file(tmp_path / "b.pcache", 70_000, seed=2)
    store.put_file("blobs/sha256/x.pcache", str(tmp_path / "a.pcache"), deadline=soon())
    etag = store.head("blobs/sha256/x.pcache", deadline=soon()).etag
    assert etag is not None
    stale = reason_of(lambda: store.replace_file("blobs/sha256/x.pcache", str(tmp_path / "b.pcache"),
                                                 deadline=soon(), if_match="0" * 32))  # fmt: skip
    assert stale.reason == "remote_conflict"
    assert store.get("blobs/sha256/x.pcache", deadline=soon(), max_bytes=1 << 20)[0] == damaged
    store.replace_file("blobs/sha256/x.pcache", str(tmp_path / "b.pcache"), deadline=soon(), if_match=etag)
    assert store.get("blobs/sha256/x.pcache", deadline=soon(), max_bytes=1 << 20)[0] == good
    store.replace_file("blobs/sha256/x.pcache", str(tmp_path / "a.pcache"), deadline=soon(), if_match=None)
    assert store.get("blobs/sha256/x.pcache", deadline=soon(), max_bytes=1 << 20)[0] == damaged


def test_put_bytes_create_only_conflicts_and_keeps_the_first(store: Store) -> None:
    store.put_bytes("m.json", b"first", deadline=soon(), if_match=None)
    error = reason_of(lambda: store.put_bytes("m.json", b"second", deadline=soon(), if_match=None))
    assert error.reason == "remote_conflict"
    assert store.get("m.json", deadline=soon(), max_bytes=100)[0] == b"first"


def test_compare_and_swap_succeeds_on_the_current_etag_and_conflicts_on_a_stale_one(store: Store) -> None:
    old = store.put_bytes("m.json", b"generation 1", deadline=soon(), if_match=None)
    new = store.put_bytes("m.json", b"generation 2", deadline=soon(), if_match=old)
    assert new != old
    assert store.get("m.json", deadline=soon(), max_bytes=100) == (b"generation 2", stores.ObjectInfo(12, new))
    stale = reason_of(lambda: store.put_bytes("m.json", b"generation 3", deadline=soon(), if_match=old))
    assert stale.reason == "remote_conflict"
    assert store.get("m.json", deadline=soon(), max_bytes=100)[0] == b"generation 2"
    absent = reason_of(lambda: store.put_bytes("other.json", b"x", deadline=soon(), if_match=old))
    assert absent.reason == "remote_conflict"
    assert reason_of(lambda: store.head("other.json", deadline=soon())).reason == "remote_absent"


def test_absent_keys_are_remote_absent_for_every_read(store: Store) -> None:
    store.put_bytes("present", b"x", deadline=soon(), if_match=None)
    calls: list[Callable[[], object]] = [
        lambda: store.head("missing/key", deadline=soon()),
        lambda: store.get("missing/key", deadline=soon(), max_bytes=10),
        lambda: store.get_range("missing/key", 0, 10, deadline=soon()),
        lambda: store.get_range("missing/key", 3, 3, deadline=soon()),
        lambda: store.download("missing/key", lambda chunk: None, deadline=soon(), max_bytes=10),
    ]
    for call in calls:
        assert reason_of(call).reason == "remote_absent"


def test_more_than_max_bytes_is_remote_corrupt_before_any_byte_is_handed_over(store: Store) -> None:
    store.put_bytes("big", b"x" * 1000, deadline=soon(), if_match=None)
    assert reason_of(lambda: store.get("big", deadline=soon(), max_bytes=999)).reason == "remote_corrupt"
    received: list[int] = []
    error = reason_of(lambda: store.download("big", lambda c: received.append(len(c)), deadline=soon(), max_bytes=999))
    assert error.reason == "remote_corrupt" and received == []
    assert store.get("big", deadline=soon(), max_bytes=1000)[0] == b"x" * 1000


def test_download_streams_every_byte_in_chunks_of_at_most_8_mib(store: Store, tmp_path: Path) -> None:
    data = write_file(tmp_path / "blob", CHUNK_BYTES + 3 * 1024 * 1024 + 5, seed=3)
    assert store.put_file("blobs/b", str(tmp_path / "blob"), deadline=soon(60)) is True
    sizes: list[int] = []
    digest = hashlib.sha256()

    def sink(chunk: memoryview) -> None:
        sizes.append(len(chunk))
        digest.update(chunk)

    info = store.download("blobs/b", sink, deadline=soon(60), max_bytes=len(data))
    assert digest.digest() == hashlib.sha256(data).digest() and info.size == len(data) == sum(sizes)
    assert max(sizes) <= CHUNK_BYTES and len(sizes) >= 2


def test_hostile_keys_are_refused_by_every_method(store: Store, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    hostile = ["", "/etc/passwd", "a/../../b", "./a", "a//b", "a/", "a\0b", "a\\b", "a/./b", "..", "\udc80", "x" * 1025]
    for key in hostile:
        for call in every_call(store, key, str(tmp_path / "f")):
            with pytest.raises(ValueError, match="store key"):
                call()
    assert check_key("x" * 1024) == "x" * 1024


# One of several processes racing on one key; all start at the same wall-clock instant.
RACER = """
import json, sys, time
from packcache.errors import RemoteError
from packcache.fleet.stores import open_store
url, mode, etag, me, start = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
store = open_store(url)
while time.time() < start:
    pass
try:
    if mode == "file":
        outcome = "created" if store.put_file("blobs/k", sys.argv[6], deadline=time.monotonic() + 20) else "existed"
    else:
        store.put_bytes("m.json", me.encode(), deadline=time.monotonic() + 20, if_match=etag or None)
        outcome = "won"
except RemoteError as e:
    outcome = e.reason
print(json.dumps(outcome))
"""


def race(store: Store, mode: str, etag: str, extra: list[str], processes: int = 4) -> list[str]:
    start = time.time() + 1.5  # the interpreters start first, then all go at once
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, store.url, mode, etag, f"writer {i}", str(start), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    outcomes = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    return outcomes


def test_racing_compare_and_swap_processes_exactly_one_wins(store: Store) -> None:
    etag = store.put_bytes("m.json", b"generation 1", deadline=soon(), if_match=None)
    outcomes = race(store, "cas", etag, [])
    assert sorted(outcomes) == ["remote_conflict"] * 3 + ["won"], outcomes
    winner = outcomes.index("won")
    assert store.get("m.json", deadline=soon(), max_bytes=100)[0] == f"writer {winner}".encode()


def test_racing_create_only_puts_exactly_one_creates(store: Store, tmp_path: Path) -> None:
    write_file(tmp_path / "blob", 300_000, seed=4)
    assert sorted(race(store, "file", "", [str(tmp_path / "blob")])) == ["created"] + ["existed"] * 3
    assert sorted(race(store, "create", "", [])).count("won") == 1


# =========================================================================== object store faults, real sockets


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and, per ``reply``, sends nothing or a prefix."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            if self.reply:
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with __import__("contextlib").suppress(OSError):
            conn.recv(65536)  # the request; then the prefix of an answer, then silence
            conn.sendall(self.reply)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for conn in self.connections:
            conn.close()


def s3_store_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> Store:
    for name, value in s3_env(endpoint).items():
        monkeypatch.setenv(name, value)
    return open_store("s3://bucket/prefix", timeout=30)


def assert_times_out(call: Callable[[], object], deadline: float) -> None:
    error = reason_of(call)
    late = time.monotonic() - deadline
    assert error.reason == "remote_timeout", error
    assert late <= GRACE, f"returned {late:.2f} s after the deadline"


def test_a_server_that_accepts_and_never_answers_times_out_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = SilentServer()
    (tmp_path / "f").write_bytes(b"x" * 1000)
    try:
        with s3_store_at(monkeypatch, f"http://127.0.0.1:{server.port}") as store:
            calls: list[Callable[[float], object]] = [
                lambda d: store.head("k", deadline=d),
                lambda d: store.get("k", deadline=d, max_bytes=10),
                lambda d: store.get_range("k", 0, 10, deadline=d),
                lambda d: store.download("k", lambda c: None, deadline=d, max_bytes=10),
                lambda d: store.put_bytes("k", b"x", deadline=d, if_match=None),
                lambda d: store.put_file("k", str(tmp_path / "f"), deadline=d),
            ]
            for call in calls:
                deadline = time.monotonic() + 0.4
                assert_times_out(lambda call=call, deadline=deadline: call(deadline), deadline)
        assert server.connections, "the store never connected"
    finally:
        server.close()


def test_a_silent_server_is_a_timeout_after_the_stall_bound_well_before_a_far_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = SilentServer()
    try:
        for name, value in s3_env(f"http://127.0.0.1:{server.port}").items():
            monkeypatch.setenv(name, value)
        with open_store("s3://bucket/prefix", timeout=0.3) as store:
            started = time.monotonic()
            error = reason_of(lambda: store.head("k", deadline=soon(30)))
        assert error.reason == "remote_timeout", error
        assert time.monotonic() - started < 5, "three tries of 0.3 s and two short backoffs, not the 30 s deadline"
    finally:
        server.close()


def test_a_file_above_the_single_put_limit_goes_up_in_parts_and_a_later_put_leaves_it(
    moto_env: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_objectstore, "_SINGLE_PUT_MAX", 1 << 20)  # what 1 GiB is in production, small enough here
    data = write_file(tmp_path / "blob", 11 << 20, seed=8)
    write_file(tmp_path / "other", 11 << 20, seed=9)
    with open_store(f"{moto_env.url}/{uuid.uuid4().hex}") as store:
        assert store.put_file("blobs/b", str(tmp_path / "blob"), deadline=soon(60)) is True
        assert store.put_file("blobs/b", str(tmp_path / "other"), deadline=soon(60)) is False
        assert store.get("blobs/b", deadline=soon(60), max_bytes=len(data))[0] == data


def test_a_server_that_stalls_in_the_middle_of_a_body_times_out_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head = (
        b'HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\nETag: "e"\r\n'
        b"Last-Modified: Tue, 01 Dec 2026 12:00:00 GMT\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    server = SilentServer(head + b"z" * 5000)
    received: list[int] = []
    try:
        with s3_store_at(monkeypatch, f"http://127.0.0.1:{server.port}") as store:
            deadline = time.monotonic() + 1.5
            assert_times_out(
                lambda: store.download("k", lambda c: received.append(len(c)), deadline=deadline, max_bytes=10**8),
                deadline,
            )
            deadline = time.monotonic() + 1.0
            assert_times_out(lambda: store.get("k", deadline=deadline, max_bytes=10**8), deadline)
    finally:
        server.close()
    assert sum(received) <= 5000


def test_a_server_killed_mid_download_is_a_remote_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = write_file(tmp_path / "blob", 48 << 20, seed=5)
    with moto_server() as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        with open_store(server.url) as store:
            assert store.put_file("blob", str(tmp_path / "blob"), deadline=soon(60))
            received: list[int] = []

            def sink(chunk: memoryview) -> None:
                if not received:
                    server.kill()  # SIGKILL after the first chunk: the rest of the body never comes
                received.append(len(chunk))

            deadline = soon(20)
            error = reason_of(lambda: store.download("blob", sink, deadline=deadline, max_bytes=len(data)))
            assert error.reason == "remote_error", error
            assert time.monotonic() < deadline and 0 < sum(received) < len(data)
            refused = reason_of(lambda: store.head("blob", deadline=soon()))
            assert refused.reason == "remote_error" and refused.errno == errno.ECONNREFUSED, refused


def test_a_refused_connection_is_a_remote_error_naming_the_errno(monkeypatch: pytest.MonkeyPatch) -> None:
    with s3_store_at(monkeypatch, f"http://127.0.0.1:{free_port()}") as store:
        started = time.monotonic()
        error = reason_of(lambda: store.head("k", deadline=soon()))
    assert error.reason == "remote_error" and error.errno == errno.ECONNREFUSED and "refused" in str(error)
    assert time.monotonic() - started < 5, "a refused connection is retried twice, not until the deadline"


def _obstore_exceptions() -> Any:
    import obstore.exceptions

    return obstore.exceptions


#: (what obstore raises: its type's name and its text, the remote miss it is, what the message says). The type
#: decides; the text is read only for what no type carries (the HTTP status, the errno, a timeout's kind, the
#: protocol's missing-bucket code).
_OBSTORE_ERRORS = [
    ("FileNotFoundError", "<Code>NoSuchKey</Code>", "remote_absent", "no object at 'k'"),
    ("NotFoundError", "<Code>NoSuchKey</Code>", "remote_absent", "no object at 'k'"),
    ("FileNotFoundError", "status: 404 <Code>NoSuchBucket</Code>", "remote_error", "does not exist"),
    ("PreconditionError", "status: 404 <Code>NoSuchBucket</Code>", "remote_error", "does not exist"),
    ("AlreadyExistsError", "status: 409", "remote_conflict", "already exists (HTTP 409)"),
    ("PreconditionError", "status: 412", "remote_conflict", "ETag"),
    ("GenericError", "HttpError { kind: Timeout }", "remote_timeout", "no answer before the deadline"),
    ("TimeoutError", "timed out", "remote_timeout", "no answer before the deadline"),
    ("GenericError", "error sending request", "remote_error", "GenericError"),  # deadline far: no timeout
    ("GenericError", "status: 503 kind: Timeout", "remote_error", "(HTTP 503)"),  # an answer: not a timeout
    ("GenericError", "Os { code: 111, kind: ConnectionRefused }", "remote_error", "ECONNREFUSED"),
    ("PermissionDeniedError", "status: 403 Forbidden", "remote_error", "(HTTP 403)"),
    ("UnauthenticatedError", "status: 401", "remote_error", "(HTTP 401)"),
    ("NotModifiedError", "status: 304", "remote_error", "(HTTP 304)"),
    ("NotImplementedError", "put_opts with a mode other than Overwrite", "remote_error", "NotImplementedError"),
    ("ValueError", "Invalid key: bogus", "remote_error", "ValueError"),
]


@pytest.mark.parametrize(("kind", "text", "reason", "says"), _OBSTORE_ERRORS)
def test_obstore_errors_are_mapped_by_their_type(kind: str, text: str, reason: str, says: str) -> None:
    exceptions = _obstore_exceptions()
    raised = getattr(exceptions, kind, None) or {
        "FileNotFoundError": FileNotFoundError, "TimeoutError": TimeoutError,
        "NotImplementedError": NotImplementedError, "ValueError": ValueError,
    }[kind]  # fmt: skip
    store = ObjectStore(f"http://127.0.0.1:{free_port()}/p", timeout=5)  # no request is made
    with pytest.raises(RemoteError) as caught, store._translating("k", "get", soon()):
        raise raised(text)
    assert caught.value.reason == reason and says in str(caught.value), caught.value
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # obstore's text holds the raw URL


def test_an_errno_past_the_deadline_is_that_error_not_a_timeout() -> None:
    """Past a call's deadline, an obstore error with no cause in it is taken for obstore's bound firing; one that names
    its errno (a refused connection) used to be taken for a timeout as well, when a busy machine handled it late. It
    is that error: a timeout never hides what the store said."""
    exceptions = _obstore_exceptions()
    store = ObjectStore(f"http://127.0.0.1:{free_port()}/p", timeout=5)  # no request is made
    past = time.monotonic() - 1
    with pytest.raises(RemoteError) as caught, store._translating("k", "get", past):
        raise exceptions.GenericError("error sending request: Os { code: 111, kind: ConnectionRefused }")
    assert caught.value.reason == "remote_error" and "ECONNREFUSED" in str(caught.value), caught.value
    with pytest.raises(RemoteError) as caught, store._translating("k", "get", past):
        raise exceptions.GenericError("error sending request")
    assert caught.value.reason == "remote_timeout", caught.value


def test_what_obstore_does_not_raise_for_a_store_passes_through_untranslated() -> None:
    """A bug (a TypeError) is not dressed as a store's answer; a range read's 416 is the range read's to answer."""
    store = ObjectStore(f"http://127.0.0.1:{free_port()}/p", timeout=5)
    with pytest.raises(TypeError), store._translating("k", "get", soon()):
        raise TypeError("a bug")

    class PastEnd(Exception):
        pass

    with pytest.raises(PastEnd), store._translating("k", "get_range", soon(), past_end=PastEnd):
        raise _obstore_exceptions().GenericError("Error performing GET: status: 416 Range Not Satisfiable")


class Forbidden(BaseHTTPRequestHandler):
    def _deny(self) -> None:
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = _deny

    def log_message(self, *args: Any) -> None:
        pass


def test_a_403_is_a_remote_error_with_the_status(monkeypatch: pytest.MonkeyPatch) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Forbidden)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with s3_store_at(monkeypatch, f"http://127.0.0.1:{httpd.server_address[1]}") as store:
            for call in (
                lambda: store.head("k", deadline=soon()),
                lambda: store.get("k", deadline=soon(), max_bytes=10),
                lambda: store.put_bytes("k", b"x", deadline=soon(), if_match=None),
            ):
                error = reason_of(call)
                assert error.reason == "remote_error" and "HTTP 403" in str(error), error
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_urls_choose_the_store_and_unknown_forms_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_store(f"file://{tmp_path}"), DirectoryStore)
    assert isinstance(open_store("file://localhost/srv/store"), DirectoryStore)
    relative = open_store("shared/store")
    assert isinstance(relative, DirectoryStore) and relative.root == str(tmp_path / "shared" / "store")
    for url in ("ftp://host/x", "file://otherhost/srv", "file:relative/path"):
        with pytest.raises(ValueError, match="store URL"):
            open_store(url)


def test_an_http_store_refuses_to_publish_with_a_remote_error(moto_env: S3Server) -> None:
    """obstore's HTTP store has no create-only or compare-and-swap put: http(s):// stores are read-only."""
    with open_store(f"{moto_env.endpoint}/{moto_env.bucket}/{uuid.uuid4().hex}") as http:
        assert isinstance(http, ObjectStore)
        refused = reason_of(lambda: http.put_bytes("new.json", b"x", deadline=soon(), if_match=None))
        assert refused.reason == "remote_error" and "not yet implemented" in str(refused), refused


def test_the_url_keeps_no_credentials() -> None:
    with open_store("https://user:secret@store.example/prefix?sig=token") as store:
        assert store.url == "https://store.example/prefix"
        assert "secret" not in repr(store) and "token" not in repr(store)


def test_the_core_and_the_directory_store_import_without_obstore(tmp_path: Path) -> None:
    code = f"""
import sys
sys.modules["obstore"] = None  # as if the fleet extra were not installed
import packcache, packcache.fleet.stores as stores
with stores.open_store({str(tmp_path)!r}) as s:
    s.put_bytes("k", b"x", deadline=__import__("time").monotonic() + 5, if_match=None)
try:
    stores.open_store("s3://bucket/prefix")
except ModuleNotFoundError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'packcache[fleet]'" in done.stdout and (tmp_path / "k").read_bytes() == b"x"


def test_a_child_forked_after_obstore_was_used_gets_an_error_not_a_hang(moto_env: S3Server) -> None:
    code = f"""
import os, time
from packcache.errors import RemoteError
from packcache.fleet.stores import open_store
store = open_store({moto_env.url + "/fork"!r})
store.put_bytes("k", b"x", deadline=time.monotonic() + 10, if_match=None)
pid = os.fork()
if pid == 0:
    started = time.monotonic()
    try:
        open_store({moto_env.url + "/fork"!r}).head("k", deadline=time.monotonic() + 10)
        os._exit(1)
    except RemoteError as e:
        os._exit(0 if e.reason == "remote_error" and "fork" in str(e) and time.monotonic() - started < 1 else 2)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "0", (done.stdout, done.stderr)


def test_a_child_of_a_parent_that_only_opened_a_store_can_use_it(moto_env: S3Server) -> None:
    """A pre-fork server master may open a store (no request): its workers still fetch."""
    url = f"{moto_env.url}/fork-ok"
    with open_store(url) as seed:
        seed.put_bytes("k", b"x", deadline=soon(), if_match=None)
    code = f"""
import os, time
from packcache.fleet.stores import open_store
store = open_store({url!r})
pid = os.fork()
if pid == 0:
    os._exit(0 if store.get("k", deadline=time.monotonic() + 10, max_bytes=10)[0] == b"x" else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "0", (done.stdout, done.stderr)


@pytest.mark.xdist_group("weed")  # one weed mini at a time
def test_weed_mini_smoke_create_only_get_range_and_compare_and_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_file(tmp_path / "blob", 200_000, seed=6)
    with weed_server() as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        with open_store(f"{server.url}/fleet") as store:
            assert store.put_file("blobs/b.pcache", str(tmp_path / "blob"), deadline=soon()) is True
            assert store.put_file("blobs/b.pcache", str(tmp_path / "blob"), deadline=soon()) is False
            assert store.get("blobs/b.pcache", deadline=soon(), max_bytes=len(data))[0] == data
            assert store.get_range("blobs/b.pcache", 199_990, 300_000, deadline=soon()) == data[199_990:]
            etag = store.put_bytes("m.json", b"1", deadline=soon(), if_match=None)
            assert reason_of(lambda: store.put_bytes("m.json", b"x", deadline=soon(), if_match=None)).reason == (
                "remote_conflict"
            )
            store.put_bytes("m.json", b"2", deadline=soon(), if_match=etag)
            stale = reason_of(lambda: store.put_bytes("m.json", b"3", deadline=soon(), if_match=etag))
            assert stale.reason == "remote_conflict"
            assert store.get("m.json", deadline=soon(), max_bytes=10)[0] == b"2"
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with open_store(f"{server.url}/fleet") as store:
            denied = reason_of(lambda: store.head("m.json", deadline=soon()))
            assert denied.reason == "remote_error" and "HTTP 403" in str(denied), denied


# =========================================================================== directory store faults


@pytest.fixture
def dstore(tmp_path: Path) -> DirectoryStore:
    (tmp_path / "store").mkdir()
    return DirectoryStore(f"file://{tmp_path / 'store'}")


def test_a_fifo_a_directory_or_a_symlink_at_a_key_is_a_remote_error_never_a_hang(
    dstore: DirectoryStore, tmp_path: Path
) -> None:
    root = Path(dstore.root)
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", root / "link")
    for key in ("fifo", "dir", "link"):
        for call in every_call(dstore, key, None):
            error = reason_of(call)
            assert error.reason == "remote_error", (key, error)
    assert "symlink" in str(reason_of(lambda: dstore.head("link", deadline=soon())))
    assert "FIFO" in str(reason_of(lambda: dstore.head("fifo", deadline=soon())))
    assert (tmp_path / "outside").read_bytes() == b"secret"


def test_a_symlinked_directory_planted_on_the_way_is_never_followed(dstore: DirectoryStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "m.json").write_bytes(b"theirs")
    os.symlink(outside, Path(dstore.root) / "manifests")
    assert reason_of(lambda: dstore.get("manifests/m.json", deadline=soon(), max_bytes=10)).reason == "remote_error"
    write = reason_of(lambda: dstore.put_bytes("manifests/new.json", b"x", deadline=soon(), if_match=None))
    assert write.reason == "remote_error" and write.errno in (errno.ELOOP, errno.ENOTDIR)
    assert sorted(os.listdir(outside)) == ["m.json"]


def test_a_missing_store_directory_is_a_remote_error_not_absent(tmp_path: Path) -> None:
    store = DirectoryStore(str(tmp_path / "not-mounted"))
    for call in (
        lambda: store.head("k", deadline=soon()),
        lambda: store.put_bytes("k", b"x", deadline=soon(), if_match=None),
    ):
        error = reason_of(call)
        assert error.reason == "remote_error" and error.errno == errno.ENOENT, error
    assert not (tmp_path / "not-mounted").exists()


def _missing_root_calls(store: Store, upload: str) -> list[Callable[[], object]]:
    return [
        *every_call(store, "manifests/m/pc1-x.json", upload),
        lambda: store.get_range("blobs/b.pcache", 0, 0, deadline=soon(5)),
        lambda: store.put_bytes("manifests/m/pc1-x.json", b"x", deadline=soon(5), if_match="0" * 32),
        lambda: store.replace_file("blobs/b.pcache", upload, deadline=soon(5), if_match="0" * 32),
    ]


@pytest.mark.parametrize("kind", ["directory", "moto"])
def test_a_missing_bucket_or_store_directory_is_a_remote_error_on_every_call(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A bucket that does not exist (a typo, a deleted bucket, the wrong account or endpoint) is a
    configuration problem, as a missing store directory is: never "nothing published"."""
    write_file(tmp_path / "f", 1000)
    if kind == "moto":
        server = request.getfixturevalue("moto_env")
        url = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/fleet"
        assert server.url != url
    else:
        url = str(tmp_path / "not-mounted")
    with open_store(url) as store:
        for number, call in enumerate(_missing_root_calls(store, str(tmp_path / "f"))):
            error = reason_of(call)
            assert error.reason == "remote_error", (number, error)
            assert ("bucket" in str(error)) if kind == "moto" else error.errno == errno.ENOENT, (number, error)
    assert not (tmp_path / "not-mounted").exists()


@pytest.mark.xdist_group("weed")  # one weed mini at a time
def test_weed_mini_a_missing_bucket_is_a_remote_error_on_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SeaweedFS creates a bucket on a first write, so only reads meet a missing one there."""
    with weed_server() as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        with open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/fleet") as store:
            for number, call in enumerate(every_call(store, "manifests/m/pc1-x.json", None)):
                error = reason_of(call)
                assert error.reason == "remote_error" and "bucket" in str(error), (number, error)
        with open_store(f"{server.url}/fleet") as store:  # an existing bucket: a missing key is absent
            assert reason_of(lambda: store.head("manifests/none.json", deadline=soon())).reason == "remote_absent"


def test_objects_are_0644_and_directories_0755_whatever_the_umask(dstore: DirectoryStore, tmp_path: Path) -> None:
    write_file(tmp_path / "f", 10)
    old = os.umask(0o077)
    try:
        dstore.put_bytes("a/b/m.json", b"x", deadline=soon(), if_match=None)
        dstore.put_file("c/blob", str(tmp_path / "f"), deadline=soon())
    finally:
        os.umask(old)
    root = Path(dstore.root)
    assert [stat.S_IMODE(os.stat(root / p).st_mode) for p in ("a", "a/b", "c")] == [0o755] * 3
    assert [stat.S_IMODE(os.stat(root / p).st_mode) for p in ("a/b/m.json", "c/blob")] == [0o644] * 2
    assert sorted(os.listdir(root / "c")) == ["blob"], "no temp file left"


@pytest.mark.root
def test_a_full_tmpfs_is_remote_no_space_and_leaves_no_partial_object(tmp_path: Path) -> None:
    write_file(tmp_path / "blob", 3 << 20, seed=7)
    with tmpfs(tmp_path / "small", "1m") as root:
        os.chmod(root, 0o755)
        store = DirectoryStore(str(root))
        error = reason_of(lambda: store.put_file("blobs/b", str(tmp_path / "blob"), deadline=soon()))
        assert error.reason == "remote_no_space" and error.errno == errno.ENOSPC and "ENOSPC" in str(error)
        error = reason_of(lambda: store.put_bytes("m.json", b"y" * (2 << 20), deadline=soon(), if_match=None))
        assert error.reason == "remote_no_space"
        assert os.listdir(root / "blobs") == [] and sorted(os.listdir(root)) == ["blobs"]
        assert reason_of(lambda: store.head("blobs/b", deadline=soon())).reason == "remote_absent"


@pytest.mark.root
def test_a_read_only_store_is_a_remote_error_naming_erofs(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.json").write_bytes(b"published")
    write_file(tmp_path / "f", 10)
    with read_only_bind(tmp_path / "src", tmp_path / "ro") as root:
        store = DirectoryStore(str(root))
        assert store.get("m.json", deadline=soon(), max_bytes=100)[0] == b"published"
        for call in (
            lambda: store.put_bytes("new.json", b"x", deadline=soon(), if_match=None),
            lambda: store.put_file("blobs/b", str(tmp_path / "f"), deadline=soon()),
        ):
            error = reason_of(call)
            assert error.reason == "remote_error" and error.errno == errno.EROFS and "EROFS" in str(error)


@pytest.mark.root
def test_another_user_cannot_write_a_root_owned_store_and_gets_eacces(dstore: DirectoryStore) -> None:
    os.chmod(dstore.root, 0o755)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, try to publish
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                dstore.put_bytes("m.json", b"x", deadline=time.monotonic() + 5, if_match=None)
                message = "written"
            except RemoteError as e:
                message = f"{e.reason} {e.errno} {e}"
            os.write(write_fd, message.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd) as f:
        message = f.read()
    assert message.startswith(f"remote_error {errno.EACCES} ") and "EACCES" in message, message


def test_a_store_lock_held_by_another_process_times_out_within_the_deadline(dstore: DirectoryStore) -> None:
    etag = dstore.put_bytes("m.json", b"1", deadline=soon(), if_match=None)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)",
            os.path.join(dstore.root, DirectoryStore.LOCK_NAME),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        deadline = time.monotonic() + 0.5
        assert_times_out(lambda: dstore.put_bytes("m.json", b"2", deadline=deadline, if_match=etag), deadline)
    finally:
        holder.kill()
        holder.communicate()
    dstore.put_bytes("m.json", b"2", deadline=soon(), if_match=etag)
    assert dstore.get("m.json", deadline=soon(), max_bytes=10)[0] == b"2"


def test_a_syscall_blocked_in_the_kernel_is_abandoned_at_the_deadline(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    closed: list[int] = []
    deadline = time.monotonic() + 0.3
    # A blocking open of a FIFO stands in for a read from a dead hard-mounted NFS server.
    result = _dirstore.run_bounded(lambda: os.open(fifo, os.O_RDONLY), deadline, closed.append)
    assert result is None and time.monotonic() - deadline <= GRACE
    writer = os.open(fifo, os.O_WRONLY)  # let the abandoned open finish: its descriptor is closed for us
    os.close(writer)
    for _ in range(100):
        if closed:
            break
        time.sleep(0.01)
    assert len(closed) == 1
