"""The compiled kernels (packcache.native, csrc/kernels.c): built by the install, exact against a reference
that applies the same numerics, on every ISA this CPU runs, with threads, forks and the torch fallback."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packcache import format as fmt
from packcache import native
from packcache._generations import pwrite_all, read_committed, write_generation
from packcache.errors import PackResultError
from packcache.loader import scheme_packer
from packcache.packers import SCHEMES
from packcache.packers_torch import (
    NATIVE_ISAS,
    NATIVE_MAX_ROWS,
    Int4WeightOnly,
    Int8WeightOnly,
    LinearBFloat16,
    LinearFloat32,
    TorchPacker,
    as_tensor,
)
from packcache.quantize import pack_int4_rows, unpack_int4_rows
from packcache.torch import PackedEmbedding, PackedLinear, check_kernels

_LEVEL = {"avx512": 2, "avx2": 1}
#: Every code this CPU runs: the AVX512 code where it can, and the AVX2 code (what a CPU without AVX512 runs) always.
CPU_ISAS = [isa for isa, level in _LEVEL.items() if native.status().cpu and level <= _LEVEL[native.status().cpu]]


def test_the_install_built_the_compiled_kernels_and_this_cpu_runs_them():
    # scripts/setup.sh installs packcache with its C extension; without it every decode silently runs torch's
    # kernels, which is what this suite must not let pass unnoticed on an x86 machine with a compiler.
    state = native.status()
    assert state.library is not None, state.reason
    assert state.isa in ("avx512", "avx2"), state.reason
    assert CPU_ISAS, state


def _quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation numerics: per row, blocks of 32, scale amax/127, round half to even, clip +-127."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32).astype(np.float32)
    scale = (np.abs(blocks).max(axis=2) / np.float32(127.0)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1.0) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
    return codes, scale


def _quantize_lanes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 product's activation numerics: per row, blocks of 4 (one int32 lane), scale amax/127, round half to
    even of x * (1 / scale), clip +-127."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 4, 4).astype(np.float32)
    scale = (np.abs(blocks).max(axis=2) / np.float32(127.0)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1.0) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    return np.clip(np.rint(blocks * inv[..., None]), -127, 127), scale


def _block_scales(rng: np.random.Generator, n: int, k: int) -> torch.Tensor:
    """Random bfloat16 block scales ``[n, k / 32]`` of an int8 pack."""
    return torch.from_numpy(rng.uniform(1e-3, 1e-1, (n, k // 32)).astype(np.float32)).to(torch.bfloat16)


def _int8_reference(x: np.ndarray, w: np.ndarray, scales: torch.Tensor, bias: np.ndarray | None) -> np.ndarray:
    codes, lane_scale = _quantize_lanes(x)
    n, k = w.shape
    dots = np.einsum("mlk,nlk->mnl", codes.astype(np.float64), w.astype(np.float64).reshape(n, k // 4, 4))  # exact
    weight_scale = np.repeat(scales.double().numpy(), 8, axis=1)  # a block of 32 is 8 lanes
    y = (dots * lane_scale[:, None, :].astype(np.float64) * weight_scale[None]).sum(axis=2)
    return y + bias if bias is not None else y


def _bf16(t: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(t).to(torch.bfloat16)


def _call(op: str, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
          isa: str, threads: int = 2) -> torch.Tensor:  # fmt: skip
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype)
    dtype = native.BFLOAT16 if x.dtype == torch.bfloat16 else native.FLOAT32
    lib = native._library()
    lib.pc_set_threads(threads)
    native._threads[0] = threads
    level = {"avx512": 2, "avx2": 1}[isa]
    bias_ptr = None if bias is None else bias.data_ptr()
    if op == "int8":
        assert scales is not None and scales.dtype == torch.bfloat16
        rc = lib.pc_int8(
            x.data_ptr(), dtype, rows, k, weight.data_ptr(), scales.data_ptr(), n, bias_ptr, y.data_ptr(), dtype, level
        )
    else:
        rc = lib.pc_bf16(x.data_ptr(), dtype, rows, k, weight.data_ptr(), n, bias_ptr, y.data_ptr(), dtype, level)
    assert rc == 0, os.strerror(-rc)
    return y


SHAPES = [(1, 64, 1), (1, 2048, 1000), (3, 128, 37), (5, 256, 129), (64, 192, 24)]


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_products_equal_the_reference_with_the_same_activation_quantisation(isa, rows, k, n, with_bias):
    rng = np.random.default_rng(rows * 7919 + k + n)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 4.0, (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0  # all-zero blocks: scale 0, codes 0
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scales = _block_scales(rng, n, k)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    expected = _int8_reference(x, w, scales, bias)
    got = _call("int8", torch.from_numpy(x), torch.from_numpy(w), scales,
                None if bias is None else torch.from_numpy(bias), isa)  # fmt: skip
    # integer dot products are exact; only float32 summation order differs from the float64 reference
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows", [*range(1, 21), 33, 50, 101])
def test_int8_tiles_of_every_row_count_equal_the_reference(isa, rows):
    # The int8 kernel runs one weight row at a time for one activation row, else tiles of 2 weight rows x up to 4
    # activation rows in blocks of 48, a chunk of K at a time: every remainder of activation rows (1..4 past each
    # tile, past a block of 48), an odd weight row past the last whole tile on each thread's share and a K past
    # whole chunks (1024 + 1024 + 64) meet the reference.
    rng = np.random.default_rng(rows)
    k, n = 2112, 83
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 4.0, (rows, 1))).astype(np.float32)
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scales = _block_scales(rng, n, k)
    bias = rng.standard_normal(n).astype(np.float32)
    expected = _int8_reference(x, w, scales, bias)
    for threads in (1, 2):
        got = _call("int8", torch.from_numpy(x), torch.from_numpy(w), scales, torch.from_numpy(bias), isa, threads)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # A row's numbers do not depend on the rows beside it (a sequence's tokens on what else is in the batch).
    alone = [_call("int8", torch.from_numpy(x[m : m + 1]), torch.from_numpy(w), scales, torch.from_numpy(bias), isa)
             for m in range(rows)]  # fmt: skip
    assert torch.equal(got, torch.cat(alone))


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_bf16_products_equal_float64_products_of_the_bf16_operands(isa, rows, k, n):
    rng = np.random.default_rng(rows + k * 31 + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = _bf16(rng.standard_normal((n, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    expected = _bf16(x).double() @ w.double().T + bias.double()
    for xt in (torch.from_numpy(x), _bf16(x)):
        got = _call("bf16", xt, w, None, bias, isa)
        assert got.dtype == xt.dtype
        tol = 1e-4 if xt.dtype == torch.float32 else 1e-2  # a bf16 output is rounded to bf16
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows", [2, 16])
def test_one_thread_and_two_threads_compute_the_same_bits(isa, rows):
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
    w = torch.from_numpy(rng.integers(-127, 128, (4099, 512), dtype=np.int8))
    scales = _block_scales(rng, 4099, 512)
    one = _call("int8", x, w, scales, None, isa, threads=1)
    two = _call("int8", x, w, scales, None, isa, threads=2)
    assert torch.equal(one, two)


# ------------------------------------------------------------------ dense: one sum order at every row count

DENSE_WEIGHTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _dense_operands(kind: str, n: int, k: int, seed: int) -> tuple[native.Bound, np.ndarray]:
    """A bound dense layer of ``kind`` weights ``[n, k]`` with a bias (and int8 scales), and its exact float64
    weight (what the kernel multiplies by: each weight widened exactly, times its scale)."""
    rng = np.random.default_rng(seed)
    if kind == "int8":
        codes = rng.integers(-127, 128, (n, k), dtype=np.int8)
        scales = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
        tensors = {"weight": torch.from_numpy(codes), "scales": torch.from_numpy(scales)}
        exact = codes.astype(np.float64) * scales.astype(np.float64)[:, None]
    else:
        weight = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(DENSE_WEIGHTS[kind])
        tensors = {"weight": weight}
        exact = weight.double().numpy()
    tensors["bias"] = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    layout = {part: (t.dtype, tuple(t.shape)) for part, t in tensors.items()}
    return native.bind(layout, tensors), exact


@pytest.mark.parametrize("kind", DENSE_WEIGHTS)
@pytest.mark.parametrize("rows,k,n", [(1, 8, 1), (3, 64, 5), (50, 1032, 83), (97, 384, 130)])
def test_dense_products_equal_float64_products_of_the_widened_weights(kind, rows, k, n):
    # 1032 = two chunks of K and a part of one; 83 and 130 outputs leave a remainder past the tiles of 4; 50 and 97
    # rows cross the blocks of 48 rows and end inside a tile of 3.
    bound, exact = _dense_operands(kind, n, k, seed=rows + k + n)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    expected = x.astype(np.float64) @ exact.T + bound["bias"].double().numpy()
    for xt in (torch.from_numpy(x), torch.from_numpy(x).to(torch.bfloat16)):
        got = native.dense_product(xt, bound, 2)
        assert got.dtype == xt.dtype and got.shape == (rows, n)
        reference = (
            expected if xt.dtype == torch.float32 else xt.double().numpy() @ exact.T + bound["bias"].double().numpy()
        )
        tol = 1e-5 if xt.dtype == torch.float32 else 1e-2  # a bfloat16 output is rounded to bfloat16
        np.testing.assert_allclose(got.double().numpy(), reference, rtol=tol, atol=tol * np.abs(reference).max())


@pytest.mark.parametrize("kind", DENSE_WEIGHTS)
def test_a_dense_row_has_the_same_bits_alone_and_in_any_batch_on_any_thread_count(kind):
    k, n = 1032, 83
    bound, _ = _dense_operands(kind, n, k, seed=7)
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((200, k)).astype(np.float32))
    alone = torch.cat([native.dense_product(x[i : i + 1], bound, 1) for i in range(200)])
    for rows in (2, 3, 4, 5, 47, 48, 49, 96, 97, 200):
        for threads in (1, 2):
            assert torch.equal(native.dense_product(x[:rows], bound, threads), alone[:rows]), (rows, threads)
    # and inside the batch, at any offset: rows 100.. of a batch are the same rows alone
    assert torch.equal(native.dense_product(x[100:], bound, 2), alone[100:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_weight_s_dense_product_never_hands_the_kernel_a_scales_part_it_did_not_check(dtype):
    """The float32 and bfloat16 products read no scales, so they check none: a ``scales`` part bound beside such a
    weight (here one element for 8 outputs, which the C code would read 8 floats past) is not passed to the kernel,
    and the result is the unscaled product."""
    n, k = 8, 64
    weight = torch.from_numpy(np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)).to(dtype)
    tensors = {"weight": weight, "scales": torch.full((1,), 2.0)}
    bound = native.bind({part: (t.dtype, tuple(t.shape)) for part, t in tensors.items()}, tensors)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((3, k)).astype(np.float32))
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(native.dense_product(x, bound, 1), expected, rtol=1e-5, atol=1e-5)


def test_dense_calls_the_kernel_does_not_take_are_refused_with_an_errno():
    lib = native._library()
    x, w, s, y = torch.zeros(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), torch.empty(2, 8)
    top = {"avx512": 2, "avx2": 1}[native.status().cpu]
    ok = lib.pc_dense(x.data_ptr(), 0, 2, 64, w.data_ptr(), 2, s.data_ptr(), 8, None, y.data_ptr(), 0, top)
    assert ok == 0
    assert lib.pc_dense(x.data_ptr(), 0, 2, 60, w.data_ptr(), 2, s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_dense(x.data_ptr(), 0, 2, 64, w.data_ptr(), 2, None, 8, None, y.data_ptr(), 0, top) == -22  # scales
    assert lib.pc_dense(x.data_ptr(), 0, 2, 64, w.data_ptr(), 3, s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_dense(x.data_ptr(), 0, 0, 64, w.data_ptr(), 2, s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_dense(x.data_ptr(), 0, 2, 64, w.data_ptr(), 2, s.data_ptr(), 8, None, y.data_ptr(), 0, 3) == -95
    with pytest.raises(native.NativeError, match="compiled dense product reads a float32, bfloat16 or int8"):
        native.dense_product(
            x, native.bind({"weight": (torch.int16, (8, 64))}, {"weight": torch.zeros(8, 64, dtype=torch.int16)}), 1
        )


def test_calls_the_kernels_do_not_take_are_refused_with_an_errno():
    lib = native._library()
    x = torch.zeros(65, 64)
    w = torch.zeros(8, 64, dtype=torch.int8)
    s = torch.ones(8, 2, dtype=torch.bfloat16)
    y = torch.empty(65, 8)
    top = {"avx512": 2, "avx2": 1}[native.status().cpu]
    assert lib.pc_int8(x.data_ptr(), 0, 65, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == 0
    assert lib.pc_int8(x.data_ptr(), 0, 0, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_int8(x.data_ptr(), 0, 1, 48, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_int8(x.data_ptr(), 7, 1, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_int8(x.data_ptr(), 0, 1, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, 3) == -95
    assert lib.pc_bf16(x.data_ptr(), 0, 65, 64, w.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22  # past 64 rows
    narrow = Int8WeightOnly().bind({"weight": torch.zeros(8, 32, dtype=torch.int8), "scales": s[:, :1].contiguous()})
    with pytest.raises(native.NativeError, match="reads 'weight' as int8 \\[8, 64\\]"):
        native.int8_product(torch.zeros(1, 64), narrow, 2)


def test_the_stream_probe_reads_every_word():
    data = np.random.default_rng(5).integers(0, 2**63, 1 << 17, dtype=np.uint64)
    data[-1] ^= np.uint64(0xDEADBEEF)  # the last word counts too
    expected = int(np.bitwise_xor.reduce(data))
    assert native.stream(data, 2) == expected
    assert native.stream(memoryview(data.tobytes()), 1) == expected
    with pytest.raises(ValueError):
        native.stream(data[::2], 1)  # a buffer with gaps: no address and byte count describe it


def _child(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != native.NATIVE_ENV}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_a_fork_child_that_runs_torch_on_one_thread_runs_the_compiled_products_too():
    # The products run on torch's OpenMP threads (csrc/kernels.c, "threads"), so a fork child is as safe as torch's
    # own ops there: with torch 2.13's libgomp a child of a parent that ran a parallel region hangs in its first
    # one (a 1024x1024 matmul does), and the known recipe is one thread in the child. The products follow torch's
    # thread count, so the recipe covers them: no parallel region, no hang, the right numbers.
    result = _child(
        """
        import os, torch
        from packcache.packers_torch import Int8WeightOnly, as_tensor
        torch.set_num_threads(2)
        packer = Int8WeightOnly()
        parts = packer.pack(torch.ones(4096, 2048).numpy(), "F32")
        ops = packer.prepare({**{p: as_tensor(a, packer.part_dtypes().get(p)) for p, a in parts.items()}, "bias": None},
                             "fp32")
        x = torch.ones(1, 2048)
        assert "packcache int8" in packer.kernel("fp32", 1)
        first = packer.linear(ops, x, "fp32")  # the parent runs a parallel region
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            again = packer.linear(ops, x, "fp32")
            os._exit(0 if torch.equal(again, first) and abs(float(again[0, 0]) - 2048.0) < 1.0 else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


def _packer_kernels_code() -> str:
    return """
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
        from packcache import native
        from packcache.packers_torch import Int8WeightOnly, LinearBFloat16
        print(native.status().isa, "|", Int8WeightOnly().kernel("bf16", 1), "|", LinearBFloat16().kernel("fp32", 1))
    """


def test_the_environment_switches_the_compiled_kernels_off_or_to_their_avx2_code():
    off = _child(_packer_kernels_code(), {native.NATIVE_ENV: "off"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split("|")[0].strip() == "None"
    assert "int8 weight to bfloat16 per call + linear(bfloat16)" in off.stdout and "+ linear(bfloat16)\n" in off.stdout
    assert "INFO packcache compiled kernels not used (switched off by PACKCACHE_NATIVE=off)" in off.stderr

    avx2 = _child(_packer_kernels_code(), {native.NATIVE_ENV: "avx2"})
    assert avx2.returncode == 0, avx2.stderr
    assert avx2.stdout.startswith("avx2 |")
    assert "packcache int8 (avx2 code" in avx2.stdout and "packcache dense (avx2 code" in avx2.stdout

    bad = _child(_packer_kernels_code(), {native.NATIVE_ENV: "fast"})
    assert bad.returncode != 0
    assert "PACKCACHE_NATIVE='fast' is not a choice" in bad.stderr


def test_without_the_compiled_part_torch_runs_and_a_warning_says_why():
    # What an install without a C compiler gets: the module absent. A finder hides it; nothing else changes.
    code = """
        import importlib.abc, sys
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "packcache._kernels":
                    raise ModuleNotFoundError(name)
                return None
        sys.meta_path.insert(0, Hide())
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "packcache._kernels" else real(name, *a)
    """ + _packer_kernels_code()
    result = _child(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("|")[0].strip() == "None"
    assert "int8 weight to bfloat16 per call + linear(bfloat16)" in result.stdout
    assert "WARNING packcache compiled kernels not used (packcache._kernels is not installed" in result.stderr


def test_each_compiled_operation_runs_its_avx2_code_on_both_isa_levels():
    # one code on every CPU with AVX2 and FMA: the same numbers, and one answer per input, wherever it runs
    isa = native.status().isa
    for packer in (Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32)):
        assert packer.kernel("fp32", 1).startswith("packcache ") == (isa in NATIVE_ISAS[packer.native_op])
        assert "avx2 code" in packer.kernel("fp32", 1), packer.kernel("fp32", 1)
    assert NATIVE_ISAS == {"dense": ("avx512", "avx2"), "int4": ("avx512", "avx2"), "int8": ("avx512", "avx2")}


@pytest.mark.parametrize(
    ("packer", "path"),
    [(LinearFloat32(), "fp32")]
    + [
        (packer, path)
        for packer in (Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32))
        for path in ("bf16", "fp32")
    ],
    ids=lambda p: p if isinstance(p, str) else p.id,
)
def test_packed_layers_run_the_compiled_kernel_for_every_row_count_it_takes(packer, path, monkeypatch):
    # every row count, so a row's bits never depend on the batch
    monkeypatch.setitem(NATIVE_ISAS, packer.native_op, (native.status().isa,))
    rng = np.random.default_rng(11)
    source = rng.standard_normal((128, 256)).astype(np.float32)
    parts = packer.pack(source, "F32")
    operands = {p: as_tensor(a, packer.part_dtypes().get(p)) for p, a in parts.items()}
    operands["bias"] = torch.from_numpy(rng.standard_normal(128).astype(np.float32))
    prepared = packer.prepare(operands, path)
    weight = torch.from_numpy(packer.intended(source, "F32"))
    dtype = torch.bfloat16 if path == "bf16" else torch.float32
    assert NATIVE_MAX_ROWS[packer.native_op] is None
    for rows in (1, 4, 5, 64, 65, 300):
        assert packer.kernel(path, rows).startswith("packcache "), (rows, packer.kernel(path, rows))
        x = torch.from_numpy(rng.standard_normal((rows, 256)).astype(np.float32)).to(dtype)
        got = packer.linear(prepared, x, path)
        assert got.dtype == dtype and got.shape == (rows, 128)
        expected = x.float() @ weight.T + operands["bias"]
        assert float((got.float() - expected).abs().max()) <= packer.tolerance(path, rows), rows


def _int4_reference(x: np.ndarray, packer: Int4WeightOnly, source: np.ndarray) -> np.ndarray:
    """The int4 kernel's numerics in float64: with weight = code * scale + offset per group (offset = zero - 8 scale),
    y = x_q @ (code * scale)^T + x @ offset^T, x_q the activations quantised as for int8 (the codes' part runs on
    int8 activations; the offsets' on each block's exact sum)."""
    codes, scales, zeros, _ = packer._quantize(source, "F32", None)
    group = packer.group_size
    scale = np.repeat(scales.astype(np.float64).T, group, axis=1)  # scales and zeros: [in / group, out]
    offset = np.repeat(zeros.astype(np.float64).T, group, axis=1) - 8 * scale
    codes_x, block_scale = _quantize_blocks(x)
    xq = (codes_x * block_scale[..., None]).reshape(x.shape).astype(np.float64)
    return xq @ (codes.astype(np.float64) * scale).T + x.astype(np.float64) @ offset.T


#: (group, rows, k, n): every group size, with 288 inputs (a row ending in the half unit) and row counts that split
#: into the tiles unevenly, for group 32.
INT4_CASES = [
    (group, rows, k, n)
    for group in Int4WeightOnly.GROUP_SIZES
    for rows, k, n in [(1, 256, 64), (2, 512, 193), (1, 1024, 128), (5, 288, 37), (1, 96, 1)]
    if k % group == 0
]


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize(("group", "rows", "k", "n"), INT4_CASES)
def test_int4_products_read_the_row_major_layout(isa, group, rows, k, n):
    # The pack is the packer's (pack_int4_rows); the reference dequantises the same codes, scales and zeros in
    # float64 and applies the kernel's activation numerics, so only the kernel's float32 sums can differ.
    packer = Int4WeightOnly(group, activation_aware=False)
    rng = np.random.default_rng(group + k + n)
    source = rng.standard_normal((n, k)).astype(np.float32)
    parts = packer.pack(source, "F32")
    weight = as_tensor(parts["weight"])
    sz = as_tensor(parts["scales_and_zeros"], torch.bfloat16)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, 32:64] = 0.0
    expected = _int4_reference(x, packer, source)
    y = torch.empty(rows, n)
    rc = native._library().pc_int4(
        torch.from_numpy(x).data_ptr(), 0, rows, k, weight.data_ptr(), sz.data_ptr(), n, group, None, None,
        y.data_ptr(), 0, _LEVEL[isa],
    )  # fmt: skip
    assert rc == 0, os.strerror(-rc)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_the_int4_layout_is_low_nibbles_then_high_nibbles_per_unit_of_64():
    # What the compiled product reads, byte by byte: a unit's low nibbles are its first 32 codes, its high nibbles
    # the next 32; a row's last 32 features (288 = 4 units + 32) pair j with j + 16.
    codes = np.random.default_rng(0).integers(0, 16, (3, 288), dtype=np.uint8)
    packed = pack_int4_rows(codes)
    assert packed.shape == (3, 144)
    for unit in range(4):
        half = packed[:, 32 * unit : 32 * unit + 32]
        assert np.array_equal(half & 15, codes[:, 64 * unit : 64 * unit + 32])
        assert np.array_equal(half >> 4, codes[:, 64 * unit + 32 : 64 * unit + 64])
    assert np.array_equal(packed[:, 128:] & 15, codes[:, 256:272])
    assert np.array_equal(packed[:, 128:] >> 4, codes[:, 272:288])
    assert np.array_equal(unpack_int4_rows(packed), codes)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4_rows(np.full((1, 32), 16, np.uint8))
    with pytest.raises(ValueError, match="32 input features"):
        pack_int4_rows(np.zeros((1, 48), np.uint8))


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 16, 33, 49, 130])  # up to 4 walk the rows as one; past 48: 48 at a time
def test_int4_products_of_several_rows_are_each_rows_own_product_bit_for_bit(isa, group, rows):
    # Several rows unpack each unit once for a tile of up to 4 of them; each row's numbers are a one-row call's
    # (a decode step's own loop), for an odd number of outputs (the last tile of one weight row) and a half unit.
    packer = Int4WeightOnly(group, activation_aware=False)
    rng = np.random.default_rng(rows)
    k, n = (256, 193) if group == 64 else (288, 193)
    source = rng.standard_normal((n, k)).astype(np.float32)
    parts = packer.pack(source, "F32")
    weight = as_tensor(parts["weight"])
    sz = as_tensor(parts["scales_and_zeros"], torch.bfloat16)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    lib = native._library()

    def product(xs: torch.Tensor) -> torch.Tensor:
        y = torch.empty(xs.shape[0], n)
        rc = lib.pc_int4(xs.data_ptr(), 0, xs.shape[0], k, weight.data_ptr(), sz.data_ptr(), n, group, None,
                         bias.data_ptr(), y.data_ptr(), 0, _LEVEL[isa])  # fmt: skip
        assert rc == 0, os.strerror(-rc)
        return y

    together = product(x)
    assert torch.equal(together, torch.cat([product(x[m : m + 1].contiguous()) for m in range(rows)]))
    expected = _int4_reference(x.numpy(), packer, source) + bias.numpy()
    np.testing.assert_allclose(together.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_int4_packs_are_the_same_bytes_whatever_torchs_cpu_capability():
    # The layout is packcache's own: torch on an AVX2 CPU (ATEN_CPU_CAPABILITY=avx2 here) packs the same bytes as
    # this process, and the packer's self-check passes at the first forward on the compiled kernel.
    packer = Int4WeightOnly(32, activation_aware=False)
    source = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    here = hashlib.sha256(b"".join(a.tobytes() for a in packer.pack(source, "F32").values())).hexdigest()
    result = _child(
        """
        import hashlib
        import numpy as np, torch
        from packcache.packers_torch import Int4WeightOnly, as_tensor
        packer = Int4WeightOnly(32, activation_aware=False)
        source = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
        parts = packer.pack(source, "F32")
        digest = hashlib.sha256(b"".join(a.tobytes() for a in parts.values())).hexdigest()
        print(torch.backends.cpu.get_cpu_capability(), digest)
        ops = {p: as_tensor(a, packer.part_dtypes().get(p)) for p, a in parts.items()}
        ops["bias"] = None
        packer.check_path("fp32")
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32))
        got = packer.linear(packer.prepare(ops, "fp32"), x, "fp32")
        want = x @ torch.from_numpy(packer.intended(source, "F32")).T
        print(packer.kernel("fp32", 1), "|", float((got - want).abs().max() / want.abs().max()))
        """,
        {"ATEN_CPU_CAPABILITY": "avx2", native.NATIVE_ENV: "avx2"},
    )
    assert result.returncode == 0, result.stderr
    packed, kernel = result.stdout.strip().splitlines()
    assert packed == f"AVX2 {here}"
    name, error = kernel.split("|")
    assert name.strip().startswith("packcache int4 (avx2")
    assert float(error) < 0.02  # int8 activations per 32: ~1 % of the output's scale


@pytest.mark.parametrize("packer", [Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32)], ids=lambda p: p.id)
def test_a_pack_whose_parts_do_not_fit_the_layer_is_refused_before_the_kernel_reads_it(packer, monkeypatch):
    # A cache file's index gives each part's shape; the key that named the pack does not. A file holding, under the
    # right key, a part smaller than the layer needs would have the kernel read past it: refused when the layer's
    # operands are bound (its first forward, or check_kernels), before any kernel runs.
    monkeypatch.setitem(NATIVE_ISAS, packer.native_op, (native.status().isa,))
    source = np.random.default_rng(2).standard_normal((128, 256)).astype(np.float32)
    parts = packer.pack(source, "F32")
    shrunk = {name: np.ascontiguousarray(array[: array.shape[0] // 2]) for name, array in parts.items()}
    shrunk["weight"] = parts["weight"][:, : parts["weight"].shape[1] // 2].copy()  # half the input features
    layer = PackedLinear.from_parts(packer, shrunk, None, name="fc", shape=(128, 256))
    for use in (lambda: check_kernels(layer), lambda: layer(torch.ones(1, 256))):
        with pytest.raises(PackResultError, match=r"layer 'fc': packed operand .* does not fit this layer"):
            use()
    # Whatever layer the parts themselves describe, the kernel reads that layer's bytes and no more: activations
    # of another width are refused by the compiled product before the call.
    assert "packcache" in packer.kernel("fp32", 1)
    layer = PackedLinear.from_parts(packer, shrunk, None, kernel_path="fp32")
    try:
        prepared = layer._operands()
    except PackResultError:
        return  # the parts do not even agree with each other
    with pytest.raises(native.NativeError, match="input features"):
        packer.linear(prepared, torch.ones(1, 256), "fp32")


# ------------------------------------------------------------------ a cache file whose parts have another dtype
# The layer's check looked at each operand's shape, not its dtype. A file whose int8 pack held its scales as int8 [out]
# (or a float16 bias) loaded, and the C code read 4x (2x) the part's bytes: whatever followed them became scales and
# bias, and the logits garbage; past the end of the mapping the process died (SIGSEGV). torch's kernels read the
# int8 scales as numbers, and a bfloat16 weight stored as uint8 failed with a raw RuntimeError. Now the first forward
# (or check_kernels) refuses each, naming the layer and the part, before any kernel reads it. In a child: it could
# fault.

CAUSAL = "AutoModelForCausalLM"
#: The tiny Llama's vocabulary: its output head's scales (128 KiB) are far larger than the file's index.
VOCAB = 32768


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama with attention biases (transformers' config class, ``save_pretrained``), built into an int8
    and a bf16 cache file by ``packcache.hf``: each file holds the whole model."""
    import transformers

    from packcache import hf

    root = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attention_bias=True, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "checkpoint")
    files = {}
    for scheme in ("int8", "bf16"):
        files[scheme] = root / f"{scheme}.pcache"
        hf.from_pretrained(root / "checkpoint", scheme, files[scheme], auto_class=CAUSAL).packcache.close()
    return files


def retype_entry(path: Path, suffix: str, dtype: str, shape: tuple[int, ...]) -> None:
    """Commit a new generation of the cache file at ``path`` in which the entry named ``...suffix`` has ``dtype`` and
    ``shape``: its bytes the first ones of its old data, copied after every other pack (right before the new index),
    its checksum theirs. Every reader accepts the file; only the layer can tell."""
    fd = os.open(path, os.O_RDWR)
    try:
        header, slot, entries = read_committed(fd)
        assert slot is not None
        (name,) = [n for n in entries if n.endswith(suffix)]
        entry = entries[name]
        nbytes = int(np.prod(shape)) * np.dtype(fmt.numpy_dtype_str(dtype)).itemsize
        assert nbytes < entry.nbytes
        data = os.pread(fd, nbytes, entry.offset)
        offset = fmt.align_up(os.fstat(fd).st_size, header.alignment)
        pwrite_all(fd, data, offset)
        entries[name] = entry._replace(dtype=dtype, shape=shape, offset=offset, nbytes=nbytes, crc32=fmt.crc32(data))
        write_generation(
            fd, list(entries.values()), fmt.align_up(offset + nbytes, header.alignment), slot.generation + 1
        )
    finally:
        os.close(fd)


_ANSWERS = """
    import json, sys, torch
    from packcache import hf
    from packcache.torch import check_kernels
    for path, tokens in json.loads(sys.argv[1]):
        for start in (True, False):  # a server's start (check_kernels), or a first forward
            try:
                model = hf.from_pretrained(path)  # maps: the parts are checked at their first use
                if start:
                    check_kernels(model)
                with torch.inference_mode():  # 1 token: the compiled kernels of a decode step; 80: torch's kernels
                    logits = model(input_ids=torch.arange(1, tokens + 1)[None]).logits
            except Exception as error:
                print("refused", type(error).__name__, error, flush=True)
            else:
                print("answered", bool(logits.isfinite().all()), logits.flatten()[:3].tolist(), flush=True)
"""

_DOWN = "layer 'model.layers.0.mlp.down_proj': packed operand"
_HEAD = "layer 'lm_head': packed operand"
#: (scheme, entry, its new dtype and shape, tokens, what the load must say). Each entry's bytes are the first of its
#: old ones, moved after every other pack: what a kernel reads past them is the index, then the end of the mapping.
_RETYPED = {
    "int8-scales-as-int8": ("int8", "layers.0.mlp.down_proj.weight:torch.int8wo:scales", "i1", (64,), 1,
                            f"{_DOWN} 'scales' is int8 [64]; the layer needs bfloat16 [64, 4]"),
    # torch's kernels (more rows than the compiled ones take) read the same parts: the same rule, not torch's checks
    "int8-scales-as-int8-prefill": ("int8", "layers.0.mlp.down_proj.weight:torch.int8wo:scales", "i1", (64,), 80,
                                    f"{_DOWN} 'scales' is int8 [64]; the layer needs bfloat16 [64, 4]"),
    "bias-as-float16": ("int8", "layers.0.self_attn.v_proj.bias:np.f32:weight", "f2", (32,), 1,
                        "layer 'model.layers.0.self_attn.v_proj': packed operand 'bias' is float16 [32]; the layer "
                        "needs float32 [32]"),
    # the kernel would read 96 KiB past them: far more than the index
    "int8-head-scales-as-int8": ("int8", "lm_head.weight:torch.int8wo:scales", "i1", (VOCAB,), 1,
                                 f"{_HEAD} 'scales' is int8 [{VOCAB}]; the layer needs bfloat16 [{VOCAB}, 2]"),
    "bf16-head-as-uint8": ("bf16", "lm_head.weight:torch.linear.bf16:weight", "u1", (VOCAB, 64), 1,
                           f"{_HEAD} 'weight' is uint8 [{VOCAB}, 64]; the layer needs bfloat16 [{VOCAB}, 64]"),
    # a float parameter served from the file (a norm) is read by torch's own ops, by its dtype: int8 bytes were read
    # as weights of about -24 (logits far off, no error), float16 ones as other numbers, a wrong shape was a raw
    # RuntimeError at the forward
    "norm-as-int8": ("int8", "model.norm.weight:np.f32:weight", "i1", (64,), 1,
                     "parameter 'model.norm.weight' is int8 [64]; the module needs float32 [64]"),
    "norm-as-float16": ("bf16", "model.norm.weight:np.f32:weight", "f2", (64,), 1,
                        "parameter 'model.norm.weight' is float16 [64]; the module needs float32 [64]"),
    "norm-shorter": ("int8", "model.norm.weight:np.f32:weight", "f4", (32,), 1,
                     "parameter 'model.norm.weight' is float32 [32]; the module needs float32 [64]"),
}  # fmt: skip


def test_retyped_parts_of_a_cache_file_are_refused_before_a_kernel_reads_them(
    llama_files: dict[str, Path], tmp_path: Path
) -> None:
    cases = [(str(llama_files["int8"]), 1)]  # the file as built: it answers
    for case, (scheme, suffix, dtype, shape, tokens, _) in _RETYPED.items():
        path = tmp_path / f"{case}.pcache"
        shutil.copy(llama_files[scheme], path)
        retype_entry(path, suffix, dtype, shape)
        cases.append((str(path), tokens))
    result = _child(_ANSWERS.replace("sys.argv[1]", repr(json.dumps(cases))))  # one child: it imports transformers
    answers = result.stdout.splitlines()
    assert result.returncode == 0, f"the child died ({result.returncode}) after {answers}:\n{result.stderr[-3000:]}"
    assert answers[0].startswith("answered True") and answers[1] == answers[0], answers[:2]
    for (case, (*_, refusal)), at_start, at_forward in zip(_RETYPED.items(), answers[2::2], answers[3::2], strict=True):
        assert at_start.startswith(f"refused PackResultError {refusal}"), (case, at_start)
        assert at_forward == at_start, (case, at_forward)


# ------------------------------------------------------------------ no operand reaches the C code unchecked

#: Every dtype a cache file's entry may have, as torch names it, and bfloat16.
TORCH_DTYPES = [
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip
#: The layer every case binds: a multiple of what each compiled product takes (int4: groups of 32).
OUT, IN = 64, 128
PACKERS = {scheme: scheme_packer(scheme) for scheme in SCHEMES}
LIBRARY_CALLS = ("pc_dense", "pc_int8", "pc_bf16", "pc_int4")


class _Counting:
    """A library function, called through and counted."""

    def __init__(self, function: Any) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.function(*args)


@contextlib.contextmanager
def counted_library_calls() -> Iterator[dict[str, _Counting]]:
    """Every call of the compiled products in the block, counted on the loaded library itself."""
    lib = native._library()
    counters = {name: _Counting(getattr(lib, name)) for name in LIBRARY_CALLS}
    for name, counter in counters.items():
        setattr(lib, name, counter)
    try:
        yield counters
    finally:
        for name, counter in counters.items():
            setattr(lib, name, counter.function)


def full_layout(packer: TorchPacker) -> dict[str, native.Spec]:
    return {**packer.layout(OUT, IN), "bias": (torch.float32, (OUT,))}


def valid_operands(packer: TorchPacker) -> dict[str, Any]:
    return {part: torch.zeros(shape, dtype=dtype) for part, (dtype, shape) in full_layout(packer).items()}


class _Subclass(torch.Tensor):
    pass


def _shapes(spec_shape: tuple[int, ...]) -> st.SearchStrategy[tuple[int, ...]]:
    sizes = sorted({1, 2, 3, *spec_shape, *(d // 2 for d in spec_shape), *(d + 1 for d in spec_shape),
                    *(2 * d for d in spec_shape)})  # fmt: skip
    return st.one_of(st.just(spec_shape), st.lists(st.sampled_from(sizes), max_size=3).map(tuple))


def _bad_tensor(draw: st.DrawFn, spec: native.Spec) -> tuple[object, bool]:
    """A tensor (or something else) for an operand of ``spec``, and whether it is exactly what the kernel reads."""
    dtype = draw(st.one_of(st.just(spec[0]), st.sampled_from(TORCH_DTYPES)))
    shape = draw(_shapes(spec[1]))
    how = draw(st.sampled_from(["contiguous", "transposed", "strided", "misaligned", "short storage", "meta",
                                "negated view", "subclass", "numpy-like list"]))  # fmt: skip
    fits = dtype == spec[0] and shape == spec[1]
    if how == "contiguous":
        return torch.zeros(shape, dtype=dtype), fits
    if how == "transposed":
        if len(shape) < 2:
            shape = (*shape, 2) if shape else (2, 2)
        tensor = torch.zeros(shape[::-1], dtype=dtype).transpose(0, -1)
        return tensor, fits and tensor.shape == spec[1] and tensor.is_contiguous()
    if how == "strided":
        wide = torch.zeros((*shape[:-1], 2 * shape[-1]) if shape else (2,), dtype=dtype)
        tensor = wide[..., ::2]
        return tensor, fits and tensor.is_contiguous()
    if how == "misaligned":  # one byte past an allocation: misaligned for any element wider than a byte
        count = int(np.prod(shape, dtype=np.int64))
        if not count:
            return torch.zeros(shape, dtype=dtype), fits
        itemsize = torch.empty((), dtype=dtype).element_size()
        tensor = torch.frombuffer(bytearray(count * itemsize + 1), dtype=dtype, offset=1, count=count).view(shape)
        return tensor, fits and itemsize == 1
    if how == "short storage":
        tensor = torch.zeros(shape, dtype=dtype)
        tensor.untyped_storage().resize_(0)  # the view now claims bytes its storage no longer has
        return tensor, fits and tensor.numel() == 0
    if how == "meta":
        return torch.empty(shape, dtype=dtype, device="meta"), False
    if how == "negated view":  # torch reads it negated; its bytes are not
        return torch._neg_view(torch.zeros(shape, dtype=dtype)), False
    if how == "subclass":
        return torch.zeros(shape, dtype=dtype).as_subclass(_Subclass), False
    return torch.zeros(shape, dtype=dtype).tolist(), False


@st.composite
def bad_operands(draw: st.DrawFn) -> tuple[str, str, object, bool]:
    scheme = draw(st.sampled_from(SCHEMES))
    part = draw(st.sampled_from([*PACKERS[scheme].parts, "bias"]))
    tensor, fits = _bad_tensor(draw, full_layout(PACKERS[scheme])[part])
    return scheme, part, tensor, fits


def _product(op: str, x: torch.Tensor, bound: native.Bound) -> torch.Tensor:
    if op == "dense":
        return native.dense_product(x, bound, 1)
    if op == "int8":
        return native.int8_product(x, bound, 1)
    return native.int4_product(x, bound, 32, 1)  # int4, the other operation a packer runs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bad_operands())
@example(case=("fp32", "weight", torch.zeros(OUT, IN, dtype=torch.bfloat16), False))  # a bfloat16 layer, read so
@example(case=("int8", "weight", torch.zeros(OUT, IN), False))  # a float32 layer with scales it does not read
def test_no_operand_reaches_the_compiled_kernels_unless_it_fits_its_layout(case: tuple[str, str, object, bool]):
    """Every part of every scheme's packs (and the bias), given random dtypes, shapes, strides, addresses, storages,
    devices and types: the production check (``TorchPacker.bind``, at ``prepare`` and when a layer is made) refuses
    each that is not exactly what the kernels read, naming the part; and a :class:`~packcache.native.Bound` made
    around it under its own layout is refused by the compiled product before the call. The library's entry points,
    counted on the loaded library, are never called."""
    scheme, part, tensor, fits = case
    packer = PACKERS[scheme]
    operands = {**valid_operands(packer), part: tensor}
    read = 0  # products that ran: operands that are, under their own layout, another layer the kernel reads
    with counted_library_calls() as calls:
        if fits:
            assert packer.bind(operands, dims=(OUT, IN))[part] is tensor
            return
        with pytest.raises(PackResultError, match=rf"^layer 'fc': packed operand {part!r} .* does not fit"):
            packer.bind(operands, name="fc", dims=(OUT, IN))  # the layer's shape, as convert() knows it
        for path in packer.paths:  # the layer's shape read off its parts: refused, or another (smaller) layer
            try:
                prepared = packer.prepare(operands, path)
            except PackResultError as error:
                assert re.search(r"packed operand '\w+' .* does not fit this layer", str(error)), error
            else:
                assert packer.dims(prepared.bound) != (OUT, IN)
                if packer.native_op is not None:  # which reads its own bytes only: the layer's activations refused
                    with pytest.raises(native.NativeError, match="input features"):
                        _product(packer.native_op, torch.zeros(1, IN), prepared.bound)
        if packer.native_op is not None and type(tensor) in (torch.Tensor, _Subclass):
            assert isinstance(tensor, torch.Tensor)
            own = {**full_layout(packer), part: (tensor.dtype, tuple(tensor.shape))}
            try:
                bound = native.bind(own, operands, optional=("bias",))
            except PackResultError:
                pass  # not even a tensor the C code could read as what it claims to be
            else:
                x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, IN)).astype(np.float32))
                try:
                    got = _product(packer.native_op, x, bound)
                except native.NativeError as error:
                    assert re.search(rf"compiled {packer.native_op}( \w+)? product reads", str(error)), error
                else:
                    # The dense product takes float32, bfloat16 and int8 weights: an fp32 layer's weight bound as
                    # the bfloat16 it is, say, is read as bfloat16, all of it and nothing past it.
                    assert packer.native_op == "dense" and bound["weight"].dtype in native._DENSE_WEIGHTS, own
                    read += 1
                    w = bound["weight"].double()
                    if bound["weight"].dtype == torch.int8:
                        w = w * bound["scales"].double()[:, None]
                    expected = x.double() @ w.T + bound["bias"].double()
                    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert sum(counter.calls for counter in calls.values()) == read


@st.composite
def numpy_parts(draw: st.DrawFn) -> tuple[str, str, np.ndarray, bool]:
    """A part as a cache file may hold it: any dtype the format has, any shape, C-contiguous or not."""
    scheme = draw(st.sampled_from(SCHEMES))
    part = draw(st.sampled_from([*PACKERS[scheme].parts, "bias"]))
    dtype, shape = full_layout(PACKERS[scheme])[part]
    stored = np.dtype("<u2") if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))
    codes = [np.dtype(fmt.numpy_dtype_str(code)) for code in fmt.DTYPE_CODES]
    array_dtype = draw(st.one_of(st.just(stored), st.sampled_from(codes)))
    array_shape = draw(_shapes(shape))
    array = np.zeros(array_shape, array_dtype)
    if draw(st.booleans()) and array.ndim:
        array = np.zeros((*array_shape[:-1], 2 * array_shape[-1]), array_dtype)[..., ::2]
    fits = array.dtype == stored and array.shape == shape and array.flags.c_contiguous
    return scheme, part, array, fits


@settings(max_examples=200, deadline=None)
@given(case=numpy_parts())
def test_a_layer_over_parts_that_do_not_fit_its_layout_refuses_its_first_use(
    case: tuple[str, str, np.ndarray, bool],
) -> None:
    """The path of a cache's parts (numpy views of the mapping, a bfloat16 part as uint16 bits): a layer of the shape
    of the module it replaces runs only over parts each exactly its layout's dtype and shape, C-contiguous. Made over
    any other (the load only maps), its first use refuses, naming the layer and the part; an array no tensor can
    view is refused by the load itself."""
    scheme, part, array, fits = case
    packer = PACKERS[scheme]
    parts: dict[str, Any] = {}
    for name, (dtype, shape) in full_layout(packer).items():
        parts[name] = np.zeros(shape, np.uint16 if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."))
    parts[part] = array
    bias = parts.pop("bias")
    refusal = rf"^layer 'fc': packed operand {part!r} .* (does not fit this layer|no kernel reads|not C-contiguous)"
    try:
        layer = PackedLinear.from_parts(packer, parts, bias, name="fc", shape=(OUT, IN))
    except PackResultError as error:
        assert not fits and re.match(refusal, str(error)), error
        return
    with counted_library_calls() as calls:
        if fits:
            assert check_kernels(layer) == 1
            assert layer(torch.zeros(1, IN)).shape == (1, OUT)
            return
        for use in (lambda: check_kernels(layer), lambda: layer(torch.zeros(1, IN)), layer.float_weight):
            with pytest.raises(PackResultError, match=refusal):
                use()
    assert sum(counter.calls for counter in calls.values()) == 0
    if packer.embeds and part != "bias":  # the same parts as an embedding table: its lookups read them too
        table = PackedEmbedding.from_parts(packer, parts, name="fc", shape=(OUT, IN))
        for use in (lambda: table(torch.tensor([0, OUT - 1])), table.float_weight):
            with pytest.raises(PackResultError, match=refusal):
                use()


@st.composite
def activations(draw: st.DrawFn) -> tuple[object, bool]:
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, *TORCH_DTYPES]))
    shape = draw(
        st.one_of(
            st.tuples(st.integers(0, 66), st.just(IN)),
            st.lists(st.sampled_from([1, 2, 64, IN, 2 * IN]), max_size=3).map(tuple),
        )
    )
    how = draw(st.sampled_from(["contiguous", "contiguous", "strided", "meta", "negated view", "subclass"]))
    fits = dtype in (torch.float32, torch.bfloat16) and len(shape) == 2 and shape[1] == IN
    if how == "contiguous":
        return torch.zeros(shape, dtype=dtype), fits
    if how == "strided":
        tensor = torch.zeros((*shape[:-1], 2 * shape[-1]) if shape else (2,), dtype=dtype)[..., ::2]
        return tensor, fits and tensor.is_contiguous()
    if how == "meta":
        return torch.zeros(shape, dtype=dtype, device="meta"), False
    if how == "negated view" and dtype.is_floating_point:
        return torch._neg_view(torch.zeros(shape, dtype=dtype)), False
    return torch.zeros(shape, dtype=dtype).as_subclass(_Subclass), False


@settings(max_examples=150, deadline=None)
@given(scheme=st.sampled_from([s for s in SCHEMES if PACKERS[s].native_op is not None]), case=activations())
def test_activations_reach_the_compiled_kernels_only_as_a_contiguous_float_matrix_of_the_layers_width(
    scheme: str, case: tuple[object, bool]
) -> None:
    packer = PACKERS[scheme]
    assert packer.native_op is not None
    x, fits = case
    bound = packer.bind(valid_operands(packer))
    with counted_library_calls() as calls:
        if fits:
            assert isinstance(x, torch.Tensor)
            rows = x.shape[0]
            y = _product(packer.native_op, x, bound)  # any number of rows
            assert y.shape == (rows, OUT) and y.dtype == x.dtype
            assert sum(c.calls for c in calls.values()) == (1 if rows else 0)
            return
        with pytest.raises(native.NativeError, match=r"takes activations|input features"):
            _product(packer.native_op, x, bound)  # type: ignore[arg-type]
    assert sum(c.calls for c in calls.values()) == 0


def test_bound_operands_are_made_only_by_the_check_and_a_copy_is_checked_again() -> None:
    packer = Int8WeightOnly()
    bound = packer.bind(packer.pack(np.ones((64, 64), np.float32), "F32"), name="fc")
    with pytest.raises(TypeError, match=r"made by packcache\.native\.bind"):
        native.Bound(object(), dict(bound.layout), dict(bound), frozenset(), "fc")
    with pytest.raises(TypeError, match=r"operands from packcache\.native\.bind"):
        native.int8_product(torch.zeros(1, 64), dict(bound), 1)  # type: ignore[arg-type]
    copy = pickle.loads(pickle.dumps(bound))  # new tensors, new addresses: bound, and so checked, again
    assert copy is not bound and copy["weight"].data_ptr() != bound["weight"].data_ptr()
    assert copy._addresses["weight"] == copy["weight"].data_ptr()
    assert torch.equal(
        native.int8_product(torch.ones(1, 64), copy, 1), native.int8_product(torch.ones(1, 64), bound, 1)
    )
    with pytest.raises(TypeError, match=r"reads operands from TorchPacker\.prepare"):
        packer.linear({**packer.prepare(bound, "fp32")}, torch.ones(1, 64), "fp32")  # a plain copy: not prepared


def test_an_empty_batch_gets_an_empty_answer_from_the_compiled_kernels() -> None:
    # Zero rows once reached the library, which refuses them (EINVAL): an empty batch raised NativeError.
    for packer in (Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32)):
        layer = PackedLinear.from_parts(packer, packer.pack(np.ones((64, 128), np.float32), "F32"), None)
        with torch.inference_mode():
            assert layer(torch.ones(0, 128)).shape == (0, 64)
            assert layer(torch.ones(2, 0, 128)).shape == (2, 0, 64)
