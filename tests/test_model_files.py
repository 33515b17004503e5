"""Every file ``run --model DIR``, ``serve --model DIR`` and ``minilm.load(model_path=...)`` reads (issue 20, item 3).

``config.json``, ``sentence_bert_config.json``, ``tokenizer.json`` and ``model.safetensors`` are read without
blocking (a FIFO is refused at once), within a size cap, and every value the loader uses is checked: a malformed
one ends in one line naming the file and the field, never a traceback, and the sizes a config gives are checked
against the safetensors header before anything is built from them.

Real files, FIFOs and processes: the ``run`` cases go through ``packcache.cli.main`` in one child interpreter
(``harness.cli_child``: each case under an alarm, the child under a 3 GiB address-space limit, so an unbounded
allocation is a ``MemoryError`` there and never a swapping machine); a FIFO, which could block a child in a
place no signal reaches, gets a child of its own with a timeout; ``serve`` is a real gunicorn server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packcache
from harness.checkpoints import tiny_bert
from harness.cli_child import run_cli_cases
from packcache import FormatError, UntrustedFileError
from packcache.models import bert, minilm
from packcache.models.bert import BertConfig, BertEncoder

SRC = Path(packcache.__file__).resolve().parents[1]
CHILD_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("model") / "tiny", hidden=32)


def variant(base: Path, target: Path, edit: Callable[[Path], None]) -> Path:
    """A copy of ``base`` (the weights hard-linked) with ``edit`` applied to it."""
    target.mkdir(parents=True)
    for entry in base.iterdir():
        os.link(entry, target / entry.name)
    edit(target)
    return target


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        (directory / name).unlink(missing_ok=True)  # a hard link: never write through it into the base
        data = content.encode() if isinstance(content, str) else content
        (directory / name).write_bytes(data)

    return edit


def json_edit(name: str, change: Callable[[Any], Any]) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        data = change(json.loads((directory / name).read_text()))
        write(name, json.dumps(data))(directory)

    return edit


def config(**fields: Any) -> Callable[[Path], None]:
    return json_edit("config.json", lambda c: {**c, **fields})


def sentence_config(text: str) -> Callable[[Path], None]:
    return write("sentence_bert_config.json", text)


def sized(name: str, size: int) -> Callable[[Path], None]:
    """``name`` replaced by a sparse file of ``size`` bytes (a cap is checked before a byte is read)."""

    def edit(directory: Path) -> None:
        (directory / name).unlink()
        with open(directory / name, "wb") as f:
            f.truncate(size)

    return edit


def a_directory(name: str) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        (directory / name).unlink()
        (directory / name).mkdir()

    return edit


def fifo(name: str) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        (directory / name).unlink()
        os.mkfifo(directory / name)

    return edit


def tokenizer_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(data: Any) -> Any:
        change(data)
        return data

    return json_edit("tokenizer.json", apply)


def _extra_tokens(data: dict[str, Any]) -> None:
    data["model"]["vocab"].update({f"zzextra{i}": 30522 + i for i in range(3)})


def _far_id(data: dict[str, Any]) -> None:
    data["model"]["vocab"]["the"] = 99_999  # as many tokens as the config's vocab_size, one id past it


def _type_id(data: dict[str, Any]) -> None:
    for item in data["post_processor"]["single"]:
        next(iter(item.values()))["type_id"] = 5  # type_vocab_size is 2


#: name -> (edit, the file the one line must name, what else it must say). Each is a value the loader uses,
#: malformed in a way that once ended in a traceback, hung, allocated without bound, or loaded a wrong model.
CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "zero heads": (config(num_attention_heads=0), "config.json", "num_attention_heads"),
    "a string for a size": (config(hidden_size="32"), "config.json", "hidden_size"),
    "true for a count": (config(num_attention_heads=True), "config.json", "num_attention_heads"),
    "a float for a count": (config(num_hidden_layers=2.0), "config.json", "num_hidden_layers"),
    "a negative size": (config(intermediate_size=-1), "config.json", "intermediate_size"),
    "an absurd layer count": (config(num_hidden_layers=10_000_000), "config.json", "num_hidden_layers 10000000"),
    "a size past int64": (config(vocab_size=10**30), "config.json", "vocab_size"),
    "more positions than the weights": (
        config(max_position_embeddings=1 << 30),
        "config.json",
        "max_position_embeddings",
    ),
    "another width than the weights": (config(hidden_size=64, num_attention_heads=2), "config.json", "hidden_size 64"),
    "a string for eps": (config(layer_norm_eps="x"), "config.json", "layer_norm_eps"),
    "a zero eps": (config(layer_norm_eps=0), "config.json", "layer_norm_eps"),
    "eps past a float": (write("config.json", '{"layer_norm_eps": 1e400}'), "config.json", "1e400"),
    "NaN": (write("config.json", '{"layer_norm_eps": NaN}'), "config.json", "NaN"),
    "another activation": (config(hidden_act="relu"), "config.json", "hidden_act"),
    "relative positions": (config(position_embedding_type="relative_key"), "config.json", "position_embedding_type"),
    "a list for the config": (write("config.json", "[1, 2]"), "config.json", "not a JSON object"),
    "a number for model_type": (config(model_type=5), "config.json", "model_type"),
    "not JSON": (write("config.json", "{"), "config.json", "not UTF-8 JSON"),
    "a config past the cap": (sized("config.json", (16 << 20) + 1), "config.json", "cap"),
    "a directory for the config": (a_directory("config.json"), "config.json", "not a regular file"),
    "a list for the sentence config": (sentence_config("[]"), "sentence_bert_config.json", "not a JSON object"),
    "a negative max_seq_length": (
        sentence_config('{"max_seq_length": -1}'),
        "sentence_bert_config.json",
        "max_seq_length",
    ),
    "a string max_seq_length": (
        sentence_config('{"max_seq_length": "x"}'),
        "sentence_bert_config.json",
        "max_seq_length",
    ),
    "true for max_seq_length": (
        sentence_config('{"max_seq_length": true}'),
        "sentence_bert_config.json",
        "max_seq_length",
    ),
    "max_seq_length past a float": (sentence_config('{"max_seq_length": 1e400}'), "sentence_bert_config.json", "1e400"),
    "a huge max_seq_length": (
        sentence_config('{"max_seq_length": 1000000000000000000000}'),
        "sentence_bert_config.json",
        "max_seq_length",
    ),
    "a truncated tokenizer": (write("tokenizer.json", '{"version": '), "tokenizer.json", "tokenizers library"),
    "a list for the tokenizer": (write("tokenizer.json", "[]"), "tokenizer.json", "tokenizers library"),
    "a tokenizer not UTF-8": (write("tokenizer.json", b'{"\xff": 1}'), "tokenizer.json", "tokenizers library"),
    "a tokenizer past the cap": (sized("tokenizer.json", (64 << 20) + 1), "tokenizer.json", "cap"),
    "a directory for the tokenizer": (a_directory("tokenizer.json"), "tokenizer.json", "not a regular file"),
    "more tokens than the vocabulary": (tokenizer_edit(_extra_tokens), "tokenizer.json", "30525 tokens"),
    "a directory for the weights": (a_directory("model.safetensors"), "model.safetensors", "not a regular file"),
}

#: Tokenizers that load but give an id past an embedding table for some text: ``run`` says so in one line.
EMBED_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a token id past vocab_size": (tokenizer_edit(_far_id), "vocab_size 30522"),
    "a type id past type_vocab_size": (tokenizer_edit(_type_id), "type_vocab_size 2"),
}


def one_line(result: dict[str, Any], prefix: str) -> str:
    """The one line ``run`` printed, after checking it was the only thing on stderr and the exit code was 1."""
    assert result.get("rc") == 1, result
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), result["stderr"]
    assert "Traceback" not in result["stderr"]
    return str(lines[0])


def test_malformed_model_files_end_in_one_line_naming_the_file_and_the_field(base: Path, tmp_path: Path) -> None:
    cases: list[tuple[str, list[str]]] = []
    for name, (edit, _, _) in CASES.items():
        directory = variant(base, tmp_path / name.replace(" ", "-"), edit)
        # With the cache (its file named from config.json and the weights first) and without (the loader alone).
        cases.append((name, ["run", "--model", str(directory), "--cache-dir", str(tmp_path / "cache")]))
        cases.append((f"{name}, no cache", ["run", "--model", str(directory), "--no-cache", "--scheme", "fp32"]))
    results = run_cli_cases(cases)
    wrong = {}
    for case, result in results.items():
        name = case.removesuffix(", no cache")
        _, file, says = CASES[name]
        try:
            line = one_line(result, "packcache run: cannot load the model: ")
            assert f"/{file}" in line and says in line, line
        except AssertionError as exc:
            wrong[case] = str(exc)[:400]
    assert not wrong, json.dumps(wrong, indent=1)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*.pcache")), "nothing cached"


def test_a_tokenizer_giving_ids_past_the_tables_is_one_line_not_an_index_error(base: Path, tmp_path: Path) -> None:
    cases = []
    for name, (edit, _) in EMBED_CASES.items():
        directory = variant(base, tmp_path / name.replace(" ", "-"), edit)
        cases.append((name, ["run", "--model", str(directory), "--no-cache", "--scheme", "fp32", "--text", "the"]))
    results = run_cli_cases(cases)
    for name, (_, says) in EMBED_CASES.items():
        line = one_line(results[name], "packcache run: cannot embed: ")
        assert "tokenizer" in line and says in line, line


@pytest.mark.parametrize("name", ["config.json", "sentence_bert_config.json", "tokenizer.json", "model.safetensors"])
@pytest.mark.parametrize("cache", ["--cache-dir", "--no-cache"])
def test_a_fifo_in_the_model_directory_is_refused_at_once(base: Path, tmp_path: Path, name: str, cache: str) -> None:
    """A FIFO where a model file should be: ``run`` refuses it at once (in a child with a timeout: a regression
    blocks in ``open``, where only the timeout reaches it)."""
    directory = variant(base, tmp_path / "fifo", fifo(name))
    where = [cache, str(tmp_path / "cache")] if cache == "--cache-dir" else [cache]
    argv = ["run", "--model", str(directory), *where]
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "packcache", *argv], capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env
    )
    line = one_line({"rc": done.returncode, "stderr": done.stderr}, "packcache run: cannot load the model: ")
    assert f"/{name}" in line and "not a regular file (a FIFO)" in line, line


# ------------------------------------------------------------------------------------------- the library


def test_a_config_the_weights_do_not_match_is_refused_before_the_skeleton_is_built(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shape the config implies is looked up in the safetensors header first: a layer count or a size
    the weights do not have never reaches ``BertEncoder`` (nor ``pack_count``'s skeleton)."""

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the skeleton was built from a config the weights do not match")

    one_more = variant(base, tmp_path / "three", config(num_hidden_layers=3))
    monkeypatch.setattr(minilm, "BertEncoder", never)
    for call in (
        lambda: minilm.load("int8", cache=None, model_path=one_more),
        lambda: minilm.pack_count("int8", model_path=one_more),
        lambda: minilm.default_cache_path("int8", model_path=one_more),
    ):
        with pytest.raises(FormatError, match=r"config\.json: num_hidden_layers 3, hidden_size 32 call for "
                           r"encoder\.layer\.2\.attention\.self\.query\.weight .*no such tensor"):  # fmt: skip
            call()
    monkeypatch.undo()
    assert minilm.pack_count("int8", model_path=base) > 0


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


