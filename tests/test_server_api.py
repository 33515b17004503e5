"""The APIs ``packcache serve`` speaks (``packcache.server.app``) and its batching (``packcache.server.worker``),
against real ``packcache serve`` processes on 127.0.0.1 (``harness.serve``).

* OpenAI's ``POST /v1/embeddings`` and ``GET /v1/models`` through the real ``openai`` client package: string and
  list input, base64 equal to float, ``dimensions``, ``usage``, bad requests raising the client's own errors.
* TEI's ``POST /embed {"inputs": ...}`` and ``GET /info`` over plain HTTP: its answers, its error shape and codes.
* Batching: concurrent requests share forwards (``/metrics``), within the token budget, and batched answers equal
  unbatched ones bit for bit; ``--max-batch-tokens 0`` runs one forward per request.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.serve import TEXTS, Server, call, embed, loaded_workers, long, scrape, server

MODEL = "all-MiniLM-L6-v2"
LONG = " ".join(["river"] * 300)  # 302 tokens with [CLS] and [SEP]: over the model's 256


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("api")
    with server(tmp, "--cache-dir", str(tmp / "cache"), "--max-texts", "16", workers=1) as s:
        loaded_workers(s, 1)
        yield s


def tokens(texts: list[str]) -> list[int]:
    """Tokens of each text as the model counts them (special tokens included), before truncation."""
    from packcache.models import minilm

    tokenizer = minilm.load_tokenizer()
    tokenizer.no_truncation()
    return [len(e.ids) for e in tokenizer.encode_batch([t.strip() for t in texts])]


def post(srv: Server, path: str, body: Any) -> tuple[int, Any]:
    status, (_, raw) = call(srv, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())
    return status, json.loads(raw)


def legacy(srv: Server, texts: list[str]) -> np.ndarray[Any, Any]:
    return np.asarray(embed(srv, texts)[1], dtype=np.float32)


# ---------------------------------------------------------------- OpenAI


def test_the_openai_client_gets_embeddings_usage_base64_and_dimensions_as_from_openai(srv: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    texts = TEXTS[:4]
    expected = legacy(srv, texts)

    one = client.embeddings.create(input=texts[0], model=MODEL, encoding_format="float")
    assert one.model == MODEL and len(one.data) == 1 and one.data[0].index == 0
    np.testing.assert_allclose(one.data[0].embedding, legacy(srv, texts[:1])[0], rtol=0, atol=0)
    assert one.usage.prompt_tokens == one.usage.total_tokens == tokens(texts[:1])[0]

    listed = client.embeddings.create(input=texts, model=MODEL, encoding_format="float")
    assert [d.index for d in listed.data] == [0, 1, 2, 3]
    np.testing.assert_allclose([d.embedding for d in listed.data], expected, rtol=0, atol=0)
    assert listed.usage.prompt_tokens == sum(tokens(texts))
    # The client asks for base64 when no format is given, and decodes it: the same floats, bit for bit.
    decoded = client.embeddings.create(input=texts, model=MODEL)
    np.testing.assert_array_equal(np.asarray([d.embedding for d in decoded.data], np.float32), expected)
    status, raw = post(srv, "/v1/embeddings", {"input": texts, "model": MODEL, "encoding_format": "base64"})
    assert status == 200
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_array_equal(np.stack(rows), expected)

    short = client.embeddings.create(input=texts, model=MODEL, dimensions=32, encoding_format="float")
    got = np.asarray([d.embedding for d in short.data])
    cut = expected[:, :32].astype(np.float64)
    np.testing.assert_allclose(got, cut / np.linalg.norm(cut, axis=1, keepdims=True), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    full = client.embeddings.create(input=texts, model=MODEL, dimensions=384, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in full.data], expected, rtol=0, atol=1e-6)
    # no model: the served one (curl users leave it out); user is accepted
    assert post(srv, "/v1/embeddings", {"input": "x", "user": "me"})[1]["model"] == MODEL


def test_bad_openai_requests_raise_the_clients_errors_with_the_message(srv: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    cases: list[tuple[dict[str, Any], type[openai.APIStatusError], str, str | None]] = [
        ({"input": LONG}, openai.BadRequestError, "maximum context length is 256 tokens", "input"),
        ({"input": "x", "dimensions": 385}, openai.BadRequestError, "'dimensions' must be", "dimensions"),
        ({"input": "x", "dimensions": 0}, openai.BadRequestError, "'dimensions' must be", "dimensions"),
        ({"input": [[1, 2, 3]]}, openai.BadRequestError, "token-id input is not served", "input"),
        ({"input": [1, 2, 3]}, openai.BadRequestError, "token-id input is not served", "input"),
        ({"input": []}, openai.BadRequestError, "must not be an empty list", "input"),
        ({"input": ""}, openai.BadRequestError, "must not contain an empty string", "input"),
        ({"input": ["x"] * 17}, openai.BadRequestError, "at most 16 per request", "input"),
        ({"input": "x", "model": "text-embedding-3-small"}, openai.NotFoundError, "does not exist", "model"),
    ]
    for arguments, error, message, param in cases:
        with pytest.raises(error) as raised:
            client.embeddings.create(**{"model": MODEL, "encoding_format": "float", **arguments})
        assert message in raised.value.message, (arguments, raised.value.message)
        body: Any = raised.value.body
        assert body["type"] == "invalid_request_error" and body["param"] == param, body
    assert client.embeddings.create(input="x", model=MODEL).data, "the server still answers"
    # the bare shape, as a curl user sees it
    status, raw = post(srv, "/v1/embeddings", {"input": "x", "encoding_format": "f16", "model": MODEL})
    assert status == 400 and set(raw["error"]) == {"message", "type", "param", "code"}
    assert raw["error"]["param"] == "encoding_format"
    status, raw = post(srv, "/v1/embeddings", {"input": "x", "extra": 1})
    assert status == 400 and "Unrecognized request argument supplied: extra" in raw["error"]["message"]
    status, raw = post(srv, "/v1/embeddings", b"{nope")
    assert status == 400 and raw["error"]["type"] == "invalid_request_error" and raw["error"]["message"]
    assert call(srv, "GET", "/v1/embeddings")[0] == 405


def test_auto_truncate_serves_long_texts_on_every_route_and_counts_the_tokens_read(tmp_path: Path) -> None:
    with server(tmp_path, "--cache-dir", str(tmp_path / "cache"), "--auto-truncate", workers=1) as srv:
        status, raw = post(srv, "/v1/embeddings", {"input": [LONG, "x"]})
        assert status == 200 and raw["usage"]["prompt_tokens"] == 256 + 3
        expected = legacy(srv, [LONG, "x"])  # the texts shape always truncated
        np.testing.assert_allclose([d["embedding"] for d in raw["data"]], expected, rtol=0, atol=1e-6)
        status, tei = post(srv, "/embed", {"inputs": [LONG, "x"]})
        assert status == 200
        np.testing.assert_allclose(tei, expected, rtol=0, atol=1e-6)
        status, tei = post(srv, "/embed", {"inputs": LONG, "truncate": False})
        assert status == 413 and tei["error_type"] == "Validation", "a request's truncate wins"
        assert json.loads(call(srv, "GET", "/info")[1][1])["auto_truncate"] is True


# ---------------------------------------------------------------- TEI


def test_tei_embed_answers_bare_arrays_and_its_errors_in_its_shape_and_codes(srv: Server) -> None:
    texts = TEXTS[:3]
    expected = legacy(srv, texts)
    status, one = post(srv, "/embed", {"inputs": texts[0]})
    assert status == 200 and np.asarray(one).shape == (1, 384)
    np.testing.assert_allclose(one[0], legacy(srv, texts[:1])[0], rtol=0, atol=0)
    status, many = post(srv, "/embed", {"inputs": texts, "normalize": True, "truncate": False, "prompt_name": None})
    assert status == 200
    np.testing.assert_allclose(many, expected, rtol=0, atol=0)
    status, raw = post(srv, "/embed", {"inputs": texts, "normalize": False})
    raw_rows = np.asarray(raw, dtype=np.float64)
    norms = np.linalg.norm(raw_rows, axis=1)
    assert status == 200 and (norms > 1.5).all(), "the pooled output, before the Normalize module"
    np.testing.assert_allclose(raw_rows / norms[:, None], expected, rtol=0, atol=1e-6)
    status, cut = post(srv, "/embed", {"inputs": [LONG], "truncate": True})
    assert status == 200
    np.testing.assert_allclose(cut, legacy(srv, [LONG]), rtol=0, atol=0)

    cases: list[tuple[Any, int, str, str]] = [
        ({"inputs": LONG}, 413, "Validation", "must have less than 257 tokens. Given: 302"),
        ({"inputs": ["x"] * 17}, 413, "Validation", "batch size 17 > maximum allowed batch size 16"),
        ({"inputs": []}, 400, "Empty", "`inputs` cannot be empty"),
        ({"inputs": 5}, 422, "Validation", "`inputs` must be a string or a list of strings"),
        ({"inputs": [[101, 102]]}, 422, "Validation", "token ids are not served"),
        ({"inputs": "x", "normalize": "yes"}, 422, "Validation", "`normalize` must be true or false"),
        ({"inputs": "x", "prompt_name": "query"}, 422, "Validation", "not one of the model's prompts (none)"),
        ({"inputs": "x", "truncation_direction": "Left"}, 422, "Validation", 'must be "Right"'),
        ({"inputs": "x", "texts": ["y"]}, 422, "Validation", "unknown field 'texts'"),
        ({"inputs": "y" * 10_001}, 413, "Validation", "at most 10000"),
    ]
    for body, code, kind, message in cases:
        status, raw = post(srv, "/embed", body)
        assert (status, raw.get("error_type")) == (code, kind) and message in raw["error"], (body, status, raw)
    # this server's own shape keeps its answers and errors
    status, raw = post(srv, "/embed", {"texts": "one"})
    assert status == 400 and set(raw) == {"error"}

    info = json.loads(call(srv, "GET", "/info")[1][1])
    assert info["model_id"] == MODEL and info["max_input_length"] == 256 and info["max_client_batch_size"] == 16
    assert info["max_batch_tokens"] == 16384 and info["auto_truncate"] is False and info["model_dtype"] == "int8"
    assert call(srv, "POST", "/info", b"{}")[0] == 405


def test_teis_health_probe_gets_200_with_an_empty_body(srv: Server) -> None:
    """TEI's ``GET /health`` was 404: a probe written for TEI took every worker out of rotation."""
    status, (headers, body) = call(srv, "GET", "/health")
    assert (status, body, headers["Content-Length"]) == (200, b"", "0")
    assert call(srv, "POST", "/health", b"{}")[0] == 405


