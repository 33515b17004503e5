"""Every routing row that needs a real fault, made real: DESIGN.md "Routing" and "Rules that follow".

Faults come from the machine wherever it can make them: a 1 MiB tmpfs for
ENOSPC, ``RLIMIT_FSIZE`` for EFBIG, ``RLIMIT_AS`` for a failed mmap, a
read-only bind mount for EROFS, a real ``flock`` held by another process,
chmod/chown/symlinks for the trust check. Only EIO is mocked (see its test).
Anything that sets an rlimit runs in a child process that reports JSON.

Each test checks what the design promises for its row: the request ends in the
right outcome and reason, the errno is kept, the array served is bit-identical
to what ``pack()`` returns, the load never raises, exactly one ERROR record per
failing reason names the errno and the path, and the state says so.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

from harness import (
    KIB,
    MIB,
    Packer,
    Spec,
    assert_same,
    build,
    child_argv,
    error_records,
    file_state,
    fill,
    packed,
    read_only_bind,
    require_root,
    run_child,
    tmpfs,
)
from packcache import WeightCache


def load(cache: WeightCache, spec: Spec, packer: Packer) -> dict[str, np.ndarray[Any, Any]]:
    """One session requesting every pack of ``spec``; each served array must equal a fresh pack."""
    served = {}
    with cache.session() as s:
        for name, (seed, nbytes) in spec.items():
            served[name] = s.get_or_pack(name, packer(name, seed, nbytes))
    for name, (seed, nbytes) in spec.items():
        assert_same(served[name], packed(seed, nbytes))
    return served


def assert_one_error(records: list[logging.LogRecord], reason: str, errno_name: str | None, path: Path) -> None:
    """Exactly one ERROR record, for ``reason``, naming the errno and the cache path."""
    errors = error_records(records)
    assert len(errors) == 1, errors
    assert reason in errors[0], errors[0]
    if errno_name is not None:
        assert f"[{errno_name}]" in errors[0], errors[0]
    assert str(path) in errors[0], f"the ERROR record does not name the cache path {path}: {errors[0]}"


def entries_in(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# --------------------------------------------------------------------------- no_space: ENOSPC, EFBIG


@pytest.mark.root
def test_enospc_falls_back_to_heap_with_errno_and_commits_the_partial_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = tmp_path / "mnt"
    small: Spec = {f"small{i}": (i, 128 * KIB) for i in range(3)}
    big: Spec = {"big0": (10, 768 * KIB), "big1": (11, 768 * KIB)}  # 4 KiB header + 384 KiB stored + 768 KiB > 1 MiB
    late: Spec = {"late": (20, 64 * KIB)}  # still fits after the big ones failed
    with tmpfs(mnt, "1m"):
        path = mnt / "model.pcache"
        with WeightCache(path) as cache:
            served = load(cache, {**small, **big, **late}, Packer())
            st = cache.stats()
            del served
        assert st.stored == 4 and st.hits == 0 and st.heap_packs == 2
        assert st.heap_bytes_by_reason["no_space"] == st.heap_bytes == 2 * 768 * KIB
        assert st.mapped_bytes == 3 * 128 * KIB + 64 * KIB
        assert (st.state, st.heap_reason, st.errno) == ("degraded", "no_space", errno.ENOSPC)
        assert "ENOSPC" in st.error
        assert st.file_bytes == path.stat().st_size
        assert entries_in(mnt) == {"model.pcache", "model.pcache.lock"}, "a temp file was left behind"

        # The partial cache was committed: a new instance maps what fit, and writes nothing.
        before = file_state(path)
        packer = Packer()
        with WeightCache(path) as cache:
            load(cache, {**small, **late}, packer)
            st = cache.stats()
        assert packer.calls == {}
        assert (st.hits, st.stored, st.written_bytes, st.state) == (4, 0, 0, "mapped")
        assert file_state(path) == before
    assert_one_error(caplog.records, "no_space", "ENOSPC", path)


@pytest.mark.root
def test_no_space_miss_on_existing_cache_writes_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A miss that cannot be stored must leave the file alone: "the file grows only when packs are stored"."""
    mnt = tmp_path / "mnt"
    present: Spec = {"a": (0, 128 * KIB), "b": (1, 128 * KIB)}
    with tmpfs(mnt, "1m"):
        path = mnt / "model.pcache"
        build(path, present)
        fill(mnt, leave_free=96 * KIB)
        before = file_state(path)
        packer = Packer()
        with WeightCache(path) as cache:
            load(cache, {**present, "c": (2, 256 * KIB)}, packer)
            st = cache.stats()
        assert packer.calls == {"c": 1}
        assert (st.hits, st.stored, st.heap_bytes_by_reason["no_space"]) == (2, 0, 256 * KIB)
        assert (st.state, st.errno) == ("degraded", errno.ENOSPC)
        after = file_state(path)
        assert after[:3] == before[:3], "inode, size or mtime changed although nothing was stored"
        assert after == before
    assert_one_error(caplog.records, "no_space", "ENOSPC", path)