def test_library_errors_are_the_librarys_own(base: Path, tmp_path: Path) -> None:
    """What the CLI prints comes from ``packcache.errors`` (a FormatError is a ValueError, an UntrustedFileError
    an OSError): a caller catches them as documented."""
    bad = variant(base, tmp_path / "bad", config(num_attention_heads=0))
    with pytest.raises(FormatError, match=r"config\.json: num_attention_heads") as caught:
        minilm.load("int8", cache=None, model_path=bad)
    assert caught.value.path == str(bad / "config.json")
    planted = variant(base, tmp_path / "fifo", fifo("tokenizer.json"))
    with pytest.raises(UntrustedFileError, match=r"untrusted tokenizer .*tokenizer\.json: not a regular file"):
        minilm.load_tokenizer(planted)
    with pytest.raises(ValueError, match="max_seq_length must be a non-negative integer"):
        minilm.load_tokenizer(base, max_seq_length=-5)


def test_a_well_formed_checkpoint_still_loads_and_its_optional_file_may_be_missing(base: Path, tmp_path: Path) -> None:
    plain = variant(base, tmp_path / "plain", lambda d: (d / "sentence_bert_config.json").unlink())
    tokenizer = minilm.load_tokenizer(plain)
    assert tokenizer.truncation is not None and tokenizer.truncation["max_length"] == 512  # the position limit
    assert minilm.load_tokenizer(base).truncation["max_length"] == 256  # sentence_bert_config.json's
    model = minilm.load("fp32", cache=None, model_path=plain)
    assert model.embed(["the", ""]).shape == (2, 32)


