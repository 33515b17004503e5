"""What a model argument names, and Hugging Face hub ids resolved offline, from the local hub cache: never the
network.

A model argument (``hf.from_pretrained``'s ``path``, ``minilm.load``'s ``model_path``, every command's ``--model``
and ``build``'s checkpoint) is read by one rule, :func:`model_argument`, whatever reads it:

1. **Spelled as a path** (it starts with ``/``, ``./``, ``../`` or ``~``, is ``.`` or ``..``, ends with ``/`` or
   with ``.pcache``; or it is a ``pathlib.Path``): that local path, taken as given (``~`` expanded:
   :func:`packcache._paths.expand_home`). A ``*.pcache`` path is a cache file, anything else a checkpoint. Nothing
   there is "no such model" (:class:`FileNotFoundError`).
2. **Otherwise, with a store** (``remote=``, ``--remote``): a *published name* (:mod:`packcache.fleet.names`), which
   the caller fetches and checks against the trusted keys. A local path spelled the same is **never** taken instead
   (``passed_over`` says one is there): a directory someone left in the working directory cannot stand in for the
   signed file.
3. **Otherwise, an existing relative path** (``ckpt``, ``org/m``) is that path, **if no other user could have put it
   there** (:func:`packcache._paths.replaceable`, the rule every name packcache believes goes by: each directory from
   ``/`` down to it this user's or root's, writable by no one else or sticky). One another user could have planted
   (a shared or world-writable working directory, another user's directory) is refused
   (:class:`~packcache.errors.UntrustedFileError`), naming it: spell it ``./org/m`` to load it as a path.
4. **Otherwise, a hub id**: ``ORG/NAME`` or ``NAME``, optionally ``@REVISION``, resolved by :func:`snapshot_path` to
   the snapshot directory the Hugging Face hub client left in its cache (its documented layout; none of its code
   runs). Not there is "no such model" (:class:`FileNotFoundError`), one line naming the hub cache it looked in.

The hub cache: ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub`` (an absolute ``$XDG_CACHE_HOME`` only, as the XDG specification says), else
``~/.cache/huggingface/hub`` (:func:`hub_cache_dir`, the hub client's own order; never relative to the working
directory). ``models--ORG--NAME/refs/main`` (or ``refs/REVISION`` for a branch or tag) holds the 40-hex commit,
``models--ORG--NAME/snapshots/<commit>/`` is the checkpoint; a 40-hex ``REVISION`` is that commit itself. What is
read is checked: the id and the revision are checked against the hub's grammar before any path is made from them
(no ``..``, no ``/`` past one, bounded), and a ref file must hold exactly 40 lowercase hex digits.

>>> split_hub_id("sentence-transformers/all-MiniLM-L6-v2@main")
('sentence-transformers/all-MiniLM-L6-v2', 'main')
>>> repo_folder("sentence-transformers/all-MiniLM-L6-v2")
'models--sentence-transformers--all-MiniLM-L6-v2'
>>> spelled_as_path("./org/m"), spelled_as_path("org/m"), spelled_as_path("m.pcache")
(True, False, True)
>>> model_argument("org/model-int8", remote=True).kind   # with a store: a published name, whatever lies in ./org
'name'
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from ._paths import expand_home, read_bounded, replaceable, resolve_trusted, xdg_cache_home
from .errors import FormatError, UntrustedFileError

__all__ = [
    "ModelArgument",
    "hub_cache_dir",
    "is_hub_id",
    "is_local_path",
    "model_argument",
    "repo_folder",
    "resolve_model",
    "snapshot_path",
    "spelled_as_path",
    "split_hub_id",
]

#: One segment of a hub repository id: the hub's own rule (letters, digits, ``-``, ``_``, ``.``; no leading or
#: trailing ``-``/``.``; at most 96 characters).
_SEGMENT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REF_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
MAX_REF_BYTES = 4096
logger = logging.getLogger("packcache")


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache, in the hub client's order: ``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE``,
    ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub`` (absolute only), ``~/.cache/huggingface/hub`` (``~`` and
    variables expanded, as the hub client expands them; ``~`` is :func:`packcache._paths.home_dir`).

    Raises:
        FileNotFoundError: it would be under the home directory, and there is none (no ``HOME``, no passwd entry).
    """
    return _hub_cache()[0]


