"""A cache file is the model: it holds the record and the checkpoint's files, and loads alone.

Every load "from the file alone" here runs in a fresh process after the checkpoint is deleted, so nothing of it
can be read; the file is then checked unchanged (a load never writes the file it runs from).
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import run_child
from packcache import FormatError, UntrustedFileError, WeightCache, hf, inspect
from packcache import format as fmt
from packcache._generations import read_committed
from packcache.bundle import open_bundle, record_requests
from packcache.errors import PackResultError
from packcache.models import minilm
from test_hf import CAUSAL, TEXTS, ids_for, outputs, save_tiny

MINILM = minilm.default_model_path()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def built_llama(tmp_path: Path, scheme: str = "int8") -> tuple[Path, torch.Tensor]:
    """A tiny Llama built into ``m.pcache`` from a checkpoint that is then deleted; its logits on ``ids_for()``."""
    checkpoint = save_tiny("llama", tmp_path / "ckpt")
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    path = tmp_path / "m.pcache"
    model = hf.from_pretrained(checkpoint, scheme, path, auto_class=CAUSAL)
    logits = outputs(model, ids_for())
    model.packcache.close()
    shutil.rmtree(checkpoint)
    return path, logits


LOAD_LLAMA = """
import sys, torch
from packcache import hf
from test_hf import ids_for, outputs
model = hf.from_pretrained(sys.argv[1])
stats = model.packcache.stats()
torch.save(outputs(model, ids_for()), sys.argv[2])
report(cls=type(model).__name__, state=stats.state, stored=stats.stored, heap=stats.heap_bytes,
     read_only=model.packcache.read_only, eos=model.generation_config.eos_token_id)
"""


def test_a_causal_lm_loads_from_its_cache_file_alone_in_a_fresh_process(tmp_path: Path) -> None:
    path, logits = built_llama(tmp_path)
    before = sha256(path)
    with open_bundle(path) as bundle:
        record = bundle.record
        assert (record.loader, record.scheme, record.auto_class, record.model_type) == ("hf", "int8", CAUSAL, "llama")
        assert set(record.files) == {"config.json", "generation_config.json", "tokenizer_config.json"}
        assert all(s.startswith("sha256:") for s in record.sources) and "model.embed_tokens.weight" in record.tensors
    result = run_child(LOAD_LLAMA, str(path), str(tmp_path / "out.pt"))
    assert result.pop("records") == []  # nothing logged: no fault, no fallback
    assert result == {"cls": "LlamaForCausalLM", "state": "mapped", "stored": 0, "heap": 0, "read_only": True, "eos": 2}
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits)
    assert sha256(path) == before


def test_a_fresh_build_is_one_generation_with_nothing_superseded(tmp_path: Path) -> None:
    path, _ = built_llama(tmp_path)
    report = inspect(path)
    assert report.generation == 1 and report.reclaimable_bytes == 0
    names = {entry.name for entry in report.entries}
    assert {"packcache.model", "packcache.file/config.json", "packcache.file/generation_config.json"} <= names


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_minilm_and_sentence_transformers_load_from_the_file_alone(tmp_path: Path, scheme: str) -> None:
    checkpoint = shutil.copytree(MINILM, tmp_path / "minilm")
    path = tmp_path / "m.pcache"
    with minilm.load(scheme, cache=path, model_path=checkpoint) as model:
        expected = model.embed(TEXTS)
    shutil.rmtree(checkpoint)
    before = sha256(path)
    code = """
import sys, numpy as np
from packcache.models import minilm
from packcache import hf
from test_hf import TEXTS
m = minilm.load(model_path=sys.argv[1])
np.save(sys.argv[2], m.embed(TEXTS))
st_state = None
if m.scheme != "int4":  # calibrated int4 packs are minilm's alone
    st = hf.sentence_transformer(sys.argv[1])
    np.save(sys.argv[3], st.encode(TEXTS))
    st_state = [st.packcache.stats().state, st.packcache.stats().stored, type(st[0]).__name__]
