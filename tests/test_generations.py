"""Committed generations (``packcache._generations``), through ``compact`` as an operator runs it: the
compaction copy (``rewrite_live``) keeps the file's owner and group, leaves the original and no temp file
behind when anything fails (a full disk, a chown it may not do, Ctrl-C), and starts the generations again
from 1 at the last usable one.

Issue 10's attacks on the maintenance entry points, as in test_maintenance.py (whose helpers these use):
real ``chown`` to the user ``nobody``, a real tmpfs, a real interrupt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from harness import KIB, file_state, fill, packed, tmpfs
from harness.driver import NOBODY, Env, run_cli
from harness.entry_faults import superseded
from packcache import WeightCache, compact, verify
from packcache import _generations as generations
from packcache import format as fmt
from packcache.cli import main
from test_maintenance import AB, in_nobodys_directory, names, nobody_loads

# -------------------------------------------------------------------------- the copy keeps the owner


@pytest.mark.root
def test_compact_as_root_keeps_the_group_a_service_reads_through(env: Env) -> None:
    """A root-owned 0640 cache in the service's group: after root compacts it, the service still maps it
    (compact used to leave root:root 0640, which the service cannot open: heap on every launch)."""
    d = env.case_dir("service-group")
    path = d / "model.pcache"
    superseded(path, AB)
    os.chown(path, 0, NOBODY)
    os.chmod(path, 0o640)
    assert nobody_loads(env, path, AB, hits=2, stored=0) == []
    assert compact(path).reclaimed_bytes > 0
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, NOBODY, 0o640)
    assert nobody_loads(env, path, AB, hits=2, stored=0) == []


@pytest.mark.root
def test_compact_that_cannot_keep_the_owner_leaves_the_original_and_no_temp(env: Env) -> None:
    """nobody may read and trust root's cache in its own directory, but must not turn it into nobody's file."""
    path = in_nobodys_directory(env, "cannot-chown")
    superseded(path, AB)
    os.chmod(path, 0o644)  # root's, so nobody trusts it and may read it
    os.chown(f"{path}.lock", NOBODY, NOBODY)  # nobody may take the lock: the owner is what must stop it
    before = file_state(path)
    done = run_cli(env, "compact", str(path), user="nobody")
    assert done.returncode == 1 and "run compact as the file's owner" in done.stderr, done.stderr
    assert file_state(path) == before and os.stat(path).st_uid == 0
    assert names(path.parent) == ["model.pcache", "model.pcache.lock"], "the temp file was removed"


# -------------------------------------------------------- a failed copy leaves the original and no temp file


def test_compact_interrupted_mid_copy_keeps_the_original_and_removes_its_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (KeyboardInterrupt) after the header is written: nothing of the attempt survives."""
    path = tmp_path / "model.pcache"
    superseded(path, AB)
    before = file_state(path)
    real_pwrite = generations.pwrite_all
    offsets: list[int] = []

    def interrupted(fd: int, data: Any, offset: int) -> int:
        offsets.append(offset)
        if len(offsets) == 2:
            raise KeyboardInterrupt
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(generations, "pwrite_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compact(path)
    assert offsets == [0, 4096], "interrupted in the middle of copying the packs"
    assert file_state(path) == before
    assert names(tmp_path) == ["model.pcache", "model.pcache.lock"]


@pytest.mark.root
def test_compact_on_a_full_disk_keeps_the_original_and_removes_its_temp(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        path = mnt / "model.pcache"
        superseded(path, AB)
        fill(mnt, leave_free=8 * KIB)
        before = file_state(path)
        with pytest.raises(OSError) as raised:
            compact(path)
        assert raised.value.errno == 28  # ENOSPC
        assert file_state(path) == before
        assert sorted(n for n in names(mnt) if n != "filler") == ["model.pcache", "model.pcache.lock"]


# --------------------------------------------------------------------------- generation overflow


def set_generation(path: Path, generation: int) -> None:
    """Move a valid cache's newest commit to ``generation`` (the other slot cleared), checksums resealed."""
    raw = bytearray(path.read_bytes())
    newest = fmt.choose_slot(bytes(raw[: fmt.HEADER_READ_SIZE]))[0][0]
    for offset in fmt.SLOT_OFFSETS:
        raw[offset : offset + 64] = bytes(64)
    at = fmt.slot_offset(generation % 2)
    raw[at : at + 64] = fmt.encode_slot(dataclasses.replace(newest, generation=generation))
    path.write_bytes(bytes(raw))


def test_compact_at_the_last_usable_generation_restarts_the_generation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.pcache"
    superseded(path, AB)
    set_generation(path, 2**64 - 2)
    assert verify(path).ok and verify(path).generation == 2**64 - 2
    with WeightCache(path) as cache, cache.session() as s:  # a process mapping the old file
        held = {name: s.get_or_pack(name, lambda: pytest.fail("hit expected")) for name in AB}
    assert main(["compact", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["generation"] == 1
    for name, (seed, nbytes) in AB.items():
        assert held[name].tobytes() == packed(seed, nbytes).tobytes(), "old mappings stay valid"
    assert verify(path).ok and verify(path).generation == 1
    with WeightCache(path) as cache:
        with cache.session() as s:
            for name in AB:
                s.get_or_pack(name, lambda: pytest.fail("hit expected"))
            s.get_or_pack("c", lambda: packed(9))
        assert (cache.stats().hits, cache.stats().stored) == (2, 1)
    assert verify(path).generation == 2, "the restarted file takes appends as usual"
