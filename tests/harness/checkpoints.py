"""Tiny random checkpoints the MiniLM loader and ``packcache.hf`` load, made here (nothing is downloaded).

torch and transformers are imported when a checkpoint is made, so the harness (and the stress
command lines that import it) stays numpy-only.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE", "hub_snapshot", "tiny_bert", "tiny_causal_lm", "tiny_sentence_transformer", "tiny_transformer",
]  # fmt: skip


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


#: What the small byte-level BPE tokenizers of :func:`tiny_transformer` learn from.
_CORPUS = (
    "packcache maps packed weights instead of packing them on every launch.",
    "A fallback to heap is reported in bytes, per reason, with the errno.",
    "The weather is nice today. Where is the nearest train station?",
    "She opened the window and looked outside. Researchers measured the growth of plants.",
    "query: passage: int main() { return 0; } the river city light market engine forest paper story answer",
)
#: Architectures :func:`tiny_transformer` makes: BERT (all-MiniLM-L6-v2's WordPiece tokenizer), XLM-R and MPNet
#: (a small byte-level BPE tokenizer made here, RoBERTa-style special tokens).
ARCHITECTURES = ("bert", "xlm-roberta", "mpnet")


def _small_tokenizer(max_length: int) -> Any:
    """A byte-level BPE tokenizer of 400 tokens learnt from :data:`_CORPUS` (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2,
    ``<unk>`` 3, ``<mask>`` 4; XLM-R's and MPNet's ids), as a transformers tokenizer truncating at ``max_length``."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers, processors, trainers

    transformers: Any = importlib.import_module("transformers")  # untyped calls, as a value

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(list(_CORPUS), trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>", model_max_length=max_length,
    )  # fmt: skip


def tiny_transformer(directory: Path, arch: str, *, seed: int = 0, hidden: int = 32, max_length: int = 128) -> Path:
    """A tiny random transformers encoder of ``arch`` (:data:`ARCHITECTURES`) with its tokenizer, written by
    ``save_pretrained``: a plain checkpoint (no ``modules.json``), which sentence-transformers loads with mean
    pooling. Norms and biases are random too, so a wrongly loaded one shows."""
    import torch

    from packcache.models import minilm

    transformers: Any = importlib.import_module("transformers")
    sizes: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 2 * hidden,
    }  # fmt: skip
    tokenizer = None
    if arch == "bert":
        config: Any = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, **sizes)
    else:
        tokenizer = _small_tokenizer(max_length)
        kind = {"xlm-roberta": transformers.XLMRobertaConfig, "mpnet": transformers.MPNetConfig}[arch]
        config = kind(vocab_size=len(tokenizer), max_position_embeddings=max_length + 2, pad_token_id=1, **sizes)
    torch.manual_seed(seed)
    model: Any = transformers.AutoModel.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    model.save_pretrained(directory)
    if tokenizer is None:
        shipped = minilm.default_model_path()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            shutil.copy(shipped / name, directory / name)
    else:
        tokenizer.save_pretrained(directory)
    return directory


#: A ChatML-style chat template: each message between ``<|im_start|>ROLE`` and ``<|im_end|>``, the assistant's turn
#: opened when ``add_generation_prompt`` is set; a role other than system, user and assistant is refused.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_causal_lm(
    directory: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, chat_template: bool = True,
    max_positions: int = 256,
) -> Path:
    """A tiny random ``LlamaForCausalLM`` (``save_pretrained``) with :func:`_small_tokenizer`'s byte-level BPE
    tokenizer (``<s>`` BOS 0, ``</s>`` EOS 2), :data:`CHAT_TEMPLATE` as its chat template unless ``chat_template`` is
    false, and a generation config naming the EOS id: what ``--model`` takes for a causal LM, made in seconds.
    Weights are scaled up so greedy decoding varies its tokens instead of repeating one."""
    import torch

    transformers: Any = importlib.import_module("transformers")
    tokenizer = _small_tokenizer(max_positions)
    tokenizer.add_bos_token = True
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    config: Any = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, bos_token_id=0,
        eos_token_id=2, pad_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model: Any = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.12)
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_sentence_transformer(
    directory: Path,
    arch: str,
    *,
    pooling: str = "mean",
    dense: int | None = None,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    max_seq_length: int = 64,
    seed: int = 0,
) -> Path:
    """A sentence-transformers save (``SentenceTransformer.save``) of :func:`tiny_transformer`'s ``arch``:
    Transformer (truncating at ``max_seq_length``), Pooling (``pooling``), a Dense layer to ``dense`` features if
    given, Normalize if ``normalize``, and ``prompts`` in ``config_sentence_transformers.json``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    plain = tiny_transformer(directory.with_name(directory.name + "-plain"), arch, seed=seed)
    transformer = Transformer(str(plain), max_seq_length=max_seq_length)
    width = transformer.get_embedding_dimension()
    modules: list[Any] = [transformer, Pooling(width, pooling)]
    if dense is not None:
        import torch

        torch.manual_seed(seed + 1)
        modules.append(Dense(width, dense))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name)
    model.save(str(directory))
    shutil.rmtree(plain)
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
