"""Progress bars from tqdm on long work: a cold build, a fetch, a publish (``packcache._progress``).

Real processes whose stderr is a pseudo-terminal, a pipe or a file: a bar on the terminal only, none with
``PACKCACHE_PROGRESS=0`` or ``TQDM_DISABLE=1``, none without tqdm, none for a load that ends within the delay.
The children set ``packcache._progress.DELAY`` to 0 where a bar must show, so a load faster than the real delay
on a fast machine still draws one; the real delay is what the warm-load test runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tqdm")
minilm = pytest.importorskip("packcache.models.minilm")

# A cold int8 build of the bundled all-MiniLM-L6-v2 (argv: cache file, delay, then "publish"/"fetch" stages that
# publish the file to a directory store and fetch it back). Each stage writes a marker line to stderr first, so the
# parent can tell whose bar it saw; stdout gets the pack counts as JSON.
CHILD = r"""
import json, os, sys
import packcache._progress as progress
progress.DELAY = float(sys.argv[2])
from packcache.models import minilm
from packcache.format import canonical_key
path, stages = sys.argv[1], sys.argv[3:]
told = []
sys.stderr.write("== build\n"); sys.stderr.flush()
model = minilm.load("int8", cache=path)
stats = model.cache.stats()
result = {"state": stats.state, "requests": stats.hits + stats.stored + stats.heap_packs,
          "total": minilm.pack_count("int8")}
model.close()
if "publish" in stages:
    from packcache.fleet.publish import publish
    store = os.path.join(os.path.dirname(path), "store")
    os.makedirs(store, exist_ok=True)
    sys.stderr.write("== publish\n"); sys.stderr.flush()
    result["uploaded"] = publish(path, store).uploaded
if "fetch" in stages:
    from packcache.fleet.fetch import fetch
    local = os.path.join(os.path.dirname(path), "fetched", os.path.basename(path))
    sys.stderr.write("== fetch\n"); sys.stderr.flush()
    result["downloaded"] = fetch(store, local, platform=canonical_key(minilm.platform("int8")),
                                 allow_unsigned=True).downloaded
sys.stderr.write("== end\n"); sys.stderr.flush()
print(json.dumps(result))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PACKCACHE_PROGRESS", "TQDM_DISABLE")}
    return {**env, "COLUMNS": "100", **extra}


def _run(
    argv: list[str], stderr: str, tmp_path: Path, env: dict[str, str], *, sized: bool = True
) -> tuple[dict[str, Any], str]:
    """Run ``argv`` with stderr on a pseudo-terminal (``"pty"``: 24 x 100, or one that reports no size), a pipe or
    a file; (its JSON result, its stderr)."""
    if stderr == "pty":
        leader, follower = pty.openpty()
        if sized:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, env=env, close_fds=True)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal's last descriptor
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(leader)
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        proc.stdout.close()
        assert proc.wait(300) == 0, b"".join(chunks).decode(errors="replace")
        return json.loads(out.strip().splitlines()[-1]), b"".join(chunks).decode(errors="replace")
    if stderr == "file":
        with open(tmp_path / "stderr.txt", "w+b") as sink:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=sink, env=env, timeout=300, check=False)
            sink.seek(0)
            err = sink.read().decode()
    else:
        done = subprocess.run(argv, capture_output=True, env=env, timeout=300, check=False)
        err = done.stderr.decode()
    assert done.returncode == 0, err
    return json.loads(done.stdout.decode().strip().splitlines()[-1]), err


def _stages(err: str) -> dict[str, str]:
    """What each stage wrote to stderr, by the child's marker lines."""
    parts: dict[str, str] = {}
    for piece in err.replace("\r\n", "\n").split("== ")[1:]:
        name, _, text = piece.partition("\n")
        parts[name.strip()] = text
    return parts


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
def test_a_cold_build_a_publish_and_a_fetch_draw_a_bar_on_a_terminal(tmp_path: Path, sized: bool) -> None:
    """On a terminal of any size: one that reports none (a pty nobody sized) gets an 80-column bar, not tqdm's
    nothing."""
    argv = [sys.executable, "-c", CHILD, str(tmp_path / "m.pcache"), "0", "publish", "fetch"]
    result, err = _run(argv, "pty", tmp_path, _env(), sized=sized)
    assert result["state"] == "stored" and result["uploaded"] and result["downloaded"]
    # The bar's total is pack_count, and the load asked for exactly that many entries.
    assert result["requests"] == result["total"]
    stages = _stages(err)
    assert set(stages) == {"build", "publish", "fetch", "end"}, err
    assert "packing int8" in stages["build"] and f"/{result['total']}" in stages["build"], stages["build"]
    size = f"/{os.path.getsize(tmp_path / 'm.pcache') / 2**20:.1f}M"  # bytes, scaled by 1024
    assert "publishing m.pcache" in stages["publish"] and size in stages["publish"], stages["publish"]
    assert "fetching m.pcache" in stages["fetch"] and size in stages["fetch"], stages["fetch"]
    assert all("B/s" in stages[s] for s in ("publish", "fetch"))
    assert stages["end"].strip() == "", "each bar is cleared when its work ends"


