"""Packers: deterministic functions from a source weight to packed bytes, with an identity.

A :class:`Packer` turns one source tensor (a numpy array as a safetensors file
stores it) into one or more *parts*, each a self-contained numpy array that the
cache stores as its own entry (an int8 weight and its scales are two parts).
Every packer has

- ``id`` and ``version``: bump the version whenever the bytes it produces change;
- ``params``: a JSON-able mapping of its parameters (group size, ...);
- :meth:`Packer.key`: the pack key of one source tensor, built from names,
  shapes, dtypes, the packer's identity and the source's identity, never from
  the tensor's content, so a warm launch reads no source byte;
- :meth:`Packer.fingerprint`: the sha256 of packing a small fixed pseudo-random
  input, computed once per process. :func:`platform_for` puts it in the cache's
  platform fingerprint, so a library upgrade that silently changes a layout
  forces exactly one rebuild instead of serving stale bytes.

This module imports numpy only; the packers that call torch's CPU kernels live in
:mod:`packcache.packers_torch`.

Source dtypes are safetensors codes (``"F32"``, ``"F16"``, ``"BF16"``); numpy has no
bfloat16, so a ``BF16`` source arrives as ``uint16`` holding the raw bits.

>>> import numpy as np
>>> w = np.arange(6, dtype=np.float16).reshape(2, 3)
>>> parts = TransposeFloat32().pack(w, "F16")
>>> parts["weight"].dtype, parts["weight"].shape
(dtype('float32'), (3, 2))
>>> q = Int8PerChannel().pack(np.array([[1.0, -2.0], [0.5, 0.25]], np.float32), "F32")
>>> q["weight"].tolist(), q["scales"].tolist()
([[64, -127], [127, 64]], [0.015748031437397003, 0.003937007859349251])
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol

import numpy as np

from .errors import PackResultError

__all__ = [
    "AWQ_EXPONENTS",
    "FINGERPRINT_SHAPE",
    "Float32",
    "Int8PerChannel",
    "Packer",
    "Parts",
    "SCHEMES",
    "SourceMeta",
    "TransposeFloat32",
    "fingerprint_input",
    "fingerprint_stats",
    "platform_for",
    "dequantize_int4",
    "packed_nbytes",
    "quantize_int4_activation_aware",
    "quantize_int4_groups",
    "quantize_int8_rows",
    "to_float32",
]

#: Bump when the meaning of a platform mapping built by :func:`platform_for` changes.
PLATFORM_VERSION = 1

#: Shape of the fixed input every fingerprint packs: rows and columns divisible by
#: 16 and by every int4 group size, so every packer accepts it.
FINGERPRINT_SHAPE = (32, 256)

Parts = dict[str, "np.ndarray[Any, Any]"]


class SourceMeta(Protocol):
    """What a key needs to know about a source tensor (e.g. :class:`packcache.safetensors.TensorMeta`)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def identity(self) -> str: ...


def to_float32(source: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """A float32 copy of ``source`` read as safetensors dtype ``dtype`` (``F32``, ``F16``, ``BF16``, ``F64``).

    >>> to_float32(np.array([0x3FC0], np.uint16), "BF16").tolist()
    [1.5]
    """
    if dtype == "BF16":
        if source.dtype.itemsize != 2:
            raise TypeError(f"a BF16 source must hold 2-byte items (uint16 bits), got {source.dtype}")
        bits = np.ascontiguousarray(source).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)
    if dtype in ("F32", "F16", "F64"):
        return np.array(source, dtype=np.float32, order="C", copy=True)
    raise TypeError(f"unsupported source dtype {dtype!r}: expected F32, F16, BF16 or F64")


