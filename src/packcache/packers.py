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
:mod:`packcache.packers_torch`, and the quantisation math every quantising packer calls in
:mod:`packcache.quantize`.

Source dtypes are safetensors codes (``"F32"``, ``"F16"``, ``"BF16"``); numpy has no
bfloat16, so a ``BF16`` source arrives as ``uint16`` holding the raw bits (:func:`to_float32`).

**Non-finite weights are refused.** Every packer here and in :mod:`packcache.packers_torch`
raises :class:`~packcache.errors.NonFiniteWeightError` for a source holding NaN, +Inf or -Inf,
or a finite value its scheme would turn into one (:func:`finite_float32`), naming the first
position and counting the rest; :meth:`Packer.checked_pack` adds the tensor's name, and refuses
a pack with a non-finite float part from any packer. No quantized scheme can compute what the
float model does with such a weight (an int8 row scale of NaN, an int4 group of span Inf), and
even the float model's answer depends on its attention kernel, so none pretends to.

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
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import numpy as np

from ._finite import finite_float32, non_finite_index, non_finite_source, position_text, to_float32, value_text
from .errors import NonFiniteWeightError, PackResultError
from .format import canonical_key, canonical_value

# The two int4 searches are named here by docs/TORCH.md; the quantisation math itself is packcache.quantize's.
from .quantize import quantize_int4_activation_aware, quantize_int4_groups, quantize_int8_rows

__all__ = [
    "FINGERPRINT_SHAPE",
    "Float32",
    "Int8PerChannel",
    "Packer",
    "Parts",
    "SCHEMES",
    "SourceMeta",
    "TransposeFloat32",
    "finite_float32",
    "fingerprint_input",
    "fingerprint_stats",
    "non_finite_index",
    "non_finite_source",
    "platform_for",
    "quantize_int4_activation_aware",
    "quantize_int4_groups",
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

    def part_keys(self, meta: SourceMeta, calibration: str | None = None) -> dict[str, bytes]:
        """Every part's pack key as canonical JSON: ``canonical_key(self.key(meta, part, calibration))``, assembled
        from members encoded once per packer (id, version, params) and once per tensor (``meta``), since
        keys are most of what a warm load computes per pack. A subclass that overrides :meth:`key` gets
        its own keys encoded.

        >>> from packcache.safetensors import TensorMeta
        >>> keys = Float32().part_keys(TensorMeta("w", (2, 3), "F32", "sha256:0:24"))
        >>> keys["weight"] == canonical_key(Float32().key(TensorMeta("w", (2, 3), "F32", "sha256:0:24"), "weight"))
        True
        """
        if type(self).key is not Packer.key:
            return {part: canonical_key(self.key(meta, part, calibration)) for part in self.parts}
        # Canonical JSON sorts members: calibration, packer, params, part, source, version.
        params = self.params
        cached = self.__dict__.get("_key_pieces")
        if cached is None or cached[0] != (self.id, self.version, params, self.parts):  # a packer changed since
            cached = self.__dict__["_key_pieces"] = (
                (self.id, self.version, params, self.parts),
                b'"packer":' + canonical_value(self.id) + b',"params":' + canonical_value(params) + b',"part":',
                b',"version":' + canonical_value(self.version) + b"}",
                {part: canonical_value(part) for part in self.parts},
            )
        _, packer, version, parts = cached
        head = b"{" + packer
        if self.uses_stats:
            head = b'{"calibration":' + canonical_value(calibration) + b"," + packer
        source = {"name": meta.name, "shape": list(meta.shape), "dtype": meta.dtype, "identity": meta.identity}
        tail = b',"source":' + canonical_value(source) + version
        return {part: head + encoded + tail for part, encoded in parts.items()}

    def platform_tags(self) -> dict[str, Any]:
        """Facts besides the fingerprint that make this packer's bytes valid (framework version, CPU)."""
        return {}

    def fingerprint(self) -> str:
        """sha256 (hex) of packing :func:`fingerprint_input`; computed once per process per packer identity.

        One pack. That the packer is deterministic is checked by :meth:`check_deterministic`, which the
        loaders call before a packer's first real pack in the process, where its output would be stored:
        a warm launch packs nothing and does not pay for it. A packer that is not deterministic has a
        fingerprint that differs between processes, so its files are rebuilt, and the check then refuses it.
        """
        identity = self._identity()
        digest = _FINGERPRINTS.get(identity)
        if digest is None:
            digest, _FINGERPRINT_PACKS[identity] = _fingerprint(self)
            _FINGERPRINTS[identity] = digest
        return digest

    def check_deterministic(self) -> None:
        """Pack :func:`fingerprint_input` again from a copy at another address and compare with the fingerprint's
        pack; once per process per packer identity (a set lookup afterwards). Output that depends on where the
        input or the packer's buffers live (pointers, address-dependent reorders) is not self-contained, and
        must never be cached.

        Raises:
            PackResultError: the bytes differ (the packer is not deterministic).
        """
        identity = self._identity()
        if identity not in _DETERMINISTIC:
            _check_deterministic(self)
            _DETERMINISTIC.add(identity)

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
        self,
        source: np.ndarray[Any, Any],
        dtype: str,
        stats: np.ndarray[Any, Any] | None = None,
        *,
        name: str | None = None,
    ) -> Parts:
        """:meth:`pack`, then check that every part is a plain self-contained array holding no NaN or Inf.

        ``name`` (the source tensor's name) is what a refusal names.

        Raises:
            PackResultError: a part is missing, extra, or not a cacheable array.
            NonFiniteWeightError: the source holds NaN or ±Inf, or a value this packer's scheme would
                turn into one, or the pack has a non-finite float part (whichever packer made it).
        """
        try:
            packed = self.pack(source, dtype, stats) if self.uses_stats else self.pack(source, dtype)
        except NonFiniteWeightError as error:
            if name is None or error.tensor is not None:
                raise
            raise error.naming(name) from None
        if not isinstance(packed, dict) or set(packed) != set(self.parts):
            got = sorted(packed) if isinstance(packed, dict) else type(packed).__name__
            raise PackResultError(f"packer {self.id} must return the parts {list(self.parts)}, got {got}")
        for part, array in packed.items():
            check_self_contained(array, f"{self.id}:{part}")
        # packcache's own pack() methods refuse before this (a second scan of a cold pack costs ~0.4 ns per
        # value); a packer whose pack() is anyone else's, a subclass's override included, is checked here.
        own = getattr(type(self).pack, "__module__", None) in _REFUSING_MODULES
        # pinned by tests/test_packers.py::test_a_custom_packer_that_makes_a_non_finite_pack_is_refused
        for part in () if own else self.parts:
            index = non_finite_index(packed[part])
            if index is not None:
                if dtype in ("F16", "F32", "F64", "BF16") and non_finite_index(source, dtype) is not None:
                    refused = non_finite_source(source, dtype)  # the packer passed the source's NaN or Inf on
                    raise refused if name is None else refused.naming(name)
                raise NonFiniteWeightError(
                    f"is finite, but packer {self.id} made its part {part!r} hold "
                    f"{value_text(float(packed[part][index]))} at {position_text(index)}",
                    tensor=name,
                    index=index,
                )
        return packed

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({params})"


