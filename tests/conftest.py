from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from harness import ROOT_ONLY
from harness.checkpoints import tiny_bert
from harness.driver import Env, environment
from harness.s3server import S3Server, moto_server
from packcache import _registry

# Hypothesis writes under its home directory even with database=None; keep it out of the work tree.
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="packcache-hypothesis-"))
# The per-user digest cache (packcache.identity) of this run, not the user's own; child processes inherit it.
# Tests that count how a digest was found set their own.
os.environ["PACKCACHE_DIGEST_DIR"] = tempfile.mkdtemp(prefix="packcache-digests-")
# The default cache directory of this run: a load without cache= (hf.*, minilm.load, the CLI without --cache-dir)
# writes its content-named file there, never into the user's ~/.cache; child processes inherit it.
os.environ["PACKCACHE_DIR"] = tempfile.mkdtemp(prefix="packcache-cache-dir-")
# And this user's cache home (fetch's accepted-generation records, the hub cache's default place): the run's own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="packcache-xdg-")


# scripts/test.sh runs pytest twice: PACKCACHE_TEST_PHASE=parallel (under pytest-xdist) runs all but the tests marked
# serial, PACKCACHE_TEST_PHASE=serial only those. An environment variable, not an option: pytest parses its options
# before it reads this file when the run names only src/packcache (the doctests). The parallel phase writes the node ids
# of the serial tests it deselected to $PACKCACHE_TEST_SERIAL_LIST, one per line, so the serial phase can collect their
# files alone (a whole collection is ~10 s of CPU for the few serial tests).
PHASES = ("parallel", "serial")


@pytest.hookimpl(wrapper=True)  # the marks go on before any plugin's own hook runs (xdist's reads xdist_group)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """A test marked ``serial`` asserts a wall-clock bound, so it runs when nothing runs beside it. Deselected, not
    skipped: the two phases of scripts/test.sh together run every collected test once.

    A module that names costly module-scoped fixtures in ``XDIST_SHARED_FIXTURES`` gets the tests using each one
    sent to one xdist worker (``xdist_group``): the fixture is made once per run, not once per worker."""
    for item in items:
        shared = getattr(getattr(item, "module", None), "XDIST_SHARED_FIXTURES", ())
        used = [name for name in shared if name in getattr(item, "fixturenames", ())]
        if used and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{used[0]}"))
    serial = [item.nodeid for item in items if item.get_closest_marker("serial") is not None]  # before ids grow @group
    if config.getoption("loadgroup", default=False):  # an xdist worker under --dist loadgroup
        _name_groups(items)
    phase = os.environ.get("PACKCACHE_TEST_PHASE", "")
    if not phase:
        return (yield)
    if phase not in PHASES:
        raise pytest.UsageError(f"PACKCACHE_TEST_PHASE={phase!r}: expected one of {', '.join(PHASES)}, or unset")
    listing = os.environ.get("PACKCACHE_TEST_SERIAL_LIST")
    if phase == "parallel" and listing:
        _write_list(Path(listing), serial)
    want = phase == "serial"
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (keep if (item.get_closest_marker("serial") is not None) == want else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    return (yield)


def _write_list(path: Path, nodeids: list[str]) -> None:
    """``nodeids``, one per line, to ``path`` whole or not at all: every xdist worker collects the same tests and
    writes the same list, and the serial phase must never read half of one. Pinned by
    tests/test_suite.py::test_the_serial_phase_given_the_parallel_phase_s_list_runs_exactly_its_serial_tests."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text("".join(f"{nodeid}\n" for nodeid in nodeids))
    os.replace(temp, path)


def _name_groups(items: list[pytest.Item]) -> None:
    """Append ``@<group>`` to the node id of each test marked ``xdist_group``, which is how xdist's scheduler sees a
    group. xdist 3.8 does it by setting ``item._nodeid``, which pytest 9 no longer reads (a node id is ``item._id``
    now), so without this every group is silently ignored: pinned by
    tests/test_suite.py::test_an_xdist_group_runs_on_one_worker."""
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})  # fmt: skip
        if names and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture(autouse=True)
def _restore_process_defaults() -> Iterator[None]:
    """Process-wide option defaults changed by a test must not leak into the next."""
    saved = dict(_registry.DEFAULTS)
    yield
    _registry.DEFAULTS.clear()
    _registry.DEFAULTS.update(saved)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    """One moto S3 server on 127.0.0.1 for the whole run (tests/harness/s3server.py); give each test its own
    key prefix (``f"{moto_s3.url}/{uuid.uuid4().hex}"``)."""
    with moto_server() as server:
        yield server


@pytest.fixture
def moto_env(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """:func:`moto_s3` with its ``AWS_*`` variables (dummy keys, ``AWS_ENDPOINT_URL``) set for this test."""
    for name, value in moto_s3.env.items():
        monkeypatch.setenv(name, value)
    return moto_s3


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    """The fault matrix's environment (``harness.driver.environment``: the interpreter and a copy of packcache
    reachable for the real user ``nobody``), once per module; root only. Each test takes its own ``case_dir``."""
    assert os.geteuid() == 0, ROOT_ONLY
    with environment() as made:
        yield made


@pytest.fixture(scope="module")
def reference() -> np.ndarray[Any, Any]:
    """``harness.serve.TEXTS`` embedded in this process by ``minilm.load("int8", cache=False)``, one torch thread:
    what every worker of ``packcache serve`` (one torch thread each) must answer."""
    import torch

    from harness.serve import TEXTS
    from packcache.models import minilm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with minilm.load("int8", cache=False) as model:
            result: np.ndarray[Any, Any] = model.embed(TEXTS)
    finally:
        torch.set_num_threads(threads)
    return result


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT checkpoint (``harness.checkpoints.tiny_bert``, hidden size 32), once per module: the model
    directory the tests of its readers (``run``/``serve --model``, ``minilm.load``) copy and break."""
    return tiny_bert(tmp_path_factory.mktemp("model") / "tiny", hidden=32)
