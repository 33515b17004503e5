"""``packcache serve --model`` on any sentence-transformers model, run the way it is deployed: real
``packcache serve`` processes (``harness.serve``) on tiny random XLM-R, MPNet and BERT models made here,
answering what ``SentenceTransformer(dir).encode`` answers; a cache file alone as the model, served exactly as its
directory; a plain transformers checkpoint (mean pooling); the sentence-transformers baseline on the same models;
the line each worker logs when ready; a bad checkpoint refused by the master in one line, before any worker boots;
which models are causal LMs (``server.modelfiles``' one rule) and GPT-2 served as one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.checkpoints import tiny_sentence_transformer, tiny_transformer
from harness.serve import TEXTS, call, loaded_workers, server
from test_cli import serve_until_exit

#: Short and empty texts, and one past the tiny models' max_seq_length (64): truncated as encode truncates.
SERVED = [*TEXTS, "the river city light market " * 60]
#: Cosine to sentence-transformers' float32 embedding that the int8 scheme keeps on these models (measured:
#: >= 0.99997 on each; int4 and bf16 are checked in process by tests/test_server_engines.py).
INT8_COSINE = 0.9995
READY = re.compile(
    r"packcache serve: worker (\d+) ready: model (\S+), engine (\S+)(?: (\S+))?, cache (\S+)(?: (\S+))?, "
    r"source (\S+)(?: \((.*)\))?, loaded in (\d+\.\d\d) s$"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {
        "xlm-roberta": tiny_sentence_transformer(
            base / "xlmr", "xlm-roberta", prompts={"query": "query: "}, default_prompt_name="query"
        ),
        "mpnet": tiny_sentence_transformer(base / "mpnet", "mpnet", pooling="cls", normalize=False),
        "bert-dense": tiny_sentence_transformer(base / "bert", "bert", dense=16),
        "plain": tiny_transformer(base / "plain", "xlm-roberta"),
    }


def _expected(directory: Path, texts: list[str]) -> np.ndarray[Any, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    # every route applies the model's default prompt, as encode() does (XLM-R's "query: ")
    return np.asarray(model.encode(texts, convert_to_numpy=True), dtype=np.float64)


def _served(srv: Any, texts: list[str]) -> np.ndarray[Any, Any]:
    status, (_, body) = call(srv, "POST", "/embed", json.dumps({"texts": texts}).encode())
    assert status == 200, (status, body[:300])
    return np.asarray(json.loads(body)["embeddings"], dtype=np.float64)


def _cosines(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    result: np.ndarray[Any, Any] = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return result


def _ready_lines(srv: Any) -> dict[int, re.Match[str]]:
    found: dict[int, re.Match[str]] = {}
    for line in srv.err.read_text().splitlines():
        if " ready: " in line:
            match = READY.search(line)
            assert match is not None, line
            pid = int(match.group(1))
            assert pid not in found, f"worker {pid} logged two ready lines"
            assert "[INFO]" in line, line  # gunicorn's error log, as the server's other lines
            found[pid] = match
    return found


def test_each_worker_logs_one_ready_line_naming_where_its_weights_came_from(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Two workers on a cold cache: one packs and stores, the other waits and maps; each says so in one line,
    and both serve what sentence-transformers encodes (XLM-R, mean pooling, Normalize, a default prompt)."""
    from packcache import hf

    directory, cache_dir = models["xlm-roberta"], tmp_path / "cache"
    with server(tmp_path, "--model", str(directory), "--cache-dir", str(cache_dir), workers=2) as srv:
        scrape = loaded_workers(srv, 2)
        path = hf.default_cache_path(directory, "int8", cache_dir=cache_dir)  # named by content, as build names it
        for w in scrape.workers.values():
            assert w.info == {"engine": "packcache", "scheme": "int8", "kernel_path": w.info["kernel_path"],
                              "cache_file": str(path)}  # fmt: skip
        lines = _ready_lines(srv)
        assert set(lines) == set(scrape.workers), (lines, srv.log())
        sources = sorted((m.group(5), m.group(7)) for m in lines.values())
        assert sources == [("mapped", "mapped"), ("stored", "stored")], sources
        for pid, match in lines.items():
            assert match.group(2) == "xlmr" and match.group(3, 4) == ("packcache", "int8")
            assert match.group(6) == str(path) and match.group(8) is None
            assert float(match.group(9)) == pytest.approx(scrape.workers[pid].values["load_seconds"], abs=0.006)
        got = _served(srv, SERVED)
    expected = _expected(directory, SERVED)
    assert got.shape == expected.shape == (len(SERVED), 32)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(got, expected).min() >= INT8_COSINE


