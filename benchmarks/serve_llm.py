"""LLM serving: ``packcache serve`` against llama.cpp (its own server, llama-cpp-python's) and transformers serve.

Method (printed first when run):

* The model: the decode benchmark's 1.24 B Llama-3.2-1B-shaped checkpoint with random weights
  (``benchmarks/decode.py``; ``benchmarks/setup_decode.sh`` makes the environment, ``decode.py`` the files)
  in its work directory: ``model/`` (bf16 safetensors, a 482-piece sentencepiece tokenizer),
  ``model-int8.pcache`` and ``model-int4.pcache`` (packcache caches, built by the decode benchmark),
  ``gguf/model-Q8_0.gguf`` and ``gguf/model-Q4_0.gguf`` (llama.cpp's converter and quantiser).
* Systems, each a real server on 127.0.0.1 (a free port), started fresh for every round, one at a time:
  ``packcache-int8`` / ``packcache-int4``: ``python -m packcache serve --model model-int8.pcache --host
  127.0.0.1 --port P --workers 1`` (serve's defaults otherwise; ready when ``GET /healthz`` answers 200);
  ``llamacpp-Q8_0`` / ``llamacpp-Q4_0``: ``python -m llama_cpp.server --model gguf/model-Q8_0.gguf
  --n_threads 2 --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False`` (llama-cpp-python's
  server, its own build of llama.cpp for this CPU; ready: ``GET /v1/models`` 200). It runs one request
  at a time: every request takes one lock for its whole stream (``llama_cpp/server/app.py``,
  ``llama_outer_lock``/``llama_inner_lock``), so concurrent clients queue; ``--interrupt_requests False``
  keeps its default from cancelling a running stream when the next request arrives;
  ``llama-server-Q8_0`` / ``llama-server-Q4_0`` (not in the default set): llama.cpp's own server, built by
  ``setup_decode.sh`` from the same vendored tree and flags, ``llama-server --model gguf/model-Q8_0.gguf
  --threads 2 --threads-batch 2 --parallel 16 --ctx-size 65536 --cont-batching`` (16 slots of 4096 tokens:
  packcache serve's default sequences and context per sequence; ready: ``GET /health`` 200). It closes a
  kept-alive connection after each streamed answer without saying so: the client sends the next request
  again on a new connection (counted as "reconnects"), as HTTP clients do for an idle connection;
  ``transformers-bf16``: ``transformers serve model/ --device cpu --dtype bfloat16`` (one inference
  thread: requests run one after another; ready: ``GET /health`` 200); ``transformers-cb-bf16`` (not in
  the default set) adds ``--continuous-batching`` with a KV cache of 16 x 128 tokens.
  Torch and llama.cpp use 2 threads (the machine's cores).
* Load: N concurrent clients (1, 4, 16; ``--quick``: 1, 4), each a thread in this process on its own
  kept-alive connection, sending ``POST /v1/completions`` with ``"stream": true``, ``"stream_options":
  {"include_usage": true}``, ``max_tokens`` 64 (``--quick``: 32), ``temperature`` 0, and its next
  request when one ends, a fixed number of requests per client (``--requests``; default 3 at 1 client,
  2 at 4, 1 at 16; ``--quick`` 2 at 1 client, 1 at 4). The prompts: texts of 32 words that are one
  tokenizer piece each (checked with the tokenizer: 32 tokens; every server's ``usage.prompt_tokens``
  is reported from the warm-up), deterministic, a different one for every request of a round (so no
  server reuses a previous request's KV cache for a prefix), the same set for every system.
  Before the windows each server answers one non-streaming and one streaming request (warm-up).
* Figures per system and client count: aggregate tokens/s = generated tokens / wall time of the window
  (first request sent to last stream ended); tokens counted from the server's own ``usage`` in the final
  chunk, else (llama-cpp-python streams no usage) ``max_tokens`` when the server says
  ``finish_reason: "length"``, else its token events (said in the ``tokens from`` column). Time to
  first token (TTFT), client side: from sending the request to the first event carrying a token. The
  random model's tokens lie almost all outside its 482-piece tokenizer, so their text is empty: a
  token event is any event with a choice before the final one, text or not; only streams with as many
  token events as tokens count (a server that sends no event for an empty text, ``transformers serve``,
  shows its first text late, not its first token: "n/a"). p50 and p99 over the
  window's requests (with few requests p99 is near the maximum). Memory: the server's whole process
  tree (the started process and all its descendants), RSS and PSS summed over ``/proc/PID/smaps_rollup``,
  sampled every 0.2 s during the window with the most clients; the peak of each sum.
* ``--rounds`` rounds (default 1), the order of the systems rotated each round; medians over rounds.
  Ratios are of figures measured in the same run: packcache against llama.cpp at the matching
  quantisation (int8 - Q8_0, int4 - Q4_0; llama-cpp-python's server and llama-server each), and against
  transformers bf16, and every system against its
  own single-client rate. The client threads run on the same 2 cores as the server. "others' CPU":
  the share of the CPUs that processes other than this one and the server's tree took during the window
  (``/proc/stat`` less both; above ~0.05 the window was contended: the machine is shared).
* ``--memory``: a separate mode. packcache serve int8 with ``--workers 4``; 4 transformers processes,
  each ``AutoModelForCausalLM.from_pretrained(model/, dtype=torch.bfloat16)`` generating 4 tokens;
  ``llama_cpp.server`` with the Q8_0 GGUF (one process; llama.cpp maps the file, ``use_mmap``). After a
  few requests (8 concurrent streams of 4 tokens; transformers: its own 4 tokens), for every process:
  RSS and PSS (``smaps_rollup``) and the PSS of the weight file's mapping (``/proc/PID/smaps``, the
  mappings whose path is the .pcache / safetensors / GGUF file); summed over the tree.

Usage: .bench/decode/venv/bin/python benchmarks/serve_llm.py [--quick] [--systems A,B] [--clients 1,4,16]
       [--requests N] [--max-tokens N] [--rounds N] [--memory] [--work DIR] [--packcache-src DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import core  # noqa: E402  (benchmarks/core.py: cpu_model)

SYSTEMS = ("packcache-int8", "packcache-int4", "llamacpp-Q8_0", "llamacpp-Q4_0", "transformers-bf16",
           "transformers-cb-bf16", "llama-server-Q8_0", "llama-server-Q4_0")  # fmt: skip
DEFAULT_SYSTEMS = SYSTEMS[:5]
#: packcache's scheme -> llama.cpp's matching quantisation: llama-cpp-python's server, and llama.cpp's own.
MATCHING = {"packcache-int8": "llamacpp-Q8_0", "packcache-int4": "llamacpp-Q4_0"}
MATCHING_SERVER = {"packcache-int8": "llama-server-Q8_0", "packcache-int4": "llama-server-Q4_0"}
#: llama-server's slots (``-np``) and context per slot: packcache serve's defaults (``LLM_MAX_SEQS`` sequences of
#: ``LLM_MAX_MODEL_LEN`` tokens), so both hold the same context per sequence.
LLAMA_SERVER_SLOTS, LLAMA_SERVER_SLOT_CONTEXT = 16, 4096
CLIENTS, QUICK_CLIENTS = (1, 4, 16), (1, 4)
#: Requests per client by client count (full, quick).
REQUESTS = {1: (3, 2), 4: (2, 1), 16: (1, 1)}
MAX_TOKENS, QUICK_MAX_TOKENS = 64, 32
PROMPT_TOKENS = 32
THREADS = 2
GOAL_VS_LLAMA = 1.0  # packcache's aggregate tokens/s at the most clients over llama.cpp's at the same quantisation
GOAL_VS_SINGLE = 3.0  # ... and over its own single-client rate
MEMORY_WORKERS = 4


# --------------------------------------------------------------------------- pure parts (tested without servers)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly between ranks (numpy's default).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside 0-100.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any] | None]:
    """The JSON payloads of a server-sent-event stream's ``data:`` lines, ``None`` for ``data: [DONE]``.

    Comments (``: ping``), ``event:``/``id:`` lines and blank lines are skipped; a payload split over
    several ``data:`` lines of one event is joined as the SSE format says.

    Raises:
        ValueError: a ``data:`` payload is not JSON (the message quotes it).
    """
    data: list[str] = []

    def flush() -> Iterator[dict[str, Any] | None]:
        if not data:
            return
        payload = "\n".join(data)
        data.clear()
        if payload.strip() == "[DONE]":
            yield None
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            raise ValueError(f"a server-sent event that is not JSON: {payload[:200]!r}") from None
        yield event

    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            yield from flush()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    yield from flush()


@dataclass
class Tally:
    """One streamed completion as the client saw it (times from ``time.perf_counter``)."""

    sent: float
    first_token: float | None = None
    done: float = 0.0
    token_events: int = 0
    text_chars: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done_marker: bool = False
    reconnects: int = 0  # times the request was sent again on a new connection (:func:`stream`)

    def feed(self, event: dict[str, Any] | None, now: float) -> None:
        """Take one event from :func:`sse_events` (``None``: the ``[DONE]`` marker).

        Raises:
            RuntimeError: the event is the server's error object.
        """
        if event is None:
            self.done_marker = True
            return
        if "error" in event:
            raise RuntimeError(f"the server streamed an error: {json.dumps(event['error'])[:300]}")
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content") or ""
            reason = choice.get("finish_reason")
            if reason is None or text:  # a token (its text may be empty); the final chunk has the reason only
                self.token_events += 1
                self.text_chars += len(text)
                if self.first_token is None:
                    self.first_token = now
            if reason is not None:
                self.finish_reason = reason

    def tokens(self, max_tokens: int) -> tuple[int, str]:
        """(generated tokens, where the count came from): the server's usage, else ``max_tokens`` when it
        ended for length, else the token events counted."""
        if self.usage and "completion_tokens" in self.usage:
            return int(self.usage["completion_tokens"]), "usage"
        if self.finish_reason == "length":
            return max_tokens, "length"
        return self.token_events, "events"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool = True) -> bytes:
    """The ``POST /v1/completions`` body every system gets."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


