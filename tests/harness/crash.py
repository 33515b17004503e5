"""The crash harness: writers SIGKILLed at a random instant, then a fresh checker judges what they left.

``stress/crash.py`` is its command line and describes the method and the figures.
``run()`` prepares the templates, calibrates the kill window of each scenario
(the median uninterrupted run), runs the trials in parallel and returns the
figures; ``summary()`` is the line the command prints.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import packcache
import packcache._generations
from harness.child import child_argv, last_json
from harness.packs import KIB, Request, build_generations


def _size(i: int) -> int:
    return KIB * (32 + (i * 53) % 224)  # 32..255 KiB, varied so packs straddle pages and alignment


BASE: list[Request] = [(f"p{i:02d}", i, _size(i), {"v": 1}) for i in range(20)]
STALE_OLD: Request = ("s", 500, 64 * KIB, {"v": 1})
STALE_NEW: Request = ("s", 501, 96 * KIB, {"v": 2})
NEW: list[Request] = [(f"n{i:02d}", 1000 + i, _size(i + 7), {"v": 1}) for i in range(20)]
REPLACED: list[Request] = [(f"p{i:02d}", 2000 + i, _size(i + 3), {"v": 2}) for i in range(10)]

SESSION = [*BASE, STALE_NEW, *NEW]  # what a fresh build and an append load
APPEND_TEMPLATE = [[*BASE[:10], STALE_OLD], BASE[10:]]  # two generations: the next commit reuses a slot
BEFORE_APPEND = [*BASE, STALE_OLD]
COMPACT_TEMPLATE = [[*BASE, STALE_OLD], [*REPLACED, STALE_NEW]]  # generation 2 supersedes 11 packs
LIVE_COMPACT = [*REPLACED, *BASE[10:], STALE_NEW]

SCENARIOS = ("fresh", "append", "compact")
MUST_BE_ZERO = ("wrong_bytes", "caches_lost", "mixed_generations", "verify_failures", "heal_failures", "errors")

WRITER = """
spec = json.loads(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
if spec["scenario"] == "compact":
    r = packcache.compact(spec["path"], lock_timeout=30)
    print(json.dumps({"done": True, "entries": r.entries, "reclaimed": r.reclaimed_bytes}), flush=True)
else:
    cache = packcache.WeightCache(spec["path"], lock_timeout=30)
    with cache.session() as s:
        request_all(s, spec["requests"])
    st = stats_dict(cache)
    cache.close()
    print(json.dumps({"done": True, "stored": st["stored"], "hits": st["hits"], "heap": st["heap_bytes"]}), flush=True)
"""

CHECKER = """
spec = json.loads(sys.argv[1])
path = spec["path"]
directory = os.path.dirname(path)

def temps():
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)

def committed():
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        try:
            _, slot, entries = packcache._generations.read_committed(fd, path=path)
            gen, end = (slot.generation, slot.committed_end) if slot else (0, 0)
        except packcache.FormatError:
            gen, end = -1, 0
        return {"inode": st.st_ino, "size": st.st_size, "generation": gen, "committed_end": end}
    finally:
        os.close(fd)

def verify():
    if not os.path.exists(path):
        return None
    report_ = packcache.verify(path)
    return [str(p) for p in report_.problems]

def load(requests, **options):
    packed_now, wrong = [], []
    cache = packcache.WeightCache(path, lock_timeout=30, **options)
    try:
        with cache.session() as s:
            for name, seed, nbytes, key in requests:
                def pack(name=name, seed=seed, nbytes=nbytes):
                    packed_now.append(name)
                    return packed(seed, nbytes)
                if not same_pack(s.get_or_pack(name, pack, key=key), seed, nbytes):
                    wrong.append(name)
        stats = stats_dict(cache)
    finally:
        cache.close()
    hits = [r[0] for r in requests if r[0] not in packed_now]
    return {"hits": hits, "wrong": wrong, "stats": {k: stats[k] for k in (
        "state", "errno", "error", "heap_bytes", "hits", "stored", "written_bytes")}}

result = {"temps": temps(), "file": committed(), "verify": verify()}
result["before"] = load(spec["before"], read_only=True) if spec["before"] else None
result["after"] = load(spec["after"], read_only=True)
result["heal"] = load(spec["after"])
result["reopen"] = load(spec["after"])
result["verify_after_heal"] = verify()
result["temps_after_heal"] = temps()
report(**result)
"""


def prepare(scenario: str, directory: Path, templates: dict[str, Path]) -> Path:
    """A new trial directory holding the scenario's starting point; returns the cache path."""
    directory.mkdir(mode=0o700)
    path = directory / "model.pcache"
    if scenario in templates:
        shutil.copyfile(templates[scenario], path)
        path.chmod(0o600)
    return path


def requests_for(scenario: str) -> tuple[list[Request], list[Request]]:
    """(what the writer and the checker's full load request, what was valid before the trial)."""
    if scenario == "fresh":
        return SESSION, []
    if scenario == "append":
        return SESSION, BEFORE_APPEND
    return LIVE_COMPACT, LIVE_COMPACT


