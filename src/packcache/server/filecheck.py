"""The background check of the cache file a server maps: every pack's checksum, once per server, after the load.

A warm load reads no pack data (docs/RELIABILITY.md, "Performance guard"), so a pack damaged at rest (a flipped
bit, a bad sector, a copy gone wrong) is mapped and served, and the answers change with nothing to say so. A
server maps its file for weeks; it checks it once, in the background:

* **Who checks.** One process per server and file. The first worker to finish loading a file claims its check
  (a non-blocking ``flock`` on a claim file in the server's metrics directory, which every worker shares) and
  starts the *checker*, a child process; the other workers, and the workers that replace them, read its result.
  Not the master: it loads no model, so it knows neither which file its workers mapped nor when a cold build
  ended, and it forks workers all its life (a thread of its own could hold a lock across a fork). Not every
  worker: that multiplies the reads.
* **How gently.** The checker is a fresh interpreter at nice 19 (its reads are then also the lowest best-effort
  I/O priority), so it takes CPU the workers leave; it reads with ``pread`` at most
  :data:`~packcache._defaults.FILE_CHECK_BYTES_PER_SECOND`, with :func:`packcache.maintenance.verify_open`'s
  checks. A process, not a thread of the worker: a thread would share the worker's GIL with the model's thread.
  Not ``SCHED_IDLE``: on a busy machine it never ran (an import that takes 0.4 s took 40 s beside four busy
  loops). The pages it reads join the page cache that the workers' mappings already share.
* **What it says.** A small JSON status file beside the claim, replaced whole (rename): ``running`` and the bytes
  checked so far, then ``passed``, or ``failed`` with the damaged packs (entry, offset, checksums), or ``error``
  (the check could not run; the next worker to load a file tries again). The checker logs one line when it ends
  (on the server's log, as gunicorn writes its own): INFO when the file passed, ERROR naming the file, the
  damaged entries and their offsets when it failed.
* **What a worker does with it** (:class:`FileChecker`): ``/healthz`` answers 503 once the check failed (a damaged
  model answers wrongly: a load balancer must take the node out), and ``/metrics`` shows the check's state, the
  packs that failed and when it finished (:mod:`.metrics`).

The master removes the status files a previous server left in its metrics directory (:func:`clear_checks`): a
restarted server checks its file again.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .. import _defaults

__all__ = ["NOTHING", "CheckState", "FileCheck", "FileChecker", "clear_checks", "main", "start_check"]

logger = logging.getLogger("gunicorn.error")  # the server's log: where the worker's other lines go

_PREFIX = "packcache-filecheck-"
#: Seconds a worker reuses what it read of a running check (a scrape, a probe and every answer ask).
_REREAD = 0.25
#: Seconds between two progress records of a running check.
_PROGRESS_EVERY = 1.0
#: Damaged packs a status file and the log line name (the count says how many more).
_NAMED = 5
_STATUS_BYTES = 64 << 10

# A fresh interpreter at nice 19, on the worker's own sys.path (it imports the packcache the worker runs; ``-c`` alone
# would put the working directory first), its argument vector after the path. It ignores SIGINT (a
# terminal's Ctrl-C reaches the whole process group): it stops once the master has gone.
_BOOTSTRAP = (
    "import json, os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # a terminal's Ctrl-C stops the server; the checker follows it
    "try:\n"
    "    os.setpriority(os.PRIO_PROCESS, 0, 19)\n"
    "except OSError:\n"
    "    pass\n"
    "sys.path[:] = json.loads(sys.argv.pop(1))\n"
    "from packcache.server.filecheck import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


class CheckState(str, enum.Enum):
    """Where the background check of a worker's cache file is."""

    NONE = "none"  #: no cache file is mapped (caching off, every pack on heap, the sentence-transformers engine)
    NOT_STARTED = "not_started"  #: claimed, the checker not reading yet
    RUNNING = "running"  #: the checker is reading the packs
    PASSED = "passed"  #: every pack matched its checksum
    FAILED = "failed"  #: a pack failed its checksum or could not be read: the file's answers are wrong
    ERROR = "error"  #: the check could not run (the file could not be opened, the checker died): no verdict

    def __str__(self) -> str:
        return self.value


_ENDED = (CheckState.PASSED.value, CheckState.FAILED.value)


