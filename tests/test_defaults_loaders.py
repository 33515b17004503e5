"""The loaders' defaults are a transformers user's: without ``cache=`` a load uses the content-named file in the
default cache directory, as the CLI does; ``cache=False`` turns caching off; cache names include the auto class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from harness.checkpoints import tiny_bert
from packcache import hf
from packcache.models import minilm

CAUSAL = "AutoModelForCausalLM"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("bert") / "ckpt", seed=11)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("gpt2") / "ckpt"
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def test_cache_none_is_the_content_named_file_and_false_is_off(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf.from_pretrained, hf.sentence_transformer and minilm.load agree: no ``cache=`` (or ``None``) is the file
    their ``default_cache_path`` names, in ``$PACKCACHE_DIR``, else ``$XDG_CACHE_HOME/packcache``."""
    monkeypatch.setenv("PACKCACHE_DIR", str(tmp_path / "explicit"))
    expected = hf.default_cache_path(bert, "int8")
    assert expected.parent == tmp_path / "explicit"
    assert expected == minilm.default_cache_path("int8", model_path=bert)  # AutoModel: the one file of both
    model = hf.from_pretrained(bert, "int8")
    assert (model.packcache.path, model.packcache.stats().state) == (str(expected), "stored")
    model.packcache.close()
    again = hf.from_pretrained(bert, "int8", None)
    assert (again.packcache.path, again.packcache.stats().state) == (str(expected), "mapped")
    again.packcache.close()
    with minilm.load("int8", model_path=bert) as m:
        assert (m.cache.path, m.cache.stats().state) == (str(expected), "mapped")
    shipped = minilm.default_model_path()  # a sentence-transformers model directory
    st = hf.sentence_transformer(shipped, "int8")
    assert (st.packcache.path, st.packcache.stats().state) == (str(hf.default_cache_path(shipped, "int8")), "stored")
    st.packcache.close()
    with minilm.load("int8") as m:
        assert (m.cache.path, m.cache.stats().state) == (st.packcache.path, "mapped")
    for off in (
        hf.from_pretrained(bert, "int8", False).packcache,
        hf.sentence_transformer(shipped, "int8", cache=False).packcache,
        minilm.load("int8", False, model_path=bert).cache,
    ):
        assert (off.path, off.stats().state) == (None, "off")
    monkeypatch.delenv("PACKCACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with minilm.load("int4", model_path=bert) as m:
        assert Path(m.cache.path or "").parent == tmp_path / "xdg" / "packcache"
        assert m.cache.path == str(minilm.default_cache_path("int4", model_path=bert))


def test_the_cache_name_includes_the_auto_class(gpt2: Path, bert: Path, tmp_path: Path) -> None:
    """A file built with AutoModel is not the one an AutoModelForCausalLM load of the same checkpoint opens: each
    holds its own model record, and neither load packs again nor rewrites the other's file."""
    plain = hf.default_cache_path(gpt2, "int8", cache_dir=tmp_path)
    causal = hf.default_cache_path(gpt2, "int8", cache_dir=tmp_path, auto_class=CAUSAL)
    assert plain != causal and plain.name.startswith("gpt2-int8-") and causal.name.startswith("gpt2-int8-")
    assert hf.default_cache_path(gpt2, "int8", cache_dir=tmp_path, auto_class=transformers.AutoModel) == plain
    for auto, path in (("AutoModel", plain), (CAUSAL, causal)):
        model = hf.from_pretrained(gpt2, "int8", auto_class=auto)
        assert Path(model.packcache.path or "").name == path.name, auto
        assert model.packcache.stats().state == "stored", (auto, model.packcache.stats())
        model.packcache.close()
    for auto in ("AutoModel", CAUSAL):
        model = hf.from_pretrained(gpt2, "int8", auto_class=auto)
        assert model.packcache.stats().state == "mapped", (auto, model.packcache.stats())
        assert Path(model.packcache.path or "").name == (plain if auto == "AutoModel" else causal).name
        model.packcache.close()
    # each file is the model of its class, alone
    assert type(hf.from_pretrained(str(Path(hf.default_cache_path(gpt2, "int8", auto_class=CAUSAL))))).__name__ == (
        "GPT2LMHeadModel"
    )
    assert type(hf.from_pretrained(str(hf.default_cache_path(gpt2, "int8")))).__name__ == "GPT2Model"
    # AutoModel keeps the name MiniLM's loader gives the same checkpoint (int8, bf16, fp32)
    for scheme in ("int8", "bf16", "fp32"):
        assert hf.default_cache_path(bert, scheme, cache_dir=tmp_path) == minilm.default_cache_path(
            scheme, model_path=bert, cache_dir=tmp_path
        )
