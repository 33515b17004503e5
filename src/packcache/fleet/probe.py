"""A graded verdict on a cache file from its header and index alone, before anyone uses it.

:func:`probe_bytes` reads the first 4096 bytes (preamble, platform fingerprint, commit slots)
and then the committed index, through a ``read(start, end)`` callable (a ``pread`` for a local
file, a range read for a published blob), never a pack's bytes, and says what a
:class:`~packcache.WeightCache` given ``expected_platform`` would do with the file:

=========================  ========================================================================
``compatible``             a committed generation under this machine's platform class: a cache opened
                           with that platform maps its packs without packing any again (exit 0).
``compatible_suboptimal``  it would map them, but: superseded bytes (``packcache compact`` reclaims
                           them), a newer generation that is unusable (the older one is served), a
                           generation with no pack, or, for a local file, a file WeightCache does not
                           trust in place (owner, mode, a symlink in an unsafe directory) (exit 3).
``incompatible``           another platform class: every differing field is named, the file's value
                           first (``cpu_capability: AVX2 -> AVX512``); a cache would rebuild it (exit 4).
``not_applicable``         not a packcache file (bad magic, a short or damaged header, no committed
                           generation, an unusable index), or a file of another model (exit 5).
``unverified``             a published file whose manifest no trusted key signed (exit 6); see
                           :func:`downgrade_unverified`.
``refused``                a manifest fetch refuses (exit 7): malformed, changed after signing,
                           expired, of another model or class than its key, a rollback, another
                           size or platform class than its blob (:func:`probe_url`).
=========================  ========================================================================

The verdict is the cache's own rule (``packcache._store.FileStore``: same fingerprint bytes, a
header and a generation that validate), applied to the same decoders of :mod:`packcache.format`;
``tests/test_fleet_probe.py`` checks it against real WeightCache loads. Torch-free: the caller
says what this machine's fingerprint is (the command line derives it from the file's packers).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _defaults
from .. import format as fmt
from .._paths import open_for_reading
from .._storeurl import StoreURL, split_object_url
from ..errors import FormatError, RemoteError, UntrustedFileError
from .platform import Difference, differences, platform_class

__all__ = ["EXIT_CODES", "ProbeReport", "Verdict", "downgrade_unverified", "probe_bytes", "probe_file", "probe_url"]


class Verdict(str, enum.Enum):
    """What a probe found, best first (module docstring: what each means and its exit code)."""

    COMPATIBLE = "compatible"
    COMPATIBLE_SUBOPTIMAL = "compatible_suboptimal"
    INCOMPATIBLE = "incompatible"
    NOT_APPLICABLE = "not_applicable"
    UNVERIFIED = "unverified"
    REFUSED = "refused"

    def __str__(self) -> str:
        return self.value


#: ``packcache probe``'s exit code for each verdict (1: an error reading, 2: usage).
EXIT_CODES = {
    Verdict.COMPATIBLE: 0,
    Verdict.COMPATIBLE_SUBOPTIMAL: 3,
    Verdict.INCOMPATIBLE: 4,
    Verdict.NOT_APPLICABLE: 5,
    Verdict.UNVERIFIED: 6,
    Verdict.REFUSED: 7,
}


@dataclass(frozen=True)
class ProbeReport:
    """A probe's verdict and what it rests on.

    ``reasons``: sentences, the verdict's first. ``differences``: for ``incompatible``, every
    differing platform field as ``{"field", "file", "here"}``. ``platform_class`` is the file's
    (``None`` when its header could not be read), ``platform_class_here`` this machine's.
    ``bytes_read``: what the probe read (header and index). ``entries``, ``live_bytes``,
    ``superseded_bytes`` and ``generation`` describe the committed generation (for an incompatible
    file, whose index is not read, ``generation`` and ``entries`` are what its newest valid slot says).
    For a manifest URL, ``manifest_generation`` is the manifest's generation (what fetch records), and
    ``remote_reason`` the remote miss reason a fetch on this machine would refuse it with (``None``: fetch
    takes it, as far as a manifest, a size, a header and an index show; see :func:`probe_url`).
    """

    verdict: Verdict
    reasons: list[str]
    differences: list[dict[str, Any]] = field(default_factory=list)
    platform_class: str | None = None
    platform_class_here: str | None = None
    bytes_read: int = 0
    entries: int = 0
    live_bytes: int = 0
    superseded_bytes: int = 0
    generation: int = 0
    model: str | None = None
    source: str | None = None
    file_bytes: int | None = None
    signer: str | None = None  #: id of the trusted key that signed the manifest (URLs), if any
    manifest_generation: int | None = None
    remote_reason: str | None = None

    @property
    def exit_code(self) -> int:
        """``packcache probe``'s exit code for this verdict (:data:`EXIT_CODES`)."""
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``packcache probe --json`` prints)."""
        data = dataclasses.asdict(self)
        data["verdict"] = self.verdict.value
        data["exit_code"] = self.exit_code
        return data

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)


def downgrade_unverified(report: ProbeReport, reason: str) -> ProbeReport:
    """``report`` for a published file whose manifest is unsigned or signed by no trusted key.

    A ``compatible`` or ``compatible_suboptimal`` verdict becomes ``unverified`` (``reason`` first,
    the others kept): the bytes may fit, but nothing says who made them. A worse verdict stays, with
    ``reason`` added: the file would not be used anyway, and the operator learns why first.

    >>> r = downgrade_unverified(ProbeReport(Verdict.COMPATIBLE, ["fits"]), "the manifest is unsigned")
    >>> r.verdict.value, r.reasons
    ('unverified', ['the manifest is unsigned', 'fits'])
    """
    if report.verdict in (Verdict.COMPATIBLE, Verdict.COMPATIBLE_SUBOPTIMAL):
        return dataclasses.replace(report, verdict=Verdict.UNVERIFIED, reasons=[reason, *report.reasons])
    return dataclasses.replace(report, reasons=[*report.reasons, reason])


# --------------------------------------------------------------------------- probing


class _Counted:
    """``read`` with the bytes it returned counted, and a short read made visible."""

    def __init__(self, read: Callable[[int, int], bytes]) -> None:
        self.read, self.total = read, 0

    def __call__(self, start: int, end: int) -> bytes:
        data = bytes(self.read(start, end))
        if len(data) > end - start:
            raise FormatError(f"the reader returned {len(data)} bytes for a {end - start}-byte range", offset=start)
        self.total += len(data)
        return data


def probe_bytes(
    read: Callable[[int, int], bytes],
    *,
    expected_platform: bytes | Callable[[bytes], bytes],
    model: str | None = None,
    expected_model: str | None = None,
    size: int | None = None,
    source: str | None = None,
    max_index_bytes: int = fmt.MAX_INDEX_BYTES,
) -> ProbeReport:
    """The verdict on the cache file ``read`` returns bytes of (module docstring for the verdicts).

    Args:
        read: ``read(start, end)`` returns the file's bytes ``[start, end)``, fewer where the file ends;
            it may raise ``OSError`` (a :class:`~packcache.errors.RemoteError` for a store), which
            propagates.
        expected_platform: this machine's platform fingerprint (the canonical bytes a
            :class:`~packcache.WeightCache` would be given), or a function from the file's fingerprint
            to it (to derive the scheme from the file's own packers).
        model: the file's model name (its name without ``.pcache``, or its manifest's ``model``).
        expected_model: the model wanted; another ``model`` is ``not_applicable`` with nothing read.
        size: the file's size, when known (a local ``fstat``, a store's ``head``): bounds the index
            before it is read and counts an uncommitted tail as superseded bytes.
        source: the path or URL, for the report.
        max_index_bytes: the largest index read (the format's cap by default; lower it for a slow store).

    Raises:
        OSError: ``read`` failed (not a short read: that is a truncated file, ``not_applicable``).
    """
    start = ProbeReport(Verdict.NOT_APPLICABLE, [], model=model, source=source, file_bytes=size)
    if expected_model is not None and model is not None and model != expected_model:
        return dataclasses.replace(start, reasons=[f"the file is of model {model!r}, not of {expected_model!r}"])
    counted = _Counted(read)

    def done(verdict: Verdict, reasons: list[str], **figures: Any) -> ProbeReport:
        return dataclasses.replace(start, verdict=verdict, reasons=reasons, bytes_read=counted.total, **figures)

    head = counted(0, fmt.HEADER_READ_SIZE)
    header, problem, wrong_version = _header(head, source)
    if header is None:
        if wrong_version is None:
            return done(Verdict.NOT_APPLICABLE, [f"not a packcache file: {problem}"])
        here = platform_class(expected_platform) if isinstance(expected_platform, bytes) else None
        why = f"the file is of format version {wrong_version}, this packcache reads {fmt.FORMAT_VERSION}: it is rebuilt"
        found = [Difference("format_version", wrong_version, fmt.FORMAT_VERSION).to_dict()]
        return done(Verdict.INCOMPATIBLE, [why], differences=found, platform_class_here=here)
    expected = expected_platform if isinstance(expected_platform, bytes) else expected_platform(header.platform)
    file_class = platform_class(header.platform, format_version=header.format_version)
    here_class = platform_class(expected)
    classes = {"platform_class": file_class, "platform_class_here": here_class}
    slots, written = fmt.choose_slot(head)
    if header.platform != expected:
        differing = _differences(header.platform, expected, header.format_version)
        newest = slots[0] if slots else None
        why = (
            f"the file is of platform class {file_class}, this machine's is {here_class}: a cache rebuilds it; "
            f"it differs in {', '.join(d.field for d in differing)}"
        )
        return done(
            Verdict.INCOMPATIBLE, [why, *(str(d) for d in differing)], differences=[d.to_dict() for d in differing],
            generation=newest.generation if newest else 0, entries=newest.entry_count if newest else 0, **classes,
        )  # fmt: skip
    if not slots:
        why = "no commit slot is valid (damaged)" if written else "it was never committed: it holds no pack"
        return done(Verdict.NOT_APPLICABLE, [why], **classes)
    reasons: list[str] = []
    used: fmt.Slot | None = None
    entries: dict[str, fmt.Entry] = {}
    first_error: FormatError | None = None
    for slot in slots:
        try:
            entries = _read_index(counted, slot, header, size, max_index_bytes, source)
        except FormatError as exc:
            first_error = first_error or exc
            continue
        used = slot
        break
    if used is None:
        return done(Verdict.NOT_APPLICABLE, [f"no generation is usable: {first_error}"], **classes)
    if used is not slots[0]:
        reasons.append(
            f"generation {slots[0].generation} is unusable ({first_error}); readers use generation {used.generation}"
        )
    live = sum(e.nbytes for e in entries.values())
    end = size if size is not None else used.committed_end
    superseded = max(0, end - fmt.compacted_size(entries.values(), header, used.index_size))
    if superseded:
        reasons.append(f"{superseded} superseded bytes: packcache compact would reclaim them")
    if not entries:
        reasons.append(f"generation {used.generation} holds no pack: every pack would be computed")
    verdict = Verdict.COMPATIBLE_SUBOPTIMAL if reasons else Verdict.COMPATIBLE
    first = f"platform class {here_class}, generation {used.generation}: {len(entries)} packs, {live} bytes"
    return done(
        verdict, [first, *reasons], entries=len(entries), live_bytes=live, superseded_bytes=superseded,
        generation=used.generation, **classes,
    )  # fmt: skip


def _header(head: bytes, source: str | None) -> tuple[fmt.Header | None, str | None, int | None]:
    """``(header, None, None)``, or ``(None, why not, None)``, or ``(None, None, version)`` for a sound
    preamble of another format version (a packcache file this packcache cannot read: incompatible)."""
    if len(head) < fmt.HEADER_READ_SIZE:
        return None, f"{len(head)} bytes, shorter than the {fmt.HEADER_READ_SIZE}-byte header", None
    if head[:8] != fmt.MAGIC:
        return None, "bad magic", None
    version = struct.unpack_from("<I", head, 8)[0]
    (crc,) = struct.unpack_from("<I", head, 60)
    if version != fmt.FORMAT_VERSION and fmt.crc32(head[:60]) == crc:
        return None, None, int(version)
    try:
        return fmt.decode_header(head, path=source), None, None
    except FormatError as exc:
        return None, str(exc), None


def _differences(file_platform: bytes, here: bytes, version: int) -> list[Difference]:
    try:
        return differences(file_platform, here, file_format_version=version)
    except FormatError as exc:  # a fingerprint no packcache writes: name it whole
        return [Difference("platform", f"<{len(file_platform)} bytes that are not a JSON object: {exc}>",
                           here.decode("ascii", "replace"))]  # fmt: skip


def _read_index(
    read: _Counted, slot: fmt.Slot, header: fmt.Header, size: int | None, cap: int, source: str | None
) -> dict[str, fmt.Entry]:
    # Bounds first (with the size when known), so a hostile index size never becomes a read.
    # pinned by tests/test_fleet_probe.py::test_hostile_files_are_not_applicable_in_one_process_that_never_blocks
    fmt.validate_slot_bounds(slot, header, size if size is not None else slot.committed_end, path=source)
    if slot.index_size > cap:
        raise FormatError(f"generation {slot.generation}: index of {slot.index_size} bytes, past the probe's "
                          f"{cap}-byte cap", path=source)  # fmt: skip
    buf = read(slot.index_offset, slot.committed_end)
    if len(buf) < slot.index_size:
        raise FormatError(
            f"generation {slot.generation}: the file ends at byte {slot.index_offset + len(buf)}, inside its "
            f"index (truncated?)", path=source,
        )  # fmt: skip
    return fmt.decode_index(buf, slot, header, path=source)


def probe_file(
    path: str | os.PathLike[str],
    *,
    expected_platform: bytes | Callable[[bytes], bytes],
    expected_model: str | None = None,
) -> ProbeReport:
    """:func:`probe_bytes` of a local file, opened as ``packcache inspect`` opens it: without blocking
    (a FIFO, socket, device or directory is ``not_applicable``, never waited on), without following a
    symlink swapped in, read with ``pread``. Its model is its name without ``.pcache``. A file
    :class:`~packcache.WeightCache` would not trust in place (another user's, group- or world-writable,
    a symlink in an unsafe directory) is at best ``compatible_suboptimal``, saying why.

    Raises:
        OSError: it cannot be opened or read (``FileNotFoundError``, ``PermissionError``, EIO).
    """
    name = os.fspath(path)
    base = os.path.basename(name)
    model = base[: -len(".pcache")] if base.endswith(".pcache") else base
    try:
        fd, st, untrusted = open_for_reading(name)
    except UntrustedFileError as exc:  # a FIFO, socket, device or directory: refused without blocking
        return ProbeReport(Verdict.NOT_APPLICABLE, [f"not a packcache file: {exc.reason}"], model=model, source=name)
    try:

        def pread(start: int, end: int) -> bytes:
            chunks, at = [], start
            while at < end:  # pread may return less than asked before the end of the file
                chunk = os.pread(fd, end - at, at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
            return b"".join(chunks)

        report = probe_bytes(
            pread, expected_platform=expected_platform, model=model, expected_model=expected_model,
            size=st.st_size, source=name,
        )  # fmt: skip
    finally:
        os.close(fd)
    if untrusted and report.verdict in (Verdict.COMPATIBLE, Verdict.COMPATIBLE_SUBOPTIMAL):
        why = f"WeightCache does not trust this file in place ({untrusted}): fix its owner or mode, or copy it"
        return dataclasses.replace(report, verdict=Verdict.COMPATIBLE_SUBOPTIMAL, reasons=[*report.reasons, why])
    return report


# --------------------------------------------------------------------------- published files


def probe_url(
    url: str | StoreURL,
    *,
    expected_platform: bytes | Callable[[bytes], bytes],
    trusted_keys: Sequence[bytes] = (),
    expected_model: str | None = None,
    timeout: float = _defaults.PROBE_TIMEOUT,
) -> ProbeReport:
    """The verdict on a published file, by range reads: ``url`` is a manifest's
    (``<store>/manifests/<model>/<class>.json``, where a published name's model has segments, or a generation's
    immutable copy ``.../<class>@<G>.json``) or a blob's (``<store>/blobs/sha256/<hex>.pcache``, or any object).

    A manifest is checked by :func:`packcache.fleet.manifest.check_manifest`, the function fetch checks
    it with, against the same trusted keys and the generation this user last accepted from the store:
    a manifest fetch refuses is ``refused`` (``remote_reason`` says why, as fetch would), one no trusted
    key signed ``unverified``. Then its blob: another size than the manifest's, or a header of another
    platform class than the manifest's, is ``refused``; else the blob is probed (:func:`probe_bytes`).
    Its sha256 is not checked (that reads the whole blob): a damaged blob of the right size, header and
    index is refused by fetch (``remote_corrupt``) and not here. ``timeout``: the seconds the reads may take together
    (waiting on the store only: parsing and checking signatures do not count).

    Raises:
        RemoteError: the store failed, or holds no object at the key (``remote_absent``).
    """
    from .fetch import last_accepted
    from .manifest import MAX_ENVELOPE_BYTES, check_manifest, manifest_key
    from .stores import StoreClock, check_key, open_store, parse_store_url

    location = parse_store_url(url)
    # The key is cut from the URL's path; the store is the URL without it (its query, which may carry a
    # token, stays with the store's URL); only the redacted form is shown.
    # pinned by tests/test_fleet_redaction.py::test_no_command_line_output_shows_a_store_secret
    root, key = split_object_url(location, ("/manifests/", "/blobs/"))
    url = location.display.rstrip("/")
    check_key(key)
    # The reads' time together, not the parsing and signature checks between them: a busy machine does not make
    # a store look slow (docs/FLEET.md, "Deadlines").
    clock = StoreClock(timeout, timeout, what="the probe", url=url)
    with open_store(root, timeout=timeout) as store:

        def read(blob: str) -> Callable[[int, int], bytes]:
            return lambda start, end: clock.call(lambda d: store.get_range(blob, start, end, deadline=d))

        if not key.endswith(".json"):
            size = clock.call(lambda d: store.head(key, deadline=d)).size
            return probe_bytes(read(key), expected_platform=expected_platform, expected_model=expected_model,
                               size=size, source=url)  # fmt: skip
        parts = key.split("/")
        pinned: int | None = None
        try:
            if len(parts) < 3 or parts[0] != "manifests":
                raise ValueError(f"{key!r} is not a manifest's key (manifests/<model>/<class>.json)")
            # a published name has segments; a generation's immutable copy is <class>@<G>.json
            # pinned by tests/test_fleet_names.py::test_probe_of_a_name_and_of_a_pinned_generation
            model, (cls, at, number) = "/".join(parts[1:-1]), parts[-1][: -len(".json")].partition("@")
            if at:
                if not number.isdigit() or number.startswith("0"):
                    raise ValueError(f"{key!r}: the generation after '@' is no positive integer")
                pinned = int(number)
            manifest_key(model, cls, pinned)
        except ValueError as exc:
            return ProbeReport(Verdict.NOT_APPLICABLE, [f"fetch never reads it: {exc}"], source=url)
        data, _ = clock.call(lambda d: store.get(key, deadline=d, max_bytes=MAX_ENVELOPE_BYTES))
        accepted = clock.call(lambda d: last_accepted(store, model, cls, deadline=d))

        # pinned by tests/test_fleet_probe.py::
        #   test_probe_refuses_exactly_the_manifests_fetch_refuses_and_names_the_same_reason
        unverified: RemoteError | None = None  # fetch's first refusal when no trusted key signed it

        def refused(exc: RemoteError, **figures: Any) -> ProbeReport:
            first = unverified or exc
            then = [f"and with unsigned manifests allowed: {exc}"] * (str(exc) != str(first))
            return ProbeReport(Verdict.REFUSED, [f"fetch refuses it: {first}", *then], model=model, source=url,
                               remote_reason=first.reason, **figures)  # fmt: skip

        try:
            manifest, signer = check_manifest(data, model=model, platform_class=cls, trusted_keys=trusted_keys,
                                              allow_unsigned=False, accepted=accepted, url=url,
                                              pinned=pinned)  # fmt: skip
        except RemoteError as exc:
            if exc.reason != "remote_untrusted":
                return refused(exc)
            unverified = exc
            try:  # what else fetch would refuse, were unsigned manifests allowed (a tampered one: again)
                manifest, signer = check_manifest(data, model=model, platform_class=cls, trusted_keys=trusted_keys,
                                                  allow_unsigned=True, accepted=accepted, url=url,
                                                  pinned=pinned)  # fmt: skip
            except RemoteError as again:
                return refused(again)
        figures: dict[str, Any] = {"manifest_generation": manifest.generation, "signer": signer}
        blob = manifest.blob_key
        size = clock.call(lambda d: store.head(blob, deadline=d)).size
        if size != manifest.size:
            why = f"its blob holds {size} bytes, the manifest says {manifest.size}"
            return refused(RemoteError("remote_corrupt", why, url=f"{store.url}/{blob}"), **figures)
        report = probe_bytes(read(blob), expected_platform=expected_platform, model=manifest.model,
                             expected_model=expected_model, size=size, source=url)  # fmt: skip
        report = dataclasses.replace(report, **figures)
        if report.platform_class is not None and report.platform_class != manifest.platform_class:
            why = (
                f"its blob's header is of platform class {report.platform_class}, "
                f"the manifest's {manifest.platform_class}"
            )
            return dataclasses.replace(refused(RemoteError("remote_incompatible", why, url=f"{store.url}/{blob}")),
                                       **figures, **_figures_of(report))  # fmt: skip
        blob_reason = {Verdict.INCOMPATIBLE: "remote_incompatible", Verdict.NOT_APPLICABLE: "remote_corrupt"}
        reason = unverified.reason if unverified is not None else blob_reason.get(report.verdict)
        if expected_model is not None and manifest.model != expected_model:
            reason = None  # not a refusal: another model than the one asked about
        report = dataclasses.replace(report, remote_reason=reason)
    return downgrade_unverified(report, str(unverified)) if unverified is not None else report


def _figures_of(report: ProbeReport) -> dict[str, Any]:
    """What a probe of the blob found besides its verdict and reasons."""
    kept = ("differences", "platform_class", "platform_class_here", "bytes_read", "entries", "live_bytes",
            "superseded_bytes", "generation", "file_bytes")  # fmt: skip
    return {name: getattr(report, name) for name in kept}
