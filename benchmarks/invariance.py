"""Whether an input's answer depends on what shares its batch: each invariance, yes or no, with its counts.

packcache's first promise is one answer per input: a row of a linear layer, a text's embedding, a prompt's
text must have the same bits alone and among others. This prints, for the kernel path this process runs
(``$PACKCACHE_NATIVE`` picks the compiled code path; run it once per path), each invariance as ``yes`` or ``no``
with what broke it:

* **Linear layers** (``--what linear``): an ``nn.Linear`` packed by :func:`packcache.torch.convert` for each
  scheme (fp32, bf16, int8, int4), three shapes (MiniLM's 384x1536 and 1536x384, a 2048x2048 Llama layer).
  Every row of a seeded ``x [512, in]`` is run alone; then ``x[:b]`` for each batch size ``b`` of
  ``--batches``, as 2-D ``[b, in]`` and as 3-D ``[1, b, in]`` (and ``[b/4, 4, in]`` where ``b % 4 == 0``). A
  batch size counts as broken when any of its rows differs in any bit from the same row alone; the kernel
  :meth:`TorchPacker.kernel` names for that row count is printed beside it.
* **Embeddings** (``--what embed``): all-MiniLM-L6-v2 through :func:`packcache.models.minilm.load` and through
  :func:`packcache.hf.sentence_transformer`, each scheme: ``--texts`` texts of 3 to 120 words embedded one per
  call, then all in one call; a text counts when its vector differs in any bit. The largest difference is
  printed beside the count, so a broken invariance shows how far it moves.
* **Generation** (``--what generate``): ``serve``'s engine (:class:`packcache.server.llm.LLMEngine`, continuous
  batching, driven one step at a time) on a random Llama (hidden 256, 4 layers, 8 heads, 2 key heads, MiniLM's
  tokenizer and vocabulary), each scheme. A greedy request of 40 prompt tokens runs alone, then among three others
  (prompts of 9-60 tokens, one joining while it decodes) with 32 tokens a step, so its prompt is read over other
  steps than alone; each of its 12 steps' logits, as the sampler sees them, counts when it differs in any bit.
  The vocabulary (30522) is not a multiple of 16, which torch's int4 layout needed; packcache's own (version 3 of
  ``torch.int4wo``) takes it, so int4 packs the output head too.

Usage: python benchmarks/invariance.py [--what linear,embed,generate] [--schemes fp32,bf16,int8,int4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Batch sizes tried by default: both sides of every row count a kernel's routing changes at (4, 16, 32, 64, 96,
#: 192 rows in ``packers_torch``), and the largest prefill chunk a server forms.
BATCHES = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 97, 128, 192, 193, 256, 511, 512)
SHAPES = ((1536, 384), (384, 1536), (2048, 2048))
SCHEMES = ("fp32", "bf16", "int8", "int4")
ROWS = 512


@dataclass
class Verdict:
    """One invariance: ``broken`` of ``tried`` cases gave other bits than the input alone."""

    what: str
    tried: int = 0
    broken: int = 0
    largest: float = 0.0  # the largest absolute difference seen
    examples: list[str] = field(default_factory=list)  # the first few broken cases, named

    @property
    def holds(self) -> bool:
        return self.tried > 0 and self.broken == 0

    def add(self, case: str, alone: Any, together: Any) -> None:
        """Count one case: ``together`` (a tensor or array) against ``alone``, bit for bit."""
        import numpy as np

        a, b = np.asarray(alone), np.asarray(together)
        self.tried += 1
        if a.shape != b.shape or a.tobytes() != b.tobytes():
            self.broken += 1
            if a.shape == b.shape:
                self.largest = max(self.largest, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
            if len(self.examples) < 4 and case not in self.examples:
                self.examples.append(case)

    def line(self) -> str:
        verdict = "yes" if self.holds else "no "
        text = f"  {verdict} {self.what:<44} {self.broken:>4} of {self.tried:<4} differ"
        if self.broken:
            text += f" (largest difference {self.largest:.3g}; e.g. {', '.join(self.examples)})"
        return text


def _packer(scheme: str) -> Any:
    from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32

    return {"fp32": LinearFloat32, "bf16": LinearBFloat16, "int8": Int8WeightOnly, "int4": Int4WeightOnly}[scheme]()


def linear_verdicts(
    schemes: Sequence[str], batches: Sequence[int], layer: Callable[[str, int, int], Any] | None = None
) -> list[Verdict]:
    """Per scheme and shape, whether each row of ``x[:b]`` equals the row alone (see the module's text).

    ``layer(scheme, out, in)`` makes the layer (by default a packed ``nn.Linear``); a test passes one that is
    known to break the invariance, to see it counted."""
    import torch

    make = layer or _packed_linear
    verdicts = []
    for scheme in schemes:
        for out_features, in_features in SHAPES:
            module, describe = make(scheme, out_features, in_features)
            x = torch.randn(ROWS, in_features, generator=torch.Generator().manual_seed(out_features + in_features))
            with torch.inference_mode():
                alone = torch.cat([module(x[i : i + 1]) for i in range(ROWS)])
                verdict = Verdict(f"linear {scheme} {out_features}x{in_features}")
                for b in batches:
                    shapes = [(b, in_features), (1, b, in_features)] + (
                        [(b // 4, 4, in_features)] if b % 4 == 0 else []
                    )
                    for shape in shapes:
                        got = module(x[:b].reshape(shape)).reshape(b, -1)
                        verdict.add(f"from {b} rows: {describe(b)}", alone[:b], got)
            verdicts.append(verdict)
    return verdicts


def _packed_linear(scheme: str, out_features: int, in_features: int) -> tuple[Any, Callable[[int], str]]:
    import torch
    from torch import nn

    import packcache
    from packcache.packers import Float32, platform_for
    from packcache.torch import convert

    packer = _packer(scheme)
    torch.manual_seed(out_features * 7 + in_features)
    model = nn.Sequential(nn.Linear(in_features, out_features))
    cache = packcache.WeightCache(None, platform=platform_for([packer, Float32()]))
    convert(model, cache, packer, model_id=f"invariance-{out_features}x{in_features}")
    path = model[0].kernel_path
    return model, lambda rows: packer.kernel(path, rows)


#: What the texts are made of: ordinary English words, so the tokenizer sees words it knows.
_SENTENCE = (
    "the cache maps packed weights from a file so every worker shares one clean copy of the model while the "
    "kernels read them in place and a warm launch costs little more than the mapping itself takes"
)


def texts(count: int) -> list[str]:
    """``count`` texts of 3 to 120 words, of many lengths (deterministic)."""
    words = _SENTENCE.split(" ")
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + (i * 37) % 118)) for i in range(count)]


def embed_verdicts(schemes: Sequence[str], count: int) -> list[Verdict]:
    """Per loader and scheme, whether a text's vector alone equals its vector in one call with the others."""
    from packcache import hf
    from packcache.models import minilm
    from packcache.models._minilm_files import default_model_path

    corpus = texts(count)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="packcache-invariance-") as tmp:
        for scheme in schemes:
            model = minilm.load(scheme, cache=os.path.join(tmp, f"minilm-{scheme}.pcache"))
            verdict = Verdict(f"minilm.embed {scheme}")
            together = model.embed(corpus)
            for i, text in enumerate(corpus):
                verdict.add(f"text {i}", model.embed([text])[0], together[i])
            model.close()
            verdicts.append(verdict)

            st = hf.sentence_transformer(default_model_path(), scheme, cache=os.path.join(tmp, f"st-{scheme}.pcache"))
            verdict = Verdict(f"hf.sentence_transformer encode {scheme}")
            together = st.encode(corpus, batch_size=len(corpus))
            for i, text in enumerate(corpus):
                verdict.add(f"text {i}", st.encode([text])[0], together[i])
            verdicts.append(verdict)
    return verdicts