def parse_list(text: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated selection from ``choices``, in ``choices``' order.

    Raises:
        ValueError: an unknown or empty selection (the message lists the choices).
    """
    asked = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in asked if s not in choices]
    if unknown or not asked:
        raise ValueError(f"{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(choices)}")
    return tuple(s for s in choices if s in asked)


def parse_clients(text: str) -> tuple[int, ...]:
    """``1,4,16`` -> (1, 4, 16), sorted and unique.

    Raises:
        ValueError: not comma-separated positive integers.
    """
    try:
        counts = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ValueError(f"--clients {text!r}: comma-separated positive integers")
    return tuple(counts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``systems``, ``clients``, ``max_tokens`` and ``requests`` (a dict by client count)
    resolved from ``--quick`` and the explicit options. Exits with a usage message on bad input."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 32 tokens, fewer requests")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    parser.add_argument("--clients", help="comma-separated client counts (default 1,4,16; --quick 1,4)")
    parser.add_argument("--requests", type=int, help="requests per client at every client count")
    parser.add_argument("--max-tokens", type=int, help="max_tokens of every request (default 64; --quick 32)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, order rotated, fresh servers (median)")
    parser.add_argument("--memory", action="store_true", help="the 4-worker memory comparison instead")
    parser.add_argument("--work", default=str(HERE.parent / ".bench" / "decode" / "work"), help="decode's work dir")
    parser.add_argument("--python", default=sys.executable, help="the servers' python (the decode venv's)")
    parser.add_argument("--packcache-src", default=str(HERE.parent / "src"), help="PYTHONPATH for packcache serve")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    try:
        args.systems = parse_list(args.systems, SYSTEMS, "--systems")
        args.clients = parse_clients(args.clients or ",".join(map(str, QUICK_CLIENTS if args.quick else CLIENTS)))
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("requests", "max_tokens", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    args.max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else MAX_TOKENS)
    args.requests = {
        c: args.requests or REQUESTS.get(c, (1, 1))[1 if args.quick else 0] for c in args.clients
    }  # fmt: skip
    return args


# --------------------------------------------------------------------------- prompts


def make_prompts(tokenizer_model: Path, count: int, length: int = PROMPT_TOKENS, seed: int = 35) -> list[str]:
    """``count`` distinct texts of ``length`` words, each word one piece of the sentencepiece model (checked:
    every text encodes to exactly ``length`` tokens), deterministic.

    Raises:
        RuntimeError: the tokenizer has too few one-piece words to make them.
    """
    import sentencepiece  # type: ignore[import-not-found,unused-ignore]  # the decode environment's

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    words = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        word = piece[1:]
        if piece.startswith("\u2581") and word.isalpha() and word.isascii() and sp.encode(word) == [i]:
            words.append(word)
    if len(words) < 8:
        raise RuntimeError(f"{tokenizer_model}: only {len(words)} one-piece words, too few for prompts")
    rng = random.Random(seed)
    prompts: list[str] = []
    for _ in range(count * 50):
        text = " ".join(rng.choice(words) for _ in range(length))
        if len(sp.encode(text)) == length and text not in prompts:
            prompts.append(text)
        if len(prompts) == count:
            return prompts
    raise RuntimeError(f"{tokenizer_model}: made only {len(prompts)} of {count} prompts of {length} tokens")


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    system: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    ready_path: str
    model: str
    started: float
    ready_s: float = 0.0
    weights: Path | None = None

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(system: str, work: Path, python: str, port: int, workers: int = 1) -> tuple[list[str], str, str, Path]:
    """(argv, readiness path, the request's ``model``, the weight file) of ``system`` on ``port``."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if system.startswith("packcache-"):
        cache = work / f"model-{system.split('-')[1]}.pcache"
        argv = [python, "-m", "packcache", "serve", "--model", str(cache), *host, "--workers", str(workers)]
        return argv, "/healthz", cache.stem, cache
    if system.startswith("llama-server-"):
        gguf = work / "gguf" / f"model-{system.split('-')[2]}.gguf"
        # setup_decode.sh builds it beside the environment whose python this is: ENV/venv/bin/python
        # (not resolved: the venv's python is a link to the interpreter it was made from)
        binary = Path(os.path.abspath(python)).parents[2] / "llama-server" / "bin" / "llama-server"
        context = LLAMA_SERVER_SLOTS * LLAMA_SERVER_SLOT_CONTEXT
        argv = [str(binary), "--model", str(gguf), *host, "--threads", str(THREADS), "--threads-batch", str(THREADS),
                "--parallel", str(LLAMA_SERVER_SLOTS), "--ctx-size", str(context), "--cont-batching",
                "--no-webui"]  # fmt: skip
        return argv, "/health", str(gguf), gguf
    if system.startswith("llamacpp-"):
        gguf = work / "gguf" / f"model-{system.split('-')[1]}.gguf"
        argv = [python, "-m", "llama_cpp.server", "--model", str(gguf), *host, "--n_threads", str(THREADS),
                "--n_threads_batch", str(THREADS), "--n_ctx", "2048", "--interrupt_requests", "False"]  # fmt: skip
        return argv, "/v1/models", str(gguf), gguf
    model = work / "model"
    argv = [str(Path(python).parent / "transformers"), "serve", str(model), *host, "--device", "cpu",
            "--dtype", "bfloat16", "--log-level", "warning"]  # fmt: skip
    if system == "transformers-cb-bf16":
        argv += ["--continuous-batching", "--cb-block-size", "64", "--cb-num-blocks", "32",
                 "--cb-max-batch-tokens", "512"]  # fmt: skip
    return argv, "/health", str(model), model / "model.safetensors"


def start(system: str, work: Path, python: str, src: str, logs: Path, workers: int = 1) -> Server:
    port = free_port()
    argv, ready, model, weights = command(system, work, python, port, workers)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = logs / f"{system}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # fmt: skip
    return Server(system, proc, log, port, ready, model, time.perf_counter(), weights=weights)


def wait_ready(server: Server, timeout: float = 900.0) -> None:
    """Until the server answers 200 on its readiness path; then ``model`` is the first id ``/v1/models`` lists.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` (its log's tail quoted).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.system} exited ({server.proc.returncode}): {server.tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if request(server.port, "GET", server.ready_path, timeout=5)[0] == 200:
                server.ready_s = time.perf_counter() - server.started
                with contextlib.suppress(OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
                    status, body = request(server.port, "GET", "/v1/models", timeout=30)
                    if status == 200:
                        server.model = json.loads(body)["data"][0]["id"]
                return
        time.sleep(0.25)
    raise RuntimeError(f"{server.system} not ready within {timeout:.0f} s: {server.tail()}")


def stop(server: Server) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


def request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 600) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------- load


def stream(conn: http.client.HTTPConnection, body: bytes) -> Tally:
    """One streamed completion on ``conn``. A kept-alive connection the server closed after its previous answer
    without saying so (llama-server does, after every streamed answer) fails before any byte of the response: the
    request is sent again once, on a new connection (``Tally.reconnects``), as HTTP clients do for an idle
    connection. A failure on a new connection, or after the status line, is the server's.

    Raises:
        RuntimeError: the server answered other than 200 or streamed an error.
        OSError, http.client.HTTPException: the connection failed.
    """
    reconnects = 0
    while True:
        reused = conn.sock is not None
        tally = Tally(sent=time.perf_counter(), reconnects=reconnects)
        try:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json", "Accept": "text/event-stream"})  # fmt: skip
            response = conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            conn.close()
            if not reused or reconnects:
                raise
            reconnects += 1
            continue
        break
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    for event in sse_events(iter(response.readline, b"")):
        tally.feed(event, time.perf_counter())
    tally.done = time.perf_counter()
    if response.will_close:
        conn.close()
    return tally


def window(
    server: Server, prompts: list[str], clients: int, per_client: int, max_tokens: int, first: int = 0
) -> dict[str, Any]:
    """``clients`` closed-loop streaming clients, ``per_client`` requests each, prompt ``first + k`` for the ``k``-th.

    Raises:
        RuntimeError: a request failed (the first failures quoted).
    """
    tallies: list[Tally] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1800)
        try:
            for j in range(per_client):
                prompt = prompts[(first + index * per_client + j) % len(prompts)]
                body = completion_body(server.model, prompt, max_tokens)
                try:
                    t = stream(conn, body)
                except (OSError, http.client.HTTPException, RuntimeError, ValueError) as exc:
                    conn.close()
                    with lock:
                        failures.append(repr(exc))
                    continue
                with lock:
                    tallies.append(t)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]  # SIGTERM: no wait
    cpu_before, server_before = core.cpu_seconds(), tree_cpu_seconds(server.proc.pid)
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu_after, server_after = core.cpu_seconds(), tree_cpu_seconds(server.proc.pid)
    if failures:
        raise RuntimeError(f"{server.system}, {clients} clients: {len(failures)} requests failed: {failures[:3]}")
    result = summarise(tallies, max_tokens, began)
    busy = cpu_after[0] - cpu_before[0]
    mine = cpu_after[1] - cpu_before[1] + server_after - server_before
    result["others_cpu_share"] = max(0.0, busy - mine) / (result["wall_s"] * len(os.sched_getaffinity(0)))
    return result


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid``'s process tree (processes alive now)."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / os.sysconf("SC_CLK_TCK")


def summarise(tallies: list[Tally], max_tokens: int, began: float) -> dict[str, Any]:
    """A window's figures from its completions (see the method)."""
    counted = [t.tokens(max_tokens) for t in tallies]
    tokens = sum(n for n, _ in counted)
    wall = max(t.done for t in tallies) - began
    # A stream with fewer token events than tokens skipped some (empty texts): its first event may be late.
    ttfts = [
        t.first_token - t.sent
        for t, (n, _) in zip(tallies, counted, strict=True)
        if t.first_token is not None and t.token_events >= n
    ]
    return {
        "requests": len(tallies),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "ttft_measured": len(ttfts),
        "token_events_per_token": sum(t.token_events for t in tallies) / max(1, tokens),
        "tokens_from": sorted({source for _, source in counted}),
        "finish_reasons": dict(Counter(str(t.finish_reason) for t in tallies)),
        "full_length": sum(n == max_tokens for n, _ in counted),
        "reconnects": sum(t.reconnects for t in tallies),
    }


# --------------------------------------------------------------------------- memory


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (``/proc/PID/task/TID/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
    return out


def rollup_kib(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup``'s kB fields (empty if the process is gone)."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def mapping_pss_kib(pid: int, path: Path) -> int:
    """The PSS of every mapping of ``path`` in ``/proc/PID/smaps`` (0 if none)."""
    target, total, inside = str(path.resolve()), 0, False
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5].strip() == target
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def tree_memory(pid: int) -> dict[str, float]:
    pids = tree(pid)
    rolls = [rollup_kib(p) for p in pids]
    return {
        "rss_mib": sum(r.get("Rss", 0) for r in rolls) / 1024,
        "pss_mib": sum(r.get("Pss", 0) for r in rolls) / 1024,
        "processes": len([r for r in rolls if r]),
    }


class Sampler:
    """The peak of a process tree's summed RSS and PSS, sampled every ``interval`` s in a thread."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval = pid, interval
        self.peak = {"rss_mib": 0.0, "pss_mib": 0.0, "processes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            now = tree_memory(self.pid)
            for key, value in now.items():
                self.peak[key] = max(self.peak[key], value)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- the benchmark


def warm_up(server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One non-streaming request (its usage gives the prompt's token count) and one streaming request.

    Raises:
        RuntimeError: either answered other than 200.
    """
    status, body = request(server.port, "POST", "/v1/completions", completion_body(server.model, prompt, 4, False))
    if status != 200:
        raise RuntimeError(f"{server.system}: warm-up answered HTTP {status}: {body[:300]!r}")
    usage = json.loads(body).get("usage") or {}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1800)
    try:
        t = stream(conn, completion_body(server.model, prompt, max_tokens))
    finally:
        conn.close()
    return {"prompt_tokens": usage.get("prompt_tokens"), "stream_usage": t.usage is not None,
            "stream_token_events": t.token_events, "stream_text_chars": t.text_chars}  # fmt: skip


def run(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    work = Path(args.work)
    most = max(args.clients)
    needed = sum(args.requests[c] * c for c in args.clients)
    prompts = make_prompts(work / "model" / "tokenizer.model", needed + 1)
    warm_prompt, prompts = prompts[-1], prompts[:-1]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    servers: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    skipped: dict[str, str] = {}
    order = list(args.systems)
    for round_ in range(args.rounds):
        rotated = order[round_ % len(order) :] + order[: round_ % len(order)]
        for system in rotated:
            if system in skipped:
                continue
            try:
                server = start(system, work, args.python, args.packcache_src, logs)
            except OSError as exc:  # no such program: llama-server before setup_decode.sh built it, say
                skipped[system] = f"cannot start: {exc} (run benchmarks/setup_decode.sh)"
                print(f"  {system}: {skipped[system]}", flush=True)
                continue
            try:
                try:
                    wait_ready(server)
                    warm = warm_up(server, warm_prompt, args.max_tokens)
                except (RuntimeError, OSError, http.client.HTTPException) as exc:
                    skipped[system] = "cannot run: " + " ".join(str(exc).split())[:400]
                    print(f"  {system}: {skipped[system]}", flush=True)
                    continue
                idle = tree_memory(server.proc.pid)
                info = {"ready_s": server.ready_s, **warm, "idle": idle, "model": server.model}
                print(f"  round {round_ + 1}/{args.rounds} {system}: ready in {server.ready_s:.1f} s, {warm}",
                      flush=True)  # fmt: skip
                first = 0  # every request of a run its own prompt: no server reuses a previous prompt's KV cache
                for count in args.clients:
                    sampler = Sampler(server.proc.pid) if count == most else None
                    try:
                        with sampler or contextlib.nullcontext():
                            r = window(server, prompts, count, args.requests[count], args.max_tokens, first)
                        first += count * args.requests[count]
                    except RuntimeError as exc:  # the other systems are still measured; this one is said failed
                        skipped[system] = f"failed at {count} clients: " + " ".join(str(exc).split())[:400]
                        print(f"  {system}: {skipped[system]}", flush=True)
                        break
                    if sampler is not None:
                        r["peak"] = dict(sampler.peak)
                        info["peak"] = dict(sampler.peak)
                    samples.setdefault((system, count), []).append(r)
                    print(f"    {count} clients: {r['tok_s']:.2f} tok/s, ttft p50 {_s(r['ttft_p50_s'])} "
                          f"p99 {_s(r['ttft_p99_s'])}, {r['full_length']}/{r['requests']} full length, "
                          f"tokens from {r['tokens_from']}, others' CPU share {r['others_cpu_share']:.2f}"
                          + (f", peak {r['peak']}" if "peak" in r else ""),
                          flush=True)  # fmt: skip
                servers[system].append(info)
            finally:
                stop(server)
    rows = []
    for (system, count), found in samples.items():
        keys = ("tok_s", "ttft_p50_s", "ttft_p99_s", "wall_s", "others_cpu_share")
        med = {k: _median([f[k] for f in found]) for k in keys}
        row: dict[str, Any] = {"system": system, "clients": count, **med, "rounds": found,
                               "full_length": sum(f["full_length"] for f in found),
                               "requests": sum(f["requests"] for f in found),
                               "reconnects": sum(f.get("reconnects", 0) for f in found),
                               "tokens_from": sorted({s for f in found for s in f["tokens_from"]})}  # fmt: skip
        peaks = [f["peak"] for f in found if "peak" in f]
        if peaks:
            row["peak_rss_mib"] = _median([p["rss_mib"] for p in peaks])
            row["peak_pss_mib"] = _median([p["pss_mib"] for p in peaks])
        rows.append(row)
    by = {(r["system"], r["clients"]): r for r in rows}
    for row in rows:
        single = by.get((row["system"], min(args.clients)))
        if single and single["tok_s"]:
            row["vs_single"] = row["tok_s"] / single["tok_s"]
        for key, peer in (("vs_llamacpp", MATCHING.get(row["system"])),
                          ("vs_llama_server", MATCHING_SERVER.get(row["system"])),
                          ("vs_transformers", "transformers-bf16")):  # fmt: skip
            base = by.get((peer, row["clients"])) if peer and row["system"].startswith("packcache") else None
            if base and base["tok_s"]:
                row[key] = row["tok_s"] / base["tok_s"]
    goals = []
    for system, peer in MATCHING.items():
        top = by.get((system, most))
        if top is None:
            continue
        for what, key, goal in (
            (f">= {GOAL_VS_LLAMA:g}x {peer}", "vs_llamacpp", GOAL_VS_LLAMA),
            (f">= {GOAL_VS_SINGLE:g}x its own single-client rate", "vs_single", GOAL_VS_SINGLE),
        ):
            goals.append({"what": f"{system} at {most} clients {what}", "value": top.get(key),
                          "met": _met(top.get(key), goal)})  # fmt: skip
        # against llama.cpp's own server (continuous batching): at every client count
        for count in args.clients:
            row = by.get((system, count))
            if row is not None and (MATCHING_SERVER[system], count) in by:
                goals.append(
                    {
                        "what": f"{system} at {count} clients >= 1x {MATCHING_SERVER[system]}",
                        "value": row.get("vs_llama_server"),
                        "met": _met(row.get("vs_llama_server"), 1.0),
                    }
                )
    rows.sort(key=lambda r: (r["clients"], SYSTEMS.index(r["system"])))
    return {"rows": rows, "servers": servers, "skipped": skipped, "goals": goals, "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": args.max_tokens, "requests_per_client": args.requests, "rounds": args.rounds}  # fmt: skip


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _met(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} s"


def _x(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if row.get(key) is not None else "-"


def print_report(result: dict[str, Any]) -> None:
    print(f"\n{result['prompt_tokens']}-token prompts, max_tokens {result['max_tokens']}, requests per client "
          f"{result['requests_per_client']}, {result['rounds']} round(s)\n")  # fmt: skip
    print("| clients | system | tok/s | vs own 1 client | vs llama.cpp (same quant) | vs llama-server (same quant) "
          "| vs transformers bf16 | TTFT p50 | TTFT p99 | full length | tokens from | peak tree RSS MiB "
          "| peak tree PSS MiB | others' CPU | reconnects |")  # fmt: skip
    print("|" + "---|" * 15)
    for r in result["rows"]:
        peak = ("-", "-") if "peak_rss_mib" not in r else (f"{r['peak_rss_mib']:.0f}", f"{r['peak_pss_mib']:.0f}")
        print(f"| {r['clients']} | {r['system']} | {r['tok_s']:.2f} | {_x(r, 'vs_single')} | {_x(r, 'vs_llamacpp')} "
              f"| {_x(r, 'vs_llama_server')} | {_x(r, 'vs_transformers')} | {_s(r['ttft_p50_s'])} "
              f"| {_s(r['ttft_p99_s'])} | {r['full_length']}/{r['requests']} | {','.join(r['tokens_from'])} "
              f"| {peak[0]} | {peak[1]} | {r['others_cpu_share']:.2f} | {r.get('reconnects', 0)} |")  # fmt: skip
    print("\n| system | ready s | prompt tokens (usage) | usage in stream | idle tree RSS MiB | idle tree PSS MiB |")
    print("|---|---|---|---|---|---|")
    for system, infos in result["servers"].items():
        if infos:
            i = infos[0]
            print(f"| {system} | {_median([x['ready_s'] for x in infos]):.1f} | {i['prompt_tokens']} "
                  f"| {i['stream_usage']} | {i['idle']['rss_mib']:.0f} | {i['idle']['pss_mib']:.0f} |")  # fmt: skip
    for system, why in result["skipped"].items():
        print(f"{system}: {why}")
    for g in result["goals"]:
        shown = "missing" if g["value"] is None else f"{g['value']:.2f}"
        print(f"goal {g['what']}: {shown} ({'-' if g['met'] is None else 'met' if g['met'] else 'NOT met'})")


# --------------------------------------------------------------------------- --memory


_TRANSFORMERS_CHILD = """
import sys, torch, transformers
torch.set_num_threads(1)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
ids = torch.tensor([list(range(100, 132))])
model.generate(ids, max_new_tokens=4, do_sample=False)
print("ready", flush=True)
sys.stdin.readline()
"""


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _processes(pids: list[int], weights: Path) -> list[dict[str, Any]]:
    out = []
    for pid in pids:
        roll = rollup_kib(pid)
        if roll:
            out.append({"pid": pid, "rss_mib": roll.get("Rss", 0) / 1024, "pss_mib": roll.get("Pss", 0) / 1024,
                        "weights_pss_mib": mapping_pss_kib(pid, weights) / 1024})  # fmt: skip
    return out


def _memory_row(system: str, processes: list[dict[str, Any]], weights: Path) -> dict[str, Any]:
    holders = [p for p in processes if p["weights_pss_mib"] > 0]
    return {
        "system": system, "processes": len(processes), "weights_file": str(weights),
        "weights_file_mib": weights.stat().st_size / 2**20,
        "tree_rss_mib": sum(p["rss_mib"] for p in processes), "tree_pss_mib": sum(p["pss_mib"] for p in processes),
        "weights_pss_mib_per_mapper": [round(p["weights_pss_mib"], 1) for p in holders],
        "per_process": processes,
    }  # fmt: skip


def run_memory(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    work = Path(args.work)
    prompts = make_prompts(work / "model" / "tokenizer.model", 2 * MEMORY_WORKERS)
    rows = []
    for system, workers in (("packcache-int8", MEMORY_WORKERS), ("llamacpp-Q8_0", 1)):
        if system not in args.systems:
            continue
        server = start(system, work, args.python, args.packcache_src, logs, workers=workers)
        try:
            try:
                wait_ready(server)
                window(server, prompts, 2 * MEMORY_WORKERS, 1, 4)
            except (RuntimeError, OSError, http.client.HTTPException) as exc:
                why = " ".join(str(exc).split())[:400]
                rows.append({"system": f"{system} x{workers}", "skipped": why})
                print(f"  {system} x{workers}: cannot run, skipped: {why}", flush=True)
                continue
            time.sleep(1.0)
            assert server.weights is not None
            row = _memory_row(f"{system} x{workers}", _processes(tree(server.proc.pid), server.weights), server.weights)
            rows.append(row)
            print(f"  {row['system']}: tree RSS {row['tree_rss_mib']:.0f} MiB, PSS {row['tree_pss_mib']:.0f} MiB, "
                  f"weights PSS per mapping process {row['weights_pss_mib_per_mapper']}", flush=True)  # fmt: skip
        finally:
            stop(server)
    if "transformers-bf16" in args.systems:
        weights = work / "model" / "model.safetensors"
        need = MEMORY_WORKERS * weights.stat().st_size / 2**20 * 1.3
        if _available_mib() < need + 2048:
            rows.append({"system": f"transformers-bf16 x{MEMORY_WORKERS}", "skipped":
                         f"needs ~{need:.0f} MiB, {_available_mib():.0f} MiB available"})  # fmt: skip
        else:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
            children = []
            try:
                for _ in range(MEMORY_WORKERS):  # one at a time: four loads at once would fight over 2 cores
                    child = subprocess.Popen([args.python, "-c", _TRANSFORMERS_CHILD, str(work / "model")],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             env=env)  # fmt: skip
                    children.append(child)
                    assert child.stdout is not None
                    if child.stdout.readline().strip() != b"ready":
                        raise RuntimeError(f"a transformers worker exited ({child.wait()}) before it was ready")
                row = _memory_row(f"transformers-bf16 x{MEMORY_WORKERS}",
                                  _processes([c.pid for c in children], weights), weights)  # fmt: skip
                rows.append(row)
                print(f"  {row['system']}: RSS {row['tree_rss_mib']:.0f} MiB, PSS {row['tree_pss_mib']:.0f} MiB, "
                      f"weights PSS per mapping process {row['weights_pss_mib_per_mapper']}", flush=True)  # fmt: skip
            finally:
                for child in children:
                    with contextlib.suppress(OSError):
                        assert child.stdin is not None
                        child.stdin.close()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(30)
                    if child.poll() is None:
                        child.kill()
                        child.wait()
    return {"memory": rows}


def print_memory(result: dict[str, Any]) -> None:
    print("\n| system | processes | tree RSS MiB | tree PSS MiB | weights file MiB | weights PSS MiB per mapper |")
    print("|---|---|---|---|---|---|")
    for r in result["memory"]:
        if "skipped" in r:
            print(f"| {r['system']} | skipped: {r['skipped']} | | | | |")
            continue
        per = ", ".join(f"{v:.0f}" for v in r["weights_pss_mib_per_mapper"]) or "none mapped"
        print(f"| {r['system']} | {r['processes']} | {r['tree_rss_mib']:.0f} | {r['tree_pss_mib']:.0f} "
              f"| {r['weights_file_mib']:.0f} | {per} |")  # fmt: skip


# --------------------------------------------------------------------------- main


def machine(python: str, src: str) -> dict[str, Any]:
    """CPU, OS kernel, packcache's kernel path and the servers' versions (asked of the servers' python)."""
    probe = (
        "import json, importlib.metadata as m\n"
        "from packcache.kernels import cpu_kernels\n"
        "v = {}\n"
        "for p in ('packcache', 'torch', 'transformers', 'llama_cpp_python', 'fastapi', 'uvicorn'):\n"
        "    try: v[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: v[p] = None\n"
        "print(json.dumps({'kernel_path': cpu_kernels().default_path, 'versions': v}))\n"
    )
    env = {**os.environ, "PYTHONPATH": src}
    found: dict[str, Any] = {"kernel_path": None, "versions": {}}
    with contextlib.suppress(subprocess.SubprocessError, OSError, ValueError):
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, check=True, timeout=120)
        found = json.loads(out.stdout.splitlines()[-1])
    return {"cpu": core.cpu_model(), "cpus": len(os.sched_getaffinity(0)), "os_kernel": platform.release(), **found}


def main() -> None:
    import tempfile

    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run()'s finally stops servers
    began, load_start = time.perf_counter(), os.getloadavg()
    print(__doc__.split("Usage:")[0].strip())
    info = machine(args.python, args.packcache_src)
    print(f"\nmachine: {info}\n1/5/15-min load average at start: {load_start}", flush=True)
    print(f"command: {' '.join(sys.argv)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="packcache-serve-llm-") as logs:
        result = run_memory(args, Path(logs)) if args.memory else run(args, Path(logs))
    (print_memory if args.memory else print_report)(result)
    elapsed, load_end = time.perf_counter() - began, os.getloadavg()
    print(f"\n1/5/15-min load average at end: {load_end}; total {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "command": sys.argv, "elapsed_s": elapsed, "quick": args.quick,
                       "load_average": [list(load_start), list(load_end)], **result}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
