"""Fault matrix: real faults at every phase of a cache's life, each load in its own process.

Method. Every case sets up a cache directory (a tiny tmpfs, a read-only bind
mount, a directory owned by someone else, a valid, missing or corrupt file),
then runs the load in a child interpreter: as root, as root with
``CAP_DAC_OVERRIDE``/``CAP_DAC_READ_SEARCH`` dropped, or as the real user
``nobody``, under ``RLIMIT_FSIZE`` / ``RLIMIT_NOFILE`` / ``RLIMIT_AS`` where the
fault needs it. The child reports JSON; the parent checks, per load:

* the child exited cleanly (a SIGBUS or any other death fails the case);
* every served array is bit-identical to ``pack()``;
* hits, stored packs and heap bytes per reason are the expected ones, and so is
  the errno the cache keeps;
* exactly one ERROR record per failing reason, naming the reason, the errno
  and the path (and none when nothing failed);
* what must survive did: a failed rebuild or append leaves the old file
  byte-identical, a failed build leaves no file and no temp file.

Phases: ``open`` (first session on a missing file), ``build`` (a fresh build
that fails mid-way), ``append`` (new packs for a valid cache), ``rebuild``
(replacing a corrupt file). Faults: ENOSPC (tmpfs ``size=``), inode
exhaustion (tmpfs ``nr_inodes=``: this kernel has no ``CONFIG_TMPFS_QUOTA``, so
``usrquota_block_hardlimit`` is refused and EDQUOT cannot be made for real;
inode exhaustion is the quota-like fault that remains, and gives ENOSPC on
create), EFBIG (``RLIMIT_FSIZE``), EACCES (``nobody``; root without DAC
override), EROFS (read-only bind mount), EMFILE (``RLIMIT_NOFILE``), mapping
failure (``RLIMIT_AS``), the file replaced, deleted or truncated by another
process while a reader has it mapped, and random bit flips in header, index
and data (data flips with ``verify=True``, and ``packcache.verify`` must name
the entry and offset: opening never reads data pages, by design).

Truncation of a file a reader has mapped is SIGBUS for any mmap user (kernel
behaviour); packcache never truncates, and detects a truncated file at the next
session or open. The matrix checks exactly that, and runs one child that does
touch a view after an external truncation: it is reported as a documented
limit, not counted as a pass.

Prints one summary line (plus one line per failing case) and exits 1 on any
failure. Needs root (mounts, setpriv, chown).

Usage: python stress/faults.py [--flips 24] [--only SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import contextlib
import errno as errno_mod
import json
import os
import random
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _helpers import CHILD_PRELUDE, KIB, MIB, TESTS_DIR, fill, packed, read_only_bind, tmpfs, two_appenders  # noqa: E402
from _helpers import run_child as run_plain_child  # noqa: E402
from packcache import WeightCache  # noqa: E402
from packcache import format as fmt  # noqa: E402

Spec = dict[str, tuple[int, int]]  # name -> (seed, nbytes) of packed()
NOBODY = 65534
FOREIGN_UID = 12345
CHILD_TIMEOUT = 120.0

# --------------------------------------------------------------------------- the child

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
        steps.append({"touched": {n: a.tobytes() == packed(*held_spec[n]).tobytes() for n, a in held.items()}})
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
        same = {}
        for name, (seed, nbytes) in step["spec"].items():
            expected = packed(seed, nbytes)
            arr = served[name]
            same[name] = (arr.dtype, arr.shape, arr.tobytes()) == (expected.dtype, expected.shape, expected.tobytes())
            del expected
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
    ``src/packcache`` and ``tests/_helpers.py``, then the venv's site-packages
    (numpy). Same binary, same stdlib, same numpy, same packcache source.
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
        """(argv prefix, environment, directory holding ``_helpers.py``) for a child run as ``user``."""
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
        shutil.copytree(ROOT / "src" / "packcache", lib / "packcache", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(Path(TESTS_DIR) / "_helpers.py", lib / "_helpers.py")
        for path in [lib, *lib.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        setpriv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        pythonpath = os.pathsep.join([str(lib), *site.getsitepackages()])
        extra = {"PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1"}
        probe = "import numpy, packcache; print(packcache.__file__)"
        done = subprocess.run([*setpriv, sys.executable, "-c", probe], env={**os.environ, **extra}, capture_output=True)
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


def run_child(
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
    argv, child_env, helpers_dir = env.python(user)
    prelude = CHILD_PRELUDE.replace(repr(TESTS_DIR), repr(helpers_dir))
    args = {"path": str(path), "steps": steps, "limits": limits or {}, "verify": verify}
    with subprocess.Popen(
        [*argv, "-c", prelude + DRIVER, json.dumps(args)],
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
    return {"do": "load", "spec": {name: list(v) for name, v in spec.items()}, "new": new}


def one_load(result: ChildResult) -> tuple[list[str], dict[str, Any]]:
    if result.died:
        return [result.died], {}
    return [], result.steps[0]


def build(path: Path, spec: Spec, **options: Any) -> None:
    """A valid cache holding ``spec`` (built in this process)."""
    with WeightCache(path, **options) as cache, cache.session() as s:
        for name, (seed, nbytes) in spec.items():
            s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed, nbytes))


def garbage(path: Path, nbytes: int, mode: int = 0o600) -> None:
    path.write_bytes(random.Random(nbytes).randbytes(nbytes))
    os.chmod(path, mode)


def snapshot(path: Path) -> tuple[int, int, int, bytes] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, path.read_bytes()


def unchanged(path: Path, before: Any) -> list[str]:
    return [] if snapshot(path) == before else [f"{path.name} changed although nothing could be stored"]


def no_temp(directory: Path) -> list[str]:
    temps = [p.name for p in directory.iterdir() if ".tmp-" in p.name]
    return [f"temp files left behind: {temps}"] if temps else []


def follow_up(env: Env, path: Path, spec: Spec) -> list[str]:
    """The next load, without the fault, maps every pack the failed run committed."""
    problems, step = one_load(run_child(env, path, [load_step(spec)]))
    return problems or check_load(step, path, hits=len(spec), stored=0)


# --------------------------------------------------------------------------- the cases

A, B, C = (1, 64 * KIB), (2, 64 * KIB), (3, 64 * KIB)
AB: Spec = {"a": A, "b": B}


@dataclass(frozen=True)
class Case:
    name: str  # fault/phase
    run: Callable[[Env, Path], list[str]]


CASES: list[Case] = []


def case(name: str) -> Callable[[Callable[[Env, Path], list[str]]], Callable[[Env, Path], list[str]]]:
    def register(func: Callable[[Env, Path], list[str]]) -> Callable[[Env, Path], list[str]]:
        CASES.append(Case(name, func))
        return func

    return register


# ENOSPC: a 1 MiB tmpfs.


@case("enospc/open")
def _enospc_open(env: Env, d: Path) -> list[str]:
    with tmpfs(d / "mnt", "1m") as mnt:
        fill(mnt, leave_free=0)
        path = mnt / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step(AB)]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"no_space": 128 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + no_temp(mnt) + ([f"{path} was created"] if path.exists() else [])


@case("enospc/build")
def _enospc_build(env: Env, d: Path) -> list[str]:
    small: Spec = {f"small{i}": (i, 128 * KIB) for i in range(3)}
    spec = {**small, "big": (10, 768 * KIB), "late": (20, 64 * KIB)}
    with tmpfs(d / "mnt", "1m") as mnt:
        path = mnt / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step(spec)]))
        problems += step and check_load(
            step, path, hits=0, stored=4, heap={"no_space": 768 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + no_temp(mnt) + follow_up(env, path, {**small, "late": spec["late"]})


@case("enospc/append")
def _enospc_append(env: Env, d: Path) -> list[str]:
    present: Spec = {"a": (0, 128 * KIB), "b": (1, 128 * KIB)}
    with tmpfs(d / "mnt", "1m") as mnt:
        path = mnt / "model.pcache"
        build(path, present)
        fill(mnt, leave_free=96 * KIB)
        before = snapshot(path)
        problems, step = one_load(run_child(env, path, [load_step({**present, "c": (2, 256 * KIB)})]))
        problems += step and check_load(
            step, path, hits=2, stored=0, heap={"no_space": 256 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + unchanged(path, before) + no_temp(mnt)


@case("enospc/rebuild")
def _enospc_rebuild(env: Env, d: Path) -> list[str]:
    with tmpfs(d / "mnt", "1m") as mnt:
        path = mnt / "model.pcache"
        garbage(path, 256 * KIB)
        fill(mnt, leave_free=64 * KIB)
        before = snapshot(path)
        problems, step = one_load(run_child(env, path, [load_step({"c": (2, 128 * KIB)})]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"no_space": 128 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + unchanged(path, before) + no_temp(mnt)


# Inode exhaustion (tmpfs nr_inodes=; the mount's root directory takes one): ENOSPC on create.


@case("inodes/open")
def _inodes_open(env: Env, d: Path) -> list[str]:
    """No inode for the lock file: creating any file fails, which is running out of space."""
    with tmpfs(d / "mnt", "8m,nr_inodes=1") as mnt:
        path = mnt / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step(AB)]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"no_space": 128 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + ([f"{path} was created"] if path.exists() else [])


@case("inodes/build")
def _inodes_build(env: Env, d: Path) -> list[str]:
    """The lock file fits, the new cache file (a temp file) does not."""
    with tmpfs(d / "mnt", "8m,nr_inodes=2") as mnt:
        path = mnt / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step(AB)]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"no_space": 128 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + no_temp(mnt) + ([f"{path} was created"] if path.exists() else [])


@case("inodes/append")
def _inodes_append(env: Env, d: Path) -> list[str]:
    """Every inode used (root, cache file, lock file): appending needs none and must just work."""
    with tmpfs(d / "mnt", "8m,nr_inodes=3") as mnt:
        path = mnt / "model.pcache"
        build(path, AB)
        problems, step = one_load(run_child(env, path, [load_step({**AB, "c": C})]))
        problems += step and check_load(step, path, hits=2, stored=1)
        return problems + follow_up(env, path, {**AB, "c": C})


@case("inodes/rebuild")
def _inodes_rebuild(env: Env, d: Path) -> list[str]:
    with tmpfs(d / "mnt", "8m,nr_inodes=3") as mnt:
        path = mnt / "model.pcache"
        garbage(path, 20 * KIB)
        Path(str(path) + ".lock").touch(mode=0o600)
        before = snapshot(path)
        problems, step = one_load(run_child(env, path, [load_step(AB)]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"no_space": 128 * KIB}, errno="ENOSPC", errors=("no_space",)
        )
        return problems + unchanged(path, before) + no_temp(mnt)


# EFBIG: RLIMIT_FSIZE in the child.


@case("efbig/open")
def _efbig_open(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    problems, step = one_load(run_child(env, path, [load_step(AB)], limits={"fsize": 2048}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"no_space": 128 * KIB}, errno="EFBIG", errors=("no_space",)
    )
    return problems + no_temp(d) + ([f"{path} was created"] if path.exists() else [])


@case("efbig/build")
def _efbig_build(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    small: Spec = {"small0": (0, 32 * KIB), "small1": (1, 32 * KIB), "small2": (3, 32 * KIB)}
    spec = {"small0": small["small0"], "small1": small["small1"], "big": (2, 512 * KIB), "small2": small["small2"]}
    problems, step = one_load(run_child(env, path, [load_step(spec)], limits={"fsize": 256 * KIB}))
    problems += step and check_load(
        step, path, hits=0, stored=3, heap={"no_space": 512 * KIB}, errno="EFBIG", errors=("no_space",)
    )
    return problems + no_temp(d) + follow_up(env, path, small)


@case("efbig/append")
def _efbig_append(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    build(path, {"a": A})
    limit = path.stat().st_size + 32 * KIB
    spec: Spec = {"a": A, "big": (5, 128 * KIB), "d": (6, 8 * KIB)}
    problems, step = one_load(run_child(env, path, [load_step(spec)], limits={"fsize": limit}))
    problems += step and check_load(
        step, path, hits=1, stored=1, heap={"no_space": 128 * KIB}, errno="EFBIG", errors=("no_space",)
    )
    return problems + follow_up(env, path, {"a": A, "d": (6, 8 * KIB)})


@case("efbig/rebuild")
def _efbig_rebuild(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    garbage(path, 20 * KIB)
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step({"c": (2, 16 * KIB)})], limits={"fsize": 12 * KIB}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"no_space": 16 * KIB}, errno="EFBIG", errors=("no_space",)
    )
    return problems + unchanged(path, before) + no_temp(d)


# EACCES: the real user nobody, or root with its DAC override dropped.


@case("eacces-nobody/open")
def _eacces_nobody_open(env: Env, d: Path) -> list[str]:
    """nobody, missing file in a root-owned 0755 directory: nothing can be created."""
    path = d / "model.pcache"
    problems, step = one_load(run_child(env, path, [load_step(AB)], user="nobody"))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EACCES", errors=("open_failed",)
    )
    return problems + ([f"{sorted(os.listdir(d))} created"] if os.listdir(d) else [])


@case("eacces-nodac/open")
def _eacces_nodac_open(env: Env, d: Path) -> list[str]:
    """root without CAP_DAC_OVERRIDE, missing file in a directory of another user (0755)."""
    os.chown(d, FOREIGN_UID, FOREIGN_UID)
    path = d / "model.pcache"
    problems, step = one_load(run_child(env, path, [load_step(AB)], user="nodac"))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EACCES", errors=("open_failed",)
    )
    return problems + ([f"{sorted(os.listdir(d))} created"] if os.listdir(d) else [])


@case("eacces-nobody/append")
def _eacces_nobody_append(env: Env, d: Path) -> list[str]:
    """nobody, a valid root-owned 0644 cache (trusted: root-owned): hits map, misses are read_only."""
    path = d / "model.pcache"
    build(path, AB, file_mode=0o644)
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step({**AB, "c": C})], user="nobody"))
    problems += step and check_load(
        step, path, hits=2, stored=0, heap={"read_only": 64 * KIB}, errno="EACCES", errors=("read_only",)
    )
    return problems + unchanged(path, before)


@case("eacces-nodac/append")
def _eacces_nodac_append(env: Env, d: Path) -> list[str]:
    """root without CAP_DAC_OVERRIDE, a valid root-owned 0444 cache: hits map, misses are read_only."""
    path = d / "model.pcache"
    build(path, AB)
    os.chmod(path, 0o444)
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step({**AB, "c": C})], user="nodac"))
    problems += step and check_load(
        step, path, hits=2, stored=0, heap={"read_only": 64 * KIB}, errno="EACCES", errors=("read_only",)
    )
    return problems + unchanged(path, before)


@case("eacces-nobody/rebuild")
def _eacces_nobody_rebuild(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    garbage(path, 20 * KIB, mode=0o644)
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step(AB)], user="nobody"))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"read_only": 128 * KIB}, errno="EACCES", errors=("read_only",)
    )
    return problems + unchanged(path, before) + no_temp(d)


# EROFS: a read-only bind mount.


@case("erofs/open")
def _erofs_open(env: Env, d: Path) -> list[str]:
    (d / "src").mkdir()
    with read_only_bind(d / "src", d / "ro") as ro:
        path = ro / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step(AB)]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EROFS", errors=("open_failed",)
        )
    return problems


@case("erofs/append")
def _erofs_append(env: Env, d: Path) -> list[str]:
    build(d / "src" / "model.pcache", AB)
    with read_only_bind(d / "src", d / "ro") as ro:
        path = ro / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step({**AB, "c": C})]))
        problems += step and check_load(
            step, path, hits=2, stored=0, heap={"read_only": 64 * KIB}, errno="EROFS", errors=("read_only",)
        )
    return problems


@case("erofs/rebuild")
def _erofs_rebuild(env: Env, d: Path) -> list[str]:
    (d / "src").mkdir()
    garbage(d / "src" / "model.pcache", 20 * KIB)
    with read_only_bind(d / "src", d / "ro") as ro:
        path = ro / "model.pcache"
        problems, step = one_load(run_child(env, path, [load_step(AB)]))
        problems += step and check_load(
            step, path, hits=0, stored=0, heap={"read_only": 128 * KIB}, errno="EROFS", errors=("read_only",)
        )
    return problems


# EMFILE: RLIMIT_NOFILE, with every descriptor but ``free_fds`` taken.


@case("emfile/open")
def _emfile_open(env: Env, d: Path) -> list[str]:
    """No descriptor for the lock file of a new cache."""
    path = d / "model.pcache"
    problems, step = one_load(run_child(env, path, [load_step(AB)], limits={"free_fds": 0}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EMFILE", errors=("open_failed",)
    )
    return problems


@case("emfile/open-existing")
def _emfile_open_existing(env: Env, d: Path) -> list[str]:
    """No descriptor to open a valid cache file: every request goes to heap."""
    path = d / "model.pcache"
    build(path, AB)
    problems, step = one_load(run_child(env, path, [load_step(AB)], limits={"free_fds": 0}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EMFILE", errors=("open_failed",)
    )
    return problems


@case("emfile/build")
def _emfile_build(env: Env, d: Path) -> list[str]:
    """One descriptor: the lock file opens, the new cache file cannot be created."""
    path = d / "model.pcache"
    problems, step = one_load(run_child(env, path, [load_step(AB)], limits={"free_fds": 1}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EMFILE", errors=("open_failed",)
    )
    return problems + no_temp(d) + ([f"{path} was created"] if path.exists() else [])


@case("emfile/append")
def _emfile_append(env: Env, d: Path) -> list[str]:
    """One descriptor: the file (its mappings keep none), none for the lock file."""
    path = d / "model.pcache"
    build(path, AB)
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step({**AB, "c": C})], limits={"free_fds": 1}))
    problems += step and check_load(
        step, path, hits=2, stored=0, heap={"open_failed": 64 * KIB}, errno="EMFILE", errors=("open_failed",)
    )
    return problems + unchanged(path, before)


@case("emfile/rebuild")
def _emfile_rebuild(env: Env, d: Path) -> list[str]:
    """Two descriptors: the corrupt file and the lock file, none for the new file."""
    path = d / "model.pcache"
    garbage(path, 20 * KIB)
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step(AB)], limits={"free_fds": 2}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"open_failed": 128 * KIB}, errno="EMFILE", errors=("open_failed",)
    )
    return problems + unchanged(path, before) + no_temp(d)


# Mapping failure: RLIMIT_AS.


@case("map/append")
def _map_append(env: Env, d: Path) -> list[str]:
    """A 64 MiB file cannot be mapped: its hits are packed to heap (map_failed)."""
    path = d / "model.pcache"
    spec: Spec = {"small0": (0, 4 * KIB), "small1": (1, 4 * KIB)}
    build(path, {"big": (9, 64 * MIB), **spec})
    before = snapshot(path)
    problems, step = one_load(run_child(env, path, [load_step(spec)], limits={"as_extra": 16 * MIB}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"map_failed": 8 * KIB}, errno="ENOMEM", errors=("map_failed",)
    )
    return problems + unchanged(path, before)


@case("map/build")
def _map_build(env: Env, d: Path) -> list[str]:
    """A fresh 64 MiB pack is written but cannot be mapped: served from heap, committed for the next load."""
    path = d / "model.pcache"
    spec: Spec = {"big": (9, 64 * MIB)}
    problems, step = one_load(run_child(env, path, [load_step(spec)], limits={"as_extra": 88 * MIB}))
    problems += step and check_load(
        step, path, hits=0, stored=0, heap={"map_failed": 64 * MIB}, errno="ENOMEM", errors=("map_failed",)
    )
    return problems + follow_up(env, path, spec)


# Attacks on the lock file and on the spelling of the path (docs/RELIABILITY.md "Attacks").


def _planted_lock(env: Env, d: Path, plant: Callable[[Path], None], what: str) -> list[str]:
    path = d / "model.pcache"
    build(path, AB)
    before = snapshot(path)
    lock = Path(str(path) + ".lock")
    lock.unlink()  # the build left its own lock file: the attacker replaces it
    plant(lock)
    problems, step = one_load(run_child(env, path, [load_step({**AB, "c": C})]))
    problems += step and check_load(step, path, hits=2, stored=0, heap={"untrusted": 64 * KIB}, errors=("untrusted",))
    logged = [m for level, m in step.get("records", []) if level == "ERROR"]
    if step and not any(what in m for m in logged):
        problems.append(f"the ERROR record does not say the lock file is {what}: {logged}")
    return problems + unchanged(path, before)


@case("lock/fifo")
def _lock_fifo(env: Env, d: Path) -> list[str]:
    """A FIFO planted at the lock path: refused (never opened blocking, never flock-ed)."""
    return _planted_lock(env, d, lambda p: os.mkfifo(p, 0o600), "FIFO")


@case("lock/symlink")
def _lock_symlink(env: Env, d: Path) -> list[str]:
    """A symlink planted at the lock path (to a file the attacker wants created or locked)."""
    return _planted_lock(env, d, lambda p: p.symlink_to(d / "victim"), "symlink")


@case("lock/foreign-owner")
def _lock_foreign(env: Env, d: Path) -> list[str]:
    """A lock file owned by another user, who could hold it forever."""

    def plant(p: Path) -> None:
        p.write_bytes(b"")
        os.chown(p, FOREIGN_UID, FOREIGN_UID)
        os.chmod(p, 0o600)

    return _planted_lock(env, d, plant, f"owned by uid {FOREIGN_UID}")


def _appenders(d: Path, how: str) -> list[str]:
    """Two processes append to one file through two spellings of its path: nothing served changes."""
    real = d / "real" / "model.pcache"
    real.parent.mkdir(mode=0o700)
    build(real, AB)
    other = {"symlink": d / "link.pcache", "hardlink": d / "real" / "hard.pcache"}.get(how, real)
    if how == "symlink":
        other.symlink_to(real)
    elif how == "hardlink":
        os.link(real, other)
    try:
        result_a, result_b = two_appenders(real, other, d, delete_lock=how == "deleted-lock")
    except (AssertionError, ValueError, subprocess.TimeoutExpired) as exc:
        return [f"appenders failed: {exc!r}"]
    problems = [f"appender {n} was served changed bytes: {r['same']}" for n, r in (("a", result_a), ("b", result_b))
                if r["same"] != [True, True]]  # fmt: skip
    from packcache import verify

    report = verify(real)
    problems += [f"verify: {p}" for p in report.problems]
    if report.entries != 6:
        problems.append(f"the file holds {report.entries} entries, expected 6 (both appenders' packs kept)")
    return problems


@case("spelling/symlink")
def _spelling_symlink(env: Env, d: Path) -> list[str]:
    return _appenders(d, "symlink")


@case("spelling/hardlink")
def _spelling_hardlink(env: Env, d: Path) -> list[str]:
    return _appenders(d, "hardlink")


@case("spelling/deleted-lock")
def _spelling_deleted_lock(env: Env, d: Path) -> list[str]:
    return _appenders(d, "deleted-lock")


@case("emfile/many-packs")
def _emfile_many_packs(env: Env, d: Path) -> list[str]:
    """1,100 packs with three spare descriptors (lock, new file, its directory): none per pack."""
    path = d / "model.pcache"
    spec: Spec = {f"p{i}": (i, 4 * KIB) for i in range(1100)}
    problems, step = one_load(run_child(env, path, [load_step(spec)], limits={"free_fds": 3}))
    problems += step and check_load(step, path, hits=0, stored=1100)
    return problems + follow_up(env, path, spec)


INDEX_CAP_CHILD = """
path = sys.argv[1]
key = {"pad": "k" * 65000}
cache = packcache.WeightCache(path)
with cache.session() as s:
    for i in range(4200):
        s.get_or_pack(f"{i:05d}" + "n" * 1000, lambda i=i: packed(i, 64), key)
