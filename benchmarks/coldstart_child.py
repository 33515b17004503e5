"""One launch of ``benchmarks/coldstart.py`` on the "fresh machine": load a model from the store, first output.

Run as ``python benchmarks/coldstart_child.py SPEC_JSON``. The store is reached only through the
environment the parent gives (``AWS_ENDPOINT_URL`` and the keys: the throttling proxy or the server).
Prints ``FIRST`` the moment the first embedding or token exists, then one JSON line of figures; a
packcache row whose interface is missing prints ``NOTAVAILABLE <exception>`` and exits 3.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()
STARTED_WALL = time.time()

import concurrent.futures  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PART = 32 * 2**20  # one range read of a large object
STREAMS = 8  # range reads at once


def _store(spec: dict[str, Any]) -> Any:
    from obstore.store import from_url

    return from_url(f"s3://{spec['bucket']}", client_options={"allow_http": True})


def download(spec: dict[str, Any], keys: list[str], target: Path) -> int:
    """obstore: every key under ``spec['prefix']`` into ``target``; a large object by concurrent range
    reads written in place (``pwrite``), the fastest a user gets from obstore; returns bytes moved."""
    import obstore

    store = _store(spec)
    target.mkdir(parents=True, exist_ok=True)
    moved = 0
    jobs: list[tuple[str, int, int, int]] = []  # key, fd, start, end
    fds = []
    for key in keys:
        path = target / key[len(spec["prefix"]) + 1 :]
        path.parent.mkdir(parents=True, exist_ok=True)
        size = obstore.head(store, key)["size"]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fds.append(fd)
        os.ftruncate(fd, size)
        jobs += [(key, fd, start, min(size, start + PART)) for start in range(0, size, PART)]
        moved += size

    def one(job: tuple[str, int, int, int]) -> None:
        key, fd, start, end = job
        data = obstore.get_range(store, key, start=start, end=end)
        os.pwrite(fd, memoryview(data), start)

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(one, jobs))
    for fd in fds:
        os.close(fd)
    return moved


def first_token(model: Any, ids: Any) -> int:
    import torch

    with torch.inference_mode():
        logits = model(ids).logits
    return int(logits[0, -1].argmax())


def tokenize(directory: Path, prompt: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))(prompt, return_tensors="pt").input_ids


def skeleton(directory: Path, dtype: Any) -> Any:
    """The model from its config alone, parameters allocated but not initialised (what a loader that
    brings its own weights does)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(directory))
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    row, work = spec["row"], Path(spec["work"])
    marks: dict[str, float] = {"imports": time.perf_counter() - STARTED}
    out: dict[str, Any] = {}
    if row in ("hf-bf16", "hf-fp32"):
        out["moved"] = download(spec, spec["keys"], work / "model")
        marks["download"] = time.perf_counter() - STARTED
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if row == "hf-bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=dtype)
        marks["load"] = time.perf_counter() - STARTED
        out["token"] = first_token(model, tokenize(work / "model", spec["prompt"]))
    elif row == "st":
        out["moved"] = download(spec, spec["keys"], work / "model")
        marks["download"] = time.perf_counter() - STARTED
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(work / "model"), device="cpu")
        marks["load"] = time.perf_counter() - STARTED
        out["dim"] = int(st.encode([spec["sentence"]]).shape[-1])
    elif row == "runai":
        out["moved"] = download(spec, spec["keys"], work / "model")  # config, tokenizer: small files
        from runai_model_streamer import SafetensorsStreamer  # type: ignore[import-untyped]

        state = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([f"s3://{spec['bucket']}/{k}" for k in spec["stream_keys"]])
            for name, tensor in streamer.get_tensors():
                state[name] = tensor
        marks["download"] = time.perf_counter() - STARTED
        model = skeleton(work / "model", torch.bfloat16)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"runai state dict: missing {missing}, unexpected {unexpected}")
        marks["load"] = time.perf_counter() - STARTED
        out["token"] = first_token(model, tokenize(work / "model", spec["prompt"]))
    elif row == "tensorizer":
        out["moved"] = download(spec, spec["keys"], work / "model")
        from tensorizer import TensorDeserializer, stream_io  # type: ignore[import-untyped]
        from tensorizer.utils import no_init_or_tensor  # type: ignore[import-untyped]
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(work / "model"))
        auto: Any = AutoModelForCausalLM
        model = no_init_or_tensor(lambda: auto.from_config(config, dtype=torch.bfloat16))
        stream = stream_io.open_stream(
            spec["tensorizer_uri"],
            "rb",
            s3_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            s3_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            s3_endpoint=os.environ["AWS_ENDPOINT_URL"],
            force_http=True,
        )
        deserializer = TensorDeserializer(stream, device="cpu")
        deserializer.load_into_module(model)
        deserializer.close()
        marks["download"] = marks["load"] = time.perf_counter() - STARTED
        out["token"] = first_token(model, tokenize(work / "model", spec["prompt"]))
    elif row == "packcache":
        out.update(packcache_row(spec, marks))
    else:
        raise SystemExit(f"unknown row {row!r}")
    marks["first"] = time.perf_counter() - STARTED
    print("FIRST", flush=True)
    out["marks"] = marks
    out["started_wall"] = STARTED_WALL
    out["rss_kb"] = peak_rss_kib()
    return out


def peak_rss_kib() -> int:
    """Its own peak resident set (``VmHWM``); ``ru_maxrss`` would carry the launcher's over ``execve``. As
    ``benchmarks/core.py``'s, which this child does not import (its imports are timed)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def packcache_row(spec: dict[str, Any], marks: dict[str, float]) -> dict[str, Any]:
    """The issue-32 node side: a published name, a store, a trusted key, an empty cache directory.
    Any exception before the model exists means the installed packcache cannot do this yet."""
    import torch

    out: dict[str, Any] = {}
    try:
        from packcache import hf as hf_module

        hf: Any = hf_module  # the issue-32 interface, not on main yet
        common = {"remote": spec["remote"], "trusted_keys": [spec["pub"]], "cache_dir": spec["cache_dir"]}
        if spec["model"] == "minilm":
            model = hf.sentence_transformer(spec["name"], allow_unsigned=False, **common)
        else:
            model = hf.from_pretrained(spec["name"], allow_unsigned=False, auto_class="AutoModelForCausalLM", **common)
    except Exception as exc:
        print(f"NOTAVAILABLE {type(exc).__name__}: {exc}".replace("\n", " ")[:600], flush=True)
        raise SystemExit(3) from None
    marks["load"] = time.perf_counter() - STARTED
    if spec["model"] == "minilm":
        out["dim"] = int(model.encode([spec["sentence"]]).shape[-1])
    else:
        tokenizer = getattr(hf, "tokenizer", None)
        if tokenizer is not None:  # from the file the load fetched: no second manifest read
            ids = tokenizer(model.packcache_fetch.path)(spec["prompt"], return_tensors="pt").input_ids
        else:  # no tokenizer call in packcache.hf yet: the ids the peers' tokenizer gives
            ids = torch.tensor([spec["ids"]])
            out["ids_given"] = True
        out["token"] = first_token(model, ids)
    return out


if __name__ == "__main__":
    figures = run(json.loads(sys.argv[1]))
    print(json.dumps(figures), flush=True)