def fingerprint_input(shape: tuple[int, int] = FINGERPRINT_SHAPE) -> np.ndarray[Any, Any]:
    """The fixed pseudo-random float32 matrix every fingerprint packs.

    Made with integer arithmetic only (splitmix64), so it is the same on every
    machine and numpy version. Values are roughly normal-shaped with a few
    outliers, one all-zero row and one constant row, to exercise scale edge cases.

    >>> fingerprint_input((2, 4)).dtype, fingerprint_input().shape
    (dtype('float32'), (32, 256))
    """
    count = shape[0] * shape[1]
    z = np.arange(count, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    # Sum of three uniforms in [-1, 1): bell-shaped, bounded, exact in float32.
    parts = [((z >> np.uint64(s)) & np.uint64(0xFFFF)).astype(np.float32) for s in (0, 16, 32)]
    total = parts[0] + parts[1] + parts[2]
    values: np.ndarray[Any, Any] = (total / np.float32(3 * 32768.0) - np.float32(1.0)).astype(np.float32)
    values = values.reshape(shape)
    if shape[1] > 7:
        values[:, 7] *= np.float32(8.0)  # an outlier column
    if shape[0] > 2:
        values[1, :] = 0.0
        values[2, :] = 0.25
    return values


class Packer:
    """Base class of packers: identity, key and fingerprint; subclasses implement :meth:`pack`.

    Class attributes ``id``, ``version`` and ``parts`` (the names of the arrays one
    pack produces, in order) identify the packer; :attr:`params` holds its parameters.
    """

    id: ClassVar[str] = ""
    version: ClassVar[int] = 0
    parts: ClassVar[tuple[str, ...]] = ("weight",)
    #: Whether :meth:`pack` uses input statistics (``stats``) measured on calibration data.
    uses_stats: ClassVar[bool] = False

    @property
    def params(self) -> dict[str, Any]:
        """JSON-able parameters; two packers with equal id, version and params pack alike."""
        return {}

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        """``None`` if this packer can pack a source of ``shape``, else why not (a sentence)."""
        return None

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        """Pack one source tensor (``dtype`` is its safetensors code) into its parts.

        ``stats`` is ``E[x x^T]`` of the layer's input on calibration data, for packers
        with :attr:`uses_stats`; others ignore it.

        Returns:
            ``{part: array}`` for every name in :attr:`parts`; each array is a plain,
            C-contiguous, little-endian numpy array owning self-contained bytes.
        """
        raise NotImplementedError

    def key(self, meta: SourceMeta, part: str, calibration: str | None = None) -> dict[str, Any]:
        """The pack key of ``part`` of the source described by ``meta`` (reads no tensor byte).

        ``calibration`` identifies the calibration data behind ``stats`` (only for
        packers with :attr:`uses_stats`; ``None``: packed without statistics).
        """
        key = {
            "packer": self.id,
            "version": self.version,
            "params": self.params,
            "part": part,
            "source": {"name": meta.name, "shape": list(meta.shape), "dtype": meta.dtype, "identity": meta.identity},
        }
        if self.uses_stats:
            key["calibration"] = calibration
        return key

    def platform_tags(self) -> dict[str, Any]:
        """Facts besides the fingerprint that make this packer's bytes valid (framework version, CPU)."""
        return {}

    def fingerprint(self) -> str:
        """sha256 (hex) of packing :func:`fingerprint_input`; computed once per process per packer identity.

        Raises:
            PackResultError: packing the same input twice gave different bytes (the
                packer is not deterministic, or its output depends on addresses).
        """
        identity = self._identity()
        digest = _FINGERPRINTS.get(identity)
        if digest is None:
            digest, _FINGERPRINT_PACKS[identity] = _fingerprint(self)
            _FINGERPRINTS[identity] = digest
        return digest

    def fingerprint_pack(self) -> Parts:
        """The parts of this packer's pack of :func:`fingerprint_input` (with :func:`fingerprint_stats`
        if it uses them), as :meth:`fingerprint` made them: for checks that need the pack itself
        (a kernel self-check) without packing again. Read-only; computed once per process."""
        Packer.fingerprint(self)
        return _FINGERPRINT_PACKS[self._identity()]

    def _identity(self) -> tuple[str, str, int, str]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", self.id, self.version, self._params_json())

    def _params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)

    def describe(self) -> dict[str, Any]:
        """The packer's entry in a platform mapping: id, version, params, fingerprint."""
        return {"id": self.id, "version": self.version, "params": self.params, "fingerprint": self.fingerprint()}

    def checked_pack(
        self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None
    ) -> Parts:
        """:meth:`pack`, then check that every part is a plain self-contained array.

        Raises:
            PackResultError: a part is missing, extra, or not a cacheable array.
        """
        packed = self.pack(source, dtype, stats) if self.uses_stats else self.pack(source, dtype)
        if not isinstance(packed, dict) or set(packed) != set(self.parts):
            got = sorted(packed) if isinstance(packed, dict) else type(packed).__name__
            raise PackResultError(f"packer {self.id} must return the parts {list(self.parts)}, got {got}")
        for part, array in packed.items():
            check_self_contained(array, f"{self.id}:{part}")
        return packed

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({params})"


_CACHEABLE_KINDS = "biuf"


