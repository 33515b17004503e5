"""The fault matrix's entry-point cases: compact, verify, inspect, gc and ``packcache run`` under attack.

The attacks on the entry points (docs/RELIABILITY.md): each command runs as a fresh process (as root or as
``nobody``) with a time bound, so a hang fails the case. ``harness.faults``
lists these in its ``CASES``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.child import child_argv
from harness.driver import (
    AB,
    CHILD_TIMEOUT,
    FOREIGN_UID,
    NOBODY,
    Case,
    Env,
    check_load,
    follow_up,
    load_step,
    no_temp,
    one_load,
    run_cli,
    run_driver,
    unchanged,
)
from harness.files import committed, snapshot
from harness.packs import KIB, Spec, build, without_build_compaction
from packcache import format as fmt

ENTRY_COMMANDS = ("inspect", "verify", "compact")


def superseded(path: Path, spec: Spec = AB) -> None:
    """A cache holding ``spec`` (as ``build()`` and the driver pack it) whose first versions were all
    replaced, as packcache left it before builds compacted: compaction has bytes to reclaim."""
    with without_build_compaction():
        build(path, {name: (seed + 100, nbytes) for name, (seed, nbytes) in spec.items()}, key={"old": True})
        build(path, spec)


def one_line_failure(done: subprocess.CompletedProcess[str], needle: str) -> list[str]:
    """Exit 1 and one message naming ``needle``, never a traceback; else the problem."""
    said = done.stdout + done.stderr
    if done.returncode != 1 or "Traceback" in said or needle not in said:
        return [f"expected exit 1 naming {needle!r}, got {done.returncode}: {said.strip()[-300:]}"]
    return []


def temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def _compact_foreign(env: Env, d: Path) -> list[str]:
    """A file planted by another user: root's and nobody's compact refuse it, nothing is written."""
    path = d / "model.pcache"
    superseded(path)
    os.chown(path, FOREIGN_UID, FOREIGN_UID)
    os.chmod(path, 0o644)
    before = snapshot(path)
    problems = []
    for user in ("root", "nobody"):
        problems += one_line_failure(run_cli(env, "compact", str(path), user=user), "owned by uid 12345")
    done = run_cli(env, "verify", str(path))
    problems += one_line_failure(done, "untrusted: owned by uid 12345")
    return problems + unchanged(path, before) + no_temp(d)


def _compact_service_group(env: Env, d: Path) -> list[str]:
    """root:nobody 0640, mapped by nobody through its group: still mapped after root compacts it."""
    path = d / "model.pcache"
    superseded(path)
    os.chown(path, 0, NOBODY)
    os.chmod(path, 0o640)
    problems, step = one_load(run_driver(env, path, [load_step(AB)], user="nobody"))
    problems += check_load(step, path, hits=2, stored=0) if step else []
    done = run_cli(env, "compact", str(path))
    if done.returncode != 0:
        return [*problems, f"compact failed: {done.stderr.strip()}"]
    st = os.stat(path)
    if (st.st_uid, st.st_gid, st.st_mode & 0o7777) != (0, NOBODY, 0o640):
        problems.append(f"owner/mode after compact {st.st_uid}:{st.st_gid} {st.st_mode & 0o7777:o}")
    more, step = one_load(run_driver(env, path, [load_step(AB)], user="nobody"))
    return problems + more + (check_load(step, path, hits=2, stored=0) if step else [])


def _compact_symlink(env: Env, d: Path) -> list[str]:
    """A builder holds the real file's lock: compact through a symlink waits for that lock, then keeps the link."""
    real = d / "real" / "model.pcache"
    real.parent.mkdir()
    superseded(real)
    link = d / "link.pcache"
    link.symlink_to(real)
    with subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\nsys.stdin.read()", f"{real}.lock"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdout.readline()
        problems = one_line_failure(run_cli(env, "compact", str(link), "--lock-timeout", "0.2"), "build lock")
        holder.stdin.close()
        holder.wait(CHILD_TIMEOUT)
    done = run_cli(env, "compact", str(link))
    if done.returncode != 0 or not link.is_symlink() or temps(d) or temps(real.parent):
        problems.append(
            f"compact through the link: {done.returncode} {done.stderr.strip()}, link kept {link.is_symlink()}"
        )
    return problems + follow_up(env, link, AB)


def _compact_last_generation(env: Env, d: Path) -> list[str]:
    """A valid file at generation 2**64-2 compacts (restarting at 1) and keeps serving hits."""
    path = d / "model.pcache"
    superseded(path)
    raw = bytearray(path.read_bytes())
    slot, _ = committed(path)
    for offset in fmt.SLOT_OFFSETS:
        raw[offset : offset + 64] = bytes(64)
    last = fmt.Slot(2**64 - 2, slot.index_offset, slot.index_size, slot.entry_count, slot.index_crc)
    raw[fmt.slot_offset(0) : fmt.slot_offset(0) + 64] = fmt.encode_slot(last)
    path.write_bytes(bytes(raw))
    done = run_cli(env, "compact", str(path), "--json")
    if done.returncode != 0 or json.loads(done.stdout)["generation"] != 1:
        return [f"compact at the last generation: {done.returncode} {done.stdout.strip()} {done.stderr.strip()}"]
    return follow_up(env, path, AB)