@pytest.mark.root
@pytest.mark.parametrize("room_for_header", [False, True], ids=["no-room-for-header", "no-room-for-pack"])
def test_failed_rebuild_on_full_disk_leaves_old_file_byte_identical(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, room_for_header: bool
) -> None:
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, "1m"):
        path = mnt / "model.pcache"
        path.write_bytes(np.random.default_rng(7).bytes(256 * KIB))  # corrupt: must be rebuilt
        fill(mnt, leave_free=64 * KIB if room_for_header else 0)
        before = file_state(path)
        with WeightCache(path) as cache:
            load(cache, {"c": (2, 128 * KIB)}, Packer())
            st = cache.stats()
        assert (st.stored, st.heap_bytes_by_reason["no_space"], st.errno) == (0, 128 * KIB, errno.ENOSPC)
        assert st.state == "heap"
        assert entries_in(mnt) == {"model.pcache", "model.pcache.lock", "filler"}, "a temp file was left behind"
        assert file_state(path) == before, "the failed rebuild replaced or changed the old file"
    assert_one_error(caplog.records, "no_space", "ENOSPC", path)


EFBIG_CHILD = """
path = sys.argv[1]
limit = 256 * 1024
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail with EFBIG
packs = [("small0", 0, 32768), ("small1", 1, 32768), ("big", 2, 512 * 1024), ("small2", 3, 32768)]
cache = packcache.WeightCache(path)
same = {}
with cache.session() as s:
    for name, seed, nbytes in packs:
        served = s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes))
        expected = packed(seed, nbytes)
        same[name] = served.dtype == expected.dtype and served.tobytes() == expected.tobytes()
stats = stats_dict(cache)
cache.close()
report(stats=stats, same=same)
"""


def test_efbig_from_rlimit_fsize_is_no_space_with_errno(tmp_path: Path) -> None:
    path = tmp_path / "model.pcache"
    result = run_child(EFBIG_CHILD, str(path))
    st = result["stats"]
    assert result["same"] == {"small0": True, "small1": True, "big": True, "small2": True}
    assert (st["stored"], st["heap_packs"], st["heap_bytes_by_reason"]["no_space"]) == (3, 1, 512 * KIB)
    assert (st["state"], st["heap_reason"], st["errno"]) == ("degraded", "no_space", errno.EFBIG)
    errors = [message for level, message in result["records"] if level == "ERROR"]
    assert len(errors) == 1, errors
    assert "no_space" in errors[0] and "[EFBIG]" in errors[0]
    # The stores under the limit were committed.
    packer = Packer()
    with WeightCache(path) as cache:
        load(cache, {"small0": (0, 32768), "small1": (1, 32768), "small2": (3, 32768)}, packer)
        assert (cache.stats().hits, packer.calls) == (3, {})
    assert str(path) in errors[0], f"the ERROR record does not name the cache path {path}: {errors[0]}"


# --------------------------------------------------------------------------- read_only: EROFS


@pytest.mark.root
def test_read_only_mount_maps_hits_and_sends_misses_to_heap_with_erofs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    present: Spec = {"a": (0, 16 * KIB), "b": (1, 16 * KIB)}
    build(src / "model.pcache", present)
    before, listing = file_state(src / "model.pcache"), entries_in(src)
    with read_only_bind(src, ro):
        path = ro / "model.pcache"
        packer = Packer()
        with WeightCache(path) as cache:
            served = load(cache, {**present, "c": (2, 16 * KIB), "d": (3, 16 * KIB)}, packer)
            st = cache.stats()
            assert not served["c"].flags.writeable
            del served
        assert packer.calls == {"c": 1, "d": 1}
        assert (st.hits, st.stored, st.mapped_bytes) == (2, 0, 32 * KIB)
        assert st.heap_bytes_by_reason["read_only"] == st.heap_bytes == 32 * KIB
        assert (st.state, st.heap_reason, st.errno, st.written_bytes) == ("degraded", "read_only", errno.EROFS, 0)
    assert file_state(src / "model.pcache") == before
    assert entries_in(src) == listing
    assert_one_error(caplog.records, "read_only", "EROFS", path)


