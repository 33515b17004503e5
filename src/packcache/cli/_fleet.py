"""``packcache platform``, ``keygen``, ``probe``, ``publish`` and ``fetch``: cache files across a fleet
(docs/FLEET.md): platform classes, signing keys, graded verdicts, and a store of published files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
from typing import Any

from .._defaults import (
    FETCH_DEADLINE,
    FETCH_LOADER,
    GROUP_SIZE,
    GROUP_SIZES,
    MANIFEST_EXPIRY,
    PROBE_TIMEOUT,
    PUBLISH_TIMEOUT,
    REMOTE_TIMEOUT,
    SCHEME,
)
from ..errors import FormatError, RemoteError
from ..packers import SCHEMES
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    Out,
    UsageError,
    add_trust_options,
    builder_text,
    chosen_scheme,
    days,
    local_model,
    mib,
    sanitize,
    seconds,
    store_url,
)
from ._model import LOADERS, default_loader

__all__ = ["add_parsers", "add_store_parsers"]


def _models_needed(command: str) -> Any:
    """``packcache.models.minilm``, or None after one line naming the models extra (it imports torch)."""
    try:
        return importlib.import_module("packcache.models.minilm")
    except ImportError as exc:
        print(f"packcache {command} needs the models extra ({exc}): pip install 'packcache[models]'", file=sys.stderr)
        return None


def _platform_bytes(minilm: Any, scheme: str, group_size: int) -> bytes:
    from ..format import canonical_key

    return canonical_key(minilm.platform(scheme, group_size))


def _field_lines(prefix: str, value: Any) -> list[str]:
    """``field: value`` lines of a platform mapping, nested names dotted and packers named by id."""
    if isinstance(value, dict) and value:
        return [
            line for key in sorted(value) for line in _field_lines(f"{prefix}.{key}" if prefix else key, value[key])
        ]
    if prefix == "packers" and isinstance(value, list) and all(isinstance(p, dict) and "id" in p for p in value):
        return [
            line
            for p in sorted(value, key=lambda p: str(p["id"]))
            for line in _field_lines(f"packers[{p['id']}]", {k: v for k, v in p.items() if k != "id"})
        ]
    return [f"{prefix}: {value if isinstance(value, str) else json.dumps(value, sort_keys=True)}"]


def cmd_platform(args: argparse.Namespace, out: Out) -> int:
    """``packcache platform``: this machine's platform class for a scheme, and the fields behind it; exit 0."""
    from ..fleet.platform import platform_class, platform_fields

    minilm = _models_needed("platform")
    if minilm is None:
        return EXIT_FAILED
    platform = _platform_bytes(minilm, chosen_scheme(args), args.group_size)
    fields = platform_fields(platform)
    identity = platform_class(platform)
    out.emit({"class": identity, "fields": fields}, "\n".join([identity, *map(sanitize, _field_lines("", fields))]))
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace, out: Out) -> int:
    """``packcache keygen KEY.pem``: a new ed25519 key pair, KEY.pem (0600) and KEY.pub.pem (0644); exit 0."""
    from ..fleet.keys import generate_key, public_path_for

    public = public_path_for(args.key)
    try:
        identity = generate_key(args.key, public)
    except ImportError as exc:
        print(f"packcache keygen: {exc}", file=sys.stderr)
        return EXIT_FAILED
    data = {"key_id": identity, "private_key": args.key, "public_key": public}
    text = (
        f"key id        {identity}\n"
        f"private key   {sanitize(args.key)} (mode 0600: keep it with the builder, e.g. a CI secret)\n"
        f"public key    {sanitize(public)} (give it to every machine: --trusted-key {sanitize(public)})"
    )
    out.emit(data, text)
    return EXIT_OK


