"""The fault matrix's child: one driver program, run as root, root without DAC override, or ``nobody``.

``run_driver`` runs DRIVER on a cache path in a fresh interpreter, under the
rlimits a fault needs, as the user a case names (``Env`` makes the interpreter,
numpy, packcache and this harness reachable for ``nobody``). The driver runs a
list of steps (a load of a ``Spec``, a pause for the parent to act, touching the
views served so far, ``verify``) and reports JSON; ``check_load`` and friends
turn one load step into the problems found (empty: it passed). ``Case`` is one
row of the matrix (``harness.faults``) as a function of the environment and a
fresh case directory.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import packcache
from harness.child import TESTS_DIR, prelude
from harness.files import snapshot
from harness.packs import KIB, Spec

NOBODY = 65534
FOREIGN_UID = 12345
CHILD_TIMEOUT = 120.0

A, B, C = (1, 64 * KIB), (2, 64 * KIB), (3, 64 * KIB)  # the (seed, nbytes) most cases load
AB: Spec = {"a": A, "b": B}

DRIVER = """
import gc, mmap
args = json.loads(sys.argv[1])
path = args["path"]
limits = args.get("limits", {})
packed(0, 64)  # import numpy.random now: with every descriptor taken, a lazy import fails
hard_as = resource.getrlimit(resource.RLIMIT_AS)[1]
as_limit = None
if "fsize" in limits:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))  # Python ignores SIGXFSZ: EFBIG
if "as_extra" in limits:
    with open("/proc/self/status") as f:
        vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    as_limit = vm_size + limits["as_extra"]
    resource.setrlimit(resource.RLIMIT_AS, (as_limit, hard_as))
hog = []
if "free_fds" in limits:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for _ in range(limits["free_fds"]):
        os.close(hog.pop())

steps = []
cache = None
held, held_spec = {}, {}
for step in args["steps"]:
    kind = step["do"]
    if kind == "pause":
        print("PAUSE", flush=True)
        sys.stdin.readline()
    elif kind == "touch":  # read every byte of every view served so far
        steps.append({"touched": {n: same_pack(a, *held_spec[n]) for n, a in held.items()}})
    elif kind == "release":
        for name in list(held):
            cache.release(name)
        held.clear()
        gc.collect()
    elif kind == "close":
        cache.close()
        cache = None
    elif kind == "verify":
        rep = packcache.verify(path)
        steps.append({"verify": [[p.entry, p.offset, p.message] for p in rep.problems]})
    else:
        if cache is None or step.get("new"):
            if cache is not None:
                cache.close()
            cache = packcache.WeightCache(path, verify=args.get("verify", False), lock_timeout=5)
        before = stats_dict(cache)
        first = len(RECORDS.records)
        served = {}
        with cache.session() as s:
            for name, (seed, nbytes) in step["spec"].items():
                served[name] = s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes))
        after = stats_dict(cache)
        if as_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (hard_as, hard_as))  # room to compare
        same = {name: same_pack(served[name], seed, nbytes) for name, (seed, nbytes) in step["spec"].items()}
        if as_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, hard_as))
        held.update(served)
        held_spec.update(step["spec"])
        del served
        for k in ("hits", "stored", "heap_packs"):
            after[k] -= before[k]
        steps.append({"stats": after, "same": same, "records": RECORDS.records[first:]})
if cache is not None:
    cache.close()
for fd in hog:
    os.close(fd)