def check_self_contained(array: object, what: str) -> None:
    """Refuse anything but a plain numeric, little-endian, C-contiguous numpy array owning plain bytes.

    Raises:
        PackResultError: naming ``what`` and the problem.
    """
    if not isinstance(array, np.ndarray) or type(array) is not np.ndarray:
        raise PackResultError(f"{what}: a pack must be a plain numpy.ndarray, got {type(array).__name__}")
    if array.dtype.kind not in _CACHEABLE_KINDS or array.dtype.fields is not None or array.dtype.hasobject:
        raise PackResultError(f"{what}: dtype {array.dtype} is not plain numeric bytes")
    if array.dtype.byteorder == ">":
        raise PackResultError(f"{what}: dtype {array.dtype} is big-endian; packs are little-endian")
    if not array.flags.c_contiguous:
        raise PackResultError(f"{what}: the array is not C-contiguous")


def fingerprint_stats(features: int = FINGERPRINT_SHAPE[1]) -> np.ndarray[Any, Any]:
    """The fixed ``E[x x^T]`` packers with ``uses_stats`` get in their fingerprint: from 64 rows of
    :func:`fingerprint_input`, with every feature scaled differently."""
    rows = fingerprint_input((64, features)).astype(np.float64)
    rows *= np.linspace(0.25, 4.0, features)[None, :]
    result: np.ndarray[Any, Any] = rows.T @ rows / rows.shape[0]
    return result


#: The weight schemes of the linear layers (:func:`packcache.torch.scheme_packer` maps each to its
#: torch packer), named here, without torch, so the command line can list them.
SCHEMES = ("fp32", "bf16", "int8", "int4")


#: Fingerprints computed in this process, by (class, id, version, params): each is computed once.
_FINGERPRINTS: dict[tuple[str, str, int, str], str] = {}
#: The pack each fingerprint hashed (a few KiB per packer), by the same identity.
_FINGERPRINT_PACKS: dict[tuple[str, str, int, str], Parts] = {}


def _fingerprint(packer: Packer) -> tuple[str, Parts]:
    source = fingerprint_input()
    stats = fingerprint_stats() if packer.uses_stats else None
    first = packer.checked_pack(source, "F32", stats)
    # Pack again from a copy at another address: output that depends on where the
    # input or the packer's buffers live (pointers, address-dependent reorders) differs.
    moved = np.empty(source.size + 64, dtype=np.float32)[64:].reshape(source.shape)
    moved[...] = source
    second = packer.checked_pack(moved, "F32", None if stats is None else stats.copy())
    digest = hashlib.sha256()
    for part in packer.parts:
        a, b = first[part], second[part]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            raise PackResultError(
                f"packer {packer.id} is not deterministic: packing the same input twice gave different "
                f"{part!r} bytes, so its output is not self-contained and cannot be cached"
            )
        digest.update(f"{part}|{a.dtype.str}|{list(a.shape)}|".encode())
        digest.update(a.tobytes())
    for array in first.values():
        array.setflags(write=False)
    return digest.hexdigest(), first


def platform_for(packers: Iterable[Packer]) -> dict[str, Any]:
    """The ``platform=`` mapping for a :class:`packcache.WeightCache` holding packs of ``packers``.

    It lists every packer's id, version, params and behavioural fingerprint, plus
    each packer's :meth:`Packer.platform_tags` (torch version, CPU capability).
    A cache file made under a different mapping is rebuilt.

    >>> platform_for([Float32()])["packers"][0]["id"]
    'np.f32'
    """
    described = {json.dumps(p.describe(), sort_keys=True): p for p in packers}
    tags: dict[str, Any] = {}
    for packer in described.values():
        for name, value in packer.platform_tags().items():
            if tags.setdefault(name, value) != value:
                raise ValueError(f"packers disagree on platform tag {name!r}: {tags[name]!r} vs {value!r}")
    return {
        "packcache.packers": PLATFORM_VERSION,
        **tags,
        "packers": [json.loads(text) for text in sorted(described)],
    }


class Float32(Packer):
    """Any float source (F32/F16/BF16) as float32, same shape: biases, norms, embeddings."""

    id = "np.f32"
    version = 1

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        return {"weight": to_float32(source, dtype)}


class TransposeFloat32(Packer):
    """A 2-d float weight ``[out, in]`` (F32/F16/BF16) as float32 ``[in, out]``, C-contiguous.

    The layout a ``x @ W`` kernel reads without a transposed access.
    """

    id = "np.f32t"
    version = 1

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 2 else f"needs a 2-d weight, got shape {list(shape)}"

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        return {"weight": np.ascontiguousarray(to_float32(source, dtype).T)}