@dataclass(frozen=True)
class FileCheck:
    """What the background check of one cache file found so far (every worker of a server sees the same).

    >>> FileCheck().state
    'none'
    """

    state: str = CheckState.NONE.value
    file: str = ""  #: the cache file
    packs: int = 0  #: packs its index lists
    file_bytes: int = 0  #: its size
    checked_bytes: int = 0  #: pack bytes read and checked so far
    failed_packs: int = 0  #: packs whose bytes failed their checksum (or could not be read)
    problems: tuple[str, ...] = ()  #: the first of them, as ``packcache verify`` names them
    started: float = 0.0  #: ``time.time()`` when the checker began reading (0 before)
    finished: float = 0.0  #: ``time.time()`` when the check finished (0 until it did)
    error: str = ""  #: why the check could not run (state ``error``)
    checker: int = 0  #: the checker's pid

    @property
    def damaged(self) -> bool:
        """A pack failed its checksum (or could not be read): the file's answers are wrong."""
        return self.state == CheckState.FAILED.value

    @property
    def reason(self) -> str:
        """One line: what the check found (the log line and ``/healthz``'s 503 say it)."""
        if self.state == CheckState.FAILED.value:
            named = "; ".join(self.problems) or "its packs cannot be read"
            more = (
                f" (and {self.failed_packs - len(self.problems)} more)"
                if self.failed_packs > len(self.problems)
                else ""
            )
            return (
                f"the cache file {self.file} failed its checksum check: {self.failed_packs} of {self.packs} packs "
                f"damaged: {named}{more}; the answers it serves would be wrong: replace the file (a checkpoint's "
                "cache: restart with --verify to pack the damaged packs again; packcache verify FILE lists them all)"
            )
        if self.state == CheckState.ERROR.value:
            return f"the cache file {self.file} could not be checked: {self.error}"
        if self.state == CheckState.PASSED.value:
            return (
                f"the cache file {self.file} passed its checksum check: {self.packs} packs, "
                f"{self.checked_bytes / 1e6:.1f} MB in {max(0.0, self.finished - self.started):.2f} s"
            )
        return f"the cache file {self.file or '(none)'}: check {self.state}"

    def encode(self) -> bytes:
        """The status file's bytes."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> FileCheck:
        """A status file's record (a malformed one raises ``ValueError``)."""
        from .._boundedjson import loads

        record = loads(data, what="file check status", max_depth=2)
        if not isinstance(record, dict):
            raise ValueError("a file check status is a JSON object")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in record.items():
            if name not in known:
                continue
            default = getattr(cls, name, None) if name != "problems" else ()
            if name == "problems":
                if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                    raise ValueError("problems must be a list of strings")
                values[name] = tuple(value)
            elif isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[name] = float(value)
            elif type(value) is type(default):
                values[name] = value
            else:
                raise ValueError(f"{name} has the wrong type")
        return cls(**values)


def _names(key: str) -> tuple[str, str]:
    """The status file's and the claim file's names for the file ``key`` identifies."""
    return f"{_PREFIX}{key}.json", f"{_PREFIX}{key}.lock"


def _write(directory: int, key: str, check: FileCheck) -> None:
    """Replace the status of ``key`` with ``check``: a temp file renamed over it (a reader sees one or the other)."""
    status, _ = _names(key)
    temp = f"{status}.tmp-{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, _defaults.PRIVATE_FILE_MODE, dir_fd=directory)
    try:
        os.write(fd, check.encode())
    finally:
        os.close(fd)
    os.replace(temp, status, src_dir_fd=directory, dst_dir_fd=directory)


