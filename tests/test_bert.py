"""The plain torch BERT (``packcache.models.bert``): ``BertConfig`` checks every value it is made with or
reads from ``config.json`` (one ``FormatError`` naming the file and the field), the shapes it implies are the
encoder's parameters, and the encoder refuses token ids past its tables.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli_child import run_cli_cases
from packcache import FormatError
from packcache.models import bert
from packcache.models.bert import BertConfig, BertEncoder
from test_minilm import one_line, tokenizer_edit, variant

# --------------------------------------------------------------------------- BertConfig


def test_the_shapes_a_config_implies_are_the_encoders_parameters() -> None:
    """``BertConfig.tensor_shapes`` (what is checked against the header) is exactly what ``BertEncoder`` builds."""
    for config_ in (BertConfig(), BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2)):
        with torch.device("meta"):
            encoder = BertEncoder(config_)
        built = [(name, tuple(param.shape)) for name, param in encoder.named_parameters()]
        assert built == [(name, shape) for name, shape, _ in config_.tensor_shapes()]


#: Any JSON value, biased to what a config field holds: integers of every size, floats past 1e308, booleans.
FIELD_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(0, 3000) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.sampled_from(["gelu", "absolute", "bert", "1e400", 1e308]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
CONFIG_FIELDS = [*BertConfig.__dataclass_fields__, "max_seq_length", "unknown"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(CONFIG_FIELDS), FIELD_VALUES, max_size=6))
def test_any_values_in_config_json_make_a_checked_config_or_one_format_error(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    """The whole class, not the spellings above: whatever JSON values the fields hold, ``BertConfig.from_file``
    gives a config whose every size is an integer in range (so nothing built from it divides by zero or
    overflows), or a ``FormatError`` naming the file; and checking it against a header takes as many lookups
    as the header has tensors, not as many as the config asks for."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    try:
        config_ = BertConfig.from_file(path)
    except FormatError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
        return
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        value = getattr(config_, name)
        assert type(value) is int and 1 <= value <= bert.MAX_SIZE
    assert config_.hidden_size % config_.num_attention_heads == 0 and config_.layer_norm_eps > 0
    held = {name: shape for name, shape, _ in BertConfig(num_hidden_layers=2).tensor_shapes()}
    looked: list[str] = []
    config_.mismatch(lambda name: looked.append(name) or held.get(name))
    assert len(looked) <= len(held) + 1


def test_bert_config_refuses_bad_values_made_in_code_too() -> None:
    with pytest.raises(ValueError, match="num_attention_heads must be an integer from 1"):
        BertConfig(num_attention_heads=0)
    with pytest.raises(ValueError, match="hidden_size 30 is not a multiple of num_attention_heads 4"):
        BertConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="layer_norm_eps must be a positive finite number"):
        BertConfig(layer_norm_eps=float("nan"))
    assert BertConfig(layer_norm_eps=1).layer_norm_eps == 1  # an integer is a number


# --------------------------------------------------------------------------- ids past the embedding tables


def _far_id(data: dict[str, Any]) -> None:
    data["model"]["vocab"]["the"] = 99_999  # as many tokens as the config's vocab_size, one id past it


def _type_id(data: dict[str, Any]) -> None:
    for item in data["post_processor"]["single"]:
        next(iter(item.values()))["type_id"] = 5  # type_vocab_size is 2


#: Tokenizers that load but give an id past an embedding table for some text: ``run`` says so in one line.
EMBED_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a token id past vocab_size": (tokenizer_edit(_far_id), "vocab_size 30522"),
    "a type id past type_vocab_size": (tokenizer_edit(_type_id), "type_vocab_size 2"),
}


def test_a_tokenizer_giving_ids_past_the_tables_is_one_line_not_an_index_error(base: Path, tmp_path: Path) -> None:
    cases = []
    for name, (edit, _) in EMBED_CASES.items():
        directory = variant(base, tmp_path / name.replace(" ", "-"), edit)
        cases.append((name, ["run", "--model", str(directory), "--no-cache", "--scheme", "fp32", "--text", "the"]))
    results = run_cli_cases(cases)
    for name, (_, says) in EMBED_CASES.items():
        line = one_line(results[name], "packcache run: cannot embed: ")
        assert "tokenizer" in line and says in line, line


# --------------------------------------------------------------------------- a decoder BERT


def test_a_decoder_bert_is_refused_not_run_as_an_encoder(base: Path, tmp_path: Path) -> None:
    """A BERT config with ``is_decoder`` (transformers runs it with causal attention: each token sees the ones
    before it) was read as an encoder's, attending both ways, without a word. The MiniLM encoder refuses it, and the
    loader rule sends it to ``packcache.hf``, which runs the model's own code."""
    import shutil

    from packcache.models import minilm
    from packcache.server.modelfiles import choose_loader

    with pytest.raises(ValueError, match=r"is_decoder True is not supported \(a decoder"):
        BertConfig(is_decoder=True)
    assert BertConfig(is_decoder=False).is_decoder is False
    directory = shutil.copytree(base, tmp_path / "decoder")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    with pytest.raises(FormatError, match=r"config\.json: is_decoder True is not supported"):
        minilm.check_checkpoint(directory)
    assert choose_loader(str(base)) == "minilm" and choose_loader(str(directory)) == "hf"
