"""The interrupts harness: Ctrl-C (a KeyboardInterrupt from a signal handler) at a random instant of a load.

``stress/interrupts.py`` is its command line and describes the method. One
child interpreter per worker runs its trials back to back; ``run()`` calibrates
the interrupt window of each scenario, runs the workers and returns the figures
and failures.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness.child import child_argv, last_json

MUST_BE_ZERO = ("wrong_bytes", "unusable", "hangs", "ledger_mismatches", "verify_failures", "heal_failures", "errors")

CHILD = r"""
import faulthandler, random, statistics, threading

# No record handler here: an interrupt inside Handler.handle would leave its lock held and hang the next
# record of another thread, a limit of logging, not of the cache. This child logs as an application does.
logging.getLogger("packcache").removeHandler(RECORDS)
logging.getLogger("packcache").setLevel(logging.NOTSET)

SPEC = {f"w{i}": (i, 16 * 1024 + 64 * i) for i in range(24)}
KEY = {"v": 1}
armed = False


def alarm(signum, frame):
    if armed:
        raise KeyboardInterrupt


signal.signal(signal.SIGALRM, alarm)


def request(s, names, out):
    for name in names:
        seed, nbytes = SPEC[name]
        out[name] = s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes), KEY)


def prepare(scenario, path):
    for p in (path, path + ".lock"):
        if os.path.exists(p):
            os.unlink(p)
    if scenario == "append":
        with packcache.WeightCache(path) as c, c.session() as s:
            request(s, list(SPEC)[:12], {})
    elif scenario == "rebuild":
        with open(path, "wb") as f:
            f.write(os.urandom(20000))
        os.chmod(path, 0o600)


class Crew:
    # Four worker threads, started before any timer is armed: CPython's own Thread.start()
    # waits on a Condition, which an interrupt can leave locked (a CPython limit, not the cache's).

    def __init__(self):
        self.go = threading.Event()
        self.jobs = []
        self.threads = [threading.Thread(target=self.work, args=(i,), daemon=True) for i in range(4)]
        for t in self.threads:
            t.start()

    def work(self, i):
        self.go.wait()
        s, names, out = self.jobs[0]
        try:
            request(s, names[i::4], out)
        except packcache.SessionError:
            pass  # the session ended (interrupted) while this worker still had requests

    def run(self, s, out):
        self.jobs.append((s, list(SPEC), out))
        self.go.set()
        for t in self.threads:
            t.join()


def load(scenario, cache, out, crew=None):
    with cache.session() as s:
        if scenario == "threads":
            (crew or Crew()).run(s, out)
        else:
            request(s, list(SPEC), out)


def same(out):
    return [n for n, a in out.items() if not same_pack(a, *SPEC[n])]


def ledger_ok(cache):
    ledger = cache._ledger
    held = sum(h.nbytes for h in ledger.held.values()) + sum(h.nbytes for h in ledger.unnamed.values())
    st = cache.stats()
    return held == st.mapped_bytes + st.heap_bytes


