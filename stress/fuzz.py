"""Hostile-file fuzzer: mutated and synthesised cache files, opened for real.

Method. Hypothesis draws a file, either

* a *mutation* of a real cache file (built by packcache: two generations, five
  dtypes, a 0-d and a zero-size pack, a non-ASCII name, alignments 64 and 4096,
  or a header-only file): bit flips, byte writes, typed writes of interesting
  values (0, 2^31, 2^32-1, 2^63, 2^64-1, the file size, ...) into the preamble,
  slot, index-head and entry fields, truncation, extension, a slot copied over
  the other; then, each independently, the index, slot and preamble/fingerprint
  checksums are re-sealed or not, so mutations reach the deep rules; or
* a *synthesis* from fields: alignment, data start, fingerprint, 0-5 entries
  with arbitrary names (text or raw bytes), dtype codes (valid and not), dims,
  sizes, offsets, key bytes and digests, index head, one or two slots with any
  generation, and a file length that may cut anything off.

Each file is written as a real file and then

1. decoded with the pure ``packcache.format`` functions (the "Reading a file"
   procedure of docs/FORMAT.md): the only allowed failure is ``FormatError``;
2. checked with ``packcache.verify``: returns a report, never raises;
3. opened with ``packcache.WeightCache`` in-process, one session requesting up
   to four names (present, absent, synthesised): the only allowed outcomes are
   a valid open (hits served from the file, misses appended; when the appended
   file's superseded bytes then outweigh its live ones, the build must compact it,
   counted as ``build_compactions``) or a rebuild (a new file renamed over the
   path). Every served array is checked to lie inside
   its mapping (the base chain ends in an mmap, and ``[ctypes.data, +nbytes)``
   lies within the map's address range) and, on a valid open, to hold exactly
   the file's bytes at the offset the pure decoder gives for it; a heap pack, a
   disagreement between the cache and the pure decoder, any other exception or
   a case running over ``--case-seconds`` (a hang) fails the run.

4. handed to the maintenance entry points, which may only raise the library's
   ``FormatError``/``UntrustedFileError``/``OSError``: ``packcache.inspect`` and
   ``packcache inspect`` (text and ``--json``, exit 0 or 1, never a traceback), and
   ``packcache.compact`` of a copy of the file, which must reject exactly the files
   the pure decoders reject (fingerprint aside) and otherwise leave a file that
   verifies, with every kept pack's bytes unchanged.

A second target draws *safetensors* files: a valid header and data, then
hostile JSON spliced in (nesting thousands deep, integers of 40 to 5,000 digits,
dtypes and shapes of the wrong JSON type, NaN, duplicate names), offsets that
overlap or leave the file, a header length past the file, raw byte edits of the
header, truncation. ``SafetensorsFile`` may only raise ``FormatError`` (with an
offset), and a header it accepts must read back every tensor's exact bytes.

A crash (segfault, SIGBUS) kills the process: no summary line, non-zero exit.

Prints ``fuzz: cases=... valid_opens=... format_errors=... rebuilds=...
other_exceptions=0 views_outside=0 ... inspected=... compacted=... compact_rejected=...
safetensors_cases=... safetensors_valid=... safetensors_rejected=... seconds=...``
(``format_errors``: files the pure decoders rejected; ``valid_opens``/``rebuilds``:
what WeightCache did; ``other_exceptions`` counts every exception outside the
allowed ones, in every target) and exits 1 on any violation, after printing the
first few.

Usage: python stress/fuzz.py [--cases 100000] [--safetensors-cases 100000] [--quick] [--seed N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from hypothesis.configuration import set_hypothesis_home_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness

from harness.fuzz import fuzz


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--safetensors-cases", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="2,000 cases of each target")
    parser.add_argument("--seed", type=int, default=None, help="reproducible run")
    parser.add_argument("--case-seconds", type=float, default=10.0, help="time bound of one case (a hang)")
    args = parser.parse_args(argv)
    set_hypothesis_home_dir(tempfile.mkdtemp(prefix="packcache-hypothesis-"))
    started = time.monotonic()
    counts = fuzz(
        2000 if args.quick else args.cases,
        case_seconds=args.case_seconds,
        seed_value=args.seed,
        safetensors_cases=2000 if args.quick else args.safetensors_cases,
    )
    for failure in counts.failures[:20]:
        print(f"FAIL {failure}")
    print(counts.summary(time.monotonic() - started))
    return 0 if counts.ok else 1


if __name__ == "__main__":
    sys.exit(main())