first = stats_dict(cache)
cache.close()
cache = packcache.WeightCache(path)
with cache.session() as s:
    for i in range(4200):
        s.get_or_pack(f"{i:05d}" + "n" * 1000, lambda i=i: packed(i, 64), key)
report(first=first, second=stats_dict(cache))
"""


@case("caps/index")
def _caps_index(env: Env, d: Path) -> list[str]:
    """4,200 entries of long names and 65 KB keys: more than the 256 MiB index readers accept."""
    path = d / "model.pcache"
    try:
        out = run_plain_child(INDEX_CAP_CHILD, str(path))
    except AssertionError as exc:
        return [str(exc)[-600:]]
    first, second = out["first"], out["second"]
    problems = []
    if not (0 < first["stored"] < 4200 and first["heap_bytes_by_reason"]["no_space"] > 0):
        problems.append(f"first load: {first['stored']} stored, heap {first['heap_bytes_by_reason']}")
    if first["errno"] != errno_mod.EFBIG:
        problems.append(f"errno {first['errno']}, expected EFBIG: {first['error']}")
    if second["hits"] != first["stored"] or second["stored"] != 0 or second["written_bytes"] != 0:
        problems.append(f"second load did not map what the first committed: {second}")
    return problems


# Another process replaces, deletes or truncates the file while a reader has it mapped.

ABC: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB), "c": (3, 16 * KIB)}


def _touched_ok(result: ChildResult, index: int) -> list[str]:
    touched = result.steps[index].get("touched", {})
    bad = sorted(name for name, ok in touched.items() if not ok)
    return [f"views served before changed: {bad}"] if bad or not touched else []


@case("replace/mapped")
def _replace_mapped(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    build(path, ABC)
    d_pack: Spec = {"d": (4, 16 * KIB)}

    def replace() -> None:  # another process's valid cache, other layout, renamed over the path
        other = d / "other.pcache"
        build(other, {**d_pack, **dict(reversed(ABC.items()))}, alignment=4096)
        os.rename(other, path)

    steps = [load_step(ABC), {"do": "pause"}, {"do": "touch"}, load_step({**ABC, **d_pack}),
             load_step({**ABC, **d_pack}, new=True)]  # fmt: skip
    result = run_child(env, path, steps, on_pause=[replace])
    if result.died:
        return [result.died]
    problems = check_load(result.steps[0], path, hits=3, stored=0) + _touched_ok(result, 1)
    # Same instance: the held views of a, b, c stay valid for whoever holds them, but the cache
    # serves every request from the file now at the path, so all four map from the new file.
    problems += check_load(result.steps[2], path, hits=4, stored=0)
    return problems + check_load(result.steps[3], path, hits=4, stored=0)


@case("replace-corrupt/mapped")
def _replace_corrupt_mapped(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    build(path, ABC)

    def replace() -> None:
        garbage(d / "other", 40 * KIB)
        os.rename(d / "other", path)

    steps = [load_step(ABC), {"do": "pause"}, {"do": "touch"}, load_step(ABC, new=True)]
    result = run_child(env, path, steps, on_pause=[replace])
    if result.died:
        return [result.died]
    problems = check_load(result.steps[0], path, hits=3, stored=0) + _touched_ok(result, 1)
    return problems + check_load(result.steps[2], path, hits=0, stored=3) + follow_up(env, path, ABC)


@case("delete/mapped")
def _delete_mapped(env: Env, d: Path) -> list[str]:
    path = d / "model.pcache"
    build(path, ABC)
    steps = [load_step(ABC), {"do": "pause"}, {"do": "touch"}, load_step(ABC, new=True)]
    result = run_child(env, path, steps, on_pause=[path.unlink])
    if result.died:
        return [result.died]
    problems = check_load(result.steps[0], path, hits=3, stored=0) + _touched_ok(result, 1)
    return problems + check_load(result.steps[2], path, hits=0, stored=3) + follow_up(env, path, ABC)


def _truncate(path: Path) -> Callable[[], None]:
    return lambda: os.truncate(path, path.stat().st_size // 2)


@case("truncate/next-open")
def _truncate_next_open(env: Env, d: Path) -> list[str]:
    """Truncated by another process before this process opens it: rebuilt as a new file."""
    path = d / "model.pcache"
    build(path, ABC)
    _truncate(path)()
    problems, step = one_load(run_child(env, path, [load_step(ABC)]))
    return problems + (step and check_load(step, path, hits=0, stored=3)) + follow_up(env, path, ABC)


@case("truncate/next-session-released")
def _truncate_next_session_released(env: Env, d: Path) -> list[str]:
    """Same instance: the reader released its views, the file is truncated, the next session rebuilds."""
    path = d / "model.pcache"
    build(path, ABC)
    steps = [load_step(ABC), {"do": "release"}, {"do": "pause"}, load_step(ABC)]
    result = run_child(env, path, steps, on_pause=[_truncate(path)])
    if result.died:
        return [result.died]
    problems = check_load(result.steps[0], path, hits=3, stored=0)
    return problems + check_load(result.steps[1], path, hits=0, stored=3) + follow_up(env, path, ABC)


@case("truncate/next-session-held")
def _truncate_next_session_held(env: Env, d: Path) -> list[str]:
    """Same instance, views still held by the cache, the file truncated between sessions.

    The application never touches the old views; the next session must serve
    correct bytes without SIGBUS (so it must not hand out views of the truncated pages again).
    """
    path = d / "model.pcache"
    build(path, ABC)
    steps = [load_step(ABC), {"do": "pause"}, load_step(ABC)]
    result = run_child(env, path, steps, on_pause=[_truncate(path)])
    if result.died:
        return [result.died]
    return check_load(result.steps[0], path, hits=3, stored=0) + check_load(result.steps[1], path, hits=0, stored=3)


def truncate_while_mapped_limit(env: Env) -> str:
    """Documented limit: touching a view after another process truncated the file. Returns what happened."""
    d = env.case_dir("limit-truncate-touch")
    path = d / "model.pcache"
    build(path, ABC)
    result = run_child(env, path, [load_step(ABC), {"do": "pause"}, {"do": "touch"}], on_pause=[_truncate(path)])
    return result.died or "the child survived touching truncated pages"


# Entry points (compact, verify, inspect, gc, the CLI) under the attacks of issue 10: each command
# runs as a fresh process (as root or as nobody) with a time bound, so a hang fails the case.

ENTRY_COMMANDS = ("inspect", "verify", "compact")


def _superseded(path: Path) -> None:
    """A cache holding AB whose first versions were replaced: compaction has bytes to reclaim."""
    with WeightCache(path) as cache, cache.session() as s:
        for name, (seed, nbytes) in AB.items():
            s.get_or_pack(name, lambda seed=seed, nbytes=nbytes: packed(seed + 100, nbytes), key={"old": True})
    build(path, AB)


def _one_line_failure(done: subprocess.CompletedProcess[str], needle: str) -> list[str]:
    said = done.stdout + done.stderr
    if done.returncode != 1 or "Traceback" in said or needle not in said:
        return [f"expected exit 1 naming {needle!r}, got {done.returncode}: {said.strip()[-300:]}"]
    return []


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


@case("entry-compact/foreign-owner")
def _entry_compact_foreign(env: Env, d: Path) -> list[str]:
    """A file planted by another user: root's and nobody's compact refuse it, nothing is written."""
    path = d / "model.pcache"
    _superseded(path)
    os.chown(path, FOREIGN_UID, FOREIGN_UID)
    os.chmod(path, 0o644)
    before = snapshot(path)
    problems = []
    for user in ("root", "nobody"):
        problems += _one_line_failure(run_cli(env, "compact", str(path), user=user), "owned by uid 12345")
    done = run_cli(env, "verify", str(path))
    problems += _one_line_failure(done, "untrusted: owned by uid 12345")
    return problems + unchanged(path, before) + no_temp(d)


@case("entry-compact/service-group")
def _entry_compact_service_group(env: Env, d: Path) -> list[str]:
    """root:nobody 0640, mapped by nobody through its group: still mapped after root compacts it."""
    path = d / "model.pcache"
    _superseded(path)
    os.chown(path, 0, NOBODY)
    os.chmod(path, 0o640)
    problems, step = one_load(run_child(env, path, [load_step(AB)], user="nobody"))
    problems += step and check_load(step, path, hits=2, stored=0)
    done = run_cli(env, "compact", str(path))
    if done.returncode != 0:
        return [*problems, f"compact failed: {done.stderr.strip()}"]
    st = os.stat(path)
    if (st.st_uid, st.st_gid, st.st_mode & 0o7777) != (0, NOBODY, 0o640):
        problems.append(f"owner/mode after compact {st.st_uid}:{st.st_gid} {st.st_mode & 0o7777:o}")
    more, step = one_load(run_child(env, path, [load_step(AB)], user="nobody"))
    return problems + more + (step and check_load(step, path, hits=2, stored=0))


@case("entry-compact/symlink-meets-the-lock")
def _entry_compact_symlink(env: Env, d: Path) -> list[str]:
    """A builder holds the real file's lock: compact through a symlink waits for that lock, then keeps the link."""
    real = d / "real" / "model.pcache"
    real.parent.mkdir()
    _superseded(real)
    link = d / "link.pcache"
    link.symlink_to(real)
    with subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\nsys.stdin.read()", f"{real}.lock"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdout.readline()
        problems = _one_line_failure(run_cli(env, "compact", str(link), "--lock-timeout", "0.2"), "build lock")
        holder.stdin.close()
        holder.wait(CHILD_TIMEOUT)
    done = run_cli(env, "compact", str(link))
    if done.returncode != 0 or not link.is_symlink() or _temps(d) or _temps(real.parent):
        problems.append(
            f"compact through the link: {done.returncode} {done.stderr.strip()}, link kept {link.is_symlink()}"
        )
    return problems + follow_up(env, link, AB)


