"""packcache.hf: transformers and sentence-transformers models with packed weights from the cache.

Checked against transformers' own float32 forward on the same inputs: the real
all-MiniLM-L6-v2 (AutoModel and SentenceTransformer) and tiny random Llama, Qwen2
and GPT-2 checkpoints made here with transformers' config classes and
``save_pretrained`` (never committed, nothing downloaded). Cosine thresholds on the
flattened outputs vs float32: fp32 0.99999, bf16 0.999, int8 0.99, int4 0.95 (an
encoder's outputs over its real tokens: padded positions are masked out by every
consumer and hold no meaning).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import BertConfig, GPT2Config, LlamaConfig, Qwen2Config

from harness import run_child
from harness.checkpoints import tiny_bert
from packcache import FormatError, WeightCache, hf, identity, inspect, native
from packcache.models import minilm
from packcache.torch import FloatLinear, PackedEmbedding, PackedLinear

THRESHOLDS = {"fp32": 0.99999, "bf16": 0.999, "int8": 0.99, "int4": 0.95}
#: How close a plain model over a packed model's saved float weights comes to the packed model: its float weight is
#: exactly what the packed product multiplies by, but int4's product also rounds the activations to int8 per 32
#: (as llama.cpp's Q4_0 x Q8_0 does), and int8's per 4 (0.99997-0.99998 measured), which the plain model does not.
RELOADED = {"fp32": 0.99999, "bf16": 0.99999, "int8": 0.9999, "int4": 0.997}
CAUSAL = "AutoModelForCausalLM"
TEXTS = ["a sentence", "", "The quick brown fox jumps over the lazy dog.", "Packed weights are mapped from a file."]


def _tiny_configs() -> dict[str, tuple[Any, str]]:
    common = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    decoder = {
        **common, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128,
    }  # fmt: skip
    return {
        "llama": (LlamaConfig(**decoder, tie_word_embeddings=False), CAUSAL),
        "qwen2": (Qwen2Config(**decoder, tie_word_embeddings=True), CAUSAL),
        "gpt2": (GPT2Config(**common, n_embd=64, n_layer=2, n_head=4, n_positions=128), CAUSAL),
        "bert": (
            BertConfig(**common, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
            "AutoModel",
        ),
    }


def save_tiny(arch: str, directory: Path, seed: int = 0, **save: Any) -> Path:
    """A tiny random-weight checkpoint of ``arch`` written by transformers' ``save_pretrained``."""
    config, auto = _tiny_configs()[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config)
    with torch.no_grad():  # norms and biases random too, so a wrongly loaded one shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    model.save_pretrained(directory, **save)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("checkpoints")
    return {arch: save_tiny(arch, base / arch) for arch in _tiny_configs()}


def reference(path: Path, auto: str) -> Any:
    return getattr(transformers, auto).from_pretrained(path, dtype=torch.float32).eval()


