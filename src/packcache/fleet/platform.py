"""Platform classes: which machines can map one cache file as it is (docs/FLEET.md).

A cache file's header holds its *platform fingerprint*: the canonical JSON of the
``platform=`` mapping the :class:`~packcache.WeightCache` that built it was given
(:func:`packcache.format.canonical_key`). For the bundled loaders that mapping is
:func:`packcache.packers.platform_for` of the scheme's packers: each packer's id,
version, params and behavioural fingerprint (the sha256 of packing a fixed input),
the torch version, torch's CPU capability and the version of the mapping itself.
Nothing in it names a path, a host, a user, a process, a rank or an environment
variable (``tests/test_fleet_platform.py`` runs real processes to show it), so two
machines that would pack alike get the same bytes, and the same class.

The *platform class* is a short id of those bytes and the format version: a
WeightCache maps a file's packs exactly when the file's fingerprint equals its own,
so one class is one set of interchangeable files. A store keeps one manifest per
(model, class).

>>> from packcache import format as fmt
>>> fp = fmt.canonical_key({"packers": [{"id": "np.f32", "version": 1}], "torch": "2.13.0+cpu"})
>>> cls = platform_class(fp)
>>> cls.startswith("pc1-") and len(cls) == 36
True
>>> platform_fields(fp)["format_version"]
2
>>> [(d.field, d.file, d.here) for d in differences(fp, fmt.canonical_key({"torch": "2.14.0+cpu"}))]
[('packers', [{'id': 'np.f32', 'version': 1}], None), ('torch', '2.13.0+cpu', '2.14.0+cpu')]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import _boundedjson as boundedjson
from .. import format as fmt
from ..errors import FormatError

__all__ = ["CLASS_PREFIX", "Difference", "differences", "platform_class", "platform_fields"]

#: Every class id starts with this: the version of the rule that derives it.
CLASS_PREFIX = "pc1-"
_DOMAIN = b"packcache platform class\0"


def platform_class(platform: bytes, *, format_version: int = fmt.FORMAT_VERSION) -> str:
    """The class id of a platform fingerprint: ``"pc1-"`` and 32 hex digits of a sha256 over a
    domain tag, the format version and the fingerprint bytes.

    ``platform`` is the canonical bytes (``WeightCache.platform``, ``format.canonical_key(mapping)``,
    ``format.decode_header(...).platform``): equal bytes, equal class; any other byte, another class.

    >>> platform_class(b"{}") == platform_class(b"{}") != platform_class(b'{"a":1}')
    True
    """
    if not isinstance(platform, bytes):
        raise TypeError(f"platform must be the fingerprint's bytes, not {type(platform).__name__}")
    digest = hashlib.sha256(_DOMAIN + str(int(format_version)).encode("ascii") + b"\0" + platform).hexdigest()
    return CLASS_PREFIX + digest[:32]


def platform_fields(platform: bytes, *, format_version: int = fmt.FORMAT_VERSION) -> dict[str, Any]:
    """The fingerprint's mapping, parsed with bounds, plus ``format_version``.

    A mapping that has a ``format_version`` key of its own keeps it; the file's format version
    then shows as ``packcache.format_version``.

    Raises:
        FormatError: the bytes are not bounded JSON (too deep, huge integers, not UTF-8, a
            duplicate key), or not a JSON object (``canonical_key`` only makes objects).
    """
    value = boundedjson.loads(platform, what="platform fingerprint", unique_keys=True) if platform else {}
    if not isinstance(value, dict):
        raise FormatError(f"the platform fingerprint is a JSON {type(value).__name__}, not an object")
    key = "format_version" if "format_version" not in value else "packcache.format_version"
    return {**value, key: int(format_version)}


@dataclass(frozen=True)
class Difference:
    """One field on which two fingerprints differ: its dotted name, the file's value and this machine's
    (``None`` where the field is absent on that side)."""

    field: str
    file: Any
    here: Any

    def __str__(self) -> str:
        return f"{self.field}: {_show(self.file)} -> {_show(self.here)}"

    def to_dict(self) -> dict[str, Any]:
        """``{"field", "file", "here"}``, JSON-serialisable."""
        return {"field": self.field, "file": self.file, "here": self.here}


def differences(
    file_platform: bytes,
    here_platform: bytes,
    *,
    file_format_version: int = fmt.FORMAT_VERSION,
    here_format_version: int = fmt.FORMAT_VERSION,
) -> list[Difference]:
    """Every field on which a file's fingerprint differs from this machine's, old value first.

    Nested mappings are compared key by key (``a.b``); the ``packers`` list is compared packer by
    packer, by id (``packers[torch.int4wo].fingerprint``), a packer present on one side only being
    one difference. When the bytes differ but no field does (other key order, a duplicate), the
    raw fingerprint is the difference, so two different classes always name at least one field.

    Raises:
        FormatError: either fingerprint is not a bounded JSON object.
    """
    old = platform_fields(file_platform, format_version=file_format_version)
    new = platform_fields(here_platform, format_version=here_format_version)
    found: list[Difference] = []
    _compare("", old, new, found)
    if not found and (file_platform, file_format_version) != (here_platform, here_format_version):
        found.append(Difference("platform", file_platform.decode("ascii", "replace"), here_platform.decode("ascii")))
    return found


def _compare(prefix: str, old: Any, new: Any, found: list[Difference]) -> None:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(old) | set(new)):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                found.append(Difference(name, old.get(key), new.get(key)))
            elif name == "packers":
                _compare_packers(old[key], new[key], found)
            else:
                _compare(name, old[key], new[key], found)
    elif _canonical(old) != _canonical(new):
        found.append(Difference(prefix, old, new))


def _compare_packers(old: Any, new: Any, found: list[Difference]) -> None:
    by_id_old, by_id_new = _by_id(old), _by_id(new)
    if by_id_old is None or by_id_new is None:  # not lists of packers with distinct ids: compare them whole
        if _canonical(old) != _canonical(new):
            found.append(Difference("packers", old, new))
        return
    for packer in sorted(set(by_id_old) | set(by_id_new)):
        name = f"packers[{packer}]"
        if packer not in by_id_old or packer not in by_id_new:
            found.append(Difference(name, by_id_old.get(packer), by_id_new.get(packer)))
        else:
            _compare(name, by_id_old[packer], by_id_new[packer], found)


def _by_id(packers: Any) -> dict[str, Any] | None:
    if not isinstance(packers, list):
        return None
    ids = [p.get("id") if isinstance(p, dict) else None for p in packers]
    if not all(isinstance(i, str) for i in ids) or len(set(ids)) != len(ids):
        return None
    return dict(zip(ids, packers, strict=True))  # type: ignore[arg-type]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _show(value: Any) -> str:
    """A value as a difference line shows it: strings bare, 64-hex digests shortened, absent as ``(absent)``."""
    if value is None:
        return "(absent)"
    if isinstance(value, str):
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
            return value[:12] + ".."
        return value
    text = _canonical(value)
    return text if len(text) <= 200 else text[:197] + "..."