def random_llama(directory: str, hidden: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 2) -> str:
    """A random Llama saved in ``directory`` with MiniLM's tokenizer (its vocabulary size), head dimension
    ``hidden / heads``: a model the engine serves, made in seconds, nothing downloaded."""
    import shutil

    import torch
    import transformers

    from packcache.models._minilm_files import default_model_path

    shipped = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(shipped / name, os.path.join(directory, name))
    config = transformers.LlamaConfig(
        vocab_size=30522, hidden_size=hidden, intermediate_size=2 * hidden if hidden < 1024 else 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        bos_token_id=101, eos_token_id=102, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the initialisation's, so greedy decoding varies its tokens
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


def _logits_of(plan: list[tuple[int, list[int], int]], model: Any, tokenizer: Any) -> dict[int, list[Any]]:
    """Run ``plan`` (step to submit at, prompt, greedy tokens) on a new engine, one step at a time; the logits of
    each request's steps, by its place in the plan, as its sampler saw them."""
    from packcache.server import llm, sampling

    seen: dict[str, list[Any]] = {}
    base: Any = sampling.sampler_class()

    class Recording(base):  # type: ignore[misc, valid-type]
        def __call__(self, scores: Any, tensor_arg: Any) -> Any:
            for row, slot in enumerate(tensor_arg[: min(scores.size(0), self.rows)].tolist()):
                request = self.slots.get(slot)
                if request is not None:
                    seen.setdefault(request.id, []).append(scores[row].clone())
            return super().__call__(scores, tensor_arg)

    original = llm.sampler_class
    llm.sampler_class = lambda: Recording
    try:
        engine = llm.LLMEngine(model, tokenizer, scheme="", max_seqs=4, max_model_len=128, page_size=16,
                               max_batch_tokens=32, warmup=False)  # fmt: skip
    finally:
        llm.sampler_class = original
    finished: dict[int, bool] = {}
    ids: dict[str, int] = {}
    step = 0
    while len(ids) < len(plan) or not all(finished.values()):
        for i, (start, prompt, tokens) in enumerate(plan):
            if start == step:
                finished[i] = False

                def sink(output: Any, i: int = i) -> None:
                    if output.finish_reason is not None:
                        finished[i] = True

                ids[engine.submit(prompt, sampling.Sampling(max_tokens=tokens, temperature=0.0), sink)] = i
        if not engine._step() or step > 500:
            raise RuntimeError(f"the engine stopped at step {step} with requests unfinished")
        step += 1
    return {i: seen.get(request_id, []) for request_id, i in ids.items()}


def generate_verdicts(schemes: Sequence[str]) -> list[Verdict]:
    """Per scheme, whether a greedy request's logits at each step are the same alone and among others."""
    import torch

    from packcache import hf

    def prompt(count: int, seed: int) -> list[int]:
        return [101, *torch.randint(1000, 30000, (count - 1,), generator=torch.Generator().manual_seed(seed)).tolist()]

    x = prompt(40, 1)
    others = [(0, prompt(9, 2), 14), (0, prompt(20, 3), 10), (5, prompt(60, 4), 6)]
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="packcache-invariance-") as tmp:
        directory = random_llama(tmp)
        tokenizer = hf.tokenizer(directory)
        for scheme in schemes:
            model = hf.from_pretrained(directory, scheme, False, auto_class="AutoModelForCausalLM")
            alone = _logits_of([(0, x, 12)], model, tokenizer)[0]
            among = _logits_of([others[0], others[1], (0, x, 12), others[2]], model, tokenizer)[2]
            verdict = Verdict(f"serve engine greedy logits {scheme}")
            for step in range(max(len(alone), len(among))):
                missing = torch.empty(0)
                verdict.add(f"step {step}", alone[step] if step < len(alone) else missing,
                            among[step] if step < len(among) else missing)  # fmt: skip
            verdicts.append(verdict)
    return verdicts