report(scheme=m.scheme, state=m.cache.stats().state, stored=m.cache.stats().stored, st=st_state)
"""
    result = run_child(code, str(path), str(tmp_path / "a.npy"), str(tmp_path / "b.npy"))
    assert result["scheme"] == scheme and result["state"] == "mapped" and result["stored"] == 0
    assert np.array_equal(np.load(tmp_path / "a.npy"), expected)
    if scheme == "int8":
        assert result["st"] == ["mapped", 0, "Transformer"]
        cosine = np.sum(np.load(tmp_path / "b.npy") * expected, axis=1)
        assert cosine.min() > 0.999, cosine
    else:
        assert result["st"] is None
        with pytest.raises(ValueError, match=r"calibrated by packcache\.models\.minilm"):
            hf.from_pretrained(path)
    assert sha256(path) == before


def test_the_cli_runs_and_builds_from_a_cache_file(tmp_path: Path) -> None:
    path, _ = built_llama(tmp_path)
    cli = [sys.executable, "-m", "packcache"]
    done = subprocess.run([*cli, "build", str(path), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["stats"]["state"] == "mapped" and data["model_class"] == "LlamaForCausalLM" and data["scheme"] == "int8"
    assert data["file_reclaimable_bytes"] == 0
    bert = tmp_path / "bert.pcache"
    minilm.load("int8", cache=bert).close()
    done = subprocess.run([*cli, "run", "--model", str(bert), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["stats"]["state"] == "mapped" and data["scheme"] == "int8" and data["embeddings_shape"] == [3, 384]
    done = subprocess.run([*cli, "run", "--model", str(bert), "--scheme", "bf16"], capture_output=True, text=True)
    assert done.returncode == 1 and "holds the int8 scheme" in done.stderr, done.stderr


def test_a_config_naming_remote_code_is_refused_and_never_stored(tmp_path: Path) -> None:
    checkpoint = save_tiny("llama", tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling_x.X"}}))
    path = tmp_path / "m.pcache"
    with pytest.raises(FormatError, match=r"config.json names remote code \(auto_map\)"):
        hf.from_pretrained(checkpoint, "int8", path, auto_class=CAUSAL)
    assert not path.exists() or not any(e.name.startswith("packcache.") for e in inspect(path).entries)
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"trust_remote_code": True}))
    with pytest.raises(FormatError, match=r"tokenizer_config.json names remote code \(trust_remote_code\)"):
        hf.from_pretrained(checkpoint, "int8", path, auto_class=CAUSAL)
    st = shutil.copytree(MINILM, tmp_path / "st")
    modules = json.loads((st / "modules.json").read_text())
    modules[1]["type"] = "my_package.CustomPooling"
    (st / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(FormatError, match=r"names the module class 'my_package\.CustomPooling'"):
        minilm.load("int8", cache=tmp_path / "st.pcache", model_path=st)


def _entry(path: Path, name: str) -> fmt.Entry:
    with open(path, "rb") as f:
        _, _, entries = read_committed(f.fileno(), path=str(path))
    return entries[name]


def test_embedded_bytes_changed_in_place_are_refused_at_load(tmp_path: Path) -> None:
    path, _ = built_llama(tmp_path)
    entry = _entry(path, "packcache.file/config.json")
    data = bytearray(path.read_bytes())
    raw = bytes(data[entry.offset : entry.offset + entry.nbytes])
    forged = raw.replace(b'"llama"', b'"bert" ')  # same length, another model type
    assert forged != raw
    data[entry.offset : entry.offset + entry.nbytes] = forged
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"checksum mismatch \(R50\)"):
        hf.from_pretrained(path)


def test_a_file_without_a_record_another_platform_or_another_owner_is_refused_clearly(tmp_path: Path) -> None:
    packs_only = tmp_path / "packs.pcache"
    with WeightCache(packs_only) as cache, cache.session() as session:
        session.get_or_pack("w", lambda: np.arange(4.0), key={"packer": "x", "version": 1})
    with pytest.raises(FormatError, match="holds no model record"):
        hf.from_pretrained(packs_only)
    path, _ = built_llama(tmp_path)
    # The same file with another platform fingerprint: refused naming the field, never rebuilt.
    other = tmp_path / "other.pcache"
    data = bytearray(path.read_bytes())
    header = fmt.decode_header(bytes(data[: fmt.HEADER_READ_SIZE]))
    platform = json.loads(header.platform)
    platform["torch"] = "0.0.1"
    fresh = fmt.canonical_key(platform)
    region = fmt.encode_header(header.alignment, fresh)
    data[:2048] = region[:2048]  # preamble and fingerprint; the slots stay
    other.write_bytes(bytes(data))
    before = sha256(other)
    with pytest.raises(ValueError, match=r"packed for another platform \(torch: file '0.0.1'"):
        hf.from_pretrained(other)
    assert sha256(other) == before
    os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(UntrustedFileError):
        hf.from_pretrained(path)


def test_a_session_refuses_an_embedded_entry_readers_would_reject(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "c.pcache") as cache, cache.session() as session:
        with pytest.raises(ValueError, match="R49"):
            session.get_or_pack("packcache.model", lambda: np.zeros(2, np.uint8), key={"kind": "packcache.model"})
        with pytest.raises(ValueError, match="R48"):
            session.get_or_pack("packcache.file/../x", lambda: np.zeros(2, np.uint8), key=None)
        key = fmt.embedded_key("file", b"abc")
        with pytest.raises(PackResultError, match="R50"):  # bytes other than the key names
            session.get_or_pack("packcache.file/a", lambda: np.frombuffer(b"abd", np.uint8).copy(),
                                key=json.loads(key))  # fmt: skip
        with pytest.raises(PackResultError, match="R47"):
            session.get_or_pack("packcache.file/b", lambda: np.zeros((1, 3), np.uint8), key=json.loads(key))
    assert not (tmp_path / "c.pcache").exists()  # nothing was stored, nothing committed


def test_record_requests_refuse_a_path_that_is_not_plain() -> None:
    from packcache.bundle import ModelRecord

    record = ModelRecord("hf", "int8", 32, "bert", "AutoModel", None, (), {}, {})
    with pytest.raises(ValueError, match="cannot embed"):
        record_requests(record, {"../config.json": b"{}"})
    with pytest.raises(ValueError, match="cannot embed"):
        record_requests(record, {"/etc/passwd": b"{}"})


def test_a_malformed_record_is_a_format_error_naming_the_member(tmp_path: Path) -> None:
    from packcache.bundle import ModelRecord

    good = ModelRecord("hf", "int8", 32, "bert", "AutoModel", None, ("sha256:" + "0" * 64 + ":8",),
                       {"w": ((2,), "F32", 0)}, {}).encode()  # fmt: skip
    assert ModelRecord.decode(good).tensors == {"w": ((2,), "F32", 0)}
    value = json.loads(good)
    for member, bad in [("version", 2), ("loader", "pickle"), ("tensors", [["w", [2], "F32", 5]]),
                        ("sources", ["md5:x"]), ("files", {"../x": "0" * 64}), ("group_size", -1)]:  # fmt: skip
        with pytest.raises(FormatError, match="model record"):
            ModelRecord.decode(json.dumps({**value, member: bad}).encode())
    with pytest.raises(FormatError):
        ModelRecord.decode(b"[" * 10000)


# --------------------------------------------------------------------------- a published name, no checkpoint


def _published(tmp_path: Path) -> tuple[Path, Path, dict[str, Path], torch.Tensor]:
    """A tiny Llama's cache file published under ``org/llama-int8`` to a directory store, signed; the checkpoint
    deleted. Returns the store, the file, the keys and the model's logits."""
    from harness.keys import make_keys
    from packcache.fleet.publish import publish

    keys = make_keys(tmp_path, "ci", "other")
    checkpoint = save_tiny("llama", tmp_path / "ckpt")
    path = tmp_path / "built" / "m.pcache"
    path.parent.mkdir()
    model = hf.from_pretrained(checkpoint, "int8", path, auto_class=CAUSAL)
    logits = outputs(model, ids_for())
    model.packcache.close()
    store = tmp_path / "store"
    store.mkdir()
    publish(path, str(store), private_key=str(keys["ci"]), sources=[str(checkpoint)], name="org/llama-int8")
    shutil.rmtree(checkpoint)
    return store, path, keys, logits