# --------------------------------------------------------------------------- open_failed


def test_parent_is_a_regular_file_is_open_failed_enotdir(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    path = tmp_path / "file" / "model.pcache"
    with WeightCache(path) as cache:
        load(cache, {"a": (0, 4 * KIB), "b": (1, 4 * KIB)}, Packer())
        st = cache.stats()
    assert (st.heap_bytes_by_reason["open_failed"], st.heap_packs, st.stored, st.hits) == (8 * KIB, 2, 0, 0)
    assert (st.state, st.heap_reason, st.errno) == ("heap", "open_failed", errno.ENOTDIR)
    assert (tmp_path / "file").read_bytes() == b"not a directory"
    assert_one_error(caplog.records, "open_failed", "ENOTDIR", path)


def test_read_only_cache_with_missing_file_is_open_failed_enoent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "model.pcache"
    with WeightCache(path, read_only=True) as cache:
        load(cache, {"a": (0, 4 * KIB), "b": (1, 4 * KIB)}, Packer())
        st = cache.stats()
    assert (st.heap_bytes_by_reason["open_failed"], st.heap_packs) == (8 * KIB, 2)
    assert (st.state, st.heap_reason, st.errno) == ("heap", "open_failed", errno.ENOENT)
    assert entries_in(tmp_path) == set(), "a read-only cache created a file"
    assert_one_error(caplog.records, "open_failed", "ENOENT", path)


# --------------------------------------------------------------------------- locked

HOLD_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until the parent closes our stdin
"""


def _hold_lock(lock_path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "locked\n"
    return proc


def _release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(10) == 0


FIVE: Spec = {f"w{i}": (i, 8 * KIB) for i in range(5)}


def test_lock_held_by_another_process_is_locked_and_waits_once_per_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "model.pcache"
    with _hold_lock(Path(str(path) + ".lock")) as holder:
        try:
            with WeightCache(path, lock_timeout=0.5) as cache:
                timings = []
                with cache.session() as s:
                    for name, (seed, nbytes) in FIVE.items():
                        started = time.monotonic()
                        assert_same(s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes)),
                                    packed(seed, nbytes))  # fmt: skip
                        timings.append(time.monotonic() - started)
                st = cache.stats()
        finally:
            _release(holder)
    assert timings[0] >= 0.45, timings  # the first miss waited for the lock...
    assert sum(timings) < 1.5, timings  # ...the other four did not wait again (that would be >= 2.5 s)
    assert (st.heap_packs, st.stored, st.hits, st.heap_bytes_by_reason["locked"]) == (5, 0, 0, 40 * KIB)
    assert (st.state, st.heap_reason, st.errno) == ("heap", "locked", errno.EWOULDBLOCK)
    assert not path.exists()
    assert_one_error(caplog.records, "locked", errno.errorcode[errno.EWOULDBLOCK], path)

    # The lock is free again: a new session stores everything.
    with WeightCache(path, lock_timeout=0.5) as cache:
        load(cache, FIVE, Packer())
        st = cache.stats()
    assert (st.stored, st.heap_packs, st.state) == (5, 0, "stored")


def test_locked_cache_stores_in_its_next_session_once_the_lock_is_free(tmp_path: Path) -> None:
    """The same instance must heal: heap-because-locked is not a verdict for the cache's whole life."""
    path = tmp_path / "model.pcache"
    with WeightCache(path, lock_timeout=0.2) as cache:
        with _hold_lock(Path(str(path) + ".lock")) as holder:
            try:
                load(cache, FIVE, Packer())
            finally:
                _release(holder)
        assert cache.stats().heap_bytes_by_reason["locked"] == 40 * KIB
        packer = Packer()
        load(cache, FIVE, packer)
        st = cache.stats()
    assert (st.stored, st.mapped_bytes, st.heap_bytes, st.state) == (5, 40 * KIB, 0, "stored")
    assert path.exists()


BUILD_HOLDING_LOCK = """
cache = packcache.WeightCache(sys.argv[1], lock_timeout=5)
with cache.session() as s:
    s.get_or_pack("w0", lambda: packed(0, 8192))  # first miss: takes the build lock
    print("holding", flush=True)
    time.sleep(0.5)
    for i in range(1, 5):
        s.get_or_pack(f"w{i}", lambda i=i: packed(i, 8192))
stats = stats_dict(cache)
cache.close()
report(stats=stats)
"""


def test_waiting_process_maps_what_the_lock_holder_committed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "model.pcache"
    with subprocess.Popen(child_argv(BUILD_HOLDING_LOCK, str(path)), stdout=subprocess.PIPE, text=True) as builder:
        assert builder.stdout is not None
        assert builder.stdout.readline() == "holding\n"
        packer = Packer()
        started = time.monotonic()
        with WeightCache(path, lock_timeout=10) as cache:
            load(cache, FIVE, packer)
            st = cache.stats()
        waited = time.monotonic() - started
        tail = builder.stdout.read()
    assert builder.returncode == 0
    assert json.loads(tail.strip().splitlines()[-1])["stats"]["stored"] == 5
    assert waited >= 0.25, waited
    assert packer.calls == {}, "the waiting process packed instead of mapping the holder's commit"
    assert (st.hits, st.stored, st.written_bytes, st.heap_bytes, st.state) == (5, 0, 0, 0, "mapped")
    assert error_records(caplog.records) == []


# --------------------------------------------------------------------------- map_failed: RLIMIT_AS

MAP_FAILED_CHILD = """
path = sys.argv[1]
with open("/proc/self/status") as f:
    vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
limit = vm_size + 16 * 1024 * 1024  # room to pack small arrays, not to map a 64 MiB file
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cache = packcache.WeightCache(path)
same = {}
with cache.session() as s:
    for name, seed in (("small0", 0), ("small1", 1)):
        served = s.get_or_pack(name, lambda seed=seed: packed(seed, 4096))
        same[name] = served.dtype == packed(seed, 4096).dtype and served.tobytes() == packed(seed, 4096).tobytes()
stats = stats_dict(cache)
cache.close()
report(stats=stats, same=same)
"""


def test_mmap_enomem_from_rlimit_as_is_map_failed_with_errno(tmp_path: Path) -> None:
    path = tmp_path / "model.pcache"
    with WeightCache(path) as cache:
        with cache.session() as s:
            s.get_or_pack("big", lambda: np.full(64 * MIB, 7, np.uint8))
            s.get_or_pack("small0", lambda: packed(0, 4 * KIB))
            s.get_or_pack("small1", lambda: packed(1, 4 * KIB))
        assert cache.stats().stored == 3
    before = file_state(path)
    result = run_child(MAP_FAILED_CHILD, str(path))
    st = result["stats"]
    assert result["same"] == {"small0": True, "small1": True}
    assert (st["hits"], st["stored"], st["heap_packs"], st["mapped_bytes"]) == (0, 0, 2, 0)
    assert st["heap_bytes_by_reason"]["map_failed"] == 8 * KIB
    assert (st["state"], st["heap_reason"], st["errno"]) == ("heap", "map_failed", errno.ENOMEM)
    errors = [message for level, message in result["records"] if level == "ERROR"]
    assert len(errors) == 1, errors
    assert "map_failed" in errors[0] and "[ENOMEM]" in errors[0] and str(path) in errors[0]
    assert file_state(path)[:3] == before[:3]


# --------------------------------------------------------------------------- write_failed: EIO (mocked)


def _eio(*args: object) -> None:
    raise OSError(errno.EIO, "Input/output error")


def test_commit_eio_is_write_failed_and_keeps_previous_generation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """EIO at commit: recorded with errno and an ERROR; the previous generation stays readable.

    This is the one mock in this file. The kernel here has no dm-error or
    dm-flakey target and no faulty block device; the only real EIO it can make
    (ext4 on a loop device shrunk under it) fails wherever ext4 happens to
    place the next block, which is neither the commit step nor deterministic.
    So ``os.fdatasync`` (the store calls it as ``os.fdatasync``, and only while
    committing) raises EIO.
    """
    path = tmp_path / "model.pcache"
    present: Spec = {"a": (0, 16 * KIB), "b": (1, 16 * KIB)}
    build(path, present)
    before = file_state(path)
    with mock.patch("os.fdatasync", side_effect=_eio) as fdatasync, WeightCache(path) as cache:
        load(cache, {"a": present["a"], "c": (2, 16 * KIB)}, Packer())  # served arrays checked inside
        st = cache.stats()
    assert fdatasync.called
    assert (st.hits, st.stored) == (1, 1)
    assert st.errno == errno.EIO
    assert "EIO" in st.error and str(path) in st.error
    assert_one_error(caplog.records, "write_failed", "EIO", path)

    # The previous generation is intact: same file, same header and commit slots, a and b still hit.
    after = file_state(path)
    assert after[0] == before[0]
    assert after[3][:4096] == before[3][:4096]
    packer = Packer()
    with WeightCache(path, read_only=True) as reader:
        load(reader, {**present, "c": (2, 16 * KIB)}, packer)
        assert reader.stats().hits == 2
    assert packer.calls == {"c": 1}, "the failed commit's entry became visible"


def test_failed_commit_keeps_served_array_intact_when_the_next_writer_appends(tmp_path: Path) -> None:
    """Arrays served by a session whose commit failed map bytes past the committed end.

    The process that served them is still running; the next writer (here a
    second instance, as another process would) must not overwrite those bytes:
    "Never ... overwrite bytes that another process may have mapped". EIO is
    mocked as in the test above.
    """
    path = tmp_path / "model.pcache"
    build(path, {"a": (0, 16 * KIB)})
    with WeightCache(path) as failing:
        with mock.patch("os.fdatasync", side_effect=_eio):
            c = load(failing, {"c": (2, 64 * KIB)}, Packer())["c"]
        assert failing.stats().errno == errno.EIO
        with WeightCache(path) as writer:
            load(writer, {"d": (3, 64 * KIB)}, Packer())
            assert writer.stats().stored == 1
        assert_same(c, packed(2, 64 * KIB))


# --------------------------------------------------------------------------- untrusted


def _world_writable(path: Path, elsewhere: Path) -> Path:
    os.chmod(path, 0o666)
    return path


def _foreign_owner(path: Path, elsewhere: Path) -> Path:
    require_root()
    os.chown(path, 12345, -1)
    return path


def _symlink_in_open_dir(path: Path, elsewhere: Path) -> Path:
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o777)  # world-writable, no sticky bit: anyone could swap the link
    link = elsewhere / "model.pcache"
    link.symlink_to(path)
    return link


