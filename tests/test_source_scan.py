"""The whole source tree, read as text (like test_architecture.py): no module of the package unpickles or
evaluates anything (DESIGN.md "Processes, threads, trust": no pickle, no eval, anywhere).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "packcache"


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "copyreg"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_ATTRIBUTES = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load")}


def forbidden_uses(source: str, filename: str) -> list[str]:
    """Every way the code could unpickle or evaluate something: imports, calls, attributes, keyword flags.

    Works on the syntax tree, so a docstring saying "no pickle" is not a hit
    and ``module.eval()`` (torch's train/eval switch) is not Python's ``eval``.
    """
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_CALLS | FORBIDDEN_MODULES:
            found.append(f"{where}: {node.id}")
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) in FORBIDDEN_ATTRIBUTES or node.attr in {"read_pickle", "unsafe_load"}:
                found.append(f"{where}: {owner}.{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{where}: allow_pickle not False")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and str(arg.value).startswith("packcache.")):
                found.append(f"{where}: import_module of something other than a packcache module")
    return found


def test_no_module_of_the_package_unpickles_or_evaluates_anything() -> None:
    """Every .py under src/packcache, subpackages included (torch adapters, models, telemetry)."""
    files = sorted(SRC.rglob("*.py"))
    assert len(files) >= 10, files
    found = [hit for f in files for hit in forbidden_uses(f.read_text(encoding="utf-8"), str(f.relative_to(SRC)))]
    assert found == []


@pytest.mark.parametrize(
    "code",
    [
        "import pickle",
        "from pickle import loads",
        "import marshal as m",
        "import shelve",
        "x = eval('1')",
        "exec('x = 1')",
        "import torch\ntorch.load('w.pt')",
        "import yaml\nyaml.load(s)",
        "import numpy as np\nnp.load('a.npy', allow_pickle=True)",
        "import importlib\nimportlib.import_module('pickle')",
        "f = __import__('pickle')",
    ],
)
def test_forbidden_use_scanner_catches(code: str) -> None:
    assert forbidden_uses(code, "sample.py"), code


@pytest.mark.parametrize(
    "code",
    [
        '"""Read safetensors without pickle."""',
        "encoder.eval()",
        "import importlib\nimportlib.import_module('packcache.models.minilm')",
        "np.load('a.npy', allow_pickle=False)",
    ],
)
def test_forbidden_use_scanner_allows(code: str) -> None:
    assert forbidden_uses(code, "sample.py") == [], code