def _fifo_case(command: str, user: str) -> Case:
    def run(env: Env, d: Path) -> list[str]:
        if user == "nobody":
            os.chown(d, NOBODY, NOBODY)
        path = d / "model.pcache"
        os.mkfifo(path)
        os.chmod(path, 0o666)  # readable and writable by nobody: only the kind of file may stop it
        try:
            done = run_cli(env, command, str(path), user=user, timeout=30)
        except subprocess.TimeoutExpired:
            return [f"packcache {command} hung on a FIFO"]
        leftovers = [p.name for p in d.iterdir() if p.name != "model.pcache"]
        return one_line_failure(done, "not a regular file (a FIFO)") + (
            [f"left behind: {leftovers}"] if leftovers else []
        )

    return Case(f"entry-fifo-{user}/{command}", run)


def _gc_fifo_lock(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    build(path, AB)
    Path(f"{path}.lock").unlink()
    os.mkfifo(f"{path}.lock")
    try:
        done = run_cli(env, "gc", str(d), "--max-bytes", "0", timeout=30)
    except subprocess.TimeoutExpired:
        return ["packcache gc hung on a FIFO at a lock path"]
    return ([] if path.exists() else ["the cache was removed without its lock"]) + (
        [] if "not a regular file (a FIFO)" in done.stdout else [f"gc said {done.stdout.strip()[-300:]}"]
    )


LIVE_BUILDER = """
cache = packcache.WeightCache(sys.argv[1])
with cache.session() as s:
    s.get_or_pack('a', lambda: packed(1))
    print('building', flush=True)
    sys.stdin.readline()
    s.get_or_pack('b', lambda: packed(2))
report(**stats_dict(cache))
"""


def _gc_live_builder(env: Env, d: Path) -> list[str]:
    """A builder mid-build (temp file written, lock held); gc as root runs; the build still commits."""
    path = d / "model.pcache"
    with subprocess.Popen(
        child_argv(LIVE_BUILDER, str(path)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as builder:
        assert builder.stdin is not None and builder.stdout is not None
        builder.stdout.readline()
        before = temps(d)
        gc_run = run_cli(env, "gc", str(d), "--max-bytes", "0")
        problems = [] if temps(d) == before and len(before) == 1 else [f"temp files {before} -> {temps(d)}"]
        builder.stdin.write("go\n")
        builder.stdin.close()
        out = builder.stdout.read()
        builder.wait(CHILD_TIMEOUT)
    stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    if (stats.get("state"), stats.get("stored"), stats.get("errno")) != ("stored", 2, 0):
        problems.append(f"the builder's commit failed after gc ({gc_run.stdout.strip()[-200:]}): {stats}")
    return problems + follow_up(env, path, {"a": (1, 4 * KIB), "b": (2, 4 * KIB)})


def _gc_planted(env: Env, d: Path) -> list[str]:
    """Only packcache's own temp names of dead builders, and only this user's files, are removed."""
    build(d / "mine.pcache", AB)
    build(d / "theirs.pcache", AB)
    os.chown(d / "theirs.pcache", NOBODY, NOBODY)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    planted = [".notes.tmp-draft", ".mine.pcache.tmp-draft", f".mine.pcache.tmp-{gone.pid}-NOTHEX0123456789"]
    for name in planted:
        (d / name).write_text("a user's file")
    orphan = d / f".mine.pcache.tmp-{gone.pid}-0123456789abcdef"
    orphan.write_bytes(b"partial")
    (d / "link.pcache").symlink_to(d / "mine.pcache")
    run_cli(env, "gc", str(d), "--max-bytes", "0")
    expected = sorted([*planted, "link.pcache", "mine.pcache.lock", "theirs.pcache", "theirs.pcache.lock"])
    left = sorted(p.name for p in d.iterdir())
    return [] if left == expected else [f"left {left}, expected {expected}"]


def _run_hostile_model(env: Env, d: Path) -> list[str]:
    """'packcache run --model' on deep JSON, a dtype list and a FIFO: one FormatError/refusal line each."""
    from packcache.models import minilm  # imports torch: only this case needs it

    shipped = minilm.default_model_path()
    for name in ("config.json", "tokenizer.json", "sentence_bert_config.json"):
        shutil.copyfile(shipped / name, d / name)
    problems = []
    headers = {
        "deep.safetensors": b'{"w": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        "dtype.safetensors": b'{"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}',
    }
    for name, header in headers.items():
        (d / name).write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
        done = run_cli(env, "run", "--model", str(d / name), "--cache-dir", str(d / "cache"), timeout=90)
        problems += one_line_failure(done, f"{d / name}: offset ")
    os.mkfifo(d / "fifo.safetensors")
    try:
        done = run_cli(env, "run", "--model", str(d / "fifo.safetensors"), "--cache-dir", str(d / "cache"), timeout=90)
    except subprocess.TimeoutExpired:
        return [*problems, "packcache run --model hung on a FIFO"]
    return problems + one_line_failure(done, "not a regular file (a FIFO)")


ENTRY_CASES: list[Case] = [
    Case("entry-compact/foreign-owner", _compact_foreign),
    Case("entry-compact/service-group", _compact_service_group),
    Case("entry-compact/symlink-meets-the-lock", _compact_symlink),
    Case("entry-compact/last-generation", _compact_last_generation),
    *(_fifo_case(command, user) for command in ENTRY_COMMANDS for user in ("root", "nobody")),
    Case("entry-gc/fifo-at-lock", _gc_fifo_lock),
    Case("entry-gc/live-builder", _gc_live_builder),
    Case("entry-gc/planted-names-and-owners", _gc_planted),
    Case("entry-run/hostile-model", _run_hostile_model),
]