class Int8PerChannel(Packer):
    """Symmetric per-output-channel int8 of a 2-d weight ``[out, in]``.

    Parts: ``weight`` int8 ``[out, in]`` with values in [-127, 127], and ``scales``
    float32 ``[out]``; the weight is ``weight * scales[:, None]``. A row's scale is
    its largest magnitude / 127 (1.0 for an all-zero row). This is exactly the
    operand layout of ``torch._weight_int8pack_mm``.
    """

    id = "np.int8c"
    version = 1
    parts = ("weight", "scales")

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 2 else f"needs a 2-d weight, got shape {list(shape)}"

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        weight, scales = quantize_int8_rows(to_float32(source, dtype))
        return {"weight": weight, "scales": scales}


def quantize_int8_rows(w: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Round-to-nearest symmetric int8 per row of float32 ``w``: ``(int8 weight, float32 scales)``."""
    amax = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    scales = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


#: Candidate code ranges tried per group by :func:`quantize_int4_groups`, as a
#: fraction of the group's min-max span: 1.0 is plain min/max round-to-nearest.
INT4_RANGE_STEPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)

#: Exponents tried by :func:`quantize_int4_activation_aware` for the per-input-channel scale.
AWQ_EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def quantize_int4_groups(
    w: np.ndarray[Any, Any],
    group_size: int,
    *,
    zero_code: int = 0,
    importance: np.ndarray[Any, Any] | None = None,
    refine: int = 2,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Asymmetric 4-bit quantization of ``w [out, in]`` in groups of ``group_size`` along ``in``.

    Each group of ``g`` values ``x`` gets codes ``q`` in 0..15, a scale ``s`` and an
    offset ``m`` with ``x ~ q*s + m``, chosen to minimise the weighted squared error
    ``sum_j d_j (q_j s + m - x_j)^2`` (``d = importance`` per input feature, default 1):

    1. for each candidate range ``r`` in :data:`INT4_RANGE_STEPS` (1.0, 0.95, ..., 0.5
       of the group's min-max span, centred on it), round ``x`` to codes of step
       ``span * r / 15`` -- a narrower range clips outliers but refines the other levels;
    2. for those codes, solve the weighted 2x2 least-squares problem for the best ``(s, m)``;
    3. keep the candidate with the least error; then ``refine`` times re-round with the
       fitted ``(s, m)`` and re-fit, keeping the result only if the error drops.

    Deterministic, and never worse than plain round-to-nearest (the ``r = 1.0`` candidate).

    Returns ``(codes uint8 [out, in], scales float32 [in/g, out], zeros float32
    [in/g, out])`` with ``x ~ (q - zero_code) * scale + zero``: ``zero_code=8`` is
    the convention of torch's int4 CPU kernel. The final codes are rounded against
    the float32 scale and zero actually stored.

    >>> codes, scales, zeros = quantize_int4_groups(np.linspace(-1, 1, 32, dtype=np.float32)[None], 32)
    >>> codes.shape, scales.shape, int(codes.min()), int(codes.max())
    ((1, 32), (1, 1), 0, 15)
    """
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    shape = (out_features, in_features // group_size, group_size)
    # float32 search (half the memory traffic of float64); sums over one group of <= 128 stay exact enough.
    x = np.asarray(w, dtype=np.float32).reshape(shape)
    if importance is None:
        d = np.ones((1, shape[1], group_size), np.float32)
    else:
        raw = np.asarray(importance, dtype=np.float64)
        raw = np.where(raw > 0, raw, 0.0)
        peak = raw.max() if raw.size and raw.max() > 0 else 1.0
        # Normalised to a peak of 1; a feature never seen still counts a little.
        d = (raw / peak + 1e-6).astype(np.float32).reshape(1, shape[1], group_size)
    lo, hi = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
    span = hi - lo
    flat = span <= 0
    safe_span = np.where(flat, 1.0, span)
    centre = (hi + lo) / 2
    sum_d = np.broadcast_to(d.sum(axis=2, keepdims=True), lo.shape)
    dx = d * x
    sum_dx = dx.sum(axis=2, keepdims=True)
    best_err = np.full(lo.shape, np.inf, np.float32)
    best_s, best_m = safe_span / np.float32(15.0), lo.copy()

    def consider(codes: np.ndarray[Any, Any]) -> None:
        nonlocal best_err, best_s, best_m
        dq = d * codes
        sum_q, sum_qq, sum_qx = (
            dq.sum(axis=2, keepdims=True),
            (dq * codes).sum(axis=2, keepdims=True),
            (dq * x).sum(axis=2, keepdims=True),
        )
        det = sum_d * sum_qq - sum_q * sum_q
        ok = det > np.float32(1e-20)
        safe = np.where(ok, det, 1.0)
        s = np.where(ok, (sum_d * sum_qx - sum_q * sum_dx) / safe, best_s)
        m = np.where(ok, (sum_qq * sum_dx - sum_q * sum_qx) / safe, best_m)
        diff = codes * s + m - x
        err = (d * diff * diff).sum(axis=2, keepdims=True)
        better = (err < best_err) & (s > 0)
        best_err = np.where(better, err, best_err)
        best_s, best_m = np.where(better, s, best_s), np.where(better, m, best_m)

    for ratio in INT4_RANGE_STEPS:
        step = safe_span * np.float32(ratio / 15.0)
        consider(np.clip(np.rint((x - (centre - safe_span * np.float32(ratio / 2))) / step), 0, 15))
    for _ in range(refine):
        consider(np.clip(np.rint((x - best_m) / best_s), 0, 15))
    scales = np.where(flat, 0.0, best_s).astype(np.float32)
    zeros = np.where(flat, lo, best_m.astype(np.float64) + zero_code * best_s.astype(np.float64)).astype(np.float32)
    x = x.astype(np.float64)
    # Final codes against the float32 scale and zero the kernel will actually use.
    s64 = scales.astype(np.float64)
    m64 = zeros.astype(np.float64) - zero_code * s64
    codes = np.clip(np.rint((x - m64) / np.where(flat, 1.0, s64)), 0, 15)
    codes = np.where(flat, zero_code, codes).astype(np.uint8).reshape(out_features, in_features)
    return codes, np.ascontiguousarray(scales[:, :, 0].T), np.ascontiguousarray(zeros[:, :, 0].T)


def dequantize_int4(
    codes: np.ndarray[Any, Any], scales: np.ndarray[Any, Any], zeros: np.ndarray[Any, Any], zero_code: int = 0
) -> np.ndarray[Any, Any]:
    """The float64 ``[out, in]`` weight that :func:`quantize_int4_groups`'s output stands for."""
    group = codes.shape[1] // scales.shape[0]
    s = np.repeat(scales.T.astype(np.float64), group, axis=1)
    z = np.repeat(zeros.T.astype(np.float64), group, axis=1)
    result: np.ndarray[Any, Any] = (codes.astype(np.float64) - zero_code) * s + z
    return result


def quantize_int4_activation_aware(
    w: np.ndarray[Any, Any], group_size: int, second_moment: np.ndarray[Any, Any], *, zero_code: int = 0
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Int4 of ``w [out, in]`` with a per-input-feature scale chosen from input statistics (AWQ-style).

    ``second_moment`` is ``E[x x^T]`` of the layer's input ``[in, in]``, measured on a
    few calibration texts. With ``a_j = sqrt(E[x_j^2])`` normalised to geometric mean 1,
    for each exponent ``alpha`` in :data:`AWQ_EXPONENTS` the weight's columns are scaled by
    ``c = a^alpha``, quantized by :func:`quantize_int4_groups` with importance ``E[x_j^2] / c_j^2``
    and scaled back; the ``alpha`` whose weight error ``D`` gives the least expected output
    error ``sum_rows D E[x x^T] D^T`` wins (``alpha = 0`` is the plain search, so it is never worse
    on the calibration statistics). Features that matter get finer steps.

    Returns ``(codes, scales, zeros, input_scales)``: the layer computes
    ``(x * input_scales) @ dequant(codes, scales, zeros)^T``; ``input_scales = 1 / c`` (float32 ``[in]``).
    """
    h = np.asarray(second_moment, dtype=np.float64)
    energy = np.clip(np.diag(h), 0.0, None)
    rms = np.sqrt(energy)
    positive = rms > 0
    base = np.where(positive, rms, 1.0)
    base = base / np.exp(np.log(base[positive]).mean()) if positive.any() else base
    w64 = np.asarray(w, dtype=np.float64)
    best: tuple[float, tuple[Any, Any, Any], np.ndarray[Any, Any]] | None = None
    for alpha in AWQ_EXPONENTS:
        inv = (1.0 / base**alpha).astype(np.float32)
        column = 1.0 / inv.astype(np.float64)  # the scale the float32 input scale really undoes
        result = quantize_int4_groups(
            w64 * column, group_size, zero_code=zero_code, importance=energy / (column * column)
        )
        delta = dequant = dequantize_int4(*result, zero_code=zero_code)
        delta = dequant / column - w64
        err = float(np.sum((delta @ h) * delta))
        if best is None or err < best[0]:
            best = (err, result, inv)
    assert best is not None
    codes, scales, zeros = best[1]
    return codes, scales, zeros, best[2]


def packed_nbytes(parts: Mapping[str, np.ndarray[Any, Any]]) -> int:
    """Total bytes of a pack's parts."""
    return sum(int(a.nbytes) for a in parts.values())
