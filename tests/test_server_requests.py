"""The request bodies of ``packcache serve`` (``packcache.server.requests``): one declared model per route, fuzzed
against real servers on 127.0.0.1 (``harness.serve``).

Requests are generated from each route's JSON schema (``model_json_schema()``, turned into hypothesis strategies
here) and mutated: wrong types, unknown fields, missing ones, extreme numbers, huge strings within the body limit,
empty lists, nulls, lone surrogates, bodies that are no object, bytes that are no JSON. One embedding server (a tiny
random BERT) and one causal-LM server (a tiny random Llama whose tokenizer adds no BOS) answer them. Whatever is
sent: no 5xx, every 4xx in its route's API error shape (OpenAI's with ``param`` naming an unknown field; TEI's; this
server's own), and no traceback in the servers' logs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.checkpoints import tiny_bert, tiny_causal_lm
from harness.serve import Server, call, server
from packcache.server import requests

#: Every test here talks to the module's two servers: one xdist worker runs them all, so each server starts once.
pytestmark = pytest.mark.xdist_group("server-requests")
#: Bytes of body each fuzzed server takes: huge strings stay within it (a larger body is the worker's own 413).
BODY_LIMIT = 65536
MAX_TEXTS = 8
EXAMPLES = 60  # per route: five routes, 300 requests


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("fuzz-embed")
    model = tiny_bert(tmp / "tiny-bert")
    with server(tmp, "--model", str(model), "--cache-dir", str(tmp / "cache"), "--max-texts", str(MAX_TEXTS),
                "--max-text-chars", "2000", "--max-body-bytes", str(BODY_LIMIT), workers=1) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("fuzz-llm")
    model = tiny_causal_lm(tmp / "tiny-llama")
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None  # no BOS: an empty prompt has no token
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    with server(tmp, "--model", str(model), "--scheme", "fp32", "--max-model-len", "64", "--max-tokens", "8",
                "--max-body-bytes", str(BODY_LIMIT), workers=1) as srv:  # fmt: skip
        yield srv


# ---------------------------------------------------------------- strategies from a JSON schema


def from_schema(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    """Values that ``schema`` (the subset pydantic writes: types, ``anyOf``, ``enum``, ``const``, ``$ref``, bounds,
    objects with ``properties`` and ``required``) describes. Strings and lists stay short; mutations make them long."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(option, defs) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 24), 24)))
    if kind == "integer":
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**70 + 1) - 1)
        return st.integers(schema.get("minimum", -(2**70)), high)
    if kind == "number":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
        floats = st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False)
        whole = st.integers(
            int(low or -(10**6)) + ("exclusiveMinimum" in schema), int(high if high is not None else 10**6)
        )
        return floats | whole
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=low,
                        max_size=max(low, min(schema.get("maxItems", 4), 4)))  # fmt: skip
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {name: from_schema(p, defs) for name, p in properties.items() if name in required},
            optional={name: from_schema(p, defs) for name, p in properties.items() if name not in required},
        )
    return JSON


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip

#: Values no field takes, or only at its edge.
WEIRD = st.sampled_from([
    None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 2**64, 10**39, -(10**39), 1e308, -1e308, 5e-324, -0.0, 0.5,
    "", "x", "\ud800", "a\udc00b", "\x00", [], [[]], [None], ["\ud800"], [""], [1, "a"], [0] * 70, {}, {"type": "text"},
    {"type": "json_object"}, [{"role": "user"}], [{"role": "user", "content": "\ud800", "name": "\udfff"}],
])  # fmt: skip


def likely(model: type[requests.Body], served: str) -> dict[str, Any]:
    """``model``'s schema narrowed to what this server likely serves (its name, small bounds, known roles), so that
    a good share of the generated requests reaches the model and its engine."""
    schema = copy.deepcopy(model.model_json_schema())
    properties = schema["properties"]
    if "model" in properties:
        properties["model"] = {"enum": [served, None]}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in properties:
            properties[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 8}, {"type": "null"}]}
    if "max_completion_tokens" in properties:
        properties.pop("max_tokens")  # two bounds that differ are refused
    if "ChatMessage" in schema.get("$defs", {}):
        message = schema["$defs"]["ChatMessage"]["properties"]
        message["role"] = {"enum": ["system", "user", "assistant"]}
        message["name"] = {"type": "null"}
    if "prompt_name" in properties:
        properties["prompt_name"] = {"enum": ["query", None]}
    if "stream_options" in properties:
        properties.pop("stream_options")  # only with "stream": true
    return schema


