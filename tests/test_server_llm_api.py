"""``packcache serve`` of a causal LM, driven the way its users drive it: the real ``openai`` client against real
servers (a tiny random Llama made here), streamed and whole, many at once, cut off, stopped and restarted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.checkpoints import tiny_causal_lm
from harness.serve import Server, call, scrape, server, wait_for

openai = pytest.importorskip("openai", reason="the test extra installs openai (bash scripts/setup.sh)")

#: The module's costly fixture (a server): its users run on one xdist worker, so it is started once (conftest.py).
XDIST_SHARED_FIXTURES = ("bare",)
#: A generation long enough to be cut off mid-way on this machine's 2 cores (the tiny model makes ~1 ms tokens).
LONG = 200


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_causal_lm(tmp_path_factory.mktemp("llm") / "tiny-llama", max_positions=512)


def _client(srv: Server) -> Any:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(model: Path, prompt: str, max_tokens: int) -> str:
    """Greedy text of ``generate()`` on the same packed model, in this process: what the server must answer."""
    import torch

    import packcache.hf

    packed = packcache.hf.from_pretrained(model, "fp32", False, auto_class="AutoModelForCausalLM")
    tokenizer = packcache.hf.tokenizer(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = packed.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=2)
    new = out[0, ids.shape[1] :].tolist()
    if 2 in new:
        new = new[: new.index(2)]
    text: str = tokenizer.decode(new, skip_special_tokens=True)
    return text


def _stream_text(stream: Any) -> tuple[str, Any, str | None]:
    """The text, usage and finish reason of a streamed chat or text completion."""
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            parts.append(delta or "")
            finish = choice.finish_reason or finish
    return "".join(parts), usage, finish


def test_greedy_completions_whole_and_streamed_are_generates_text_with_usage(model: Path, tmp_path: Path) -> None:
    expected = _reference(model, "the river city", 24)
    assert expected, "the tiny model's greedy text is empty: the test would prove nothing"
    with server(tmp_path, "--model", str(model), "--scheme", "fp32", workers=1) as srv:
        client = _client(srv)
        whole = client.completions.create(model=model.name, prompt="the river city", max_tokens=24, temperature=0)
        assert whole.choices[0].text == expected
        assert whole.choices[0].finish_reason in ("length", "stop")
        assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens <= 24
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
        chunks = list(client.completions.create(
            model=model.name, prompt="the river city", max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        text, usage, finish = _stream_text(chunks)
        assert (text, finish) == (expected, whole.choices[0].finish_reason)
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        # an event per generated token, whatever its text, the last one too: here the EOS that ends the text, a
        # token with no text (usage counts it), whose event came only with the finish reason before
        chunks = list(client.completions.create(
            model=model.name, prompt="The weather is nice", max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        text, usage, finish = _stream_text(chunks)
        assert finish == "stop" and usage is not None and usage.completion_tokens < 40, (finish, usage)
        token_events = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
        assert len(token_events) == usage.completion_tokens, [c.choices[0].text for c in token_events]

        messages = [{"role": "user", "content": "Where is the nearest train station?"}]
        chat = client.chat.completions.create(model=model.name, messages=messages, max_tokens=16, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        text, usage, finish = _stream_text(client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        assert text == chat.choices[0].message.content and finish == chat.choices[0].finish_reason
        assert usage is not None and usage.prompt_tokens == chat.usage.prompt_tokens
        # The chat template was applied: the prompt is longer than the message's own tokens.
        plain = client.completions.create(model=model.name, prompt=messages[0]["content"], max_tokens=1)
        assert chat.usage.prompt_tokens > plain.usage.prompt_tokens

        models = client.models.list()
        assert [m.id for m in models.data] == [model.name]


def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(model: Path, tmp_path: Path) -> None:
    with server(tmp_path, "--model", str(model), "--scheme", "fp32", workers=1) as srv:
        client = _client(srv)
        full = client.completions.create(model=model.name, prompt="the weather", max_tokens=40, temperature=0)
        text = full.choices[0].text
        words = [w for w in re.findall(r"\S{2,}", text[len(text) // 3 :])]
        assert words, f"no word to stop at in {text!r}"
        stop = words[0][:3] if len(words[0]) >= 3 else words[0]
        cut = text.index(stop)
        for stream in (False, True):
            answer = client.completions.create(
                model=model.name, prompt="the weather", max_tokens=40, temperature=0, stop=[stop, "\u2603never"],
                stream=stream,
            )  # fmt: skip
            got, _, finish = _stream_text(answer) if stream else (answer.choices[0].text, None,
                                                                  answer.choices[0].finish_reason)  # fmt: skip
            assert (got, finish) == (text[:cut], "stop"), (stream, stop)


def test_a_seed_gives_the_same_sampled_text_alone_and_among_other_requests(model: Path, tmp_path: Path) -> None:
    with server(tmp_path, "--model", str(model), "--scheme", "fp32", workers=1) as srv:
        client = _client(srv)

        def sample(seed: int) -> str:
            answer = client.completions.create(
                model=model.name, prompt="the market", max_tokens=20, temperature=1.0, top_p=0.9, seed=seed
            )
            return str(answer.choices[0].text)

        alone = sample(7)
        crowd: list[str] = []
        threads = [threading.Thread(target=lambda: crowd.append(sample(8))) for _ in range(3)]
        threads.append(threading.Thread(target=lambda: crowd.append("7:" + sample(7))))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert f"7:{alone}" in crowd
        assert sample(8) in crowd
        assert len({sample(s) for s in range(5)}) > 1, "five seeds gave one text: sampling ignores the seed"


def test_sixteen_concurrent_streams_are_each_complete_and_well_formed(model: Path, tmp_path: Path) -> None:
    # fp32: a row's result does not depend on the rows beside it (int8 prefill takes another kernel past 64 rows)
    with server(tmp_path, "--model", str(model), "--scheme", "fp32", "--max-seqs", "8", workers=2) as srv:
        client = _client(srv)
        results: dict[int, tuple[str, Any, str | None]] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                messages = [{"role": "user", "content": f"question {i}: where is the forest?"}]
                results[i] = _stream_text(client.chat.completions.create(
                    model=model.name, messages=messages, max_tokens=32, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                ))  # fmt: skip
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and len(results) == 16, errors[:3]
        for i, (_, usage, finish) in results.items():
            assert finish in ("length", "stop"), (i, finish)
            assert usage is not None and 0 < usage.completion_tokens <= 32, (i, usage)
            assert finish == "stop" or usage.completion_tokens == 32, (i, usage, finish)
        # Each answer is the one the same request gets alone (greedy): batching changes no text.
        for i in (0, 9):
            messages = [{"role": "user", "content": f"question {i}: where is the forest?"}]
            alone = client.chat.completions.create(model=model.name, messages=messages, max_tokens=32, temperature=0)
            assert alone.choices[0].message.content == results[i][0], i


def _post_stream(srv: Server, body: dict[str, Any]) -> socket.socket:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
        f"\r\n\r\n".encode() + data
    )
    return sock


def test_a_client_that_disconnects_mid_stream_frees_its_slot_at_once(model: Path, tmp_path: Path) -> None:
    """One sequence per worker: a second request runs only once the first's slot is free. The first client reads
    a few events and closes; its generation must stop there, not run on to its max_tokens."""
    with server(tmp_path, "--model", str(model), "--scheme", "fp32", "--max-seqs", "1", workers=1) as srv:
        sock = _post_stream(srv, {"prompt": "the story", "max_tokens": LONG, "temperature": 0, "stream": True,
                                  "stop": None})  # fmt: skip
        got = b""
        while got.count(b"data: ") < 3:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 OK") and b"text/event-stream" in got
        sock.close()
        client = _client(srv)
        answer = client.completions.create(model=model.name, prompt="the answer", max_tokens=8, temperature=0)
        assert answer.usage.completion_tokens >= 1
        generated = scrape_total(srv, "packcache_completion_tokens_total")
        assert generated < LONG, f"{generated} tokens generated: the closed stream ran on"


def scrape_total(srv: Server, name: str) -> float:
    status, (_, body) = call(srv, "GET", "/metrics")
    assert status == 200
    values = [float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(name + "{")]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def test_bad_requests_get_openais_errors_and_the_metrics_count_tokens(model: Path, tmp_path: Path) -> None:
    with server(tmp_path, "--model", str(model), "--scheme", "int8", "--max-model-len", "128", workers=1) as srv:
        client = _client(srv)
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as long:
            client.completions.create(model=model.name, prompt="paper " * 300, max_tokens=2)
        assert long.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as too_many:
            client.completions.create(model=model.name, prompt="x", max_tokens=127)
        assert too_many.value.code == "context_length_exceeded"
        for bad in ({"temperature": 3}, {"top_p": 0}, {"stop": ["a"] * 5}, {"n": 2}, {"logprobs": 2}):
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model=model.name, prompt="x", max_tokens=2, **bad)  # type: ignore[arg-type]
            assert refused.value.param == next(iter(bad)), bad
        with pytest.raises(openai.BadRequestError) as unknown:
            client.completions.create(model=model.name, prompt="x", max_tokens=2, extra_body={"mirostat": 2})
        assert "mirostat" in str(unknown.value)
        status, (_, body) = call(srv, "POST", "/v1/chat/completions", b'{"messages": [{"role": "robot", '
                                 b'"content": "hi"}], "max_tokens": 2}')  # fmt: skip
        assert status == 400 and json.loads(body)["error"]["param"] == "messages", body
        # this model's template ignores a message's name: refused, never dropped
        named = {"messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 2}
        status, (_, body) = call(srv, "POST", "/v1/chat/completions", json.dumps(named).encode())
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "messages" and "messages[0].name" in error["message"], body
        before = scrape_total(srv, "packcache_completion_tokens_total") if _has(srv, "completion_tokens") else 0
        answer = client.completions.create(model=model.name, prompt="the city light", max_tokens=6, temperature=0)
        text = scrape(srv)  # the worker's other figures are still there
        assert text.workers
        assert scrape_total(srv, "packcache_completion_tokens_total") == before + answer.usage.completion_tokens
        assert scrape_total(srv, "packcache_prompt_tokens_total") >= answer.usage.prompt_tokens
        assert scrape_total(srv, "packcache_time_to_first_token_seconds_count") >= 1


def _has(srv: Server, what: str) -> bool:
    status, (_, body) = call(srv, "GET", "/metrics")
    return status == 200 and what.encode() in body


def test_a_model_without_a_chat_template_refuses_chat_but_completes_text(tmp_path: Path) -> None:
    plain = tiny_causal_lm(tmp_path / "plain", chat_template=False)
    with server(tmp_path, "--model", str(plain), "--scheme", "int8", workers=1) as srv:
        client = _client(srv)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=plain.name, messages=[{"role": "user", "content": "hi"}])
        assert "template" in str(refused.value)
        assert client.completions.create(model=plain.name, prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_sigterm_under_streaming_load_finishes_or_cleanly_ends_every_stream_and_stops(
    model: Path, tmp_path: Path
) -> None:
    """Streams that fit the grace finish; the rest end with an error event and [DONE], never a reset; the server
    stops within its grace."""
    args = ("--model", str(model), "--scheme", "fp32", "--graceful-timeout", "4")
    with server(tmp_path, *args, workers=2) as srv:
        client = _client(srv)
        outcomes: list[str] = []

        def stream(max_tokens: int) -> None:
            try:
                _, usage, finish = _stream_text(client.completions.create(
                    model=model.name, prompt="the engine", max_tokens=max_tokens, temperature=0, stream=True,
                ))  # fmt: skip
                outcomes.append(f"finished {finish} {usage.completion_tokens if usage else None}")
            except openai.APIError as exc:  # the error event
                outcomes.append(f"error {exc.message}")
            except Exception as exc:
                outcomes.append(f"broken {exc!r}")

        # Short streams finish within the grace; the long ones may not.
        threads = [threading.Thread(target=stream, args=(n,)) for n in (8, 8, 400, 400)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        started = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        for t in threads:
            t.join(30)
        srv.proc.wait(30)
        stopped = time.monotonic() - started
        assert len(outcomes) == 4 and not any(o.startswith("broken") for o in outcomes), outcomes
        assert sum(o.startswith("finished") for o in outcomes) >= 2, outcomes
        assert srv.proc.returncode == 0 and stopped < 8, (srv.proc.returncode, stopped)


def test_sighup_picks_up_a_new_model_with_no_failed_request(tmp_path: Path) -> None:
    """The model directory is replaced in place (a new version), then SIGHUP: the old workers finish their streams,
    the new ones load the new weights, and a client streaming throughout never sees a failure."""
    model = tmp_path / "models" / "current"
    tiny_causal_lm(tmp_path / "v1", seed=1)
    tiny_causal_lm(tmp_path / "v2", seed=2)
    shutil.copytree(tmp_path / "v1", model)
    args = ("--model", str(model), "--scheme", "int8", "--cache-dir", str(tmp_path / "cache"))
    with server(tmp_path, *args, workers=2) as srv:
        client = _client(srv)

        def greedy() -> str:
            answer = client.completions.create(model="current", prompt="the forest", max_tokens=12, temperature=0)
            return str(answer.choices[0].text)

        first = greedy()
        failures: list[str] = []
        served = [0]
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    _, usage, finish = _stream_text(client.completions.create(
                        model="current", prompt="the forest", max_tokens=24, temperature=0, stream=True,
                    ))  # fmt: skip
                    if finish not in ("length", "stop") or usage is None:
                        failures.append(f"{finish} {usage}")
                    served[0] += 1
                except Exception as exc:
                    failures.append(repr(exc))

        clients = [threading.Thread(target=traffic) for _ in range(2)]
        for t in clients:
            t.start()
        try:
            wait_for("traffic", lambda: served[0] >= 2, timeout=60)
            old = set(srv.workers())
            for name in os.listdir(tmp_path / "v2"):
                shutil.copy(tmp_path / "v2" / name, model / f".{name}.new")
                os.rename(model / f".{name}.new", model / name)
            os.kill(srv.pid, signal.SIGHUP)
            wait_for("the new workers", lambda: (lambda now: len(now) == 2 and not now & old)(set(srv.workers())),
                     timeout=120)  # fmt: skip
            wait_for("the new model", lambda: greedy() != first, timeout=60)
            after = served[0]
            wait_for("traffic after", lambda: served[0] >= after + 2, timeout=60)
        finally:
            stop.set()
            for t in clients:
                t.join(60)
        assert failures == [], failures[:5]


# ---------------------------------------------------------------- what a client sends: served or refused by name

#: A chat template that writes each message's ``name`` after its role: a name it is given changes the prompt.
NAMED_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + (' ' + message['name'] if message['name'] is defined else '') + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server of a tiny Llama whose tokenizer adds no BOS (as GPT-2's does not: an empty prompt has no token) and
    whose chat template uses a message's name, with a 64-token context."""
    tmp = tmp_path_factory.mktemp("bare")
    model = tiny_causal_lm(tmp / "bare-llama")
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None  # no <s> before the text
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    (model / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    with server(tmp, "--model", str(model), "--scheme", "fp32", "--max-model-len", "64", "--max-tokens", "32",
                workers=1) as srv:  # fmt: skip
        yield srv


def _no_traceback(srv: Server) -> None:
    log = srv.err.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def test_an_empty_prompt_to_a_tokenizer_without_bos_is_refused_by_name(bare: Server) -> None:
    """Before, the engine refused the prompt of no token after the request had been accepted: 500
    ``{"error": "internal error"}`` (not OpenAI's shape) and a traceback in the log."""
    client = _client(bare)
    for prompt in ("", [""]):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="bare-llama", prompt=prompt, max_tokens=4)
        assert refused.value.param == "prompt" and "no tokens" in refused.value.message, refused.value.body
    assert client.completions.create(model="bare-llama", prompt="the city", max_tokens=2).usage.prompt_tokens >= 1
    _no_traceback(bare)


