"""Hugging Face hub ids resolved offline, from the local hub cache: never the network.

A model argument (``hf.from_pretrained``'s ``path``, ``--model``) that is not a local path and comes without
``remote=`` is a hub id: ``ORG/NAME`` or ``NAME``, optionally ``@REVISION``. :func:`resolve_model` makes it the
snapshot directory the Hugging Face hub client left in its cache (its documented layout; none of its code runs):

- the cache: ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (:func:`hub_cache_dir`, the hub
  client's own order);
- ``models--ORG--NAME/refs/main`` (or ``refs/REVISION`` for a branch or tag) holds the 40-hex commit,
  ``models--ORG--NAME/snapshots/<commit>/`` is the checkpoint; a 40-hex ``REVISION`` is that commit itself.

What is read is checked: the id and the revision are checked against the hub's grammar before any path is made
from them (no ``..``, no ``/`` past one, bounded), and a ref file must hold exactly 40 lowercase hex digits. A
name that is not there is one :class:`FileNotFoundError` line naming where it looked. A name given *with*
``remote=`` is a published name instead (:mod:`packcache.fleet.names`), never looked up here.

>>> split_hub_id("sentence-transformers/all-MiniLM-L6-v2@main")
('sentence-transformers/all-MiniLM-L6-v2', 'main')
>>> repo_folder("sentence-transformers/all-MiniLM-L6-v2")
'models--sentence-transformers--all-MiniLM-L6-v2'
>>> resolve_model("./ckpt") == "./ckpt"      # a local path is returned as given
True
"""

from __future__ import annotations

import os
import re

from ._paths import read_bounded
from .errors import FormatError

__all__ = [
    "hub_cache_dir",
    "is_hub_id",
    "is_local_path",
    "repo_folder",
    "resolve_model",
    "snapshot_path",
    "split_hub_id",
]

#: One segment of a hub repository id: the hub's own rule (letters, digits, ``-``, ``_``, ``.``; no leading or
#: trailing ``-``/``.``; at most 96 characters).
_SEGMENT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REF_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
MAX_REF_BYTES = 4096


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache, in the hub client's order: ``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE``,
    ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub`` (``~`` and variables
    expanded, as the hub client expands them)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(variable)
        if value:
            return os.path.expanduser(os.path.expandvars(value))
    home = os.environ.get("HF_HOME")
    if not home:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(base, "huggingface")
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def split_hub_id(text: str) -> tuple[str, str]:
    """``(repo id, revision)`` of ``ORG/NAME[@REVISION]`` (revision ``main`` when none is given), both checked.

    Raises:
        ValueError: not a hub id (naming the text and what is wrong).
    """
    repo, at, revision = text.partition("@")
    shown = repr(text[:120])
    parts = repo.split("/")
    if len(parts) > 2 or not all(_SEGMENT.fullmatch(p) for p in parts) or any("--" in p or ".." in p for p in parts):
        raise ValueError(
            f"{shown} is neither a local path nor a Hugging Face hub id (ORG/NAME[@REVISION]: letters, digits, "
            "'-', '_', '.', one '/')"
        )
    if not at:
        return repo, "main"
    if not _COMMIT.fullmatch(revision):
        segments = revision.split("/")
        if len(revision) > 255 or not all(_REF_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments):
            raise ValueError(f"{shown}: revision {revision[:60]!r} is neither a 40-hex commit nor a branch or tag name")
    return repo, revision


def is_hub_id(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is shaped like a hub id (:func:`split_hub_id` accepts it); says nothing of the cache."""
    try:
        split_hub_id(os.fspath(text))
    except ValueError:
        return False
    return True


def repo_folder(repo: str) -> str:
    """The hub cache's folder of a model repository: ``models--ORG--NAME``."""
    return "models--" + repo.replace("/", "--")


def snapshot_path(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The snapshot directory of hub id ``name`` (``ORG/NAME[@REVISION]``) in the local hub cache (``cache_dir``,
    default :func:`hub_cache_dir`). Reads one ref file at most; never the network.

    Raises:
        ValueError: ``name`` is not a hub id.
        FileNotFoundError: the cache has no snapshot of it (one line naming the file or directory looked for).
        FormatError: a ref file that does not hold a 40-hex commit. UntrustedFileError: a ref that is not a
            regular file.
    """
    repo, revision = split_hub_id(name)
    root = os.fspath(cache_dir) if cache_dir is not None else hub_cache_dir()
    folder = os.path.join(root, repo_folder(repo))
    if _COMMIT.fullmatch(revision):
        commit = revision
    else:
        ref = os.path.join(folder, "refs", *revision.split("/"))
        try:
            raw = read_bounded(ref, what="hub ref", max_bytes=MAX_REF_BYTES)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(_absent(name, ref)) from None
        commit = raw.decode("ascii", "replace").strip()
        if not _COMMIT.fullmatch(commit):
            raise FormatError(f"the hub ref of {name[:120]!r} holds {commit[:60]!r}, not a 40-hex commit", path=ref)
    snapshot = os.path.join(folder, "snapshots", commit)
    if not os.path.isdir(snapshot):
        raise FileNotFoundError(_absent(name, snapshot))
    return snapshot


def _absent(name: str, looked: str) -> str:
    return (
        f"{name[:120]!r} is not a local path, and the Hugging Face hub cache has no snapshot of it: no {looked} "
        "(the hub cache is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; nothing is downloaded: "
        "fetch it with `hf download`, or give a directory)"
    )


def resolve_model(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The local path of a model argument: ``path`` itself when it is a local path
    (:func:`is_local_path`), else the snapshot directory of the hub id it is
    (:func:`snapshot_path`). What ``packcache.hf``, the CLI's ``--model`` and ``serve --model`` call on a model
    given without ``remote=``: a transformers user's ``from_pretrained("org/name")`` works offline here.

    Raises:
        ValueError: neither a local path nor a hub id.
        FileNotFoundError: a hub id the local hub cache has no snapshot of (one line naming where it looked).
        FormatError, UntrustedFileError: a ref file that is not a regular file holding a 40-hex commit.
    """
    value = os.fspath(path)
    if is_local_path(value):
        return value
    return snapshot_path(value, cache_dir=cache_dir)


def is_local_path(text: str | os.PathLike[str]) -> bool:
    """Whether a model argument is a local path rather than a name (a hub id, or with ``remote=`` a published
    name): an existing path, or one starting with ``/``, ``./``, ``../`` or ``~``, or ending in ``.pcache``.

    >>> is_local_path("/models/bert"), is_local_path("~/m"), is_local_path("org/m@2")
    (True, True, False)
    """
    value = os.fspath(text)
    return (
        value.startswith(("/", "./", "../", "~"))
        or value in (".", "..")
        or value.endswith(".pcache")
        or os.path.lexists(value)
    )