def _read(directory: int, key: str) -> FileCheck | None:
    """The status of ``key``, or ``None`` when there is none yet (or it cannot be read)."""
    status, _ = _names(key)
    try:
        fd = os.open(status, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    except OSError:
        return None
    try:
        return FileCheck.decode(os.read(fd, _STATUS_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def clear_checks(directory: int) -> None:
    """Remove what earlier servers' checks left in the metrics directory open as ``directory`` (the master, at start).
    A restarted server checks its file again."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=directory)


class FileChecker:
    """A worker's view of the background check of the file it maps: :meth:`current` reads the shared status (at
    most every 0.25 s while the check runs; a finished check is final) and never raises."""

    def __init__(
        self, file: str = "", directory: int | None = None, key: str = "", fixed: FileCheck | None = None
    ) -> None:
        self.file, self._directory, self._key = file, directory, key
        self._fixed = fixed
        self._last: tuple[float, FileCheck] = (-_REREAD, fixed or FileCheck(CheckState.NOT_STARTED.value, file))
        self.process: subprocess.Popen[bytes] | None = None  # the checker, when this worker started it

    def current(self) -> FileCheck:
        """The check's state and figures now (:class:`FileCheck`)."""
        if self._fixed is not None or self._directory is None:
            return self._last[1]
        now = time.monotonic()
        when, check = self._last  # one reference, read once: any thread may call this
        if check.state in _ENDED or now - when < _REREAD:
            return check
        read = _read(self._directory, self._key)
        if read is not None:
            check = read
        self._last = (now, check)
        return check


#: A worker with no cache file mapped: nothing to check.
NOTHING = FileChecker(fixed=FileCheck())


def start_check(
    file: str,
    directory: int | None,
    *,
    log_level: str = _defaults.SERVE_LOG_LEVEL,
    rate: int = _defaults.FILE_CHECK_BYTES_PER_SECOND,
) -> FileChecker:
    """Claim the background check of ``file`` (the cache file this worker maps) among the server's workers and, if
    no other worker's checker has it and no check of it ended, start the checker. Returns this worker's view of
    the check. Never raises: a file that cannot be opened, or a checker that cannot start, is state ``error``.

    ``directory``: the server's metrics directory, open (the master's held descriptor); ``None`` (no server around
    it): nothing is checked. ``log_level``: gunicorn's, for the checker's own lines.
    """
    if not file or directory is None:
        return NOTHING
    from .._paths import open_for_reading
    from ..errors import PackCacheError

    try:
        fd, st, _ = open_for_reading(file)  # its trust was the cache's to check, at the load
    except (OSError, PackCacheError) as exc:
        return FileChecker(file, fixed=FileCheck(CheckState.ERROR.value, file, error=f"cannot open it: {exc}"))
    key = f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size:x}"  # the file as mapped: a replaced or grown one is checked again
    checker = FileChecker(file, directory, key)
    lock = -1
    try:
        _, lock_name = _names(key)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        lock = os.open(lock_name, flags, _defaults.PRIVATE_FILE_MODE, dir_fd=directory)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        for descriptor in (fd, lock):
            if descriptor >= 0:
                os.close(descriptor)
        if not isinstance(exc, BlockingIOError):  # BlockingIOError: another worker's checker holds the claim
            logger.warning("packcache serve: cannot claim the check of %s: %s", file, exc)
        return checker
    try:
        done = _read(directory, key)
        if done is not None and done.state in _ENDED:
            return checker
        argv = [
            sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(fd), str(directory), str(lock), key, file,
            str(rate), log_level, str(os.getppid()),  # the master: the checker stops with the server
        ]  # fmt: skip
        # The checker holds the claim (its copy of the lock's descriptor) until it ends.
        checker.process = subprocess.Popen(
            argv, pass_fds=(fd, directory, lock), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
    except OSError as exc:
        failed = FileCheck(CheckState.ERROR.value, file, error=f"the checker could not start: {exc}")
        with contextlib.suppress(OSError):
            _write(directory, key, failed)
        logger.warning("packcache serve: %s", failed.reason)
        return checker
    finally:
        os.close(fd)
        os.close(lock)
    logger.info(
        "packcache serve: checking every pack of %s in the background (%.1f MB, at most %.0f MiB/s, nice 19; "
        "checker pid %d)", file, st.st_size / 1e6, rate / (1 << 20), checker.process.pid,
    )  # fmt: skip
    threading.Thread(
        target=_reap, args=(checker.process, directory, key, file), name="packcache-filecheck", daemon=True
    ).start()
    return checker


def _reap(process: subprocess.Popen[bytes], directory: int, key: str, file: str) -> None:
    """Wait for the checker (so it leaves no zombie); one that ended without a verdict leaves state ``error``, so
    the next worker to load the file tries again."""
    code = process.wait()
    left = _read(directory, key)
    if left is not None and left.state in _ENDED:
        return
    failed = FileCheck(CheckState.ERROR.value, file, error=f"the checker (pid {process.pid}) ended with status {code}")
    with contextlib.suppress(OSError):
        _write(directory, key, failed)
    logger.warning("packcache serve: %s", failed.reason)


# --------------------------------------------------------------------------- the checker (a child process)


class _ServerGone(Exception):
    """The server the check was for has stopped."""


def main(argv: list[str]) -> int:
    """The checker: ``FD DIRECTORY_FD LOCK_FD KEY FILE RATE LOG_LEVEL MASTER`` (what :func:`start_check` passes).
    Reads every pack of the file open as ``FD`` at most ``RATE`` bytes a second, checks its checksum, writes its
    progress and verdict to the status of ``KEY``, and logs the verdict; exits 0 once a verdict is written. It
    outlives the worker that started it (a replaced worker's successors read its verdict), not the server: once the
    ``MASTER`` pid is gone it stops, writing nothing more."""
    fd, directory, _lock = (int(a) for a in argv[:3])
    key, file, rate, level, master = argv[3], argv[4], int(argv[5]), argv[6], int(argv[7])
    handler = logging.StreamHandler(sys.stderr)
    # gunicorn's own format: the checker's lines read as the server's others do
    handler.setFormatter(logging.Formatter("%(asctime)s [%(process)d] [%(levelname)s] %(message)s",
                                           "[%Y-%m-%d %H:%M:%S %z]"))  # fmt: skip
    log = logging.getLogger("packcache.server.filecheck")
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False
    try:
        check = _check(fd, directory, key, file, rate, master)
    except _ServerGone:
        return 0
    if check.state == CheckState.FAILED.value:
        log.error("packcache serve: %s", check.reason)
    elif check.state == CheckState.PASSED.value:
        log.info("packcache serve: %s", check.reason)
    else:
        log.warning("packcache serve: %s", check.reason)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a master that changed its user): not ours to judge
        return True
    return True


def _check(fd: int, directory: int, key: str, file: str, rate: int, master: int) -> FileCheck:
    """Check the file open as ``fd``, writing the status as it goes (a status that cannot be written, the server's
    private directory removed at its exit, is no reason to stop: the verdict is still logged).

    Raises:
        _ServerGone: the ``master`` pid ended.
    """
    from ..maintenance import verify_open

    size = os.fstat(fd).st_size
    started = time.time()
    state = FileCheck(CheckState.RUNNING.value, file, file_bytes=size, started=started, checker=os.getpid())
    with contextlib.suppress(OSError):
        _write(directory, key, state)
    clock = time.monotonic()
    checked, reported = 0, clock

    def pace(nbytes: int) -> None:
        nonlocal checked, reported
        checked += nbytes
        while True:  # in slices: a slow pace still notices a stopped server
            if not _alive(master):
                raise _ServerGone
            ahead = checked / rate - (time.monotonic() - clock)
            if ahead <= 0:
                break
            time.sleep(min(ahead, _PROGRESS_EVERY))
        now = time.monotonic()
        if now - reported >= _PROGRESS_EVERY:
            reported = now
            with contextlib.suppress(OSError):
                _write(directory, key, replace(state, checked_bytes=checked))

    try:
        report = verify_open(fd, file, progress=pace)
    except OSError as exc:
        # EIO: the disk cannot give the bytes back, and a worker faulting those pages would die of SIGBUS
        ended = (CheckState.FAILED if exc.errno == errno.EIO else CheckState.ERROR).value
        result = FileCheck(
            ended, file, file_bytes=size, checked_bytes=checked, started=started, finished=time.time(),
            failed_packs=1 if ended == CheckState.FAILED.value else 0, error=str(exc), checker=os.getpid(),
            problems=(f"reading it: {exc}",) if ended == CheckState.FAILED.value else (),
        )  # fmt: skip
        with contextlib.suppress(OSError):
            _write(directory, key, result)
        return result
    damaged = [p for p in report.problems if p.entry is not None]
    unreadable = [p for p in report.problems if p.entry is None and not report.entries]  # no index to check by
    failures = damaged or unreadable
    result = FileCheck(
        (CheckState.FAILED if failures else CheckState.PASSED).value, file, packs=report.entries, file_bytes=size,
        checked_bytes=report.checked_bytes, failed_packs=len(failures),
        problems=tuple(str(p) for p in failures[:_NAMED]), started=started, finished=time.time(), checker=os.getpid(),
    )  # fmt: skip
    with contextlib.suppress(OSError):
        _write(directory, key, result)
    return result