def in_thread(fn, timeout=10.0):
    done, box = threading.Event(), {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = repr(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(timeout):
        return "hang"
    return box.get("error")


def trial(scenario, path, delay):
    global armed
    prepare(scenario, path)
    cache = packcache.WeightCache(path, lock_timeout=5)
    out = {}
    crew = Crew() if scenario == "threads" else None
    interrupted = False
    signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
    armed = True
    try:
        load(scenario, cache, out, crew)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    result = {"interrupted": interrupted, "wrong": same(out), "ledger": ledger_ok(cache)}
    again = {}
    problem = None
    try:
        load(scenario, cache, again)  # this thread first: never "already active"
    except BaseException as exc:
        problem = repr(exc)
    if problem is None:
        problem = in_thread(lambda: load(scenario, cache, again))  # then another thread: nothing left locked
    result["usable"] = problem
    if problem is not None:  # leave this cache as it is (closing it could hang too) and stop the worker
        st = cache.stats()
        result.update(fatal=True, state=st.state, last_error=st.error, owner=cache._owner.thread is not None,
                      session=cache._session is not None, locked=cache._store.locked if cache._store else None)
        return result
    result["wrong"] += same(again)
    result["ledger"] = result["ledger"] and ledger_ok(cache)
    cache.close()
    result["verify"] = [] if not os.path.exists(path) else [str(p) for p in packcache.verify(path).problems]
    with packcache.WeightCache(path) as fresh:
        healed = {}
        with fresh.session() as s:
            request(s, list(SPEC), healed)
        st = fresh.stats()
    result["wrong"] += same(healed)
    result["healed"] = st.heap_bytes == 0 and st.hits + st.stored == len(SPEC)
    if not result["healed"]:
        result["heal_stats"] = {"heap": {k: v for k, v in st.heap_bytes_by_reason.items() if v}, "error": st.error}
    return result


args = json.loads(sys.stdin.read())
path = os.path.join(args["dir"], "model.pcache")
if args["mode"] == "calibrate":
    times = {}
    for scenario in args["scenarios"]:
        runs = []
        for _ in range(args["runs"]):
            prepare(scenario, path)
            with packcache.WeightCache(path) as cache:
                started = time.perf_counter()
                load(scenario, cache, {})
                runs.append(time.perf_counter() - started)
        times[scenario] = statistics.median(runs)
    print(json.dumps(times))
else:
    results = []
    for scenario, delay in args["trials"]:
        # A hang anywhere (not only in the checked loads) dumps every thread's stack and ends the worker.
        faulthandler.dump_traceback_later(60, exit=True)
        try:
            r = trial(scenario, path, delay)
        except BaseException as exc:
            import traceback
            where = " <- ".join(f"{f.name}@{os.path.basename(f.filename)}:{f.lineno}"
                                for f in reversed(traceback.extract_tb(exc.__traceback__)[-6:]))
            r = {"error": f"{type(exc).__name__}: {exc} at {where}"}
        faulthandler.cancel_dump_traceback_later()
        r["scenario"] = scenario
        results.append(r)
        if r.get("fatal"):
            break
    print(json.dumps(results), flush=True)
    os._exit(0)  # do not wait at shutdown for threads the interrupts left blocked in CPython's threading
"""

SCENARIOS = ("build", "append", "rebuild", "threads")


def _child(args: dict[str, Any], timeout: float) -> Any:
    done = subprocess.run(child_argv(CHILD), input=json.dumps(args), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"child exited {done.returncode}: {done.stderr.strip()[-4000:]}")
    return last_json(done.stdout)


def run(base: Path, *, trials: int, seed: int, workers: int, calibration_runs: int = 3) -> dict[str, Any]:
    """Run the harness in ``base``; return the summary figures and the failures."""
    started = time.perf_counter()
    calibration_dir = base / "calibrate"
    calibration_dir.mkdir()
    medians = _child({"mode": "calibrate", "dir": str(calibration_dir), "scenarios": SCENARIOS,
                      "runs": calibration_runs}, timeout=600)  # fmt: skip
    rng = random.Random(seed)
    plan = [(SCENARIOS[i % len(SCENARIOS)], rng.uniform(0, medians[SCENARIOS[i % len(SCENARIOS)]]))
            for i in range(trials)]  # fmt: skip
    chunks = [plan[i::workers] for i in range(workers)]

    def work(index: int) -> list[dict[str, Any]]:
        directory = base / f"worker{index}"
        directory.mkdir()
        try:
            trials = chunks[index]
            out: list[dict[str, Any]] = _child(
                {"mode": "trials", "dir": str(directory), "trials": trials}, timeout=120 + 30 * len(trials)
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a worker that hung or died is a failure
            return [{"scenario": f"worker{index}", "error": str(exc)}]
        return out

    with ThreadPoolExecutor(workers) as pool:
        results = [r for chunk in pool.map(work, range(workers)) for r in chunk]
    counts: dict[str, float] = dict.fromkeys(("trials", "interrupted", *MUST_BE_ZERO), 0)
    failures: list[str] = []
    for r in results:
        counts["trials"] += 1
        if "error" in r:
            counts["errors"] += 1
            failures.append(f"{r['scenario']}: {r['error']}")
            continue
        counts["interrupted"] += r["interrupted"]
        checks = {
            "wrong_bytes": bool(r["wrong"]),
            "unusable": r["usable"] not in (None, "hang"),
            "hangs": r["usable"] == "hang",
            "ledger_mismatches": not r["ledger"],
            "verify_failures": bool(r.get("verify")),
            "heal_failures": not r.get("healed", True),
        }
        for figure, bad in checks.items():
            if bad:
                counts[figure] += 1
                failures.append(f"{r['scenario']}: {figure}: {r}")
    counts["seconds"] = round(time.perf_counter() - started, 1)
    return {**counts, "medians_ms": {k: round(v * 1e3, 1) for k, v in medians.items()}, "failures": failures}
