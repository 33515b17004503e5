"""The store's condition as one value (``packcache._store_state``): each state reached by a real file
condition, the status replaced whole by each transition, and every illegal call refused with its error."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.files import garbage
from harness.mounts import read_only_bind
from harness.packs import build, packed
from packcache import format as fmt
from packcache._faults import Fault
from packcache._store import FileStore
from packcache._store_state import StoreState, StoreStateError, StoreStatus
from packcache.stats import HeapReason

PLATFORM = fmt.canonical_key(None)  # what WeightCache(path) writes by default
KEY = fmt.canonical_key({"packer": "test", "version": 1})


def open_store(path: Path, *, read_only: bool = False, platform: bytes = PLATFORM) -> FileStore:
    return FileStore(str(path), alignment=64, platform=platform, read_only=read_only, file_mode=0o600, dir_mode=0o700)


@pytest.fixture
def stores() -> Iterator[Callable[..., FileStore]]:
    """``open_store``, every store it made closed at the end (descriptors and locks released)."""
    made: list[FileStore] = []

    def make(path: Path, **options: Any) -> FileStore:
        made.append(open_store(path, **options))
        return made[-1]

    yield make
    for store in made:
        store.close()


def built(path: Path) -> Path:
    build(path, {"a": (1, 4096), "b": (2, 4096)}, key={"packer": "test", "version": 1})
    return path


def store_one(store: FileStore, name: str = "c", seed: int = 3) -> None:
    """One pack stored and committed under the build lock, as a session does it."""
    store.take_lock(5.0)
    store.hold_lock(5.0)
    try:
        store.store(name, KEY, fmt.key_digest(name, KEY), packed(seed, 4096))
        store.commit()
    finally:
        store.release_lock()


# --------------------------------------------------------------------------- states from real files


def test_a_new_store_is_unread_and_holds_nothing(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"))
    assert store.status.state is StoreState.UNREAD
    status = store.status
    assert (status.file, status.size, status.blocking, status.replacing) == (None, 0, None, None)
    assert store.serve("a", KEY) is None  # not read yet: a miss, never a guess


def test_a_missing_file_is_missing_and_the_next_store_builds_it(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    store = stores(tmp_path / "m.pcache")
    assert store.refresh() is True
    assert store.status.state is StoreState.MISSING
    assert store.status.rebuild == "the cache file does not exist"
    assert store.status.blocking is None and store.status.replacing is None  # nothing to replace
    assert store.refresh() is False  # still missing: nothing changed
    store_one(store)
    assert store.status.state is StoreState.READY and (tmp_path / "m.pcache").exists()


def test_a_missing_file_of_a_read_only_cache_blocks_with_enoent(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    store = stores(tmp_path / "m.pcache", read_only=True)
    store.refresh()
    assert store.status.state is StoreState.MISSING
    blocking = store.status.blocking
    assert blocking is not None
    assert (blocking.reason, blocking.errno) == (HeapReason.OPEN_FAILED, errno.ENOENT)
    assert blocking.message == f"cache file {tmp_path / 'm.pcache'} does not exist (read-only cache)"


def test_a_valid_file_is_ready_and_serves_its_packs(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path)
    store.refresh()
    status = store.status
    assert status.state is StoreState.READY
    assert status.file is not None and status.file.writable and status.committed is not None
    assert sorted(status.committed.entries) == ["a", "b"] and status.size == path.stat().st_size
    served = store.serve("a", KEY)
    assert served is not None and served[0].tobytes() == packed(1, 4096).tobytes()
    assert served[1] == (*status.file.identity, status.committed.entries["a"].offset)
    assert store.holds("a", KEY, served[1])


def test_an_untrusted_file_is_blocked_and_a_chmod_makes_it_ready_again(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path)
    store.refresh()
    ready = store.status
    origin = store.serve("a", KEY)
    assert origin is not None
    os.chmod(path, 0o666)
    assert store.refresh() is True
    assert store.status.state is StoreState.BLOCKED
    blocking = store.status.blocking
    assert blocking is not None and (blocking.reason, blocking.errno) == (HeapReason.UNTRUSTED, 0)
    assert blocking.message.startswith(f"untrusted cache file {path}: ")
    assert store.status.file is ready.file  # kept open: its trust is checked again at each refresh
    assert store.serve_many([("a", KEY)]) is None and not store.holds("a", KEY, origin[1])
    assert store.refresh() is False  # still untrusted: nothing changed
    os.chmod(path, 0o600)
    assert store.refresh() is True
    assert store.status.state is StoreState.READY and store.holds("a", KEY, origin[1])


def test_an_untrusted_file_found_at_open_is_blocked_without_a_descriptor(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    path = built(tmp_path / "m.pcache")
    os.chmod(path, 0o666)
    store = stores(path)
    store.refresh()
    assert store.status.state is StoreState.BLOCKED and store.status.file is None
    assert store.status.blocking is not None and store.status.blocking.reason is HeapReason.UNTRUSTED


def test_a_directory_at_the_path_is_blocked_with_eisdir(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    (tmp_path / "m.pcache").mkdir()
    store = stores(tmp_path / "m.pcache")
    store.refresh()
    assert store.status.state is StoreState.BLOCKED
    blocking = store.status.blocking
    assert blocking is not None and (blocking.reason, blocking.errno) == (HeapReason.OPEN_FAILED, errno.EISDIR)
    assert blocking.message == f"cache path {tmp_path / 'm.pcache'} is a directory"


def test_a_path_through_a_file_is_blocked_with_the_stat_errno(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    store = stores(tmp_path / "plain" / "m.pcache")
    store.refresh()
    blocking = store.status.blocking
    assert store.status.state is StoreState.BLOCKED and blocking is not None
    assert (blocking.reason, blocking.errno) == (HeapReason.OPEN_FAILED, errno.ENOTDIR)
    assert blocking.message == f"cannot stat {tmp_path / 'plain' / 'm.pcache'}: ENOTDIR (Not a directory)"


def test_an_invalid_file_is_rebuild_and_the_next_store_replaces_it(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    path = tmp_path / "m.pcache"
    garbage(path, 8192)
    store = stores(path)
    store.refresh()
    assert store.status.state is StoreState.REBUILD and store.status.file is not None
    assert store.status.replacing is not None and store.status.replacing.startswith("it is invalid: ")
    assert store.status.size == 8192 and store.status.reclaimable_bytes == 0
    old_inode = path.stat().st_ino
    store_one(store)
    assert store.status.state is StoreState.READY and path.stat().st_ino != old_inode  # a new file, renamed over


def test_a_file_of_another_platform_is_rebuild(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"), platform=fmt.canonical_key({"cpu": "elsewhere"}))
    store.refresh()
    assert store.status.state is StoreState.REBUILD
    assert store.status.replacing == "its platform fingerprint differs from this process's"


def test_a_file_replaced_under_the_store_is_read_anew(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path)
    store.refresh()
    served = store.serve("a", KEY)
    assert served is not None
    other = built(tmp_path / "other.pcache")
    os.replace(other, path)
    assert store.refresh() is True
    assert store.status.state is StoreState.READY
    assert store.status.file is not None and store.status.file.identity[1] == path.stat().st_ino
    assert not store.holds("a", KEY, served[1])  # the old bytes are another inode's now
    garbage(tmp_path / "junk", 8192)
    os.replace(tmp_path / "junk", path)
    store.refresh()
    assert store.status.state is StoreState.REBUILD and store.status.replacing is not None


def test_a_file_removed_under_the_store_is_missing(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path)
    store.refresh()
    path.unlink()
    assert store.refresh() is True
    assert store.status.state is StoreState.MISSING and store.status.file is None


@pytest.mark.root
def test_a_file_on_a_read_only_mount_is_ready_with_an_erofs_read_only_fault(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    built(tmp_path / "src" / "m.pcache")
    with read_only_bind(tmp_path / "src", tmp_path / "ro") as mount:
        store = stores(mount / "m.pcache")
        store.refresh()
        status = store.status
        assert status.state is StoreState.READY and status.file is not None and not status.file.writable
        fault = store.status.read_only_fault
        assert fault is not None and (fault.reason, fault.errno) == (HeapReason.READ_ONLY, errno.EROFS)
        assert fault.message == f"cannot write {mount / 'm.pcache'}: EROFS (Read-only file system)"
        assert store.serve("a", KEY) is not None  # hits still map
        with pytest.raises(StoreStateError, match=r"store\(\) on .* while it is open read-only \(cannot write"):
            store.store("c", KEY, fmt.key_digest("c", KEY), packed(3, 4096))
        store.close()
        del status  # it holds the file's mapping: the mount must be free to go


def test_a_read_only_store_opens_read_only_and_reopens_read_write_when_allowed(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path, read_only=True)
    store.refresh()
    assert store.status.state is StoreState.READY and store.status.file is not None
    assert not store.status.file.writable
    fault = store.status.read_only_fault
    assert fault is not None and fault.message == f"cache {path} is opened read-only"
    store.read_only = False
    assert store.refresh() is True  # the same file, open in the wrong mode: reopened
    assert store.status.file is not None and store.status.file.writable and store.status.read_only_fault is None


def test_a_closed_store_is_closed_for_good(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"))
    store.refresh()
    file = store.status.file
    assert file is not None
    store.close()
    assert store.status.state is StoreState.CLOSED and store.status.file is None
    try:  # the descriptor went with the status that held it (its number may be another file's by now)
        st = os.fstat(file.fd)
    except OSError:
        pass
    else:
        assert (st.st_dev, st.st_ino) != file.identity
    store.close()  # again: nothing
    store.abort()
    store.release_lock()


# --------------------------------------------------------------------------- the status, whole


def test_a_status_is_replaced_whole_never_patched(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path)
    store.refresh()
    before = store.status
    assert store.refresh() is False and store.status is before  # nothing changed: the same value
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.state = StoreState.CLOSED  # type: ignore[misc]
    store_one(store)
    after = store.status
    assert after is not before and after.state is StoreState.READY
    assert before.committed is not None and sorted(before.committed.entries) == ["a", "b"]  # the old one unchanged
    assert after.committed is not None and sorted(after.committed.entries) == ["a", "b", "c"]


def test_a_status_mixing_two_states_fields_cannot_be_made(tmp_path: Path) -> None:
    fault = Fault(HeapReason.UNTRUSTED, 0, "untrusted")
    with pytest.raises(AssertionError, match="READY"):
        StoreStatus(StoreState.READY)  # READY without a file or what it commits
    with pytest.raises(AssertionError, match="BLOCKED"):
        StoreStatus(StoreState.BLOCKED)  # blocked by nothing
    with pytest.raises(AssertionError, match="CLOSED"):
        StoreStatus(StoreState.CLOSED, blocking=fault)
    with pytest.raises(AssertionError, match="MISSING"):
        StoreStatus(StoreState.MISSING)  # missing, but no word on rebuilding


def test_a_pending_write_freezes_refresh_and_abort_returns_to_the_committed_status(
    tmp_path: Path, stores: Callable[..., FileStore]
) -> None:
    path = built(tmp_path / "m.pcache")
    store = stores(path)
    store.refresh()
    store.take_lock(5.0)
    store.hold_lock(5.0)
    store.store("c", KEY, fmt.key_digest("c", KEY), packed(3, 4096))
    committed = store.status
    assert store.pending and store.pending_names == ("c",)
    path.unlink()
    assert store.refresh() is False and store.status is committed  # our own writes are newer than the disk
    assert store.serve_many([("a", KEY)]) is None  # the one-pass path stays out while writing
    store.abort()
    assert not store.pending and store.status is committed
    store.release_lock()


# --------------------------------------------------------------------------- illegal calls


def test_store_before_the_first_refresh_is_refused(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(tmp_path / "m.pcache")
    with pytest.raises(StoreStateError, match=r"store\(\) on .* before its first refresh\(\)"):
        store.store("c", KEY, fmt.key_digest("c", KEY), packed(3, 4096))
    assert not (tmp_path / "m.pcache").exists()


def test_store_on_a_blocked_store_is_refused(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    path = built(tmp_path / "m.pcache")
    os.chmod(path, 0o666)
    before = path.read_bytes()
    store = stores(path)
    store.refresh()
    with pytest.raises(StoreStateError, match=r"store\(\) on .* while it is blocked \(untrusted cache file"):
        store.store("c", KEY, fmt.key_digest("c", KEY), packed(3, 4096))
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.pcache", "m.pcache.lock"]


def test_store_on_a_read_only_store_is_refused(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"), read_only=True)
    store.refresh()
    with pytest.raises(StoreStateError, match=r"while it is open read-only \(cache .* is opened read-only\)"):
        store.store("c", KEY, fmt.key_digest("c", KEY), packed(3, 4096))
    missing = stores(tmp_path / "none.pcache", read_only=True)
    missing.refresh()
    with pytest.raises(StoreStateError, match=r"while it is blocked \(cache file .* does not exist"):
        missing.store("c", KEY, fmt.key_digest("c", KEY), packed(3, 4096))
    assert not (tmp_path / "none.pcache").exists()


def test_commit_with_nothing_stored_is_refused(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"))
    store.refresh()
    with pytest.raises(StoreStateError, match=r"commit\(\) on the store of .* with nothing stored to commit"):
        store.commit()
    store.close()
    with pytest.raises(StoreStateError, match=r"commit\(\) on the store of .*, which is closed, with nothing stored"):
        store.commit()


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: s.refresh(), id="refresh"),
        pytest.param(lambda s: s.serve("a", KEY), id="serve"),
        pytest.param(lambda s: s.serve_many([("a", KEY)]), id="serve_many"),
        pytest.param(lambda s: s.holds("a", KEY, (0, 0, 0)), id="holds"),
        pytest.param(lambda s: s.take_lock(1.0), id="take_lock"),
        pytest.param(lambda s: s.hold_lock(1.0), id="hold_lock"),
        pytest.param(lambda s: s.store("c", KEY, b"", np.zeros(1)), id="store"),
        pytest.param(lambda s: s.compact_if_superseded(), id="compact_if_superseded"),
    ],
)
def test_every_call_on_a_closed_store_is_refused(
    tmp_path: Path, stores: Callable[..., FileStore], call: Callable[[FileStore], object]
) -> None:
    store = stores(built(tmp_path / "m.pcache"))
    store.refresh()
    store.close()
    with pytest.raises(StoreStateError, match=r"on the store of .*, which is closed"):
        call(store)
    assert store.status.state is StoreState.CLOSED


def test_taking_the_build_lock_twice_is_refused(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"))
    store.refresh()
    store.take_lock(5.0)
    store.hold_lock(5.0)
    with pytest.raises(StoreStateError, match=r"take_lock\(\) on .* while its build lock is held"):
        store.take_lock(5.0)
    store.release_lock()
    store.take_lock(5.0)  # free again: allowed
    store.hold_lock(5.0)
    assert store.locked


def test_holding_a_build_lock_never_taken_is_refused(tmp_path: Path, stores: Callable[..., FileStore]) -> None:
    store = stores(built(tmp_path / "m.pcache"))
    store.refresh()
    with pytest.raises(StoreStateError, match=r"hold_lock\(\) on .* with no build lock taken"):
        store.hold_lock(5.0)
    assert not store.locked


def test_a_state_error_is_never_a_fault(tmp_path: Path) -> None:
    """A refused call is the caller's bug: it must not be taken for a cache problem and sent to heap."""
    assert not issubclass(StoreStateError, Fault) and issubclass(StoreStateError, RuntimeError)
