"""benchmarks/serve_llm.py's pure parts: the command line, SSE and usage parsing of recorded streams, percentiles;
and its client against a real socket that closes a kept-alive connection as llama-server does."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from serve_llm import Tally, command, completion_body, parse_args, percentile, sse_events, stream

#: llama-cpp-python 0.3.36's server (sse-starlette: CRLF lines, a ping comment), max_tokens 3: one event per
#: token, text empty (the random model's tokens are outside its tokenizer), no usage in the stream.
LLAMACPP = (
    b'data: {"id": "cmpl-b3", "object": "text_completion", "created": 1796254611, "model": "m.gguf", '
    b'"choices": [{"text": "", "index": 0, "logprobs": null, "finish_reason": null}]}\r\n\r\n'
    b": ping - 2026-12-02 23:40:00\r\n\r\n"
    b'data: {"id": "cmpl-b3", "object": "text_completion", "created": 1796254611, "model": "m.gguf", '
    b'"choices": [{"text": "", "index": 0, "logprobs": null, "finish_reason": null}]}\r\n\r\n'
    b'data: {"id": "cmpl-b3", "object": "text_completion", "created": 1796254611, "model": "m.gguf", '
    b'"choices": [{"text": "", "index": 0, "logprobs": null, "finish_reason": "length"}]}\r\n\r\n'
    b"data: [DONE]\r\n\r\n"
)
#: transformers serve 5.23.0, max_tokens 8: no event for an empty text, usage in the final chunk.
TRANSFORMERS = (
    b'data: {"id":"921e","choices":[{"finish_reason":"length","index":0,"text":""}],"created":1796254573,'
    b'"model":"model@main","object":"text_completion",'
    b'"usage":{"completion_tokens":8,"prompt_tokens":19,"total_tokens":27}}\n\n'
)
#: OpenAI's own shape with include_usage: text deltas, then a chunk with no choices and the usage.
OPENAI = (
    b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"Hel","finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"lo","finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c","object":"text_completion","choices":[],'
    b'"usage":{"prompt_tokens":32,"completion_tokens":2,"total_tokens":34}}\n\n'
    b"data: [DONE]\n\n"
)


def _tally(stream: bytes) -> Tally:
    tally = Tally(sent=0.0)
    for i, event in enumerate(sse_events(stream.splitlines(keepends=True)), start=1):
        tally.feed(event, now=float(i))
    return tally


def test_llamacpp_stream_counts_tokens_from_its_length_finish() -> None:
    t = _tally(LLAMACPP)
    assert (t.token_events, t.text_chars, t.finish_reason, t.usage, t.done_marker) == (2, 0, "length", None, True)
    assert t.ttft == 1.0  # the first event, though its text is empty
    assert t.tokens(3) == (3, "length")
    t.finish_reason = "stop"  # an early end without usage: only what was streamed
    assert t.tokens(3) == (2, "events")


def test_transformers_stream_has_usage_but_no_first_token() -> None:
    t = _tally(TRANSFORMERS)
    assert t.tokens(8) == (8, "usage") and t.usage is not None and t.usage["prompt_tokens"] == 19
    assert t.ttft is None and t.token_events == 0 and not t.done_marker


def test_openai_stream_usage_wins_over_events_and_max_tokens() -> None:
    t = _tally(OPENAI)
    assert (t.token_events, t.text_chars, t.finish_reason, t.ttft) == (2, 5, "stop", 1.0)
    assert t.tokens(64) == (2, "usage")


def test_sse_joins_multiline_data_and_rejects_non_json() -> None:
    lines = [b"event: message\n", b'data: {"a":\n', b"data: 1}\n", b"\n", b"data: [DONE]\n"]
    assert list(sse_events(lines)) == [{"a": 1}, None]  # the last event needs no blank line after it
    with pytest.raises(ValueError, match="not JSON: 'oops'"):
        list(sse_events([b"data: oops\n", b"\n"]))
    with pytest.raises(RuntimeError, match="streamed an error"):
        Tally(sent=0).feed({"error": {"message": "bad"}}, 1.0)


def test_completion_body_is_greedy_streaming_with_usage() -> None:
    body = json.loads(completion_body("m", "a b", 64))
    assert body == {"model": "m", "prompt": "a b", "max_tokens": 64, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
    assert "stream" not in json.loads(completion_body("m", "a b", 4, stream=False))


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = list(np.random.default_rng(int(q)).exponential(size=17))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([3.0], q) == 3.0


def test_percentile_rejects_no_values_and_bad_q() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="101 is outside"):
        percentile([1.0], 101)


def test_arguments_resolve_quick_and_explicit_choices() -> None:
    full = parse_args([])
    assert full.clients == (1, 4, 16) and full.max_tokens == 64 and full.requests == {1: 3, 4: 2, 16: 1}
    assert "transformers-cb-bf16" not in full.systems and "packcache-int4" in full.systems
    quick = parse_args(["--quick", "--systems", "llamacpp-Q4_0,packcache-int8"])
    assert quick.clients == (1, 4) and quick.max_tokens == 32 and quick.requests == {1: 2, 4: 1}
    assert quick.systems == ("packcache-int8", "llamacpp-Q4_0")  # the report's order, not the asked one
    mine = parse_args(["--clients", "16,2,2", "--requests", "5", "--max-tokens", "8"])
    assert mine.clients == (2, 16) and mine.requests == {2: 5, 16: 5} and mine.max_tokens == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--systems", "vllm"], "--systems: vllm; choose from packcache-int8"),
        (["--clients", "0,4"], "comma-separated positive integers"),
        (["--clients", "a"], "comma-separated positive integers"),
        (["--requests", "0"], "--requests must be at least 1, not 0"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_memory_readers_see_a_mapped_file_and_this_process(tmp_path: Path) -> None:
    import mmap
    import os

    from serve_llm import mapping_pss_kib, rollup_kib, tree, tree_memory

    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert sum(mm[i] for i in range(0, len(mm), 4096)) >= 0  # fault every page in
        pss = mapping_pss_kib(os.getpid(), path)
        assert 8 * 1024 - 64 <= pss <= 8 * 1024, pss  # this process alone maps it
        assert mapping_pss_kib(os.getpid(), tmp_path / "other.bin") == 0
        roll = rollup_kib(os.getpid())
        assert roll["Rss"] >= 8 * 1024 and roll["Pss"] >= pss
    assert os.getpid() in tree(os.getpid()) and tree_memory(os.getpid())["processes"] >= 1
    assert rollup_kib(2**22 + 12345) == {}  # no such process: nothing, not an error


def test_ttft_counts_only_streams_that_showed_every_token() -> None:
    from serve_llm import summarise

    every = _tally(OPENAI)  # 2 token events, usage 2
    every.done = 5.0
    late = _tally(TRANSFORMERS)  # usage 8, no token event
    late.first_token, late.done = 4.0, 6.0  # as if one late token had text: not a first token
    r = summarise([every, late], 64, began=0.0)
    assert (r["tokens"], r["wall_s"], r["tok_s"]) == (10, 6.0, 10 / 6.0)
    assert r["ttft_measured"] == 1 and r["ttft_p50_s"] == 1.0 and r["token_events_per_token"] == 0.2
    assert r["full_length"] == 0 and r["finish_reasons"] == {"stop": 1, "length": 1}
    assert summarise([late], 64, began=0.0)["ttft_p50_s"] is None


def _silent_closer(answers: int) -> tuple[socket.socket, list[int]]:
    """A listener on 127.0.0.1 that answers ``answers`` requests, each on its own accepted connection, with an
    HTTP/1.1 stream that does not say it closes (no ``Connection: close``), then closes the socket: what
    llama-server does after every streamed answer. The list counts the connections it accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def serve() -> None:
        for _ in range(answers):
            conn, _ = listener.accept()
            accepted.append(1)
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))  # fmt: skip
                while len(body) < length:
                    body += conn.recv(65536)
                chunk = OPENAI
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")  # fmt: skip
            # the socket is closed here, without a word to the client

    threading.Thread(target=serve, daemon=True).start()
    return listener, accepted