# ------------------------------------------------------------------------------------------- serve


def serve_until_exit(argv: list[str], timeout: float = 90.0) -> tuple[int | None, str]:
    """Run ``packcache serve ARGV`` in its own session until it exits or ``timeout`` passes (then the whole group
    is killed: a worker stuck on a FIFO outlives its master); its exit code (None: it was still running) and stderr."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "packcache", "serve", "--port", "0", "--torch-threads", "1", *argv]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    code: int | None = None
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        err = "(still running)"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if code is None:
            err = (proc.communicate(timeout=10)[1] or "") + err  # reaps it and closes the pipe
    return code, err


@pytest.mark.parametrize(
    ("edit", "file", "says"),
    [
        (fifo("tokenizer.json"), "tokenizer.json", "not a regular file (a FIFO)"),
        (fifo("config.json"), "config.json", "not a regular file (a FIFO)"),
        (config(num_attention_heads=0), "config.json", "num_attention_heads"),
        (config(num_hidden_layers=10_000_000), "config.json", "num_hidden_layers 10000000"),
        (write("tokenizer.json", "[]"), "tokenizer.json", "tokenizers library"),
    ],
    ids=["fifo-tokenizer", "fifo-config", "zero-heads", "absurd-layers", "bad-tokenizer"],
)
@pytest.mark.parametrize("cache", ["--cache-dir", "--no-cache"])
def test_serve_refuses_a_bad_model_directory_in_one_line_before_any_worker_starts(
    base: Path, tmp_path: Path, edit: Callable[[Path], None], file: str, says: str, cache: str
) -> None:
    directory = variant(base, tmp_path / "model", edit)
    where = [cache, str(tmp_path / "cache")] if cache == "--cache-dir" else [cache]
    code, err = serve_until_exit(["--model", str(directory), "--workers", "2", *where])
    assert code == 1, f"serve did not stop with exit 1 (exit {code}): {err[-2000:]}"
    assert err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("packcache serve: cannot load the model: ") and f"/{file}" in err and says in err, err


def test_a_worker_booting_with_a_fifo_in_the_model_directory_stops_the_server_instead_of_hanging(
    base: Path, tmp_path: Path
) -> None:
    """The master checked the directory at start; a FIFO planted before a rolling restart (SIGHUP) reaches the
    new workers themselves. Each refuses it at once (gunicorn then stops the server: a worker that cannot load
    its model is a boot failure, exit 1); none waits on it until the worker timeout, to be replaced and wait again."""
    directory = variant(base, tmp_path / "model", lambda d: None)
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "packcache", "serve", "--port", "0", "--torch-threads", "1", "--workers", "2",
            "--no-cache", "--scheme", "fp32", "--model", str(directory), "--timeout", "60"]  # fmt: skip
    err_path = tmp_path / "serve.err"
    with open(tmp_path / "serve.out", "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "listening on" not in (tmp_path / "serve.out").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
            time.sleep(0.1)
        fifo("tokenizer.json")(directory)
        os.kill(proc.pid, signal.SIGHUP)
        try:
            code = proc.wait(45)  # well under the 60 s worker timeout that would kill a hung worker
        except subprocess.TimeoutExpired:
            code = None
        log = err_path.read_text()
        assert code == 1, f"the server did not stop (exit {code}): {log[-3000:]}"
        assert "tokenizer.json: not a regular file (a FIFO)" in log, log[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
