"""The compiled kernels (packcache.native, csrc/kernels.c): built by the install, exact against a reference
that applies the same numerics, on every ISA this CPU runs, with threads, forks and the torch fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from packcache import native
from packcache.errors import PackResultError
from packcache.packers_torch import (
    NATIVE_ISAS,
    NATIVE_MAX_ROWS,
    Int4WeightOnly,
    Int8WeightOnly,
    LinearBFloat16,
    as_tensor,
)

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


def _int8_reference(x: np.ndarray, w: np.ndarray, scales: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    codes, block_scale = _quantize_blocks(x)
    blocks = codes.shape[1]
    wb = w.astype(np.float64).reshape(w.shape[0], blocks, 32)
    dots = np.einsum("mbk,nbk->mnb", codes.astype(np.float64), wb)  # exact integers
    y = (dots * block_scale[:, None, :].astype(np.float64)).sum(axis=2) * scales.astype(np.float64)[None, :]
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
        assert scales is not None
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
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scales = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    expected = _int8_reference(x, w, scales, bias)
    got = _call("int8", torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(scales),
                None if bias is None else torch.from_numpy(bias), isa)  # fmt: skip
    # integer dot products are exact; only float32 summation order differs from the float64 reference
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows", [*range(1, 21), 33])
def test_int8_tiles_of_every_row_count_equal_the_reference(isa, rows):
    # The int8 kernels run tiles of several weight rows x up to 4 activation rows, a chunk of K at a time: every
    # remainder of activation rows (1..4 past each tile), weight rows past the last whole tile (n = 4 * 9 + 3 on
    # each thread's share) and a K past whole chunks (1024 + 1024 + 64) meet the reference.
    rng = np.random.default_rng(rows)
    k, n = 2112, 83
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 4.0, (rows, 1))).astype(np.float32)
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scales = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    expected = _int8_reference(x, w, scales, bias)
    for threads in (1, 2):
        got = _call("int8", torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(scales),
                    torch.from_numpy(bias), isa, threads)  # fmt: skip
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # A row's numbers do not depend on the rows beside it (a sequence's tokens on what else is in the batch).
    alone = [_call("int8", torch.from_numpy(x[m : m + 1]), torch.from_numpy(w), torch.from_numpy(scales),
                   torch.from_numpy(bias), isa) for m in range(rows)]  # fmt: skip
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
    scales = torch.from_numpy(rng.uniform(1e-3, 1e-1, 4099).astype(np.float32))
    one = _call("int8", x, w, scales, None, isa, threads=1)
    two = _call("int8", x, w, scales, None, isa, threads=2)
    assert torch.equal(one, two)


def test_calls_the_kernels_do_not_take_are_refused_with_an_errno():
    lib = native._library()
    x = torch.zeros(65, 64)
    w = torch.zeros(8, 64, dtype=torch.int8)
    s = torch.ones(8)
    y = torch.empty(65, 8)
    top = {"avx512": 2, "avx2": 1}[native.status().cpu]
    assert lib.pc_int8(x.data_ptr(), 0, 65, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_int8(x.data_ptr(), 0, 1, 48, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_int8(x.data_ptr(), 7, 1, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, top) == -22
    assert lib.pc_int8(x.data_ptr(), 0, 1, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, 3) == -95
    with pytest.raises(native.NativeError, match="Invalid argument"):
        native.int8_product(x.data_ptr(), 0, 65, 64, w.data_ptr(), s.data_ptr(), 8, None, y.data_ptr(), 0, 2)


def test_the_stream_probe_reads_every_word():
    data = np.random.default_rng(5).integers(0, 2**63, 1 << 17, dtype=np.uint64)
    data[-1] ^= np.uint64(0xDEADBEEF)  # the last word counts too
    expected = int(np.bitwise_xor.reduce(data))
    assert native.stream(data.ctypes.data, data.nbytes, 2) == expected
    assert native.stream(data.ctypes.data, data.nbytes, 1) == expected


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
        ops = packer.prepare({**{p: as_tensor(a) for p, a in parts.items()}, "bias": None}, "fp32")
        x = torch.ones(1, 2048)
        assert "packcache int8" in packer.kernel("fp32", 1)
        first = packer.linear(ops, x, "fp32")  # the parent runs a parallel region
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            again = packer.linear(ops, x, "fp32")
            os._exit(0 if torch.equal(again, first) and float(again[0, 0]) == 2048.0 else 3)
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
    assert "_weight_int8pack_mm" in off.stdout and "linear(bfloat16)" in off.stdout
    assert "INFO packcache compiled kernels not used (switched off by PACKCACHE_NATIVE=off)" in off.stderr

    avx2 = _child(_packer_kernels_code(), {native.NATIVE_ENV: "avx2"})
    assert avx2.returncode == 0, avx2.stderr
    assert avx2.stdout.startswith("avx2 |")
    assert "packcache int8 (avx2: vpmaddubsw" in avx2.stdout

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
    assert "_weight_int8pack_mm" in result.stdout
    assert "WARNING packcache compiled kernels not used (packcache._kernels is not installed" in result.stderr


def test_each_compiled_operation_runs_on_the_codes_where_it_was_measured_faster():
    isa = native.status().isa
    for packer in (Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32)):
        uses = packer.kernel("fp32", 1).startswith("packcache ")
        assert uses == (isa in NATIVE_ISAS[packer.native_op]), (packer.id, isa)
    assert NATIVE_ISAS["int4"] == ("avx2",)  # torch's own AVX512 int4 kernel is faster (docs/TORCH.md)


@pytest.mark.parametrize("packer", [Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32)], ids=lambda p: p.id)
@pytest.mark.parametrize("path", ["bf16", "fp32"])
def test_packed_layers_run_the_compiled_kernel_for_few_rows_and_torch_for_more(packer, path, monkeypatch):
    monkeypatch.setitem(NATIVE_ISAS, packer.native_op, (native.status().isa,))  # int4's too, on any code
    rng = np.random.default_rng(11)
    source = rng.standard_normal((128, 256)).astype(np.float32)
    parts = packer.pack(source, "F32")
    operands = {p: as_tensor(a, packer.part_dtypes().get(p)) for p, a in parts.items()}
    operands["bias"] = torch.from_numpy(rng.standard_normal(128).astype(np.float32))
    prepared = packer.prepare(operands, path)
    weight = torch.from_numpy(packer.intended(source, "F32"))
    dtype = torch.bfloat16 if path == "bf16" else torch.float32
    limit = NATIVE_MAX_ROWS[packer.native_op]
    for rows in (1, limit, limit + 1, 65):
        assert ("packcache" in packer.kernel(path, rows)) == (rows <= limit), (rows, packer.kernel(path, rows))
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


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("group", Int4WeightOnly.GROUP_SIZES)
@pytest.mark.parametrize("rows,k,n", [(1, 256, 64), (2, 512, 192), (1, 1024, 128)])
def test_int4_products_read_torchs_layout_on_this_cpu(isa, group, rows, k, n):
    # The pack is torch's own (_convert_weight_to_int4pack_for_cpu on this torch and CPU capability); the kernel
    # reads its blocks and nibbles. The reference dequantises the same codes, scales and zeros in float64 and
    # applies the kernel's activation numerics, so only the kernel's float32 sums can differ.
    from packcache.kernels import int4_layout

    layout = int4_layout()
    assert layout is not None and layout.halves, layout
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
        torch.from_numpy(x).data_ptr(), 0, rows, k, weight.data_ptr(), sz.data_ptr(), n, group, layout.block, None,
        None, y.data_ptr(), 0, _LEVEL[isa],
    )  # fmt: skip
    assert rc == 0, os.strerror(-rc)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows", [2, 3, 16, 33])
def test_int4_products_of_several_rows_are_each_rows_own_product_bit_for_bit(isa, rows):
    # Several rows unpack each block's nibbles once for all of them; every row's numbers stay those of a one-row call.
    from packcache.kernels import int4_layout

    layout = int4_layout()
    assert layout is not None
    packer = Int4WeightOnly(64, activation_aware=False)
    rng = np.random.default_rng(rows)
    k, n = 256, 192
    source = rng.standard_normal((n, k)).astype(np.float32)
    parts = packer.pack(source, "F32")
    weight = as_tensor(parts["weight"])
    sz = as_tensor(parts["scales_and_zeros"], torch.bfloat16)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    lib = native._library()

    def product(xs: torch.Tensor) -> torch.Tensor:
        y = torch.empty(xs.shape[0], n)
        rc = lib.pc_int4(xs.data_ptr(), 0, xs.shape[0], k, weight.data_ptr(), sz.data_ptr(), n, 64, layout.block,
                         None, bias.data_ptr(), y.data_ptr(), 0, _LEVEL[isa])  # fmt: skip
        assert rc == 0, os.strerror(-rc)
        return y

    together = product(x)
    assert torch.equal(together, torch.cat([product(x[m : m + 1].contiguous()) for m in range(rows)]))
    expected = _int4_reference(x.numpy(), packer, source) + bias.numpy()
    np.testing.assert_allclose(together.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_int4_layers_run_the_compiled_kernel_on_a_torch_avx2_layout_too():
    # torch on an AVX2 CPU (ATEN_CPU_CAPABILITY=avx2 here) packs int4 in blocks of 32 rows: the kernel reads those as
    # pairs of neighbouring blocks. The packer's own self-check runs at the first forward and passes.
    result = _child(
        """
        import numpy as np, torch
        from packcache.kernels import int4_layout
        from packcache.packers_torch import Int4WeightOnly, as_tensor
        print(int4_layout())
        packer = Int4WeightOnly(32, activation_aware=False)
        source = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
        parts = packer.pack(source, "F32")
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
    layout, kernel = result.stdout.strip().splitlines()
    assert layout == "Int4Layout(block=32, halves=True)"
    name, error = kernel.split("|")
    assert name.strip().startswith("packcache int4 (avx2")
    assert float(error) < 0.01  # int8 activations: ~0.5 % of the output's scale