def _hub_cache() -> tuple[str, str]:
    """:func:`hub_cache_dir` and what placed it there (for messages)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(variable)
        if value:
            return expand_home(os.path.expandvars(value)), f"${variable}"
    home = os.environ.get("HF_HOME")
    if home:
        return os.path.join(expand_home(os.path.expandvars(home)), "hub"), "$HF_HOME/hub"
    # pinned by tests/test_hub.py::test_the_hub_cache_is_never_relative_to_the_working_directory
    given = os.environ.get("XDG_CACHE_HOME")
    where = "$XDG_CACHE_HOME/huggingface/hub" if given and os.path.isabs(given) else "~/.cache/huggingface/hub"
    return os.path.join(xdg_cache_home(), "huggingface", "hub"), where


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
            f"no such model: {shown} is neither an existing local path nor a Hugging Face hub id (ORG/NAME[@REVISION]: "
            "letters, digits, '-', '_', '.', one '/')"
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
        FileNotFoundError: the cache has no snapshot of it (one line naming the hub cache and what was looked for).
        FormatError: a ref file that does not hold a 40-hex commit. UntrustedFileError: a ref that is not a
            regular file.
    """
    repo, revision = split_hub_id(name)
    root, origin = (os.fspath(cache_dir), "given") if cache_dir is not None else _hub_cache()
    folder = os.path.join(root, repo_folder(repo))
    if _COMMIT.fullmatch(revision):
        commit = revision
    else:
        ref = os.path.join(folder, "refs", *revision.split("/"))
        try:
            raw = read_bounded(ref, what="hub ref", max_bytes=MAX_REF_BYTES)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(_absent(name, repo, root, origin, ref)) from None
        commit = raw.decode("ascii", "replace").strip()
        if not _COMMIT.fullmatch(commit):
            raise FormatError(f"the hub ref of {name[:120]!r} holds {commit[:60]!r}, not a 40-hex commit", path=ref)
    snapshot = os.path.join(folder, "snapshots", commit)
    if not os.path.isdir(snapshot):
        raise FileNotFoundError(_absent(name, repo, root, origin, snapshot))
    return snapshot


def _absent(name: str, repo: str, root: str, origin: str, looked: str) -> str:
    # pinned by tests/test_hub.py::test_a_name_not_in_the_hub_cache_is_one_line_naming_where_it_looked
    return (
        f"no such model: {name[:120]!r} is no local path (nothing at {os.path.abspath(name)[:200]}), and the Hugging "
        f"Face hub cache {root} ({origin}) has no snapshot of it (no {looked}); nothing is downloaded: fetch it with "
        f"`hf download {repo}`, or give a directory"
    )


@dataclass(frozen=True)
class ModelArgument:
    """What a model argument names (:func:`model_argument`).

    Attributes:
        kind: ``"cache_file"`` (a ``*.pcache`` path: the file is the model), ``"path"`` (any other local path: a
            checkpoint), ``"hub"`` (a hub id, found in the local hub cache) or ``"name"`` (a published name, for
            the caller to fetch from its store).
        given: the argument as given.
        path: what to load (the local path, ``~`` expanded; a relative one taken by rule 3 spelled ``./...``; a hub
            id's snapshot directory); ``None`` for a published name.
        passed_over: for a published name, a local path spelled the same that exists and was not taken (worth a
            note); else ``None``.
    """

    kind: str
    given: str
    path: str | None = None
    passed_over: str | None = None


def spelled_as_path(text: str | os.PathLike[str]) -> bool:
    """Whether a model argument is written as a path, whatever exists: it starts with ``/``, ``./``, ``../`` or
    ``~``, is ``.`` or ``..``, or ends with ``/`` or ``.pcache`` (no hub id nor published name does)."""
    value = os.fspath(text)
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or value.endswith(("/", ".pcache"))