def machine() -> dict[str, Any]:
    """The CPU, the compiled code path this process runs and torch's, as the report's first line says."""
    import torch

    from packcache import native

    state = native.status()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "packcache_native": state.isa or f"off ({state.reason})",
        "batch_invariant_schemes": list(getattr(state, "batch_invariant", ())),  # absent before issue 47
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", default="linear,embed,generate", help="comma-separated: linear, embed, generate")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes of the linear layers")
    parser.add_argument("--texts", type=int, default=24, help="texts embedded alone and together")
    parser.add_argument("--json", help="write the verdicts to this file")
    args = parser.parse_args(argv)
    what = set(args.what.split(","))
    if what - {"linear", "embed", "generate"}:
        parser.error(f"--what: unknown {', '.join(sorted(what - {'linear', 'embed', 'generate'}))}")
    schemes = args.schemes.split(",")
    if set(schemes) - set(SCHEMES):
        parser.error(f"--schemes: one of {', '.join(SCHEMES)}")
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 or b > ROWS for b in batches):
        parser.error(f"--batches: each from 1 to {ROWS}")

    about = machine()
    print(__doc__.split("\n\n")[0])
    print(json.dumps(about))
    verdicts: list[Verdict] = []
    if "linear" in what:
        print("linear layers: each row alone against the same row inside a batch")
        for verdict in linear_verdicts(schemes, batches):
            print(verdict.line(), flush=True)
            verdicts.append(verdict)
    if "embed" in what:
        print(f"embeddings: {args.texts} texts, each alone against all in one call")
        for verdict in embed_verdicts(schemes, args.texts):
            print(verdict.line(), flush=True)
            verdicts.append(verdict)
    if "generate" in what:
        print("generation: a greedy request's logits at each step, alone against among others (continuous batching)")
        for verdict in generate_verdicts(schemes):
            print(verdict.line(), flush=True)
            verdicts.append(verdict)
    held = sum(v.holds for v in verdicts)
    print(f"{held} of {len(verdicts)} invariances hold")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": about, "verdicts": [asdict(v) | {"holds": v.holds} for v in verdicts]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
