"""PyTorch integration: converting a module so that its weights come packed from the cache, zero-copy.

This module's one idea is the conversion; it is also the public face of the torch integration.
:func:`convert` walks a module, replaces every eligible ``nn.Linear`` by a :class:`PackedLinear` whose operands
are tensors over the cache's read-only mapping (``torch.frombuffer``, no copy), given an ``embedding`` packer
every ``nn.Embedding`` by a :class:`PackedEmbedding` over its table in that packer's form (bf16, or int8 rows
with a scale per block of 32), and gives every other parameter the same treatment (as float32). Ineligible layers
(shapes the kernel cannot take) stay ``nn.Linear`` and are listed in the :class:`ConversionReport`.

Sources are lazy. The pack keys come from names, shapes, dtypes, the packer's
identity and the source's identity (:class:`packcache.safetensors.SafetensorsFile`:
the sha256 of the file's bytes and its size, found without reading the file on a
warm launch, see :mod:`packcache.identity`; :class:`ModuleSource`: a caller-given
model id, or the sha256 of the parameters), and a source tensor is read only inside
the ``pack`` callable, which a hit never calls: a warm launch reads no source byte.
The module may be built on the ``meta`` device (``with torch.device("meta"): model
= MyModel()``) so its own weights are never materialised.

Packed tensors are views of a read-only file mapping: writing to them in place
crashes the process (SIGSEGV), which is why they are buffers and parameters
without gradients, and why ``load_state_dict`` into a converted module raises
``RuntimeError`` instead of copying into them. Saving works: ``state_dict()``
holds every weight the way the float module held it (a packed layer's weight is
the float32 weight it computes, see :meth:`PackedLinear.float_weight`), so
``torch.save(model.state_dict())`` and ``save_pretrained`` write a complete
float checkpoint. This module imports torch; ``import packcache`` does not.

:func:`open_cache` and :func:`scheme_packer`, which a model loader calls before :func:`convert`, live in
:mod:`packcache.loader` (with the scheme resolution every loader shares); the packed layers (:class:`PackedLinear`,
:class:`PackedEmbedding`, :func:`check_kernels`) in :mod:`packcache._torch_layers`; the plan of which tensors are
packed how (:func:`count_packs`, :func:`parameter_groups`) in :mod:`packcache._torch_plan`. All are importable from
here, the path to use.

>>> import torch, packcache
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
>>> from packcache.packers_torch import Int8WeightOnly
>>> report = convert(model, packcache.WeightCache(None), Int8WeightOnly(), model_id="doctest-model")
>>> report.converted, report.ineligible, report.stats.state
(['0', '2'], {}, 'off')
>>> model(torch.zeros(1, 64)).shape
torch.Size([1, 3])
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from ._torch_layers import (
    _READ_ONLY_HOOK,
    FloatLinear,
    PackedEmbedding,
    PackedLinear,
    _ReadOnlyTensors,
    _SharedFloat,
    check_kernels,
)
from ._torch_plan import _plan, count_packs, parameter_groups
from ._torch_sources import (
    Calibration,
    ModuleSource,
    TensorSource,
    load_parts,
    materialize,
    part_requests,
    record_linear_inputs,
)
from .cache import Request, Session, WeightCache
from .errors import PackResultError
from .loader import open_cache, scheme_packer
from .packers import Float32, Packer, Parts, SourceMeta
from .packers_torch import STORAGE_DTYPES, TorchPacker, as_tensor
from .safetensors import TensorMeta
from .stats import CacheStats

__all__ = [
    "Calibration",
    "ConversionReport",
    "FloatLinear",
    "ModuleSource",
    "PackedEmbedding",
    "PackedLinear",
    "TensorSource",
    "as_tensor",
    "check_kernels",
    "convert",
    "count_packs",
    "load_parts",
    "materialize",
    "open_cache",
    "parameter_groups",
    "part_requests",
    "record_linear_inputs",
    "scheme_packer",
]


@dataclass
class ConversionReport:
    """What :func:`convert` did.

    Attributes:
        converted: names of the ``nn.Linear`` modules now :class:`PackedLinear`.
        ineligible: name → reason for ``nn.Linear`` modules the packer cannot take;
            they stay ``nn.Linear`` (their weights come from the cache as float32).
        parameters: names of the other parameters now served from the cache as float32.
        embeddings: names of the ``nn.Embedding`` modules now :class:`PackedEmbedding` (their tables in the
            ``embedding`` packer's form); ``float_embeddings``: name -> why one stayed float32.
        tied: name served → the other names of the same (tied) parameter, which share its tensor.
        packed_ties: packed layer → the other names of the tensor its weight is tied to (an output head
            tied to the input embeddings): both come from the one source tensor. With an ``embedding`` packer
            the head and the embeddings read one pack; without one the layer is packed and the embeddings
            served as float32. Its ``state_dict`` writes the embeddings' float32 tensor, so the tie stays.
        packed_bytes: bytes of every array served from the cache for this module.
        stats: the cache's statistics when the conversion ended.
        kernel_path: the kernel path of the packed layers (:mod:`packcache.kernels`).
        kernels: per kind of linear layer (the last part of its name: ``q_proj``, ``lm_head``, ``dense``),
            the torch ops it runs on that path, with their row ranges (:meth:`TorchPacker.kernels`), or why it
            is a float32 layer; one entry per kind (layers of a kind are packed alike).
    """

    converted: list[str] = field(default_factory=list)
    ineligible: dict[str, str] = field(default_factory=dict)
    parameters: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)
    float_embeddings: dict[str, str] = field(default_factory=dict)
    tied: dict[str, list[str]] = field(default_factory=dict)
    packed_ties: dict[str, list[str]] = field(default_factory=dict)
    packed_bytes: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    kernel_path: str = "fp32"
    kernels: Mapping[str, str] = field(default_factory=dict)


class _KernelNames(Mapping[str, str]):
    """:attr:`ConversionReport.kernels`, worded when first read: naming a layer's ops may load the compiled part
    (milliseconds), which a load that never reads the report must not pay."""

    def __init__(self) -> None:
        self._kinds: dict[str, tuple[TorchPacker, str] | str] = {}
        self._names: dict[str, str] | None = None

    def add(self, kind: str, what: tuple[TorchPacker, str] | str) -> None:
        self._kinds.setdefault(kind, what)
        self._names = None

    def _worded(self) -> dict[str, str]:
        if self._names is None:
            self._names = {
                kind: what if isinstance(what, str) else what[0].kernels(what[1]) for kind, what in self._kinds.items()
            }
        return self._names

    def __getitem__(self, kind: str) -> str:
        return self._worded()[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def __repr__(self) -> str:
        return repr(self._worded())


def convert(
    module: nn.Module,
    cache: WeightCache,
    packer: Packer,
    *,
    session: Session | None = None,
    source: TensorSource | None = None,
    model_id: str | None = None,
    source_prefix: str = "",
    other: Packer | None = None,
    embedding: TorchPacker | None = None,
    calibration: Calibration | None = None,
    kernel_path: str | None = None,
    transposed: tuple[type[nn.Module], ...] = (),
) -> ConversionReport:
    """Convert ``module`` in place: packed linear layers and parameters served from ``cache``.

    Args:
        module: the model. Its parameters may live on the ``meta`` device when
            ``source`` is given: nothing of them is read.
        cache: the :class:`~packcache.WeightCache` the packs come from.
        session: an active session of ``cache`` to convert in (to load several modules
            in one session); by default a session is opened and closed here.
        packer: the packer of eligible ``nn.Linear`` weights, one of
            :mod:`packcache.packers_torch` (``LinearFloat32``, ``LinearBFloat16``,
            ``Int8WeightOnly``, ``Int4WeightOnly``).
        source: where the weights come from (e.g. a
            :class:`~packcache.safetensors.SafetensorsFile`); ``None`` reads the
            module's own parameters through :class:`ModuleSource`.
        model_id: with ``source=None``, the identity of the module's weights (see :class:`ModuleSource`).
        source_prefix: prepended to a parameter's name to find it in ``source``.
        other: packer of every other parameter (default float32, :class:`~packcache.packers.Float32`).
        embedding: packer of the ``nn.Embedding`` tables (one whose packs are tables,
            :attr:`~packcache.packers_torch.TorchPacker.embeds`: ``LinearBFloat16``, ``Int8WeightOnly``,
            what :data:`packcache.loader.EMBEDDING_PACKERS` names per scheme); each such module becomes a
            :class:`PackedEmbedding`. ``None`` (the default): tables are float32 parameters like the rest.
            A subclass of ``nn.Embedding`` (its own forward), one with ``max_norm``, or a table whose
            tensor another kind of module shares stays float32 (``report.float_embeddings`` says why).
        calibration: input statistics for a packer that uses them (activation-aware int4);
            recorded only if such a pack misses. Without it that packer packs weight-only.
        kernel_path: the kernel path of every :class:`PackedLinear` (``"bf16"``, ``"fp32"``,
            or ``None``/``"auto"``: this machine's rule, see :mod:`packcache.kernels`). It is a
            runtime choice: the packs, their keys and the platform are the same on every path.
        transposed: module classes that compute ``x @ weight + bias`` with ``weight`` stored
            ``[in, out]`` (GPT-2's ``Conv1D``); they are packed like ``nn.Linear`` from the
            transposed source (their pack keys say so) and replaced by :class:`PackedLinear`.

    A parameter shared by several modules (tied weights, e.g. a language-model head tied to
    the input embeddings) is fetched once, under the first of its names the source holds,
    and the one float32 tensor is given to every owner; the other names are listed in
    ``report.tied``. A linear layer among the owners (an output head tied to the input embeddings)
    is listed in ``report.packed_ties`` and its ``state_dict`` writes the embeddings' float32 tensor, so a
    saved model is still tied. With an ``embedding`` packer, the embeddings and the head read one pack of
    that packer (per-row int8 *is* per-output-channel int8): the head runs that packer's kernel, whatever
    ``packer`` is. Without one, the head is packed by ``packer`` from that same source tensor, while the
    embeddings keep it as float32; and with the float32 scheme the head stays a float32 layer over the one
    tensor (listed in ``report.ineligible``): packing it would store the same bytes twice.

    Returns:
        A :class:`ConversionReport`; ``report.stats`` is the cache's state afterwards and
        ``report.kernel_path`` the path the packed layers run.

    Raises:
        ValueError: a source tensor's shape differs from the module's parameter, or the
            packer has no such kernel path.
        TypeError: ``packer`` is not a torch packer.
        Whatever the source or a packer raises; cache problems are never raised.
    """
    if not isinstance(packer, TorchPacker):
        raise TypeError(f"convert() needs a packcache.packers_torch packer for the linear layers, got {packer!r}")
    if embedding is not None and (not isinstance(embedding, TorchPacker) or not embedding.embeds):
        raise TypeError(f"convert() needs a packer of embedding tables (TorchPacker.embeds), got {embedding!r}")
    path = packer.kernel_path(kernel_path)  # before any pack: a bad path fails fast
    other = other if other is not None else Float32()
    if source is None:
        source = ModuleSource(module, model_id)
    report = ConversionReport(kernel_path=path)
    try:
        if session is None:
            with cache.session() as own:
                _convert(module, own, packer, other, embedding, source, source_prefix, calibration, report, transposed)
        else:
            _convert(module, session, packer, other, embedding, source, source_prefix, calibration, report, transposed)
    finally:
        if calibration is not None:
            calibration.release()
    report.stats = cache.stats()
    return report


def _convert(
    module: nn.Module,
    session: Session,
    packer: TorchPacker,
    other: Packer,
    embedding: TorchPacker | None,
    source: TensorSource,
    prefix: str,
    calibration: Calibration | None,
    report: ConversionReport,
    transposed: tuple[type[nn.Module], ...],
) -> None:
    queue: list[Request] = []  # requests not served yet
    served: list[np.ndarray[Any, Any]] = []  # what every request before them was served

    def flush() -> None:
        served.extend(session.get_many(queue))
        queue.clear()

    def wanted(
        names: list[str], expected: tuple[int, ...], with_packer: Packer, layer: str | None = None, flip: bool = False
    ) -> slice:
        """Queue the requests of one source tensor's pack; where its parts will be in the batch's answer."""
        name, meta = _first_meta(source, [prefix + n for n in names])
        if flip:
            if len(meta.shape) != 2:
                raise ValueError(f"source tensor {name!r} has shape {list(meta.shape)}; a transposed layer needs 2-d")
            meta = TensorMeta(meta.name, meta.shape[::-1], meta.dtype, meta.identity + ";transposed")
        if tuple(meta.shape) != expected:
            raise ValueError(f"source tensor {name!r} has shape {list(meta.shape)}, the module {list(expected)}")
        stats = None
        if calibration is not None and layer is not None:
            stats = functools.partial(calibration.second_moment, layer)

        def read() -> np.ndarray[Any, Any]:
            array = source.read(name)
            return np.ascontiguousarray(array.T) if flip else array

        start = len(served) + len(queue)
        queue.extend(
            part_requests(
                name, with_packer, meta, read,
                stats=stats, calibration=calibration.identity if calibration is not None else None,
            )
        )  # fmt: skip
        if len(queue) >= _BATCH:
            flush()
        return slice(start, start + len(with_packer.parts))

    modules = dict(module.named_modules())
    plan = _plan(module, packer, transposed, embedding)
    report.ineligible.update(plan.ineligible)
    report.float_embeddings.update(plan.float_embeddings)
    tables = [(table, wanted(list(table.names), table.shape, table.packer)) for table in plan.tables]
    # Requests in batches of a few layers (shapes checked, nothing read): a warm load maps each batch in one pass,
    # and the requests' own objects (keys, callables) never all exist at once: they would leave heap behind.
    layers = []
    for layer in plan.linears:
        dotted = f"{layer.name}." if layer.name else ""
        names = [f"{dotted}weight", *layer.tied]  # a tied checkpoint saves the tensor under one of them
        layers.append((
            layer,
            # A head tied to a packed table reads the table's pack (below); it has no pack of its own.
            None if layer.table else wanted(names, layer.shape, packer, layer=layer.name, flip=layer.transposed),
            # pinned by tests/test_hf_ties.py::test_a_masked_lm_checkpoint_saved_tied_loads_in_every_scheme
            wanted([f"{dotted}bias", *layer.bias_tied], (layer.shape[0],), other) if layer.has_bias else None,
        ))  # fmt: skip
    parameters = []  # (its names, the module's parameter, where its array lands in served)
    for names in plan.parameters:
        needed = module.get_parameter(names[0])
        parameters.append((names, needed, wanted([*names, *plan.also.get(names[0], ())], tuple(needed.shape), other)))
    flush()
    report.packed_bytes += sum(int(a.nbytes) for a in served)

    tied_layers: dict[str, PackedLinear] = {}  # name of a served float parameter -> the packed layer tied to it
    kernels = _KernelNames()
    report.kernels = kernels
    table_parts: dict[str, tuple[Parts, _SharedFloat]] = {}  # a table's first name -> its parts and float weight
    for table, at in tables:
        parts = dict(zip(table.packer.parts, served[at], strict=True))
        shared: _SharedFloat | None = None
        for paths, padding_idx in table.modules:
            new_table = PackedEmbedding.from_parts(
                table.packer, parts, padding_idx=padding_idx, name=paths[0], shape=table.shape
            )
            if shared is None:
                shared = new_table._shared
            new_table.__dict__["_shared"] = shared  # every module of a tie writes the one tensor
            for name in paths:
                _replace(modules, name, new_table, root=module)
            report.embeddings.append(paths[0])
        assert shared is not None
        table_parts[table.names[0]] = parts, shared
        head_names = {f"{name}.weight" for name, tie in plan.table_ties.items() if tie == table.names[0]}
        rest = [n for n in table.names[1:] if n not in head_names]
        if rest:  # embedding modules sharing the table (T5's shared and embed_tokens); a head is a packed tie
            report.tied[table.names[0]] = rest
    for layer, weight_at, bias_at in layers:
        bias = served[bias_at][0] if bias_at is not None else None
        layer_packer: TorchPacker = packer
        if weight_at is not None:
            parts = dict(zip(packer.parts, served[weight_at], strict=True))
        else:
            assert embedding is not None and layer.table is not None
            layer_packer, parts = embedding, table_parts[layer.table][0]
        new = PackedLinear.from_parts(
            layer_packer, parts, bias, kernel_path=report.kernel_path, transposed=layer.transposed, name=layer.name,
            shape=layer.shape,
        )  # fmt: skip
        tie = plan.table_ties.get(layer.name)
        if tie is not None:  # it saves the table's float32 weight, as the tied float model did
            new.__dict__["_tie"] = table_parts[tie][1]
        _replace(modules, layer.name, new)
        report.converted.append(layer.name)
        kernels.add(layer.name.rpartition(".")[2], (layer_packer, report.kernel_path))
        if layer.tied:
            report.packed_ties[layer.name] = list(layer.tied)
            tied_layers[layer.tied[0]] = new
    for name in plan.ineligible:
        if type(modules[name]) is nn.Linear:
            # Its float weight, under the one sum order of the packed layers around it where the compiled product
            # runs: an unpacked head must not make a text's answer depend on its batch either.
            modules[name].__class__ = FloatLinear
            kernels.add(name.rpartition(".")[2], "not packed: FloatLinear (packcache dense, else linear)")
        else:
            kernels.add(name.rpartition(".")[2], "linear(float32), not packed")
    owners: dict[str, list[str]] = {}
    for names, needed, at in parameters:
        served_param = _served_parameter(names[0], served[at][0], needed)
        for alias in names:
            owner, _, attr = alias.rpartition(".")
            modules[owner]._parameters[attr] = served_param
            owners.setdefault(owner, []).append(attr)
            if alias in tied_layers:  # what the packed twin saves: the tie's one tensor
                tied_layers[alias].__dict__["_tie"] = served_param
        report.parameters.append(names[0])
        if len(names) > 1:
            report.tied[names[0]] = names[1:]
    for owner, attrs in owners.items():
        # Straight into the hook table (register_load_state_dict_pre_hook adds a handle and a weakref, 3 us a
        # module): this runs for every module with a parameter on every warm load. One key: converting again
        # replaces it.
        modules[owner]._load_state_dict_pre_hooks[_READ_ONLY_HOOK] = _ReadOnlyTensors(tuple(attrs))


def _served_parameter(name: str, array: np.ndarray[Any, Any], needed: nn.Parameter) -> nn.Parameter:
    """The read-only parameter over ``array``, what the cache served for the float parameter ``name``, once it is
    checked against ``needed``, the module's own (dtype and shape, from the index: no byte is read). torch's own ops
    read it by its dtype, so a file whose entry says int8 or float16, or another shape, would give wrong numbers or a
    raw error at the forward.

    Raises:
        PackResultError: the served array is not the parameter's dtype and shape, C-contiguous.
    """
    # pinned by tests/test_native.py::test_retyped_parts_of_a_cache_file_are_refused_before_a_kernel_reads_them
    stored = STORAGE_DTYPES.get(needed.dtype)  # its bytes as the cache stores them (bfloat16: uint16 bits)
    if array.dtype != stored or tuple(array.shape) != tuple(needed.shape) or not array.flags.c_contiguous:
        raise PackResultError(
            f"parameter {name!r} is {array.dtype.name} {list(array.shape)}; the module needs "
            f"{str(needed.dtype).removeprefix('torch.')} {list(needed.shape)}, C-contiguous: the cache holds a pack "
            "that does not fit this model"
        )
    return nn.Parameter(as_tensor(array, needed.dtype), requires_grad=False)


#: Requests :func:`convert` sends to :meth:`Session.get_many <packcache.Session.get_many>` at once: a few layers' parts.
_BATCH = 32


def _first_meta(source: TensorSource, names: list[str]) -> tuple[str, SourceMeta]:
    """The first of ``names`` that ``source`` holds, with its metadata (tied weights are saved under one name).

    Raises:
        KeyError: none of them (the message names them all).
    """
    if len(names) == 1:
        return names[0], source.meta(names[0])  # its own KeyError names the file
    for name in names:
        try:
            return name, source.meta(name)
        except KeyError:
            continue
    raise KeyError(f"the source has no tensor named {' or '.join(repr(n) for n in names)}")


def _replace(modules: Mapping[str, nn.Module], name: str, new: nn.Module, root: nn.Module | None = None) -> None:
    """Put ``new`` where module ``name`` is (``modules``: the root's ``named_modules()``; a container found
    only under another of its paths is looked up from ``root``)."""
    if not name:
        raise ValueError("convert() cannot replace the root module itself; wrap the nn.Linear in a container")
    owner, _, attr = name.rpartition(".")
    container = modules.get(owner)
    if container is None and root is not None:
        container = root.get_submodule(owner)
    assert container is not None, name
    setattr(container, attr, new)
