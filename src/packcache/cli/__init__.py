"""The ``packcache`` command: run the bundled model, build caches ahead of time, and look after cache files.

Exit codes: 0 success, 1 a check failed (or the work could not be done),
2 usage error. Every command that prints data takes ``--json``.
``packcache probe`` grades a file instead: 0 compatible, 3 compatible_suboptimal,
4 incompatible, 5 not_applicable, 6 unverified (1: it could not be read, 2: usage).
"""

from __future__ import annotations

import argparse
import errno as errno_mod
import sys
from collections.abc import Sequence

from .._paths import default_cache_dir
from ..errors import FormatError, LockTimeoutError, RemoteError, UntrustedFileError
from . import _fleet, _model, _operator, _serve
from ._common import EXIT_FAILED, EXIT_USAGE, Out, UsageError, check_cache_dir, sanitize

__all__ = ["default_cache_dir", "main", "sanitize"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packcache",
        description="Cache packed model weights in a memory-mapped file, and account for every byte.",
        epilog="Exit codes: 0 ok, 1 a check failed or the work could not be done, 2 usage error. probe: 0 "
        "compatible, 3 compatible_suboptimal, 4 incompatible, 5 not_applicable, 6 unverified.",
    )
    parser.add_argument(
        "--version", action=_Version, help="print the installed distribution's version (and where it runs from)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _model.add_parsers(sub)  # run, build
    _serve.add_parser(sub)
    _fleet.add_store_parsers(sub)  # publish, fetch
    _operator.add_parsers(sub)  # inspect, verify, compact, gc
    _fleet.add_parsers(sub)  # platform, keygen, probe
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 1 failed check, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return int(exc.code or 0)
    out = Out(sys.stdout, getattr(args, "json", False))
    # A hostile file or path ends here as one sanitised line (names in messages may hold
    # escape sequences or newlines), never as a traceback. Anything else is a bug: let it show.
    try:
        check_cache_dir(args)
        return int(args.func(args, out))
    except UsageError as exc:
        print(f"packcache {args.command}: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except RemoteError as exc:
        print(f"packcache {args.command}: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except FormatError as exc:
        what = "" if args.command in _FLEET_COMMANDS else "not a valid cache file: "
        print(f"packcache {args.command}: {what}{sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except (UntrustedFileError, LockTimeoutError, OSError) as exc:
        print(f"packcache {args.command}: {sanitize(_describe(exc))}", file=sys.stderr)
        return EXIT_FAILED


def version_text() -> str:
    """``packcache VERSION (PATH)``: the installed distribution's version (``importlib.metadata``; the source tree's
    ``packcache.__version__`` when it is not installed, said so), and the package directory that runs."""
    import importlib.metadata
    import os

    from .. import __file__ as package_file
    from .. import __version__

    where = os.path.dirname(os.path.abspath(package_file))
    try:
        return f"packcache {importlib.metadata.version('packcache')} ({where})"
    except importlib.metadata.PackageNotFoundError:
        return f"packcache {__version__} (not installed: the source tree {where})"


class _Version(argparse.Action):
    """``--version``: :func:`version_text`, read only when asked (``packcache --help`` reads no metadata)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=str(kwargs.get("help", "")))

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        # pinned by tests/test_defaults_cli.py::test_version_is_the_installed_distribution_s
        print(version_text())
        parser.exit()


#: Commands whose FormatError is about a key or a manifest, not a cache file.
_FLEET_COMMANDS = ("keygen", "platform", "probe")


def _describe(exc: OSError) -> str:
    """``str(exc)``, with the errno's name in front for a bare OSError (``[Errno 2]`` says less than ENOENT)."""
    if isinstance(exc, (UntrustedFileError, LockTimeoutError)) or exc.errno is None:
        return str(exc)
    name = errno_mod.errorcode.get(exc.errno, str(exc.errno))
    where = f": {exc.filename}" if exc.filename is not None else ""
    return f"{name}: {exc.strerror}{where}"