LOAD_NAME = """
import sys, torch
from packcache import hf
from packcache.errors import RemoteError
from test_hf import ids_for, outputs
try:
    model = hf.from_pretrained("org/llama-int8", remote=sys.argv[1], trusted_keys=[sys.argv[2]], allow_unsigned=False,
                               cache_dir=sys.argv[3])
except RemoteError as exc:
    report(error=exc.reason)
else:
    torch.save(outputs(model, ids_for()), sys.argv[4])
    fetch = model.packcache_fetch
    report(cls=type(model).__name__, state=model.packcache.stats().state, downloaded=fetch.downloaded,
           path=fetch.path, generation=fetch.generation)
"""


def test_a_published_name_loads_on_a_node_with_no_checkpoint(tmp_path: Path) -> None:
    store, _, keys, logits = _published(tmp_path)
    node = tmp_path / "node"
    argv = [str(store), str(keys["ci.pub"]), str(node), str(tmp_path / "out.pt")]
    first = run_child(LOAD_NAME, *argv)
    assert first.pop("records") == []
    assert first == {"cls": "LlamaForCausalLM", "state": "mapped", "downloaded": True, "generation": 1,
                     "path": str(node / "org--llama-int8.pcache")}  # fmt: skip
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits)
    second = run_child(LOAD_NAME, *argv)  # warm: the file there is the published one, nothing downloaded
    assert second["downloaded"] is False and second["state"] == "mapped"
    untrusted = run_child(LOAD_NAME, str(store), str(keys["other.pub"]), str(tmp_path / "node2"), "x")
    assert untrusted["error"] == "remote_untrusted" and not (tmp_path / "node2" / "org--llama-int8.pcache").exists()


