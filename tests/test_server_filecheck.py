"""The background check of a served cache file (``packcache.server.filecheck``): every pack's checksum, once per
server, after the load, by one worker's child process at nice 19.

A warm load reads no pack data, so a pack damaged at rest was mapped and served: ``serve`` of a file with bytes
flipped inside a pack said ``mapped``, ``/healthz`` said ok and the embeddings changed; only ``packcache verify``
found it. Real files with real flipped bytes, real servers on 127.0.0.1 (``harness.serve``), real checker processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness.serve import call, server, wait_for
from test_cli_run import build_file, copy_of, damage

if TYPE_CHECKING:
    from packcache.server.filecheck import FileCheck, FileChecker

XDIST_SHARED_FIXTURES = ("model_file",)  # a build of the tiny model: made once, on one worker


@pytest.fixture(scope="module")
def model_file(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT (conftest's ``base``) as an int8 cache file that holds its model; tests damage copies."""
    return build_file(base, tmp_path_factory.mktemp("file") / "tiny-int8.pcache")


def check_figures(text: str) -> dict[int, dict[str, Any]]:
    """Per worker pid, the scrape's file check figures: ``state`` (the one-hot label set to 1) and the others."""
    from prometheus_client.parser import text_string_to_metric_families

    workers: dict[int, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("packcache_file_check"):
                continue
            figures = workers.setdefault(int(sample.labels["pid"]), {})
            if sample.name == "packcache_file_check":
                if sample.value == 1:
                    figures["state"] = sample.labels["state"]
                figures.setdefault("states", set()).add(sample.labels["state"])
            else:
                figures[sample.name.removeprefix("packcache_file_check_")] = sample.value
    return workers


def scraped(srv: Any, workers: int, state: str) -> dict[int, dict[str, Any]]:
    """Scrape until ``workers`` workers report the check in ``state``."""

    def check() -> dict[int, dict[str, Any]] | None:
        status, (_, body) = call(srv, "GET", "/metrics")
        figures = check_figures(body.decode()) if status == 200 else {}
        done = {pid: f for pid, f in figures.items() if f.get("state") == state}
        return done if len(done) == workers else None

    found: dict[int, dict[str, Any]] = wait_for(f"{workers} workers whose file check is {state}", check, 60, srv.log)
    return found


def log_lines(srv: Any, level: str, text: str) -> list[str]:
    return [line for line in srv.err.read_text().splitlines() if f"[{level}]" in line and text in line]


# ------------------------------------------------------------ a damaged pack: healthz 503, metrics and one ERROR line


def test_a_server_of_a_damaged_file_says_so_in_healthz_metrics_and_its_log(model_file: Path, tmp_path: Path) -> None:
    """Two workers map the damaged file: one checker reads it (not one per worker), and every worker then answers
    ``/healthz`` 503 naming the entry and its offset, and scrapes ``failed``; the log has one ERROR line."""
    bad = copy_of(model_file, tmp_path / "bad" / "tiny-int8.pcache")
    entry = damage(bad)
    with server(tmp_path, "--model", str(bad), workers=2) as srv:
        started = time.monotonic()

        def unhealthy() -> bytes | None:
            status, (_, body) = call(srv, "GET", "/healthz")
            return body if status == 503 else None

        body = wait_for("/healthz 503", unhealthy, 60, srv.log)
        seconds = time.monotonic() - started
        reason = json.loads(body)["error"]
        assert str(bad) in reason and repr(entry.name) in reason and f"offset {entry.offset}" in reason, reason
        figures = scraped(srv, 2, "failed")
        from packcache.server.filecheck import CheckState

        for one in figures.values():
            assert one["failed_packs"] == 1 and one["finished_timestamp_seconds"] > 0, one
            assert one["states"] == {s.value for s in CheckState}, "every state is exported, 0 included"
        errors = wait_for("the ERROR line", lambda: log_lines(srv, "ERROR", "failed its checksum check"), 30, srv.log)
        assert len(errors) == 1 and str(bad) in errors[0], errors
        assert repr(entry.name) in errors[0] and f"offset {entry.offset}" in errors[0], errors[0]
        assert len(log_lines(srv, "INFO", "checking every pack of")) == 1, "one checker for the whole server"
        assert call(srv, "GET", "/health")[0] == 503, "TEI's probe says what /healthz says"
        # /healthz said it while the workers kept serving: taking the node out is the load balancer's move
        assert call(srv, "POST", "/embed", json.dumps({"texts": ["still answered"]}).encode())[0] == 200
    print(f"damaged file: /healthz 503 {seconds:.2f} s after the server listened")


def test_a_causal_lm_server_of_a_damaged_file_answers_healthz_503(tmp_path: Path) -> None:
    """The generation server (``server.llm``) runs the same check: its worker maps the file the same way."""
    from harness.checkpoints import tiny_causal_lm

    checkpoint = tiny_causal_lm(tmp_path / "tiny-llama")
    bad = build_file(checkpoint, tmp_path / "llm" / "tiny-llama-int8.pcache", "--auto-class", "AutoModelForCausalLM")
    entry = damage(bad, "q_proj.weight")
    with server(tmp_path, "--model", str(bad), "--max-model-len", "64", "--max-seqs", "2", workers=1) as srv:

        def unhealthy() -> bytes | None:
            status, (_, body) = call(srv, "GET", "/healthz")
            return body if status == 503 else None

        reason = json.loads(wait_for("/healthz 503", unhealthy, 60, srv.log))["error"]["message"]
        assert repr(entry.name) in reason and f"offset {entry.offset}" in reason, reason
        scraped(srv, 1, "failed")


# ------------------------------------------------------------ the claim, the checker and its status


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Iterator[int]:
    """A private directory, open, as the master holds its metrics directory."""
    directory = tmp_path / "metrics"
    directory.mkdir(mode=0o700)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def ended(checker: FileChecker, timeout: float = 60.0) -> FileCheck:
    def check() -> FileCheck | None:
        now = checker.current()
        return now if now.state in ("passed", "failed", "error") else None

    result: FileCheck = wait_for("the check to end", check, timeout)
    return result


def test_one_checker_per_file_whatever_the_workers_and_a_new_server_checks_again(
    model_file: Path, metrics_dir: int
) -> None:
    """Workers that load one file start one checker between them; a check that ended is final for the file as
    mapped; the master's ``clear_checks`` at start makes a new server check it again."""
    from packcache.server.filecheck import clear_checks, start_check

    first = start_check(str(model_file), metrics_dir)
    second = start_check(str(model_file), metrics_dir)  # while the first checker holds the claim, or after it ended
    assert first.process is not None and second.process is None
    assert first.process.wait(60) == 0
    done = ended(first)
    assert done.state == "passed" and done.packs > 0 and done.checked_bytes > 0 and done.finished >= done.started > 0
    assert ended(second) == done, "every worker reads the one result"
    third = start_check(str(model_file), metrics_dir)
    assert third.process is None and ended(third) == done, "a check that ended is not run again"
    clear_checks(metrics_dir)
    assert [n for n in os.listdir(metrics_dir) if n.startswith("packcache-filecheck-")] == []
    again = start_check(str(model_file), metrics_dir)
    assert again.process is not None and again.process.wait(60) == 0 and ended(again).state == "passed"


def test_a_checker_that_dies_leaves_state_error_and_the_next_worker_checks_again(
    model_file: Path, metrics_dir: int
) -> None:
    """A checker killed mid-check (at one byte a second it never ends by itself) leaves ``error``, never
    ``running`` for good; the next worker to load the file claims it and checks it."""
    from packcache.server.filecheck import start_check

    stalled = start_check(str(model_file), metrics_dir, rate=1)
    assert stalled.process is not None
    wait_for("the checker to start reading", lambda: stalled.current().state == "running", 60)
    stalled.process.send_signal(signal.SIGKILL)
    failed = ended(stalled)
    assert failed.state == "error" and f"pid {stalled.process.pid}" in failed.error, failed
    retried = start_check(str(model_file), metrics_dir)
    assert retried.process is not None and retried.process.wait(60) == 0 and ended(retried).state == "passed"


def test_nothing_is_checked_without_a_mapped_file_and_an_unreadable_one_is_error(
    tmp_path: Path, metrics_dir: int
) -> None:
    from packcache.server.filecheck import start_check

    assert start_check("", metrics_dir).current().state == "none"
    assert start_check(str(tmp_path / "x.pcache"), None).current().state == "none"
    missing = start_check(str(tmp_path / "missing.pcache"), metrics_dir).current()
    assert missing.state == "error" and "cannot open it" in missing.error


def test_a_malformed_status_file_is_not_believed() -> None:
    from packcache.server.filecheck import FileCheck

    assert FileCheck.decode(FileCheck("passed", "f", packs=3, finished=1.5).encode()).packs == 3
    for data in (b"[]", b'{"packs": "3"}', b'{"failed_packs": true}', b'{"problems": [1]}', b"{"):
        with pytest.raises(ValueError):
            FileCheck.decode(data)


def test_the_reason_names_the_file_the_damaged_entries_and_how_many_more() -> None:
    from packcache.server.filecheck import FileCheck

    check = FileCheck("failed", "/m.pcache", packs=59, failed_packs=7, problems=("entry 'w' at offset 64: x",))
    assert "/m.pcache failed its checksum check: 7 of 59 packs damaged: entry 'w' at offset 64" in check.reason
    assert "(and 6 more)" in check.reason