@case("entry-compact/last-generation")
def _entry_compact_last_generation(env: Env, d: Path) -> list[str]:
    """A valid file at generation 2**64-2 compacts (restarting at 1) and keeps serving hits."""
    from packcache._store import read_committed

    path = d / "model.pcache"
    _superseded(path)
    raw = bytearray(path.read_bytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        slot = read_committed(fd)[1]
    finally:
        os.close(fd)
    assert slot is not None
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
        return _one_line_failure(done, "not a regular file (a FIFO)") + (
            [f"left behind: {leftovers}"] if leftovers else []
        )

    return Case(f"entry-fifo-{user}/{command}", run)


CASES += [_fifo_case(command, user) for command in ENTRY_COMMANDS for user in ("root", "nobody")]


@case("entry-gc/fifo-at-lock")
def _entry_gc_fifo_lock(env: Env, d: Path) -> list[str]:
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


@case("entry-gc/live-builder")
def _entry_gc_live_builder(env: Env, d: Path) -> list[str]:
    """A builder mid-build (temp file written, lock held); gc as root runs; the build still commits."""
    path = d / "model.pcache"
    code = (
        "cache = packcache.WeightCache(sys.argv[1])\nwith cache.session() as s:\n"
        "    s.get_or_pack('a', lambda: packed(1))\n    print('building', flush=True)\n    sys.stdin.readline()\n"
        "    s.get_or_pack('b', lambda: packed(2))\nreport(**stats_dict(cache))\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + code, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as builder:
        assert builder.stdin is not None and builder.stdout is not None
        builder.stdout.readline()
        temps = _temps(d)
        gc_run = run_cli(env, "gc", str(d), "--max-bytes", "0")
        problems = [] if _temps(d) == temps and len(temps) == 1 else [f"temp files {temps} -> {_temps(d)}"]
        builder.stdin.write("go\n")
        builder.stdin.close()
        out = builder.stdout.read()
        builder.wait(CHILD_TIMEOUT)
    stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    if (stats.get("state"), stats.get("stored"), stats.get("errno")) != ("stored", 2, 0):
        problems.append(f"the builder's commit failed after gc ({gc_run.stdout.strip()[-200:]}): {stats}")
    return problems + follow_up(env, path, {"a": (1, 4 * KIB), "b": (2, 4 * KIB)})


@case("entry-gc/planted-names-and-owners")
def _entry_gc_planted(env: Env, d: Path) -> list[str]:
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


@case("entry-run/hostile-model")
def _entry_run_hostile_model(env: Env, d: Path) -> list[str]:
    """'packcache run --model' on deep JSON, a dtype list and a FIFO: one FormatError/refusal line each."""
    from packcache.models import minilm

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
        problems += _one_line_failure(done, f"{d / name}: offset ")
    os.mkfifo(d / "fifo.safetensors")
    try:
        done = run_cli(env, "run", "--model", str(d / "fifo.safetensors"), "--cache-dir", str(d / "cache"), timeout=90)
    except subprocess.TimeoutExpired:
        return [*problems, "packcache run --model hung on a FIFO"]
    return problems + _one_line_failure(done, "not a regular file (a FIFO)")


# Random bit flips in header, index and data.

FLIP_SPEC: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB), "c": (3, 8 * KIB)}


