"""What every ``packcache`` command shares: exit codes, output (text or ``--json``), safe names, argument types."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

__all__ = [
    "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "Out", "UsageError", "add_trust_options", "check_cache_dir",
    "chosen_group_size", "chosen_scheme", "mib", "builder_text", "days", "local_model", "model_argument", "positive",
    "sanitize", "seconds", "store_url",
]  # fmt: skip


#: Exit codes: success, a check failed (or the work could not be done), a usage error (an argument that names no
#: model among them: no such path, a hub id the local hub cache lacks, a path another user could have planted).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MIB = float(1 << 20)


def sanitize(text: str) -> str:
    r"""Make a name from a (possibly hostile) file safe to print on a terminal.

    Control characters (escape sequences included) and other non-printables
    become ``\xNN``/``\uNNNN`` escapes.

    >>> sanitize("layer\x1b[2Jweight")
    'layer\\x1b[2Jweight'
    """
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class Out:
    """Where a command's report goes: ``emit(data, text)`` prints the JSON object with ``--json``, else the text."""

    def __init__(self, stream: TextIO, as_json: bool) -> None:
        self.stream, self.as_json = stream, as_json

    def emit(self, data: dict[str, Any], text: str) -> None:
        self.stream.write(json.dumps(data, indent=2, sort_keys=True) + "\n" if self.as_json else text + "\n")


def mib(n: int) -> str:
    """Bytes as the reports show them: ``12.3 MiB``."""
    return f"{n / MIB:.1f} MiB"


class UsageError(Exception):
    """A usage error found after the arguments were parsed (an environment variable): one line, exit 2."""


def chosen_scheme(args: argparse.Namespace) -> str:
    """``--scheme``, with ``auto`` (the default) resolved for this CPU as every loader resolves it:
    int8 where torch has its vectorised int8/int4 kernels, else fp32 (:func:`packcache.loader.resolve_scheme`);
    for a ``--model`` cache file, the scheme it holds.

    Raises:
        FormatError, UntrustedFileError, OSError: a ``--model`` cache file that cannot be read (as
            :func:`packcache.bundle.open_bundle`).
    """
    from ..bundle import is_cache_file, open_bundle
    from ..loader import resolve_scheme  # imports torch: only for a command that loads a model

    model = getattr(args, "model", None)
    if args.scheme == "auto" and model is not None and is_cache_file(model):
        with open_bundle(model) as bundle:  # a cache file holds one scheme: auto means that one
            return bundle.record.scheme
    return resolve_scheme(args.scheme)


def chosen_group_size(args: argparse.Namespace) -> int | None:
    """``--group-size`` of ``run`` and ``serve``: as given, else ``None`` for a ``--model`` cache file (the file's
    own), else :data:`packcache._defaults.GROUP_SIZE`."""
    from .._defaults import GROUP_SIZE

    given: int | None = getattr(args, "group_size", None)
    if given is not None:
        return given
    model = getattr(args, "model", None)
    if model is not None and model.endswith(".pcache"):  # packcache.bundle.is_cache_file, without its imports
        return None
    return GROUP_SIZE


def model_argument(model: str, option: str, *, remote: bool = False, hint: str = "") -> Any:
    """What a model argument names, by the library's one rule (:func:`packcache.hub.model_argument`: a path spelled
    as one; with a store (``remote``) a published name; an existing relative path no other user could have planted;
    a hub id in the local Hugging Face hub cache, offline). Returns its :class:`~packcache.hub.ModelArgument`.

    Raises:
        UsageError: no such model (nothing at the path; a hub id the hub cache does not hold, naming where it
            looked), a relative path another user could have planted, a malformed name: one line, then ``hint``
            (``--remote URL`` for a published name, where the command fetches one). Exit 2, whichever it is.
    """
    from ..errors import FormatError, UntrustedFileError
    from ..hub import model_argument as what_it_names

    # pinned by tests/test_cli.py::test_no_such_model_is_one_line_naming_what_was_given_and_exit_2
    try:
        return what_it_names(model, remote=remote)
    except (ValueError, FormatError, UntrustedFileError, OSError) as exc:
        raise UsageError(f"{option}: {sanitize(str(exc))}{hint}") from None