print(json.dumps({"steps": steps}))
"""


class Env:
    """One run's resources: a world-traversable work directory, and an interpreter ``nobody`` can run.

    The venv's interpreter usually lives under ``/root`` (mode 0700), which
    ``nobody`` cannot traverse. Then the interpreter's installation
    (``sys.base_prefix``) is bind-mounted read-only inside the work directory and
    run from there, with ``LD_LIBRARY_PATH`` pointing at its ``lib`` (its RUNPATH
    names the unreachable path) and ``PYTHONPATH`` = a world-readable copy of
    the imported ``packcache`` and of ``tests/harness``, then the venv's
    site-packages (numpy). Same binary, same stdlib, same numpy, same packcache source.
    """

    def __init__(self) -> None:
        assert os.geteuid() == 0, "the fault matrix needs root (mounts, setpriv, chown); CI runs as root"
        self.base = Path(tempfile.mkdtemp(prefix="packcache-faults-"))
        os.chmod(self.base, 0o755)
        self._counter = 0
        self._nobody: tuple[list[str], dict[str, str]] | None = None
        self._mounted: Path | None = None

    def case_dir(self, name: str) -> Path:
        self._counter += 1
        path = self.base / f"{self._counter:03d}-{name.replace('/', '-')}"
        path.mkdir(mode=0o755)
        os.chmod(path, 0o755)
        return path

    def close(self) -> None:
        if self._mounted is not None:
            subprocess.run(["umount", str(self._mounted)], capture_output=True)
            self._mounted = None
        shutil.rmtree(self.base, ignore_errors=True)

    def python(self, user: str) -> tuple[list[str], dict[str, str], str]:
        """(argv prefix, environment, directory holding ``harness/``) for a child run as ``user``."""
        env = dict(os.environ)
        if user == "root":
            return [sys.executable], env, TESTS_DIR
        if user == "nodac":
            drop = "-dac_override,-dac_read_search"
            return ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", sys.executable], env, TESTS_DIR
        assert user == "nobody", user
        if self._nobody is None:
            self._nobody = self._nobody_python()
        argv, extra = self._nobody
        return argv, {**env, **extra}, str(self.base / "lib")

    def _nobody_python(self) -> tuple[list[str], dict[str, str]]:
        lib = self.base / "lib"
        pycache = shutil.ignore_patterns("__pycache__")
        shutil.copytree(Path(packcache.__file__).parent, lib / "packcache", ignore=pycache)
        shutil.copytree(Path(TESTS_DIR) / "harness", lib / "harness", ignore=pycache)
        for path in [lib, *lib.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        setpriv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        pythonpath = os.pathsep.join([str(lib), *site.getsitepackages()])
        extra = {"PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1"}
        probe = "import numpy, packcache, harness; print(packcache.__file__)"
        done = subprocess.run(
            [*setpriv, sys.executable, "-c", probe], env={**os.environ, **extra}, capture_output=True, text=True
        )
        if done.returncode == 0:
            return [*setpriv, sys.executable], extra
        prefix = Path(os.path.realpath(sys.base_prefix))
        mounted = self.base / "python"
        mounted.mkdir(mode=0o755)
        subprocess.run(["mount", "--bind", str(prefix), str(mounted)], check=True, capture_output=True)
        self._mounted = mounted
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True, capture_output=True)
        interpreter = mounted / Path(os.path.realpath(sys.executable)).relative_to(prefix)
        extra["LD_LIBRARY_PATH"] = str(mounted / "lib")
        done = subprocess.run(
            [*setpriv, str(interpreter), "-c", probe], env={**os.environ, **extra}, capture_output=True, text=True
        )
        assert done.returncode == 0, f"nobody cannot run {interpreter}: {done.stderr}"
        return [*setpriv, str(interpreter)], extra


@contextlib.contextmanager
def environment() -> Iterator[Env]:
    """An ``Env`` for the duration of the block, its mounts and work directory removed after."""
    env = Env()
    try:
        yield env
    finally:
        env.close()


@dataclass
class ChildResult:
    returncode: int
    steps: list[dict[str, Any]]
    stderr: str

    @property
    def died(self) -> str | None:
        if self.returncode < 0:
            return f"child killed by {signal.Signals(-self.returncode).name}"
        if self.returncode != 0:
            return f"child exited {self.returncode}: {self.stderr.strip()[-600:]}"
        return None


def run_driver(
    env: Env,
    path: Path,
    steps: list[dict[str, Any]],
    *,
    user: str = "root",
    limits: dict[str, int] | None = None,
    verify: bool = False,
    on_pause: list[Callable[[], None]] | None = None,
) -> ChildResult:
    """Run the DRIVER on ``path`` as ``user``; call ``on_pause[i]`` at the i-th pause step."""
    argv, child_env, tests_dir = env.python(user)
    args = {"path": str(path), "steps": steps, "limits": limits or {}, "verify": verify}
    with subprocess.Popen(
        [*argv, "-c", prelude(tests_dir) + DRIVER, json.dumps(args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env,
        cwd=env.base,
    ) as proc:  # fmt: skip
        watchdog = threading.Timer(CHILD_TIMEOUT, proc.kill)  # a hang is a failure, not a stuck run
        watchdog.start()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            pauses = iter(on_pause or [])
            last = ""
            for line in proc.stdout:
                if line == "PAUSE\n":
                    next(pauses)()
                    with contextlib.suppress(BrokenPipeError):
                        proc.stdin.write("go\n")
                        proc.stdin.flush()
                else:
                    last = line
            stderr = proc.stderr.read()
            proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
    result = json.loads(last)["steps"] if proc.returncode == 0 and last else []
    return ChildResult(proc.returncode, result, stderr)


def run_cli(env: Env, *argv: str, user: str = "root", timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m packcache ARGV`` as ``user`` in a fresh interpreter.

    A hang (a FIFO opened for reading blocks forever) is a failure, not a stuck run:
    ``subprocess.TimeoutExpired`` propagates after ``timeout`` seconds, the child killed.
    """
    prefix, child_env, _ = env.python(user)
    return subprocess.run(
        [*prefix, "-m", "packcache", *argv],
        env=child_env,
        cwd=env.base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- checks


def check_load(
    step: dict[str, Any],
    path: Path,
    *,
    hits: int,
    stored: int,
    heap: dict[str, int] | None = None,
    errno: str | None = None,
    errors: tuple[str, ...] = (),
    error_text: str | None = None,
) -> list[str]:
    """What one load step must show; returns the problems found (empty: it passed)."""
    problems = []
    if "same" not in step:
        return [f"not a load step: {step}"]
    wrong = sorted(name for name, same in step["same"].items() if not same)
    if wrong:
        problems.append(f"served arrays differ from pack(): {wrong}")
    st = step["stats"]
    if (st["hits"], st["stored"]) != (hits, stored):
        problems.append(f"hits/stored {st['hits']}/{st['stored']}, expected {hits}/{stored}")
    by_reason = {k: v for k, v in st["heap_bytes_by_reason"].items() if v}
    if by_reason != (heap or {}):
        problems.append(f"heap bytes by reason {by_reason}, expected {heap or {}}")
    expected_errno = 0 if errno is None else getattr(errno_mod, errno)
    if st["errno"] != expected_errno:
        problems.append(f"errno {errno_mod.errorcode.get(st['errno'], st['errno'])}, expected {errno}")
    logged = [message for level, message in step["records"] if level in ("ERROR", "CRITICAL")]
    if error_text is not None:
        if len(logged) != 1 or error_text not in logged[0]:
            problems.append(f"expected one ERROR record with {error_text!r}, got {logged}")
        return problems
    if len(logged) != len(errors):
        problems.append(f"{len(logged)} ERROR records, expected {len(errors)} ({errors}): {logged}")
    for reason in errors:
        match = [m for m in logged if m.startswith(f"packcache: {reason} ")]
        if len(match) != 1:
            problems.append(f"expected one ERROR record for {reason}, got {logged}")
            continue
        if errno is not None and f"[{errno}]" not in match[0]:
            problems.append(f"ERROR record lacks [{errno}]: {match[0]}")
        if str(path) not in match[0]:
            problems.append(f"ERROR record does not name {path}: {match[0]}")
    return problems


def load_step(spec: Spec, *, new: bool = False) -> dict[str, Any]:
    """A driver step loading every pack of ``spec`` in one session (``new``: of a new WeightCache)."""
    return {"do": "load", "spec": {name: list(v) for name, v in spec.items()}, "new": new}


def loaded(env: Env, path: Path, spec: Spec, *, user: str = "root") -> dict[str, Any]:
    """The step of one load of ``spec`` as ``user`` in a driver child, which must not die (for tests)."""
    result = run_driver(env, path, [load_step(spec)], user=user)
    assert result.died is None, result.died
    step: dict[str, Any] = result.steps[0]
    return step


def one_load(result: ChildResult) -> tuple[list[str], dict[str, Any]]:
    """(problems, the load step) of a driver run of one load step."""
    if result.died:
        return [result.died], {}
    return [], result.steps[0]


def unchanged(path: Path, before: Any) -> list[str]:
    return [] if snapshot(path) == before else [f"{path.name} changed although nothing could be stored"]


def no_temp(directory: Path) -> list[str]:
    temps = [p.name for p in directory.iterdir() if ".tmp-" in p.name]
    return [f"temp files left behind: {temps}"] if temps else []


def not_created(path: Path) -> list[str]:
    return [f"{path} was created"] if path.exists() else []


def follow_up(env: Env, path: Path, spec: Spec) -> list[str]:
    """The next load, without the fault, maps every pack the failed run committed."""
    problems, step = one_load(run_driver(env, path, [load_step(spec)]))
    return problems or check_load(step, path, hits=len(spec), stored=0)


@dataclass(frozen=True)
class Case:
    name: str  # fault/phase
    run: Callable[[Env, Path], list[str]]


def run_case(env: Env, item: Case) -> list[str]:
    """Run one case in a fresh case directory; its problems (a harness error is one, not a crashed run)."""
    d = env.case_dir(item.name)
    try:
        return item.run(env, d)
    except Exception as exc:  # a harness error is a failing case, not a crashed run
        return [f"harness error: {exc!r}"]
