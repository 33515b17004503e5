"""Kernel paths (packcache.kernels): chosen from the CPU's flags, forced for tests, never part of a cache's identity.

The "no reference kernel" checks are functional: they observe, at torch's dispatcher, which op
each packed layer calls and the dtype of what it receives. Speed is measured in benchmarks/ only.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import packcache
from harness import save_safetensors
from packcache.kernels import KERNEL_PATH_ENV, activation_dtype, cpu_kernels
from packcache.packers import Float32, platform_for
from packcache.packers_torch import (
    NATIVE_ISAS,
    Int4WeightOnly,
    Int8WeightOnly,
    LinearBFloat16,
    LinearFloat32,
    TorchPacker,
    dequantize_int4_rows,
)
from packcache.quantize import pack_int4_rows
from packcache.safetensors import SafetensorsFile
from packcache.torch import PackedLinear, check_kernels, convert

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
    check_kernels(layer)  # the first forward's self-check runs its own (float32 reference) ops: not watched here
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
    assert set(cpu.flags()) >= {"cpu_capability", "native_bf16", "default_path"}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 flags from /proc/cpuinfo")
@pytest.mark.parametrize("packer", [*QUANTISED, LinearBFloat16()], ids=lambda p: p.id)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "without-compiled"])
def test_no_packed_layer_falls_back_to_a_reference_kernel(
    packer: TorchPacker, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:
        # What a CPU the compiled kernels do not run on gets: the path's GEMM over the weight dequantised per call
        # (torch has no kernel for int8's blocks nor int4's row-major layout).
        for op in NATIVE_ISAS:
            monkeypatch.setitem(NATIVE_ISAS, op, ())
    flags = _cpu_flags()
    layer = _layer(packer)  # the path this machine's rule picks
    native = ("avx512_bf16" in flags or "amx_bf16" in flags) and cpu_kernels().onednn_bf16
    if native:
        assert layer.kernel_path == "bf16", "native bf16 flags, yet the packed layer does not run bf16"
    vectorised = "avx2" in flags  # torch dispatches its AVX2 or AVX512 kernels on such a CPU
    weight_only_seen = 0
    for rows in (1, 7, 300):
        seen = _run(layer, rows)
        if layer.kernel(rows).startswith("packcache "):  # the compiled kernel (packcache.native): no torch op at all
            assert not seen.of(WEIGHT_ONLY_KERNELS) and not seen.of(GEMMS), (layer.kernel(rows), rows)
            continue
        for name, dtypes in seen.of(WEIGHT_ONLY_KERNELS):
            weight_only_seen += 1
            # Given float32 activations these ops run their scalar reference loop.
            assert not vectorised or dtypes[0] == torch.bfloat16, (name, dtypes, rows)
        gemms = seen.of(GEMMS)
        if native:
            assert all(set(dtypes) == {torch.bfloat16} for _, dtypes in gemms), (gemms, rows)
        assert seen.of(WEIGHT_ONLY_KERNELS) or gemms, f"no kernel observed for {rows} rows"
    if not compiled and isinstance(packer, (Int8WeightOnly, Int4WeightOnly)):
        assert weight_only_seen == 0, "torch's weight-only kernels read neither int8's blocks nor int4's layout"


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
        if layer.kernel(rows).startswith("packcache "):  # the compiled kernel: no torch op
            # int8's and int4's quantise the activations to int8; dense (bf16) reads the path's, widened to float32
            quantising = isinstance(packer, (Int8WeightOnly, Int4WeightOnly))
            assert expected_dtype == (torch.int8 if quantising else activation_dtype(path))
            assert not seen.of(WEIGHT_ONLY_KERNELS) and not seen.of(GEMMS)
        elif layer.kernel(rows).startswith("_weight_"):
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


@pytest.mark.parametrize("shape", [(80, 64), (1536, 384), (384, 1536), (48, 32), (16, 96)])
def test_int4_weights_are_read_back_from_the_row_major_layout(shape: tuple[int, int]) -> None:
    # torch's unpacking (the per-call dequantisation, float_weight) reads what pack_int4_rows wrote, a half unit too
    rng = np.random.default_rng(shape[0])
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (shape[0], shape[1] // 32)).astype(np.float32)
    zeros = rng.uniform(-0.1, 0.1, (shape[0], shape[1] // 32)).astype(np.float32)
    pairs = torch.from_numpy(np.stack([scales, zeros], axis=-1)).to(torch.bfloat16)
    got = dequantize_int4_rows(torch.from_numpy(pack_int4_rows(codes)), pairs, None, torch.float32)
    scale, zero = (np.repeat(pairs[..., i].float().numpy(), 32, axis=1) for i in (0, 1))
    np.testing.assert_allclose(got.numpy(), (codes.astype(np.float64) - 8) * scale + zero, rtol=0, atol=1e-6)


def test_derived_operands_wait_for_the_first_forward() -> None:
    packer = Int4WeightOnly(32)
    weight = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) * np.float32(0.05)
    x = np.random.default_rng(1).standard_normal((512, 128)) * np.geomspace(0.05, 20, 128)
    parts = packer.checked_pack(weight, "F32", x.T @ x / 512)  # calibrated: input scales that are not all ones
    assert not np.all(parts["input_scales"] == 1)
    layer = PackedLinear.from_parts(packer, parts, None, kernel_path="bf16")
    assert layer._prepared is None  # a load maps only; nothing is converted until the layer runs
    _run(layer, 2)
    prepared = layer._prepared
    assert prepared is not None and prepared["input_scales"] is not None
    assert prepared["input_scales"].dtype == torch.float32
    assert prepared["weight"] is layer.get_buffer("weight")  # the packed bytes themselves, not a copy
    assert prepared["scales_and_zeros"] is layer.get_buffer("scales_and_zeros")  # stored as the kernel takes them


class _Produced(TorchDispatchMode):
    """Every aten op that runs, with the dtype and shape of each tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for out in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(out, torch.Tensor):
                self.outputs.append((func.overloadpacket.__name__, out.dtype, tuple(out.shape)))
        return result


