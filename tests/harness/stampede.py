"""The stampede harness: many fresh interpreters released at once on one cache.

``stress/stampede.py`` is its command line and describes the three modes.
``stampede()`` runs the ``wait`` and ``zero-timeout`` rounds, ``mixed()`` the
readers-while-a-writer-appends rounds; each returns its figures and failures,
``passed()`` judges them and ``summary()`` is the line the command prints.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import select
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import packcache
import packcache._generations
from harness.child import child_argv, last_json
from harness.packs import KIB, Request, build_generations, packed
from packcache import format as fmt

PACKS: list[Request] = [(f"w{i:02d}", 3000 + i, KIB * (16 + (i * 29) % 112), {"v": 1}) for i in range(24)]
WARM: list[Request] = [(f"b{i:02d}", 4000 + i, KIB * (16 + (i * 31) % 80), {"v": 1}) for i in range(16)]
APPENDED: list[Request] = [(f"a{i:02d}", 5000 + i, KIB * (16 + (i * 37) % 80), {"v": 1}) for i in range(40)]
WRITER_SESSIONS = 5
START_TIMEOUT = 120.0

# Shared by every child, after the prelude: its spec, and the start barrier.
START_GUN = """
import hashlib, select
spec = json.loads(sys.argv[1])

def wait_for_start_gun():
    os.write(spec["ready_fd"], b"r")
    os.close(spec["ready_fd"])
    os.read(spec["gun_fd"], 1)  # returns b"" once the parent closes the write end: everyone wakes at once
    os.close(spec["gun_fd"])
"""

LOADER = """
wait_for_start_gun()
started = time.monotonic()
digest, mismatches = hashlib.sha256(), 0
cache = packcache.WeightCache(spec["path"], lock_timeout=spec["lock_timeout"])
try:
    with cache.session() as s:
        for name, seed, nbytes, key in spec["requests"]:
            served = s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes), key=key)
            digest.update(f"{name}:{served.dtype.str}:{served.shape}:".encode() + served.tobytes())
            mismatches += not same_pack(served, seed, nbytes)
    stats = stats_dict(cache)
finally:
    cache.close()
report(stats=stats, digest=digest.hexdigest(), mismatches=mismatches, seconds=time.monotonic() - started)
"""

READER = """
catalog = {r[0]: r for r in spec["catalog"]}
wait_for_start_gun()
opens = checked = mismatches = errors = regressions = most = mid_append = 0
problems = []
while True:
    stop = spec["stop_fd"] is None or select.select([spec["stop_fd"]], [], [], 0)[0]
    fd = os.open(spec["path"], os.O_RDONLY)
    try:
        _, slot, entries = packcache._generations.read_committed(fd, path=spec["path"])
    finally:
        os.close(fd)
    listed = sorted(entries) if spec["stop_fd"] is not None else sorted(catalog)
    if len(listed) < most:
        regressions += 1
    most = max(most, len(listed))
    mid_append += spec["base"] < len(listed) < len(catalog)  # some of the writer's sessions visible, not all
    packed_now = []
    cache = packcache.WeightCache(spec["path"], lock_timeout=60)
    try:
        with cache.session() as s:
            for name in listed:
                _, seed, nbytes, key = catalog[name]
                def pack(name=name, seed=seed, nbytes=nbytes):
                    packed_now.append(name)
                    return packed(seed, nbytes)
                served = s.get_or_pack(name, pack, key=key)
                mismatches += not same_pack(served, seed, nbytes)
                checked += 1
        st = stats_dict(cache)
    finally:
        cache.close()
    opens += 1
    if packed_now or st["hits"] != len(listed) or st["written_bytes"] or st["heap_bytes"] or st["errno"]:
        errors += 1
        problems.append({"listed": len(listed), "packed": packed_now, "stats": st})
    if stop:
        break
report(opens=opens, checked=checked, mismatches=mismatches, errors=errors, regressions=regressions,
       most=most, mid_append=mid_append, problems=problems[:3])
"""

WRITER = """
wait_for_start_gun()
catalog, base, per_session = spec["catalog"], spec["base"], spec["per_session"]
sessions, mismatches = [], 0
for n in range(spec["sessions"]):
    requests = catalog[: base + (n + 1) * per_session]
    cache = packcache.WeightCache(spec["path"], lock_timeout=60)
    try:
        with cache.session() as s:
            for name, seed, nbytes, key in requests:
                served = s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes), key=key)
                mismatches += not same_pack(served, seed, nbytes)
        sessions.append(stats_dict(cache))
    finally:
        cache.close()
    time.sleep(0.02)  # let readers open between sessions
