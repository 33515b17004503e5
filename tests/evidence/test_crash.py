"""Crash safety with real SIGKILL: a writer killed at any instant never costs a valid cache.

A child process runs one writer session with ``os.pwrite``, ``os.fdatasync``
and ``os.rename`` wrapped (the store calls them as ``os.<name>``): the wrapper
counts calls and sends the process SIGKILL right before (or, in the second
variant, right after) call number N. An uninterrupted run first counts the
calls of the session; then N goes over every one of them, for four
scenarios: a fresh build, an append to a valid cache (new entries plus a stale
key replaced), the rebuild of a corrupt file, and an append that supersedes more
bytes than it leaves live, so the same build compacts the file (append in place,
then copy the live packs into a new file and rename it over the old).

After every kill the cache must be one of exactly two things: the generation
before the session, or the one after it, never a mix; what it serves is
bit-identical to a fresh pack; entries valid before the trial are never lost;
the path never shows a half-written temp file. And the next writer heals it.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import KIB, Packer, Request, assert_same, build_generations, child_argv, packed, run_child
from packcache import WeightCache, gc

BEFORE: list[Request] = [  # what a valid cache holds before the "append" trial
    ("a", 0, 8 * KIB, {"v": 1}),
    ("s", 2, 8 * KIB, {"v": 1}),
    ("b", 1, 24 * KIB, {"v": 1}),
]
SESSION: list[Request] = [  # what every child session requests: "s" with a new key is stale in BEFORE
    ("a", 0, 8 * KIB, {"v": 1}),
    ("b", 1, 24 * KIB, {"v": 1}),
    ("s", 3, 16 * KIB, {"v": 2}),
    ("c", 4, 40 * KIB, {"v": 1}),
    ("d", 5, 8 * KIB, {"v": 1}),
]
BEFORE_COMPACT: list[Request] = [  # "s", "c" and "d" are stale and big: SESSION supersedes more than it keeps
    ("a", 0, 8 * KIB, {"v": 1}),
    ("b", 1, 24 * KIB, {"v": 1}),
    ("s", 2, 64 * KIB, {"v": 1}),
    ("c", 6, 64 * KIB, {"v": 0}),
    ("d", 7, 64 * KIB, {"v": 0}),
]
ALL = {name for name, *_ in SESSION}
SCENARIOS = ["fresh", "append", "rebuild", "compact"]
KEPT = {"fresh": set(), "append": {"a", "b"}, "rebuild": set(), "compact": {"a", "b"}}  # valid before the trial
VALID_BEFORE = {"append": BEFORE, "compact": BEFORE_COMPACT}  # what a valid cache holds before the trial
GARBAGE = np.random.default_rng(11).bytes(12 * KIB)

CRASH_CHILD = """
spec = json.loads(sys.argv[1])
kill_at, when = spec["kill_at"], spec["when"]
calls = []

