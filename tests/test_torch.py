"""packcache.torch: packed Linear layers from the cache, zero-copy, with lazy sources; and ``open_cache``,
the one way the loaders (``minilm.load``, ``hf.from_pretrained``, hence ``run``, ``build`` and ``serve``) open
the cache path they are given.

A non-regular file at the cache path never stops a load. A container runtime that
bind-mounts a host path which did not exist creates a *directory* there: with ``-v
/srv/cache/bert-int8-….pcache:…`` the cache file ``run`` and ``serve`` open is a directory. That, a FIFO, a
socket, a directory at the lock file, a file where the cache directory should be, a dangling symlink or a
symlink loop: each is a cache problem, counted under its reason with its errno (docs/ROUTING.md rows 4-5),
and the model is served from heap. ``run`` and ``build`` run through ``packcache.cli.main`` in a child
(``harness.cli_child``); ``serve`` is a real gunicorn server on 127.0.0.1 with two workers. A directory
given *as an argument* under any other name than ``*.pcache`` is still refused by the loaders: it is a
mistake of argument (the directory meant to hold the file), and the message names the file to give
(``tests/test_minilm.py::test_cache_argument_forms``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import packcache
import packcache.loader
import packcache.memory
from harness import plant_socket, run_child, save_safetensors
from harness.checkpoints import tiny_bert
from harness.cli_child import run_cli_cases
from harness.serve import TEXTS, assert_embeddings, call, embed, loaded_workers, server
from packcache import hf
from packcache.models import minilm
from packcache.packers import SCHEMES, Float32, platform_for
from packcache.packers_torch import (
    NATIVE_ISAS,
    Int4WeightOnly,
    Int8WeightOnly,
    LinearBFloat16,
    LinearFloat32,
    TorchPacker,
)
from packcache.safetensors import SafetensorsFile
from packcache.torch import FloatLinear, PackedEmbedding, PackedLinear, as_tensor, convert, scheme_packer


class Toy(nn.Module):
    """Two int4-friendly linears, one that int4 does not pack (40 inputs: not a multiple of its group), and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 40, bias=False)
        self.odd = nn.Linear(40, 20)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.down(torch.relu(self.up(self.norm(x)))))


def _toy(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    model = Toy()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    return model


def _skeleton() -> Toy:
    with torch.device("meta"):
        return Toy()


def _cache(path: Path | None, packer: Any) -> packcache.WeightCache:
    return packcache.WeightCache(path, platform=platform_for([packer, Float32()]))


X = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("packer", "tolerance"),
    [(LinearFloat32(), 1e-5), (LinearBFloat16(), 0.05), (Int8WeightOnly(), 0.02), (Int4WeightOnly(32), 0.15)],
)
def test_convert_packs_linears_and_keeps_the_answers(packer: Any, tolerance: float) -> None:
    model = _toy()
    with torch.no_grad():
        expected = model(X)
    report = convert(model, _cache(None, packer), packer, model_id="toy-v1")
    assert isinstance(model.up, PackedLinear) and isinstance(model.down, PackedLinear)
    assert report.stats.state == "off" and report.stats.heap_bytes == report.packed_bytes > 0
    if isinstance(packer, Int4WeightOnly):
        assert report.converted == ["up", "down"]
        assert set(report.ineligible) == {"odd"} and "multiple of the group size" in report.ineligible["odd"]
        # ineligible layers keep their float weight, listed; an nn.Linear that runs the one-order dense product
        assert type(model.odd) is FloatLinear and isinstance(model.odd, nn.Linear)
        assert report.kernels["odd"].startswith("not packed: FloatLinear")
    else:
        assert report.converted == ["up", "down", "odd"] and report.ineligible == {}
    with torch.no_grad():
        got = model(X)
    assert float((got - expected).abs().max()) < tolerance


def _float_toy_from(state: dict[str, torch.Tensor]) -> Toy:
    model = _toy(5)  # other weights: only what load_state_dict brings can make its answers match
    model.load_state_dict(state)  # strict: every key, shape and name of a plain Toy
    return model


class _Int8Renamed(Int8WeightOnly):
    """A packer packcache knows nothing of: its state_dict weight is what its forward computes."""

    id = "test.int8-renamed"