report(sessions=sessions, mismatches=mismatches)
"""


def expected_digest(requests: list[Request]) -> str:
    digest = hashlib.sha256()
    for name, seed, nbytes, _ in requests:
        fresh = packed(seed, nbytes)
        digest.update(f"{name}:{fresh.dtype.str}:{fresh.shape}:".encode() + fresh.tobytes())
    return digest.hexdigest()


def start_together(jobs: list[tuple[dict[str, Any], str]], *, stop_after_first: bool = False) -> list[dict[str, Any]]:
    """Start one fresh interpreter per (spec, code), release them at once, return what each reported.

    With ``stop_after_first``, each spec's ``stop_fd`` is the read end of a pipe
    whose write end is closed once the first child has finished (readers poll it).
    A child that fails is reported as ``{"exit": code, "stderr": ...}``.
    """
    ready_r, ready_w = os.pipe()
    gun_r, gun_w = os.pipe()
    stop_r, stop_w = os.pipe() if stop_after_first else (-1, -1)
    procs = []
    try:
        shared = {"ready_fd": ready_w, "gun_fd": gun_r, **({"stop_fd": stop_r} if stop_after_first else {})}
        fds = tuple(fd for fd in (ready_w, gun_r, stop_r) if fd >= 0)
        for spec, code in jobs:
            argv = child_argv(START_GUN + code, json.dumps({**spec, **shared}))
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=fds)
            )
        os.close(ready_w)
        ready_w = -1
        pending, deadline = len(jobs), time.monotonic() + START_TIMEOUT
        while pending:
            if not select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise RuntimeError("children did not get ready in time")
            got = os.read(ready_r, pending)
            if not got:
                raise RuntimeError("a child died before it was ready")
            pending -= len(got)
        os.close(gun_w)  # the start gun: every child's blocking read returns at once
        gun_w = -1
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            if stop_w >= 0:
                os.close(stop_w)  # the first child is done: the others finish their current pass, then one more
                stop_w = -1
            if proc.returncode != 0:
                results.append({"exit": proc.returncode, "stderr": err.strip()[-800:]})
            else:
                results.append(last_json(out))
        return results
    finally:
        for fd in (ready_r, ready_w, gun_r, gun_w, stop_r, stop_w):
            if fd >= 0:
                os.close(fd)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def one_copy_each(path: Path, requests: list[Request]) -> str | None:
    """None if the file holds exactly one copy of each pack and nothing else; else what is wrong."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header, slot, entries = packcache._generations.read_committed(fd, path=str(path))
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if slot is None or slot.generation != 1:
        return f"generation {slot.generation if slot else None}, expected exactly one commit (1)"
    if sorted(entries) != sorted(r[0] for r in requests) or slot.entry_count != len(requests):
        return f"{slot.entry_count} index entries for {len(requests)} packs requested"
    at = header.data_start
    for entry in sorted(entries.values(), key=lambda e: e.offset):
        at = fmt.align_up(at, header.alignment)
        if entry.offset != at:
            return f"entry {entry.name!r} at {entry.offset}, expected {at}: bytes in between are not padding"
        at += entry.nbytes
    if slot.index_offset != fmt.align_up(at, header.alignment):
        return f"index at {slot.index_offset}, expected {fmt.align_up(at, header.alignment)}"
    if slot.committed_end != size:
        return f"file is {size} bytes, committed end is {slot.committed_end}"
    return None


def stampede(directory: Path, rounds: int, processes: int, lock_timeout: float) -> dict[str, Any]:
    """Rounds of ``processes`` loaders started at once on an empty cache; figures and failures."""
    started = time.monotonic()
    figures: Counter[str] = Counter()
    builders: list[int] = []
    failures: list[str] = []
    expected = expected_digest(PACKS)
    total = sum(r[2] for r in PACKS)
    for round_ in range(rounds):
        path = directory / f"{'zero' if lock_timeout == 0 else 'wait'}-{round_:03d}" / "model.pcache"
        path.parent.mkdir(mode=0o700)
        spec = {"path": str(path), "lock_timeout": lock_timeout, "requests": PACKS}
        results = start_together([(spec, LOADER)] * processes)
        built = 0
        for i, result in enumerate(results):
            label = f"round {round_} process {i}"
            if "exit" in result:
                figures["errors"] += 1
                failures.append(f"{label}: exit {result['exit']}: {result['stderr']}")
                continue
            st = result["stats"]
            figures["mismatches"] += result["mismatches"]
            if result["digest"] != expected:
                figures["digest_mismatches"] += 1
                failures.append(f"{label}: outputs differ from a fresh pack")
            if st["stored"]:
                built += 1
                ok = (st["stored"], st["hits"], st["heap_bytes"], st["state"], st["errno"]) == (
                    len(PACKS), 0, 0, "stored", 0)  # fmt: skip
            elif st["hits"] == len(PACKS):
                figures["waiters_mapped" if lock_timeout else "late_mapped"] += 1
                ok = (st["heap_bytes"], st["state"], st["errno"]) == (0, "mapped", 0)
            else:
                figures["locked_processes"] += 1
                figures["heap_locked_packs"] += st["heap_packs"] if st["heap_bytes_by_reason"]["locked"] else 0
                # Nothing mapped: the state is ``heap`` (DESIGN.md: first rule that applies), the reason ``locked``.
                outcome = (st["heap_packs"], st["heap_bytes_by_reason"]["locked"], st["heap_bytes"], st["state"])
                ok = lock_timeout == 0 and outcome == (len(PACKS), total, total, "heap") and st["errno"] == errno.EAGAIN
            if not ok:
                figures["errors"] += 1
                failures.append(f"{label}: unexpected outcome {st}")
        builders.append(built)
        if built != 1:
            failures.append(f"round {round_}: {built} builders")
        elif (problem := one_copy_each(path, PACKS)) is not None:
            figures["file_not_one_copy"] += 1
            failures.append(f"round {round_}: {problem}")
    return {
        "rounds": rounds,
        "processes": processes,
        "builders_per_round": "/".join(str(b) for b in sorted(set(builders))),
        **{k: figures[k] for k in ("waiters_mapped", "locked_processes", "heap_locked_packs", "late_mapped")},
        "mismatches": figures["mismatches"] + figures["digest_mismatches"],
        "errors": figures["errors"],
        "files_one_copy": f"{rounds - figures['file_not_one_copy'] - sum(b != 1 for b in builders)}/{rounds}",
        "seconds": round(time.monotonic() - started, 1),
        "failures": failures,
    }