_CACHEABLE_KINDS = "biuf"
#: Modules whose packers' pack() refuses non-finite values itself (:func:`finite_float32` and the quantizers).
_REFUSING_MODULES = frozenset({"packcache.packers", "packcache.packers_torch"})


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


#: Packer identities whose determinism check passed in this process (:meth:`Packer.check_deterministic`).
_DETERMINISTIC: set[tuple[str, str, int, str]] = set()


def _fingerprint(packer: Packer) -> tuple[str, Parts]:
    source = fingerprint_input()
    stats = fingerprint_stats() if packer.uses_stats else None
    first = packer.checked_pack(source, "F32", stats)
    digest = hashlib.sha256()
    for part in packer.parts:
        a = first[part]
        digest.update(f"{part}|{a.dtype.str}|{list(a.shape)}|".encode())
        digest.update(a.tobytes())
    for array in first.values():
        array.setflags(write=False)
    return digest.hexdigest(), first


def _check_deterministic(packer: Packer) -> None:
    """:meth:`Packer.check_deterministic`, once per identity."""
    first = packer.fingerprint_pack()
    source = fingerprint_input()
    stats = fingerprint_stats() if packer.uses_stats else None
    moved = np.empty(source.size + 64, dtype=np.float32)[64:].reshape(source.shape)
    moved[...] = source
    second = packer.checked_pack(moved, "F32", stats)
    for part in packer.parts:
        a, b = first[part], second[part]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            raise PackResultError(
                f"packer {packer.id} is not deterministic: packing the same input twice gave different "
                f"{part!r} bytes, so its output is not self-contained and cannot be cached"
            )


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
        return {"weight": finite_float32(source, dtype)}


class TransposeFloat32(Packer):
    """A 2-d float weight ``[out, in]`` (F32/F16/BF16) as float32 ``[in, out]``, C-contiguous.

    The layout a ``x @ W`` kernel reads without a transposed access.
    """

    id = "np.f32t"
    version = 1

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 2 else f"needs a 2-d weight, got shape {list(shape)}"

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        return {"weight": np.ascontiguousarray(finite_float32(source, dtype).T)}


class Int8PerChannel(Packer):
    """Symmetric per-output-channel int8 of a 2-d weight ``[out, in]``.

    Parts: ``weight`` int8 ``[out, in]`` with values in [-127, 127], and ``scales``
    float32 ``[out]``; the weight is ``weight * scales[:, None]``. A row's scale is
    its largest magnitude / 127 (1.0 for an all-zero row). This is exactly the
    operand layout of ``torch._weight_int8pack_mm``.

    Version 2: a pack of version 1 may hold a NaN row packed as an all-zero channel (version 2 refuses
    NaN and ±Inf), so a cache of version 1 is rebuilt once; finite packs are the same bytes.
    """

    id = "np.int8c"
    version = 2
    parts = ("weight", "scales")

    def eligible(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 2 else f"needs a 2-d weight, got shape {list(shape)}"

    def pack(self, source: np.ndarray[Any, Any], dtype: str, stats: np.ndarray[Any, Any] | None = None) -> Parts:
        weight, scales = quantize_int8_rows(finite_float32(source, dtype))
        return {"weight": weight, "scales": scales}