@pytest.mark.parametrize(
    "make_untrusted", [_world_writable, pytest.param(_foreign_owner, marks=pytest.mark.root), _symlink_in_open_dir]
)
def test_untrusted_file_sends_every_request_to_heap_and_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_untrusted: Any
) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "model.pcache"
    present: Spec = {"a": (0, 8 * KIB), "b": (1, 8 * KIB)}
    build(target, present)
    path = make_untrusted(target, tmp_path / "open")
    before, listings = file_state(target), (entries_in(target.parent), entries_in(path.parent))
    packer = Packer()
    with WeightCache(path) as cache:
        load(cache, {**present, "c": (2, 8 * KIB)}, packer)
        st = cache.stats()
    assert packer.calls == {"a": 1, "b": 1, "c": 1}, "an untrusted file's bytes were served"
    assert (st.hits, st.stored, st.mapped_bytes, st.heap_bytes_by_reason["untrusted"]) == (0, 0, 0, 24 * KIB)
    assert (st.state, st.heap_reason, st.written_bytes) == ("heap", "untrusted", 0)
    assert "untrusted" in st.error and str(path) in st.error
    assert file_state(target) == before
    assert (entries_in(target.parent), entries_in(path.parent)) == listings, "the cache created files"
    assert_one_error(caplog.records, "untrusted", None, path)