def test_an_embedded_file_changed_in_the_store_is_remote_corrupt_and_nothing_is_loaded(tmp_path: Path) -> None:
    store, path, keys, _ = _published(tmp_path)
    (blob,) = (store / "blobs" / "sha256").iterdir()
    entry = _entry(path, "packcache.file/config.json")
    data = bytearray(blob.read_bytes())
    raw = bytes(data[entry.offset : entry.offset + entry.nbytes])
    forged = raw.replace(b'"llama"', b'"bert" ')
    data[entry.offset : entry.offset + entry.nbytes] = forged
    # Well-formed: the index and crc made for the forged bytes would still fail the sha256 the manifest names.
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    node = tmp_path / "node"
    result = run_child(LOAD_NAME, str(store), str(keys["ci.pub"]), str(node), "x")
    assert result["error"] == "remote_corrupt"
    assert not (node / "org--llama-int8.pcache").exists()


def test_the_cli_runs_a_published_name_and_a_local_path_is_never_a_name(tmp_path: Path) -> None:
    from harness.keys import make_keys
    from packcache.fleet.publish import publish

    keys = make_keys(tmp_path, "ci")
    path = tmp_path / "bert.pcache"
    minilm.load("int8", cache=path).close()
    store = tmp_path / "store"
    store.mkdir()
    publish(path, str(store), private_key=str(keys["ci"]), sources=[str(MINILM)], name="org/minilm")
    cli = [sys.executable, "-m", "packcache", "run"]
    node = tmp_path / "node"
    argv = [*cli, "--model", "org/minilm", "--remote", str(store), "--trusted-key", str(keys["ci.pub"])]
    done = subprocess.run([*argv, "--cache-dir", str(node), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["stats"]["state"] == "mapped" and data["cache_file"] == str(node / "org--minilm.pcache")
    done = subprocess.run([*cli, "--model", "org/minilm"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "give --remote URL" in done.stderr, done.stderr
    with pytest.raises(ValueError, match="is a local path: remote options are for a published name"):
        hf.from_pretrained(path, remote=str(store))


def test_a_json_bomb_in_an_embedded_file_is_a_format_error(tmp_path: Path) -> None:
    from packcache.bundle import ModelRecord

    checkpoint = save_tiny("llama", tmp_path / "ckpt")
    path = tmp_path / "m.pcache"
    hf.from_pretrained(checkpoint, "int8", path, auto_class=CAUSAL).packcache.close()
    with open_bundle(path) as bundle:
        record = bundle.record
        files = {name: bundle.read_file(name) for name in record.files}
    files["config.json"] = b"[" * 100_000 + b"]" * 100_000  # valid JSON, 100,000 levels deep
    record = ModelRecord(**{**record.__dict__, "files": {}})
    with WeightCache(path, platform=hf.platform("int8")) as cache, cache.session() as session:
        session.get_many(record_requests(record, files))
    with pytest.raises(FormatError, match=r"config\.json"):
        hf.from_pretrained(path)


def test_the_tokenizer_comes_from_the_file_alone(tmp_path: Path) -> None:
    import transformers

    checkpoint = shutil.copytree(MINILM, tmp_path / "minilm")
    path = tmp_path / "m.pcache"
    hf.from_pretrained(checkpoint, "int8", path).packcache.close()
    expected = transformers.AutoTokenizer.from_pretrained(checkpoint)(TEXTS).input_ids
    shutil.rmtree(checkpoint)
    code = """
import sys
from packcache import hf
from test_hf import TEXTS
report(ids=hf.tokenizer(sys.argv[1])(TEXTS).input_ids)
"""
    assert run_child(code, str(path))["ids"] == expected


# --------------------------------------------------------------------------- a file that holds every module


def _rewrite_record(path: Path, scheme: str, files: dict[str, bytes]) -> None:
    """Give the file at ``path`` a new model record listing exactly ``files`` (an older build's, or a forged one)."""
    from packcache.bundle import ModelRecord

    with open_bundle(path) as bundle:
        record = bundle.record
    with WeightCache(path, platform=hf.platform(scheme)) as cache, cache.session() as session:
        session.get_many(record_requests(ModelRecord(**{**record.__dict__, "files": {}}), files))


def test_a_module_whose_weights_are_pickle_is_refused_at_build_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sentence-transformers model whose Dense module keeps its weights in ``pytorch_model.bin`` (what
    ``save(safe_serialization=False)`` writes) built a file without them that passed ``build FILE``; no node could
    load it. The build refuses it now, naming the module and the file, before anything is packed or written."""
    from sentence_transformers import SentenceTransformer

    from harness.checkpoints import tiny_sentence_transformer
    from packcache.cli import main

    model = tiny_sentence_transformer(tmp_path / "st", "bert", dense=16)
    dense = SentenceTransformer(str(model), device="cpu", local_files_only=True)[2]
    (model / "2_Dense" / "model.safetensors").unlink()
    dense.save(str(model / "2_Dense"), safe_serialization=False)
    assert (model / "2_Dense" / "pytorch_model.bin").is_file()
    capsys.readouterr()
    path = tmp_path / "st.pcache"
    assert main(["build", str(model), "--scheme", "int8", "--cache", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "cannot make a self-contained cache file: module '2_Dense'" in err, err
    assert "needs 2_Dense/pytorch_model.bin, pickle" in err, err
    assert not path.exists()  # refused before anything was packed
    with pytest.raises(FormatError, match=r"module '2_Dense' \(sentence_transformers\..*Dense\) needs 2_Dense/pyto"):
        hf.sentence_transformer(model, "int8", tmp_path / "library.pcache")
    assert not (tmp_path / "library.pcache").exists()


def test_build_of_a_file_loads_every_module_its_record_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``build FILE`` loaded the Transformer alone, so a file lacking a Dense module's weights passed; loading it
    then failed naming a temporary directory that no longer existed. It loads the whole pipeline now, as a node
    with no checkpoint does, and a failure names the module and the file."""
    from harness.checkpoints import tiny_sentence_transformer
    from packcache.cli import main

    model = tiny_sentence_transformer(tmp_path / "st", "bert", dense=16)
    path = tmp_path / "st.pcache"
    hf.sentence_transformer(model, "int8", path).packcache.close()
    shutil.rmtree(model)
    capsys.readouterr()
    assert main(["build", str(path)]) == 0
    out = capsys.readouterr().out
    assert "from the file: sentence-transformers Transformer, Pooling, Dense, Normalize" in out, out
    with open_bundle(path) as bundle:  # the file an older build made: no Dense weights
        files = {name: bundle.read_file(name) for name in bundle.record.files}
    del files["2_Dense/model.safetensors"]
    _rewrite_record(path, "int8", files)
    assert main(["build", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"packcache build: cannot load the model the file holds: {path}: "), err
    assert "module '2_Dense'" in err and "packcache-st-" not in err and "Traceback" not in err, err
    with pytest.raises(FormatError, match=r"module '2_Dense' \(sentence_transformers\..*Dense\)") as caught:
        hf.sentence_transformer(path)
    assert "packcache-st-" not in str(caught.value) and str(path) in str(caught.value)


def test_a_record_listing_a_file_and_a_file_inside_it_is_refused_naming_both(tmp_path: Path) -> None:
    """A record listing ``x`` and ``x/config.json`` was accepted, and writing its files out raised a raw
    ``NotADirectoryError``; the record's check refuses it, naming both paths."""
    checkpoint = shutil.copytree(MINILM, tmp_path / "minilm")
    path = tmp_path / "m.pcache"
    hf.sentence_transformer(checkpoint, "int8", path).packcache.close()
    with open_bundle(path) as bundle:
        files = {name: bundle.read_file(name) for name in bundle.record.files}
    files["1_Pooling"] = b"{}"  # besides 1_Pooling/config.json
    _rewrite_record(path, "int8", files)
    both = r"files list both '1_Pooling' and '1_Pooling/config.json'"
    with pytest.raises(FormatError, match=both):
        open_bundle(path)
    with pytest.raises(FormatError, match=both):
        hf.sentence_transformer(path)


def test_run_of_a_causal_lm_says_run_is_for_embedding_models_and_names_serve(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run --model`` of an LLM's file said "hidden_act 'silu' is not supported" (the BERT encoder's refusal); the
    one causal-LM rule serve and build follow says what it is and what to use instead. A run that loads asks it
    without importing transformers (``run`` is the lean path)."""
    from packcache.cli import main

    code = """
import sys
from packcache.cli import main
report(code=main(["run", "--model", sys.argv[1], "--no-cache", "--json"]), imported="transformers" in sys.modules)
"""
    ran = run_child(code, str(base))
    assert (ran["code"], ran["imported"]) == (0, False), ran

    path, _ = built_llama(tmp_path)
    gpt2 = save_tiny("gpt2", tmp_path / "gpt2")  # GPT2LMHeadModel: a causal LM by transformers' mapping, no suffix
    for model in (str(path), str(gpt2)):
        capsys.readouterr()
        assert main(["run", "--model", model]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"packcache run: {model} is a causal LM, and run is for embedding models: generate with it through "
            f"packcache serve --model {model} (OpenAI chat and text completions)\n"
        ), err


def test_every_vocabulary_file_transformers_tokenizers_read_is_embedded() -> None:
    """A tokenizer whose vocabulary is a file packcache did not know (DeBERTa's ``spm.model``, ``bpe.codes``, ...)
    loaded from the directory and not from its cache file; every name transformers' tokenizers declare is embedded."""
    import importlib
    import pkgutil

    import transformers.models

    from packcache.bundle import MODEL_FILES, TOKENIZER_FILES

    declared: set[str] = set()
    for module in pkgutil.iter_modules(transformers.models.__path__):
        for name in (f"tokenization_{module.name}", f"tokenization_{module.name}_fast"):
            try:
                found = importlib.import_module(f"transformers.models.{module.name}.{name}")
            except Exception:  # no such tokenizer, or an optional package it needs is missing
                continue
            names = getattr(found, "VOCAB_FILES_NAMES", None)
            declared.update(v for v in (names or {}).values() if isinstance(v, str))
    assert "spm.model" in declared and len(declared) > 10, declared
    assert declared <= set(TOKENIZER_FILES) <= set(MODEL_FILES), sorted(declared - set(TOKENIZER_FILES))
