"""``packcache._faults``: the one translation of an ``OSError`` into a ``Fault`` (and, for the fleet, into a
``RemoteError``): reasons, errnos and messages, made from real system errors wherever the machine allows."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from harness.mounts import tmpfs
from packcache import _faults as faults
from packcache._faults import Fault, translating, translating_into
from packcache._paths import open_checked
from packcache._sidefiles import acquire_build_lock
from packcache.errors import RemoteError, UntrustedFileError
from packcache.fleet.stores import DirectoryStore
from packcache.stats import HeapReason


def test_an_oserror_becomes_a_fault_with_its_reason_errno_and_message(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.pcache")
    with pytest.raises(Fault) as raised, translating(HeapReason.OPEN_FAILED, "cannot open", missing):
        os.open(missing, os.O_RDONLY)
    fault = raised.value
    assert (fault.reason, fault.errno) == (HeapReason.OPEN_FAILED, errno.ENOENT)
    assert fault.message == str(fault) == f"cannot open {missing}: ENOENT (No such file or directory)"
    # ``from None``: the fault is the whole story, as the hand-written blocks made it.
    assert fault.__cause__ is None and fault.__suppress_context__


@pytest.mark.parametrize(
    ("err", "write", "opening"),
    [
        (errno.ENOSPC, "no_space", "open_failed"),
        (errno.EDQUOT, "no_space", "open_failed"),
        (errno.EFBIG, "no_space", "open_failed"),
        (errno.EIO, "write_failed", "open_failed"),
        (errno.EACCES, "write_failed", "read_only"),
        (errno.EROFS, "write_failed", "read_only"),
        (errno.EPERM, "write_failed", "read_only"),
        (errno.ETXTBSY, "write_failed", "read_only"),
        (None, "write_failed", "open_failed"),
    ],
)
def test_a_reason_may_be_a_function_of_the_errno(err: int | None, write: str, opening: str) -> None:
    assert faults.write_reason(err).value == write
    assert faults.open_failed_reason(err).value == opening
    with pytest.raises(Fault) as raised, translating(faults.write_reason, "cannot write to", "m.pcache"):
        raise OSError(err, os.strerror(err) if err else "no errno")
    assert raised.value.reason.value == write and raised.value.errno == (err or 0)


@pytest.mark.root
def test_a_full_disk_is_no_space_with_enospc(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "64k") as mnt:
        path = mnt / "m.pcache"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(Fault) as raised, translating(faults.write_reason, "cannot write to", str(path)):
                os.posix_fallocate(fd, 0, 1 << 20)
        finally:
            os.close(fd)
    fault = raised.value
    assert (fault.reason, fault.errno) == (HeapReason.NO_SPACE, errno.ENOSPC)
    assert fault.message == f"cannot write to {path}: ENOSPC (No space left on device)"


def test_an_untrusted_file_is_an_untrusted_fault_whatever_the_reason_given(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    path.write_bytes(b"x")
    os.chmod(path, 0o666)
    with pytest.raises(UntrustedFileError) as refused:
        open_checked(str(path))
    with pytest.raises(Fault) as raised, translating(HeapReason.OPEN_FAILED, "cannot open", str(path)):
        open_checked(str(path))
    fault = raised.value
    assert (fault.reason, fault.errno, fault.message) == (HeapReason.UNTRUSTED, 0, str(refused.value))


def test_a_lock_timeout_is_a_locked_fault_with_ewouldblock(tmp_path: Path) -> None:
    path = str(tmp_path / "m.pcache")
    held = acquire_build_lock(path, 1.0, 0o600)
    try:
        with pytest.raises(Fault) as raised, translating(HeapReason.OPEN_FAILED, "cannot open lock file for", path):
            acquire_build_lock(path, 0.0, 0o600)  # another descriptor: flock refuses it, as another process
    finally:
        os.close(held)
    fault = raised.value
    assert (fault.reason, fault.errno) == (HeapReason.LOCKED, errno.EWOULDBLOCK)
    assert fault.message.startswith(f"another process held the build lock {path}.lock for more than 0 s")


@pytest.mark.parametrize("error", [ValueError("not an OSError"), KeyboardInterrupt(), Fault(HeapReason.LOCKED, 0, "f")])
def test_anything_but_an_oserror_passes_through_untouched(error: BaseException) -> None:
    with pytest.raises(type(error)) as raised, translating(HeapReason.OPEN_FAILED, "cannot open", "m.pcache"):
        raise error
    assert raised.value is error


def test_a_body_that_succeeds_is_left_alone(tmp_path: Path) -> None:
    with translating(HeapReason.OPEN_FAILED, "cannot stat", str(tmp_path)):
        st = os.stat(tmp_path)
    assert st.st_ino == tmp_path.stat().st_ino


def test_a_message_without_strerror_still_names_the_errno_or_says_it_has_none() -> None:
    message = faults.describe(OSError("mapping failed"), "cannot map", "m.pcache")
    assert message == "cannot map m.pcache: E? (mapping failed)"
    assert faults.errno_name(errno.EWOULDBLOCK) in ("EAGAIN", "EWOULDBLOCK")
    assert faults.errno_name(0, "no errno") == "no errno"


def test_translating_into_makes_the_callers_error_and_none_leaves_the_oserror(tmp_path: Path) -> None:
    def remote(exc: OSError) -> RemoteError | None:
        if exc.errno == errno.ENOENT:
            return None  # not this translation's: it leaves as it is
        return RemoteError("remote_write_failed", faults.errno_name(exc.errno), errno=exc.errno or 0)

    with pytest.raises(FileNotFoundError), translating_into(remote):
        os.stat(tmp_path / "none")
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(RemoteError) as raised, translating_into(remote, cause=True):
        os.stat(tmp_path / "plain" / "below")
    assert (raised.value.reason, raised.value.errno, str(raised.value)) == (
        "remote_write_failed", errno.ENOTDIR, "remote_write_failed: ENOTDIR",
    )  # fmt: skip
    assert isinstance(raised.value.__cause__, NotADirectoryError)  # cause=True keeps the OSError behind it


def test_the_directory_store_translates_at_one_point_and_keeps_its_own_errors(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    store = DirectoryStore(str(root))
    deadline = time.monotonic() + 10
    with pytest.raises(RemoteError) as absent:
        store.get("manifests/none.json", deadline=deadline, max_bytes=100)
    assert (absent.value.reason, absent.value.errno) == ("remote_absent", errno.ENOENT)
    assert isinstance(absent.value.__cause__, FileNotFoundError)
    os.mkfifo(root / "fifo")
    with pytest.raises(RemoteError) as fifo:
        store.get("fifo", deadline=deadline, max_bytes=100)
    assert fifo.value.reason == "remote_error" and "is not a regular file (a FIFO)" in str(fifo.value)
    assert fifo.value.__cause__ is None  # its own error, not re-translated
    gone = DirectoryStore(str(tmp_path / "unmounted"))
    with pytest.raises(RemoteError) as unmounted:
        gone.get("manifests/none.json", deadline=deadline, max_bytes=100)
    assert (unmounted.value.reason, unmounted.value.errno) == ("remote_error", errno.ENOENT)
    assert f"store directory {str(tmp_path / 'unmounted')!r}: ENOENT (No such file or directory)" in str(
        unmounted.value
    )
