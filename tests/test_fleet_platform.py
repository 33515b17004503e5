"""Platform classes: ``packcache platform`` is the same wherever a machine would pack alike.

Each run is a real ``python -m packcache platform --scheme int4 --json`` process: from other working
directories, as root and as ``nobody`` with another HOME, under another hostname (a new UTS namespace),
with the variables a launcher or a fleet sets (ranks, cache and digest directories, kernel path, TMPDIR).
Its stdout must be byte-identical; another scheme, group size, CPU capability or packer version must
change the class and name the field.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import require_root
from packcache import format as fmt
from packcache import packers_torch
from packcache.cli import main
from packcache.fleet.platform import Difference, differences, platform_class, platform_fields
from packcache.models import minilm

NOBODY = 65534
VARIED = (
    "HOME", "USER", "LOGNAME", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PACKCACHE_DIR", "PACKCACHE_DIGEST_DIR",
    "PACKCACHE_KERNEL_PATH", "TMPDIR", "ATEN_CPU_CAPABILITY", "HOSTNAME",
)  # fmt: skip
HERE_CAPABILITY = torch.backends.cpu.get_cpu_capability()
OTHER_CAPABILITY = "avx2" if HERE_CAPABILITY != "AVX2" else "default"


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """A directory every user can enter (pytest's own temp root is root's alone), for cwds and HOMEs."""
    directory = Path(tempfile.mkdtemp(prefix="packcache-platform-"))
    os.chmod(directory, 0o755)
    for name in ("a", "b/deeper", "home-root", "home-nobody"):
        (directory / name).mkdir(parents=True)
    for path in directory.rglob("*"):
        os.chmod(path, 0o755)
    os.chown(directory / "home-nobody", NOBODY, NOBODY)
    yield directory
    shutil.rmtree(directory)


def platform_run(
    cwd: Path, *, scheme: str = "int4", extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
) -> str:  # fmt: skip
    """stdout of ``packcache platform --scheme S --json`` in a fresh process (a failure fails the test)."""
    base = {k: v for k, v in os.environ.items() if k not in VARIED}
    command = [*prefix, sys.executable, "-m", "packcache", "platform", "--scheme", scheme, *extra, "--json"]
    done = subprocess.run(
        command, cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout


def test_the_platform_class_is_byte_identical_across_paths_users_hosts_ranks_and_variables(shared: Path) -> None:
    require_root()
    baseline = platform_run(shared / "a", env={"HOME": str(shared / "home-root"), "USER": "root"})
    runs = {
        "another working directory": platform_run(shared / "b" / "deeper", env={"HOME": "/root"}),
        "user nobody, another HOME": platform_run(
            shared / "b",
            env={"HOME": str(shared / "home-nobody"), "USER": "nobody", "LOGNAME": "nobody"},
            prefix=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"),
        ),
        "another hostname": platform_run(
            shared / "a", prefix=("unshare", "--uts", "sh", "-c", 'hostname packcache-elsewhere && exec "$@"', "sh")
        ),
        "a worker's variables": platform_run(
            shared / "b",
            env={
                "HOME": str(shared / "b"),
                "USER": "worker",
                "RANK": "3",
                "LOCAL_RANK": "1",
                "WORLD_SIZE": "8",
                "PACKCACHE_DIR": str(shared / "b"),
                "PACKCACHE_DIGEST_DIR": str(shared / "a"),
                "PACKCACHE_KERNEL_PATH": "fp32",
                "TMPDIR": str(shared / "b" / "deeper"),
            },
        ),
        "the bf16 kernel path": platform_run(shared / "a", env={"PACKCACHE_KERNEL_PATH": "bf16", "RANK": "0"}),
    }
    assert {name: out for name, out in runs.items() if out != baseline} == {}
    report = json.loads(baseline)
    fields = report["fields"]
    assert report["class"] == platform_class(fmt.canonical_key(minilm.platform("int4")))
    assert fields["cpu_capability"] == HERE_CAPABILITY and fields["format_version"] == fmt.FORMAT_VERSION
    assert fields["torch"] == torch.__version__ and fields["packcache.packers"] == 1
    # int4 stores its embedding tables as int8 rows (torch.int8wo); the platform says which packer does.
    assert sorted(p["id"] for p in fields["packers"]) == ["np.f32", "torch.int4wo", "torch.int8wo"]
    assert fields["embeddings"] == {"id": "torch.int8wo", "version": 3, "params": {}}
    # Nothing of where or who it ran: no path, user, host or rank appears anywhere in it.
    text = json.dumps(
        {**fields, "packers": [{k: v for k, v in p.items() if k != "fingerprint"} for p in fields["packers"]]}
    )
    for leaked in (
        str(shared),
        "/root",
        "nobody",
        "worker",
        "packcache-elsewhere",
        os.uname().nodename,
        "fp32",
        "bf16",
    ):
        assert leaked not in text, leaked


def _class_and_fields(out: str) -> tuple[str, dict[str, Any]]:
    report = json.loads(out)
    return report["class"], report["fields"]


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [d.field for d in differences(fmt.canonical_key(_unfield(a)), fmt.canonical_key(_unfield(b)))]


def _unfield(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k != "format_version"}


def test_another_scheme_group_size_or_cpu_capability_is_another_class_naming_the_field(shared: Path) -> None:
    here_class, here = _class_and_fields(platform_run(shared / "a"))
    int8_class, int8 = _class_and_fields(platform_run(shared / "a", scheme="int8"))
    group_class, group = _class_and_fields(platform_run(shared / "a", extra=("--group-size", "64")))
    cpu_class, cpu = _class_and_fields(platform_run(shared / "a", env={"ATEN_CPU_CAPABILITY": OTHER_CAPABILITY}))
    assert len({here_class, int8_class, group_class, cpu_class}) == 4
    assert _differing(here, int8) == ["packers[torch.int4wo]"]  # both pack their tables with torch.int8wo
    assert _differing(here, group) == [
        "packers[torch.int4wo].fingerprint", "packers[torch.int4wo].params.group_size"
    ]  # fmt: skip
    # The capability is in the class; every pack's bytes are the same under it (int4's layout is packcache's own
    # since version 3: torch's was blocked per capability, and the int4 fingerprint changed with it).
    assert _differing(cpu, here) == ["cpu_capability"]
    assert cpu["cpu_capability"] != HERE_CAPABILITY and here["cpu_capability"] == HERE_CAPABILITY
    assert [p for p in cpu["packers"] if p["id"] == "np.f32"] == [p for p in here["packers"] if p["id"] == "np.f32"]


def test_a_packer_version_bump_changes_the_class(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["platform", "--scheme", "int4", "--json"]) == 0
    before_class, before = _class_and_fields(capsys.readouterr().out)
    monkeypatch.setattr(packers_torch.Int4WeightOnly, "version", packers_torch.Int4WeightOnly.version + 1)
    assert main(["platform", "--scheme", "int4", "--json"]) == 0
    after_class, after = _class_and_fields(capsys.readouterr().out)
    assert before_class != after_class
    assert "packers[torch.int4wo].version" in _differing(before, after)


def test_the_text_output_is_the_class_then_one_field_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform", "--scheme", "int8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == platform_class(fmt.canonical_key(minilm.platform("int8")))
    assert f"cpu_capability: {HERE_CAPABILITY}" in lines and "format_version: 2" in lines
    assert f"torch: {torch.__version__}" in lines and "packers[torch.int8wo].version: 3" in lines
    assert all(": " in line for line in lines[1:])


def test_auto_resolves_to_the_scheme_run_and_build_choose(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["class"] == platform_class(fmt.canonical_key(minilm.platform(minilm.default_scheme())))


def test_the_class_is_of_the_bytes_and_the_format_version() -> None:
    a = fmt.canonical_key({"x": 1})
    assert platform_class(a) == platform_class(fmt.canonical_key({"x": 1}))
    assert platform_class(a) != platform_class(fmt.canonical_key({"x": 1.0}))  # 1 and 1.0 are other bytes
    assert platform_class(a) != platform_class(a, format_version=1)
    assert platform_fields(a) == {"x": 1, "format_version": 2}
    assert platform_fields(fmt.canonical_key({"format_version": 9})) == {
        "format_version": 9, "packcache.format_version": 2
    }  # fmt: skip


def test_differences_name_every_field_old_value_first_and_never_come_back_empty() -> None:
    file = fmt.canonical_key({"a": {"b": 1, "c": [1]}, "packers": [{"id": "p", "version": 1}], "gone": 1})
    here = fmt.canonical_key({"a": {"b": 2, "c": [1]}, "packers": [{"id": "p", "version": 2}], "new": True})
    assert [str(d) for d in differences(file, here)] == [
        "a.b: 1 -> 2", "gone: 1 -> (absent)", "new: (absent) -> true", "packers[p].version: 1 -> 2"
    ]  # fmt: skip
    # Packers without distinct ids are compared whole; bytes that differ without a field still differ.
    twice = fmt.canonical_key({"packers": [{"id": "p"}, {"id": "p"}]})
    assert [d.field for d in differences(twice, fmt.canonical_key({"packers": [{"id": "p"}]}))] == ["packers"]
    assert differences(b'{"a":1}', b'{"a": 1}') == [Difference("platform", '{"a":1}', '{"a": 1}')]
    assert differences(file, file) == []


@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4"])
def test_both_loaders_give_one_platform_per_scheme(scheme: str) -> None:
    """``probe`` derives this machine's platform with the MiniLM loader's function; a file of ``packcache.hf``
    (``packcache build``'s default loader) must get the same, or probe would call it incompatible."""
    from packcache import hf

    for group_size in (32, 64) if scheme == "int4" else (32,):
        assert hf.platform(scheme, group_size) == minilm.platform(scheme, group_size)
