"""The metrics directory of ``packcache serve`` cannot be redirected after it is checked.

Before: ``serve`` checked ``--metrics-dir`` / ``PROMETHEUS_MULTIPROC_DIR`` with ``stat`` (following
symlinks) and then every worker opened ``<dir>/<kind>_<pid>.db`` by name. A symlink another user
owns passed the check when it named a private root directory, and its owner could re-point it
later; a root directory inside another user's directory could be renamed away and a symlink put
in its place. Root's workers then created their files where that user chose, and the start-up
wipe of ``*.db`` ran in whatever directory the link named at that moment.

Now (``packcache.server.metricsdir``) the path is walked with ``O_NOFOLLOW`` one component at a
time, a symlink another user can change is refused, and the directory reached is held open:
prometheus_client reaches it as ``/proc/self/fd/N``. The other user here is the real ``nobody``
(uid 65534), running ``ln`` and ``mv`` in a shell loop through ``setpriv`` while the server runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import require_root
from harness.serve import SRC, TEXTS, embed_from_every_worker, loaded_workers, scrape, server
from packcache.server.metricsdir import hold_metrics_dir

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

#: As nobody, in its directory $1, until $2 seconds have passed: move root's metrics directory
#: aside, then keep swapping a symlink at its name between nobody's directory ../evil (most of
#: the time) and root's moved directory, by atomic renames.
SWAPPER = r"""
cd "$1" || exit 3
end=$(( $(date +%s) + $2 ))
mv -T metrics metrics.real 2>/dev/null
while [ "$(date +%s)" -lt "$end" ]; do
    ln -sfn ../evil .swap && mv -T .swap metrics
    sleep 0.05
    ln -sfn metrics.real .swap && mv -T .swap metrics
