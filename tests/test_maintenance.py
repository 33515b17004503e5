"""Verification (on demand and on hit), compaction, inspection and gc (``packcache.maintenance``).

The entry points under attack: every one opens paths the way WeightCache does (packcache._paths):
never blocking on a FIFO, never following a symlink swapped in, checking what was opened; and every writer
or deleter takes the one build lock of the file's resolved path. Each of those tests reproduces an attack
the reporter ran on this machine (as root, with the real user ``nobody`` on the other side): real FIFOs,
symlinks, hard links, ``chown`` to a service uid, live builders in other processes. Anything that could
hang runs in a subprocess with a timeout, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import packcache
from harness import KIB, Spec, build, child_argv, file_state, flip_bit, packed, without_build_compaction
from harness.driver import FOREIGN_UID, NOBODY, Env, check_load, loaded, run_cli
from harness.entry_faults import superseded
from packcache import WeightCache, compact, maintenance, verify
from packcache import format as fmt
from packcache._generations import read_committed
from packcache._sidefiles import lock_path_for, pid_alive
from packcache.cli import main
from packcache.errors import LockTimeoutError, UntrustedFileError


def arrays(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(1000 + 357 * i).astype(np.float32) for i in range(5)}


def entries_of(path: Path) -> dict[str, fmt.Entry]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_committed(fd)[2]
    finally:
        os.close(fd)


def test_verify_passes_on_a_healthy_cache(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, packs)
    report = packcache.verify(path)
    assert report.ok and report.entries == 5 and report.generation == 1
    assert report.checked_bytes == sum(a.nbytes for a in packs.values())


def test_flipped_bit_anywhere_in_pack_data_is_found_and_named(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build(path, arrays())
    rng = np.random.default_rng(1)
    pristine = tmp_path / "pristine"
    shutil.copyfile(path, pristine)
    for entry in entries_of(path).values():
        for position in (0, entry.nbytes - 1, *rng.integers(0, entry.nbytes, 3)):
            shutil.copyfile(pristine, path)
            flip_bit(path, entry.offset + int(position), int(rng.integers(0, 8)))
            report = packcache.verify(path)
            assert [(p.entry, p.offset) for p in report.problems] == [(entry.name, entry.offset)], position
            assert f"entry {entry.name!r} at offset {entry.offset}" in str(report.problems[0])


def test_verify_reports_a_broken_newest_generation_that_readers_skip(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, dict(list(packs.items())[:2]))
    build(path, packs)  # generation 2 appends three packs and a new index
    fd = os.open(path, os.O_RDONLY)
    slot = fmt.choose_slot(os.pread(fd, 4096, 0))[0][0]
    os.close(fd)
    assert slot.generation == 2
    flip_bit(path, slot.index_offset + 20)
    report = packcache.verify(path)
    assert report.generation == 1 and not report.ok
    assert report.problems[0].entry is None and "generation 2 unusable" in report.problems[0].message


def test_verify_reports_structure_errors_of_a_hostile_file(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    path.write_bytes(b"\x89PKC\r\n\x1a\n" + bytes(5000))
    report = packcache.verify(path)
    assert not report.ok and report.problems[0].entry is None and "checksum" in report.problems[0].message


def test_verify_on_hit_packs_a_corrupt_entry_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, packs)
    victim = entries_of(path)["w2"]
    flip_bit(path, victim.offset + 5)
    with WeightCache(path) as cache:  # without verification the flip goes unseen: that is the trade-off
        with cache.session() as s:
            unseen = s.get_or_pack("w2", lambda: packs["w2"])
        assert not np.array_equal(unseen, packs["w2"])
    caplog.set_level(logging.ERROR, logger="packcache")
    with WeightCache(path, verify=True) as cache:
        with cache.session() as s:
            served = {n: s.get_or_pack(n, lambda a=a: a) for n, a in packs.items()}
        st = cache.stats()
    assert all(np.array_equal(served[n], a) for n, a in packs.items())
    assert (st.hits, st.stored, st.state) == (4, 1, "stored")
    assert any("'w2'" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    assert packcache.verify(path).ok, "the repacked entry replaced the corrupt one"


def test_compact_reclaims_superseded_bytes_and_keeps_live_packs_identical(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    with without_build_compaction():  # as packcache left files before builds compacted
        for version in range(4):  # each version supersedes every pack: the file grows
            packs = {n: a + version for n, a in arrays().items()}
            build(path, packs, key={"version": version})
    grown = path.stat().st_size
    live = sum(a.nbytes for a in packs.values())
    with WeightCache(path) as cache, cache.session() as s:  # a reader holding views of the old file
        held = {n: s.get_or_pack(n, lambda n=n: packs[n], key={"version": 3}) for n in packs}
    inode = path.stat().st_ino
    report = packcache.compact(path)
    assert report.entries == 5 and report.dropped == () and report.bytes_before == grown
    assert path.stat().st_ino != inode and path.stat().st_size == report.bytes_after
    assert report.bytes_after < grown / 3 and report.bytes_after < live + 4096 + 5 * 64 + 1024 + 64 * 5
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert all(np.array_equal(held[n], a) for n, a in packs.items()), "old mappings stay valid"
    assert packcache.verify(path).ok
    with WeightCache(path) as cache:
        with cache.session() as s:
            again = {n: s.get_or_pack(n, lambda: pytest.fail("hit expected"), key={"version": 3}) for n in packs}
        assert (cache.stats().hits, cache.stats().written_bytes) == (5, 0)
    assert all(np.array_equal(again[n], a) for n, a in packs.items())


def test_compact_drops_packs_that_fail_their_checksum(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    packs = arrays()
    build(path, packs)
    flip_bit(path, entries_of(path)["w1"].offset)
    report = packcache.compact(path)
    assert report.dropped == ("w1",) and report.entries == 4
    assert set(entries_of(path)) == set(packs) - {"w1"} and packcache.verify(path).ok


def test_compact_waits_for_the_build_lock_and_gives_up_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build(path, arrays())
    before = path.read_bytes()
    holder = os.open(str(path) + ".lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(TimeoutError, match="build lock"):
            packcache.compact(path, lock_timeout=0.1)
    finally:
        os.close(holder)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pcache", "m.pcache.lock"]


def test_compact_of_an_invalid_file_raises_format_error_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    path.write_bytes(bytes(8192))
    with pytest.raises(packcache.FormatError, match="magic"):
        packcache.compact(path)
    assert path.read_bytes() == bytes(8192)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pcache", "m.pcache.lock"]


# -------------------------------------------------------------------- the entry points under attack: helpers


AB: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB)}
HANG = 30.0  # seconds: far more than any of these takes; reaching it means something blocked


def nobody_loads(env: Env, path: Path, spec: Spec, *, hits: int, stored: int) -> list[str]:
    """``nobody`` loads ``spec`` from ``path`` in a child (which must not die): what check_load finds wrong."""
    return check_load(loaded(env, path, spec, user="nobody"), path, hits=hits, stored=stored)


def in_nobodys_directory(env: Env, name: str) -> Path:
    """``model.pcache`` (not created) in a fresh case directory owned by ``nobody``."""
    d = env.case_dir(name)
    os.chown(d, NOBODY, NOBODY)
    return d / "model.pcache"


def cli(*argv: str, timeout: float = HANG) -> subprocess.CompletedProcess[str]:
    """``python -m packcache ARGV`` as root in a fresh process, bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "packcache", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


