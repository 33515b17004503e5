"""Kernel paths (packcache.kernels): chosen from the CPU's flags, forced for tests, never part of a cache's identity.

The "no reference kernel" checks are functional: they observe, at torch's dispatcher, which op
each packed layer calls and the dtype of what it receives. Speed is measured in benchmarks/ only.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import packcache
from harness import save_safetensors
from packcache.kernels import KERNEL_PATH_ENV, activation_dtype, cpu_kernels, int4_layout
from packcache.packers import Float32, platform_for
from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32, TorchPacker
from packcache.safetensors import SafetensorsFile
from packcache.torch import PackedLinear, convert

WEIGHT_ONLY_KERNELS = {"_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu"}
GEMMS = {"linear", "mm", "addmm", "matmul"}
QUANTISED = [Int8WeightOnly(), Int4WeightOnly(32)]


def _cpu_flags() -> set[str]:
    """The CPU's flags as the kernel reports them, read independently of torch."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


class _Dispatched(TorchDispatchMode):
    """Every aten op that runs, with the dtypes of its tensor arguments (in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))

    def of(self, names: set[str]) -> list[tuple[str, tuple[torch.dtype, ...]]]:
        return [call for call in self.calls if call[0] in names]


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def _layer(packer: TorchPacker, kernel_path: str | None = None) -> PackedLinear:
    weight = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) * np.float32(0.05)
    return PackedLinear.from_parts(
        packer, packer.checked_pack(weight, "F32"), np.zeros(64, np.float32), kernel_path=kernel_path
    )


def _run(layer: PackedLinear, rows: int) -> _Dispatched:
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode(), _Dispatched() as seen:
        layer(x)
    return seen


# ------------------------------------------------------------------ the rule


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 flags from /proc/cpuinfo")
def test_the_rule_follows_the_cpu_flags() -> None:
    flags, cpu = _cpu_flags(), cpu_kernels()
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    assert cpu.avx512_bf16 == ("avx512_bf16" in flags)
    assert cpu.amx_tile == ("amx_tile" in flags)
    native = ("avx512_bf16" in flags or "amx_bf16" in flags) and cpu.onednn_bf16
    assert cpu.native_bf16 == native
    assert cpu.default_path == ("bf16" if native else "fp32")
    # torch's vectorised weight-only kernels exist for its AVX2 and AVX512 dispatch.
    assert cpu.fused_weight_only == (cpu.capability in ("AVX2", "AVX512"))
    assert set(cpu.flags()) >= {"cpu_capability", "native_bf16", "default_path"}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 flags from /proc/cpuinfo")
@pytest.mark.parametrize("packer", [*QUANTISED, LinearBFloat16()], ids=lambda p: p.id)
def test_no_packed_layer_falls_back_to_a_reference_kernel(packer: TorchPacker) -> None:
    flags = _cpu_flags()
    layer = _layer(packer)  # the path this machine's rule picks
    native = ("avx512_bf16" in flags or "amx_bf16" in flags) and cpu_kernels().onednn_bf16
    if native:
        assert layer.kernel_path == "bf16", "native bf16 flags, yet the packed layer does not run bf16"
    vectorised = "avx2" in flags  # torch dispatches its AVX2 or AVX512 kernels on such a CPU
    weight_only_seen = 0
    for rows in (1, 7, 300):  # the fused kernel for few rows, dequantise + GEMM for many (int8/int4)
        seen = _run(layer, rows)
        for name, dtypes in seen.of(WEIGHT_ONLY_KERNELS):
            weight_only_seen += 1
            # Given float32 activations these ops run their scalar reference loop.
            assert not vectorised or dtypes[0] == torch.bfloat16, (name, dtypes, rows)
        gemms = seen.of(GEMMS)
        if native:
            assert all(set(dtypes) == {torch.bfloat16} for _, dtypes in gemms), (gemms, rows)
        assert seen.of(WEIGHT_ONLY_KERNELS) or gemms, f"no kernel observed for {rows} rows"
    if isinstance(packer, (Int8WeightOnly, Int4WeightOnly)) and vectorised:
        assert weight_only_seen > 0, "few rows must take torch's fused kernel"


def test_the_dispatch_check_sees_a_reference_call() -> None:
    """The check above can fail: a float32 call of the fused kernel is observed as such."""
    weight, scales = torch.ones(16, 32, dtype=torch.int8), torch.ones(16)
    with torch.inference_mode(), _Dispatched() as seen:
        torch._weight_int8pack_mm(torch.ones(2, 32), weight, scales)
    assert seen.of(WEIGHT_ONLY_KERNELS) == [("_weight_int8pack_mm", (torch.float32, torch.int8, torch.float32))]


@pytest.mark.parametrize("packer", QUANTISED, ids=lambda p: p.id)
@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_every_forced_path_runs_the_ops_it_reports(packer: TorchPacker, path: str) -> None:
    layer = _layer(packer, path)
    assert layer.kernel_path == path and f"kernel_path={path!r}" in repr(layer)
    for rows in (1, 300):
        seen = _run(layer, rows)
        expected_dtype = packer.kernel_input_dtype(path, rows)
        if layer.kernel(rows).startswith("_weight_"):
            (call,) = seen.of(WEIGHT_ONLY_KERNELS)
            assert call[0] in layer.kernel(rows) and call[1][0] == expected_dtype
        else:
            assert not seen.of(WEIGHT_ONLY_KERNELS)
            assert {dtypes[1] for _, dtypes in seen.of(GEMMS)} == {activation_dtype(path)}


# ------------------------------------------------------------------ forcing a path


def test_a_path_is_forced_by_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNEL_PATH_ENV, raising=False)
    assert Int8WeightOnly().kernel_path() == cpu_kernels().default_path
    assert Int8WeightOnly().kernel_path("fp32") == "fp32" and Int8WeightOnly().kernel_path("bf16") == "bf16"
    assert LinearFloat32().kernel_path() == "fp32"  # the exact reference runs float32 only
    with pytest.raises(ValueError, match="has no kernel path 'bf16'"):
        LinearFloat32().kernel_path("bf16")
    with pytest.raises(ValueError, match="kernel_path='avx'"):
        Int8WeightOnly().kernel_path("avx")
    monkeypatch.setenv(KERNEL_PATH_ENV, "fp32")
    assert Int4WeightOnly().kernel_path() == "fp32" and Int4WeightOnly().kernel_path("bf16") == "bf16"
    monkeypatch.setenv(KERNEL_PATH_ENV, "bf16")
    assert Int8WeightOnly().kernel_path() == "bf16"
    assert LinearFloat32().kernel_path() == "fp32"  # the environment applies only where the path exists
    monkeypatch.setenv(KERNEL_PATH_ENV, "auto")
    assert Int8WeightOnly().kernel_path() == cpu_kernels().default_path
    monkeypatch.setenv(KERNEL_PATH_ENV, "gpu")
    with pytest.raises(ValueError, match=KERNEL_PATH_ENV):
        Int8WeightOnly().kernel_path()


@pytest.mark.parametrize("packer", QUANTISED, ids=lambda p: p.id)
def test_a_cache_built_on_one_path_is_a_hit_on_the_other(tmp_path: Path, packer: TorchPacker) -> None:
    reference = _toy()
    source = save_safetensors(reference, tmp_path / "toy.safetensors")
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    outputs, platforms = {}, set()
    for path in ("bf16", "fp32"):
        with torch.device("meta"):
            model = Toy()
        expected_platform = platform_for([packer, Float32()])
        cache = packcache.WeightCache(tmp_path / "toy.pcache", platform=expected_platform)
        report = convert(model, cache, packer, source=SafetensorsFile(source), kernel_path=path)
        assert report.kernel_path == path and {
            m.kernel_path for m in model.modules() if isinstance(m, PackedLinear)
        } == {path}
        platforms.add(cache.platform)
        assert report.stats.state == ("stored" if path == "bf16" else "mapped"), report.stats
        with torch.inference_mode():
            outputs[path] = model(x)
        cache.close()
    assert len(platforms) == 1  # the path is not part of the platform fingerprint
    with torch.inference_mode():
        exact = reference(x)
    tolerance = 0.1 * float(exact.abs().max())  # int4 of a random toy layer, then bf16 rounding
    for path, got in outputs.items():
        assert got.dtype == torch.float32
        assert float((got - exact).abs().max()) < tolerance, path
    assert float((outputs["bf16"] - outputs["fp32"]).abs().max()) < tolerance


# ------------------------------------------------------------------ int4 layout


@pytest.mark.parametrize("shape", [(80, 64), (1536, 384), (384, 1536), (48, 32), (16, 128)])
def test_int4_codes_are_read_back_from_torchs_layout(shape: tuple[int, int]) -> None:
    layout = int4_layout()
    if cpu_kernels().capability in ("AVX2", "AVX512"):
        assert layout is not None, "torch's AVX2/AVX512 int4 layouts are known"
    if layout is None:
        assert "_weight_int4pack_mm_for_cpu" in Int4WeightOnly().kernel("fp32", 10_000)  # only torch's kernel reads it
        return
    codes = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(layout.codes_t(packed, *shape).t().to(torch.int32), codes)


def test_derived_operands_wait_for_the_first_forward() -> None:
    layer = _layer(Int4WeightOnly(32), "bf16")
    assert layer._prepared is None  # a load maps only; nothing is converted until the layer runs
    _run(layer, 2)
    prepared = layer._prepared
    assert prepared is not None and prepared["input_scales"] is not None
    assert prepared["input_scales"].dtype == torch.bfloat16
    assert prepared["weight"] is layer.get_buffer("weight")  # the packed bytes themselves, not a copy


class _MisreadInt8(Int8WeightOnly):
    """An int8 packer whose kernel reads the layout wrong on one path (as a new torch might)."""

    id = "test.int8-misread"
    wrong_path = "fp32"

    def linear(self, operands: Any, x: torch.Tensor, path: str) -> torch.Tensor:
        y = super().linear(operands, x, path)
        return -y if path == self.wrong_path else y


@pytest.mark.parametrize("wrong_path", ["fp32", "bf16"])
def test_a_kernel_that_misreads_the_layout_fails_loudly_on_the_path_that_runs(wrong_path: str) -> None:
    """The self-check runs on the default path at the fingerprint, and on a forced path at the first
    layer that runs it; a path no layer runs is not checked (its first kernel calls cost time)."""
    packer = type(
        f"Misread{wrong_path}", (_MisreadInt8,), {"wrong_path": wrong_path, "id": f"test.misread-{wrong_path}"}
    )()
    parts = packer.pack(np.ones((8, 64), np.float32), "F32")
    default = packer.kernel_path(None)
    other = next(p for p in packer.paths if p != default)
    if wrong_path == default:
        with pytest.raises(packcache.PackResultError, match=f"self-check.*path {wrong_path}"):
            packer.fingerprint()
        with pytest.raises(packcache.PackResultError, match="bump the packer's version"):
            PackedLinear.from_parts(packer, parts, None, kernel_path=wrong_path)
        PackedLinear.from_parts(packer, parts, None, kernel_path=other)  # the right path still loads
    else:
        packer.fingerprint()  # the default path reads the layout right: nothing to say
        with pytest.raises(packcache.PackResultError, match=f"self-check.*path {wrong_path}"):
            PackedLinear.from_parts(packer, parts, None, kernel_path=wrong_path)


def test_the_self_check_reuses_the_fingerprints_pack() -> None:
    """A process's first fingerprint packs the fingerprint input twice (the determinism check) and no
    more: the kernel self-check runs on that pack, it does not pack a third time."""
    calls: list[int] = []

    class Counting(Int8WeightOnly):
        id = "test.int8-counting"

        def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Any:
            calls.append(1)
            return super().pack(source, dtype, stats)

    packer = Counting()
    packer.fingerprint()
    assert len(calls) == 2
    PackedLinear.from_parts(packer, packer.fingerprint_pack(), None, kernel_path="fp32")  # another path's check
    assert len(calls) == 2