def _wrap(name):
    real = getattr(os, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        if len(calls) == kill_at and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if len(calls) == kill_at and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(os, name, wrapper)

for _name in ("pwrite", "fdatasync", "rename"):
    _wrap(_name)
cache = packcache.WeightCache(spec["path"], lock_timeout=5)
with cache.session() as s:
    request_all(s, spec["requests"])
stats = stats_dict(cache)
cache.close()
report(stats=stats, calls=calls)
"""


def request(session: Any, req: Request, packer: Packer) -> np.ndarray[Any, Any]:
    name, seed, nbytes, key = req
    return session.get_or_pack(name, packer(name, seed, nbytes), key=key)  # type: ignore[no-any-return]


def prepare(scenario: str, directory: Path, templates: dict[str, Path]) -> Path:
    """A directory holding the scenario's starting point; returns the cache path."""
    directory.mkdir()
    path = directory / "model.pcache"
    if scenario in templates:
        shutil.copyfile(templates[scenario], path)
        path.chmod(0o600)
    elif scenario == "rebuild":
        path.write_bytes(GARBAGE)
        path.chmod(0o600)
    return path


@pytest.fixture
def templates(tmp_path: Path) -> dict[str, Path]:
    """Valid caches of two generations (so the next commit overwrites a used slot) holding VALID_BEFORE."""
    made = {}
    for scenario, before in VALID_BEFORE.items():
        path = tmp_path / f"template-{scenario}" / "model.pcache"
        split = 2 if scenario == "append" else 3  # one key per generation
        build_generations(path, [before[:split], before[split:]])  # each generation stored whole
        made[scenario] = path
    return made


def count_calls(scenario: str, tmp_path: Path, templates: dict[str, Path]) -> list[str]:
    """The wrapped calls of one uninterrupted session, which must itself succeed."""
    path = prepare(scenario, tmp_path / f"{scenario}-uninterrupted", templates)
    spec = {"path": str(path), "kill_at": None, "when": "before", "requests": SESSION}
    result = run_child(CRASH_CHILD, json.dumps(spec))
    stored = len(ALL - KEPT[scenario])
    assert (result["stats"]["stored"], result["stats"]["hits"], result["stats"]["heap_bytes"]) == (
        stored, len(KEPT[scenario]), 0)  # fmt: skip
    calls: list[str] = result["calls"]
    # A new file is published by one rename; an append never renames. A compacting build commits twice:
    # its append in place, then the compacted copy it renames over the file.
    assert calls.count("rename") == (0 if scenario == "append" else 1), calls
    assert calls.count("fdatasync") == (4 if scenario == "compact" else 2), calls
    return calls


def kill_everywhere(scenario: str, tmp_path: Path, templates: dict[str, Path]) -> list[tuple[str, Path]]:
    """Run one child per (before/after, call N), each killed there; return (label, cache path) per trial."""
    calls = count_calls(scenario, tmp_path, templates)
    trials = []
    for when in ("before", "after"):
        for n in range(1, len(calls) + 1):
            label = f"{scenario}: SIGKILL {when} call {n} ({calls[n - 1]}) of {calls}"
            trials.append((label, when, n, prepare(scenario, tmp_path / f"{scenario}-{when}-{n}", templates)))

    def run(trial: tuple[str, str, int, Path]) -> subprocess.CompletedProcess[str]:
        _, when, n, path = trial
        spec = {"path": str(path), "kill_at": n, "when": when, "requests": SESSION}
        return subprocess.run(child_argv(CRASH_CHILD, json.dumps(spec)), capture_output=True, text=True, timeout=60)

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = list(pool.map(run, trials))
    for (label, *_), proc in zip(trials, done, strict=True):
        assert proc.returncode == -signal.SIGKILL, f"{label}: exit {proc.returncode}\n{proc.stderr}"
        assert proc.stdout == "", label
    return [(label, path) for label, _, _, path in trials]


def rebuild_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.name == "packcache" and "rebuilt" in r.getMessage()]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sigkill_at_any_write_leaves_previous_or_next_generation(
    tmp_path: Path, templates: dict[str, Path], caplog: pytest.LogCaptureFixture, scenario: str
) -> None:
    outcomes = set()
    for label, path in kill_everywhere(scenario, tmp_path, templates):
        caplog.clear()
        packer = Packer()
        with WeightCache(path, read_only=True) as reader, reader.session() as s:  # reading writes nothing
            for req in SESSION:
                assert_same(request(s, req, packer), packed(req[1], req[2]))
        hits = ALL - set(packer.calls)
        assert hits in (KEPT[scenario], ALL), f"{label}: a mix of generations is visible: hits {sorted(hits)}"
        assert all(count == 1 for count in packer.calls.values()), label
        committed = hits == ALL
        outcomes.add(committed)
        if committed:
            assert rebuild_warnings(caplog.records) == [], f"{label}: the committed file is not valid"
        elif scenario == "fresh":
            assert not path.exists(), f"{label}: an uncommitted file is visible as the cache path"
        elif scenario == "rebuild":
            assert path.read_bytes() == GARBAGE, f"{label}: the old file was changed in place"
        else:  # append, compact: the previous generation is whole, stale entries included
            assert rebuild_warnings(caplog.records) == [], f"{label}: the previous generation was damaged"
            old = Packer()
            with WeightCache(path, read_only=True) as reader, reader.session() as s:
                for req in VALID_BEFORE[scenario]:
                    assert_same(request(s, req, old), packed(req[1], req[2]))
            assert old.calls == {}, f"{label}: entries of the previous generation were lost: {old.calls}"
    assert outcomes == {False, True}, "the kill points did not span the commit"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_next_writer_after_any_sigkill_completes_and_next_load_is_full_hit(
    tmp_path: Path, templates: dict[str, Path], scenario: str
) -> None:
    for label, path in kill_everywhere(scenario, tmp_path, templates):
        writer_packer = Packer()
        with WeightCache(path, lock_timeout=5) as writer:
            with writer.session() as s:
                for req in SESSION:
                    assert_same(request(s, req, writer_packer), packed(req[1], req[2]))
            st = writer.stats()
        assert st.heap_bytes == 0 and st.errno == 0, f"{label}: {st}"
        assert st.stored == len(writer_packer.calls), label
        packer = Packer()
        with WeightCache(path) as cache:
            with cache.session() as s:
                for req in SESSION:
                    assert_same(request(s, req, packer), packed(req[1], req[2]))
            st = cache.stats()
        assert packer.calls == {}, f"{label}: packed again after healing: {packer.calls}"
        assert (st.hits, st.stored, st.written_bytes, st.state) == (len(ALL), 0, 0, "mapped"), label
        left = {p.name for p in path.parent.iterdir()} - {"model.pcache", "model.pcache.lock"}
        if left and (healed_nothing := writer_packer.calls == {}):
            # Killed while compacting, after its append was committed: nothing was left for the next writer to
            # pack, so no build ran to take the lock and remove the dead builder's temp file. gc does.
            assert scenario == "compact" and len(left) == 1, f"{label}: {left} (healed nothing: {healed_nothing})"
            gc(path.parent, 1 << 40)
            left = {p.name for p in path.parent.iterdir()} - {"model.pcache", "model.pcache.lock"}
        # The killed builder's temp file is an orphan: the next builder (or gc) removes it, nothing else is left.
        assert left == set(), f"{label}: {left}"