@pytest.mark.parametrize("packer", [Int8WeightOnly(), LinearBFloat16(), Int4WeightOnly(32)], ids=lambda p: p.id)
def test_a_pack_whose_parts_do_not_fit_the_layer_is_refused_before_the_kernel_reads_it(packer, monkeypatch):
    # A cache file's index gives each part's shape; the key that named the pack does not. A file holding, under the
    # right key, a part smaller than the layer needs would have the kernel read past it: refused first.
    monkeypatch.setitem(NATIVE_ISAS, packer.native_op, (native.status().isa,))
    source = np.random.default_rng(2).standard_normal((128, 256)).astype(np.float32)
    parts = packer.pack(source, "F32")
    shrunk = {name: array[: array.shape[0] // 2] for name, array in parts.items()}
    shrunk["weight"] = parts["weight"][:, : parts["weight"].shape[1] // 2].copy()  # half the input features
    operands = {p: as_tensor(np.ascontiguousarray(a), packer.part_dtypes().get(p)) for p, a in shrunk.items()}
    operands["bias"] = None
    prepared = packer.prepare(operands, "fp32")
    assert "packcache" in packer.kernel("fp32", 1)
    with pytest.raises(PackResultError, match="does not fit this layer"):
        packer.linear(prepared, torch.ones(1, 256), "fp32")
