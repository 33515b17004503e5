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
