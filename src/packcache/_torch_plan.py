"""The plan of a conversion: which layers and embedding tables are packed, by which packer, and which tensors
are served as float32 parameters, with every tie among them. Made from the module's structure alone: it reads
no weight, so a module on the ``meta`` device plans (and :func:`count_packs` counts) like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .packers import Packer
from .packers_torch import LinearFloat32, TorchPacker

__all__ = ["_plan", "count_packs", "parameter_groups"]


@dataclass(frozen=True)
class _Layer:
    name: str
    shape: tuple[int, int]  # (out, in), as packed
    transposed: bool  # the module stores its weight [in, out]
    has_bias: bool
    tied: tuple[str, ...] = ()  # the other names of its weight (parameters of other modules: the tie)
    bias_tied: tuple[str, ...] = ()  # the other names of its bias (BERT's MLM decoder's, tied to cls.predictions.bias)
    table: str | None = None  # the packed embedding table (its first name) whose pack this tied head reads


@dataclass(frozen=True)
class _Table:
    """An embedding table packed by an embedding packer, with every module over its tensor."""

    packer: TorchPacker
    names: tuple[str, ...]  # every name of its tensor (a checkpoint holds it under one of them)
    shape: tuple[int, int]
    modules: tuple[tuple[tuple[str, ...], int | None], ...]  # per nn.Embedding module: its paths, its padding_idx
    heads: tuple[_Layer, ...] = ()  # linear layers over the same tensor (a tied output head): they read its pack


@dataclass
class _Plan:
    linears: list[_Layer] = field(default_factory=list)
    ineligible: dict[str, str] = field(default_factory=dict)
    parameters: list[list[str]] = field(default_factory=list)  # every name of each other parameter
    tables: list[_Table] = field(default_factory=list)
    float_embeddings: dict[str, str] = field(default_factory=dict)
    # A linear layer whose weight is a packed table's tensor -> the table's first name: it saves the table's weight.
    table_ties: dict[str, str] = field(default_factory=dict)
    # A parameter's names that a packed layer owns (a packed head's weight, tied to the embeddings): a checkpoint
    # may hold the tie's tensor under one of them only (the head's), which then serves the embeddings too.
    also: dict[str, list[str]] = field(default_factory=dict)


def _plan(
    module: nn.Module, packer: Packer, transposed: tuple[type[nn.Module], ...], embedding: TorchPacker | None = None
) -> _Plan:
    """Which layers :func:`~packcache.torch.convert` packs with ``packer``, which embedding tables with
    ``embedding`` and which parameters it serves as float32; reads no weight."""
    plan = _Plan()
    aliases = _aliases(module)
    owned: set[str] = set()
    if embedding is not None:
        _plan_tables(module, embedding, aliases, plan)
        for table in plan.tables:
            owned.update(table.names)
            owned.update(f"{head.name}.bias" for head in table.heads if head.has_bias)
    heads = {head.name: head for table in plan.tables for head in table.heads}
    for name, sub in module.named_modules():
        if name in heads:  # a head over a packed table, in its place among the layers
            plan.linears.append(heads[name])
            continue
        flip = type(sub) in transposed
        if type(sub) is not nn.Linear and not flip:
            continue
        weight = sub.weight
        dotted = f"{name}." if name else ""
        rows, columns = int(weight.shape[0]), int(weight.shape[1])
        shape = (columns, rows) if flip else (rows, columns)
        tied = tuple(n for n in aliases.get(id(weight), []) if n != f"{dotted}weight")
        if tied and isinstance(packer, LinearFloat32):
            # Packed as float32 it would be a second copy of the very tensor its twin is served as: keep one.
            plan.ineligible[name] = f"weight tied to {', '.join(tied)}: one float32 tensor"
            continue
        reason = packer.eligible(shape)
        if reason is not None:
            plan.ineligible[name] = reason
            continue
        # A tied layer (an output head tied to the input embeddings) is packed like any other, from the one source
        # tensor of the tie; the other owners (the embedding lookup) keep that tensor as float32.
        bias_tied = (
            tuple(n for n in aliases.get(id(sub.bias), []) if n != f"{dotted}bias") if sub.bias is not None else ()
        )
        plan.linears.append(_Layer(name, shape, flip, sub.bias is not None, tied, bias_tied))
        owned.update({f"{dotted}weight", f"{dotted}bias"})
    # pinned by tests/test_hf_ties.py::test_every_config_and_checkpoint_combination_builds_transformers_model
    for names in aliases.values():
        left = [n for n in names if n not in owned]
        if left:
            plan.parameters.append(left)
            if len(left) < len(names):  # a packed head's weight: the checkpoint may hold the tie under its name only
                plan.also[left[0]] = [n for n in names if n in owned]
    return plan


def _plan_tables(module: nn.Module, packer: TorchPacker, aliases: dict[int, list[str]], plan: _Plan) -> None:
    """The embedding tables :func:`~packcache.torch.convert` packs with ``packer`` (into ``plan.tables``), and why
    the others stay float32 (``plan.float_embeddings``). A linear layer over a table's tensor (a tied output head)
    reads the table's pack, whatever packer the other layers use: one stored tensor (the int4 scheme's head is the
    int8 table's: an int4 pack of its own beside the table would store the tensor twice, a file 1.35x llama.cpp's
    Q4_0)."""
    paths: dict[int, list[str]] = {}
    found: dict[int, nn.Embedding] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, nn.Embedding):
            paths.setdefault(id(sub), []).append(name)
            found[id(sub)] = sub
    by_weight: dict[int, list[int]] = {}  # a table's tensor -> the embedding modules over it
    for key, sub in found.items():
        reason = _table_reason(sub, packer)
        if reason is not None:
            plan.float_embeddings[paths[key][0]] = reason
            continue
        by_weight.setdefault(id(sub.weight), []).append(key)
    for weight, keys in by_weight.items():
        names = aliases.get(weight, [])
        if not names:
            continue
        tables = {f"{p}.weight" if p else "weight" for key in keys for p in paths[key]}
        layers: list[_Layer] = []
        others: list[str] = []
        for name in names:
            if name in tables:
                continue
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            if type(sub) is not nn.Linear or attr != "weight":
                others.append(name)
            elif packer.eligible(tuple(sub.weight.shape)) is None:
                layers.append(_head(owner, sub, names, aliases))
            else:
                others.append(name)
        if others:  # a tensor another kind of module computes with: it needs the float32 tensor itself
            for key in keys:
                plan.float_embeddings[paths[key][0]] = f"its weight is also {', '.join(others)}: one float32 tensor"
            continue
        rows, columns = found[keys[0]].weight.shape
        modules = tuple((tuple(paths[key]), found[key].padding_idx) for key in keys)
        plan.tables.append(_Table(packer, tuple(names), (int(rows), int(columns)), modules, tuple(layers)))
        plan.table_ties.update(dict.fromkeys((layer.name for layer in layers), names[0]))


def _head(name: str, sub: nn.Linear, names: list[str], aliases: dict[int, list[str]]) -> _Layer:
    """The plan of linear layer ``name`` over a packed table's tensor (``names``): it reads the table's pack."""
    rows, columns = sub.weight.shape
    bias = sub.bias
    bias_tied = tuple(n for n in aliases.get(id(bias), []) if n != f"{name}.bias") if bias is not None else ()
    tied = tuple(n for n in names if n != f"{name}.weight")
    return _Layer(name, (int(rows), int(columns)), False, bias is not None, tied, bias_tied, names[0])


def _table_reason(sub: nn.Module, packer: TorchPacker) -> str | None:
    """Why ``convert`` keeps the embedding module ``sub`` float32 (``None``: it packs it with ``packer``)."""
    if type(sub) is not nn.Embedding:
        return f"{type(sub).__name__} is a subclass of nn.Embedding (its own forward): float32"
    assert isinstance(sub, nn.Embedding)
    if sub.max_norm is not None:
        return "max_norm renormalises looked-up rows in place: float32"
    return packer.eligible(tuple(sub.weight.shape))


def parameter_groups(module: nn.Module) -> list[list[str]]:
    """Every parameter of ``module`` as the list of its names, in ``named_parameters`` order:
    more than one name is a tied parameter (one tensor that several modules own).

    >>> lm = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    >>> lm[1].weight = lm[0].weight
    >>> parameter_groups(lm)
    [['0.weight', '1.weight']]
    """
    return list(_aliases(module).values())


def _aliases(module: nn.Module) -> dict[int, list[str]]:
    """``id(parameter)`` -> every name of that parameter in ``module``."""
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return aliases


def count_packs(
    module: nn.Module,
    packer: Packer,
    *,
    transposed: tuple[type[nn.Module], ...] = (),
    embedding: TorchPacker | None = None,
) -> int:
    """How many cache entries :func:`~packcache.torch.convert` requests for ``module`` (hits, stores and heap packs
    together): a progress total. Reads no weight; ``module`` may live on the ``meta`` device.

    >>> from packcache.packers_torch import Int8WeightOnly
    >>> count_packs(nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32)), Int8WeightOnly())
    5
    """
    plan = _plan(module, packer, transposed, embedding)
    linears = sum(len(packer.parts) * (layer.table is None) + layer.has_bias for layer in plan.linears)
    return linears + sum(len(table.packer.parts) for table in plan.tables) + len(plan.parameters)