def test_symlink_in_sticky_world_writable_dir_is_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "model.pcache"
    present: Spec = {"a": (0, 8 * KIB), "b": (1, 8 * KIB)}
    build(target, present)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: others cannot replace our link
    (shared / "model.pcache").symlink_to(target)
    packer = Packer()
    with WeightCache(shared / "model.pcache") as cache:
        load(cache, present, packer)
        st = cache.stats()
    assert packer.calls == {}
    assert (st.hits, st.heap_bytes, st.state) == (2, 0, "mapped")
    assert error_records(caplog.records) == []


# --------------------------------------------------------------------------- rebuilds


def _garbage(path: Path, platform: dict[str, str]) -> None:
    path.write_bytes(np.random.default_rng(3).bytes(20 * KIB))


def _truncated(path: Path, platform: dict[str, str]) -> None:
    build(path, {"a": (0, 8 * KIB), "b": (1, 8 * KIB), "c": (2, 8 * KIB)}, platform=platform)
    os.truncate(path, path.stat().st_size // 2)  # setup only: no one has it mapped


def _other_platform(path: Path, platform: dict[str, str]) -> None:
    build(path, {"a": (0, 8 * KIB), "b": (1, 8 * KIB), "c": (2, 8 * KIB)}, platform={"cpu": "avx2"})


@pytest.mark.parametrize("make_invalid", [_garbage, _truncated, _other_platform])
def test_invalid_file_is_rebuilt_as_a_new_file_and_old_mappings_stay_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_invalid: Any
) -> None:
    path = tmp_path / "model.pcache"
    platform = {"cpu": "avx512"}
    spec: Spec = {"a": (0, 8 * KIB), "b": (1, 8 * KIB), "c": (2, 8 * KIB)}
    make_invalid(path, platform)
    old_inode, _, _, old_bytes = file_state(path)
    with open(path, "rb") as f:
        old_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        packer = Packer()
        with WeightCache(path, platform=platform) as cache:
            load(cache, spec, packer)
            st = cache.stats()
        assert packer.calls == {"a": 1, "b": 1, "c": 1}
        assert (st.stored, st.hits, st.heap_bytes, st.state) == (3, 0, 0, "stored")
        assert path.stat().st_ino != old_inode, "the file was rewritten in place, not replaced"
        assert old_map[:] == old_bytes, "bytes an old mapping sees changed"
    finally:
        old_map.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert entries_in(tmp_path) == {"model.pcache", "model.pcache.lock"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "packcache"]
    assert len(warnings) == 1 and "rebuilt" in warnings[0] and str(path) in warnings[0], warnings
    assert error_records(caplog.records) == []

    packer = Packer()
    with WeightCache(path, platform=platform) as cache:
        load(cache, spec, packer)
        st = cache.stats()
    assert packer.calls == {}
    assert (st.hits, st.stored, st.written_bytes, st.state) == (3, 0, 0, "mapped")