# ---------------------------------------------------------------- batching


def _forwards(srv: Server) -> dict[str, float]:
    """The worker's forward figures: count, requests and texts summed, and how many forwards had one request."""
    text = scrape(srv).text
    figures = {}
    for name in ("requests_count", "requests_sum", "texts_sum"):
        found = [line for line in text.splitlines() if line.startswith(f"packcache_forward_{name}{{")]
        figures[name] = sum(float(line.rsplit(" ", 1)[1]) for line in found)
    for bucket in ("1.0", "2.0"):
        found = [
            line for line in text.splitlines()
            if line.startswith("packcache_forward_requests_bucket{") and f'le="{bucket}"' in line
        ]  # fmt: skip
        figures[f"le_{bucket}"] = sum(float(line.rsplit(" ", 1)[1]) for line in found)
    return figures


def _concurrent(srv: Server, bodies: list[bytes], clients: int, rounds: int) -> list[list[Any]]:
    """Each of ``clients`` threads sends ``bodies[i]`` ``rounds`` times on one kept-alive connection, all at once."""
    port = int(srv.url.rsplit(":", 1)[1])
    answers: list[list[Any]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients)

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            barrier.wait(30)
            for _ in range(rounds):
                conn.request("POST", "/embed", bodies[index], {"Content-Type": "application/json"})
                response = conn.getresponse()
                forward = int(response.getheader("X-Packcache-Forward-Texts", "-1"))
                answers[index].append((response.status, json.loads(response.read()), forward))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return answers