def test_a_prompt_without_room_for_the_default_16_tokens_is_context_length_exceeded(bare: Server) -> None:
    """``/v1/completions`` defaults ``max_tokens`` to 16, as OpenAI's. A prompt of 49 to 63 tokens on a 64-token
    context sent without it went to the engine, which refused it there: 500 and a traceback."""
    client = _client(bare)
    for ids in ([7] * 49, [7] * 63):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="bare-llama", prompt=ids)
        assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_tokens"
        assert "defaults to 16" in refused.value.message, refused.value.message
    assert client.completions.create(model="bare-llama", prompt=[7] * 48).usage.completion_tokens >= 1
    _no_traceback(bare)


def test_json_mode_and_stream_options_without_a_stream_are_refused_by_name(bare: Server) -> None:
    """``response_format`` was accepted and ignored: a JSON-mode client got free text with 200."""
    client = _client(bare)
    messages = [{"role": "user", "content": "Answer in JSON."}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for response_format in ({"type": "json_object"}, schema):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="bare-llama", messages=messages, max_tokens=4,
                                           response_format=response_format)  # type: ignore[arg-type]  # fmt: skip
        assert refused.value.param == "response_format" and "JSON" in refused.value.message
    text = client.chat.completions.create(model="bare-llama", messages=messages, max_tokens=4,
                                          response_format={"type": "text"})  # fmt: skip
    assert text.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="bare-llama", messages=messages, max_tokens=4,
                                       stream_options={"include_usage": True})  # fmt: skip
    assert refused.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="bare-llama", messages=messages, max_tokens=4, max_completion_tokens=5)
    assert refused.value.param == "max_completion_tokens"
    _no_traceback(bare)


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(bare: Server) -> None:
    """``stream_options.continuous_usage_stats`` (vLLM's) was accepted and ignored."""
    client = _client(bare)
    for options in ({"continuous_usage_stats": True}, {"continuous_usage_stats": True, "include_usage": True}):
        chunks = list(client.completions.create(
            model="bare-llama", prompt="the forest", max_tokens=12, temperature=0, stream=True,
            stream_options=options,  # type: ignore[arg-type]
        ))  # fmt: skip
        counted = [c.usage.completion_tokens for c in chunks if c.choices]
        assert all(c.usage is not None for c in chunks), chunks
        assert counted == sorted(counted) and counted[-1] == chunks[-1].usage.completion_tokens >= 1, counted
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks if c.usage)
        assert (not chunks[-1].choices) is bool(options.get("include_usage")), "the usage chunk of its own"
    _no_traceback(bare)