def mixed(directory: Path, rounds: int, processes: int) -> dict[str, Any]:
    """Rounds of ``processes - 1`` readers mapping a warm cache while one writer appends."""
    started = time.monotonic()
    figures: Counter[str] = Counter()
    failures: list[str] = []
    per_session = len(APPENDED) // WRITER_SESSIONS
    catalog = [*WARM, *APPENDED]
    for round_ in range(rounds):
        path = directory / f"mixed-{round_:03d}" / "model.pcache"
        build_generations(path, [WARM])
        reader = {"path": str(path), "catalog": catalog, "base": len(WARM)}
        writer = {"path": str(path), "catalog": catalog, "base": len(WARM), "per_session": per_session,
                  "sessions": WRITER_SESSIONS}  # fmt: skip
        jobs = [(writer, WRITER)] + [(reader, READER)] * (processes - 1)
        results = start_together(jobs, stop_after_first=True)
        final = start_together([({**reader, "stop_fd": None}, READER)])[0]
        for i, result in enumerate([*results, final]):
            label = f"mixed round {round_} {'writer' if i == 0 else 'final reader' if i == len(results) else 'reader'}"
            if "exit" in result:
                figures["errors"] += 1
                failures.append(f"{label}: exit {result['exit']}: {result['stderr']}")
                continue
            figures["mismatches"] += result["mismatches"]
            if i == 0:
                stored = [st["stored"] for st in result["sessions"]]
                if stored != [per_session] * WRITER_SESSIONS or any(st["errno"] for st in result["sessions"]):
                    figures["errors"] += 1
                    failures.append(f"{label}: sessions {result['sessions']}")
                continue
            figures["errors"] += result["errors"]
            figures["regressions"] += result["regressions"]
            if result["errors"] or result["regressions"]:
                failures.append(f"{label}: {result['problems']}")
            if i == len(results):
                figures["final_hits"] += result["checked"]
                if result["checked"] != len(catalog) or result["errors"]:
                    failures.append(f"{label}: saw {result['checked']} of {len(catalog)} packs")
            else:
                figures["reader_opens"] += result["opens"]
                figures["packs_checked"] += result["checked"]
                figures["opens_mid_append"] += result["mid_append"]
    return {
        "rounds": rounds,
        "readers": processes - 1,
        "writer_sessions": WRITER_SESSIONS,
        **{k: figures[k] for k in ("reader_opens", "opens_mid_append", "packs_checked")},
        "mismatches": figures["mismatches"],
        "errors": figures["errors"],
        "regressions": figures["regressions"],
        "final_hits": f"{figures['final_hits']}/{rounds * len(catalog)}",
        "seconds": round(time.monotonic() - started, 1),
        "failures": failures,
    }


def summary(mode: str, result: dict[str, Any]) -> str:
    return f"stampede-{mode}: " + " ".join(f"{k}={v}" for k, v in result.items() if k != "failures")


def run(directory: str | Path, rounds: int, mixed_rounds: int, processes: int = 8) -> dict[str, dict[str, Any]]:
    """All three modes in ``directory``; figures per mode (each with its ``failures``)."""
    directory = Path(directory)
    return {
        "wait": stampede(directory, rounds, processes, lock_timeout=60.0),
        "zero-timeout": stampede(directory, rounds, processes, lock_timeout=0.0),
        "mixed": mixed(directory, mixed_rounds, processes),
    }


def passed(mode: str, result: dict[str, Any]) -> bool:
    """Whether a mode's figures are all as they must be (its failures list says why not)."""
    if result["failures"] or result["mismatches"] or result["errors"]:
        return False
    if mode == "mixed":
        return bool(result["regressions"] == 0 and result["opens_mid_append"] > 0)
    if result["builders_per_round"] != "1":
        return False
    if mode == "wait":
        return bool(result["waiters_mapped"] == result["rounds"] * (result["processes"] - 1))
    return bool(result["heap_locked_packs"] > 0)