def test_concurrent_requests_share_forwards_within_the_budget_and_answer_as_unbatched(tmp_path: Path) -> None:
    clients, rounds = 12, 4
    # Pairs of texts of 19 to 27 tokens: any two fit a budget of 54 tokens, no three do.
    pairs = [[TEXTS[i], TEXTS[(i + 3) % 8]] for i in (0, 2, 4, 5, 6, 7)]
    sizes = [sum(tokens(pair)) for pair in pairs]
    budget = 2 * max(sizes)
    assert budget < 3 * min(sizes), sizes
    bodies = [json.dumps({"texts": pairs[i % len(pairs)]}).encode() for i in range(clients)]
    answers: dict[str, list[list[Any]]] = {}
    for name, options in (
        ("unbatched", ("--max-batch-tokens", "0")),
        ("batched", ("--batch-wait", "0.05")),
        ("budget", ("--batch-wait", "0.05", "--max-batch-tokens", str(budget))),
    ):
        with server(tmp_path / name, "--cache-dir", str(tmp_path / "cache"), *options, workers=1) as srv:
            loaded_workers(srv, 1)
            before = _forwards(srv)
            answers[name] = _concurrent(srv, bodies, clients, rounds)
            after = {key: value - before[key] for key, value in _forwards(srv).items()}
            assert after["requests_sum"] == clients * rounds and after["texts_sum"] == 2 * clients * rounds, after
            if name == "unbatched":
                assert after["requests_count"] == clients * rounds == after["le_1.0"], "one forward per request"
            elif name == "batched":
                assert after["requests_count"] <= clients * rounds / 3, f"requests share forwards: {after}"
            else:
                assert after["le_2.0"] == after["requests_count"], f"at most two requests fit the budget: {after}"
                assert after["requests_count"] < clients * rounds, f"two requests did share: {after}"
    assert max(a[2] for client in answers["batched"] for a in client) > 2, "the header says when a forward is shared"
    assert max(a[2] for client in answers["budget"] for a in client) <= 4
    for name in ("batched", "budget"):
        for index in range(clients):
            unbatched = answers["unbatched"][index]
            for (status, got, forward), (base_status, base, alone) in zip(answers[name][index], unbatched, strict=True):
                assert status == base_status == 200 and alone == 2 and forward >= 2
                # The same texts in a bigger forward, among other texts: the same floats, bit for bit (one
                # answer per input: the compiled kernels' one sum order, each text's own attention).
                a, b = np.asarray(got["embeddings"]), np.asarray(base["embeddings"])
                assert a.shape == b.shape == (2, 384)
                assert a.tobytes() == b.tobytes(), np.abs(a - b).max()