def run_writer(scenario: str, path: Path, delay: float | None) -> dict[str, Any]:
    """Run one writer; SIGKILL it ``delay`` seconds after it starts working (``None``: let it finish)."""
    after, _ = requests_for(scenario)
    spec = json.dumps({"scenario": scenario, "path": str(path), "requests": after})
    argv = child_argv(WRITER, spec)
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        assert p.stdin is not None and p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            _, err = p.communicate()
            return {"error": f"writer did not start: {err.strip()[-500:]}"}
        p.stdin.write("go\n")
        p.stdin.flush()
        started = time.monotonic()
        duration = None
        if delay is None:
            line = p.stdout.readline()
            duration = time.monotonic() - started
            out, err = p.communicate()
            out = line + out
        else:
            time.sleep(delay)
            p.kill()  # SIGKILL; Popen does not signal a child it has already reaped
            out, err = p.communicate()
    done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if p.returncode not in (0, -9):
        return {"error": f"writer exited {p.returncode}: {err.strip()[-500:]}"}
    return {"finished": bool(done), "result": done[0] if done else None, "duration": duration}


def run_checker(scenario: str, path: Path) -> dict[str, Any]:
    after, before = requests_for(scenario)
    spec = json.dumps({"path": str(path), "after": after, "before": before if scenario == "append" else []})
    done = subprocess.run(child_argv(CHECKER, spec), capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        return {"error": f"checker exited {done.returncode}: {done.stderr.strip()[-800:]}"}
    result: dict[str, Any] = last_json(done.stdout)
    return result


def names(requests: list[Request]) -> set[str]:
    return {r[0] for r in requests}


def judge(scenario: str, before_trial: dict[str, int] | None, check: dict[str, Any]) -> tuple[Counter[str], list[str]]:
    """Figures and failure messages of one trial, from what the checker saw."""
    figures: Counter[str] = Counter()
    problems: list[str] = []
    after, _ = requests_for(scenario)
    file, temps = check["file"], check["temps"]
    # What the kill left on disk, judged before the checker wrote anything.
    if scenario == "fresh":
        new_generation = file is not None
        uncommitted = bool(temps) and not new_generation
    elif scenario == "append":
        assert before_trial is not None
        new_generation = file is not None and file["generation"] > before_trial["generation"]
        uncommitted = not new_generation and file is not None and file["size"] > before_trial["size"]
    else:
        assert before_trial is not None
        new_generation = file is not None and file["inode"] != before_trial["inode"]
        uncommitted = bool(temps) and not new_generation
    figures["uncommitted_on_disk"] += uncommitted
    figures["new_generation"] += new_generation

    for phase in ("before", "after", "heal", "reopen"):
        if check[phase] is not None:
            figures["wrong_bytes"] += len(check[phase]["wrong"])
            if check[phase]["wrong"]:
                problems.append(f"{phase}: wrong bytes served for {check[phase]['wrong']}")

    hits = set(check["after"]["hits"])
    if scenario == "fresh":
        expected = names(after) if new_generation else set()
        if hits != expected:
            figures["mixed_generations"] += 1
            problems.append(f"file {'present' if file else 'absent'} but hits {sorted(hits)}")
    elif scenario == "append":
        old_hits = set(check["before"]["hits"])
        if not names(BASE) <= old_hits or (not new_generation and "s" not in old_hits):
            figures["caches_lost"] += 1
            problems.append(f"previous entries lost: {sorted(names(BEFORE_APPEND) - old_hits)}")
        expected = names(after) if new_generation else names(BASE)
        if hits != expected:
            figures["mixed_generations"] += 1
            problems.append(f"generation {'new' if new_generation else 'old'} but hits {sorted(hits)}")
    elif hits != names(after):
        figures["caches_lost"] += 1
        problems.append(f"compaction lost entries: {sorted(names(after) - hits)}")

    for when in ("verify", "verify_after_heal"):
        found = check[when]
        if found is None and (when == "verify_after_heal" or scenario != "fresh"):
            found = ["the cache file does not exist"]
        if found:
            figures["verify_failures"] += 1
            problems.append(f"{when}: {found}")

    heal, reopen = check["heal"]["stats"], check["reopen"]["stats"]
    healed = heal["heap_bytes"] == 0 and heal["errno"] == 0 and heal["hits"] + heal["stored"] == len(after)
    warm = (reopen["hits"], reopen["stored"], reopen["written_bytes"], reopen["state"]) == (len(after), 0, 0, "mapped")
    if not (healed and warm):
        figures["heal_failures"] += 1
        problems.append(f"heal {heal} then reopen {reopen}")
    figures["orphans_left"] += len(check["temps_after_heal"])
    return figures, problems


def file_facts(path: Path) -> dict[str, int] | None:
    """Generation, size and inode of a valid cache file (the state before a trial)."""
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        _, slot, _ = packcache._generations.read_committed(fd, path=str(path))
        st = os.fstat(fd)
        return {"generation": slot.generation if slot else 0, "size": st.st_size, "inode": st.st_ino}
    finally:
        os.close(fd)


class Run:
    """One harness run: templates, calibration, trials; figures accumulated thread-safely."""

    def __init__(self, directory: Path, workers: int) -> None:
        self.directory = directory
        self.workers = workers
        self.templates: dict[str, Path] = {}
        self.figures: Counter[str] = Counter()
        self.by_scenario: dict[str, Counter[str]] = {s: Counter() for s in SCENARIOS}
        self.failures: list[str] = []
        self.limit: dict[str, float] = {}
        self._lock = threading.Lock()
        self._serial = 0

    def _new_dir(self, label: str) -> Path:
        with self._lock:
            self._serial += 1
            return self.directory / f"{self._serial:05d}-{label}"

    def setup(self, calibration_runs: int) -> None:
        for scenario, generations in (("append", APPEND_TEMPLATE), ("compact", COMPACT_TEMPLATE)):
            path = self.directory / f"template-{scenario}" / "model.pcache"
            build_generations(path, generations)
            self.templates[scenario] = path
        jobs = [s for s in SCENARIOS for _ in range(calibration_runs)]
        with ThreadPoolExecutor(self.workers) as pool:
            durations = list(pool.map(self._calibrate, jobs))
        for scenario in SCENARIOS:
            measured = [d for s, d in zip(jobs, durations, strict=True) if s == scenario]
            self.limit[scenario] = statistics.median(measured)

    def _calibrate(self, scenario: str) -> float:
        """An uninterrupted run, which must succeed and leave a cache that passes every check."""
        directory = self._new_dir(f"calibrate-{scenario}")
        path = prepare(scenario, directory, self.templates)
        before = file_facts(path)
        writer = run_writer(scenario, path, None)
        if "error" in writer or not writer["finished"]:
            raise RuntimeError(f"uninterrupted {scenario} writer failed: {writer}")
        expected = {"fresh": (41, 0), "append": (21, 20)}.get(scenario)
        result = writer["result"]
        if expected is not None and (result["stored"], result["hits"], result["heap"]) != (*expected, 0):
            raise RuntimeError(f"uninterrupted {scenario} writer: {result}")
        if scenario == "compact" and (result["entries"], result["reclaimed"] > 0) != (len(LIVE_COMPACT), True):
            raise RuntimeError(f"uninterrupted compaction: {result}")
        check = run_checker(scenario, path)
        if "error" in check:
            raise RuntimeError(f"checker of uninterrupted {scenario} run: {check['error']}")
        figures, problems = judge(scenario, before, check)
        if problems or not figures["new_generation"]:
            raise RuntimeError(f"uninterrupted {scenario} run judged wrong: {problems}")
        shutil.rmtree(directory)
        return float(writer["duration"])

    def trial(self, job: tuple[str, float]) -> None:
        scenario, delay = job
        directory = self._new_dir(scenario)
        path = prepare(scenario, directory, self.templates)
        before = file_facts(path)
        writer = run_writer(scenario, path, delay)
        figures: Counter[str] = Counter(trials=1)
        problems: list[str] = []
        if "error" in writer:
            figures["errors"] += 1
            problems.append(writer["error"])
        else:
            figures["finished" if writer["finished"] else "killed_mid_write"] += 1
            check = run_checker(scenario, path)
            if "error" in check:
                figures["errors"] += 1
                problems.append(check["error"])
            else:
                more, problems = judge(scenario, before, check)
                figures.update(more)
        with self._lock:
            self.figures.update(figures)
            self.by_scenario[scenario].update(figures)
            if problems:
                self.failures.append(f"{directory.name} ({scenario}, kill after {delay * 1000:.1f} ms): {problems}")
        if not problems:
            shutil.rmtree(directory)


def run(
    directory: str | Path, trials: int, *, seed: int = 1, workers: int = 2, calibration_runs: int = 4
) -> dict[str, Any]:
    """Run the harness in ``directory``; return its figures (``failures`` lists what went wrong)."""
    started = time.monotonic()
    harness = Run(Path(directory), workers)
    harness.setup(calibration_runs)
    rng = random.Random(seed)
    jobs = []
    for i in range(trials):
        scenario = SCENARIOS[i % len(SCENARIOS)]
        jobs.append((scenario, rng.uniform(0.0, harness.limit[scenario])))
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(harness.trial, jobs))
    result: dict[str, Any] = {key: harness.figures[key] for key in (
        "trials", "killed_mid_write", "uncommitted_on_disk", "new_generation", "finished", *MUST_BE_ZERO,
        "orphans_left")}  # fmt: skip
    result["seconds"] = round(time.monotonic() - started, 1)
    result["limits"] = {s: round(t, 4) for s, t in harness.limit.items()}
    result["by_scenario"] = {s: dict(c) for s, c in harness.by_scenario.items()}
    result["failures"] = harness.failures
    return result


def summary(result: dict[str, Any]) -> str:
    keys = ("trials", "killed_mid_write", "uncommitted_on_disk", "new_generation", "finished", *MUST_BE_ZERO)
    return "crash: " + " ".join(f"{k}={result[k]}" for k in (*keys, "orphans_left", "seconds"))