# --------------------------------------------------------------------------- file and directory modes

MODES_CHILD = """
os.umask(int(sys.argv[2], 8))
cache = packcache.WeightCache(sys.argv[1])
with cache.session() as s:
    s.get_or_pack("w", lambda: packed(0, 4096))
stats = stats_dict(cache)
cache.close()
report(stats=stats)
"""


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.lstat(path).st_mode))


UMASKS = pytest.mark.parametrize("umask", ["000", "022", "277"])


@UMASKS
def test_new_cache_file_and_lock_file_are_0600_regardless_of_umask(tmp_path: Path, umask: str) -> None:
    path = tmp_path / "model.pcache"
    assert run_child(MODES_CHILD, str(path), umask)["stats"]["stored"] == 1
    assert {"file": _mode(path), "lock": _mode(Path(str(path) + ".lock"))} == {"file": "0o600", "lock": "0o600"}


@UMASKS
def test_created_cache_directory_is_0700_regardless_of_umask(tmp_path: Path, umask: str) -> None:
    path = tmp_path / "cache" / "model.pcache"
    assert run_child(MODES_CHILD, str(path), umask)["stats"]["stored"] == 1
    assert (_mode(path.parent), _mode(path)) == ("0o700", "0o600")


def test_created_parent_directories_are_0700_too(tmp_path: Path) -> None:
    """With umask 0, every directory the cache creates must still be 0700, not world-writable 0777."""
    path = tmp_path / "a" / "b" / "model.pcache"
    assert run_child(MODES_CHILD, str(path), "000")["stats"]["stored"] == 1
    assert {"a": _mode(tmp_path / "a"), "b": _mode(tmp_path / "a" / "b")} == {"a": "0o700", "b": "0o700"}