HOLD_LOCK = """
import fcntl
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()  # held until the parent closes our stdin
"""


@contextlib.contextmanager
def lock_held_by_another_process(lock_path: str) -> Iterator[None]:
    """A real second process holds an exclusive flock on ``lock_path`` for the duration."""
    with subprocess.Popen(child_argv(HOLD_LOCK, lock_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as holder:  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert holder.stdout.readline() == "locked\n"
            yield
        finally:
            holder.stdin.close()
            holder.wait(HANG)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def write_cache(path: Path, key: bytes = b"{}", platform: bytes = b"{}", generation: int = 1) -> None:
    """A valid one-pack cache built byte by byte: keys and fingerprints no WeightCache would write."""
    data = np.arange(16, dtype=np.float32)
    header = fmt.encode_header(64, platform)
    entry = fmt.Entry("w", key, fmt.key_digest("w", key), "f4", (16,), len(header), data.nbytes,
                      zlib.crc32(data.tobytes()))  # fmt: skip
    index_at = fmt.align_up(len(header) + data.nbytes, 64)
    index = fmt.encode_index([entry])
    slot = fmt.Slot(generation, index_at, len(index), 1, zlib.crc32(index))
    body = bytearray(header) + data.tobytes()
    body += bytes(index_at - len(body)) + index
    at = fmt.slot_offset(generation % 2)
    body[at : at + 64] = fmt.encode_slot(slot)
    path.write_bytes(bytes(body))
    os.chmod(path, 0o600)


# ----------------------------------------------------------------- trust in every entry point


@pytest.mark.root
def test_compact_refuses_a_file_planted_by_another_user(tmp_path: Path) -> None:
    """Root's cache refuses a file owned by nobody; compact used to rewrite it as root's own file."""
    path = tmp_path / "model.pcache"
    superseded(path, AB)
    os.chown(path, NOBODY, NOBODY)
    before = file_state(path)
    with pytest.raises(UntrustedFileError, match="owned by uid 65534"):
        compact(path)
    assert file_state(path) == before and os.stat(path).st_uid == NOBODY
    assert names(tmp_path) == ["model.pcache", "model.pcache.lock"], "no temp file, no new lock file"
    with WeightCache(path) as cache:  # and the cache still refuses it: nothing was laundered
        with cache.session() as s:
            s.get_or_pack("a", lambda: packed(*AB["a"]))
        assert cache.stats().heap_bytes_by_reason["untrusted"] == 16 * KIB


@pytest.mark.parametrize("attack", ["group-writable", "world-writable", "symlink-in-open-dir"])
def test_compact_refuses_what_the_cache_refuses_and_writes_nothing(tmp_path: Path, attack: str) -> None:
    real = tmp_path / "real" / "model.pcache"
    real.parent.mkdir()
    superseded(real, AB)
    path = real
    if attack == "group-writable":
        os.chmod(real, 0o620)
    elif attack == "world-writable":
        os.chmod(real, 0o602)
    else:
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)  # anyone may swap the link: WeightCache refuses it
        path = shared / "model.pcache"
        path.symlink_to(real)
    before = file_state(real)
    with pytest.raises(UntrustedFileError):
        compact(path)
    assert file_state(real) == before
    assert all(".tmp-" not in n for n in names(real.parent)) and names(tmp_path / "real") == sorted(
        ["model.pcache", "model.pcache.lock"]
    )


@pytest.mark.root
def test_every_entry_point_reports_a_foreign_file_as_untrusted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify never says ok, inspect shows the verdict, compact refuses, gc leaves it: one rule everywhere."""
    path = tmp_path / "model.pcache"
    build(path, AB)
    os.chown(path, NOBODY, NOBODY)
    before = file_state(path)
    report = verify(path)
    assert not report.ok and report.trust_problem is not None and "owned by uid 65534" in report.trust_problem
    assert report.checked_bytes == 32 * KIB, "a read-only check of the bytes still runs"
    assert maintenance.inspect(path).trust_problem == report.trust_problem
    assert main(["verify", str(path)]) == 1
    assert "FAILED: structure at offset 0: untrusted: owned by uid 65534" in capsys.readouterr().out
    assert main(["inspect", str(path)]) == 0
    assert "UNTRUSTED: owned by uid 65534" in capsys.readouterr().out
    assert main(["compact", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "untrusted cache file" in err and "Traceback" not in err
    assert main(["gc", str(tmp_path), "--max-bytes", "0"]) == 1
    assert "owned by uid 65534" in capsys.readouterr().out
    assert file_state(path) == before


@pytest.mark.root
def test_nobody_compacts_its_own_cache_but_not_another_users(env: Env) -> None:
    """As the real second user: its own file is compacted and stays its own; a foreign one is refused."""
    d = env.case_dir("nobody-compact")
    os.chown(d, NOBODY, NOBODY)
    mine, theirs = d / "mine.pcache", d / "theirs.pcache"
    for path in (mine, theirs):
        superseded(path, AB)
        os.chmod(path, 0o640)
    for owned in (mine, Path(f"{mine}.lock")):
        os.chown(owned, NOBODY, NOBODY)
    os.chown(theirs, FOREIGN_UID, FOREIGN_UID)
    os.chmod(theirs, 0o644)  # readable by nobody: what stops compact must be the trust check
    before = file_state(theirs)
    done = run_cli(env, "compact", str(mine), "--json", user="nobody")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reclaimed_bytes"] > 0
    st = os.stat(mine)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o640)
    refused = run_cli(env, "compact", str(theirs), user="nobody")
    assert refused.returncode == 1 and "owned by uid 12345" in refused.stderr and "Traceback" not in refused.stderr
    assert file_state(theirs) == before
    assert nobody_loads(env, mine, {}, hits=0, stored=0) == []


@pytest.mark.root
def test_compact_as_root_leaves_a_service_users_cache_loadable_by_the_service(env: Env) -> None:
    """The reporter's case: compact as root on nobody's cache used to leave a root-owned file nobody could open."""
    path = in_nobodys_directory(env, "service-owned")
    assert nobody_loads(env, path, AB, hits=0, stored=2) == []
    before = file_state(path)
    with pytest.raises(UntrustedFileError, match="owned by uid 65534"):
        compact(path)  # root refuses it as WeightCache does: compact it as nobody instead
    assert file_state(path) == before
    assert nobody_loads(env, path, AB, hits=2, stored=0) == []
    done = run_cli(env, "compact", str(path), user="nobody")
    assert done.returncode == 0, done.stderr
    assert os.stat(path).st_uid == NOBODY
    assert nobody_loads(env, path, AB, hits=2, stored=0) == []


# ------------------------------------------------------------ compact works on the file the path resolves to


def test_compact_keeps_mode_bits_and_a_symlinked_path_stays_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real" / "model.pcache"
    real.parent.mkdir()
    superseded(real, AB)
    os.chmod(real, 0o640)
    link = tmp_path / "link.pcache"
    link.symlink_to(real)
    inode = os.stat(real).st_ino
    report = compact(link)
    assert report.reclaimed_bytes > 0
    assert link.is_symlink() and os.readlink(link) == str(real), "the link was replaced by a regular file"
    assert os.stat(real).st_ino != inode and stat.S_IMODE(os.stat(real).st_mode) == 0o640
    assert names(tmp_path) == ["link.pcache", "real"], "the temp and the lock live beside the real file"
    assert names(real.parent) == ["model.pcache", "model.pcache.lock"]
    assert verify(link).ok


def test_compact_through_a_symlink_waits_for_the_lock_a_builder_holds_on_the_real_file(tmp_path: Path) -> None:
    """One lock per file: the builder locks <real>.lock; compact through a link must meet that lock."""
    real = tmp_path / "real" / "model.pcache"
    real.parent.mkdir()
    superseded(real, AB)
    link = tmp_path / "link.pcache"
    link.symlink_to(real)
    with lock_held_by_another_process(lock_path_for(str(real))):
        before = file_state(real)
        with pytest.raises(LockTimeoutError, match="build lock") as raised:
            compact(link, lock_timeout=0.2)
        assert isinstance(raised.value, TimeoutError)
        assert file_state(real) == before
        assert main(["compact", str(link), "--lock-timeout", "0.1"]) == 1
    assert compact(link).reclaimed_bytes > 0


# --------------------------------------------------------------------------- FIFOs


def test_verify_and_compact_never_block_the_build_lock_on_a_fifo(tmp_path: Path) -> None:
    """The reporter's worst case: compact held the build lock while blocked, so every builder went to 'locked'."""
    path = tmp_path / "model.pcache"
    os.mkfifo(path)
    code = (
        "import packcache\n"
        "try:\n    packcache.compact(sys.argv[1])\nexcept packcache.UntrustedFileError as e:\n    print('refused', e)\n"
        "print('verify', packcache.verify(sys.argv[1]).problems[0].message)\n"
    )
    done = subprocess.run(child_argv(code, str(path)), capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    assert (
        "refused untrusted cache file" in done.stdout and "verify untrusted: not a regular file (a FIFO)" in done.stdout
    )
    with WeightCache(tmp_path / "other.pcache", lock_timeout=0) as cache, cache.session() as s:
        s.get_or_pack("w", lambda: packed(0))  # a builder next door is not stuck behind anything
        assert cache.stats().stored == 1


def test_gc_does_not_hang_on_a_fifo_planted_at_a_lock_path(tmp_path: Path) -> None:
    path = tmp_path / "model.pcache"
    build(path, AB)
    Path(f"{path}.lock").unlink()
    os.mkfifo(f"{path}.lock")
    done = cli("gc", str(tmp_path), "--max-bytes", "0", "--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["removed"] == [] and "not a regular file (a FIFO)" in report["kept"][0]["reason"]
    assert path.exists() and stat.S_ISFIFO(os.lstat(f"{path}.lock").st_mode), "the FIFO is not ours to remove"


# ---------------------------------------------------------------------- gc deletes only what is ours


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped), and that no new process has taken since."""
    while True:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        if not pid_alive(proc.pid):
            return proc.pid


def test_gc_keeps_a_users_file_named_like_a_temp_file(tmp_path: Path) -> None:
    build(tmp_path / "m.pcache", AB)
    pid = dead_pid()
    planted = [
        ".notes.tmp-draft",
        ".m.pcache.tmp-draft",
        f".m.pcache.tmp-{pid}-0123",
        f".m.pcache.tmp-{pid}-ABCDEF0123456789",
    ]
    for name in planted:
        (tmp_path / name).write_text("a user's own words")
    orphan = tmp_path / f".m.pcache.tmp-{pid}-0123456789abcdef"
    orphan.write_bytes(b"partial build")
    assert main(["gc", str(tmp_path), "--max-bytes", str(10**9)]) == 0
    assert not orphan.exists(), "a dead builder's temp file is stale"
    for name in planted:
        assert (tmp_path / name).read_text() == "a user's own words", name


def test_gc_keeps_a_live_builders_temp_file(tmp_path: Path) -> None:
    """A builder mid-build (temp file written, build lock held) in another process: gc must not touch it."""
    path = tmp_path / "m.pcache"
    code = (
        "cache = packcache.WeightCache(sys.argv[1])\n"
        "with cache.session() as s:\n"
        "    s.get_or_pack('a', lambda: packed(1))\n"
        "    print('building', flush=True)\n"
        "    sys.stdin.readline()\n"
        "    s.get_or_pack('b', lambda: packed(2))\n"
        "report(**stats_dict(cache))\n"
    )
    with subprocess.Popen(child_argv(code, str(path)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as builder:  # fmt: skip
        assert builder.stdin is not None and builder.stdout is not None
        try:
            assert builder.stdout.readline() == "building\n"
            temps = [n for n in names(tmp_path) if ".tmp-" in n]
            assert len(temps) == 1 and not path.exists()
            assert main(["gc", str(tmp_path), "--max-bytes", "0"]) == 1  # over budget: the temp cannot go
            assert [n for n in names(tmp_path) if ".tmp-" in n] == temps
            builder.stdin.write("go\n")
            builder.stdin.close()
            out = builder.stdout.read()
            assert builder.wait(HANG) == 0
        finally:
            if builder.poll() is None:
                builder.kill()
    stats = json.loads(out.strip().splitlines()[-1])
    assert (stats["state"], stats["stored"], stats["errno"], stats["heap_bytes"]) == ("stored", 2, 0, 0), stats
    assert verify(path).ok and verify(path).entries == 2


def test_gc_keeps_a_dead_builders_temp_while_another_process_holds_the_caches_lock(tmp_path: Path) -> None:
    path = tmp_path / "m.pcache"
    build(path, AB)
    orphan = tmp_path / f".m.pcache.tmp-{dead_pid()}-0123456789abcdef"
    orphan.write_bytes(b"partial")
    with lock_held_by_another_process(f"{path}.lock"):
        report = maintenance.gc(tmp_path, 0)
    assert report.removed == () and orphan.exists() and path.exists()
    assert {Path(k.path).name for k in report.kept} == {orphan.name, "m.pcache"}
    assert all("holds the build lock" in k.reason for k in report.kept)
    assert {Path(f.path).name for f in maintenance.gc(tmp_path, 0).removed} == {orphan.name, "m.pcache"}


@pytest.mark.root
def test_gc_as_root_leaves_a_service_users_cache_and_temp_alone(tmp_path: Path) -> None:
    build(tmp_path / "svc.pcache", AB)
    build(tmp_path / "mine.pcache", AB)
    orphan = tmp_path / f".svc.pcache.tmp-{dead_pid()}-0123456789abcdef"
    orphan.write_bytes(b"partial")
    for owned in (tmp_path / "svc.pcache", tmp_path / "svc.pcache.lock", orphan):
        os.chown(owned, NOBODY, NOBODY)
    report = maintenance.gc(tmp_path, 0)
    assert [Path(f.path).name for f in report.removed] == ["mine.pcache"]
    assert {Path(k.path).name: k.reason for k in report.kept} == {
        "svc.pcache": "owned by uid 65534: gc removes only files of its own user (0)",
        orphan.name: "owned by uid 65534: gc removes only files of its own user (0)",
    }
    assert not report.fits and orphan.exists() and (tmp_path / "svc.pcache").exists()


def test_gc_never_follows_or_removes_symlinks_and_leaves_hard_links_alone(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    build(elsewhere / "precious.pcache", AB)
    d = tmp_path / "cache"
    d.mkdir()
    (d / "link.pcache").symlink_to(elsewhere / "precious.pcache")
    (d / f".precious.pcache.tmp-{dead_pid()}-0123456789abcdef").symlink_to(elsewhere / "precious.pcache")
    os.link(elsewhere / "precious.pcache", d / "twin.pcache")
    before = file_state(elsewhere / "precious.pcache")
    report = maintenance.gc(d, 0)
    assert report.removed == ()
    assert [(Path(k.path).name, k.reason) for k in report.kept] == [
        ("twin.pcache", "it has 2 hard links: removing one name frees nothing")
    ]
    assert len(os.listdir(d)) == 3 and file_state(elsewhere / "precious.pcache") == before


def test_gc_removes_stale_then_least_recently_used_and_counts_each_inode_once(tmp_path: Path) -> None:
    for i, name in enumerate(["old", "mid", "new"]):
        build(tmp_path / f"{name}.pcache", AB)
        os.utime(tmp_path / f"{name}.pcache", (1000 * (i + 1), 1000 * (i + 1)))
    (tmp_path / "corrupt.pcache").write_bytes(fmt.MAGIC + bytes(5000))
    (tmp_path / "notes.txt").write_text("not a cache file")
    size = (tmp_path / "old.pcache").stat().st_size
    dry = maintenance.gc(tmp_path, 2 * size, dry_run=True)
    assert [Path(f.path).name for f in dry.removed] == ["corrupt.pcache", "old.pcache"] and dry.fits
    assert len(os.listdir(tmp_path)) == 8, "a dry run removes nothing (and creates no lock file)"
    report = maintenance.gc(tmp_path, 2 * size)
    assert report.removed == dry.removed and report.bytes_before == 3 * size + 5008
    assert report.bytes_after == 2 * size and report.fits
    assert names(tmp_path) == sorted(
        ["corrupt.pcache.lock", "mid.pcache", "mid.pcache.lock", "new.pcache", "new.pcache.lock", "notes.txt",
         "old.pcache.lock"]
    ), "lock files are never removed"  # fmt: skip


# ------------------------------------------------------------------------ inspect on any valid file


DEEP = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize(
    ("key", "platform"),
    [
        (DEEP, b"{}"),
        (b'{"packer":' + b"[" * 2000 + b"]" * 2000 + b',"version":1}', b"{}"),
        (b'{"packer":"x","version":' + b"9" * 5000 + b"}", b"{}"),
        (b"{}", b"[" * 992 + b"]" * 992),
        (b"{}", b'{"cpu":"\xff\xfe"}'),
        (b"\xff\x00not json", b'{"n":' + b"1" * 1900 + b"}"),
    ],
    ids=["deep-key", "deep-packer", "huge-int-key", "deep-platform", "non-utf8-platform", "garbage-key-huge-int"],
)
def test_inspect_shows_placeholders_for_hostile_keys_and_platforms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: bytes, platform: bytes
) -> None:
    path = tmp_path / "model.pcache"
    write_cache(path, key=key, platform=platform)
    assert verify(path).ok, "a valid file: the format does not parse keys"
    for argv in (["inspect", str(path)], ["inspect", str(path), "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and len(out) < 20_000
    info = json.loads(out)
    assert info["entries"][0]["name"] == "w" and info["entries"][0]["shape"] == [16]
    if key != b"{}":
        assert info["entries"][0]["packer"] in ("?", "")
    if platform != b"{}":
        assert isinstance(info["platform"], str) and info["platform"].startswith("<")


def test_write_cache_builds_what_the_reader_accepts(tmp_path: Path) -> None:
    """The byte-by-byte builder above writes what the format's reader accepts (or those tests prove nothing)."""
    path = tmp_path / "m.pcache"
    write_cache(path, key=b'{"packer":"f4","version":3}', generation=5)
    report = maintenance.inspect(path)
    assert (report.generation, report.entries[0].packer, report.entries[0].nbytes) == (5, "f4/3", 64)
    assert verify(path).ok