def model_argument(
    text: str | os.PathLike[str], *, remote: bool = False, cache_dir: str | os.PathLike[str] | None = None
) -> ModelArgument:
    """What the model argument ``text`` names, by the module's rule: a local path spelled as one; with ``remote``
    (a store is given) a published name; an existing relative path no other user could have planted; else a hub id
    in the local hub cache (``cache_dir``: that hub cache instead of :func:`hub_cache_dir`). The one rule of
    ``packcache.hf``, ``packcache.models.minilm`` and every command.

    Raises:
        FileNotFoundError: no such model: nothing at a path spelled as one, or a hub id the hub cache has no
            snapshot of (one line naming what was given and where it looked); ``~`` with no home directory.
        UntrustedFileError: a relative path another user could have put there, given without ``./``.
        ValueError: neither an existing path nor a hub id (naming the grammar).
        FormatError: a hub ref that is not a regular file holding a 40-hex commit.
    """
    value = os.fspath(text)
    if not isinstance(text, str) or spelled_as_path(value):  # a pathlib.Path is a path, however it is spelled
        path = expand_home(value)
        if not os.path.lexists(path):
            # pinned by tests/test_cli.py::test_no_such_model_is_one_line_naming_what_was_given_and_exit_2
            where = os.path.abspath(path)
            shown = "" if where == value else f" ({where[:200]})"
            raise FileNotFoundError(f"no such model: {value[:200]!r} does not exist{shown}")
        return ModelArgument("cache_file" if path.endswith(".pcache") else "path", value, path)
    if remote:
        # pinned by tests/test_hub.py::test_a_directory_nobody_plants_never_stands_in_for_a_signed_name
        if not os.path.lexists(value):
            return ModelArgument("name", value)
        logger.warning(
            "packcache: %r is a published name here (a store is given); the local path %s is not used (spell it "
            "./%s to load it)", value[:200], os.path.abspath(value)[:200], value[:200],
        )  # fmt: skip
        return ModelArgument("name", value, passed_over=value)
    if os.path.lexists(value):
        problem = _planted(value)
        if problem is not None:
            # pinned by tests/test_hub.py::test_a_bare_name_another_user_planted_is_refused_without_a_store
            raise UntrustedFileError(
                value, f"{problem}: another user could have put it there, so a bare name is not taken as that path; "
                f"spell it ./{value[:200]} to load it, or run elsewhere for the hub id", what="model path",
            )  # fmt: skip
        return ModelArgument("path", value, os.path.join(os.curdir, value))
    return ModelArgument("hub", value, snapshot_path(value, cache_dir=cache_dir))


def _planted(relative: str) -> str | None:
    """Why another user could have put (or can replace) what the relative path ``relative`` names, or ``None``."""
    try:
        return replaceable(resolve_trusted(os.path.abspath(relative), what="model path"))
    except UntrustedFileError as exc:  # a symlink on the way another user could have planted
        return exc.reason


def resolve_model(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The local path a model argument names without a store (:func:`model_argument`): a path as given (``~``
    expanded), an existing relative path no other user could have planted, or the snapshot directory of a hub id
    (:func:`snapshot_path`). What ``packcache.hf``, ``packcache.models.minilm`` and the CLI call on a model given
    without ``remote=``: a transformers user's ``from_pretrained("org/name")`` works offline here.

    Raises:
        As :func:`model_argument`.
    """
    found = model_argument(path, cache_dir=cache_dir).path
    assert found is not None  # without a store nothing is a published name
    return found


def is_local_path(text: str | os.PathLike[str], *, remote: bool = False) -> bool:
    """Whether :func:`model_argument` takes ``text`` as a local path (it says nothing of existence or trust): a
    ``pathlib.Path``, spelled as a path (:func:`spelled_as_path`), or, without a store (``remote``), any path that
    exists.

    >>> is_local_path("/models/bert"), is_local_path("~/m"), is_local_path("org/m@2")
    (True, True, False)
    """
    value = os.fspath(text)
    return not isinstance(text, str) or spelled_as_path(value) or (not remote and os.path.lexists(value))