def _scheme_of(file_platform: bytes) -> tuple[str, int] | None:
    """The scheme (and int4 group size) whose packers are the ones a fingerprint lists, or None."""
    from ..fleet.platform import platform_fields
    from ..loader import resolve

    try:
        packers = platform_fields(file_platform).get("packers")
    except FormatError:
        return None
    if not isinstance(packers, list) or not all(isinstance(p, dict) for p in packers):
        return None
    ids = sorted(str(p.get("id")) for p in packers)
    groups = [p.get("params", {}).get("group_size") for p in packers if isinstance(p.get("params"), dict)]
    group_size = next((g for g in groups if isinstance(g, int) and not isinstance(g, bool)), GROUP_SIZE)
    for scheme in SCHEMES:
        try:
            recipe = resolve(scheme, group_size)
        except ValueError:
            continue
        if ids == sorted({packer.id for packer in recipe.packers}):
            return scheme, group_size
    return None


def cmd_probe(args: argparse.Namespace, out: Out) -> int:
    """``packcache probe FILE``: a graded verdict from the header and index; exit by verdict (module docstring)."""
    from ..fleet.probe import probe_file

    minilm = _models_needed("probe")
    if minilm is None:
        return EXIT_FAILED
    compared: list[str] = []

    def expected(file_platform: bytes) -> bytes:
        # This machine's fingerprint for the file's own scheme (read from its packers), or for --scheme.
        found = _scheme_of(file_platform)
        if args.scheme is not None:
            scheme = chosen_scheme(args)
            group_size = args.group_size or (found[1] if found and found[0] == scheme else GROUP_SIZE)
            compared.append(f"compared with scheme {scheme}" + (f", group size {group_size}" * (scheme == "int4")))
        elif found is not None:
            scheme, group_size = found[0], args.group_size or found[1]
            compared.append(
                f"the file's packers are scheme {scheme}'s" + (f" (group size {group_size})" * (scheme == "int4"))
            )
        else:
            scheme, group_size = chosen_scheme(argparse.Namespace(scheme=SCHEME)), args.group_size or GROUP_SIZE
            compared.append(
                f"the file's packers are those of no scheme of this packcache; compared with scheme {scheme}, "
                "this machine's default"
            )
        return _platform_bytes(minilm, scheme, group_size)

    if _URL.match(args.file) or _in_directory_store(args.file):
        from ..fleet.stores import parse_store_url

        try:  # checked before any store call; only the redacted form is shown
            # pinned by tests/test_cli_fleet_input.py::test_bad_input_is_one_line_exit_2_nothing_uploaded
            location = parse_store_url(args.file)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        shown = location.display
        report = _probe_url(args, location, expected)
    else:
        # A directory named like a cache file is a cache problem (a bind mount of a missing host file): probed, it
        # is not_applicable, as the cache counts it. Any other directory was given as a store.
        if os.path.isdir(args.file) and not args.file.endswith(".pcache"):
            # pinned by tests/test_defaults_cli.py::test_probe_reads_a_plain_path_as_publish_and_fetch_do
            raise UsageError(
                f"{args.file} is a directory: give a cache file, or an object of a store (a plain path is a "
                "directory store, as publish and fetch read it): STORE/manifests/<model>/<class>.json or "
                "STORE/blobs/sha256/<hex>.pcache"
            )
        shown = args.file
        report = probe_file(args.file, expected_platform=expected, expected_model=args.expected_model)
    if compared:
        report = dataclasses.replace(report, reasons=[*report.reasons, *compared])
    lines = [
        f"verdict       {report.verdict.value}",
        f"file          {sanitize(shown)}",
        f"class         file {report.platform_class or '-'}, here {report.platform_class_here or '-'}",
        *([_manifest_line(report)] if report.manifest_generation is not None else []),
        f"generation    {report.generation}"
        + (" (the file's own commit)" if report.manifest_generation is not None else "")
        + f": {report.entries} packs"
        + (
            " (as its commit slot says; index not read)"
            if report.verdict.value == "incompatible"
            else f", {report.live_bytes} live bytes, {report.superseded_bytes} superseded"
        ),
        # a verdict on the header and index says nothing of the packs' bytes: say so, and what checks them
        f"read          {report.bytes_read} bytes (header and index; no pack's checksum: `packcache verify` checks "
        "them)",
        *(f"reason        {sanitize(r)}" for r in report.reasons),
    ]
    out.emit(report.to_dict(), "\n".join(lines))
    code: int = report.exit_code
    return code