def test_a_message_name_is_given_to_the_chat_template(bare: Server) -> None:
    """A chat message's ``name`` was accepted and dropped before the template: the model never saw it."""
    client = _client(bare)

    def prompt_tokens(message: dict[str, str]) -> int:
        answer = client.chat.completions.create(model="bare-llama", messages=[message], max_tokens=1)  # type: ignore[list-item]
        return int(answer.usage.prompt_tokens)

    plain = prompt_tokens({"role": "user", "content": "where is the river"})
    named = prompt_tokens({"role": "user", "content": "where is the river", "name": "river"})
    assert named > plain
    _no_traceback(bare)


def test_a_tiny_temperature_is_greedy_and_every_seed_has_its_own_stream(bare: Server) -> None:
    """``temperature: 1e-40`` overflowed the float32 logits to inf: every probability NaN and one fixed token
    every step, with 200. The generator kept only a seed's low 32 bits: seeds 0 and 2**32 gave the same text."""
    client = _client(bare)

    def text(**sampling: Any) -> str:
        answer = client.completions.create(model="bare-llama", prompt="the river city", max_tokens=24, **sampling)
        return str(answer.choices[0].text)

    greedy = text(temperature=0)
    assert greedy, "the greedy text is empty: the test would prove nothing"
    for temperature in (1e-40, 1e-300, 5e-324):
        for seed in (0, 1):
            assert text(temperature=temperature, seed=seed) == greedy, (temperature, seed)
    assert text(temperature=1.0, top_p=1e-300, seed=3) == greedy
    for a, b in ((0, 2**32), (-1, 2**64 - 1), (-(2**63), 2**63), (5, 5 + 2**40)):
        assert text(temperature=2.0, seed=a) != text(temperature=2.0, seed=b), (a, b)
    assert text(temperature=2.0, seed=2**64 - 1) == text(temperature=2.0, seed=2**64 - 1)
    _no_traceback(bare)


def test_tgi_and_vllm_health_probes_get_200(bare: Server) -> None:
    status, (_, body) = call(bare, "GET", "/health")
    assert (status, body) == (200, b"")
    assert call(bare, "POST", "/health", b"{}")[0] == 405

