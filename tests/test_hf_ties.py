"""packcache.hf ties exactly what transformers 5.23 ties, whatever the config and the checkpoint say.

transformers ties a pair of ``all_tied_weights_keys`` (``lm_head.weight`` -> the input embeddings) only when
the config asks for it (``tie_word_embeddings``) and the checkpoint does not hold both tensors with different
values: both present and different, it keeps them apart (``tie_weights(missing_keys=...)``); only the head
present, it ties the embeddings to the head. Each case here is made from one untied tiny random checkpoint
(``save_pretrained``) by dropping or replacing a tensor and editing ``config.json``, and packcache's model
(every scheme, cold and warm, and its ``save_pretrained`` reloaded by transformers) is compared with
``AutoModelForCausalLM.from_pretrained``'s: which parameters are tied, ``all_tied_weights_keys``, and the
logits (fp32: allclose; the other schemes: cosine to the float32 reference, as tests/test_hf.py judges).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, LlamaConfig

from packcache import hf, inspect
from test_hf import CAUSAL, THRESHOLDS, cosine

HEAD = "lm_head.weight"
EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
#: What the checkpoint holds of the pair: the embedding only, both (equal or different), the head only.
HOLDINGS = ("no head", "equal head", "different head", "head only")


def _untied(arch: str) -> Any:
    common = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if arch == "llama":
        return LlamaConfig(
            **common, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        )  # fmt: skip
    return GPT2Config(**common, n_embd=64, n_layer=2, n_head=4, n_positions=128, tie_word_embeddings=False)


def make_case(base: Path, arch: str, tied: bool, holding: str) -> Path:
    """An untied random checkpoint of ``arch`` with its head (and embedding) as ``holding`` says, its config
    saying ``tie_word_embeddings=tied``."""
    source = base / f"{arch}-source"
    if not source.exists():
        torch.manual_seed(3)
        transformers.AutoModelForCausalLM.from_config(_untied(arch)).save_pretrained(source)
    directory = base / f"{arch}-{'tied' if tied else 'untied'}-{holding.replace(' ', '-')}"
    tensors = load_file(source / "model.safetensors")
    assert not torch.equal(tensors[HEAD], tensors[EMBEDDING[arch]])
    if holding == "no head":
        del tensors[HEAD]
    elif holding == "equal head":
        tensors[HEAD] = tensors[EMBEDDING[arch]].clone()
    elif holding == "head only":
        del tensors[EMBEDDING[arch]]
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, str], Path]:
    base = tmp_path_factory.mktemp("ties")
    return {
        (arch, tied, holding): make_case(base, arch, tied, holding)
        for arch in EMBEDDING for tied in (True, False) for holding in HOLDINGS
    }  # fmt: skip


def reference(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def head_is_tied(model: Any) -> bool:
    """Whether the model's head computes with its input embeddings' tensor (a packed head: packed from it)."""
    embedding = model.get_input_embeddings().weight
    head = model.lm_head
    return getattr(head, "tied_weight", None) is embedding or getattr(head, "weight", None) is embedding


def transformers_would_initialise(tied: bool, holding: str) -> bool:
    """transformers fills a tensor the checkpoint lacks with random values; packcache refuses instead."""
    return not tied and holding in ("no head", "head only")


@pytest.mark.parametrize("scheme", hf.SCHEMES)
@pytest.mark.parametrize("holding", HOLDINGS)
@pytest.mark.parametrize("tied", [True, False], ids=["config-tied", "config-untied"])
@pytest.mark.parametrize("arch", list(EMBEDDING))
def test_every_config_and_checkpoint_combination_builds_transformers_model(
    cases: dict[tuple[str, bool, str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    tied: bool,
    holding: str,
    scheme: str,
) -> None:
    directory = cases[arch, tied, holding]
    path = tmp_path / "c.pcache"
    if transformers_would_initialise(tied, holding):
        with pytest.raises(ValueError, match="the checkpoint lacks 1 tensor"):
            hf.from_pretrained(directory, scheme, path, auto_class=CAUSAL)
        return
    ref = reference(directory)
    expected = logits(ref)
    launches = []
    for launch in ("cold", "warm"):
        if launch == "warm":  # the tie is decided from the cache too: no tensor of the checkpoint is read
            monkeypatch.setattr(hf.Checkpoint, "read", lambda self, name: pytest.fail(f"warm launch read {name}"))
        model = hf.from_pretrained(directory, scheme, path, auto_class=CAUSAL)
        stats = model.packcache.stats()
        assert stats.state == {"cold": "stored", "warm": "mapped"}[launch], stats
        assert stats.heap_bytes == 0 and (launch == "cold" or stats.stored == 0), stats
        assert head_is_tied(model) == head_is_tied(ref), f"{launch}: packcache ties what transformers does not"
        assert model.all_tied_weights_keys == ref.all_tied_weights_keys
        got = logits(model)
        if scheme == "fp32":
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), f"{launch}: cosine {cosine(got, expected)}"
        else:
            assert cosine(got, expected) >= THRESHOLDS[scheme], f"{launch}: cosine {cosine(got, expected):.6f}"
        launches.append(got)
        if launch == "cold":
            count = hf.pack_count(directory, scheme, auto_class=CAUSAL)
            assert count == stats.stored + stats.hits
        else:
            saved = tmp_path / "saved"
            model.save_pretrained(saved)
            reloaded = reference(saved)
            assert head_is_tied(reloaded) == head_is_tied(ref), "the saved checkpoint reloads as another model"
            assert reloaded.all_tied_weights_keys == ref.all_tied_weights_keys
            # A packed tied head saves the tie's float32 tensor (docs/HF.md): the reload is within the scheme of both.
            assert cosine(logits(reloaded), got) >= THRESHOLDS[scheme]
            assert cosine(logits(reloaded), expected) >= THRESHOLDS[scheme]
        model.packcache.close()
    assert torch.equal(launches[0], launches[1])


@pytest.mark.parametrize("arch", list(EMBEDDING))
def test_a_tied_config_over_an_untied_checkpoint_loads_the_checkpoints_own_head(
    cases: dict[tuple[str, bool, str], Path], tmp_path: Path, arch: str
) -> None:
    """Issue 31, defect 9: the config says tied, the checkpoint holds its own, different head. transformers keeps
    the two apart; packcache tied them (fp32 logits had cosine 0.004 to transformers'), and int8's
    save_pretrained wrote that other model (the embedding as the head)."""
    directory = cases[arch, True, "different head"]
    ref = reference(directory)
    assert not head_is_tied(ref)
    model = hf.from_pretrained(directory, "fp32", False, auto_class=CAUSAL)
    assert torch.allclose(logits(model), logits(ref), rtol=1e-4, atol=1e-5)
    packed = hf.from_pretrained(directory, "int8", tmp_path / "c.pcache", auto_class=CAUSAL)
    assert "lm_head" not in hf.load_report(packed).packed_ties
    packed.save_pretrained(tmp_path / "saved")
    assert HEAD in load_file(tmp_path / "saved" / "model.safetensors")
    reloaded = reference(tmp_path / "saved")
    assert not head_is_tied(reloaded)
    assert cosine(logits(reloaded), logits(ref)) >= THRESHOLDS["int8"]
    assert cosine(logits(reloaded), logits(packed)) >= 0.999
    packed.packcache.close()
    checks = [
        e.name for e in inspect(tmp_path / "c.pcache").entries if e.name.endswith(":packcache.hf.tie-check:equal")
    ]
    assert checks == [f"{EMBEDDING[arch]}={HEAD}:packcache.hf.tie-check:equal"]  # what a warm launch ties from


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random BertForMaskedLM as transformers saves it tied (no decoder weight or bias: the config ties the
    weight to the word embeddings and the bias to ``cls.predictions.bias``), and copies whose checkpoint holds
    its own, different decoder weight or decoder bias under the same tied config."""
    base = tmp_path_factory.mktemp("mlm")
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(4)
    model = transformers.BertForMaskedLM(config)
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0.0, 0.5)
    saved = base / "as-saved"
    model.save_pretrained(saved)
    tensors = load_file(saved / "model.safetensors")
    assert "cls.predictions.decoder.bias" not in tensors and "cls.predictions.decoder.weight" not in tensors
    own = {
        "own decoder bias": {"cls.predictions.decoder.bias": torch.randn(256) * 0.5},
        "own decoder weight": {"cls.predictions.decoder.weight": torch.randn(256, 64) * 0.05},
    }
    cases = {"as saved": saved}
    for label, extra in own.items():
        directory = base / label.replace(" ", "-")
        directory.mkdir()
        save_file({**tensors, **extra}, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text((saved / "config.json").read_text())
        cases[label] = directory
    return cases


@pytest.mark.parametrize("scheme", hf.SCHEMES)
@pytest.mark.parametrize("case", ["as saved", "own decoder bias", "own decoder weight"])
def test_a_masked_lm_checkpoint_saved_tied_loads_in_every_scheme(
    masked_lm: dict[str, Path], tmp_path: Path, case: str, scheme: str
) -> None:
    """BERT's MLM head ties a bias too (the decoder's to ``cls.predictions.bias``). A packed decoder looked its bias
    up under its own name only, which transformers' save leaves out: every scheme but fp32 raised KeyError."""
    directory = masked_lm[case]
    ref = transformers.AutoModelForMaskedLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = hf.from_pretrained(directory, scheme, tmp_path / "c.pcache", auto_class="AutoModelForMaskedLM")
    assert model.all_tied_weights_keys == ref.all_tied_weights_keys
    got, expected = logits(model), logits(ref)
    assert cosine(got, expected) >= THRESHOLDS[scheme], f"cosine {cosine(got, expected):.6f}"
    model.save_pretrained(tmp_path / "saved")
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    assert reloaded.all_tied_weights_keys == ref.all_tied_weights_keys
    assert cosine(logits(reloaded), expected) >= THRESHOLDS[scheme]
    model.packcache.close()


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random T5 as transformers saves it (``shared.weight`` only: the encoder's and decoder's embeddings
    and the head are tied to it), and checkpoints that disagree with that config: the encoder's embeddings its
    own, different tensor; no ``shared.weight`` but the encoder's and decoder's (equal, or the decoder's different:
    transformers ties ``shared`` to the encoder's, then compares the decoder's with it)."""
    base = tmp_path_factory.mktemp("t5")
    config = transformers.T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(5)
    saved = base / "as-saved"
    transformers.T5ForConditionalGeneration(config).save_pretrained(saved)
    tensors = load_file(saved / "model.safetensors")
    shared = tensors.pop("shared.weight")
    variants = {
        "own encoder embeddings": {"shared.weight": shared, "encoder.embed_tokens.weight": torch.randn(256, 64)},
        "encoder and decoder only": {"encoder.embed_tokens.weight": shared, "decoder.embed_tokens.weight": shared},
        "decoder differs": {"encoder.embed_tokens.weight": shared, "decoder.embed_tokens.weight": torch.randn(256, 64)},
    }
    cases = {"as saved": saved}
    for label, extra in variants.items():
        directory = base / label.replace(" ", "-")
        directory.mkdir()
        # clone: safetensors refuses two names over one storage
        save_file({**tensors, **{k: v.clone() for k, v in extra.items()}}, directory / "model.safetensors")
        (directory / "config.json").write_text((saved / "config.json").read_text())
        cases[label] = directory
    return cases


@pytest.mark.parametrize("scheme", ["fp32", "int8"])
@pytest.mark.parametrize("case", ["as saved", "own encoder embeddings", "encoder and decoder only", "decoder differs"])
def test_shared_embeddings_of_an_encoder_decoder_are_tied_as_transformers_ties_them(
    seq2seq: dict[str, Path], tmp_path: Path, case: str, scheme: str
) -> None:
    directory = seq2seq[case]
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    model = hf.from_pretrained(directory, scheme, tmp_path / "c.pcache", auto_class="AutoModelForSeq2SeqLM")
    assert model.all_tied_weights_keys == ref.all_tied_weights_keys
    embeddings = [m.get_input_embeddings().weight for m in (model, model.encoder, model.decoder)]
    expected = [m.get_input_embeddings().weight for m in (ref, ref.encoder, ref.decoder)]
    assert [a is b for a in embeddings for b in embeddings] == [a is b for a in expected for b in expected]
    with torch.inference_mode():
        got, want = model(input_ids=ids, decoder_input_ids=ids).logits, ref(input_ids=ids, decoder_input_ids=ids).logits
    assert cosine(got, want) >= THRESHOLDS[scheme], f"cosine {cosine(got, want):.6f}"
    model.packcache.close()
