"""The suite's own machinery (tests/conftest.py, as scripts/test.sh runs it): the two phases and the xdist groups.

Each test runs a child pytest, two xdist workers, on a planted test file that loads tests/conftest.py as a plugin;
every planted test writes which worker ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PLANTED = '''
import os, time
import pytest

XDIST_SHARED_FIXTURES = ("shared",)


@pytest.fixture(scope="module")
def shared():
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture
def record():
    def write(kind, i):
        time.sleep(0.05)  # long enough that both workers take tests
        with open(os.environ["PLANTED_OUT"], "a") as f:
            f.write(f"{kind} {i} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")
    return write


@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(8))
def test_grouped(i, record):
    record("grouped", i)


@pytest.mark.parametrize("i", range(8))
def test_shared(i, shared, record):
    record("shared", i)


@pytest.mark.parametrize("i", range(8))
def test_free(i, record):
    record("free", i)


@pytest.mark.serial
def test_serial(record):
    record("serial", 0)


@pytest.mark.serial
@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", ["a b", "[c]"])
def test_serial_too(i, record):
    record("serial", i)
'''

SERIAL_IDS = ["test_planted.py::test_serial", "test_planted.py::test_serial_too[a b]",
              "test_planted.py::test_serial_too[[c]]"]  # fmt: skip


def _run(
    tmp_path: Path, phase: str, *args: str, targets: list[str] | None = None, listing: Path | None = None
) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Run the planted file (or ``targets``, node ids in it) in ``phase``, the list of serial tests written to
    ``listing``; return kind -> the workers that ran its tests, and kind -> how many ran."""
    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED)
    out = tmp_path / f"{phase}.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "PACKCACHE_TEST_PHASE": phase, "PLANTED_OUT": str(out)}  # fmt: skip
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PACKCACHE_TEST_SERIAL_LIST", None)
    if listing is not None:
        env["PACKCACHE_TEST_SERIAL_LIST"] = str(listing)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-c", os.devnull,
            "--rootdir", str(tmp_path), *args, *(targets if targets is not None else [str(planted)])]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        kind, *_, worker = line.split()
        workers.setdefault(kind, set()).add(worker)
        counts[kind] = counts.get(kind, 0) + 1
    return workers, counts


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    """A group marked ``xdist_group`` and the users of a fixture named in ``XDIST_SHARED_FIXTURES`` each run on one
    worker, while the other tests spread over both; the serial test waits for its phase."""
    workers, counts = _run(tmp_path, "parallel", "-n", "2", "--dist", "loadgroup")
    assert counts == {"free": 8, "grouped": 8, "shared": 8}, counts
    assert len(workers["grouped"]) == 1, workers
    assert len(workers["shared"]) == 1, workers
    assert workers["free"] | workers["grouped"] | workers["shared"] == {"gw0", "gw1"}, workers


@pytest.mark.parametrize("phase", ["serial", ""])
def test_the_serial_phase_runs_only_the_serial_tests_and_no_phase_runs_all(tmp_path: Path, phase: str) -> None:
    _, counts = _run(tmp_path, phase)
    expected = {"serial": 3} if phase else {"free": 8, "grouped": 8, "shared": 8, "serial": 3}
    assert counts == expected, counts


def test_the_serial_phase_given_the_parallel_phase_s_list_runs_exactly_its_serial_tests(tmp_path: Path) -> None:
    """scripts/test.sh's whole run: the parallel phase (two workers, each writing the list) names the serial tests
    it deselected, ids with a space, brackets and a group included, and the serial phase given those ids runs each
    of them once and nothing else."""
    listing = tmp_path / "serial-tests.txt"
    _, counts = _run(tmp_path, "parallel", "-n", "2", "--dist", "loadgroup", listing=listing)
    assert "serial" not in counts, counts
    listed = listing.read_text().splitlines()
    assert listed == SERIAL_IDS, listed
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".serial-tests")]  # no temp file left
    _, counts = _run(tmp_path, "serial", "-m", "serial", targets=listed)
    assert counts == {"serial": 3}, counts


def test_the_ports_of_one_server_are_drawn_distinct() -> None:
    """weed mini takes ten listeners: drawn one by one, each free until the server binds it, two could be the same
    port (a start failing with "address already in use" once in ~20 starts). Drawn avoiding each other, never."""
    from harness.s3server import free_port

    drawn: list[int] = []
    for _ in range(600):  # most of one worker's 2,768 / 4 candidates: a repeat would show
        drawn.append(free_port(avoid=drawn))
    assert len(set(drawn)) == len(drawn)
