"""What the bounds on safetensors headers cost: parsing a normal header, now and before.

Method (printed first when run): ``SafetensorsFile(path)`` — open, read and
validate the header, no tensor byte — on the shipped all-MiniLM-L6-v2 header
(11 KB, 104 tensors) and on a synthetic 1B-parameter header (114 KB, 900
tensors; the data is a sparse file). Each figure is the best of 15 runs of
200 (MiniLM) or 20 (1B) constructions, in a fresh process. With ``--baseline
SRC`` the same measurement runs with ``PYTHONPATH=SRC`` (the source of the
reader to compare with, e.g. ``git archive 3a81630 src | tar -x -C /tmp/base``
and ``--baseline /tmp/base/src``), alternating with this checkout for ``--rounds`` rounds; the ranges over the
rounds are printed side by side.

Usage: python benchmarks/safetensors_header.py [--baseline SRC] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import json, sys, time
from packcache.safetensors import SafetensorsFile

def best(path, calls):
    SafetensorsFile(path)
    runs = []
    for _ in range(15):
        started = time.perf_counter()
        for _ in range(calls):
            SafetensorsFile(path)
        runs.append((time.perf_counter() - started) / calls * 1e3)
    return min(runs)

print(json.dumps({"minilm": best(sys.argv[1], 200), "1b": best(sys.argv[2], 20)}))
"""


def synthetic_1b(directory: str) -> str:
    """A header like a 1B-parameter bf16 model's: 900 tensors of 2048 x 5632 (sparse data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for i in range(900):
        nbytes = 2048 * 5632 * 2
        header[f"model.layers.{i // 9}.mlp.proj_{i % 9}.weight"] = {
            "dtype": "BF16", "shape": [2048, 5632], "data_offsets": [offset, offset + nbytes],
        }  # fmt: skip
        offset += nbytes
    raw = json.dumps(header).encode()
    path = os.path.join(directory, "1b.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def measure(src: str | None, minilm: str, big: str) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, minilm, big], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="src directory of the reader to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(__doc__.split("Usage:")[0].strip(), "\n")
    from packcache.models import minilm

    shipped = str(minilm.default_model_path() / "model.safetensors")
    here = str(Path(__file__).resolve().parents[1] / "src")
    with tempfile.TemporaryDirectory() as directory:
        big = synthetic_1b(directory)
        rows: dict[str, list[dict[str, float]]] = {"this checkout": [], "baseline": []}
        for _ in range(args.rounds):
            rows["this checkout"].append(measure(here, shipped, big))
            if args.baseline:
                rows["baseline"].append(measure(args.baseline, shipped, big))
    for label, runs in rows.items():
        if runs:
            spans = {k: f"{min(r[k] for r in runs):.3f}-{max(r[k] for r in runs):.3f} ms" for k in ("minilm", "1b")}
            print(f"{label:14s} MiniLM header {spans['minilm']:>18s}   1B header {spans['1b']:>18s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