def test_the_client_reconnects_when_a_kept_alive_connection_was_closed_silently() -> None:
    listener, accepted = _silent_closer(3)
    port = listener.getsockname()[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = completion_body("m", "a prompt", 2)
    try:
        tallies = [stream(conn, body) for _ in range(3)]
    finally:
        conn.close()
        listener.close()
    assert [t.tokens(2)[0] for t in tallies] == [2, 2, 2]
    assert [t.reconnects for t in tallies] == [0, 1, 1] and len(accepted) == 3


def test_a_fresh_connection_that_fails_is_the_servers_failure_not_retried() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def refuse() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()  # no answer at all

    threading.Thread(target=refuse, daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        with pytest.raises(http.client.RemoteDisconnected):
            stream(conn, completion_body("m", "a prompt", 2))
    finally:
        conn.close()
        listener.close()


def test_llama_server_runs_with_packcaches_slots_and_context_per_sequence(tmp_path: Path) -> None:
    python = tmp_path / "env" / "venv" / "bin" / "python"
    argv, ready, _, weights = command("llama-server-Q8_0", tmp_path, str(python), 8123)
    assert argv[0] == str(tmp_path / "env" / "llama-server" / "bin" / "llama-server")
    assert argv[argv.index("--parallel") + 1] == "16" and argv[argv.index("--ctx-size") + 1] == str(16 * 4096)
    assert "--cont-batching" in argv and ready == "/health" and weights == tmp_path / "gguf" / "model-Q8_0.gguf"