def _manifest_line(report: Any) -> str:
    signed = f"signed by {report.signer}" if report.signer else "signed by no trusted key"
    return f"manifest      generation {report.manifest_generation}, {signed}"


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _in_directory_store(path: str) -> bool:
    """Whether ``probe``'s plain path names an object of a directory store (a manifest, ``.json``, or anything under
    a ``manifests/`` or ``blobs/`` folder): read there, as ``publish`` and ``fetch`` read a plain path, with the
    store's checks (a manifest's signature, its blob's size and class); any other path is a local cache file."""
    parts = os.path.abspath(path).split(os.sep)[:-1]
    return path.endswith(".json") or "manifests" in parts or "blobs" in parts


def _probe_url(args: argparse.Namespace, location: Any, expected: Any) -> Any:
    """``probe URL``: :func:`packcache.fleet.probe.probe_url` with the trusted keys given (``location``: the
    URL parsed once; only its redacted form is shown).

    Raises:
        RemoteError: the store failed (exit 1 with the reason).
    """
    from ..fleet.fetch import load_trusted_keys
    from ..fleet.probe import probe_url

    try:
        return probe_url(location, expected_platform=expected, trusted_keys=load_trusted_keys(args.trusted_key),
                         expected_model=args.expected_model, timeout=args.timeout)  # fmt: skip
    except ValueError as exc:  # the URL's key is none a store can hold
        where = (
            ""
            if _URL.match(location.display)  # the redacted form keeps the scheme
            else " (a plain path is read in its directory store, as publish and fetch read one)"
        )
        raise UsageError(f"{exc}{where}") from None


