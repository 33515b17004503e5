"""``packcache inspect``, ``verify``, ``compact`` and ``gc``: looking after the cache files on this machine.

The policy lives in :mod:`packcache.maintenance`; these only format its reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from .._defaults import LOCK_TIMEOUT
from ..maintenance import compact, gc, inspect, verify
from ._common import EXIT_FAILED, EXIT_OK, Out, sanitize

__all__ = ["add_parsers"]


def cmd_inspect(args: argparse.Namespace, out: Out) -> int:
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


def cmd_verify(args: argparse.Namespace, out: Out) -> int:
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


def cmd_compact(args: argparse.Namespace, out: Out) -> int:
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


def cmd_gc(args: argparse.Namespace, out: Out) -> int:
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


def add_parsers(sub: Any) -> None:
    """``inspect``, ``verify``, ``compact`` and ``gc``."""
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
    com.add_argument("--lock-timeout", type=float, default=LOCK_TIMEOUT, help="seconds to wait for the build lock")
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