def test_mpnet_with_cls_pooling_and_no_normalize_serves_what_sentence_transformers_encodes(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The route's rows are unit length: the model's own output (not unit length), normalised."""
    directory = models["mpnet"]
    with server(tmp_path, "--model", str(directory), "--cache-dir", str(tmp_path / "cache"), workers=1) as srv:
        got = _served(srv, SERVED)
        ((_, match),) = _ready_lines(srv).items()
        assert match.group(7) == "stored" and match.group(3) == "packcache"
    expected = _expected(directory, SERVED)
    assert got.shape == expected.shape
    assert _cosines(got, expected).min() >= INT8_COSINE


def test_a_cache_file_alone_serves_the_model_and_its_workers_map_it(models: dict[str, Path], tmp_path: Path) -> None:
    """The file a load with a cache built holds every module's configuration, the tokenizer and the packs: served
    with no checkpoint anywhere, read-only: the worker maps it."""
    from packcache import hf

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(models["xlm-roberta"], checkpoint)
    expected = _expected(checkpoint, SERVED)
    file = tmp_path / "files" / "xlmr-int8.pcache"
    hf.sentence_transformer(checkpoint, "int8", file).packcache.close()
    shutil.rmtree(checkpoint)
    with server(tmp_path, "--model", str(file), "--scheme", "auto", workers=1) as srv:
        scrape = loaded_workers(srv, 1)
        assert {w.info["cache_file"] for w in scrape.workers.values()} == {str(file)}
        lines = _ready_lines(srv)
        assert set(lines) == set(scrape.workers)
        assert {m.group(7) for m in lines.values()} == {"mapped"} and {m.group(2) for m in lines.values()} == {
            "xlmr-int8"
        }
        got = _served(srv, SERVED)
    assert _cosines(got, expected).min() >= INT8_COSINE


def test_a_plain_transformers_checkpoint_serves_mean_pooling(models: dict[str, Path], tmp_path: Path) -> None:
    """No modules.json: sentence-transformers gives it mean pooling, and so does serve. Caching off: the ready line
    says the weights are on the heap, and why."""
    directory = models["plain"]
    with server(tmp_path, "--model", str(directory), "--no-cache", "--served-model-name", "my-xlmr", workers=1) as srv:
        got = _served(srv, SERVED)
        ((_, match),) = _ready_lines(srv).items()
        assert match.group(2) == "my-xlmr" and match.group(5) == "off" and match.group(6) is None
        assert match.group(7, 8) == ("heap", "caching off")
    expected = _expected(directory, SERVED)
    assert _cosines(got, expected).min() >= INT8_COSINE


def test_the_sentence_transformers_baseline_loads_the_same_models(models: dict[str, Path], tmp_path: Path) -> None:
    """BERT with a Dense module: not MiniLM's shape, so the packcache engine takes packcache.hf; the baseline loads
    it unpacked, float32, and says its weights are on the heap."""
    directory = models["bert-dense"]
    with server(tmp_path, "--model", str(directory), "--engine", "sentence-transformers", workers=1) as srv:
        got = _served(srv, SERVED)
        ((_, match),) = _ready_lines(srv).items()
        assert match.group(3, 4, 5) == ("sentence-transformers", "fp32", "none") and match.group(7) == "heap"
    np.testing.assert_allclose(got, _expected(directory, SERVED), atol=2e-5)


def test_a_bad_checkpoint_is_refused_by_the_master_in_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    """Checked in the master before any worker is forked (no weight read): one line, exit 1, no worker booted."""
    broken = tmp_path / "broken"
    shutil.copytree(models["xlm-roberta"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))  # the checkpoint holds 2
    modules = tmp_path / "modules"
    shutil.copytree(models["mpnet"], modules)
    (modules / "modules.json").write_text('{"not": "a list"}')
    import torch
    import transformers

    from packcache import hf

    gpt2 = tmp_path / "gpt2"  # a causal LM whose file was built with AutoModel: it cannot generate
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    ).save_pretrained(gpt2)
    file = tmp_path / "gpt2-base.pcache"
    hf.from_pretrained(gpt2, "int8", file).packcache.close()
    for argv, says in (
        (["--model", str(broken)], "lacks"),
        (["--model", str(modules)], "modules.json: not a JSON list of modules"),
        (["--model", str(file)], "holds a causal LM (GPT2LMHeadModel) built with AutoModel, so it cannot generate"),
        (["--model", str(file), "--engine", "sentence-transformers"], "loads a checkpoint directory"),
    ):
        code, err = serve_until_exit([*argv, "--workers", "2", "--cache-dir", str(tmp_path / "cache")])
        assert code == 1, f"serve did not stop with exit 1 (exit {code}): {err[-2000:]}"
        assert err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
        assert err.startswith("packcache serve: cannot load the model: ") and says in err, err


def test_a_hub_id_serves_from_the_local_hub_cache_under_its_own_name(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model org/name`` is read from the local hub cache (``HF_HUB_CACHE``; refs/main -> the snapshot), offline,
    and served under the id as given; the OpenAI route applies the model's default prompt as ``encode`` does. A hub
    id that is not there is one line in the master, naming where it looked."""
    from harness.checkpoints import hub_snapshot

    hub = tmp_path / "hub"
    hub_snapshot(hub, "org/xlmr", models["xlm-roberta"])
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # packcache reads the cache itself: the hub client never runs
    texts = [t for t in TEXTS if t]  # within the context length: the OpenAI route refuses longer ones
    with server(tmp_path, "--model", "org/xlmr", "--cache-dir", str(tmp_path / "cache"), workers=1) as srv:
        status, (_, body) = call(srv, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["org/xlmr"], body
        request = json.dumps({"input": texts, "model": "org/xlmr"}).encode()
        status, (_, body) = call(srv, "POST", "/v1/embeddings", request)
        assert status == 200, body[:300]
        answer = json.loads(body)
        assert answer["model"] == "org/xlmr"
        got = np.asarray([row["embedding"] for row in answer["data"]], dtype=np.float64)
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(models["xlm-roberta"]), device="cpu", local_files_only=True)
    expected = np.asarray(reference.encode(texts, convert_to_numpy=True), dtype=np.float64)  # the default prompt
    assert _cosines(got, expected).min() >= INT8_COSINE
    code, err = serve_until_exit(["--model", "org/absent", "--workers", "1", "--cache-dir", str(tmp_path / "cache")])
    assert code is not None and code != 0 and "Traceback" not in err, err[-2000:]
    assert err.count("\n") == 1 and str(hub) in err, err


# --------------------------------------------------------- a file serves exactly what its directory serves


@pytest.fixture(scope="module")
def plain_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain BERT checkpoint (no ``modules.json``, no ``sentence_bert_config.json``) whose tokenizer truncates at
    64 tokens (``tokenizer_config.json``)."""
    directory = tiny_transformer(tmp_path_factory.mktemp("plain-bert") / "bert", "bert")
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 64}))
    return directory


@pytest.mark.parametrize("hidden_act", ["gelu", "relu"])
def test_a_plain_bert_file_serves_what_its_directory_serves(plain_bert: Path, tmp_path: Path, hidden_act: str) -> None:
    """A plain BERT's cache file went to the MiniLM loader without the checks its directory took: with
    ``model_max_length`` 64 the file truncated at 512 and the directory at 64 (cosine 0.849 on a 300-token text),
    and with ``hidden_act: relu`` the file's server did not start. One rule reads the same files from the directory
    or from the file, so both are served alike: the same bits for every text, the long one cut at 64 tokens."""
    from packcache.cli import main
    from packcache.server.modelfiles import choose_loader

    directory = shutil.copytree(plain_bert, tmp_path / "bert")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_act": hidden_act}))
    file = tmp_path / "files" / "bert.pcache"
    assert main(["build", str(directory), "--scheme", "int8", "--cache", str(file)]) == 0
    assert choose_loader(str(file)) == choose_loader(str(directory)) == "hf"
    served = {}
    for name, model in (("dir", directory), ("file", file)):
        args = ("--model", str(model), "--scheme", "int8", "--cache-dir", str(tmp_path / "cache"))
        with server(tmp_path / name, *args, workers=1) as srv:
            served[name] = _served(srv, SERVED)
    assert np.array_equal(served["dir"], served["file"])
    expected = _expected(directory, SERVED)  # sentence-transformers truncates the long text at 64
    assert _cosines(served["file"], expected).min() >= INT8_COSINE


# --------------------------------------------------------- one rule decides what a causal LM is

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}


@pytest.mark.parametrize(
    ("config", "causal"),
    [
        (GPT2, True),  # a causal LM whose class does not end in ForCausalLM
        ({"model_type": "gpt2"}, True),  # no architectures: a decoder family
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, True),
        ({"model_type": "llama", "architectures": ["LlamaModel"]}, False),  # a base model has no head to generate
        ({"model_type": "bert", "architectures": ["BertModel"]}, False),  # bert's causal class is BertLMHeadModel
        ({"model_type": "bert"}, False),  # an encoder family, not made a decoder
        ({"model_type": "bert", "is_decoder": True}, True),
        ({"model_type": "bert", "architectures": ["BertLMHeadModel"], "is_decoder": True}, True),
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, False),
        ({"model_type": "roberta", "architectures": ["RobertaForCausalLM"], "is_decoder": True}, True),
        ({"model_type": "mpnet"}, False),  # no causal-LM class at all
        ({"model_type": "gpt2", "architectures": "GPT2LMHeadModel"}, True),  # not a list: read as naming none
        ({"architectures": ["GPT2LMHeadModel"]}, False),  # no model type: nothing to look up
    ],
)
def test_one_rule_tells_a_causal_lm_by_transformers_causal_lm_mapping(
    tmp_path: Path, config: dict[str, Any], causal: bool
) -> None:
    """``serve`` told a causal LM by an architecture ending in ``ForCausalLM``, so GPT-2 (``GPT2LMHeadModel``) was
    served as an embedding model; build, run, serve and fetch now ask one rule, transformers' own mapping."""
    from packcache.server.modelfiles import causal_lm_class, choose_loader

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (causal_lm_class(config) is not None) is causal
    assert (choose_loader(str(tmp_path)) == "causal") is causal
    (tmp_path / "modules.json").write_text("[]")  # a sentence-transformers save embeds, whatever its backbone
    assert choose_loader(str(tmp_path)) != "causal"



def test_the_causal_lm_rule_reads_the_tables_transformers_itself_holds() -> None:
    """The rule reads transformers' two tables as data from its ``modeling_auto.py`` (importing it cost 1.6-4 s at
    every ``serve`` start of a plain checkpoint): they are exactly the tables transformers' own module holds."""
    import transformers.models.auto.modeling_auto as auto

    from packcache.server.modelfiles import _auto_tables

    tables = _auto_tables()
    assert tables is not None
    causal, masked = tables
    assert causal == dict(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and len(causal) > 100
    assert masked == frozenset(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) and "bert" in masked

def _tiny_gpt2(directory: Path) -> Path:
    """A tiny random ``GPT2LMHeadModel`` with :func:`harness.checkpoints.tiny_causal_lm`'s tokenizer."""
    import torch
    import transformers

    from harness.checkpoints import tiny_causal_lm

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_causal_lm(directory.with_name("llama")))
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=2,
        pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_gpt2_is_served_as_a_causal_lm(tmp_path: Path) -> None:
    """GPT-2 was served as an embedding model (its class does not end in ForCausalLM); it generates now, the tokens
    ``generate`` gives greedily."""
    import torch
    import transformers

    directory = _tiny_gpt2(tmp_path / "gpt2")
    reference = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(directory)("the river city", return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = reference.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=1)
    tokens = greedy[0, ids.shape[1] :]
    expected = transformers.AutoTokenizer.from_pretrained(directory).decode(tokens, skip_special_tokens=True)
    assert expected, "the tiny model's greedy text is empty: the test would prove nothing"
    args = ("--model", str(directory), "--scheme", "fp32", "--cache-dir", str(tmp_path / "cache"))
    with server(tmp_path / "srv", *args, workers=1) as srv:
        request = {"prompt": ids[0].tolist(), "max_tokens": 8, "temperature": 0}
        status, (_, body) = call(srv, "POST", "/v1/completions", json.dumps(request).encode())
        assert status == 200, body[:500]
        status, _ = call(srv, "POST", "/embed", json.dumps({"texts": ["x"]}).encode())
        assert status == 404  # no embedding route: it is not served as an embedding model
    answer = json.loads(body)
    assert answer["choices"][0]["text"] == expected and answer["usage"]["completion_tokens"] == len(tokens)