def _two_generations(path: Path) -> None:
    build(path, {"a": FLIP_SPEC["a"], "b": FLIP_SPEC["b"]})
    build(path, {"c": FLIP_SPEC["c"]})


def _flip(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _committed(path: Path) -> tuple[fmt.Slot, dict[str, fmt.Entry]]:
    from packcache._store import read_committed

    fd = os.open(path, os.O_RDONLY)
    try:
        _, slot, entries = read_committed(fd)
    finally:
        os.close(fd)
    assert slot is not None
    return slot, entries


def flip_case(region: str, seed: int) -> Case:
    def run(env: Env, d: Path) -> list[str]:
        rng = random.Random(f"{region}-{seed}")
        path = d / "model.pcache"
        _two_generations(path)
        slot, entries = _committed(path)
        if region == "header":
            offset = rng.randrange(fmt.HEADER_READ_SIZE)
        elif region == "index":
            offset = rng.randrange(slot.index_offset, slot.committed_end)
        else:
            entry = entries[rng.choice(sorted(entries))]
            offset = rng.randrange(entry.offset, entry.offset + entry.nbytes)
        bit = rng.randrange(8)
        _flip(path, offset, bit)
        where = f"byte {offset} bit {bit}"
        if region != "data":
            problems, step = one_load(run_child(env, path, [load_step(FLIP_SPEC)]))
            if problems:
                return [f"{where}: {p}" for p in problems]
            st = step["stats"]
            # A valid open (flip in a byte readers ignore, or fallback to the older generation, then append)
            # or a rebuild; never a heap pack, an error, or a wrong byte.
            problems = check_load(step, path, hits=st["hits"], stored=3 - st["hits"])
            return [f"{where}: {p}" for p in problems + follow_up(env, path, FLIP_SPEC)]
        steps = [{"do": "verify"}, load_step(FLIP_SPEC), {"do": "verify"}]
        result = run_child(env, path, steps, verify=True)
        if result.died:
            return [f"{where}: {result.died}"]
        found = result.steps[0]["verify"]
        problems = []
        if [p[:2] for p in found] != [[entry.name, entry.offset]]:
            problems.append(f"verify() reported {found}, expected entry {entry.name!r} at offset {entry.offset}")
        problems += check_load(result.steps[1], path, hits=2, stored=1, error_text=f"entry {entry.name!r}")
        if result.steps[2]["verify"]:
            problems.append(f"verify() after the repair still reports {result.steps[2]['verify']}")
        return [f"{where}: {p}" for p in problems]

    return Case(f"bitflip-{region}/{seed}", run)


def all_cases(flips: int) -> list[Case]:
    per_region = {"header": flips, "index": flips, "data": max(1, flips // 2)}
    return [*CASES, *(flip_case(region, seed) for region, count in per_region.items() for seed in range(count))]


def run_case(env: Env, item: Case) -> list[str]:
    d = env.case_dir(item.name)
    try:
        return item.run(env, d)
    except Exception as exc:  # a harness error is a failing case, not a crashed run
        return [f"harness error: {exc!r}"]


@contextlib.contextmanager
def environment() -> Iterator[Env]:
    env = Env()
    try:
        yield env
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flips", type=int, default=24, help="random bit-flip cases per region (data: half)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases(args.flips) if args.only in c.name]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    started = time.monotonic()
    failed = 0
    with environment() as env:
        for item in cases:
            problems = run_case(env, item)
            if problems:
                failed += 1
                print(f"FAIL {item.name}: {'; '.join(problems)}", flush=True)
        limit = truncate_while_mapped_limit(env) if not args.only else None
    if limit is not None:
        print(f"documented limit: touching a view after another process truncated the file: {limit}")
    seconds = time.monotonic() - started
    print(f"faults: cases={len(cases)} passed={len(cases) - failed} failed={failed} seconds={seconds:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