@st.composite
def bodies(draw: st.DrawFn, model: type[requests.Body], served: str) -> bytes:
    """A request body for ``model``'s route: generated from its schema (as declared, or narrowed by :func:`likely`),
    then perhaps mutated, perhaps as bytes that are no JSON."""
    schema = model.model_json_schema()
    body: Any = draw(from_schema(schema) | from_schema(likely(model, served)))
    fields = sorted(schema["properties"])
    mutation = draw(st.sampled_from(["none", "value", "unknown", "drop", "huge", "nested", "whole", "bytes"]))
    if mutation == "value":
        body[draw(st.sampled_from(fields))] = draw(WEIRD)
    elif mutation == "unknown":
        body[draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in fields))] = draw(JSON)
    elif mutation == "drop" and body:
        body.pop(draw(st.sampled_from(sorted(body))))
    elif mutation == "huge":
        size = draw(st.integers(2000, BODY_LIMIT - 2000))
        text = draw(st.sampled_from(["x", "é", " the", "\ud800"])) * (size // 6)
        body[draw(st.sampled_from(fields))] = draw(st.sampled_from([text, [text], [text[:1999]] * 2]))
    elif mutation == "nested":
        for value in body.values():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                value[0][draw(st.sampled_from([*sorted(value[0]), "extra"]))] = draw(WEIRD)
                break
    elif mutation == "whole":
        body = draw(WEIRD | st.lists(st.just(body), max_size=2))
    encoded = json.dumps(body).encode()  # lone surrogates travel as \\ud800, as JSON allows
    if mutation != "bytes":
        return encoded
    return draw(st.sampled_from([
        encoded[: len(encoded) // 2], encoded + b"}", b"\xff\xfe" + encoded, encoded.replace(b"{", b"{\"a\": NaN, ", 1),
        b"[" * 200 + b"]" * 200, b'{"a": 1' + b"0" * 50 + b"}", encoded.replace(b"{", b'{"x": 1, "x": 2, ', 1),
        b"", b" ", b"null", b'"\\ud800"',
    ]))  # fmt: skip


# ---------------------------------------------------------------- what every answer must be


def api_of(route: str, body: bytes) -> str:
    """The API whose error shape answers ``body`` on ``route`` (``/embed``: TEI's for an object with ``inputs``; a
    body the server cannot read as JSON, NaN and repeated keys included, is answered in this server's own shape, as
    its docstring says: the shape is not known)."""
    if route != "/embed":
        return "openai"

    def refuse(what: Any) -> Any:
        raise ValueError(f"{what} is not JSON")

    def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in pairs}) != len(pairs):
            raise ValueError("a repeated key")
        return dict(pairs)

    try:
        parsed = json.loads(body, parse_constant=refuse, object_pairs_hook=once)
    except ValueError:
        return "legacy"
    return "tei" if isinstance(parsed, dict) and "inputs" in parsed else "legacy"


def check(srv: Server, route: str, body: bytes) -> int:
    """Send ``body``; assert the answer is no 5xx and a 4xx is in the route's API shape. Returns the status."""
    status, (headers, raw) = call(srv, "POST", route, body, timeout=60)
    assert status < 500, (route, body[:300], status, raw[:300])
    if status == 200:
        if raw.startswith(b"data: "):
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        else:
            json.loads(raw)
        return status
    assert headers.get("Content-Type") == "application/json", (status, headers)
    error = json.loads(raw)
    api = api_of(route, body)
    if api == "openai":
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"], error
        assert error["error"]["param"] is None or isinstance(error["error"]["param"], str), error
    elif api == "tei":
        assert set(error) == {"error", "error_type"} and error["error"] and isinstance(error["error_type"], str), error
    else:
        assert set(error) == {"error"} and isinstance(error["error"], str) and error["error"], error
    return status


def no_traceback(srv: Server) -> None:
    log = srv.err.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


@pytest.mark.parametrize("route, model", [
    ("/v1/embeddings", requests.EmbeddingsRequest), ("/embed", requests.TEIEmbedRequest),
    ("/embed", requests.TextsRequest),
])  # fmt: skip
def test_no_embedding_request_gets_a_5xx_or_a_traceback(
    embedder: Server, route: str, model: type[requests.Body]
) -> None:
    statuses: set[int] = set()

    @FUZZ
    @given(body=bodies(model, "tiny-bert"))
    def one(body: bytes) -> None:
        statuses.add(check(embedder, route, body))

    one()
    assert 200 in statuses and statuses & {400, 404, 413, 422}, statuses  # both served and refused requests were sent
    no_traceback(embedder)


