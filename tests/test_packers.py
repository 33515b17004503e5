"""Packers (``packcache.packers``): identity, keys, behavioural fingerprints, self-contained output,
non-finite weights (the int4 search: test_packers_int4.py; the torch packers: test_packers_torch.py).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from packcache import NonFiniteWeightError, PackResultError
from packcache.packers import (
    Float32,
    Int8PerChannel,
    Packer,
    TransposeFloat32,
    fingerprint_input,
    fingerprint_stats,
    platform_for,
    to_float32,
)
from packcache.quantize import (
    dequantize_int4,
    quantize_int4_activation_aware,
    quantize_int4_groups,
    quantize_int8_rows,
)


def test_import_packcache_and_numpy_packers_does_not_import_torch() -> None:
    code = (
        "import sys, packcache, packcache.packers, packcache.safetensors, packcache.models\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _bf16_bits(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_transpose_float32_converts_f16_and_bf16_and_transposes() -> None:
    w = np.array([[1.0, -2.5, 0.125], [3.0, 4.0, -0.5]], np.float32)  # exact in f16 and bf16
    for source, dtype in ((w.astype(np.float16), "F16"), (_bf16_bits(w), "BF16"), (w, "F32")):
        packed = TransposeFloat32().checked_pack(source, dtype)["weight"]
        assert packed.dtype == np.float32 and packed.flags.c_contiguous
        np.testing.assert_array_equal(packed, w.T)


def test_int8_per_channel_reconstructs_within_half_a_step() -> None:
    w = fingerprint_input((16, 64))
    parts = Int8PerChannel().checked_pack(w, "F32")
    assert parts["weight"].dtype == np.int8 and parts["scales"].shape == (16,)
    assert int(np.abs(parts["weight"].astype(np.int16)).max()) <= 127
    restored = parts["weight"].astype(np.float32) * parts["scales"][:, None]
    assert np.all(np.abs(restored - w) <= parts["scales"][:, None] * 0.5 + 1e-7)
    assert parts["scales"][1] == 1.0  # the all-zero row gets scale 1, not a division by zero


def test_int4_search_is_never_worse_than_round_to_nearest() -> None:
    w = np.random.default_rng(3).standard_t(df=4, size=(32, 256)).astype(np.float32)
    codes, scales, zeros = quantize_int4_groups(w, 32, zero_code=8)
    searched = np.square(dequantize_int4(codes, scales, zeros, zero_code=8) - w).sum()
    groups = w.reshape(32, 8, 32).astype(np.float64)
    lo, hi = groups.min(axis=2, keepdims=True), groups.max(axis=2, keepdims=True)
    step = (hi - lo) / 15
    rtn = np.clip(np.rint((groups - lo) / step), 0, 15) * step + lo
    plain = np.square(rtn.reshape(32, 256) - w).sum()
    assert codes.dtype == np.uint8 and int(codes.max()) <= 15
    assert searched < plain * 0.95  # clipping search + least squares beat plain min/max


def test_activation_aware_int4_lowers_the_expected_output_error() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    x = rng.standard_normal((256, 128)) * np.geomspace(0.05, 20.0, 128)[None, :]  # a few loud features
    h = x.T @ x / len(x)

    def output_error(weight: np.ndarray[Any, Any]) -> float:
        delta = weight - w
        return float(np.sum((delta @ h) * delta))

    plain = quantize_int4_groups(w, 32, zero_code=8)
    codes, scales, zeros, input_scales = quantize_int4_activation_aware(w, 32, h, zero_code=8)
    aware = dequantize_int4(codes, scales, zeros, zero_code=8) * input_scales[None, :]
    assert output_error(aware) < 0.95 * output_error(dequantize_int4(*plain, zero_code=8))


def test_fingerprint_is_deterministic_and_computed_once_per_process() -> None:
    class Counting(Float32):
        id = "test.counting"
        calls = 0

        def pack(self, source: Any, dtype: str, stats: Any = None) -> dict[str, np.ndarray[Any, Any]]:
            type(self).calls += 1
            return super().pack(source, dtype)

    first = Counting().fingerprint()
    assert Counting().fingerprint() == first  # a new instance with the same identity: no new pack
    assert Counting.calls == 1  # one pack: a warm launch pays for no determinism check
    assert len(first) == 64 and first == Counting().describe()["fingerprint"]
    Counting().check_deterministic()  # what a loader runs before the first real pack: one more pack, once
    assert Counting.calls == 2
    Counting().check_deterministic()
    assert Counting.calls == 2


def test_fingerprint_changes_when_the_packed_bytes_change() -> None:
    class Scaled(Float32):
        id = "test.scaled"

        def pack(self, source: Any, dtype: str, stats: Any = None) -> dict[str, np.ndarray[Any, Any]]:
            return {"weight": to_float32(source, dtype) * np.float32(2.0)}

    class ScaledNewTorch(Scaled):  # same id and version, silently different bytes (a library upgrade)
        def pack(self, source: Any, dtype: str, stats: Any = None) -> dict[str, np.ndarray[Any, Any]]:
            return {"weight": to_float32(source, dtype) * np.float32(2.0) + np.float32(1e-3)}

    assert Scaled().fingerprint() != ScaledNewTorch().fingerprint()
    assert platform_for([Scaled()]) != platform_for([ScaledNewTorch()])


def test_nondeterministic_packer_is_refused() -> None:
    class AddressDependent(Float32):
        id = "test.address"

        def pack(self, source: Any, dtype: str, stats: Any = None) -> dict[str, np.ndarray[Any, Any]]:
            # Like a packer that embeds a pointer in its output.
            return {"weight": np.array([source.ctypes.data], dtype=np.int64)}

    packer = AddressDependent()
    packer.fingerprint()  # one pack says nothing; a loader that packs with it refuses it before storing a byte
    for _ in range(2):
        with pytest.raises(PackResultError, match="not deterministic"):
            packer.check_deterministic()


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"weight": [1.0, 2.0]}, "plain numpy.ndarray"),
        ({"weight": np.array(["a"], dtype=object)}, "not plain numeric"),
        ({"weight": np.arange(4, dtype=">f4")}, "big-endian"),
        ({"weight": np.zeros((4, 4), np.float32)[:, ::2]}, "not C-contiguous"),
        ({"weights": np.zeros(2, np.float32)}, "must return the parts"),
    ],
)
def test_pack_output_that_is_not_self_contained_is_refused(result: dict[str, Any], message: str) -> None:
    class Bad(Packer):
        id = "test.bad"
        version = 1

        def pack(self, source: Any, dtype: str, stats: Any = None) -> Any:
            return result

    with pytest.raises(PackResultError, match=message):
        Bad().checked_pack(np.zeros(2, np.float32), "F32")


def test_key_comes_from_metadata_and_changes_with_identity_shape_and_params() -> None:
    from packcache.safetensors import TensorMeta

    meta = TensorMeta(name="w", shape=(4, 8), dtype="F32", identity="sha256:" + "1" * 64 + ":8")
    key = Int8PerChannel().key(meta, "weight")
    assert key["packer"] == "np.int8c" and key["version"] == 2 and key["source"]["identity"] == meta.identity
    other_file = TensorMeta(name="w", shape=(4, 8), dtype="F32", identity="sha256:" + "2" * 64 + ":8")
    assert Int8PerChannel().key(other_file, "weight") != key
    assert Int8PerChannel().key(TensorMeta("w", (4, 9), "F32", meta.identity), "weight") != key
    assert Int8PerChannel().key(meta, "scales") != key


def test_platform_lists_every_packer_with_its_fingerprint() -> None:
    platform = platform_for([Int8PerChannel(), Float32(), Float32()])
    ids = [p["id"] for p in platform["packers"]]
    assert sorted(ids) == ["np.f32", "np.int8c"]
    assert all(len(p["fingerprint"]) == 64 for p in platform["packers"])


# --------------------------------------------------------------------------- non-finite weights

NON_FINITE = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
SHOWN = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}


def _source(dtype: str, value: float, at: tuple[int, int] = (5, 3), shape: tuple[int, int] = (32, 64)) -> Any:
    """A fingerprint-like weight with one ``value`` at ``at``, stored as safetensors dtype ``dtype``."""
    w = fingerprint_input(shape)
    w[at] = value
    if dtype == "BF16":
        return _bf16_bits(w)
    return w.astype({"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype])


def _torch_packers() -> list[Packer]:
    from packcache.packers_torch import Int4WeightOnly, Int8WeightOnly, LinearBFloat16, LinearFloat32

    return [LinearFloat32(), LinearBFloat16(), Int8WeightOnly(), Int4WeightOnly(32), Int4WeightOnly(32, False)]


@pytest.mark.parametrize("value", sorted(NON_FINITE))
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64"])
def test_every_packer_refuses_a_non_finite_source_naming_row_and_column(dtype: str, value: str) -> None:
    """NaN, +Inf and -Inf, in every source dtype, for the numpy packers and every scheme's torch packer:
    the same refusal, never a pack. int8 used to turn a NaN row into a finite all-zero channel."""
    source = _source(dtype, NON_FINITE[value])
    for packer in [Float32(), TransposeFloat32(), Int8PerChannel(), *_torch_packers()]:
        expected = rf"holds {re.escape(SHOWN[value])} at row 5, column 3"
        with pytest.raises(NonFiniteWeightError, match=expected) as caught:
            packer.pack(source, dtype)
        assert caught.value.index == (5, 3) and caught.value.tensor is None, packer
        with pytest.raises(NonFiniteWeightError, match=r"tensor 'layer\.weight' holds") as caught:
            packer.checked_pack(source, dtype, name="layer.weight")
        assert caught.value.tensor == "layer.weight" and caught.value.index == (5, 3), packer
        assert isinstance(caught.value, ValueError)  # the command line's "cannot load the model" catches it


@pytest.mark.parametrize("value", sorted(NON_FINITE))
def test_the_quantizers_refuse_non_finite_weights_instead_of_laundering_them(value: str) -> None:
    w = _source("F32", NON_FINITE[value], at=(7, 40))
    with pytest.raises(NonFiniteWeightError, match="row 7, column 40"):
        quantize_int8_rows(w)
    with pytest.raises(NonFiniteWeightError, match="row 7, column 40"):
        quantize_int4_groups(w, 32, zero_code=8)
    with pytest.raises(NonFiniteWeightError, match="row 7, column 40"):
        quantize_int4_activation_aware(w, 32, fingerprint_stats(64), zero_code=8)


def test_the_message_counts_every_non_finite_value_and_names_the_first() -> None:
    w = fingerprint_input((32, 64))
    w[9, 60], w[4, 2], w[4, 11] = np.inf, np.nan, -np.inf
    with pytest.raises(NonFiniteWeightError) as caught:
        Int8PerChannel().checked_pack(w, "F32", name="enc.w")
    text = str(caught.value)
    assert "tensor 'enc.w' holds NaN at row 4, column 2" in text and "3 non-finite values in 2 rows" in text, text
    assert "fix the checkpoint" in text, text


@pytest.mark.parametrize(
    ("shape", "at", "where"), [((64,), (7,), "at index 7"), ((2, 4, 8), (1, 2, 3), r"at index \(1, 2, 3\)")]
)
def test_a_non_finite_bias_norm_or_other_tensor_is_refused_too(
    shape: tuple[int, ...], at: tuple[int, ...], where: str
) -> None:
    w = np.ones(shape, np.float32)
    w[at] = np.nan
    with pytest.raises(NonFiniteWeightError, match=f"tensor 'x' holds NaN {where}"):
        Float32().checked_pack(w, "F32", name="x")


def test_a_finite_weight_a_scheme_cannot_hold_is_refused_not_turned_into_inf() -> None:
    """F64 beyond float32's range, float32 that bfloat16 rounds to Inf (above ~3.39e38), and an int4 group
    whose range overflows float32: refused like NaN, never packed as a non-finite value."""
    from packcache.packers_torch import Int4WeightOnly, LinearBFloat16

    huge = fingerprint_input((32, 64)).astype(np.float64)
    huge[2, 9] = 1e300
    for packer in [Float32(), Int8PerChannel(), *_torch_packers()]:
        with pytest.raises(NonFiniteWeightError, match=r"holds 1e\+300 at row 2, column 9.*float32"):
            packer.checked_pack(huge, "F64", name="w")
    top = fingerprint_input((32, 64))
    top[3, 4] = np.float32(3.4e38)
    with pytest.raises(NonFiniteWeightError, match=r"row 3, column 4.*bfloat16"):
        LinearBFloat16().checked_pack(top, "F32", name="w")
    spread = fingerprint_input((32, 64))
    spread[6, 33], spread[6, 40] = np.float32(3e38), np.float32(-3e38)
    for packer in (Int4WeightOnly(32), Int4WeightOnly(32, activation_aware=False)):  # bf16 scales since version 2
        with pytest.raises(NonFiniteWeightError, match=r"row 6, group 1.*overflows bfloat16"):
            packer.checked_pack(spread, "F32", fingerprint_stats(64), name="w")
    with pytest.raises(NonFiniteWeightError, match=r"row 6, group 1"):
        quantize_int4_groups(spread, 32)


@pytest.mark.parametrize("value", sorted(NON_FINITE))
def test_non_finite_calibration_statistics_are_refused(value: str) -> None:
    """``E[x x^T]`` holding NaN or Inf means the float model computes them on the calibration texts."""
    from packcache.packers_torch import Int4WeightOnly

    stats = fingerprint_stats(64)
    stats[3, 3] = NON_FINITE[value]
    with pytest.raises(NonFiniteWeightError, match="calibration statistics"):
        Int4WeightOnly(32).checked_pack(fingerprint_input((32, 64)), "F32", stats, name="w")
    with pytest.raises(NonFiniteWeightError, match="calibration statistics"):
        quantize_int4_activation_aware(fingerprint_input((32, 64)), 32, stats)


def test_a_custom_packer_that_makes_a_non_finite_pack_is_refused() -> None:
    class Reciprocal(Float32):
        id = "test.reciprocal"

        def pack(self, source: Any, dtype: str, stats: Any = None) -> dict[str, np.ndarray[Any, Any]]:
            with np.errstate(divide="ignore"):
                return {"weight": np.float32(1.0) / to_float32(source, dtype)}

    w = np.ones((4, 8), np.float32)
    w[2, 5] = 0.0
    made = r"tensor 'r' is finite, but packer test\.reciprocal made its part 'weight' hold \+Inf at row 2, column 5"
    with pytest.raises(NonFiniteWeightError, match=made):
        Reciprocal().checked_pack(w, "F32", name="r")


#: sha256 of each packer's pack of the fingerprint input, before non-finite weights were refused: the
#: refusal adds checks, it changes no byte of a finite pack (the int8 packers' version went from 1 to 2
#: only so that caches holding packs laundered by version 1 are rebuilt). torch.int8wo's version 3 packs
#: blocks of 32 with bfloat16 scales: new bytes, a new version.
FINGERPRINTS = {
    "np.f32": "b663132fdcddfaf81daf890f94100ac06ce9110e1881478c910ed2cf84806ad8",
    "np.f32t": "0e4348f76208c5e1ab2442d1f2f606fa54d8de44eb1e8f66bc17a5ba78c190e1",
    "np.int8c": "a3c07ae19a7cc508727a04252501f652942eabcc844fabd9a5b2ed4d3cdec0a0",
    "torch.linear.f32": "b663132fdcddfaf81daf890f94100ac06ce9110e1881478c910ed2cf84806ad8",
    "torch.linear.bf16": "b13068b554e1328272243c00715a0a34f612b2263afa32f9ab9e017bd16d9490",
    "torch.int8wo": "113e65b7c6cfee8358ae36653ae864333a98b8a1ae0345d4b2745b22e3594f48",
    # version 3, packcache's row-major layout: the same bytes on every CPU (versions 1 and 2 were torch's, per CPU
    # capability). The weight-only packer's: the last of the two int4 packers of _torch_packers, which share an id.
    "torch.int4wo": "6576b9b851026f11575a0d46ba7eccffc1f488516900972199c35bbea65f72bf",
}
#: The int4 codes, scales and zeros before they are laid out.
INT4_QUANTIZED = {
    "lsq-clip": "161bce403ff23ca8e1578837ddd2de0b65f277e8a111a7e63b5e9f1fbdff1271",
    "awq-lsq-clip": "0121ed90720fc3306b784781d70f517899b3f380788c49d9bd0ba3ea27a657a2",
}


def test_the_behavioural_fingerprints_and_the_self_check_still_hold() -> None:
    import torch

    from packcache.torch import PackedLinear

    packers = [Float32(), TransposeFloat32(), Int8PerChannel(), *_torch_packers()]
    got = {p.id: p.fingerprint() for p in packers if p.id in FINGERPRINTS}
    assert got == FINGERPRINTS
    x = fingerprint_input()

    def digest(arrays: Any) -> str:
        return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()

    assert digest(quantize_int4_groups(x, 32, zero_code=8)) == INT4_QUANTIZED["lsq-clip"]
    aware = quantize_int4_activation_aware(x, 32, fingerprint_stats(), zero_code=8)
    assert digest(aware) == INT4_QUANTIZED["awq-lsq-clip"]
    for packer in _torch_packers():
        for path in packer.paths:  # each path's kernel self-check on the fingerprint pack
            layer = PackedLinear.from_parts(packer, packer.fingerprint_pack(), None, kernel_path=path)
            with torch.inference_mode():
                assert bool(torch.isfinite(layer(torch.ones(2, 256))).all())


def test_rows_and_groups_of_subnormal_weights_pack_to_nearly_zero_without_warnings() -> None:
    """A largest magnitude below 127 (or 15) times the smallest subnormal makes the step 0: int8 and
    int4 divided by zero (a RuntimeWarning, an error under ``-W error``). They pack the values as ~0."""
    w = fingerprint_input((32, 64))
    w[:3] = 0.0
    w[0, :4], w[1, :] = np.float32(1e-44), np.float32(3e-39)
    w[2, :32] = np.linspace(0, 1e-42, 32, dtype=np.float32)
    weight, scales = quantize_int8_rows(w)
    assert np.abs(weight[:3].astype(np.float32) * scales[:3, None] - w[:3]).max() < 1e-38
    codes, scales4, zeros = quantize_int4_groups(w, 32, zero_code=8)
    assert np.abs(dequantize_int4(codes, scales4, zeros, zero_code=8)[:3] - w[:3]).max() < 1e-38
    for packer in [Int8PerChannel(), *_torch_packers()]:
        packer.checked_pack(w, "F32", fingerprint_stats(64), name="subnormal")  # filterwarnings = error


def test_a_refusal_survives_pickling_with_its_tensor_and_index() -> None:
    import pickle

    with pytest.raises(NonFiniteWeightError) as caught:
        Float32().checked_pack(np.array([1.0, np.nan], np.float32), "F32", name="b")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (str(copy), copy.tensor, copy.index) == (str(caught.value), "b", (1,))