def cmd_publish(args: argparse.Namespace, out: Out) -> int:
    from ..fleet.manifest import check_published_name
    from ..fleet.publish import check_publish_target, publish

    try:  # the URL and --expires-days were checked by their argument types; the file's name (or --name) here
        # pinned by tests/test_fleet_names.py::test_cli_publish_and_fetch_refuse_a_bad_name_with_exit_2
        check_publish_target(args.file) if args.name is None else check_published_name(args.name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sources = [local_model(model, "--model") for model in args.model]
    try:
        report = publish(
            args.file, args.url, private_key=args.sign or None, sources=sources, builder=args.builder,
            expires_in=None if args.expires_days == 0 else args.expires_days * 86400.0, timeout=args.timeout,
            name=args.name,
        )  # fmt: skip
    except ImportError as exc:
        print(f"packcache publish needs the fleet extra ({exc}): pip install 'packcache[fleet]'", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:  # a source that does not hold the bytes its name claims, a bad key
        print(f"packcache publish: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    data = report.to_json()
    lines = [
        f"published     {sanitize(args.file)} -> {sanitize(report.url)}",
        f"model         {report.model}   class {report.platform_class}",
        f"blob          {report.blob_key} ({mib(report.size)}, {_blob_state(report)})",
        f"manifest      {report.manifest_key}, generation {report.generation}, "
        + (f"signed by {', '.join(report.signers)}" if report.signers else "UNSIGNED (machines need --allow-unsigned)"),
        *([f"pinned        {report.generation_key} (fetch --name {report.model}@{report.generation})"]
          if report.generation_key else []),
        f"sources       {report.sources_checked} hashed again and found as the packs name them",
    ]  # fmt: skip
    out.emit(data, "\n".join(lines))
    return EXIT_OK


def _blob_state(report: Any) -> str:
    if report.uploaded:
        return "uploaded"
    return "replaced: the object there held other bytes" if report.repaired else "already there, its bytes hashed"


def cmd_fetch(args: argparse.Namespace, out: Out) -> int:
    from ..fleet.fetch import check_fetch_target, fetch, load_trusted_keys
    from ..format import canonical_key

    if args.name is not None:
        return _fetch_name(args, out)
    if args.cache is None and args.model is None:
        raise UsageError("give the checkpoint (--model DIR, whose cache file is named by its content) or --cache FILE")
    if args.cache is not None:
        try:  # before anything is loaded or asked: the name must be a model's, as publish names it
            # pinned by tests/test_cli_fleet_input.py::test_bad_input_is_one_line_exit_2_nothing_uploaded
            check_fetch_target(args.cache)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.model is not None:
        args.model = local_model(args.model, "--model")
        if args.auto_class is None:  # build's: the one rule names the file a build with default flags published
            from ..server.modelfiles import default_auto_class

            args.auto_class = default_auto_class(args.model)
    scheme = chosen_scheme(args)
    # --loader auto: the loader of build's rule (default_loader) first, then, when nothing is published under its
    # file's name, the other (a file built with an explicit --loader).
    # pinned by tests/test_fleet.py::
    #   test_fetch_without_loader_picks_the_loader_that_reads_the_checkpoint_of_an_hf_built_file
    targets: list[tuple[str, str, bytes]] = []
    refused: list[str] = []
    order = [args.loader]
    if args.loader == "auto":
        ruled, ruled_why = default_loader(args.model, args.auto_class) if args.model else ("minilm", "")
        order = [ruled, "hf" if ruled == "minilm" else "minilm"]
        if ruled == "hf" and ruled_why:
            refused.append(ruled_why)
    for loader in order:
        try:
            if loader == "hf":
                module: Any = importlib.import_module("packcache.hf")
            else:
                module = importlib.import_module("packcache.models.minilm")
            platform = canonical_key(module.platform(scheme, args.group_size))
            if args.cache is not None:
                path = args.cache
            elif loader == "hf":
                path = str(
                    module.default_cache_path(args.model, scheme, group_size=args.group_size, cache_dir=args.cache_dir,
                                              auto_class=args.auto_class)
                )  # fmt: skip
            else:
                path = str(module.default_cache_path(scheme, model_path=args.model, group_size=args.group_size,
                                                     cache_dir=args.cache_dir))  # fmt: skip
        except ImportError as exc:
            refused.append(f"the {loader} loader needs its extra ({exc})")
            continue
        except (ValueError, FormatError, OSError) as exc:
            refused.append(f"the {loader} loader cannot read the checkpoint: {sanitize(str(exc))}")
            continue
        if all((path, platform) != (p, f) for _, p, f in targets):
            targets.append((loader, path, platform))
    if not targets:
        hint = " (a checkpoint of another architecture than BERT: --loader hf, as build makes it)" * (
            args.loader == "minilm"
        )
        print(f"packcache fetch: {'; '.join(refused)}{hint}", file=sys.stderr)
        return EXIT_FAILED
    trusted = load_trusted_keys(args.trusted_key)
    absent: list[str] = []
    for number, (loader, path, platform) in enumerate(targets):
        try:
            report = fetch(args.url, path, platform=platform, trusted_keys=trusted,
                           allow_unsigned=args.allow_unsigned, timeout=args.timeout,
                           total_timeout=args.deadline)  # fmt: skip
        except RemoteError as exc:
            if exc.reason != "remote_absent" or (not absent and number == len(targets) - 1):
                raise
            absent.append(f"the {loader} loader's file: {exc}")
            if number == len(targets) - 1:
                raise RemoteError("remote_absent", "nothing published for " + "; nor for ".join(absent)) from None
            continue
        break
    speed = f" (download {report.download_mbps:.0f} MB/s, {report.download_seconds:.2f} s)" if report.downloaded else ""
    why = "as --loader says" if args.loader != "auto" else "; ".join([*refused, *absent]) or "it reads the checkpoint"
    lines = [
        f"{'fetched' if report.downloaded else 'up to date'}    {sanitize(report.path)}",
        f"from          {sanitize(report.url)}: {report.model}, class {report.platform_class}, "
        f"generation {report.generation}" + (f", signed by {report.signed_by}" if report.signed_by else ", unsigned"),
        f"loader        {loader} ({why})",
        f"read          {mib(report.bytes)} in {report.seconds:.2f} s{speed}",
    ]
    out.emit({**report.to_json(), "loader": loader}, "\n".join(lines))
    return EXIT_OK


def _fetch_name(args: argparse.Namespace, out: Out) -> int:
    """``fetch URL --name NAME[@G]``: :func:`packcache.fleet.names.fetch_name`, no checkpoint needed."""
    from ..fleet.names import fetch_name, local_path, parse_name

    if args.model is not None or args.cache is not None:
        raise UsageError("--name fetches a published name: give it without --model and --cache (--cache-dir says "
                         "where its file goes)")  # fmt: skip
    try:  # before anything is loaded or asked
        # pinned by tests/test_fleet_names.py::test_cli_publish_and_fetch_refuse_a_bad_name_with_exit_2
        model, pinned = parse_name(args.name)
        local_path(model, pinned, cache_dir=args.cache_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report = fetch_name(args.url, args.name, cache_dir=args.cache_dir, trusted_keys=args.trusted_key,
                        allow_unsigned=args.allow_unsigned, timeout=args.timeout, total_timeout=args.deadline,
                        scheme=args.scheme, group_size=args.group_size)  # fmt: skip
    state = "offline" if not report.reached else "fetched" if report.downloaded else "up to date"
    lines = [
        f"{state:<14}{sanitize(report.path)}",
        f"from          {sanitize(report.url)}: {report.name}, class {report.platform_class}, "
        f"generation {report.generation}" + (f", signed by {report.signed_by}" if report.signed_by else "")
        + ("" if report.signed_by or not report.reached else ", unsigned"),
        f"scheme        {report.scheme}" + (f" (group size {report.group_size})" if report.scheme == "int4" else ""),
        *([f"store         not reached ({sanitize(report.store_error or '')}): the file accepted before is used"]
          if not report.reached else []),
        f"read          {mib(report.bytes)} in {report.seconds:.2f} s",
    ]  # fmt: skip
    out.emit(report.to_json(), "\n".join(lines))
    return EXIT_OK


def add_store_parsers(sub: Any) -> None:
    """``publish`` and ``fetch``."""
    publish = sub.add_parser(
        "publish",
        help="publish a cache file to a store: verified, its sources hashed again, uploaded by content, named by a "
        "signed manifest",
        description="Verify FILE, hash every source its packs name again (found under --model, where this user last "
        "hashed it, or in the Hugging Face hub cache), upload it create-only to URL/blobs/sha256/<hex>.pcache and "
        "write URL/manifests/<model>/<class>.json with a conditional put (docs/FLEET.md). An object already at the "
        "blob's address is read back whole and hashed (one read of the blob); a damaged one is replaced by a "
        "conditional PUT (If-Match), which the bucket policy must allow for blobs/. Exit 1 with remote_conflict "
        "when another publisher won the race for the manifest: run it again.",
    )
    publish.add_argument("file", help="the cache file (built by build, run or serve)")
    publish.add_argument(
        "--name", metavar="NAME",
        help="publish under this name (org/model-int8: [A-Za-z0-9._-] segments, single '/' between) instead of the "
        "file's name; every generation also keeps an immutable copy, fetched with --name NAME@G",
    )  # fmt: skip
    publish.add_argument(
        "url", type=store_url, help="the store: s3://bucket/prefix, gs://..., az://..., file:///dir or a directory"
    )
    publish.add_argument(
        "--sign", action="append", default=[], metavar="KEY.pem",
        help="sign the manifest with this ed25519 private key, a 0600 file of this user or root (repeatable: every "
        "key given signs; during a key rotation give the old and the new key, so machines trusting either accept it)",
    )  # fmt: skip
    publish.add_argument(
        "--model", action="append", default=[], metavar="DIR",
        help="where the checkpoint the file was built from lies (repeatable)",
    )  # fmt: skip
    publish.add_argument(
        "--builder", type=builder_text,
        help="free text recorded in the manifest, at most 256 printable characters (default: packcache <version>)",
    )  # fmt: skip
    publish.add_argument(
        "--expires-days", type=days, default=MANIFEST_EXPIRY / 86400,
        help="days until the manifest expires (over 0, at most 3660; 0: never; default 30)",
    )  # fmt: skip
    publish.add_argument(
        "--timeout", type=seconds, default=PUBLISH_TIMEOUT,
        help="seconds the upload may spend waiting on the store (default 600; hashing and signing do not count)",
    )  # fmt: skip
    publish.add_argument("--json", action="store_true", help="print one JSON object")
    publish.set_defaults(func=cmd_publish)

    fetch = sub.add_parser(
        "fetch",
        help="fetch the published cache file of a checkpoint from a store, checked (an init container's step)",
        description="Read URL's manifest for the checkpoint's cache file and this machine's platform class, check "
        "its signature, expiry and generation, download the blob beside the local file while hashing it, verify "
        "it and rename it into place. Exit 1 with the miss reason when the store cannot give it (docs/FLEET.md): "
        "remote_absent is nothing published; a missing bucket, container or store directory is remote_error (a "
        "plain http(s):// store cannot tell a wrong prefix from nothing published).",
    )
    fetch.add_argument(
        "url", type=store_url, help="the store: s3://bucket/prefix, gs://..., az://..., file:///dir or a directory"
    )
    fetch.add_argument(
        "--model", help="the checkpoint directory, or a hub id in the local hub cache (the cache file is named by its "
        "content)",
    )  # fmt: skip
    fetch.add_argument("--cache", help="the local cache file (its name is the model's: as published)")
    fetch.add_argument(
        "--name", metavar="NAME[@G]",
        help="fetch a published name (publish --name), no checkpoint needed, into --cache-dir/<NAME with / as "
        "-->.pcache (NAME@G: that generation, into ...@G.pcache); prints the local path",
    )  # fmt: skip
    fetch.add_argument("--cache-dir", help="directory of the default cache file ($PACKCACHE_DIR, $XDG_CACHE_HOME)")
    fetch.add_argument(
        "--loader", choices=LOADERS, default=FETCH_LOADER,
        help="whose cache file: minilm (run/serve --model) or hf (packcache.hf). Default auto, build's rule: minilm "
        "where it reads the checkpoint, the auto class is AutoModel and serve runs it on MiniLM, else hf; when "
        "nothing is published under that file's name, the other loader's (the output says which)",
    )  # fmt: skip
    fetch.add_argument(
        "--auto-class",
        help="the transformers auto class the file was built with (build --auto-class): it names the hf file "
        "(default: build's, AutoModelForCausalLM for a causal LM, else AutoModel)",
    )  # fmt: skip
    fetch.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default=SCHEME,
        help="weight scheme (default auto; with --name, auto looks under auto's scheme first, then int8, int4, bf16, "
        "fp32: the first class published under the name is taken)",
    )  # fmt: skip
    fetch.add_argument("--group-size", type=int, default=GROUP_SIZE, choices=GROUP_SIZES, help="int4 group size")
    add_trust_options(fetch)
    # pinned by tests/test_fleet_deadline.py::test_the_init_recipe_ends_fast_against_a_silent_store
    fetch.add_argument(
        "--timeout", type=seconds, default=REMOTE_TIMEOUT, metavar="S",
        help=f"seconds the store may go without answering: the manifest and header reads, connecting, a stalled "
        f"download (default {REMOTE_TIMEOUT:g}: a store that accepts and never answers ends the fetch that fast)",
    )  # fmt: skip
    fetch.add_argument(
        "--deadline", type=seconds, default=FETCH_DEADLINE, metavar="S",
        help=f"seconds the fetch may spend waiting on the store, the download included (default {FETCH_DEADLINE:g}; "
        "hashing, verifying and writing the file do not count; a download that keeps making progress runs until then)",
    )  # fmt: skip
    fetch.add_argument("--json", action="store_true", help="print one JSON object")
    fetch.set_defaults(func=cmd_fetch)


def add_parsers(sub: Any) -> None:
    """``platform``, ``keygen`` and ``probe``."""
    plat = sub.add_parser(
        "platform",
        help="this machine's platform class for a scheme: the id a fleet store files caches under, and its fields",
        description="Print the platform class id, then the fields it is derived from (packer ids, versions, params "
        "and behavioural fingerprints, torch version, CPU capability, format version). Machines with one class "
        "map each other's cache files; no path, host, user, rank or environment variable enters it.",
    )
    plat.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default=SCHEME,
        help="weight scheme (default auto: as run/build choose it on this CPU)",
    )  # fmt: skip
    plat.add_argument("--group-size", type=int, default=GROUP_SIZE, choices=GROUP_SIZES, help="int4 group size")
    plat.add_argument("--json", action="store_true", help='print {"class": ..., "fields": {...}}')
    plat.set_defaults(func=cmd_platform)

    key = sub.add_parser(
        "keygen",
        help="make an ed25519 key pair for signing published manifests: KEY.pem (private, 0600) and KEY.pub.pem",
        description="Write a new ed25519 private key to KEY.pem (unencrypted PKCS#8 PEM, mode 0600) and its public "
        "key to KEY.pub.pem (SubjectPublicKeyInfo PEM, 0644); never overwrites either. Prints the key id "
        "signatures name. Needs the fleet extra.",
    )
    key.add_argument("key", metavar="KEY.pem")
    key.add_argument("--json", action="store_true")
    key.set_defaults(func=cmd_keygen)

    probe = sub.add_parser(
        "probe",
        help="say from a cache file's header and index whether this machine can map it (exit 0 only if compatible)",
        description="Read FILE's header and index (never its packs) and give a verdict: compatible (exit 0), "
        "compatible_suboptimal (3), incompatible (4, naming every differing platform field), not_applicable (5: "
        "not a packcache file, or another model), unverified (6: a manifest no trusted key signed), refused (7: a "
        "manifest fetch refuses, with fetch's reason: the checks fetch makes, by the same function); 1 when FILE "
        "cannot be read. A manifest's blob is checked by size, header and index, not by sha256 (that reads it "
        "whole; fetch does). This machine's platform is that of the file's own scheme, read from its packers, "
        "unless --scheme is given.",
    )
    probe.add_argument(
        "file", metavar="FILE_OR_URL",
        help="a cache file, or a manifest's or a blob's URL in a store; a plain path to a manifest (.json) or to "
        "anything under manifests/ or blobs/ is read in its directory store, as publish and fetch read a plain path",
    )  # fmt: skip
    add_trust_options(probe, unsigned=False)  # an unsigned manifest is probed all the same: 'unverified'
    probe.add_argument("--timeout", type=seconds, default=PROBE_TIMEOUT, help="seconds for a URL's reads (default 30)")
    probe.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default=None,
        help="compare with this scheme's platform (default: the scheme of the file's packers)",
    )  # fmt: skip
    probe.add_argument(
        "--group-size", type=int, default=None, choices=GROUP_SIZES,
        help="int4 group size (default: the file's)",
    )  # fmt: skip
    probe.add_argument(
        "--expected-model", metavar="NAME", help="the model wanted: a file of another (its name without .pcache) "
        "is not_applicable",
    )  # fmt: skip
    probe.add_argument("--json", action="store_true")
    probe.set_defaults(func=cmd_probe)