@pytest.mark.parametrize("route, model", [
    ("/v1/chat/completions", requests.ChatRequest), ("/v1/completions", requests.CompletionRequest),
])  # fmt: skip
def test_no_generation_request_gets_a_5xx_or_a_traceback(
    generator: Server, route: str, model: type[requests.Body]
) -> None:
    statuses: set[int] = set()

    @FUZZ
    @given(body=bodies(model, "tiny-llama"))
    def one(body: bytes) -> None:
        statuses.add(check(generator, route, body))

    one()
    assert 200 in statuses and 400 in statuses, statuses
    no_traceback(generator)


def test_an_unknown_field_is_named_in_each_apis_words(embedder: Server, generator: Server) -> None:
    """The one translator (``Body.refusal``) reports an unknown field first, in the words of the route's API."""
    cases = [
        (embedder, "/v1/embeddings", {"input": "x", "mirostat": 1}, 400, "Unrecognized request argument supplied"),
        (embedder, "/embed", {"inputs": "x", "mirostat": 1}, 422, "unknown field 'mirostat'"),
        (embedder, "/embed", {"texts": ["x"], "mirostat": 1}, 400, 'exactly the key "texts"'),
        (generator, "/v1/completions", {"prompt": "x", "temperature": 9, "mirostat": 1}, 400, "mirostat"),
        (generator, "/v1/chat/completions", {"messages": [], "mirostat": 1}, 400, "mirostat"),
    ]
    for srv, route, body, code, words in cases:
        status, (_, raw) = call(srv, "POST", route, json.dumps(body).encode())
        error = json.loads(raw)
        message = error["error"]["message"] if route.startswith("/v1/") else error["error"]
        assert status == code and words in message, (route, status, raw)
        if route.startswith("/v1/"):
            assert error["error"]["param"] == "mirostat", error


def test_json_types_are_taken_strictly_and_bounds_by_name(generator: Server) -> None:
    """No ``"1"`` for 1, no ``true`` for 1, no ``1.0`` for an integer: each refused with ``param`` naming it."""
    cases = {
        "max_tokens": ["4", True, 4.0, 0, 9],
        "temperature": ["1", True, -0.1, 2.5],
        "top_p": [0, 1.5, "1"],
        "seed": [True, 1.5, "7", 2**64, -(2**63) - 1],
        "stream": [1, "true"],
        "n": [2, True, 1.0],
        "presence_penalty": [0.5, False],
        "logprobs": [0, True],
        "user": [5],
    }
    for field, values in cases.items():
        for value in values:
            body = json.dumps({"prompt": "x", "max_tokens": 2, **{field: value}}).encode()
            status, (_, raw) = call(generator, "POST", "/v1/completions", body)
            assert status == 400 and json.loads(raw)["error"]["param"] == field, (field, value, raw)
    for field, value in {"temperature": 2, "top_p": 1, "seed": 2**64 - 1, "n": 1, "presence_penalty": 0.0}.items():
        body = json.dumps({"prompt": "x", "max_tokens": 2, field: value}).encode()
        assert call(generator, "POST", "/v1/completions", body)[0] == 200, (field, value)


def test_a_body_over_the_limit_is_refused_in_the_routes_own_error_shape(embedder: Server, generator: Server) -> None:
    """The worker refuses a body over ``--max-body-bytes`` itself, before any application reads it. Its 413 is in
    the route's API shape all the same: OpenAI's on ``/v1/*`` (it was a bare ``{"error": "..."}``, which an OpenAI
    client cannot read), this server's own on ``/embed``, whose API cannot be told from an unread body."""
    big = json.dumps({"input": "x" * BODY_LIMIT}).encode()
    for srv, route in ((embedder, "/v1/embeddings"), (generator, "/v1/completions"),
                       (generator, "/v1/chat/completions")):  # fmt: skip
        status, (headers, raw) = call(srv, "POST", route, big)
        assert status == 413 and headers.get("Content-Type") == "application/json", (route, status, raw)
        error = json.loads(raw)
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, (route, error)
        assert error["error"]["type"] == "invalid_request_error" and "bytes" in error["error"]["message"], error
    status, (_, raw) = call(embedder, "POST", "/embed", big)
    assert status == 413 and set(json.loads(raw)) == {"error"}, raw
