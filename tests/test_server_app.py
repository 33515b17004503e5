"""The WSGI application of ``packcache serve`` (``packcache.server.app``) and its request checks: a bad
request is a JSON 4xx, the worker survives it, and SIGTERM stops the server gracefully. A real server on
127.0.0.1 (``harness.serve``).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from harness.serve import call, connection_owner, embed, loaded_workers, long, scrape, server, wait_for


def test_bad_requests_get_a_json_4xx_the_worker_survives_and_sigterm_stops_gracefully(tmp_path: Path) -> None:
    limits = ("--max-texts", "64", "--max-text-chars", "2000", "--max-body-bytes", "200000")
    with server(tmp_path, "--cache-dir", str(tmp_path / "cache"), *limits, workers=1) as srv:
        (pid,) = loaded_workers(srv, 1).workers

        def post(body: bytes) -> tuple[int, str]:
            status, (_, raw) = call(srv, "POST", "/embed", body)
            return status, json.loads(raw)["error"] if status != 200 else ""

        cases = {
            b"not json": 400,
            b'{"texts": "one string"}': 400,
            b'{"texts": [1, 2]}': 400,
            b'{"text": ["typo"]}': 400,
            b'{"texts": ["a"], "more": 1}': 400,
            b"[" * 1000 + b"]" * 1000: 400,
            b'{"texts": [' + b"1" * 100 + b"]}": 400,
            json.dumps({"texts": ["x"] * 65}).encode(): 400,
            json.dumps({"texts": ["y" * 2001]}).encode(): 400,
            b'{"texts": ["\\ud800"]}': 400,
            b"": 400,
            json.dumps({"texts": ["z" * 1999] * 120}).encode(): 413,
        }
        for body, expected in cases.items():
            status, message = post(body)
            assert status == expected and message, (body[:40], status, message)
        assert call(srv, "GET", "/embed")[0] == 405
        assert call(srv, "GET", "/embed")[1][0]["Allow"] == "POST"
        assert call(srv, "POST", "/metrics", b"{}")[0] == 405
        assert call(srv, "GET", "/nope")[0] == 404
        assert embed(srv, [])[1] == []
        served_by, embeddings = embed(srv, ["still here"])
        assert served_by == pid and len(embeddings) == 1 and len(embeddings[0]) == 384
        s = scrape(srv)
        assert set(s.workers) == {pid} and srv.workers() == [pid], "no worker died or was replaced"
        assert s.requests[("/embed", "400", pid)] == sum(1 for c in cases.values() if c == 400)
        assert s.requests[("/embed", "413", pid)] == 1 and s.requests[("/embed", "405", pid)] == 2
        assert s.requests[("other", "404", pid)] == 1 and s.requests[("/metrics", "405", pid)] == 1
        health = json.loads(call(srv, "GET", "/healthz")[1][1])
        assert health.pop("file_check") in ("not_started", "running", "passed"), health  # the background check's
        assert health == {"status": "ok", "pid": pid, "engine": "packcache", "scheme": "int8", "state": "stored",
                          "heap_reason": "none"}  # fmt: skip
        private = list(srv.tmp.iterdir())
        assert len(private) == 1 and private[0].name.startswith("packcache-serve-metrics-")
        assert (private[0].stat().st_mode & 0o777) == 0o700

        # SIGTERM while a slow request is in flight: it completes, then the server exits 0 and cleans up.
        slow = long(48, 1990)
        port = int(srv.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        client_port = conn.sock.getsockname()[1]
        result: list[Any] = []
        sent = threading.Event()

        def send() -> None:
            conn.request("POST", "/embed", json.dumps({"texts": slow}), {"Content-Type": "application/json"})
            sent.set()
            response = conn.getresponse()
            result.append((response.status, len(json.loads(response.read())["embeddings"])))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for("the worker to take the slow request", lambda: connection_owner(port, client_port, [pid]))
        # Accepted is not enough: a connection that has sent nothing yet is idle, and SIGTERM closes idle
        # connections at once. Wait until the whole request is sent and the worker has had time to read it
        # (it reads ~95 KB at once; the batch itself takes over a second, checked just below).
        assert sent.wait(30)
        time.sleep(0.3)
        os.kill(srv.pid, signal.SIGTERM)
        assert sender.is_alive() and not result, "the slow request must still be in flight at SIGTERM"
        sender.join(60)
        assert result == [(200, len(slow))], result
        assert srv.proc.wait(30) == 0, srv.log()
        assert list(srv.tmp.iterdir()) == [], "the private metrics directory is removed at exit"