@pytest.mark.parametrize(
    ("stderr", "env", "stages"),
    [
        ("pipe", {}, ["publish", "fetch"]),
        ("file", {}, ["publish", "fetch"]),
        ("pty", {"PACKCACHE_PROGRESS": "0"}, ["publish", "fetch"]),
        ("pty", {"PACKCACHE_PROGRESS": "off"}, []),
        ("pty", {"TQDM_DISABLE": "1"}, []),
    ],
    ids=["pipe", "file", "switched-off", "switched-off-word", "tqdm-disable"],
)
def test_no_bar_off_a_terminal_or_with_the_switch_off(
    tmp_path: Path, stderr: str, env: dict[str, str], stages: list[str]
) -> None:
    argv = [sys.executable, "-c", CHILD, str(tmp_path / "m.pcache"), "0", *stages]
    result, err = _run(argv, stderr, tmp_path, _env(**env))
    assert result["state"] == "stored" and result.get("downloaded", True)
    assert {k: v.strip() for k, v in _stages(err).items()} == dict.fromkeys(["build", *stages, "end"], "")


def test_a_cold_hugging_face_load_draws_its_bar(tmp_path: Path) -> None:
    """``hf.from_pretrained`` draws the bar, its total ``hf.pack_count`` (``hf.sentence_transformer`` loads its
    Transformer module through the same ``hf._load``)."""
    pytest.importorskip("transformers")
    from harness.checkpoints import tiny_bert

    checkpoint = tiny_bert(tmp_path / "bert")
    code = (
        "import sys; import packcache._progress as p; p.DELAY = 0\n"
        "from packcache import hf\n"
        "sys.stderr.write('== from_pretrained\\n'); sys.stderr.flush()\n"
        "m = hf.from_pretrained(sys.argv[1], 'int8', cache=sys.argv[2])\n"
        "sys.stderr.write('== end\\n'); sys.stderr.flush()\n"
        "s = m.packcache.stats()\n"
        "print('{\"total\": %d, \"requests\": %d}' % (hf.pack_count(sys.argv[1], 'int8'), s.stored + s.hits))\n"
    )
    argv = [sys.executable, "-c", code, str(checkpoint), str(tmp_path / "a.pcache")]
    result, err = _run(argv, "pty", tmp_path, _env())
    stages = _stages(err)
    assert result["requests"] == result["total"]
    assert "packing int8:" in stages["from_pretrained"] and f"/{result['total']} [" in stages["from_pretrained"], err
    assert stages["end"].strip() == "", err


def test_no_bar_without_tqdm_and_the_load_is_the_same(tmp_path: Path) -> None:
    """tqdm is the extras' dependency, not the core's: without it the work runs and draws nothing."""
    hidden = "import sys; sys.modules['tqdm'] = None\n"  # `import tqdm` raises ImportError
    argv = [sys.executable, "-c", hidden + CHILD, str(tmp_path / "m.pcache"), "0"]
    result, err = _run(argv, "pty", tmp_path, _env())
    assert result["state"] == "stored" and result["requests"] == result["total"]
    assert {k: v.strip() for k, v in _stages(err).items()} == {"build": "", "end": ""}


def test_a_warm_load_within_the_delay_draws_nothing(tmp_path: Path) -> None:
    """The real delay (1 s): a load that maps its packs ends before it, so a terminal sees no bar."""
    path = str(tmp_path / "m.pcache")
    _run([sys.executable, "-c", CHILD, path, "0"], "pipe", tmp_path, _env())
    delay = str(pytest.importorskip("packcache._progress").DELAY)
    result, err = _run([sys.executable, "-c", CHILD, path, delay], "pty", tmp_path, _env())
    assert result["state"] == "mapped"
    assert {k: v.strip() for k, v in _stages(err).items()} == {"build": "", "end": ""}


def test_the_cli_draws_the_loaders_bar(tmp_path: Path) -> None:
    """``packcache build`` shows the bar its loader draws (the CLI has no bar of its own)."""
    code = (
        "import sys; import packcache._progress as p; p.DELAY = 0\n"
        "from packcache.cli import main\n"
        "code = main(sys.argv[1:]); sys.stderr.write('== end\\n'); print('{\"code\": %d}' % code); sys.exit(code)\n"
    )
    argv = [sys.executable, "-c", code, "build", "--loader", "minilm", "--scheme", "int8", "--cache-dir",
            str(tmp_path / "c"), "--json", str(minilm.default_model_path())]  # fmt: skip
    result, err = _run(argv, "pty", tmp_path, _env())
    assert result == {"code": 0}
    assert "packing int8" in err and err.split("== end")[1].strip() == "", err


def test_session_progress_counts_every_request_once(tmp_path: Path) -> None:
    """The hook the bars read: each answered request told once, whether it was stored, mapped or served from heap,
    through ``get_many``'s one pass or ``get_or_pack``."""
    import numpy as np

    import packcache

    told: list[int] = []
    requests = [(f"w{i}", lambda i=i: np.full(4, i, np.float32), {"v": 1}) for i in range(5)]
    for launch in ("cold", "warm"):
        told.clear()
        with packcache.WeightCache(tmp_path / "m.pcache") as cache, cache.session() as s:
            s.progress = told.append
            s.get_many(requests)
            s.get_or_pack("w0", requests[0][1], {"v": 1})  # held already: answered again, told again
            s.get_or_pack(None, lambda: np.zeros(2, np.float32))  # unnamed: heap
        assert sum(told) == 7, (launch, told)
    with packcache.WeightCache(None) as off, off.session() as s:
        told.clear()
        s.progress = told.append
        s.get_many(requests)
        assert sum(told) == 5