def _produced(layer: PackedLinear, rows: int) -> _Produced:
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
    layer(x)  # the first forward derives the operands, once: not what a call does afterwards
    with torch.inference_mode(), _Produced() as seen:
        layer(x)
    return seen


@pytest.mark.parametrize("path", ["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 300])
def test_the_bf16_scheme_never_widens_its_weight_per_call(path: str, rows: int) -> None:
    """Issue 22: on the fp32 path the bf16 weight was converted to float32 at every call, 78 % of a decode on a
    CPU without native bf16. No call makes a tensor of the weight's size any more, on either path."""
    layer = _layer(LinearBFloat16(), path)
    seen = _produced(layer, rows)
    weight_sized = [out for out in seen.outputs if out[2] in ((64, 128), (128, 64))]
    assert not weight_sized, weight_sized
    if layer.kernel(rows).startswith("packcache dense"):  # the compiled kernel (packcache.native) reads it in place
        assert not any(op in GEMMS for op, _, _ in seen.outputs)
    else:
        assert any(op in GEMMS for op, _, _ in seen.outputs)
        assert layer.kernel(rows).endswith("linear(bfloat16)")


@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_an_int4_decode_call_converts_neither_its_scales_nor_its_input(path: str) -> None:
    """Issue 22: the float32 scales were converted to bf16 at every call (11 % of a 1 B model's decode) and the
    activations multiplied by all-ones input scales. Versions 2 and 3 store bf16 scales, which the kernel reads."""
    layer = _layer(Int4WeightOnly(32), path)
    assert layer.get_buffer("scales_and_zeros").dtype == torch.bfloat16
    seen = _produced(layer, 1)
    scales_sized = [out for out in seen.outputs if out[2] == (64, 128 // 32, 2)]
    assert not scales_sized, scales_sized
    assert not [out for out in seen.outputs if out[0] == "mul"], seen.outputs
    if layer.kernel(1).startswith("packcache int4"):  # the compiled kernel: no torch kernel, no weight-sized tensor
        assert not [out for out in seen.outputs if out[0].startswith("_weight_int4pack")], seen.outputs
        assert not [out for out in seen.outputs if out[2] in ((64, 128), (128, 64), (64, 64))], seen.outputs
    else:
        assert layer.kernel(1).startswith("int4 weight to")


class _MisreadInt8(Int8WeightOnly):
    """An int8 packer whose kernel reads the layout wrong on one path (as a new torch might)."""

    id = "test.int8-misread"
    wrong_path = "fp32"

    def linear(self, operands: Any, x: torch.Tensor, path: str) -> torch.Tensor:
        y = super().linear(operands, x, path)
        return -y if path == self.wrong_path else y


@pytest.mark.parametrize("wrong_path", ["fp32", "bf16"])
def test_a_kernel_that_misreads_the_layout_fails_loudly_on_the_path_that_runs(
    wrong_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The self-check runs on the path a layer runs, at its first forward (or ``check_kernels``), before any
    output exists, whichever way the path was chosen (argument, environment, the rule); a path no layer
    runs is not checked (its first kernel calls cost time), a load checks none (it only maps), and the
    fingerprint, the same on every path, checks none."""
    monkeypatch.delenv(KERNEL_PATH_ENV, raising=False)
    packer = type(
        f"Misread{wrong_path}", (_MisreadInt8,), {"wrong_path": wrong_path, "id": f"test.misread-{wrong_path}"}
    )()
    parts = packer.pack(np.ones((8, 64), np.float32), "F32")
    other = next(p for p in packer.paths if p != wrong_path)
    x = torch.ones(2, 64)
    packer.fingerprint()  # no path: nothing to say
    assert PackedLinear.from_parts(packer, parts, None, kernel_path=other)(x).shape == (2, 8)  # the right path runs
    wrong = PackedLinear.from_parts(packer, parts, None, kernel_path=wrong_path)  # loading runs no kernel
    for _ in range(2):  # the first forward refuses, and so does every later one: no output is ever returned
        with pytest.raises(packcache.PackResultError, match=f"self-check.*path {wrong_path}.*bump the packer's"):
            wrong(x)
    monkeypatch.setenv(KERNEL_PATH_ENV, wrong_path)
    model = nn.Sequential(nn.Linear(64, 8))
    convert(model, packcache.WeightCache(None), packer, model_id="toy")
    with pytest.raises(packcache.PackResultError, match=f"self-check.*path {wrong_path}"):
        check_kernels(model)  # what a service calls to fail its start rather than its first request
    with pytest.raises(packcache.PackResultError, match=f"self-check.*path {wrong_path}"):
        model(x)
    if cpu_kernels().default_path == wrong_path:
        monkeypatch.delenv(KERNEL_PATH_ENV)
        with pytest.raises(packcache.PackResultError, match=f"self-check.*path {wrong_path}"):
            PackedLinear.from_parts(packer, parts, None)(x)


def test_the_self_check_reuses_the_fingerprints_pack() -> None:
    """A process's first fingerprint packs the fingerprint input once (the determinism check waits for a
    real pack) and no more: the kernel self-check runs on that pack, it does not pack it again (where a compiled
    kernel runs it also packs its own probe once, the first of ``packers_torch.NATIVE_PROBE_SHAPES`` it takes)."""
    from packcache.packers import FINGERPRINT_SHAPE
    from packcache.packers_torch import NATIVE_PROBE_SHAPES

    calls: list[tuple[int, ...]] = []

    class Counting(Int8WeightOnly):
        id = "test.int8-counting"

        def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Any:
            calls.append(tuple(source.shape))
            return super().pack(source, dtype, stats)

    packer = Counting()
    packer.fingerprint()
    assert calls == [FINGERPRINT_SHAPE]
    check_kernels(nn.Sequential(PackedLinear.from_parts(packer, packer.fingerprint_pack(), None, kernel_path="fp32")))
    native_probe = [NATIVE_PROBE_SHAPES[0]] if packer.kernel("fp32", 1).startswith("packcache ") else []
    assert calls == [FINGERPRINT_SHAPE, *native_probe]


# ------------------------------------------------------------------ an explicit choice wins over the environment


def _fresh(code: str, tmp_path: Path, env_value: str | None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (fingerprints and self-checks are computed once per process)
    with ``$PACKCACHE_KERNEL_PATH`` set to ``env_value`` (``None``: unset)."""
    env = {k: v for k, v in os.environ.items() if k != KERNEL_PATH_ENV}
    if env_value is not None:
        env[KERNEL_PATH_ENV] = env_value
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )  # fmt: skip


def _other_path() -> str:
    """The path this machine's rule does not pick."""
    return next(p for p in ("bf16", "fp32") if p != cpu_kernels().default_path)


@pytest.mark.parametrize("env_value", ["gpu", "BF16"])
def test_an_explicit_kernel_path_wins_over_an_invalid_environment_value(tmp_path: Path, env_value: str) -> None:
    """Every scheme, as the loaders call it (the platform first, then ``convert``), and ``minilm.load``:
    ``kernel_path="fp32"`` (or ``"auto"``) runs whatever ``$PACKCACHE_KERNEL_PATH`` holds. The packers'
    fingerprint used to read the variable regardless, so a bad value failed every explicit choice."""
    code = """
        import torch, packcache
        from packcache.models import minilm
        from packcache.packers import SCHEMES, Float32, platform_for
        from packcache.kernels import cpu_kernels
        from packcache.torch import PackedLinear, convert, scheme_packer

        for scheme in SCHEMES:
            for choice, expected in (("fp32", "fp32"), ("auto", None)):
                packer = scheme_packer(scheme)
                expected = expected or (cpu_kernels().default_path if "bf16" in packer.paths else "fp32")
                platform = platform_for([packer, Float32()])
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
                reference = model(torch.ones(2, 64))
                cache = packcache.WeightCache(f"{scheme}-{choice}.pcache", platform=platform)
                report = convert(model, cache, packer, model_id="toy", kernel_path=choice)
                assert report.kernel_path == expected, (scheme, choice, report.kernel_path)
                assert {m.kernel_path for m in model.modules() if isinstance(m, PackedLinear)} == {expected}
                with torch.inference_mode():
                    got = model(torch.ones(2, 64))
                assert float((got - reference).abs().max()) < 0.1, (scheme, choice)
                cache.close()
        m = minilm.load("int8", cache=False, kernel_path="fp32")
        assert m.kernel_path == "fp32" and m.embed(["an explicit choice"]).shape == (1, 384)
        print("ok")
    """
    done = _fresh(code, tmp_path, env_value)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_an_explicit_kernel_path_runs_no_self_check_of_the_environments_path(tmp_path: Path) -> None:
    """With a valid ``$PACKCACHE_KERNEL_PATH`` naming the other path, an explicit choice checks only the
    path that runs: the environment's path costs no kernel call (and cannot fail the load)."""
    code = f"""
        import torch, packcache
        from packcache import packers_torch
        from packcache.packers import Float32, platform_for
        from packcache.torch import convert, scheme_packer

        chosen = {cpu_kernels().default_path!r}
        for scheme in ("int8", "int4", "bf16"):
            packer = scheme_packer(scheme)
            platform = platform_for([packer, Float32()])
            model = torch.nn.Sequential(torch.nn.Linear(64, 32))
            convert(model, packcache.WeightCache(None), packer, model_id="toy", kernel_path=chosen)
            model(torch.zeros(1, 64))  # the first forward runs the self-check of the path it runs
        print(sorted({{key[-1] for key in packers_torch._CHECKED}}))
    """
    done = _fresh(code, tmp_path, _other_path())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == repr([cpu_kernels().default_path])


def test_serve_with_an_explicit_kernel_path_boots_its_workers_whatever_the_environment(tmp_path: Path) -> None:
    """``serve --kernel-path fp32`` under an invalid ``$PACKCACHE_KERNEL_PATH``: the worker loads (it
    used to fail to boot on the variable, and the server stopped) and reports path fp32."""
    env = {k: v for k, v in os.environ.items() if k not in (KERNEL_PATH_ENV, "PROMETHEUS_MULTIPROC_DIR")}
    env.update({KERNEL_PATH_ENV: "gpu", "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path)})
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    argv = ["serve", "--port", "0", "--workers", "1", "--torch-threads", "1", "--no-cache", "--scheme", "int8"]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "packcache", *argv, "--kernel-path", "fp32"],
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        deadline, info = time.monotonic() + 120, ""
        while time.monotonic() < deadline and not info:
            assert proc.poll() is None, f"the server exited {proc.returncode}: {err.read_text()[-3000:]}"
            url = next(
                (line.rsplit(" ", 1)[1] for line in out.read_text().splitlines() if "listening on " in line), None
            )
            if url is not None:
                try:
                    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                        text = response.read().decode()
                    info = next((line for line in text.splitlines() if line.startswith("packcache_worker_info{")), "")
                except OSError:
                    pass
            time.sleep(0.2)
        assert 'kernel_path="fp32"' in info, (info, err.read_text()[-3000:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_a_large_int8_weight_is_converted_block_by_block_with_the_same_answer(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a prefill converted each whole int8 weight to the activations' dtype per call (32 MiB of bf16 for
    an 8192x2048 layer), 1.7x slower than converting blocks of output channels that are used at once. Where the
    compiled kernels do not run, a weight above ``DEQUANT_BLOCK_BYTES`` is never converted whole, and the product
    is the whole conversion's."""
    from packcache.packers_torch import DEQUANT_BLOCK_BYTES

    monkeypatch.setitem(NATIVE_ISAS, "int8", ())
    monkeypatch.setitem(NATIVE_ISAS, "dense", ())
    out_features, in_features = 4096, 1280
    assert out_features * in_features * 2 > DEQUANT_BLOCK_BYTES  # past the budget in bf16 and in float32
    packer = Int8WeightOnly()
    weight = np.random.default_rng(0).standard_normal((out_features, in_features)).astype(np.float32)
    bias = np.random.default_rng(1).standard_normal(out_features).astype(np.float32)
    layer = PackedLinear.from_parts(packer, packer.checked_pack(weight, "F32"), bias, kernel_path=path)
    for rows in (1, 300):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        seen = _produced(layer, rows)
        whole = [out for out in seen.outputs if out[2] == (out_features, in_features)]
        assert not whole, whole
        with torch.inference_mode():
            got = layer(x).float()
            dtype = activation_dtype(path)
            reference = x.to(dtype).float() @ layer.float_weight().to(dtype).float().T + torch.from_numpy(bias)
        tolerance = 2e-2 if path == "bf16" else 1e-4
        assert float((got - reference).abs().max()) <= tolerance * float(reference.abs().max())