@pytest.mark.parametrize(
    "packer", [LinearFloat32(), LinearBFloat16(), Int8WeightOnly(), Int4WeightOnly(32), _Int8Renamed()], ids=repr
)
def test_state_dict_holds_every_packed_weight_as_the_float_weight_it_computes(
    packer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``state_dict()`` of a converted module has exactly the keys, shapes and dtypes of the float module, each
    packed layer's weight the float32 weight its forward multiplies by: a plain module loads it (strict) and
    gives the packed module's answers on the dequantising path (enough rows that no fused kernel runs; int8 and int4
    with their compiled products off, which round the activations to int8 and the plain module does not), through
    ``torch.save`` and ``torch.load(weights_only=True)`` too."""
    model = _toy()
    layout = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    convert(model, _cache(None, packer), packer, model_id="toy-v1", kernel_path="fp32")
    state = model.state_dict()
    assert {name: (tuple(t.shape), t.dtype) for name, t in state.items()} == layout
    torch.save(state, tmp_path / "toy.pt")
    reloaded = _float_toy_from(torch.load(tmp_path / "toy.pt", weights_only=True))
    rows = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    if isinstance(packer, Int4WeightOnly):
        monkeypatch.setitem(NATIVE_ISAS, "int4", ())
        monkeypatch.setitem(NATIVE_ISAS, "dense", ())
        assert "per call + linear(float32)" in model.up.kernel(256)
    if isinstance(packer, Int8WeightOnly):
        monkeypatch.setitem(NATIVE_ISAS, "int8", ())
        monkeypatch.setitem(NATIVE_ISAS, "dense", ())
        assert "per call + linear(float32)" in model.up.kernel(256)
    with torch.no_grad():
        packed, plain = model(rows), reloaded(rows)
    # The bf16 scheme rounds the activations to bfloat16 on every path (its weight is never widened): ~2^-8.
    tolerance = 2**-7 if isinstance(packer, LinearBFloat16) else 1e-5
    assert float((packed - plain).abs().max()) <= tolerance * float(packed.abs().max())
    # The weights were not merely copied back: a lossy scheme saves its quantised weight, not the source's.
    source = _toy()
    if isinstance(packer, (Int8WeightOnly, Int4WeightOnly)):
        assert not torch.equal(state["up.weight"], source.up.weight)


def test_load_state_dict_into_a_converted_module_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """Its tensors are views of a read-only mapping: copying into them would kill the process (SIGSEGV).
    Loading is refused with one clear error, for the module and for every submodule holding cache tensors,
    before anything is written; a load that touches none of them still works. In a child: on failure it crashes."""
    source = save_safetensors(_toy(), tmp_path / "toy.safetensors")
    code = textwrap.dedent(
        """
        import torch
        from test_torch import Int8WeightOnly, SafetensorsFile, X, _cache, _skeleton, _toy, convert
        source, path = sys.argv[1], sys.argv[2]
        for _ in range(2):  # the second load maps every tensor from the file
            model = _skeleton()
            convert(model, _cache(path, Int8WeightOnly()), Int8WeightOnly(), source=SafetensorsFile(source))
        with torch.no_grad():
            before = model(X)
        other = _toy(7).state_dict()
        errors = []
        for target, prefix in ((model, ""), (model.norm, "norm."), (model.up, "up."), (model.odd, "odd.")):
            state = {k[len(prefix):]: v for k, v in other.items() if k.startswith(prefix)}
            try:
                target.load_state_dict(state)
            except RuntimeError as exc:
                errors.append(str(exc))
        model.load_state_dict({}, strict=False)  # nothing to write: allowed
        with torch.no_grad():
            same = torch.equal(model(X), before)
        report(errors=errors, same=same)
        """
    )  # the child prelude puts tests/ on sys.path: it imports this module's Toy
    result = run_child(code, str(source), str(tmp_path / "toy.pcache"))
    assert result["same"], "a refused load changed the model"
    assert len(result["errors"]) == 4, result["errors"]
    for error in result["errors"]:
        assert "read-only" in error and "packcache" in error, error


def test_cold_then_warm_launch_maps_every_weight_and_gives_identical_answers(tmp_path: Path) -> None:
    source = save_safetensors(_toy(), tmp_path / "toy.safetensors")
    outputs, states = [], []
    for _ in range(2):
        model = _skeleton()
        cache = _cache(tmp_path / "toy.pcache", Int8WeightOnly())
        report = convert(model, cache, Int8WeightOnly(), source=SafetensorsFile(source))
        with torch.no_grad():
            outputs.append(model(X))
        states.append((report.stats.state, report.stats.heap_bytes, report.stats.mapped_bytes == report.packed_bytes))
        cache.close()
    assert states == [("stored", 0, True), ("mapped", 0, True)]
    assert torch.equal(outputs[0], outputs[1])


def test_warm_launch_reads_no_source_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = save_safetensors(_toy(), tmp_path / "toy.safetensors")
    packer = Int4WeightOnly(32)
    first = _skeleton()
    cold = convert(first, _cache(tmp_path / "toy.pcache", packer), packer, source=SafetensorsFile(source))
    assert cold.stats.state == "stored"

    def no_reading(self: SafetensorsFile, name: str) -> np.ndarray[Any, Any]:
        raise AssertionError(f"a warm launch read source tensor {name!r}")

    monkeypatch.setattr(SafetensorsFile, "read", no_reading)
    warm = _skeleton()
    report = convert(warm, _cache(tmp_path / "toy.pcache", packer), packer, source=SafetensorsFile(source))
    assert report.stats.state == "mapped" and report.stats.hits > 0 and report.stats.heap_bytes == 0
    with torch.no_grad():
        assert torch.equal(warm(X), first(X))
    # The same reader does fail when a pack is really needed, so the check above can fail.
    with pytest.raises(AssertionError, match="read source tensor"):
        convert(_skeleton(), _cache(None, packer), packer, source=SafetensorsFile(source))


def test_a_rewritten_source_file_is_packed_again(tmp_path: Path) -> None:
    source = save_safetensors(_toy(0), tmp_path / "toy.safetensors")
    convert(
        _skeleton(), _cache(tmp_path / "toy.pcache", Int8WeightOnly()), Int8WeightOnly(), source=SafetensorsFile(source)
    )
    source.unlink()
    save_safetensors(_toy(1), source)  # new inode and mtime: the identity in every key changes
    model = _skeleton()
    report = convert(
        model, _cache(tmp_path / "toy.pcache", Int8WeightOnly()), Int8WeightOnly(), source=SafetensorsFile(source)
    )
    assert report.stats.stored > 0 and report.stats.hits == 0
    reference = _toy(1)
    with torch.no_grad():
        assert float((model(X) - reference(X)).abs().max()) < 0.02


def test_packed_tensors_are_zero_copy_views_of_the_cache_mapping(tmp_path: Path) -> None:
    source = save_safetensors(_toy(), tmp_path / "toy.safetensors")
    path = tmp_path / "toy.pcache"
    convert(_skeleton(), _cache(path, Int8WeightOnly()), Int8WeightOnly(), source=SafetensorsFile(source))
    model = _skeleton()
    convert(model, _cache(path, Int8WeightOnly()), Int8WeightOnly(), source=SafetensorsFile(source))
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(v, 16) for v in fields[0].split("-"))
            ranges.append((start, end))
    assert ranges, "the cache file is not mapped"
    tensors = [
        model.up.get_buffer("weight"),
        model.up.get_buffer("scales"),
        model.norm.weight,
        model.odd.get_buffer("bias"),
    ]
    for tensor in tensors:
        address = tensor.data_ptr()
        assert any(start <= address and address + tensor.nbytes <= end for start, end in ranges)


def test_as_tensor_shares_memory_and_silences_only_the_read_only_warning() -> None:
    array = np.arange(8, dtype=np.float32)
    array.flags.writeable = False
    tensor = as_tensor(array.reshape(2, 4))
    assert tensor.data_ptr() == array.ctypes.data and tensor.shape == (2, 4)
    assert as_tensor(np.zeros((0, 3), np.float32)).shape == (0, 3)
    bits = np.array([0x3F80, 0xC000], np.uint16)
    assert as_tensor(bits, torch.bfloat16).tolist() == [1.0, -2.0]


def test_module_source_without_model_id_hashes_the_weights() -> None:
    from packcache.torch import ModuleSource

    a, b = ModuleSource(_toy(0)), ModuleSource(_toy(1))
    assert a.identity.startswith("sha256:") and a.identity != b.identity
    assert ModuleSource(_toy(0)).identity == a.identity
    assert ModuleSource(_toy(0), model_id="toy-v1").identity == "toy-v1"


def test_source_shape_mismatch_is_an_error(tmp_path: Path) -> None:
    class Wider(Toy):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(64, 256)

    source = save_safetensors(_toy(), tmp_path / "toy.safetensors")
    with torch.device("meta"):
        model = Wider()
    with pytest.raises(ValueError, match="shape"):
        convert(model, _cache(None, LinearFloat32()), LinearFloat32(), source=SafetensorsFile(source))


# ------------------------------------------------------------------ non-finite weights

NON_FINITE = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
SHOWN = {"nan": "NaN", "+inf": r"\+Inf", "-inf": "-Inf"}
TOLERANCE = {"fp32": 1e-5, "bf16": 0.05, "int8": 0.02, "int4": 0.15}


def _with(model: nn.Module, name: str, index: tuple[int, ...], value: float) -> nn.Module:
    with torch.no_grad():
        model.get_parameter(name)[index] = value
    return model


@pytest.mark.parametrize("value", sorted(NON_FINITE))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_non_finite_weight_is_refused_by_every_scheme_and_the_fixed_checkpoint_loads(
    tmp_path: Path, scheme: str, value: str
) -> None:
    """End to end, from a safetensors file into a cache file: NaN, +Inf or -Inf in one weight is refused at
    pack time by every scheme, naming the tensor, row and column; nothing of it is cached. int8 used to
    serve that output channel as a finite 0 (the all-zero-row scale), fp32/bf16/int4 as NaN or Inf.
    The same cache file then loads the repaired checkpoint, and its forward matches the float model."""
    packer = scheme_packer(scheme)
    broken = save_safetensors(_with(_toy(), "down.weight", (5, 3), NON_FINITE[value]), tmp_path / "broken.safetensors")
    cache = _cache(tmp_path / "toy.pcache", packer)
    refused = rf"'down\.weight' holds {SHOWN[value]} at row 5, column 3"
    with pytest.raises(packcache.NonFiniteWeightError, match=refused):
        convert(_skeleton(), cache, packer, source=SafetensorsFile(broken))  # "up" is packed before "down"
    cache.close()
    names = {e.name.split(":")[0] for e in packcache.inspect(tmp_path / "toy.pcache").entries}
    assert names == {"up.weight", "up.bias"}  # what was packed before the refusal; nothing of "down"

    repaired = save_safetensors(_toy(), tmp_path / "repaired.safetensors")
    cache = _cache(tmp_path / "toy.pcache", packer)
    model = _skeleton()
    report = convert(model, cache, packer, source=SafetensorsFile(repaired))
    assert report.stats.state == "stored" and report.stats.heap_bytes == 0, report.stats
    with torch.inference_mode():
        got, expected = model(X), _toy()(X)
    assert bool(torch.isfinite(got).all()) and float((got - expected).abs().max()) < TOLERANCE[scheme]
    cache.close()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("name", "index", "where"), [("up.bias", (7,), "index 7"), ("norm.weight", (60,), "index 60")])
def test_a_non_finite_bias_or_norm_is_refused_by_every_scheme(
    tmp_path: Path, scheme: str, name: str, index: tuple[int, ...], where: str
) -> None:
    """The tensors every scheme packs as float32 (biases, norms, embeddings) follow the same rule."""
    source = save_safetensors(_with(_toy(), name, index, float("nan")), tmp_path / "toy.safetensors")
    packer = scheme_packer(scheme)
    with pytest.raises(packcache.NonFiniteWeightError, match=rf"'{name}' holds NaN at {where}"):
        convert(_skeleton(), _cache(None, packer), packer, source=SafetensorsFile(source))


def test_a_non_finite_weight_of_an_in_memory_module_is_refused_too() -> None:
    """``convert`` without a source packs the module's own parameters (``ModuleSource``): the same rule."""
    model = _with(_toy(), "odd.weight", (19, 31), float("-inf"))
    with pytest.raises(packcache.NonFiniteWeightError, match=r"'odd\.weight' holds -Inf at row 19, column 31"):
        convert(model, _cache(None, Int8WeightOnly()), Int8WeightOnly(), model_id="toy")


