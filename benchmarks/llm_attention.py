"""What one answer per request costs a generating engine: per-query-row attention against transformers' ``sdpa``.

Method (printed first when run):

* A random Llama (``invariance.random_llama``: hidden 1024, 8 layers, 16 heads, 4 key heads, intermediate 4096,
  MiniLM's tokenizer and its vocabulary of 30522; about 130 M parameters), loaded by
  ``packcache.hf.from_pretrained(dir, --scheme, cache=False)``.
* One ``LLMEngine`` (``serve``'s: continuous batching, driven one step at a time in this thread; 8 sequences of
  640 tokens, 512 tokens a step). Its model attends through ``packcache_per_sequence`` (each query row in its own
  call over its sequence's keys: what makes a request's logits the same alone and among others) or, switched
  back, through transformers' ``sdpa`` over the whole packed step; the two alternate round by round.
* Timed: the step that reads a whole prompt of 128 and of 512 tokens (prefill), and the median decode step of 8
  sequences of 60-token prompts. ``--rounds`` rounds; medians, with the range.

Usage: python benchmarks/llm_attention.py [--scheme int8] [--rounds 3] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import invariance  # noqa: E402  (benchmarks/invariance.py: the random Llama and the machine line)


class _Sink:
    def __init__(self) -> None:
        self.done = False

    def __call__(self, output: Any) -> None:
        if output.finish_reason is not None:
            self.done = True


def measure(scheme: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """``{case: {attention: [seconds per round]}}``."""
    import torch

    from packcache import hf
    from packcache._attention import NAME
    from packcache.server import llm
    from packcache.server.sampling import Sampling

    ids = torch.Generator().manual_seed(3)

    def prompt(count: int) -> list[int]:
        return [101, *torch.randint(1000, 30000, (count - 1,), generator=ids).tolist()]

    with tempfile.TemporaryDirectory(prefix="packcache-llm-attention-") as tmp:
        directory = invariance.random_llama(tmp, hidden=1024, layers=8, heads=16, kv_heads=4)
        model = hf.from_pretrained(directory, scheme, False, auto_class="AutoModelForCausalLM")
        engine = llm.LLMEngine(model, hf.tokenizer(directory), scheme=scheme, max_seqs=8, max_model_len=640,
                               page_size=16, max_batch_tokens=512, warmup=False)  # fmt: skip
        if engine.attention != NAME:
            raise RuntimeError(f"the engine runs {engine.attention!r}, not {NAME!r}: nothing to compare")

        def prefill(count: int) -> float:
            sink = _Sink()
            engine.submit(prompt(count), Sampling(max_tokens=1, temperature=0.0), sink)
            started = time.perf_counter()
            engine._step()
            seconds = time.perf_counter() - started
            while not sink.done:
                engine._step()
            return seconds

        def decode(sequences: int = 8, count: int = 60, steps: int = 8) -> float:
            sinks = [_Sink() for _ in range(sequences)]
            for sink in sinks:
                engine.submit(prompt(count), Sampling(max_tokens=steps + 4, temperature=0.0), sink)
            times = []
            for step in range(steps + 4):
                started = time.perf_counter()
                engine._step()
                if step >= 2:  # the prompts are read in the first step (8 x 60 tokens <= 512)
                    times.append(time.perf_counter() - started)
            while not all(sink.done for sink in sinks):
                engine._step()
            return statistics.median(times)

        cases: dict[str, Callable[[], float]] = {
            "prefill 128 tokens": lambda: prefill(128), "prefill 512 tokens": lambda: prefill(512),
            "decode step, 8 sequences": decode,
        }  # fmt: skip
        results: dict[str, dict[str, list[float]]] = {case: {NAME: [], "sdpa": []} for case in cases}
        for r in range(rounds):
            for attention in (NAME, "sdpa") if r % 2 == 0 else ("sdpa", NAME):
                model.set_attn_implementation(attention)
                for case, run in cases.items():
                    results[case][attention].append(run())
        model.set_attn_implementation(NAME)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", default="int8", choices=invariance.SCHEMES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    about = invariance.machine()
    print(__doc__.split("\n\n")[0])
    print(json.dumps(about | {"scheme": args.scheme, "load_average": os.getloadavg()}))
    results = measure(args.scheme, args.rounds)
    for case, by in results.items():
        row, plain = by["packcache_per_sequence"], by["sdpa"]
        ratio = statistics.median(row) / statistics.median(plain)
        print(f"  {case:<26} per query row {statistics.median(row) * 1e3:7.1f} ms ({min(row) * 1e3:.1f}-"
              f"{max(row) * 1e3:.1f})  sdpa {statistics.median(plain) * 1e3:7.1f} ms ({min(plain) * 1e3:.1f}-"
              f"{max(plain) * 1e3:.1f})  ratio {ratio:.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": about, "scheme": args.scheme, "seconds": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
