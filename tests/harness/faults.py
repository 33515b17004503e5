"""The fault matrix: real faults at every phase of a cache's life, each load in its own process.

``stress/faults.py`` is its command line and describes the method. Here:

* ``ROWS``, the resource faults as data (ENOSPC, inode exhaustion, EFBIG,
  EACCES, EROFS, EMFILE, mapping failure at open, build, append, rebuild): one
  ``Row`` each, where the cache lives, what the file holds, one load in a child,
  what it must show and what must survive it;
* the attacks on the lock file and the path's spelling, the index caps, and the
  file replaced, deleted or truncated under a reader, as case functions;
* the entry points' cases (``harness.entry_faults``) and the random bit flips
  (``flip_case``).

``CASES`` lists every named case, ``all_cases(flips)`` adds the bit flips.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import random
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.child import run_child, two_appenders
from harness.driver import (
    AB,
    FOREIGN_UID,
    A,
    C,
    Case,
    ChildResult,
    Env,
    check_load,
    follow_up,
    load_step,
    no_temp,
    not_created,
    one_load,
    run_driver,
    unchanged,
)
from harness.entry_faults import ENTRY_CASES
from harness.files import committed, flip_bit, garbage, snapshot
from harness.mounts import fill, read_only_bind, tmpfs
from harness.packs import KIB, MIB, Spec, build
from packcache import format as fmt
from packcache import verify

ABC_64K: Spec = {**AB, "c": C}


# --------------------------------------------------------------------------- resource faults, as data


@dataclass(frozen=True)
class Row:
    """One resource fault at one phase: where the cache lives, what its file holds, one load, what it must show.

    The load (``request``) runs once in a child, as ``user`` under ``limits``, and
    must serve every pack bit-identical with ``hits``/``stored``; with ``heap`` =
    (reason, bytes, errno name) exactly those heap bytes for that reason, that
    errno, and one ERROR record naming the reason, the errno and the path (without
    it: no heap, errno 0, no ERROR record). Then what ``survives`` names must
    hold, and ``follow_up``'s packs must map on the next load without the fault.
    """

    name: str
    request: Spec
    hits: int = 0
    stored: int = 0
    heap: tuple[str, int, str] | None = None
    mount: str = ""  # "": a plain directory; "ro": a read-only bind mount; else tmpfs options ("1m,nr_inodes=2")
    file: Spec | int | None = None  # no file, a valid cache of these packs, or this many bytes of garbage
    file_mode: int = 0o600
    prepare: Callable[[Path], None] | None = None  # applied to the path once the file is written
    leave_free: int | None = None  # then fill the tmpfs until this many bytes are free
    user: str = "root"
    limits: Mapping[str, int] | None = None
    fsize_past_file: int | None = None  # RLIMIT_FSIZE this many bytes past the file's size
    survives: tuple[str, ...] = ()  # "unchanged" (the file), "no_temp", "not_created", "nothing_created" (the dir)
    follow_up: Spec | None = None

    def case(self) -> Case:
        return Case(self.name, self.run)

    def _write(self, path: Path) -> None:
        if isinstance(self.file, int):
            garbage(path, self.file, mode=self.file_mode)
        elif self.file is not None:
            build(path, self.file, file_mode=self.file_mode)
        if self.prepare is not None:
            self.prepare(path)

    @contextlib.contextmanager
    def _directory(self, d: Path) -> Iterator[Path]:
        """The directory of the cache file, the file written and the fault in place."""
        if self.mount == "ro":
            (d / "src").mkdir()
            self._write(d / "src" / "model.pcache")
            with read_only_bind(d / "src", d / "ro") as ro:
                yield ro
        elif self.mount:
            with tmpfs(d / "mnt", self.mount) as mnt:
                self._write(mnt / "model.pcache")
                if self.leave_free is not None:
                    fill(mnt, leave_free=self.leave_free)
                yield mnt
        else:
            self._write(d / "model.pcache")
            yield d

    def run(self, env: Env, d: Path) -> list[str]:
        with self._directory(d) as directory:
            path = directory / "model.pcache"
            before = snapshot(path)
            limits = dict(self.limits or {})
            if self.fsize_past_file is not None:
                limits["fsize"] = path.stat().st_size + self.fsize_past_file
            result = run_driver(env, path, [load_step(self.request)], user=self.user, limits=limits)
            problems, step = one_load(result)
            if step:
                reason, nbytes, errno = self.heap or ("", 0, None)
                heap, errors = ({reason: nbytes}, (reason,)) if self.heap else (None, ())
                problems += check_load(
                    step, path, hits=self.hits, stored=self.stored, heap=heap, errno=errno, errors=errors
                )
            after = {
                "unchanged": lambda: unchanged(path, before),
                "no_temp": lambda: no_temp(directory),
                "not_created": lambda: not_created(path),
                "nothing_created": lambda: [f"{sorted(os.listdir(d))} created"] if os.listdir(d) else [],
            }
            for what in self.survives:
                problems += after[what]()
            if self.follow_up is not None:
                problems += follow_up(env, path, self.follow_up)
            return problems


def _no_space(nbytes: int, errno: str = "ENOSPC") -> tuple[str, int, str]:
    return ("no_space", nbytes, errno)


SMALL_128K: Spec = {f"small{i}": (i, 128 * KIB) for i in range(3)}
EFBIG_SMALL: Spec = {"small0": (0, 32 * KIB), "small1": (1, 32 * KIB), "small2": (3, 32 * KIB)}
PRESENT_128K: Spec = {"a": (0, 128 * KIB), "b": (1, 128 * KIB)}
SMALL_4K: Spec = {"small0": (0, 4 * KIB), "small1": (1, 4 * KIB)}
BIG_64M: Spec = {"big": (9, 64 * MIB)}
BUILT = ("no_temp", "not_created")  # a failed first build leaves no file and no temp file
KEPT = ("unchanged", "no_temp")  # a failed rebuild or append leaves the old file byte-identical


def _foreign_directory(path: Path) -> None:
    os.chown(path.parent, FOREIGN_UID, FOREIGN_UID)


def _read_only_file(path: Path) -> None:
    os.chmod(path, 0o444)


def _lock_file(path: Path) -> None:
    Path(f"{path}.lock").touch(mode=0o600)


ROWS: list[Row] = [
    # ENOSPC: a 1 MiB tmpfs.
    Row("enospc/open", AB, heap=_no_space(128 * KIB), mount="1m", leave_free=0, survives=BUILT),
    Row("enospc/build", {**SMALL_128K, "big": (10, 768 * KIB), "late": (20, 64 * KIB)}, stored=4,
        heap=_no_space(768 * KIB), mount="1m", survives=("no_temp",),
        follow_up={**SMALL_128K, "late": (20, 64 * KIB)}),
    Row("enospc/append", {**PRESENT_128K, "c": (2, 256 * KIB)}, hits=2, heap=_no_space(256 * KIB), mount="1m",
        file=PRESENT_128K, leave_free=96 * KIB, survives=KEPT),
    Row("enospc/rebuild", {"c": (2, 128 * KIB)}, heap=_no_space(128 * KIB), mount="1m", file=256 * KIB,
        leave_free=64 * KIB, survives=KEPT),
    # Inode exhaustion (tmpfs nr_inodes=; the mount's root directory takes one): ENOSPC on create.
    # No inode for the lock file: creating any file fails, which is running out of space.
    Row("inodes/open", AB, heap=_no_space(128 * KIB), mount="8m,nr_inodes=1", survives=("not_created",)),
    # The lock file fits, the new cache file (a temp file) does not.
    Row("inodes/build", AB, heap=_no_space(128 * KIB), mount="8m,nr_inodes=2", survives=BUILT),
    # Every inode used (root, cache file, lock file): appending needs none and must just work.
    Row("inodes/append", ABC_64K, hits=2, stored=1, mount="8m,nr_inodes=3", file=AB, follow_up=ABC_64K),
    Row("inodes/rebuild", AB, heap=_no_space(128 * KIB), mount="8m,nr_inodes=3", file=20 * KIB,
        prepare=_lock_file, survives=KEPT),
    # EFBIG: RLIMIT_FSIZE in the child.
    Row("efbig/open", AB, heap=_no_space(128 * KIB, "EFBIG"), limits={"fsize": 2048}, survives=BUILT),
    Row("efbig/build", {"small0": EFBIG_SMALL["small0"], "small1": EFBIG_SMALL["small1"], "big": (2, 512 * KIB),
                        "small2": EFBIG_SMALL["small2"]}, stored=3, heap=_no_space(512 * KIB, "EFBIG"),
        limits={"fsize": 256 * KIB}, survives=("no_temp",), follow_up=EFBIG_SMALL),
    Row("efbig/append", {"a": A, "big": (5, 128 * KIB), "d": (6, 8 * KIB)}, hits=1, stored=1,
        heap=_no_space(128 * KIB, "EFBIG"), file={"a": A}, fsize_past_file=32 * KIB,
        follow_up={"a": A, "d": (6, 8 * KIB)}),
    Row("efbig/rebuild", {"c": (2, 16 * KIB)}, heap=_no_space(16 * KIB, "EFBIG"), file=20 * KIB,
        limits={"fsize": 12 * KIB}, survives=KEPT),
    # EACCES: the real user nobody, or root with its DAC override dropped.
    # nobody, missing file in a root-owned 0755 directory: nothing can be created.
    Row("eacces-nobody/open", AB, heap=("open_failed", 128 * KIB, "EACCES"), user="nobody",
        survives=("nothing_created",)),
    # root without CAP_DAC_OVERRIDE, missing file in a directory of another user (0755).
    Row("eacces-nodac/open", AB, heap=("open_failed", 128 * KIB, "EACCES"), prepare=_foreign_directory,
        user="nodac", survives=("nothing_created",)),
    # nobody, a valid root-owned 0644 cache (trusted: root-owned): hits map, misses are read_only.
    Row("eacces-nobody/append", ABC_64K, hits=2, heap=("read_only", 64 * KIB, "EACCES"), file=AB, file_mode=0o644,
        user="nobody", survives=("unchanged",)),
    # root without CAP_DAC_OVERRIDE, a valid root-owned 0444 cache: hits map, misses are read_only.
    Row("eacces-nodac/append", ABC_64K, hits=2, heap=("read_only", 64 * KIB, "EACCES"), file=AB,
        prepare=_read_only_file, user="nodac", survives=("unchanged",)),
    Row("eacces-nobody/rebuild", AB, heap=("read_only", 128 * KIB, "EACCES"), file=20 * KIB, file_mode=0o644,
        user="nobody", survives=KEPT),
    # EROFS: a read-only bind mount.
    Row("erofs/open", AB, heap=("open_failed", 128 * KIB, "EROFS"), mount="ro"),
    Row("erofs/append", ABC_64K, hits=2, heap=("read_only", 64 * KIB, "EROFS"), mount="ro", file=AB),
    Row("erofs/rebuild", AB, heap=("read_only", 128 * KIB, "EROFS"), mount="ro", file=20 * KIB),
    # EMFILE: RLIMIT_NOFILE, with every descriptor but ``free_fds`` taken.
    # No descriptor for the lock file of a new cache.
    Row("emfile/open", AB, heap=("open_failed", 128 * KIB, "EMFILE"), limits={"free_fds": 0}),
    # No descriptor to open a valid cache file: every request goes to heap.
    Row("emfile/open-existing", AB, heap=("open_failed", 128 * KIB, "EMFILE"), file=AB, limits={"free_fds": 0}),
    # One descriptor: the lock file opens, the new cache file cannot be created.
    Row("emfile/build", AB, heap=("open_failed", 128 * KIB, "EMFILE"), limits={"free_fds": 1}, survives=BUILT),
    # One descriptor: the file (its mappings keep none), none for the lock file.
    Row("emfile/append", ABC_64K, hits=2, heap=("open_failed", 64 * KIB, "EMFILE"), file=AB,
        limits={"free_fds": 1}, survives=("unchanged",)),
    # Two descriptors: the corrupt file and the lock file, none for the new file.
    Row("emfile/rebuild", AB, heap=("open_failed", 128 * KIB, "EMFILE"), file=20 * KIB, limits={"free_fds": 2},
        survives=KEPT),
    # Mapping failure: RLIMIT_AS.
    # A 64 MiB file cannot be mapped: its hits are packed to heap (map_failed).
    Row("map/append", SMALL_4K, heap=("map_failed", 8 * KIB, "ENOMEM"), file={**BIG_64M, **SMALL_4K},
        limits={"as_extra": 16 * MIB}, survives=("unchanged",)),
    # A fresh 64 MiB pack is written but cannot be mapped: served from heap, committed for the next load.
    Row("map/build", BIG_64M, heap=("map_failed", 64 * MIB, "ENOMEM"), limits={"as_extra": 88 * MIB},
        follow_up=BIG_64M),
]  # fmt: skip

CASES: list[Case] = [row.case() for row in ROWS]


def case(name: str) -> Callable[[Callable[[Env, Path], list[str]]], Callable[[Env, Path], list[str]]]:
    """Register the decorated function as the case ``name`` (appended to ``CASES``)."""

    def register(func: Callable[[Env, Path], list[str]]) -> Callable[[Env, Path], list[str]]:
        CASES.append(Case(name, func))
        return func

    return register


# --------------------------------------------------------------------------- attacks on the lock file and the path

# docs/RELIABILITY.md "Attacks".


def _planted_lock(env: Env, d: Path, plant: Callable[[Path], None], what: str) -> list[str]:
    path = d / "model.pcache"
    build(path, AB)
    before = snapshot(path)
    lock = Path(str(path) + ".lock")
    lock.unlink()  # the build left its own lock file: the attacker replaces it
    plant(lock)
    problems, step = one_load(run_driver(env, path, [load_step(ABC_64K)]))
    if step:
        problems += check_load(step, path, hits=2, stored=0, heap={"untrusted": 64 * KIB}, errors=("untrusted",))
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
    report = verify(real)
    problems += [f"verify: {p}" for p in report.problems]
    if report.entries != 6:
        problems.append(f"the file holds {report.entries} entries, expected 6 (both appenders' packs kept)")
    return problems


def _spelling_case(how: str) -> Case:
    return Case(f"spelling/{how}", lambda env, d: _appenders(d, how))


CASES += [_spelling_case(how) for how in ("symlink", "hardlink", "deleted-lock")]

# 1,100 packs with three spare descriptors (lock, new file, its directory): none per pack.
MANY_PACKS: Spec = {f"p{i}": (i, 4 * KIB) for i in range(1100)}
CASES.append(Row("emfile/many-packs", MANY_PACKS, stored=1100, limits={"free_fds": 3}, follow_up=MANY_PACKS).case())

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
        out = run_child(INDEX_CAP_CHILD, str(path))
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


# --------------------------------------------------------------------------- the file changed under a reader

# Another process replaces, deletes or truncates the file while a reader has it mapped.

ABC: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB), "c": (3, 16 * KIB)}
MAPPED_THEN = [load_step(ABC), {"do": "pause"}, {"do": "touch"}]  # map ABC, let the parent act, touch the views


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

    steps = [*MAPPED_THEN, load_step({**ABC, **d_pack}), load_step({**ABC, **d_pack}, new=True)]
    result = run_driver(env, path, steps, on_pause=[replace])
    if result.died:
        return [result.died]
    problems = check_load(result.steps[0], path, hits=3, stored=0) + _touched_ok(result, 1)
    # Same instance: the held views of a, b, c stay valid for whoever holds them, but the cache
    # serves every request from the file now at the path, so all four map from the new file.
    problems += check_load(result.steps[2], path, hits=4, stored=0)
    return problems + check_load(result.steps[3], path, hits=4, stored=0)


def _changed_under_reader(env: Env, d: Path, change: Callable[[Path], None]) -> list[str]:
    """``change`` the file while a reader holds views of it: the views keep their bytes, a new instance rebuilds."""
    path = d / "model.pcache"
    build(path, ABC)
    result = run_driver(env, path, [*MAPPED_THEN, load_step(ABC, new=True)], on_pause=[lambda: change(path)])
    if result.died:
        return [result.died]
    problems = check_load(result.steps[0], path, hits=3, stored=0) + _touched_ok(result, 1)
    return problems + check_load(result.steps[2], path, hits=0, stored=3) + follow_up(env, path, ABC)


def _replace_with_garbage(path: Path) -> None:
    garbage(path.parent / "other", 40 * KIB)
    os.rename(path.parent / "other", path)


CASES.append(Case("replace-corrupt/mapped", lambda env, d: _changed_under_reader(env, d, _replace_with_garbage)))
CASES.append(Case("delete/mapped", lambda env, d: _changed_under_reader(env, d, Path.unlink)))


def _truncate(path: Path) -> Callable[[], None]:
    return lambda: os.truncate(path, path.stat().st_size // 2)


@case("truncate/next-open")
def _truncate_next_open(env: Env, d: Path) -> list[str]:
    """Truncated by another process before this process opens it: rebuilt as a new file."""
    path = d / "model.pcache"
    build(path, ABC)
    _truncate(path)()
    problems, step = one_load(run_driver(env, path, [load_step(ABC)]))
    problems += check_load(step, path, hits=0, stored=3) if step else []
    return problems + follow_up(env, path, ABC)


@case("truncate/next-session-released")
def _truncate_next_session_released(env: Env, d: Path) -> list[str]:
    """Same instance: the reader released its views, the file is truncated, the next session rebuilds."""
    path = d / "model.pcache"
    build(path, ABC)
    steps = [load_step(ABC), {"do": "release"}, {"do": "pause"}, load_step(ABC)]
    result = run_driver(env, path, steps, on_pause=[_truncate(path)])
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
    result = run_driver(env, path, steps, on_pause=[_truncate(path)])
    if result.died:
        return [result.died]
    return check_load(result.steps[0], path, hits=3, stored=0) + check_load(result.steps[1], path, hits=0, stored=3)


def truncate_while_mapped_limit(env: Env) -> str:
    """Documented limit: touching a view after another process truncated the file. Returns what happened."""
    d = env.case_dir("limit-truncate-touch")
    path = d / "model.pcache"
    build(path, ABC)
    result = run_driver(env, path, MAPPED_THEN, on_pause=[_truncate(path)])
    return result.died or "the child survived touching truncated pages"


CASES += ENTRY_CASES

# --------------------------------------------------------------------------- random bit flips in header, index, data

FLIP_SPEC: Spec = {"a": (1, 16 * KIB), "b": (2, 16 * KIB), "c": (3, 8 * KIB)}


def flip_case(region: str, seed: int) -> Case:
    """A random bit flipped in ``region`` ("header", "index" or "data") of a two-generation cache."""

    def run(env: Env, d: Path) -> list[str]:
        rng = random.Random(f"{region}-{seed}")
        path = d / "model.pcache"
        build(path, {"a": FLIP_SPEC["a"], "b": FLIP_SPEC["b"]})
        build(path, {"c": FLIP_SPEC["c"]})
        slot, entries = committed(path)
        if region == "header":
            offset = rng.randrange(fmt.HEADER_READ_SIZE)
        elif region == "index":
            offset = rng.randrange(slot.index_offset, slot.committed_end)
        else:
            entry = entries[rng.choice(sorted(entries))]
            offset = rng.randrange(entry.offset, entry.offset + entry.nbytes)
        bit = rng.randrange(8)
        flip_bit(path, offset, bit)
        where = f"byte {offset} bit {bit}"
        if region != "data":
            problems, step = one_load(run_driver(env, path, [load_step(FLIP_SPEC)]))
            if problems:
                return [f"{where}: {p}" for p in problems]
            st = step["stats"]
            # A valid open (flip in a byte readers ignore, or fallback to the older generation, then append)
            # or a rebuild; never a heap pack, an error, or a wrong byte.
            problems = check_load(step, path, hits=st["hits"], stored=3 - st["hits"])
            return [f"{where}: {p}" for p in problems + follow_up(env, path, FLIP_SPEC)]
        steps = [{"do": "verify"}, load_step(FLIP_SPEC), {"do": "verify"}]
        result = run_driver(env, path, steps, verify=True)
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
    """Every named case, then ``flips`` random bit flips in the header and in the index, half as many in data."""
    per_region = {"header": flips, "index": flips, "data": max(1, flips // 2)}
    return [*CASES, *(flip_case(region, seed) for region, count in per_region.items() for seed in range(count))]