def outputs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=ids)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def ids_for(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", hf.SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "bert"])
def test_tiny_architectures_match_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, scheme: str
) -> None:
    auto = _tiny_configs()[arch][1]
    ref = reference(checkpoints[arch], auto)
    model = hf.from_pretrained(checkpoints[arch], scheme, tmp_path / "c.pcache", auto_class=auto)
    assert type(model) is type(ref)
    assert model.packcache.stats().state == "stored"
    assert model.packcache.stats().heap_bytes == 0
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers, "no layer was packed"
    unpacked = (torch.nn.Linear, FloatLinear, *hf.TRANSPOSED_LINEARS)
    leftovers = [n for n, m in model.named_modules() if type(m) in unpacked]
    assert leftovers == [n for n in hf.load_report(model).ineligible], "an eligible linear layer stayed unpacked"
    assert not model.training
    similarity = cosine(outputs(model, ids_for()), outputs(ref, ids_for()))
    assert similarity >= THRESHOLDS[scheme], f"{arch} {scheme}: cosine {similarity:.6f}"
    model.packcache.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_generation_fp32_gives_transformers_tokens(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    ref = reference(checkpoints[arch], CAUSAL)
    model = hf.from_pretrained(checkpoints[arch], "fp32", tmp_path / "c.pcache", auto_class=CAUSAL)
    prompt = ids_for(7)[:1, :6]
    settings = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        expected = ref.generate(prompt, **settings)
        got = model.generate(prompt, **settings)
    assert got.shape == (1, 26)
    assert torch.equal(got, expected)
    model.packcache.close()


@pytest.mark.parametrize("scheme", hf.SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cold_warm_and_heap_loads_are_bit_identical(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, scheme: str
) -> None:
    auto = _tiny_configs()[arch][1]
    path = tmp_path / "c.pcache"
    results = {}
    for launch, cache in (("cold", path), ("warm", path), ("heap", False)):
        model = hf.from_pretrained(checkpoints[arch], scheme, cache, auto_class=auto)
        stats = model.packcache.stats()
        results[launch] = outputs(model, ids_for())
        expected_state = {"cold": "stored", "warm": "mapped", "heap": "off"}[launch]
        assert stats.state == expected_state, f"{launch}: {stats}"
        if launch == "warm":
            assert stats.heap_bytes == 0 and stats.stored == 0 and stats.hits > 0
        model.packcache.close()
    assert torch.equal(results["cold"], results["warm"])
    assert torch.equal(results["cold"], results["heap"])


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_a_tied_head_and_its_embedding_read_one_int8_pack_of_the_one_source_tensor(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """Issue 22: a float32 head read whole at every token cost a quarter of a 1 B model's decode; the head was
    packed by the scheme from the tie's one source tensor while the embeddings kept it as float32. Issue 32: per-row
    int8 *is* per-output-channel int8, so the embedding lookup and the head read one int8 pack (the checkpoint
    holds the tensor once, under the embedding's name), and no float32 copy is stored. The head's state_dict
    entry is the embeddings' float32 weight, one tensor, so a saved model is still tied."""
    path = tmp_path / "c.pcache"
    model = hf.from_pretrained(checkpoints[arch], "int8", path, auto_class=CAUSAL)
    embeddings = model.get_input_embeddings().weight
    report = hf.load_report(model)
    assert isinstance(model.lm_head, PackedLinear) and "lm_head" in report.converted
    assert "lm_head" not in report.ineligible
    embedding_name = "model.embed_tokens.weight" if arch == "qwen2" else "transformer.wte.weight"
    assert report.packed_ties == {"lm_head": [embedding_name]}
    few = "packcache int8" if native.status().isa is not None else "int8 weight to float32 per call"
    assert few in report.kernels["lm_head"]  # reported per layer kind, the head among them
    assert model.lm_head.tied_weight is embeddings and embeddings.dtype == torch.float32
    table = model.get_input_embeddings()
    assert isinstance(table, PackedEmbedding)
    for part in ("weight", "scales"):  # the head's operands are the table's parts (``.weight`` is the float table)
        assert model.lm_head._buffers[part].data_ptr() == table._buffers[part].data_ptr(), part
    state = model.state_dict()
    assert torch.equal(state["lm_head.weight"], embeddings) and state["lm_head.weight"] is state[embedding_name]
    model.packcache.close()
    names = [entry.name for entry in inspect(path).entries]
    assert not [n for n in names if n.startswith("lm_head")], names  # the checkpoint's one tensor, not a copy
    parts = ("torch.int8wo:scales", "torch.int8wo:weight")
    assert sorted(n for n in names if n.startswith(embedding_name)) == [f"{embedding_name}:{p}" for p in parts], names


def test_with_int4_a_tied_head_reads_the_int8_table_and_saves_the_table(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 32: the int4 scheme stores the embeddings as int8 rows. Issue 33 (item 3): its tied head reads that
    one int8 pack too (an int4 pack of its own beside the table made a 1.24 B Llama's int4 file 1.35x llama.cpp's
    Q4_0). Nothing float32 of the tie is stored, and the head saves the table's float32 weight, so a saved model is
    still tied."""
    path = tmp_path / "c.pcache"
    model = hf.from_pretrained(checkpoints["qwen2"], "int4", path, auto_class=CAUSAL)
    report = hf.load_report(model)
    table = model.get_input_embeddings()
    assert isinstance(table, PackedEmbedding) and type(table.packer).__name__ == "Int8WeightOnly"
    assert isinstance(model.lm_head, PackedLinear) and type(model.lm_head.packer).__name__ == "Int8WeightOnly"
    assert model.lm_head._buffers["weight"].data_ptr() == table._buffers["weight"].data_ptr()  # one pack
    assert report.packed_ties == {"lm_head": ["model.embed_tokens.weight"]} and report.tied == {}
    state = model.state_dict()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert torch.equal(state["lm_head.weight"], table.float_weight())
    model.packcache.close()
    names = sorted(entry.name for entry in inspect(path).entries if entry.name.startswith("model.embed_tokens"))
    assert names == [f"model.embed_tokens.weight:torch.int8wo:{p}" for p in ("scales", "weight")], names


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_with_the_fp32_scheme_a_tied_head_stays_one_float32_tensor(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    model = hf.from_pretrained(checkpoints[arch], "fp32", tmp_path / "c.pcache", auto_class=CAUSAL)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert "lm_head" in hf.load_report(model).ineligible and not hf.load_report(model).packed_ties
    model.packcache.close()


def test_untied_head_is_packed(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = hf.from_pretrained(checkpoints["llama"], "int8", tmp_path / "c.pcache", auto_class=CAUSAL)
    assert isinstance(model.lm_head, PackedLinear)
    model.packcache.close()


def test_gpt2_conv1d_is_packed_transposed(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "c.pcache"
    model = hf.from_pretrained(checkpoints["gpt2"], "fp32", path, auto_class=CAUSAL)
    layer = model.transformer.h[0].attn.c_attn
    assert isinstance(layer, PackedLinear) and (layer.out_features, layer.in_features) == (192, 64)
    model.packcache.close()
    entry = next(e for e in inspect(path).entries if e.name.startswith("transformer.h.0.attn.c_attn.weight"))
    assert entry.shape == (192, 64)  # [out, in], packed from the checkpoint's [in, out]
    assert hf.Checkpoint(checkpoints["gpt2"]).meta("transformer.h.0.attn.c_attn.weight").shape == (64, 192)


def test_changed_checkpoint_is_repacked_not_served_stale(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = shutil.copytree(checkpoints["llama"], tmp_path / "llama")
    path = tmp_path / "c.pcache"
    hf.from_pretrained(directory, "int8", path, auto_class=CAUSAL).packcache.close()
    assert hf.from_pretrained(directory, "int8", path, auto_class=CAUSAL).packcache.stats().state == "mapped"
    save_tiny("llama", directory, seed=5)  # other weights, same names and shapes
    model = hf.from_pretrained(directory, "int8", path, auto_class=CAUSAL)
    stats = model.packcache.stats()
    # Only the embedded config.json and generation_config.json hit: the same bytes, keyed by their sha256.
    assert stats.state == "stored" and stats.hits == 2, stats
    fresh = hf.from_pretrained(directory, "int8", False, auto_class=CAUSAL)
    assert torch.equal(outputs(model, ids_for()), outputs(fresh, ids_for()))
    assert cosine(outputs(model, ids_for()), outputs(reference(directory, CAUSAL), ids_for())) >= THRESHOLDS["int8"]
    model.packcache.close()


def test_sharded_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = save_tiny("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    model = hf.from_pretrained(directory, "fp32", tmp_path / "c.pcache", auto_class=CAUSAL)
    assert cosine(outputs(model, ids_for()), outputs(reference(checkpoints["llama"], CAUSAL), ids_for())) > 0.99999
    model.packcache.close()


def test_base_model_from_a_head_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """AutoModel on a causal-LM checkpoint: the checkpoint's ``model.`` prefix is stripped, as transformers does."""
    model = hf.from_pretrained(checkpoints["llama"], "int8", tmp_path / "c.pcache")
    ref = reference(checkpoints["llama"], "AutoModel")
    assert type(model) is type(ref) is transformers.LlamaModel
    assert cosine(outputs(model, ids_for()), outputs(ref, ids_for())) >= THRESHOLDS["int8"]
    model.packcache.close()


def test_pack_count_is_what_a_load_requests(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    for arch, scheme in (("gpt2", "int8"), ("qwen2", "int4"), ("bert", "fp32")):
        auto = _tiny_configs()[arch][1]
        model = hf.from_pretrained(checkpoints[arch], scheme, tmp_path / f"{arch}.pcache", auto_class=auto)
        stats = model.packcache.stats()
        assert hf.pack_count(checkpoints[arch], scheme, auto_class=auto) == stats.stored + stats.hits
        model.packcache.close()


def test_two_threads_building_skeletons_leave_torch_init_alone(tmp_path: Path) -> None:
    """Building a skeleton swaps process-wide functions (torch.nn.init's, tie_weights) for no-ops and
    puts back what it saw on entry. Thread A builds a model whose constructor waits; thread B starts
    its own build meanwhile and finishes after A. Interleaved, B saw A's no-ops on entry and put them
    back for good; serialised, B waits for A and the originals stay."""
    import threading

    class SlowConfig(transformers.PretrainedConfig):
        model_type = "packcache-test-slow"

    b_started, a_done = threading.Event(), threading.Event()

    class SlowModel(transformers.PreTrainedModel):
        config_class = SlowConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            if threading.current_thread().name == "A":
                b_started.wait(10)
                time.sleep(0.3)  # B, unless serialised, enters the init contexts now
            else:
                a_done.wait(10)  # ... and leaves them after A left
            self.proj = torch.nn.Linear(64, 64)
            self.post_init()

    transformers.AutoConfig.register(SlowConfig.model_type, SlowConfig)
    transformers.AutoModel.register(SlowConfig, SlowModel)
    directory = tmp_path / "slow"
    a_done.set()  # the save below runs the constructor outside any thread named A
    SlowModel(SlowConfig()).save_pretrained(directory)
    a_done.clear()
    originals = (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_, transformers.PreTrainedModel.tie_weights)
    errors: list[BaseException] = []

    def load(name: str) -> None:
        try:
            if name == "B":
                b_started.set()
            model = hf.from_pretrained(directory, "int8", False)
            assert isinstance(model.proj, PackedLinear)
        except BaseException as exc:
            errors.append(exc)
        finally:
            if name == "A":
                a_done.set()

    threads = [threading.Thread(target=load, args=(n,), name=n) for n in ("A", "B")]
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    now = (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_, transformers.PreTrainedModel.tie_weights)
    assert now == originals, "a no-op stayed installed in place of torch.nn.init or tie_weights"


def test_threads_loading_at_once_get_right_models(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Eight threads load at once (half into one shared cache file): every model matches a heap load."""
    import threading

    expected = {arch: outputs(hf.from_pretrained(checkpoints[arch], "int8", False, auto_class=CAUSAL), ids_for())
                for arch in ("llama", "gpt2")}  # fmt: skip
    results: dict[int, Any] = {}
    start = threading.Barrier(8)

    def load(i: int) -> None:
        arch = ("llama", "gpt2")[i % 2]
        cache = tmp_path / ("shared.pcache" if i < 4 else f"own-{i}.pcache")
        start.wait()
        try:
            model = hf.from_pretrained(checkpoints[arch], "int8", cache, auto_class=CAUSAL)
            results[i] = (arch, outputs(model, ids_for()), model.packcache.stats().state)
            model.packcache.close()
        except BaseException as exc:  # reported below, with the thread it came from
            results[i] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 8, f"threads did not finish: {sorted(results)}"
    for i, result in sorted(results.items()):
        assert not isinstance(result, BaseException), f"thread {i}: {result!r}"
        arch, got, state = result
        assert state in ("stored", "mapped"), (i, state)
        assert torch.equal(got, expected[arch]), f"thread {i} ({arch}) got other outputs"


# ----------------------------------------------------------------------------- saving a packed model
# A save writes each packed layer's float32 weight as its dequantising path multiplies by it. With 256 tokens a
# call every layer runs that path, so the reloaded float model gives the packed model's outputs (cosine >= 0.99999);
# with few tokens the fused weight-only kernels run on bfloat16 activations instead (cosine >= 0.999). Against the
# float source the scheme's own tolerance holds (THRESHOLDS): int8 and int4 saves keep their quantisation error.


def _layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}


def long_ids() -> torch.Tensor:
    """256 tokens a call: past every fused kernel's rows (at most 192), so every packed layer dequantises."""
    return torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scheme", hf.SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "bert"])
def test_save_pretrained_writes_a_checkpoint_plain_transformers_reloads_whole(
    checkpoints: dict[str, Path], tmp_path: Path, arch: str, scheme: str
) -> None:
    """``state_dict()`` has the keys, shapes and dtypes of transformers' own model; ``save_pretrained`` writes
    the tensors the source holds, under their names and shapes (GPT-2's ``Conv1D`` back in its ``[in, out]``
    layout, a tied head once), float32. Plain transformers reloads it with nothing missing or unexpected, and
    its outputs are the packed model's, within the scheme's tolerance of the source's."""
    auto = _tiny_configs()[arch][1]
    ref = reference(checkpoints[arch], auto)
    model = hf.from_pretrained(checkpoints[arch], scheme, False, auto_class=auto, kernel_path="fp32")
    assert _layout(model.state_dict()) == _layout(ref.state_dict())
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    source, written = hf.Checkpoint(checkpoints[arch]), hf.Checkpoint(saved)
    assert {n: written.meta(n).shape for n in written} == {n: source.meta(n).shape for n in source}
    assert {written.meta(n).dtype for n in written} == {"F32"}
    reloaded, info = getattr(transformers, auto).from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors: none
    reloaded.eval()
    # A packed head tied to the embeddings saves the tie's float32 tensor (the saved model stays tied, like the
    # source): the reload's head is that tensor, the packed model's its packed form, within the scheme's tolerance.
    tied = bool(hf.load_report(model).packed_ties)
    tolerances = (THRESHOLDS[scheme],) * 2 if tied else (RELOADED[scheme], 0.999)
    for ids, tolerance in zip((long_ids(), ids_for()), tolerances, strict=True):
        similarity = cosine(outputs(reloaded, ids), outputs(model, ids))
        assert similarity >= tolerance, f"{arch} {scheme} {tuple(ids.shape)}: cosine {similarity:.7f}"
    if tied:  # saved tied: the reload's head is the tie's tensor, as the source's
        assert torch.equal(reloaded.lm_head.weight, reloaded.get_input_embeddings().weight)
    to_source = cosine(outputs(reloaded, long_ids()), outputs(ref, long_ids()))
    assert to_source >= THRESHOLDS[scheme], f"{arch} {scheme}: cosine to the source {to_source:.7f}"
    if scheme != "fp32":  # what the packed layers compute was saved, not a copy of the source's weights
        name = f"{hf.load_report(model).converted[0]}.weight"
        assert not np.array_equal(written.read(name), source.read(name)), name


def test_torch_save_of_the_state_dict_loads_into_plain_transformers(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """GPT-2 (transposed ``Conv1D``, tied head), int4: ``torch.save(model.state_dict())`` loads with
    ``weights_only=True`` into transformers' own model, strictly, and gives the packed model's hidden states;
    its head is the tie's float32 tensor (the packed model's head is that tensor packed): logits within int4's
    tolerance."""
    model = hf.from_pretrained(checkpoints["gpt2"], "int4", False, auto_class=CAUSAL, kernel_path="fp32")
    assert isinstance(model.transformer.h[0].attn.c_attn, PackedLinear)
    state = model.state_dict()
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D's [in, out]
    torch.save(state, tmp_path / "state.pt")
    plain = transformers.GPT2LMHeadModel(model.config).eval()
    plain.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))  # strict
    assert plain.lm_head.weight is plain.transformer.wte.weight
    assert torch.equal(plain.transformer.wte.weight, model.transformer.wte.weight)
    with torch.inference_mode():
        hidden = [m.transformer(long_ids()).last_hidden_state for m in (plain, model)]
    assert cosine(*hidden) >= 0.99999
    assert cosine(outputs(plain, long_ids()), outputs(model, long_ids())) >= THRESHOLDS["int4"]


def test_load_state_dict_into_a_packed_model_is_refused_and_changes_nothing(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Its tensors are the cache's: a read-only mapping (a copy into one kills the process, see
    ``tests/test_torch.py``) or, here, the cache's own heap packs. ``load_state_dict`` raises before writing
    anything, on the model and on every module holding such tensors (packed, served, tied)."""
    model = hf.from_pretrained(checkpoints["gpt2"], "int8", False, auto_class=CAUSAL)
    before = outputs(model, ids_for())
    state = reference(save_tiny("gpt2", tmp_path / "other", seed=5), CAUSAL).state_dict()
    targets = {"": model, "transformer.wte.": model.transformer.wte, "lm_head.": model.lm_head}
    targets["transformer.h.0.attn.c_attn."] = model.transformer.h[0].attn.c_attn
    for prefix, target in targets.items():
        with pytest.raises(RuntimeError, match="read-only file mapping"):
            target.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    assert torch.equal(outputs(model, ids_for()), before)


def test_a_sharded_save_pretrained_reloads_whole(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model = hf.from_pretrained(checkpoints["llama"], "int8", False, auto_class=CAUSAL, kernel_path="fp32")
    model.save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    assert len(list((tmp_path / "saved").glob("model-*.safetensors"))) > 1
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info.values()), info
    assert cosine(outputs(reloaded.eval(), long_ids()), outputs(model, long_ids())) >= 0.99999


# ----------------------------------------------------------------------------- the real all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm_reference() -> dict[str, Any]:
    path = minilm.default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = reference(path, "AutoModel")(**batch).last_hidden_state
    from sentence_transformers import SentenceTransformer

    embeddings = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    return {"path": path, "batch": batch, "hidden": hidden, "embeddings": embeddings}


@pytest.mark.parametrize("scheme", hf.SCHEMES)
def test_minilm_automodel_matches_transformers(minilm_reference: dict[str, Any], tmp_path: Path, scheme: str) -> None:
    model = hf.from_pretrained(minilm_reference["path"], scheme, tmp_path / "c.pcache")
    assert type(model) is transformers.BertModel
    batch = minilm_reference["batch"]
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    similarity = cosine(hidden[real], minilm_reference["hidden"][real])
    assert similarity >= THRESHOLDS[scheme], f"{scheme}: cosine {similarity:.6f}"
    model.packcache.close()


@pytest.mark.parametrize("scheme", hf.SCHEMES)
def test_sentence_transformer_matches_sentence_transformers(
    minilm_reference: dict[str, Any], tmp_path: Path, scheme: str
) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer

    path = tmp_path / "st.pcache"
    embeddings = {}
    for launch in ("cold", "warm"):
        st = hf.sentence_transformer(minilm_reference["path"], scheme, path)
        assert type(st) is SentenceTransformer and type(st[0]) is Transformer
        assert st.packcache.stats().state == {"cold": "stored", "warm": "mapped"}[launch]
        assert any(isinstance(m, PackedLinear) for m in st.modules())
        embeddings[launch] = torch.from_numpy(st.encode(TEXTS))
        st.packcache.close()
    assert torch.equal(embeddings["cold"], embeddings["warm"])
    similarity = cosine(embeddings["warm"], minilm_reference["embeddings"])
    assert similarity >= THRESHOLDS[scheme], f"{scheme}: cosine {similarity:.6f}"


def test_a_cache_built_by_from_pretrained_serves_the_sentence_transformer(
    minilm_reference: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "shared.pcache"
    hf.from_pretrained(minilm_reference["path"], "int8", path).packcache.close()
    st = hf.sentence_transformer(minilm_reference["path"], "int8", path)
    stats = st.packcache.stats()
    assert stats.state == "mapped" and stats.stored == 0 and stats.heap_bytes == 0, stats
    st.packcache.close()


def test_sentence_transformer_needs_a_transformer_module(minilm_reference: dict[str, Any], tmp_path: Path) -> None:
    directory = shutil.copytree(minilm_reference["path"], tmp_path / "st")
    modules = json.loads((directory / "modules.json").read_text())
    (directory / "modules.json").write_text(json.dumps([m for m in modules if "Transformer" not in m["type"]]))
    with pytest.raises(ValueError, match="no sentence-transformers Transformer module"):
        hf.sentence_transformer(directory, "int8", False)


#: Eight texts of about 40 tokens: one call is past every fused kernel's rows (see "saving a packed model").
LONG_TEXTS = [f"{i}. " + " ".join(TEXTS[2:] * 2) for i in range(8)]

PLAIN_RELOAD = textwrap.dedent(
    """
    import json, sys
    from sentence_transformers import SentenceTransformer
    texts, directories = json.loads(sys.argv[1]), sys.argv[2:]
    embeddings = {d: SentenceTransformer(d, device="cpu").encode(texts).tolist() for d in directories}
    print(json.dumps({"embeddings": embeddings, "packcache": [m for m in sys.modules if m.startswith("packcache")]}))
    """
)


def test_sentence_transformer_save_reloads_in_plain_sentence_transformers(
    minilm_reference: dict[str, Any], tmp_path: Path
) -> None:
    """``SentenceTransformer.save`` of a packed all-MiniLM-L6-v2 writes the tensors plain sentence-transformers
    writes for the model (names, shapes, dtypes), and plain sentence-transformers in a fresh interpreter, offline,
    without packcache, embeds with them what the packed model embeds (cosine >= 0.99999 on texts long enough
    that every layer dequantises), within the scheme's tolerance of the float model's embeddings."""
    from sentence_transformers import SentenceTransformer

    float_model = SentenceTransformer(str(minilm_reference["path"]), device="cpu")
    expected_embeddings = torch.from_numpy(float_model.encode(LONG_TEXTS))
    float_model.save(str(tmp_path / "float"))
    plain_files = hf.Checkpoint(tmp_path / "float")
    expected = {n: (plain_files.meta(n).shape, plain_files.meta(n).dtype) for n in plain_files}
    packed, directories = {}, {}
    for scheme in hf.SCHEMES:
        st = hf.sentence_transformer(minilm_reference["path"], scheme, False, kernel_path="fp32")
        packed[scheme] = torch.from_numpy(st.encode(LONG_TEXTS))
        directories[scheme] = tmp_path / scheme
        st.save(str(directories[scheme]))
        written = hf.Checkpoint(directories[scheme])
        assert {n: (written.meta(n).shape, written.meta(n).dtype) for n in written} == expected, scheme
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [sys.executable, "-c", PLAIN_RELOAD, json.dumps(LONG_TEXTS), *(str(d) for d in directories.values())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["packcache"] == []
    for scheme, directory in directories.items():
        plain = torch.tensor(result["embeddings"][str(directory)])
        assert cosine(plain, packed[scheme]) >= RELOADED[scheme], f"{scheme}: {cosine(plain, packed[scheme]):.7f}"
        assert cosine(plain, expected_embeddings) >= THRESHOLDS[scheme], scheme


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_minilm_load_state_dict_loads_into_transformers_bert(
    minilm_reference: dict[str, Any], tmp_path: Path, scheme: str
) -> None:
    """``minilm.load``'s encoder (calibrated int4 included) has a ``state_dict`` under ``BertModel``'s names:
    transformers' model loads it (all but the pooler, which the encoder has not) and gives its outputs."""
    m = minilm.load(scheme, False, kernel_path="fp32")
    torch.save(m.encoder.state_dict(), tmp_path / "encoder.pt")
    plain = reference(minilm_reference["path"], "AutoModel")
    result = plain.load_state_dict(torch.load(tmp_path / "encoder.pt", weights_only=True), strict=False)
    assert result.unexpected_keys == [] and sorted(result.missing_keys) == ["pooler.dense.bias", "pooler.dense.weight"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_reference["path"])
    batch = tokenizer(LONG_TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = plain(**batch).last_hidden_state
        packed = m.encoder(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).float()
    real = batch["attention_mask"].bool()
    assert int(real.sum()) > 192
    similarity = cosine(hidden[real], packed[real])
    assert similarity >= RELOADED[scheme], f"{scheme}: {similarity:.7f}"
    name = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(
        m.encoder.state_dict()[name], reference(minilm_reference["path"], "AutoModel").state_dict()[name]
    )


# ----------------------------------------------------------------------------- warm launch reads no tensor byte

WARM_CHILD = textwrap.dedent(
    """
    import ctypes, json, mmap, os, sys
    from pathlib import Path
    import numpy as np
    checkpoint, cache_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    from packcache import hf
    from packcache.safetensors import SafetensorsFile

    def resident(path):
        # Pages of the file's tensor data (after the header) in the page cache, by mincore over a fresh mapping.
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: read the 8 bytes, nothing more
        size = os.fstat(fd).st_size
        data_start = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        os.close(fd)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        view = np.frombuffer(m, dtype=np.uint8)  # read-only; only its address is used, no byte is read
        if libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        first = data_start // page + 1  # the page holding the header's end may be read with it
        del view
        m.close()
        return sum(v & 1 for v in vec[first:]), pages - first

    shards = sorted(str(p) for p in Path(checkpoint).glob("*.safetensors"))
    if mode == "drop":
        for shard in shards:
            fd = os.open(shard, os.O_RDONLY)
            os.fsync(fd)  # dirty pages (just written by save_pretrained) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        print(json.dumps({"after_drop": [resident(s) for s in shards]}))
    else:
        from packcache import identity
        hashed = []
        real_hash = identity.hash_file
        # the shards; the small files the cache file embeds (config, generation config) are hashed once too
        identity.hash_file = lambda fd, path, st: (path.endswith(".safetensors") and hashed.append(path)) or real_hash(
            fd, path, st
        )
        model = hf.from_pretrained(checkpoint, "int8", cache_path, auto_class=mode)
        stats = model.packcache.stats()
        print(json.dumps({"state": stats.state, "heap": stats.heap_bytes, "hits": stats.hits,
                          "resident": [resident(s) for s in shards], "hashed": len(hashed)}))
    """
)


def test_warm_load_reads_no_tensor_byte_of_the_source(tmp_path: Path) -> None:
    """A warm launch in a fresh process, after the checkpoint was dropped from the page cache,
    leaves none of its tensor pages resident (mincore): it read config and headers only."""
    directory = save_tiny("llama", tmp_path / "llama", max_shard_size="40KB")
    cache_path = str(tmp_path / "c.pcache")
    # Past the racy window, the cold launch records each shard's content digest (packcache.identity), so the
    # warm launch finds them without reading a byte; a younger checkpoint would be hashed again.
    shards = list(directory.glob("*.safetensors"))
    time.sleep(max(0.0, max(p.stat().st_ctime for p in shards) + identity.RACY_SECONDS + 0.05 - time.time()))
    cold = run_child(WARM_CHILD, str(directory), cache_path, CAUSAL)
    assert cold["state"] == "stored" and cold["hashed"] == len(shards) > 1
    assert sum(count for count, _ in cold["resident"]) > 0, "the cold load should have read the tensors"
    dropped = run_child(WARM_CHILD, str(directory), cache_path, "drop")
    if any(count for count, _ in dropped["after_drop"]):
        pytest.fail(f"posix_fadvise(DONTNEED) left pages resident, the proof cannot run here: {dropped}")
    warm = run_child(WARM_CHILD, str(directory), cache_path, CAUSAL)
    assert warm["state"] == "mapped" and warm["heap"] == 0 and warm["hits"] > 0 and warm["hashed"] == 0, warm
    assert [count for count, _ in warm["resident"]] == [0] * len(warm["resident"]), warm


# ----------------------------------------------------------------------------- errors


def test_missing_or_malformed_checkpoints_are_clear_errors(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.from_pretrained(tmp_path / "nowhere", "int8", False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        hf.from_pretrained(empty, "int8", False)
    pickled = shutil.copytree(checkpoints["bert"], tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: pickle checkpoints are not loaded"):
        hf.from_pretrained(pickled, "int8", False)
    hostile = shutil.copytree(checkpoints["bert"], tmp_path / "hostile")
    index = {"weight_map": {"embeddings.word_embeddings.weight": "../../etc/passwd"}}
    (hostile / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="not a file name in this directory"):
        hf.from_pretrained(hostile, "int8", False)
    huge = {"weight_map": {"w": "x" * 1_000_000 + "/y"}}  # a hostile name stays out of the message
    (hostile / "model.safetensors.index.json").write_text(json.dumps(huge))
    with pytest.raises(FormatError, match="not a file name") as caught:
        hf.from_pretrained(hostile, "int8", False)
    assert len(str(caught.value)) < 500
    (hostile / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"model\.safetensors\.index\.json"):
        hf.from_pretrained(hostile, "int8", False)
    truncated = shutil.copytree(checkpoints["bert"], tmp_path / "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(FormatError, match=r"model\.safetensors"):
        hf.from_pretrained(truncated, "int8", False)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors"])
def test_a_fifo_in_the_checkpoint_is_refused_not_waited_on(
    checkpoints: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """A FIFO where a checkpoint file should be: a clear error at once (in a child with a timeout,
    so a regression hangs the child, not the suite)."""
    directory = shutil.copytree(checkpoints["gpt2"], tmp_path / "gpt2")
    (directory / name).unlink()
    os.mkfifo(directory / name)
    code = (
        "import sys; from packcache import hf, UntrustedFileError\n"
        "try:\n    hf.from_pretrained(sys.argv[1], 'int8', None, auto_class='AutoModelForCausalLM')\n"
        "except UntrustedFileError as exc:\n    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:") and name in done.stdout and "not a regular file" in done.stdout


def test_a_config_without_a_known_model_type_is_a_format_error(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = shutil.copytree(checkpoints["bert"], tmp_path / "bert")
    settings = json.loads((directory / "config.json").read_text())
    settings["model_type"] = "no-such-model"
    (directory / "config.json").write_text(json.dumps(settings))
    with pytest.raises(FormatError, match=r"config\.json.*model_type 'no-such-model'"):
        hf.from_pretrained(directory, "int8", False)
    (directory / "config.json").write_text("[" * 100_000)
    with pytest.raises(FormatError, match=r"config\.json"):
        hf.from_pretrained(directory, "int8", False)


def test_a_missing_tensor_is_named_and_the_cache_is_untouched(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = shutil.copytree(checkpoints["llama"], tmp_path / "llama")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    path = tmp_path / "c.pcache"
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf.from_pretrained(directory, "int8", path, auto_class=CAUSAL)
    assert not path.exists()


def test_bad_arguments(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown scheme"):
        hf.from_pretrained(checkpoints["bert"], "int3", False)
    with pytest.raises(ValueError, match="not a transformers AutoModel"):
        hf.from_pretrained(checkpoints["bert"], "int8", False, auto_class="BertModel")
    with pytest.raises(ValueError, match="AutoModelForImageClassification has no model class for a BertConfig"):
        hf.from_pretrained(checkpoints["bert"], "int8", False, auto_class="AutoModelForImageClassification")
    with pytest.raises(ValueError, match=r"lacks 5 tensor\(s\) that BertLMHeadModel needs: cls\.predictions"):
        hf.from_pretrained(checkpoints["bert"], "int8", False, auto_class=CAUSAL)
    with pytest.raises(ValueError, match="is a directory"):
        hf.from_pretrained(checkpoints["bert"], "int8", tmp_path)
    other = WeightCache(tmp_path / "other.pcache", platform=hf.platform("int4"))
    with pytest.raises(ValueError, match="another platform mapping"):
        hf.from_pretrained(checkpoints["bert"], "int8", other)
    other.close()


def test_model_close_keeps_outputs_and_a_given_cache_open(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "c.pcache", platform=hf.platform("int8"))
    model = hf.from_pretrained(checkpoints["bert"], "int8", cache)
    assert model.packcache is cache
    before = outputs(model, ids_for())
    cache.close()
    assert torch.equal(outputs(model, ids_for()), before)  # mapped tensors stay valid after close


def test_importing_packcache_imports_no_hugging_face_package() -> None:
    code = (
        "import sys, packcache, packcache.torch, packcache.models.minilm;"
        "print(sorted(m for m in ('transformers', 'sentence_transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    hf_done = subprocess.run(
        [sys.executable, "-c", "import sys, packcache.hf; print('transformers' in sys.modules)"],
        capture_output=True, text=True, timeout=120, check=True, env=env,
    )  # fmt: skip
    assert hf_done.stdout.strip() == "True"


# ----------------------------------------------------------------------------- packcache build


def _build(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """``packcache build ARGS --json``: its exit code and report; stderr is kept as ``{"stderr": ...}`` when
    nothing was printed."""
    from packcache.cli import main

    code = main(["build", *args, "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out.strip() else {"stderr": captured.err})


def test_build_packs_ahead_then_a_launch_maps(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deploy" / "gpt2.pcache"
    args = (str(checkpoints["gpt2"]), "--scheme", "int8", "--cache", str(path), "--auto-class", CAUSAL)
    code, first = _build(capsys, *args)
    assert code == 0, first
    assert first["stats"]["state"] == "stored" and first["stats"]["stored"] == first["packs"] > 0
    assert first["model_class"] == "GPT2LMHeadModel" and first["packed_ties"] == {"lm_head": ["transformer.wte.weight"]}
    code, again = _build(capsys, *args)
    assert code == 0 and again["stats"]["state"] == "mapped" and again["stats"]["hits"] == first["packs"]
    model = hf.from_pretrained(checkpoints["gpt2"], "int8", path, auto_class=CAUSAL)
    assert model.packcache.stats().state == "mapped"
    model.packcache.close()


def test_build_text_report_and_default_cache_file(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from packcache.cli import main

    assert main(["build", str(checkpoints["bert"]), "--scheme", "fp32", "--cache-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "BertModel (AutoModel)" in text and "state         stored" in text and "layers        13 packed" in text
    [made] = list(tmp_path.glob("bert-fp32-*.pcache"))
    assert made == hf.default_cache_path(checkpoints["bert"], "fp32", cache_dir=tmp_path)
    assert f"cache file    {made}" in text


def test_build_fails_when_the_file_cannot_hold_the_model(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    code, report = _build(capsys, str(checkpoints["bert"]), "--scheme", "int8", "--cache", str(blocker / "c.pcache"))
    assert code == 1
    assert report["stats"]["heap_bytes"] > 0 and report["stats"]["errno"] == 20  # ENOTDIR, served from heap
    code, failed = _build(capsys, str(tmp_path / "missing"), "--scheme", "int8", "--cache", str(tmp_path / "c.pcache"))
    assert code == 2  # no such model: a usage error, in every command (tests/test_cli.py)
    assert "packcache build: the checkpoint: no such model" in failed["stderr"] and "does not exist" in failed["stderr"]
    assert not (tmp_path / "c.pcache").exists()


def test_build_of_a_causal_lm_without_auto_class_builds_the_file_serve_generates_with(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``build`` of a causal LM without ``--auto-class`` wrote an ``AutoModel`` file that serve never opens, exit 0,
    no hint. One rule (transformers' causal-LM mapping, not a class-name suffix) now gives a causal LM, GPT-2's
    ``GPT2LMHeadModel`` too, the class serve generates with; BERT, whose causal class in that mapping is
    ``BertLMHeadModel``, stays an embedding model; fetch without ``--auto-class`` names the same file."""
    from packcache.cli import main
    from packcache.server.modelfiles import choose_loader

    gpt2, cache_dir = checkpoints["gpt2"], tmp_path / "ci"
    code, built = _build(capsys, str(gpt2), "--scheme", "int8", "--cache-dir", str(cache_dir))
    assert code == 0, built
    assert built["auto_class"] == CAUSAL and built["model_class"] == "GPT2LMHeadModel", built
    file = Path(built["cache_file"])
    assert file == hf.default_cache_path(gpt2, "int8", cache_dir=cache_dir, auto_class=CAUSAL)
    assert choose_loader(str(file)) == "causal"
    assert main(["build", str(gpt2), "--scheme", "int8", "--cache-dir", str(cache_dir)]) == 0
    assert (
        "auto class    AutoModelForCausalLM (a causal LM by transformers' causal-LM mapping" in capsys.readouterr().out
    )
    code, bert = _build(capsys, str(checkpoints["bert"]), "--scheme", "int8", "--cache-dir", str(cache_dir))
    assert code == 0 and (bert["auto_class"], bert["model_class"]) == ("AutoModel", "BertModel"), bert
    assert choose_loader(bert["cache_file"]) != "causal"
    # fetch without --auto-class looks for the file build published
    store = tmp_path / "store"
    store.mkdir()
    assert main(["publish", str(file), str(store), "--model", str(gpt2)]) == 0
    capsys.readouterr()
    fetched = tmp_path / "node"
    argv = ["fetch", str(store), "--model", str(gpt2), "--scheme", "int8", "--allow-unsigned", "--cache-dir"]
    assert main([*argv, str(fetched), "--json"]) == 0
    assert Path(json.loads(capsys.readouterr().out)["path"]) == fetched / file.name
    # an AutoModel file of a causal LM (what build made before): serve refuses it saying how to build the one it opens
    base = tmp_path / "base.pcache"
    assert main(["build", str(gpt2), "--scheme", "int8", "--cache", str(base), "--auto-class", "AutoModel"]) == 0
    assert "serve does not open this file" in capsys.readouterr().out
    with pytest.raises(
        ValueError, match=r"holds a causal LM \(GPT2LMHeadModel\) built with AutoModel.*packcache build"
    ):
        choose_loader(str(base))


# ----------------------------------------------------------------------------- hostile config values

#: arch -> config.json edit -> what the one line says. Each ended in a traceback (ZeroDivisionError, TypeError,
#: AttributeError, an 80 GB allocation), built a model of no layers, or built ten million layers on ``meta``.
HOSTILE_CONFIGS: dict[str, tuple[str, dict[str, Any] | str, str]] = {
    "zero heads": ("bert", {"num_attention_heads": 0}, "transformers cannot build BertModel from it"),
    "a string for a size": ("bert", {"hidden_size": "64"}, "cannot read it as a bert config: Validation error"),
    "a string for eps": ("llama", {"rms_norm_eps": "x"}, "rms_norm_eps"),
    "an absurd layer count": ("bert", {"num_hidden_layers": 10_000_000}, "num_hidden_layers is 10000000, but"),
    "an absurd n_layer": ("gpt2", {"n_layer": 10_000_000}, "num_hidden_layers is 10000000, but"),
    "a negative layer count": ("llama", {"num_hidden_layers": -1}, "num_hidden_layers is -1, but"),
    "a position table of 10^10": ("bert", {"max_position_embeddings": 10**10}, "non-persistent buffers would take"),
    "a size past int64": ("llama", {"vocab_size": 10**30}, "transformers cannot build LlamaForCausalLM from it"),
    "a number past a float": ("bert", '{"model_type": "bert", "layer_norm_eps": 1e400}', "1e400 does not fit a float"),
}


def test_hostile_config_values_end_in_one_line_naming_config_json(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``packcache build`` (which reads the config, counts the packs on a ``meta`` skeleton, then loads) on configs
    whose values transformers' own classes do not bound: one line naming ``config.json``, in a child bounded in
    time and address space (``harness.cli_child``)."""
    from harness.cli_child import run_cli_cases

    cases = []
    for name, (arch, change, _) in HOSTILE_CONFIGS.items():
        directory = shutil.copytree(checkpoints[arch], tmp_path / name.replace(" ", "-"))
        config = directory / "config.json"
        text = change if isinstance(change, str) else json.dumps({**json.loads(config.read_text()), **change})
        config.write_text(text)
        auto = _tiny_configs()[arch][1]
        cases.append((name, ["build", str(directory), "--scheme", "fp32", "--cache-dir", str(tmp_path / "c"),
                             "--auto-class", auto]))  # fmt: skip
    results = run_cli_cases(cases)
    wrong = {}
    for name, result in results.items():
        lines = result["stderr"].splitlines()
        line = lines[0] if lines else ""
        if not (result.get("rc") == 1 and len(lines) == 1 and "/config.json: " in line
                and line.startswith("packcache build: cannot load the checkpoint: ")
                and HOSTILE_CONFIGS[name][2] in line):  # fmt: skip
            wrong[name] = {k: v for k, v in result.items() if k != "stdout"}
    assert not wrong, json.dumps(wrong, indent=1)[:6000]
    assert not list((tmp_path / "c").glob("*.pcache")), "nothing was packed or written"


def test_a_hostile_generation_config_is_a_format_error_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = shutil.copytree(checkpoints["gpt2"], tmp_path / "gpt2")
    (directory / "generation_config.json").write_text(json.dumps({"watermarking_config": "x"}))
    with pytest.raises(FormatError, match=r"generation_config\.json: not a generation config: .*validate"):
        hf.from_pretrained(directory, "int8", False, auto_class=CAUSAL)


def test_a_load_from_a_local_path_imports_nothing_of_the_fleet_layer(tmp_path: Path) -> None:
    """Fetching by name is the fleet layer's; a load from a directory or a cache file imported it anyway (the
    published-name lookup and the platform comparison, at module level): milliseconds of every warm launch."""
    checkpoint = tiny_bert(tmp_path / "ckpt", seed=3)
    script = f"""
import sys
from packcache import hf
for launch in ("cold", "warm"):
    hf.from_pretrained({str(checkpoint)!r}, "int8", {str(tmp_path / "a.pcache")!r})
    hf.sentence_transformer({str(checkpoint)!r}, "int4", {str(tmp_path / "b.pcache")!r})
print(sorted(m for m in sys.modules if m.startswith("packcache.fleet")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
