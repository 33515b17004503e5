"""The wheel ``python -m build`` makes carries everything: installed alone, with ``--no-deps``, into a scratch
directory, it runs the command line, loads its compiled kernels and embeds with the bundled model.

``bash scripts/test.sh`` builds the wheel once per run (from an sdist, so the sdist is proven too) and names it in
``PACKCACHE_TEST_WHEEL``; run alone, this module builds it once itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEEL_ENV = "PACKCACHE_TEST_WHEEL"

# Run with only the installed wheel's directory on PYTHONPATH (not the checkout's src/): numpy, torch, tokenizers and
# the bundled model come from the environment, packcache from the wheel.
CHILD = r"""
import json, os, sys
import packcache, packcache._kernels
from packcache import native
from packcache.models import minilm
model = minilm.load("int8", cache=sys.argv[1])
embeddings = model.embed(["a sentence", "another"])
print(json.dumps({
    "file": packcache.__file__, "kernels": packcache._kernels.__file__, "native": native.status().isa,
    "cpu": native.status().cpu, "native_library": native.status().library, "state": model.cache.stats().state,
    "shape": list(embeddings.shape),
    "typed": os.path.exists(os.path.join(os.path.dirname(packcache.__file__), "py.typed")),
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    given = os.environ.get(WHEEL_ENV)
    if given:
        path = Path(given)
        assert path.is_file() and path.suffix == ".whl", f"{WHEEL_ENV}={given!r} is not a wheel file"
        yield path
        return
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (path,) = out.glob("packcache-*.whl")
    yield path


def test_the_wheel_installs_alone_and_runs_its_cli_kernels_and_model(wheel: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "packcache/py.typed" in names and any(n.startswith("packcache/_kernels.") for n in names), names
    assert not any(n.startswith(("tests/", "csrc/")) for n in names)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target),
         str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    script = target / "bin" / "packcache"
    done = subprocess.run(
        [str(script), "platform", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["class"].startswith("pc1-")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "m.pcache")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(target)) and result["kernels"].startswith(str(target)), result
    assert result["typed"] and result["state"] == "stored" and result["shape"] == [2, 384]
    # The wheel's compiled kernels run: the best code this CPU has, loaded from the wheel.
    assert result["native"] == result["cpu"], result
    if result["cpu"] is not None:
        assert str(result["native_library"]).startswith(str(target)), result