def _poison(checkpoint: Path, tensor: str, row: int, column: int) -> None:
    """Write NaN over element ``[row, column]`` of float32 ``tensor`` in a safetensors file, in place."""
    with open(checkpoint, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(length))[tensor]
        assert info["dtype"] == "F32"
        f.seek(8 + length + info["data_offsets"][0] + 4 * (row * info["shape"][1] + column))
        f.write(struct.pack("<f", float("nan")))


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--model", "{model}", "--no-cache", "--scheme", "int8"],
        ["build", "{model}", "--loader", "minilm", "--cache-dir", "{tmp}", "--scheme", "int8"],
        ["build", "{model}", "--loader", "hf", "--cache-dir", "{tmp}", "--scheme", "int4"],
    ],
    ids=["run", "build-minilm", "build-hf"],
)
def test_the_command_line_refuses_a_checkpoint_with_a_nan_weight_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    from packcache.cli import main
    from packcache.models import minilm

    model = tmp_path / "model"
    shutil.copytree(minilm.default_model_path(), model)
    _poison(model / "model.safetensors", "encoder.layer.0.attention.self.query.weight", 5, 3)
    code = main([a.format(model=model, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "encoder.layer.0.attention.self.query.weight' holds NaN at row 5, column 3" in lines[0], lines


def test_a_packer_that_is_not_deterministic_is_refused_before_its_first_pack_is_stored(tmp_path: Path) -> None:
    """The fingerprint packs once (a warm launch pays for no more); the determinism check runs before the
    first real pack of a process, so such a packer never stores a byte."""

    class AddressDependent(LinearFloat32):
        id = "test.address-dependent"

        def pack(self, source: Any, dtype: str, stats: Any = None) -> dict[str, np.ndarray[Any, Any]]:
            weight = np.array(source, dtype=np.float32)
            weight.flat[0] = float(source.ctypes.data % 4093)  # like a packer that embeds a pointer
            return {"weight": weight}

    packer = AddressDependent()
    packer.fingerprint()
    path = tmp_path / "m.pcache"
    with packcache.WeightCache(path, platform=platform_for([packer, Float32()])) as cache:
        with pytest.raises(packcache.PackResultError, match="not deterministic"):
            convert(nn.Sequential(nn.Linear(8, 4)), cache, packer, model_id="toy")
        assert cache.stats().stored == 0
    assert not path.exists()


# ------------------------------------------------- any kind of file at the cache path: run and build


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _lock_directory(path: Path) -> None:
    Path(f"{path}.lock").mkdir()


def _file_for_the_directory(path: Path) -> None:
    path.parent.rmdir()
    path.parent.write_text("not a directory")


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "gone" / "m.pcache")


def _loop(path: Path) -> None:
    path.symlink_to(path)


#: What sits at (or in the way of) the cache file -> (the reason, its errno, a phrase of the message).
KINDS: dict[str, tuple[Callable[[Path], None], str, int, str]] = {
    "a directory": (_directory, "open_failed", errno.EISDIR, "is a directory"),
    "a FIFO": (_fifo, "untrusted", 0, "not a regular file (a FIFO)"),
    "a socket": (plant_socket, "untrusted", 0, "not a regular file (a socket)"),
    "a directory at the lock file": (_lock_directory, "open_failed", errno.EISDIR, "lock file"),
    "a file for the cache directory": (_file_for_the_directory, "open_failed", errno.ENOTDIR, "Not a directory"),
    "a dangling symlink": (_dangling, "open_failed", errno.ENOENT, "No such file"),
    "a symlink loop": (_loop, "open_failed", errno.ELOOP, "symbolic links"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("model") / "tiny", hidden=32)


def planted(base: Path, name: str, path_of: Callable[[Path], Path]) -> Path:
    """A fresh cache directory under ``base`` whose cache file (``path_of(directory)``) has ``name``'s kind."""
    directory = base / name.replace(" ", "-")
    directory.mkdir()
    KINDS[name][0](path_of(directory))
    return directory


def assert_counted(stats: dict[str, Any], name: str) -> None:
    _, reason, err, phrase = KINDS[name]
    assert stats["state"] == "heap" and stats["heap_reason"] == reason, (name, stats)
    assert stats["errno"] == err and phrase in stats["error"], (name, stats)
    assert stats["heap_bytes"] == stats["heap_bytes_by_reason"][reason] > 0 and stats["mapped_bytes"] == 0, stats


def test_run_counts_any_kind_of_file_at_its_cache_path_and_embeds_from_heap(tmp_path: Path, tiny: Path) -> None:
    cases = []
    for name in KINDS:
        directory = planted(tmp_path, name, lambda d: minilm.default_cache_path("int8", model_path=tiny, cache_dir=d))
        cases.append((name, ["run", "--model", str(tiny), "--cache-dir", str(directory), "--scheme", "int8", "--json"]))
    results = run_cli_cases(cases)
    for name, result in results.items():
        assert result.get("rc") == 0, (name, result)
        report = json.loads(result["stdout"])
        assert report["embeddings_shape"] == [3, 32], name
        assert_counted(report["stats"], name)
    assert (tmp_path / "a-directory" / minilm.default_cache_path("int8", model_path=tiny).name).is_dir()  # as it was


def test_run_with_the_bundled_model_and_a_directory_at_its_cache_file_still_embeds(tmp_path: Path) -> None:
    """The issue's case, end to end: ``<cache-dir>/bert-int8-<hex>.pcache`` is a directory."""
    minilm.default_cache_path("int8", cache_dir=tmp_path).mkdir()
    (result,) = run_cli_cases(
        [("bundled", ["run", "--cache-dir", str(tmp_path), "--scheme", "int8", "--json"])]
    ).values()
    assert result.get("rc") == 0, result
    report = json.loads(result["stdout"])
    assert report["embeddings_shape"] == [3, 384]
    assert_counted(report["stats"], "a directory")
    assert "EISDIR" in result["stderr"]  # the ERROR line the cache logs once, with the errno's name


def test_build_reports_a_directory_at_its_cache_file_and_exits_1_without_a_traceback(
    tmp_path: Path, tiny: Path
) -> None:
    """``build`` is a deploy step: the file must hold the model afterwards, so it fails, but as a report of the
    cache's figures (the reason and errno), not as a checkpoint it cannot load."""
    cases = []
    for loader in ("hf", "minilm"):
        directory = tmp_path / loader
        directory.mkdir()
        named = (
            hf.default_cache_path(tiny, "int8")
            if loader == "hf"
            else minilm.default_cache_path("int8", model_path=tiny)
        )
        (directory / named.name).mkdir()
        cases.append(
            (
                loader,
                ["build", str(tiny), "--loader", loader, "--scheme", "int8", "--cache-dir", str(directory), "--json"],
            )
        )
    for loader, result in run_cli_cases(cases).items():
        assert result.get("rc") == 1 and "cannot load" not in result["stderr"], (loader, result)
        assert_counted(json.loads(result["stdout"])["stats"], "a directory")


# ---------------------------------------------------------------------- any kind of file at the cache path: the loaders


@pytest.mark.parametrize("name", list(KINDS))
def test_the_loaders_take_any_kind_of_file_at_a_cache_file_path(tmp_path: Path, tiny: Path, name: str) -> None:
    directory = planted(tmp_path, name, lambda d: d / "model.pcache")
    with minilm.load("int8", cache=directory / "model.pcache", model_path=tiny) as model:
        assert model.embed(["a"]).shape == (1, 32)
        assert_counted(_stats(model.cache), name)
    model = hf.from_pretrained(tiny, "int8", directory / "model.pcache")
    assert_counted(_stats(model.packcache), name)
    model.packcache.close()


def test_a_directory_given_by_another_name_is_still_a_mistake_of_argument(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"is a directory; give a file path such as .*bert-int8-"):
        minilm.load("int8", cache=tmp_path, model_path=tiny)
    with pytest.raises(ValueError, match=r"is a directory; give a file path such as .*bert-int8-"):
        hf.from_pretrained(tiny, "int8", tmp_path)


def _stats(cache: Any) -> dict[str, Any]:
    stats = cache.stats()
    return {
        "state": stats.state, "heap_reason": stats.heap_reason, "errno": stats.errno, "error": stats.error,
        "heap_bytes": stats.heap_bytes, "heap_bytes_by_reason": stats.heap_bytes_by_reason,
        "mapped_bytes": stats.mapped_bytes,
    }  # fmt: skip


# --------------------------------------------------------------------------- any kind of file at the cache path: serve


@pytest.fixture
def docker_cache_dir(tmp_path: Path) -> Iterator[Path]:
    """A cache directory whose bundled int8 cache file is a directory, as a bind mount of a missing host path leaves."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    minilm.default_cache_path("int8", cache_dir=directory).mkdir()
    yield directory


def test_serve_workers_boot_and_serve_from_heap_with_a_directory_at_the_cache_file(
    tmp_path: Path, docker_cache_dir: Path, reference: np.ndarray[Any, Any]
) -> None:
    with server(tmp_path, "--cache-dir", str(docker_cache_dir), workers=2) as srv:
        scrape = loaded_workers(srv, 2)
        for worker in scrape.workers.values():
            assert worker.current_state == "heap" and worker.current_reason == "open_failed", worker
            assert worker.values["errno"] == errno.EISDIR and worker.values["mapped_bytes"] == 0, worker
            assert (
                worker.heap_bytes["open_failed"] > 0
                and sum(worker.heap_bytes.values()) == worker.heap_bytes["open_failed"]
            )
        assert call(srv, "GET", "/healthz")[0] == 200
        health = json.loads(call(srv, "GET", "/healthz")[1][1])
        assert health["state"] == "heap" and health["heap_reason"] == "open_failed"
        assert_embeddings(embed(srv, list(TEXTS))[1], reference)
        assert set(srv.workers()) == set(scrape.workers), "no worker died or was replaced"


# ---------------------------------------------------------------- embedding tables in the scheme's form


class TinyLM(nn.Module):
    """An embedding table, a norm and an output head tied to the table (like a tied causal LM)."""

    def __init__(self, vocab: int = 96, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _tiny_lm(tmp_path: Path) -> tuple[Path, TinyLM]:
    torch.manual_seed(3)
    model = TinyLM()
    with torch.no_grad():
        model.embed.weight.normal_(0.0, 0.5)
    return save_safetensors(model, tmp_path / "lm.safetensors"), model


def _tiny_lm_skeleton() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


IDS = torch.tensor([[0, 5, 95, 5], [17, 3, 2, 64]])
EMBEDDING_SCHEMES = {"bf16": LinearBFloat16, "int8": Int8WeightOnly, "int4": Int8WeightOnly}


@pytest.mark.parametrize("scheme", list(EMBEDDING_SCHEMES))
def test_a_packed_table_looks_up_exactly_its_dequantised_rows_and_saves_them_as_float32(
    tmp_path: Path, scheme: str
) -> None:
    source, reference = _tiny_lm(tmp_path)
    recipe = packcache.loader.resolve(scheme, 32)
    assert type(recipe.embedding) is EMBEDDING_SCHEMES[scheme]
    path = tmp_path / "lm.pcache"
    for launch in ("stored", "mapped"):
        model = _tiny_lm_skeleton()
        cache = packcache.WeightCache(path, platform=recipe.platform())
        report = convert(
            model, cache, recipe.linear, source=SafetensorsFile(source), embedding=recipe.embedding, other=recipe.other
        )
        assert report.stats.state == launch and report.stats.heap_bytes == 0
        table = model.embed
        assert isinstance(table, PackedEmbedding) and report.embeddings == ["embed"]
        assert (table.num_embeddings, table.embedding_dim, table.padding_idx) == (96, 64, 0)
        weight = table.float_weight()
        assert weight.dtype == torch.float32 and weight.shape == (96, 64)
        with torch.inference_mode():
            rows = table(IDS)
        assert rows.dtype == torch.float32 and rows.shape == (2, 4, 64)
        assert torch.equal(rows, weight[IDS]), "a lookup is bit for bit the dequantised table's rows"
        tolerance = {"bf16": 0.004, "int8": 0.02, "int4": 0.02}[scheme]
        assert float((rows - reference.embed.weight.detach()[IDS]).abs().max()) < tolerance
        # Saving writes the float32 table under the source's name, and the tied head the same tensor.
        state = model.state_dict()
        assert torch.equal(state["embed.weight"], weight) and state["head.weight"] is state["embed.weight"]
        assert model.head.tied_weight is table.weight
        with pytest.raises(RuntimeError, match="read-only file mapping"):
            model.load_state_dict(reference.state_dict())
        plain = TinyLM()
        plain.load_state_dict(state)  # a float model of the same class takes it
        with torch.inference_mode():
            assert torch.equal(plain.embed(IDS), rows)
        cache.close()
    names = sorted(entry.name for entry in packcache.inspect(path).entries)
    parts = sorted(f"embed.weight:{recipe.embedding.id}:{p}" for p in recipe.embedding.parts)
    # One stored table: no float32 copy, and the head reads the table's own pack (with int4 too: the int8 table,
    # which keeps the file size against llama.cpp's Q4_0 in bounds).
    if scheme == "int4":
        assert report.kernels["head"] == Int8WeightOnly().kernels(model.head.kernel_path), report.kernels["head"]
    assert names == sorted([*parts, "norm.bias:np.f32:weight", "norm.weight:np.f32:weight"]), names
    assert report.packed_ties == {"head": ["embed.weight"]}


@pytest.mark.parametrize("packer", [Int8WeightOnly(), LinearBFloat16()], ids=lambda p: p.id)
def test_a_lookup_of_an_id_out_of_range_is_an_error_as_for_the_float_table(packer: TorchPacker) -> None:
    # The int8 table gathers codes and block scales itself: a negative id must not wrap round to the last rows.
    parts = packer.pack(np.random.default_rng(0).standard_normal((10, 64)).astype(np.float32), "F32")
    operands: dict[str, torch.Tensor | None] = {p: as_tensor(a, packer.part_dtypes().get(p)) for p, a in parts.items()}
    operands["bias"] = None
    assert packer.rows(operands, torch.tensor([[9, 0]])).shape == (1, 2, 64)
    for ids in (torch.tensor([-1]), torch.tensor([10])):
        with pytest.raises(IndexError):
            packer.rows(operands, ids)
        with pytest.raises(IndexError):
            F.embedding(ids, torch.zeros(10, 64))  # what the float table does


def test_the_fp32_scheme_keeps_its_tables_float32_parameters(tmp_path: Path) -> None:
    source, _ = _tiny_lm(tmp_path)
    recipe = packcache.loader.resolve("fp32")
    assert recipe.embedding is None
    model = _tiny_lm_skeleton()
    report = convert(model, packcache.WeightCache(None), recipe.linear, source=SafetensorsFile(source))
    assert type(model.embed) is nn.Embedding and model.head.weight is model.embed.weight
    assert report.embeddings == [] and "head" in report.ineligible


def test_a_table_is_mapped_and_a_lookup_dequantises_only_the_rows_it_reads(tmp_path: Path) -> None:
    """A 131072 x 256 table: 128 MiB as float32, 32 MiB as int8. A warm load maps it and lookups widen only their
    rows: the process's anonymous memory grows by far less than the float32 table (it would, by 128 MiB, had the
    load or a lookup dequantised it)."""
    vocab, width = 131072, 256
    from safetensors.numpy import save_file

    table = np.random.default_rng(0).standard_normal((vocab, width), dtype=np.float32)
    save_file({"weight": table}, str(tmp_path / "table.safetensors"))
    del table
    packer = Int8WeightOnly()
    platform = packcache.loader.resolve("int8").platform()
    path = tmp_path / "table.pcache"

    # The source's names: the module "0" holds "0.weight"; the file holds "weight".
    class Renamed:
        def __init__(self, file: SafetensorsFile) -> None:
            self.file = file

        def meta(self, name: str) -> Any:
            return self.file.meta(name.removeprefix("0."))

        def read(self, name: str) -> np.ndarray[Any, Any]:
            return self.file.read(name.removeprefix("0."))

    def load_renamed() -> tuple[nn.Module, packcache.WeightCache]:
        with torch.device("meta"):
            holder = nn.Sequential(nn.Embedding(vocab, width))
        cache = packcache.WeightCache(path, platform=platform)
        source = Renamed(SafetensorsFile(tmp_path / "table.safetensors"))
        convert(holder, cache, packer, source=source, embedding=packer)
        return holder, cache

    _, cold = load_renamed()
    assert cold.stats().state == "stored"
    cold.close()
    before = packcache.memory.smaps_rollup()["Anonymous"]
    holder, warm = load_renamed()
    assert warm.stats().state == "mapped" and isinstance(holder[0], PackedEmbedding)
    loaded = packcache.memory.smaps_rollup()["Anonymous"]
    ids = torch.randint(0, vocab, (8, 512), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        rows = holder[0](ids)
    looked_up = packcache.memory.smaps_rollup()["Anonymous"]
    float_bytes = vocab * width * 4
    assert loaded - before < float_bytes // 16, f"the load grew anonymous memory by {loaded - before} bytes"
    # The rows themselves (8 x 512 x 256 float32: 4 MiB) and their codes; never the table.
    assert looked_up - loaded < rows.nbytes * 3 + (8 << 20), f"lookups grew it by {looked_up - loaded} bytes"
    file_usage = packcache.memory.file_mapping_usage(path)
    assert file_usage.anonymous == 0
    warm.close()


# ------------------------------------------------------------------------- one public path for every class of a layer


def test_a_converted_module_pickles_under_packcache_torch_and_answers_alike(tmp_path: Path) -> None:
    """Every class a pickle of a converted module names (the packed layers, a tie's shared float weight, the
    read-only hook) is named by its public path, ``packcache.torch``, whichever private module defines it: a
    pickle does not depend on the package's inside. The copy answers alike and still refuses ``load_state_dict``."""
    import pickle

    path, _ = _tiny_lm(tmp_path)
    model = _tiny_lm_skeleton()
    report = convert(
        model, packcache.WeightCache(None), Int8WeightOnly(), source=SafetensorsFile(path), embedding=Int8WeightOnly()
    )
    assert report.embeddings == ["embed"] and report.converted == ["head"]
    assert {type(m).__module__ for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))} == {
        "packcache.torch"
    }
    data = pickle.dumps(model)
    assert b"packcache.torch" in data and b"packcache._" not in data
    copy = pickle.loads(data)
    with torch.no_grad():
        assert torch.equal(copy(IDS), model(IDS))
    with pytest.raises(RuntimeError, match="read-only"):
        copy.load_state_dict(model.state_dict())


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
def test_casting_a_packed_model_leaves_its_packed_operands_as_the_file_holds_them(tmp_path: Path, scheme: str) -> None:
    """``model.to(torch.bfloat16)`` on a loaded model cast the packed operands too: private heap copies of the
    mapped bytes, which the kernels then refused (bfloat16 scales turned float32) or, in a layer already run,
    ignored. A cast now leaves them as the file holds them and the model runs in the new dtype; a move off the
    CPU is refused, naming the layer."""
    from harness.checkpoints import tiny_bert

    model = hf.from_pretrained(tiny_bert(tmp_path / "ckpt", seed=4), scheme, tmp_path / "c.pcache")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear | PackedEmbedding)]
    assert any(isinstance(m, PackedEmbedding) for m in packed) or scheme == "fp32"

    def operands() -> dict[tuple[int, str], tuple[int, torch.dtype]]:
        return {(id(m), n): (b.data_ptr(), b.dtype) for m in packed for n, b in m._buffers.items() if b is not None}

    before = operands()
    ids = torch.tensor([[101, 2054, 2003, 1037, 3231, 102]])
    with torch.inference_mode():
        expected = model(input_ids=ids).last_hidden_state
        assert model.to(torch.bfloat16) is model
        got = model(input_ids=ids).last_hidden_state
    after = operands()
    assert after == before  # the same tensors over the mapping, in the packer's dtypes
    assert got.dtype == torch.bfloat16 and model.embeddings.LayerNorm.weight.dtype == torch.bfloat16
    cosine = torch.nn.functional.cosine_similarity(got.float().flatten(), expected.flatten(), dim=0)
    assert cosine > 0.99, float(cosine)
    assert model.float() is model  # and back: float32 again, over the same operands
    with torch.inference_mode():
        back = model(input_ids=ids).last_hidden_state
    assert back.dtype == torch.float32 and operands() == before
    assert float(torch.nn.functional.cosine_similarity(back.flatten(), expected.flatten(), dim=0)) > 0.99
    # (as any failed move, one that stops part of the way leaves the modules before it moved: load a fresh model)
    with pytest.raises(RuntimeError, match="computes on the CPU over its cache file's mapping; it cannot move to meta"):
        model.to("meta")