def test_batching_options_refuse_bad_values(tmp_path: Path) -> None:
    import subprocess
    import sys

    from harness.serve import SRC

    for option, value in (("--max-batch-tokens", "-1"), ("--max-batch-tokens", "x"), ("--batch-wait", "2"),
                          ("--batch-wait", "nan")):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "packcache", "serve", option, value], capture_output=True, text=True, timeout=60,
            env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert done.returncode == 2 and option in done.stderr, (option, value, done.stderr[-300:])


def test_kept_alive_clients_connecting_at_once_are_all_served_soon(tmp_path: Path) -> None:
    """32 clients connect while the model runs a long forward, each sending one request with its connection: a
    batching worker accepts them several per forward. Accepting one at a time (while no request waited) took a
    forward per client: 32 forwards before the last client's first answer, seconds in the kernel's queue."""
    clients = 32
    body = json.dumps({"texts": TEXTS[:2]}).encode()
    with server(tmp_path, "--cache-dir", str(tmp_path / "cache"), workers=1) as srv:
        loaded_workers(srv, 1)
        before = _forwards(srv)
        slow = threading.Thread(
            target=call, args=(srv, "POST", "/embed", json.dumps({"texts": long(64, 2000)}).encode())
        )
        slow.start()
        time.sleep(
            0.5
        )  # the long forward runs: the clients' requests wait in the kernel's queue with their connections
        answers = _concurrent(srv, [body] * clients, clients, 1)
        slow.join(60)
        after = {key: value - before[key] for key, value in _forwards(srv).items()}
    assert [a[0][0] for a in answers] == [200] * clients
    assert after["requests_sum"] == clients + 1 and after["requests_count"] <= clients / 3, after