def local_model(model: str, option: str, *, hint: str = "") -> str:
    """A model argument given without a store as a local path (:func:`model_argument`): itself when spelled as a
    path, an existing relative path no other user could have planted (as ``./PATH``), else the snapshot of the hub
    id it is in the local Hugging Face hub cache (offline, never the network).

    Raises:
        UsageError: as :func:`model_argument`.
    """
    # pinned by tests/test_hub.py::test_the_cli_takes_a_hub_id_and_says_in_one_line_where_it_looked
    found = model_argument(model, option, hint=hint)
    return str(found.path)


def check_cache_dir(args: argparse.Namespace) -> None:
    """At startup, before anything is imported or asked: a command that will put its cache file in the default cache
    directory (``--cache-dir`` not given, nor ``--cache FILE``, ``--no-cache`` or a ``*.pcache`` model) has one
    (:func:`packcache._paths.default_cache_dir`: never a path relative to the working directory).

    Raises:
        UsageError: there is none (no ``$PACKCACHE_DIR``, no absolute ``$XDG_CACHE_HOME``, no home directory).
    """
    if not hasattr(args, "cache_dir") or args.cache_dir is not None:
        return
    if getattr(args, "no_cache", False) or getattr(args, "cache", None) is not None:
        return
    given = getattr(args, "model", None) or getattr(args, "checkpoint", None)
    if isinstance(given, str) and given.endswith(".pcache"):  # a cache file is its own cache
        return
    from .._paths import default_cache_dir

    # pinned by tests/test_paths.py::test_no_home_and_no_passwd_entry_is_refused_never_a_path_under_the_cwd
    try:
        default_cache_dir()
    except FileNotFoundError as exc:
        raise UsageError(f"no default cache directory: {exc}; or give --cache-dir DIR") from None


def positive(text: str) -> int:
    """An argument type: a count of at least 1 (workers, threads, limits)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def seconds(text: str) -> float:
    """An argument type: seconds over 0 and at most an hour (a deadline that can neither be missed nor hang)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
    if not 0 < value <= 3600:  # NaN and inf fail this too
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give seconds over 0 and at most 3600")
    return value


def store_url(text: str) -> Any:
    """An argument type: a store URL (``s3://bucket/prefix``, ``file:///dir``, a directory), parsed once
    (:func:`packcache._storeurl.parse_store_url`); a bad one is a usage error naming it redacted."""
    from .._storeurl import parse_store_url

    # pinned by tests/test_cli_fleet_input.py::test_bad_input_is_one_line_exit_2_nothing_uploaded
    try:
        return parse_store_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def builder_text(text: str) -> str:
    """An argument type: a manifest's free-text builder, at most 256 printable characters."""
    from ..fleet.manifest import MAX_BUILDER_CHARS

    if len(text) > MAX_BUILDER_CHARS or not text.isprintable():
        raise argparse.ArgumentTypeError(f"give at most {MAX_BUILDER_CHARS} printable characters")
    return text


def days(text: str) -> float:
    """An argument type: days until a manifest expires, 0 for never, else over 0 and at most ten years."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of days") from None
    if not (value == 0 or 0 < value <= 3660):  # NaN and inf fail this too
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give days over 0 and at most 3660, or 0 for never")
    return value


def add_trust_options(parser: argparse.ArgumentParser, *, unsigned: bool = True) -> None:
    """``--trusted-key`` (repeatable) and, unless ``unsigned`` is false, ``--allow-unsigned``: whose manifests count."""
    parser.add_argument(
        "--trusted-key", action="append", default=[], metavar="PUB.pem",
        help="an ed25519 public key (the .pub.pem 'packcache keygen' writes) whose signature on a manifest is "
        "trusted (repeatable: key rotation); the file must be this user's or root's and writable by no one else",
    )  # fmt: skip
    if unsigned:
        parser.add_argument(
            "--allow-unsigned", action="store_true", help="accept manifests nobody signed (a store you trust as it is)"
        )