done
ln -sfn ../evil .swap && mv -T .swap metrics
echo swapped
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 directory nobody can enter (pytest's tmp_path is 0700: nobody could not reach it)."""
    require_root()
    path = Path(tempfile.mkdtemp(prefix="packcache-metrics-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def nobody_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, mode)
    return path


def root_dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    return path


def as_nobody(*argv: str) -> None:
    done = subprocess.run([*AS_NOBODY, *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def serve_and_fail(*args: str, env_dir: str | None = None) -> subprocess.CompletedProcess[str]:
    """``packcache serve`` run to its refusal (a timeout if it ever starts instead)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if env_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = env_dir
    argv = [sys.executable, "-m", "packcache", "serve", "--port", "0", "--workers", "1", "--no-cache", *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the server started: {exc.stdout!r}") from None


@pytest.mark.root
def test_a_nobody_process_swapping_symlinks_while_the_server_runs_never_gets_a_file_where_it_points(
    base: Path, tmp_path: Path
) -> None:
    """Root's metrics directory lies in a directory nobody can write, so nobody can move it aside
    and put a symlink to its own directory at its name, again and again, while workers start
    (SIGHUP replaces both, SIGTTIN adds a third) and serve. Every worker's files go to the
    directory that was checked, none to nobody's; the scrape still shows every worker."""
    nobodys = nobody_dir(base / "nobodys")
    metrics = root_dir(nobodys / "metrics")
    evil = nobody_dir(base / "evil", 0o777)
    with server(tmp_path, "--cache-dir", str(tmp_path / "cache"), "--metrics-dir", str(metrics), workers=2) as srv:
        first = loaded_workers(srv, 2)
        swapper = subprocess.Popen(
            [*AS_NOBODY, "/bin/sh", "-c", SWAPPER, "swapper", str(nobodys), "8"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while not (nobodys / "metrics").is_symlink() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (nobodys / "metrics.real").is_dir(), "nobody moved root's directory aside"
            os.kill(srv.pid, signal.SIGHUP)
            second = loaded_workers(srv, 2, exclude=set(first.workers))
            os.kill(srv.pid, signal.SIGTTIN)
            third = loaded_workers(srv, 3, exclude=set(first.workers))
            embed_from_every_worker(srv, set(third.workers), TEXTS[:2])
            out, err = swapper.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                swapper.kill()
            swapper.wait(10)
        assert swapper.returncode == 0 and out.strip() == "swapped", err
        assert os.readlink(nobodys / "metrics") == "../evil", "the name points at nobody's directory now"
        assert sorted(os.listdir(evil)) == [], "no file was created where nobody pointed"
        s = scrape(srv)
        assert set(s.workers) == set(third.workers) and set(second.workers) <= set(third.workers)
        held = {p.name for p in (nobodys / "metrics.real").iterdir()}
        for pid in third.workers:
            assert any(name.endswith(f"_{pid}.db") for name in held), (pid, sorted(held))
    assert sorted(os.listdir(evil)) == [], "nor at exit"


@pytest.mark.root
@pytest.mark.parametrize("owner", ["nobody", "root"])
def test_a_symlink_another_user_can_change_is_refused_before_anything_is_read_or_removed(
    base: Path, owner: str
) -> None:
    """``--metrics-dir`` names a symlink to root's private directory (holding a ``keep.db``), in
    nobody's directory: owned by nobody, or owned by root but replaceable by nobody. Refused with
    the reason, before the wipe of ``*.db``: ``keep.db`` stays; nothing appears anywhere."""
    real = root_dir(base / "real")
    (real / "keep.db").write_bytes(b"root's")
    nobodys = nobody_dir(base / "nobodys")
    link = nobodys / "link"
    if owner == "nobody":
        as_nobody("ln", "-s", str(real), str(link))
        reason = "is a symlink owned by uid 65534"
    else:
        link.symlink_to(real)
        reason = "is a symlink in a directory another user can change"
    for done in (serve_and_fail("--metrics-dir", str(link)), serve_and_fail(env_dir=str(link))):
        assert done.returncode == 1 and reason in done.stderr and "listening" not in done.stdout, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(os.listdir(real)) == ["keep.db"] and (real / "keep.db").read_bytes() == b"root's"
    assert sorted(os.listdir(nobodys)) == ["link"]


@pytest.mark.root
def test_a_symlink_only_root_can_change_is_followed_and_the_directory_it_names_is_used(
    base: Path, tmp_path: Path
) -> None:
    """The systemd shape: a root-owned link in a root-owned directory (or in sticky /tmp-like one,
    where only its owner can replace it) to root's 0700 directory. Accepted; a previous run's
    ``*.db`` files are wiped, other files kept; the workers' files land there."""
    real = root_dir(base / "real")
    (real / "old_123.db").write_bytes(b"stale")
    (real / "notes.txt").write_bytes(b"kept")
    sticky = root_dir(base / "sticky", 0o1777)
    (sticky / "link").symlink_to(real)
    with server(tmp_path, "--no-cache", "--metrics-dir", str(sticky / "link"), workers=1) as srv:
        (pid,) = loaded_workers(srv, 1).workers
        names = sorted(os.listdir(real))
        assert "old_123.db" not in names and "notes.txt" in names, names
        assert any(name.endswith(f"_{pid}.db") for name in names), names


@pytest.mark.root
def test_hold_metrics_dir_walks_the_path_the_way_the_kernel_does_and_refuses_what_it_cannot_hold(
    base: Path,
) -> None:
    """In-process: ``..`` and relative links resolve physically; a loop of links, a link to a file,
    a missing directory and a group-writable one are one ``ValueError`` each, naming the part."""
    real = root_dir(base / "a")
    (base / "b").mkdir(mode=0o755)
    (base / "b" / "up").symlink_to("../a")
    held = hold_metrics_dir(str(base / "b" / "up" / ".." / "a" / "."))
    try:
        assert os.path.samestat(os.stat(held.path), os.stat(real)) and held.path.startswith("/proc/self/fd/")
    finally:
        os.close(held.fd)
    (base / "loop1").symlink_to("loop2")
    (base / "loop2").symlink_to("loop1")
    (base / "file").write_bytes(b"")
    (base / "tofile").symlink_to("file")
    open_dir = root_dir(base / "open", 0o770)
    cases = {
        str(base / "loop1"): "more than 40 symlinks",
        str(base / "tofile"): "is not a directory",
        str(base / "missing" / "x"): "does not exist",
        str(open_dir): "other users can write it (mode 0770",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            hold_metrics_dir(path)


def test_a_gunicorn_re_exec_gets_the_operators_metrics_dir_not_this_processs_descriptor(tmp_path: Path) -> None:
    """gunicorn's USR2 re-executes the master with the environment it saw at start; that must name the
    directory the operator gave (walked and held again by the new master), never ``/proc/self/fd/N``."""
    from packcache.server import ServeOptions
    from packcache.server.master import _application

    real = tmp_path / "metrics"
    real.mkdir(mode=0o700)
    for given in (None, str(real)):
        held = hold_metrics_dir(given)
        before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = held.path  # as serve() sets it
        try:
            application = _application(ServeOptions(), lambda pid: None, held, given)
            assert application.cfg.env_orig.get("PROMETHEUS_MULTIPROC_DIR") == given
        finally:
            if before is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
            held.remove()
            os.close(held.fd)


# --------------------------------------------------------------------------- a metrics directory other users can write


def test_a_metrics_directory_other_users_can_write_is_refused_before_anything_is_written() -> None:
    """prometheus_client opens ``<dir>/<kind>_<pid>.db`` by name and writes through it: in a directory
    another user can write, that user plants a symlink there and the server writes through it into a
    file of theirs choosing. ``serve`` refuses such a directory (as the cache refuses one for its
    files), before it starts gunicorn or deletes anything in it."""
    require_root()
    base = Path(tempfile.mkdtemp(prefix="packcache-metrics-"))  # pytest's tmp_path is 0700: nobody can't reach it
    try:
        _refuse_shared_metrics_dir(base)
    finally:
        shutil.rmtree(base)


def _refuse_shared_metrics_dir(base: Path) -> None:
    os.chmod(base, 0o755)
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, no sticky bit: anyone can plant or replace names
    victim = base / "victim"
    victim.write_bytes(b"keep")
    planted = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ln", "-s", str(victim), str(shared / "a.db")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert planted.returncode == 0, planted.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "packcache", "serve", "--port", "0", "--workers", "1", "--metrics-dir", str(shared)],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "other users can write" in done.stderr and "listening" not in done.stdout, done.stderr[-2000:]
    assert (shared / "a.db").is_symlink() and victim.read_bytes() == b"keep"
