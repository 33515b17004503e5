"""Tiny random checkpoints the MiniLM loader and ``packcache.hf`` load, made here (nothing is downloaded).

torch and transformers are imported when a checkpoint is made, so the harness (and the stress
command lines that import it) stays numpy-only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = ["tiny_bert"]


def tiny_bert(directory: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A tiny random BERT (``save_pretrained``, safetensors) with all-MiniLM-L6-v2's tokenizer and
    ``sentence_bert_config.json`` (the tokenizer's vocabulary sets the embedding table's size): what
    ``--model`` and ``build`` take, loaded in a fraction of a second. ``seed`` makes other weights."""
    import torch
    import transformers

    from packcache.models import minilm

    config: Any = transformers.BertConfig(
        vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(seed)
    model: Any = transformers.BertModel(config)
    model.save_pretrained(directory)
    shipped = minilm.default_model_path()
    for name in ("tokenizer.json", "sentence_bert_config.json"):
        shutil.copy(shipped / name, directory / name)
    return directory


def hub_snapshot(
    hub: Path, repo: str, source: Path, *, commit: str = "a" * 40, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Lay ``source`` (a checkpoint directory) out as the Hugging Face hub client caches a download of ``repo``
    (its documented layout): each file's bytes in ``models--ORG--NAME/blobs/<sha256>``, a relative symlink to it at
    ``snapshots/<commit>/<path>``, and ``refs/<ref>`` holding the commit for each of ``refs``. Returns the
    snapshot directory."""
    import hashlib
    import os

    folder = hub / ("models--" + repo.replace("/", "--"))
    blobs, snapshot = folder / "blobs", folder / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = path.relative_to(source)
        data = path.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)  # the hub client writes it without a newline
    return snapshot
