"""The torch packers (``packcache.packers_torch``): each runs its kernel to the weight it intends on every
kernel path, names torch and the CPU in its platform, refuses what its kernel cannot take.
"""

from __future__ import annotations

import numpy as np
import pytest

from packcache import PackResultError
from packcache.packers import Float32, fingerprint_input, platform_for, to_float32


def test_torch_packers_run_their_kernel_to_the_intended_weight_on_every_path() -> None:
    import torch

    from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32
    from packcache.torch import PackedLinear

    w = fingerprint_input((64, 256)) * np.float32(0.1)
    checked = 0
    for packer in (LinearFloat32(), LinearBFloat16(), Int8WeightOnly(), *(Int4WeightOnly(g) for g in (32, 64, 128))):
        parts = packer.checked_pack(w, "F32")
        for path in packer.paths:
            layer = PackedLinear.from_parts(packer, parts, bias=np.full(64, 0.5, np.float32), kernel_path=path)
            # One row (a decode step's own loop in the compiled kernels), a few and more than a tile block of rows.
            for rows in (1, 5, 97):
                x = torch.from_numpy(fingerprint_input((rows, 256)))
                expected = x @ torch.from_numpy(packer.intended(w, "F32")).T + 0.5
                with torch.inference_mode():
                    got = layer(x)
                assert got.dtype == torch.float32 and got.shape == (rows, 64)
                coarse = packer.kernel_input_dtype(path, rows) in (torch.bfloat16, torch.int8)
                # bfloat16 keeps 8 significant bits, int8 activations (the compiled kernels': blocks of 32) about 7:
                # their error scales with the outputs' magnitude.
                tolerance = 0.02 * (1 + float(expected.abs().max())) if coarse else 1e-4
                what = (packer, path, rows, layer.kernel(rows))
                assert float((got - expected).abs().max()) < tolerance, what
                approximation = float((got - (x @ torch.from_numpy(w).T + 0.5)).abs().max())
                assert approximation < 0.35 + tolerance, what  # and it approximates w (int4 g128: ~0.3 on 193 rows)
                checked += 1
    assert checked >= 20


def test_torch_platform_names_torch_version_and_cpu_capability() -> None:
    import torch

    from packcache.packers_torch import Int4WeightOnly

    platform = platform_for([Int4WeightOnly(32), Float32()])
    assert platform["torch"] == torch.__version__
    assert platform["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {p["id"] for p in platform["packers"]} == {"torch.int4wo", "np.f32"}
    assert platform_for([Int4WeightOnly(64)]) != platform_for([Int4WeightOnly(32)])


def test_int4_refuses_shapes_its_kernel_cannot_take() -> None:
    from packcache.packers_torch import Int4WeightOnly

    assert Int4WeightOnly(32).eligible((24, 64)) is None  # any out_features: the layout is row-major
    assert Int4WeightOnly(64).eligible((32, 96)) is not None  # in_features not a multiple of the group
    assert Int4WeightOnly(32).eligible((32, 96)) is None
    with pytest.raises(ValueError, match="group_size"):
        Int4WeightOnly(16)


def test_tensors_that_are_not_self_contained_bytes_are_refused() -> None:
    import torch

    from packcache.packers_torch import tensor_to_numpy

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with pytest.raises(PackResultError, match="not standard C-contiguous"):
        tensor_to_numpy(base.t(), "w")
    with pytest.raises(PackResultError, match="opaque or non-dense"):
        tensor_to_numpy(base.to_mkldnn(), "w")
    with pytest.raises(PackResultError, match="opaque or non-dense"):
        tensor_to_numpy(base.to_sparse(), "w")
    with pytest.raises(PackResultError, match="autograd"):
        tensor_to_numpy(base.clone().requires_grad_(), "w")
    with pytest.raises(PackResultError, match="no numpy representation"):
        tensor_to_numpy(base.to(torch.complex64), "w")
    with pytest.raises(PackResultError, match=r"plain torch\.Tensor"):
        tensor_to_numpy(torch.nn.Parameter(base), "w")
    bits = tensor_to_numpy(base.to(torch.bfloat16), "w")
    assert bits.dtype == np.uint16 and to_float32(bits, "BF16").tolist() == base.tolist()


def test_packers_of_embedding_tables_look_up_exactly_the_rows_of_their_dequantised_table() -> None:
    """Issue 32: a table in the scheme's form (bf16; int8 rows with per-row scales) is looked up row by row, each
    row bit for bit the row of the whole dequantised table, and that table is the weight the packer intends."""
    import torch

    from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32, as_tensor

    table = fingerprint_input((96, 64)) * np.float32(0.1)
    ids = torch.tensor([[0, 95, 7], [7, 7, 31]])
    for packer in (LinearFloat32(), LinearBFloat16(), Int8WeightOnly()):
        assert packer.embeds
        dtypes = packer.part_dtypes()
        operands = {p: as_tensor(a, dtypes.get(p)) for p, a in packer.pack(table, "F32").items()}
        whole = packer.dequantized(operands)
        assert whole.dtype == torch.float32
        assert torch.equal(whole, torch.from_numpy(packer.intended(table, "F32"))), packer
        rows = packer.rows(operands, ids)
        assert rows.dtype == torch.float32 and rows.shape == (2, 3, 64)
        assert torch.equal(rows, whole[ids]), packer
    int4 = Int4WeightOnly(32)
    assert not int4.embeds
    with pytest.raises(NotImplementedError, match=r"torch\.int4wo does not pack embedding tables"):
        int4.rows({}, ids)


def test_every_scheme_declares_the_layout_of_its_packs_and_its_compiled_product_reads_exactly_that() -> None:
    """``TorchPacker.layout`` is what ``bind`` checks every layer against: a pack of the packer fits it, bfloat16
    parts are the ones stored as uint16 bits (``part_dtypes``), and the compiled product of the scheme takes the
    bound operands as they are (its own check of what it reads agrees with the layout)."""
    import torch

    from packcache import native
    from packcache.loader import scheme_packer
    from packcache.packers import SCHEMES
    from packcache.packers_torch import Int4WeightOnly

    out_features, in_features = 64, 256
    packers = [scheme_packer(scheme) for scheme in SCHEMES] + [Int4WeightOnly(64), Int4WeightOnly(128)]
    for packer in packers:
        parts = packer.checked_pack(fingerprint_input((out_features, in_features)), "F32")
        layout = packer.layout(out_features, in_features)
        assert tuple(layout) == packer.parts, packer
        assert {p for p, (dtype, _) in layout.items() if dtype == torch.bfloat16} == set(packer.part_dtypes()), packer
        bound = packer.bind(parts, dims=(out_features, in_features))
        assert packer.dims(parts) == (out_features, in_features) and bound["bias"] is None
        for part, (dtype, shape) in layout.items():
            assert (bound[part].dtype, tuple(bound[part].shape)) == (dtype, shape), (packer, part)
        if packer.native_op is None or native.status().isa is None:
            continue
        x = torch.ones(1, in_features)
        if packer.native_op == "dense":
            y = native.dense_product(x, bound, 1)
        elif packer.native_op == "int8":
            y = native.int8_product(x, bound, 1)
        else:
            y = native.int4_product(x, bound, packer.params["group_size"], 1)
        assert y.shape == (1, out_features) and bool(y.isfinite().all()), packer
